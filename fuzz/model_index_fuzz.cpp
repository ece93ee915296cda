// libFuzzer target for diffusers pipeline folders' model_index.json (dew/interop/model_index.cpp: what `dew sample
// --pipeline DIR` and `dew eval --pipeline DIR` read before any component loads). The input is the file, written
// into a scratch folder that is then read as every pipeline class dew loads, and each component those pipelines
// name is looked up. Any input must be refused with a dew::Error or give the class the file names and, for every
// component, the class its [library, class] entry holds ("" for null); the quick class test (is this folder a
// flow pipeline?) must agree and never throw. A crash, a sanitizer report or another exception is a bug.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "dew/core/error.h"
#include "dew/interop/model_index.h"
#include "fuzz/fuzz_util.h"

namespace {

using dew::json;
namespace detail = dew::interop::detail;

const std::filesystem::path& scratch_dir() {
  static const auto dir = dew_fuzz::make_scratch_dir("model-index");
  return dir;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::filesystem::path file = scratch_dir() / "model_index.json";
  dew_fuzz::write_file(file, std::string_view(reinterpret_cast<const char*>(data), size));
  const std::string dir = scratch_dir().string();
  const std::string quick = detail::model_index_class(dir);
  std::string class_name;
  json index;
  try {
    index = detail::read_model_index(
        dir, {"StableDiffusionPipeline", "StableDiffusion3Pipeline", "FluxPipeline", "QwenImage21Pipeline"},
        class_name);
  } catch (const dew::Error&) {
    return 0;  // refused, named
  }
  FUZZ_REQUIRE(index.is_object() && index["_class_name"] == class_name);
  FUZZ_REQUIRE(quick == class_name);
  for (const char* name : {"unet", "transformer", "vae", "scheduler", "text_encoder", "text_encoder_2",
                           "text_encoder_3", "tokenizer", "tokenizer_2", "tokenizer_3", "safety_checker"}) {
    try {
      const std::string c = detail::index_component(index, name, file);
      const json& e = index[name];
      FUZZ_REQUIRE(c.empty() ? (e.is_null() || e[1].is_null() || e[1] == "") : e[1] == c);
      FUZZ_REQUIRE(detail::expect_component(index, name, {c}, file) == c);
      try {
        detail::expect_component(index, name, {c + "x"}, file);
        FUZZ_REQUIRE(!"a class outside the accepted list was accepted");
      } catch (const dew::Error&) {}
    } catch (const dew::Error&) {}
  }
  return 0;
}

// libFuzzer target for sharded checkpoints' index files (dew/io/weights.cpp: WeightSource::open on
// NAME.safetensors.index.json, what every folder loader reads): the input is written as
// model.safetensors.index.json in a scratch folder that also holds two small shards (a.safetensors: "x" [2, 3]
// float32 and "z" [1] int64; b.safetensors: "y" [4] bfloat16), a subfolder shard and, one level up, a shard
// outside the folder. Any input must either be refused with a dew::Error or give a source whose every name is a
// tensor of a shard inside the folder, readable, with its header's shape; a crash, a sanitizer report, a read
// outside the folder's shards or a huge allocation is a bug.
#include <ATen/ATen.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string>

#include "dew/core/error.h"
#include "dew/io/safetensors.h"
#include "dew/io/weights.h"
#include "fuzz/fuzz_util.h"

namespace fs = std::filesystem;

namespace {

// One folder per fuzzing process (libFuzzer's -jobs run several); the shards are written once.
const fs::path& scratch_dir() {
  static const fs::path dir = [] {
    const fs::path root = dew_fuzz::make_scratch_dir("shard-index");
    fs::create_directories(root / "model" / "sub");
    dew::io::save_safetensors((root / "model" / "a.safetensors").string(),
                              {{"x", at::arange(6, at::kFloat).view({2, 3})}, {"z", at::full({1}, 7, at::kLong)}});
    dew::io::save_safetensors((root / "model" / "b.safetensors").string(), {{"y", at::ones({4}, at::kBFloat16)}});
    dew::io::save_safetensors((root / "model" / "sub" / "c.safetensors").string(), {{"w", at::zeros({2})}});
    dew::io::save_safetensors((root / "outside.safetensors").string(), {{"secret", at::zeros({3})}});
    return root / "model";
  }();
  return dir;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const fs::path index = scratch_dir() / "model.safetensors.index.json";
  dew_fuzz::write_file(index, std::string_view(reinterpret_cast<const char*>(data), size));
  static const std::set<std::string> inside = {"x", "y", "z", "w"};
  try {
    const auto source = dew::io::WeightSource::open(index.string());
    for (const auto& name : source.names()) {
      FUZZ_REQUIRE(inside.count(name) == 1);  // never a tensor of a file outside the folder
      const at::Tensor t = source.tensor(name);
      FUZZ_REQUIRE(t.sizes().vec() == source.shape(name) && t.scalar_type() == source.dtype(name));
      (void)t.to(at::kDouble).sum().item<double>();
      source.release(name);
    }
  } catch (const dew::Error&) {}
  return 0;
}

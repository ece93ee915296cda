// `dew forward DIR --inputs IN.safetensors --out OUT.safetensors`: one diffusers model folder run on named
// tensors, for checking a conversion against Python (dew/interop/diffusers_forward.h holds the library part).
#include <iostream>

#include "dew/cli/commands.h"
#include "dew/cli/recipe.h"
#include "dew/core/device.h"
#include "dew/interop/diffusers_forward.h"
#include "dew/io/safetensors.h"

namespace dew::cli {

namespace {

std::string forward_usage() {
  return "usage: dew forward DIR --inputs IN.safetensors --out OUT.safetensors [--class NAME] [--method NAME]\n"
         "                   [--dtype float32|float64] [--device D]\n"
         "\n"
         "Loads one diffusers model folder (config.json + diffusion_pytorch_model.safetensors or model.safetensors,\n"
         "single or sharded, fp32/fp16/bf16) as the dew family of its _class_name (transformers' text encoders:\n"
         "architectures[0]; or --class), runs a method\n"
         "(--method; the first listed by default) on the tensors of IN named as the diffusers arguments and writes\n"
         "the results to OUT:\n" +
         interop::diffusers_usage() +
         "Tiled methods use tiles of the config's sample_size, as diffusers' enable_tiling(). --dtype float64 runs\n"
         "the whole model in float64. A missing or extra input is an error naming it.\n";
}

}  // namespace

int cmd_forward(const std::vector<std::string>& args) {
  for (const auto& a : args)
    if (a == "--help" || a == "-h") {
      std::cout << forward_usage();
      return 0;
    }
  auto f = parse_flags(args, {"inputs", "out", "class", "method", "dtype", "device"});
  DEW_CHECK(f.positional.size() == 1, "forward: expected one model folder DIR, got ", f.positional.size(),
            " arguments (dew forward --help)");
  DEW_CHECK(f.has("inputs") && f.has("out"), "forward: --inputs IN.safetensors and --out OUT.safetensors are required");
  const std::string dtype = f.get("dtype", "float32");
  DEW_CHECK(dtype == "float32" || dtype == "float64", "--dtype: got \"", dtype, "\", accepted: float32, float64");
  interop::DiffusersLoadOptions o;
  o.class_name = f.get("class", "");
  o.dtype = dtype == "float64" ? at::kDouble : at::kFloat;
  o.device = parse_device(f.get("device", "cpu"));
  const auto inputs = io::load_safetensors(f.get("inputs", ""));
  const auto model = interop::load_diffusers_folder(f.positional[0], o);
  const auto outputs = interop::diffusers_forward(model, inputs, f.get("method", ""));
  io::save_safetensors(f.get("out", ""), outputs, {{"format", "pt"}});
  std::string names;
  for (const auto& kv : outputs) names += (names.empty() ? "" : ", ") + kv.first;
  std::cout << model.class_name << " (" << model.family << ", " << dtype << "): " << model.report.summary()
            << "; wrote " << names << " to " << f.get("out", "") << "\n";
  return 0;
}

}  // namespace dew::cli

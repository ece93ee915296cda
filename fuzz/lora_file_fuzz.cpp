// libFuzzer target for the LoRA adapter files dew reads (dew/nn/lora.cpp; `dew sample PIPELINE --lora FILE[:SCALE]`
// reads a diffusers or kohya file per component through lora_file_has and load_lora_file, `dew generate RUN --lora
// DIR` a PEFT folder through load_peft_adapter): the input up to its first NUL byte is the folder's
// adapter_config.json, the rest its adapter_model.safetensors: the file's bytes, or, when the rest starts with '{',
// the file's header JSON, a NUL byte and its data, written with the header's length in front (so that the fuzzer's
// edits of names, shapes and dtypes in the header keep a readable file; the header itself is the safetensors
// target's). A tiny
// model whose Linear and Conv2d layers are named as in a diffusers UNet (down_blocks.0.attentions.0.
// transformer_blocks.0.attn1.to_q, conv_in, a depthwise and a dilated conv), a FLUX transformer
// (transformer_blocks.0.attn.to_q, single_transformer_blocks.0.proj_mlp, norm_out.linear), a causal LM
// (model.layers.0.self_attn.q_proj, lm_head) and a CLIP text encoder (text_model.encoder.layers.0...) is built once;
// each input goes through load_peft_adapter on the folder, then lora_file_has, load_lora_file (kohya or diffusers,
// as the keys say), load_diffusers_lora ("unet", and "transformer" when the file has such keys) and
// load_kohya_lora on the file, the model reset after each load that succeeded (adapters removed, base trainable).
// Any input must either be refused with a dew::Error that leaves the model bit for bit as it was (no adapter
// attached, no weight written, nothing frozen: a refused file is never half applied), or load adapters that fit:
// the base parameters keep their names, shapes, dtypes and values (a load never merges) and are frozen, the only
// new parameters are float32 lora_A / lora_B weights of exactly the modules the load reports, each adapter's weight
// delta is shaped like its layer's weight (a PEFT folder's with the config's rank and scale), and a file that
// loaded has a key of the component. Another exception type, a crash, a sanitizer report or a huge allocation is a
// bug.
#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "dew/core/error.h"
#include "dew/nn/lora.h"
#include "fuzz/fuzz_util.h"
#include "fuzz/lora_file_model.h"

namespace fs = std::filesystem;
using dew_fuzz::lora::ModulePtr;
using dew_fuzz::lora::safetensors_file;
using dew_fuzz::lora::tiny_model;

namespace {

struct Param {
  at::Tensor value;  // a copy
  bool requires_grad;
};
struct State {
  std::vector<std::string> modules;
  std::map<std::string, Param> params;
};

State state_of(const torch::nn::Module& model) {
  State s;
  for (const auto& item : model.named_modules("", /*include_self=*/false)) s.modules.push_back(item.key());
  for (const auto& p : model.named_parameters(/*recurse=*/true))
    s.params[p.key()] = {p.value().detach().clone(), p.value().requires_grad()};
  return s;
}

// The model, built once (building it costs more than a load), and its state before any load.
torch::nn::Module& model() {
  static const ModulePtr m = tiny_model();
  return *m;
}
const State& initial() {
  static const State s = state_of(model());
  return s;
}

// Back to the initial state after a load that succeeded (one that was refused must have left it so): the
// adapters removed, the base trainable again. The base weights are checked to be unchanged by every load.
void reset() {
  for (const auto& item : model().named_modules("", /*include_self=*/false))
    if (dew::nn::lora_state(*item.value()))
      for (const char* child : {"lora_A", "lora_B", "lora"}) item.value()->unregister_module(child);
  for (auto& p : model().parameters()) p.requires_grad_(true);
}

bool same_bits(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  const at::Tensor ca = a.contiguous(), cb = b.contiguous();
  return std::memcmp(ca.data_ptr(), cb.data_ptr(), ca.nbytes()) == 0;
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), std::string::npos, suffix) == 0;
}

std::vector<std::string> module_names() {
  std::vector<std::string> out;
  for (const auto& item : model().named_modules("", /*include_self=*/false)) out.push_back(item.key());
  return out;
}

// A refused load left the model as it was: the same modules, parameters, values and requires_grad flags.
void require_untouched() {
  const State& before = initial();
  FUZZ_REQUIRE(module_names() == before.modules);  // no lora_A / lora_B / lora child left behind
  const auto params = model().named_parameters(/*recurse=*/true);
  FUZZ_REQUIRE(params.size() == before.params.size());
  for (const auto& [name, p] : before.params) {
    const at::Tensor* now = params.find(name);
    FUZZ_REQUIRE(now != nullptr);
    FUZZ_REQUIRE(same_bits(*now, p.value));                 // no weight written
    FUZZ_REQUIRE(now->requires_grad() == p.requires_grad);  // nothing frozen
  }
}

// A load that succeeded attached adapters that fit exactly the modules `targets` and changed nothing else.
void require_fitting_adapters(const std::vector<std::string>& targets) {
  FUZZ_REQUIRE(!targets.empty());
  const State& before = initial();
  const auto params = model().named_parameters(/*recurse=*/true);
  for (const auto& [name, p] : before.params) {
    const at::Tensor* now = params.find(name);
    FUZZ_REQUIRE(now != nullptr);
    FUZZ_REQUIRE(same_bits(*now, p.value));  // the same shape, dtype and values: a load never merges
    FUZZ_REQUIRE(!now->requires_grad());     // the base is frozen
  }
  const std::set<std::string> adapted(targets.begin(), targets.end());
  FUZZ_REQUIRE(adapted.size() == targets.size());
  for (const auto& p : params) {
    const std::string& name = p.key();
    if (before.params.count(name)) continue;
    const bool a = ends_with(name, ".lora_A.weight"), b = ends_with(name, ".lora_B.weight");
    FUZZ_REQUIRE(a || b);
    FUZZ_REQUIRE(adapted.count(name.substr(0, name.size() - std::strlen(".lora_A.weight"))) == 1);
    FUZZ_REQUIRE(p.value().scalar_type() == at::kFloat);  // the float32 base's adapters are float32
  }
  FUZZ_REQUIRE(params.size() == before.params.size() + 2 * targets.size());
  const auto modules = model().named_modules("", /*include_self=*/false);
  for (const auto& name : targets) {
    const ModulePtr* m = modules.find(name);
    FUZZ_REQUIRE(m != nullptr && before.params.count(name + ".weight") == 1);
    const dew::nn::LoraStateImpl* s = dew::nn::lora_state(**m);
    FUZZ_REQUIRE(s != nullptr && !s->merged && s->rank >= 1);
    FUZZ_REQUIRE(dew::nn::lora_delta_weight(**m).sizes() == before.params.at(name + ".weight").value.sizes());
  }
}

// Runs `load` on the model in its initial state and checks the outcome; returns whether it loaded.
bool check_load(const std::function<std::vector<std::string>(torch::nn::Module&)>& load) {
  std::vector<std::string> targets;
  try {
    targets = load(model());
  } catch (const dew::Error&) {
    require_untouched();
    return false;
  }
  require_fitting_adapters(targets);
  reset();
  return true;
}

// Whether the file has a key of the component; false when it is not a safetensors file.
bool has(const std::string& path, const std::string& diffusers_prefix, const std::string& kohya_prefix) {
  try {
    return dew::nn::lora_file_has(path, diffusers_prefix, kohya_prefix);
  } catch (const dew::Error&) {
    return false;
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const fs::path dir = dew_fuzz::make_scratch_dir("lora-file");
  (void)initial();
  const auto [config, tensors] = dew_fuzz::split_at_nul(data, size);
  dew_fuzz::write_file(dir / "adapter_config.json", config);
  dew_fuzz::write_file(dir / "adapter_model.safetensors", safetensors_file(tensors));
  const std::string folder = dir.string(), file = (dir / "adapter_model.safetensors").string();
  namespace nn = dew::nn;

  check_load([&](torch::nn::Module& m) {
    const nn::PeftAdapterConfig c = nn::load_peft_adapter(m, folder);
    std::vector<std::string> targets;
    const double scale = nn::lora_scale(c.lora);
    for (const auto& item : m.named_modules("", /*include_self=*/false))
      if (const nn::LoraStateImpl* s = nn::lora_state(*item.value())) {
        FUZZ_REQUIRE(s->rank == c.lora.rank() && s->scale == scale);  // the config's rank and scale
        targets.push_back(item.key());
      }
    return targets;
  });
  const bool unet = has(file, "unet", "lora_unet");
  (void)has(file, "text_encoder", "lora_te");
  FUZZ_REQUIRE(!check_load([&](torch::nn::Module& m) { return nn::load_lora_file(m, file, 0.5).targets; }) || unet);
  FUZZ_REQUIRE(!check_load([&](torch::nn::Module& m) { return nn::load_diffusers_lora(m, file).targets; }) || unet);
  FUZZ_REQUIRE(!check_load([&](torch::nn::Module& m) { return nn::load_kohya_lora(m, file).targets; }) || unet);
  if (has(file, "transformer", "lora_transformer"))
    check_load([&](torch::nn::Module& m) { return nn::load_diffusers_lora(m, file, "transformer").targets; });
  return 0;
}

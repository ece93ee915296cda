// LoRA adapters (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models") on the Linear and
// Conv2d layers of any module tree, with PEFT's semantics (peft 0.21 tuners/lora): targets chosen by module
// name, scale alpha / r (rsLoRA: alpha / sqrt(r)), dropout on the adapter's input, A Kaiming-uniform
// (a = sqrt(5)) and B zero, merge and unmerge, the base frozen.
//
// Design: PEFT replaces each targeted nn.Linear by a wrapper module. In LibTorch that would not route
// anything: the families hold typed `torch::nn::Linear` / `Conv2d` holders and call them through the two
// project-wide functions `nn::dense(x, layer)` (attention.h) and `nn::conv(x, layer)` (blocks.h), and
// LinearImpl::forward is not virtual. So the adapter is attached *to the targeted layer itself*, as three
// extra children of its LinearImpl / Conv2dImpl:
//   lora_A  Linear(in, r, bias=false)            | Conv2d(in, r, base kernel/stride/padding, bias=false)
//   lora_B  Linear(r, out, bias=false)           | Conv2d(r, out, 1x1, bias=false)
//   lora    LoraState: scale, dropout, merged flag (no parameters or buffers)
// and dense / conv add  scale * B(A(dropout(x)))  when the layer carries one (`lora_delta`). Consequences:
//  - the base parameters keep their names ("...q_proj.weight"), so base checkpoints load unchanged;
//  - the adapter parameters are "...q_proj.lora_A.weight" / "...q_proj.lora_B.weight": PEFT's saved names
//    (adapter_model.safetensors, after its "base_model.model." prefix and with the adapter name "default"
//    removed). PEFT's in-memory names are "...q_proj.base_layer.weight" and "...q_proj.lora_A.default.weight";
//  - every call site that uses dense / conv gets the adapter with no change to the family code. A layer
//    called through `layer->forward(x)` instead is not routed; apply_lora refuses nothing for that, so the
//    families call dense / conv (all Linear and Conv2d in unet_2d_condition, causal_transformer,
//    diffusers_blocks and blocks do).
//  - Module::clone() of a tree with adapters attached is not supported (Cloneable's reset() would not
//    recreate the children); nothing in dew clones modules.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>

#include <map>
#include <string>
#include <vector>

#include "dew/core/options.h"

namespace dew::nn {

using torch::Tensor;

/// Options of LoRA adapters (PEFT's LoraConfig fields of the same meaning).
/// Example: LoraOptions().rank(4).alpha(8).target_modules({"q_proj", "v_proj"})
struct LoraOptions {
#define DEW_LORA_FIELDS(F, C)                                                                                   \
  F(int64_t, rank, 8, "adapter rank r (PEFT's r), 1 .. min(in, out) of each targeted layer")                    \
  F(double, alpha, 8.0, "lora_alpha: the adapter output is scaled by alpha / rank (alpha / sqrt(rank) rsLoRA)") \
  F(double, dropout, 0.0, "dropout probability on the adapter's input while training (lora_dropout)")           \
  F(bool, use_rslora, false, "rank-stabilised scale alpha / sqrt(rank) instead of alpha / rank")                \
  F(std::vector<std::string>, target_modules, {},                                                               \
    "module names: a module matches when its full name equals an entry or ends with '.' + entry")               \
  F(std::string, target_regex, "", "if set (instead of target_modules): a full regex match of the module name")
  DEW_OPTIONS(DEW_LORA_FIELDS)
#undef DEW_LORA_FIELDS
};

/// alpha / rank, or alpha / sqrt(rank) with use_rslora.
double lora_scale(const LoraOptions& o);

/// PEFT's check_target_module_exists: regex set -> std::regex_match(name, regex) (Python's re.fullmatch);
/// else name == entry or name ends with "." + entry for some entry of target_modules.
bool lora_target_matches(const LoraOptions& o, const std::string& name);

/// The adapter's state, a parameterless child "lora" of the adapted layer.
class LoraStateImpl : public torch::nn::Module {
 public:
  LoraStateImpl(int64_t rank, double alpha, double scale, double dropout)
      : rank(rank), alpha(alpha), scale(scale), dropout(dropout) {}
  int64_t rank;
  double alpha;
  double scale;    // applied to B(A(x))
  double dropout;  // probability, on the adapter input while training
  bool merged = false;
  bool enabled = true;  // false: the adapter is skipped (its weights stay)
  // The registered lora_A / lora_B siblings, held here for the forward (one pair is set).
  torch::nn::Linear linear_A{nullptr}, linear_B{nullptr};
  torch::nn::Conv2d conv_A{nullptr}, conv_B{nullptr};
};
TORCH_MODULE(LoraState);

/// Attaches an adapter to one layer (registers lora_A, lora_B, lora; initialises A Kaiming-uniform with
/// a = sqrt(5) and B zeros from the default generator; adapter parameters on the base weight's device, in
/// its dtype, or in float32 when the base is bfloat16 / half, so a reduced-precision frozen base trains
/// float32 adapters). `name` is used in messages. Refuses rank <= 0, rank > min(in, out), a layer that already
/// holds an adapter and Conv2d with groups > 1 or dilation > 1.
void attach_lora(torch::nn::Linear& layer, const LoraOptions& o, const std::string& name = "layer");
void attach_lora(torch::nn::Conv2d& layer, const LoraOptions& o, const std::string& name = "layer");

/// The layer's adapter state, or nullptr when it holds none.
LoraStateImpl* lora_state(const torch::nn::Module& layer);

/// scale * B(A(dropout(x))) in x's dtype, or an undefined tensor when the layer holds no active (enabled,
/// unmerged) adapter. x: [..., in] -> [..., out] (Linear), [B, in, H, W] -> [B, out, H', W'] (Conv2d).
/// Called by nn::dense and nn::conv; cheap (one flag) while no adapter exists in the process.
Tensor lora_delta(const Tensor& x, const torch::nn::LinearImpl& layer);
Tensor lora_delta(const Tensor& x, const torch::nn::Conv2dImpl& layer);

/// What apply_lora did.
struct LoraReport {
  std::vector<std::string> targets;  // adapted module names, in module order
  int64_t trainable = 0;             // adapter parameter count
  int64_t frozen = 0;                // base parameter count (requires_grad set false)
};

/// Attaches adapters to every Linear / Conv2d of `model` whose name (as named_modules gives it, no
/// prefix) matches, then freezes every parameter that is not an adapter's (PEFT's bias="none"), so an
/// optimizer over the parameters that require grad holds only the adapters. A pattern matching no
/// adapted-kind module fails naming the nearest module names; a name matching a module of another kind
/// fails naming its kind.
LoraReport apply_lora(torch::nn::Module& model, const LoraOptions& o);

/// Adds scale * B @ A (Conv2d: contracted over r per kernel position) into each adapted base weight
/// (no-op for merged layers); the forward then skips the adapter. unmerge subtracts it again.
void merge_lora(torch::nn::Module& model);
void unmerge_lora(torch::nn::Module& model);

/// The weight delta scale * B @ A of one adapted layer (float32, or float64 for float64 adapters), shaped
/// like the base weight.
Tensor lora_delta_weight(const torch::nn::Module& layer);

/// The same from an adapter pair as tensors (a checkpoint's, a file's): Linear A [r, in], B [out, r] ->
/// [out, in]; Conv2d A [r, in, kh, kw], B [out, r, 1, 1] -> [out, in, kh, kw]. At least float32.
Tensor lora_delta_weight(const Tensor& a, const Tensor& b, double scale);

/// Merges every adapter into its base weight and removes it (lora_A, lora_B and lora unregistered), so the
/// model is plain again with the adapters in its weights: an adapter file applied at load, after which
/// another file may adapt the same layers. The base parameters stay frozen.
void fold_lora(torch::nn::Module& model);

/// The adapter parameters, name -> tensor: "<module>.lora_A.weight", "<module>.lora_B.weight".
std::vector<std::pair<std::string, Tensor>> lora_parameters(const torch::nn::Module& model);

// ---- files users exchange ----
// Adapter tensors are stored under the adapted layer's module name: PEFT's adapter folder prefixes
// "base_model.model.", diffusers' pytorch_lora_weights.safetensors prefixes the component ("unet.").

/// LoRA options of PEFT's adapter_config.json (r, lora_alpha, lora_dropout, use_rslora, target_modules as
/// a list or a regex string) plus base_model_name_or_path. Settings dew does not implement (use_dora,
/// lora_bias, fan_in_fan_out, rank_pattern / alpha_pattern, layers_to_transform, exclude_modules,
/// modules_to_save, target_parameters, peft_type other than LORA) are refused by name.
struct PeftAdapterConfig {
  LoraOptions lora;
  std::string base_model_name_or_path;  // "" when the file has null
};
PeftAdapterConfig read_peft_adapter_config(const std::string& dir);

/// Writes DIR/adapter_config.json and DIR/adapter_model.safetensors (keys
/// "base_model.model.<module>.lora_A.weight" / ".lora_B.weight", as PeftModel.save_pretrained) for the
/// adapters of `model` made with options `o`. Merged adapters are written as they are (A and B).
void save_peft_adapter(const std::string& dir, const torch::nn::Module& model, const LoraOptions& o,
                       const std::string& base_model_name_or_path = "");
/// The same from adapter tensors by parameter name ("<module>.lora_A.weight"; a LoRA run's checkpoint).
void save_peft_adapter(const std::string& dir, const std::map<std::string, Tensor>& adapters, const LoraOptions& o,
                       const std::string& base_model_name_or_path = "");

/// Applies the folder's adapters to `model` (apply_lora with its config, so the base is frozen) and loads
/// their weights. A file tensor for a module the config did not adapt, an adapted module the file lacks
/// and a shape that does not fit are each a dew::Error naming the key (and both shapes).
PeftAdapterConfig load_peft_adapter(torch::nn::Module& model, const std::string& dir);

/// Writes a diffusers LoRA file (pytorch_lora_weights.safetensors as save_lora_weights writes it for a
/// UNet): keys "<prefix>.<module>.lora_A.weight" / ".lora_B.weight" and the LoraConfig fields (r,
/// lora_alpha, use_rslora, lora_dropout, target_modules) as JSON in the metadata "lora_adapter_metadata",
/// each field prefixed ("unet.lora_alpha"), which diffusers' load_lora_weights reads back as the
/// adapter's LoraConfig (checked with diffusers 0.42.1: scale and weights arrive as written).
void save_diffusers_lora(const std::string& path, const torch::nn::Module& model, const LoraOptions& o,
                         const std::string& prefix = "unet");
/// The same from adapter tensors by parameter name ("<module>.lora_A.weight"; a LoRA run's checkpoint).
void save_diffusers_lora(const std::string& path, const std::map<std::string, Tensor>& adapters, const LoraOptions& o,
                         const std::string& prefix = "unet");

/// Reads a diffusers LoRA file onto `model`: keys "<prefix>.<module>.lora_A.weight" / ".lora_B.weight"
/// (or the older "lora.down.weight" / "lora.up.weight"); rank from A's shape; alpha (and use_rslora) from
/// the metadata "lora_adapter_metadata" ("<prefix>.lora_alpha"), else a "<prefix>.<module>.alpha" tensor,
/// else alpha = rank (scale 1, what diffusers assumes without either). Adapters are attached to exactly the named modules; the base is
/// frozen. Keys of other components (e.g. "text_encoder.") are ignored; a file with no key for `prefix`,
/// a module name not in `model` and a shape that does not fit are each a dew::Error naming the key.
LoraReport load_diffusers_lora(torch::nn::Module& model, const std::string& path, const std::string& prefix = "unet");

/// Writes the kohya / sd-scripts layout that stable-diffusion.cpp, ComfyUI and A1111 load:
/// "<prefix>_<module with '.' -> '_'>.lora_down.weight" (A), ".lora_up.weight" (B) and ".alpha" (a
/// float32 scalar, scale * rank, so kohya's alpha / rank is this adapter's scale, rsLoRA included). The
/// module names are the model's own (diffusers' for unet_2d_condition, as diffusers'
/// convert_state_dict_to_kohya writes them).
void save_kohya_lora(const std::string& path, const torch::nn::Module& model, const std::string& prefix = "lora_unet");

/// Reads that layout onto `model`, resolving each flattened name against the model's Linear / Conv2d
/// names flattened the same way (a name that resolves to none is refused with the nearest ones); alpha
/// from ".alpha" (any dtype), else the rank. Keys of other components (lora_te_...) are ignored. A UNet's
/// files may also use the original (SGM / LDM) UNet's names kohya trains SDXL with (lora_unet_input_blocks_4_1_...,
/// ..._in_layers_2, lora_unet_middle_block_1_..., lora_unet_output_blocks_...): mapped to the diffusers
/// names by the model's block layout. A FLUX transformer's files may use FLUX.1's original names
/// (lora_unet_double_blocks_0_img_attn_qkv, ..._single_blocks_0_linear1, img_in, final_layer_...): a fused
/// module's adapter becomes one per part (the file's A, the part's rows of B; the final modulation's halves
/// swapped into diffusers' order), and a B whose rows do not add up to the parts' is refused.
LoraReport load_kohya_lora(torch::nn::Module& model, const std::string& path, const std::string& prefix = "lora_unet");

/// A LoRA file in kohya's layout (a key starting with "<kohya_prefix>_") or else diffusers' (keys
/// "<diffusers_prefix>.<module>..."), read onto `model` with each adapter's scale multiplied by `scale`
/// (`dew sample --lora FILE:SCALE`; 0 leaves the model's output as it was).
/// Whether the file at `path` holds a key of a component: "<diffusers_prefix>." or "<kohya_prefix>_"
/// ("text_encoder" / "lora_te" is not "text_encoder_2" / "lora_te2").
bool lora_file_has(const std::string& path, const std::string& diffusers_prefix, const std::string& kohya_prefix);

LoraReport load_lora_file(torch::nn::Module& model, const std::string& path, double scale = 1.0,
                          const std::string& diffusers_prefix = "unet", const std::string& kohya_prefix = "lora_unet");

}  // namespace dew::nn

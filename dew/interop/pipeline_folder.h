// Reading a diffusers pipeline folder's pieces, shared by the UNet pipelines (diffusers_pipeline.cpp) and the
// flow pipelines (flow_pipeline.cpp): model_index.json's components (model_index.h), a CLIP text tower with its
// tokenizer, and LoRA files merged into the denoiser.
#pragma once
#include <filesystem>
#include <string>
#include <vector>

#include <torch/nn/module.h>

#include "dew/core/options.h"
#include "dew/interop/model_index.h"
#include "dew/nn/clip_text.h"

namespace dew::interop::detail {

/// A transformers CLIP text tower folder and its tokenizer folder, in eval mode; `projection`: it must be a
/// CLIPTextModelWithProjection. `weights_dtype` bfloat16 / float16: built with its matrix weights in that dtype
/// (nn::build_weights_in), then loaded.
nn::ClipText load_clip_component(const std::filesystem::path& folder, const std::filesystem::path& tokenizer,
                                 bool projection, at::ScalarType weights_dtype = at::kFloat);
/// `dew sample --pipeline DIR --lora FILE[:SCALE]`: a LoRA file of the denoiser `model` (`component`: "unet" or
/// "transformer"), in diffusers' pytorch_lora_weights.safetensors layout ("<component>." keys) or kohya's
/// ("<kohya_prefix>_" keys; nn::load_lora_file), merged into its weights with each adapter's scale times `scale`
/// (nn::fold_lora), so several files add up. Refused once the weights are held in another dtype than float32.
/// Returns the number of layers adapted.
int64_t merge_lora_file(torch::nn::Module& model, at::ScalarType weights_dtype, const std::string& path, double scale,
                        const std::string& component, const std::string& kohya_prefix);

/// A LoRA merges into float32 weights: once they are held (or were built) in another dtype, a dew::Error naming
/// `path` and the dtype. Each add_lora checks it before reading the file.
void check_lora_weights_dtype(at::ScalarType weights_dtype, const std::string& path);

/// A pipeline component a LoRA file may adapt: its module, diffusers' key prefix and kohya's.
struct LoraPart {
  torch::nn::Module* module;
  std::string diffusers, kohya;
};
/// merge_lora_file for each part the file holds keys of (diffusers' load_lora_weights reads every component it
/// finds); a file with none of them is a dew::Error listing the prefixes accepted. Returns the layers adapted.
int64_t merge_lora_parts(const std::vector<LoraPart>& parts, at::ScalarType weights_dtype, const std::string& path,
                         double scale);

}  // namespace dew::interop::detail

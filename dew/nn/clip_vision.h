// The CLIP vision tower (transformers' CLIPVisionModel / CLIPVisionModelWithProjection parameter names), so the
// image side of a CLIP checkpoint loads as it is: what `dew eval --clip` scores images with
// (dew/metrics/clip_score.h).
//
//   auto v = dew::nn::ClipVision(dew::nn::clip_vision_options_from_hf(config).weights("clip/model.safetensors"));
//   auto out = v->forward(pixel_values);   // [B, 3, 224, 224] -> image_embeds [B, projection_dim]
//
// Architecture (transformers' CLIPVisionTransformer): a patch_size-strided convolution without bias, a learned
// class token prepended, learned position embeddings; pre_layrnorm; the pre-norm encoder layers of the text tower
// (ClipEncoderLayer, without a mask); the class token's final state through post_layernorm = pooler_output;
// visual_projection (no bias) = image_embeds.
#pragma once
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include <string>
#include <vector>

#include "dew/nn/clip_text.h"

namespace dew::nn {

/// Fields of the CLIP vision tower (names and defaults of transformers' CLIPVisionConfig,
/// openai/clip-vit-base-patch32).
struct ClipVisionOptions {
#define DEW_CLIP_VISION_FIELDS(F, C)                                                                               \
  F(int64_t, hidden_size, 768, "width D of the states")                                                            \
  F(int64_t, intermediate_size, 3072, "MLP hidden width")                                                          \
  F(int64_t, num_hidden_layers, 12, "transformer layers")                                                          \
  F(int64_t, num_attention_heads, 12, "attention heads (hidden_size divisible by it)")                             \
  F(int64_t, num_channels, 3, "input image channels")                                                              \
  F(int64_t, image_size, 224, "input height and width (image_size divisible by patch_size)")                       \
  F(int64_t, patch_size, 32, "patch height and width")                                                             \
  C(hidden_act, "quick_gelu", ({"quick_gelu", "gelu"}), "MLP activation: quick_gelu (x sigmoid(1.702 x)) or gelu") \
  F(double, layer_norm_eps, 1e-5, "LayerNorm epsilon")                                                             \
  F(int64_t, projection_dim, 0, "visual_projection width (image_embeds); 0 = none (CLIPVisionModel)")              \
  F(std::string, weights, "",                                                                                      \
    "safetensors file with CLIPVisionModel / CLIPModel names, loaded at build (\"\" = random init)")               \
  DEW_COMPUTE_FIELDS(F, C, "layer")
  DEW_OPTIONS(DEW_CLIP_VISION_FIELDS)
#undef DEW_CLIP_VISION_FIELDS
};

/// The CLIP vision tower. Parameters, exactly transformers' CLIPVisionModelWithProjection state dict:
///   vision_model.embeddings.class_embedding [D]
///   vision_model.embeddings.patch_embedding.weight [D, num_channels, patch_size, patch_size]
///   vision_model.embeddings.position_embedding.weight [(image_size / patch_size)^2 + 1, D]
///   vision_model.pre_layrnorm.{weight,bias} [D]   (sic: transformers' spelling)
///   vision_model.encoder.layers.N.* as ClipEncoderLayer
///   vision_model.post_layernorm.{weight,bias} [D]
///   visual_projection.weight [projection_dim, D] (projection_dim > 0 only)
class ClipVisionImpl : public torch::nn::Module {
 public:
  /// Builds, then loads `weights` when set (errors name the file and the offending tensors).
  explicit ClipVisionImpl(ClipVisionOptions options = {});
  void reset();
  /// transformers' init (CLIPPreTrainedModel._init_weights with initializer_factor 1).
  void reset_parameters();
  /// last_hidden_state [B, 1 + P, D], pooler_output [B, D] (post_layernorm of the class token), image_embeds
  /// [B, projection_dim] (undefined without a projection). Float32, or float64 for a float64 model.
  struct Outputs {
    at::Tensor last_hidden_state, pooler_output, image_embeds;
  };
  /// pixel_values: [B, num_channels, image_size, image_size] floating (CLIPImageProcessor's output).
  Outputs forward(const at::Tensor& pixel_values);

  ClipVisionOptions options;
  std::shared_ptr<torch::nn::Module> vision_model, embeddings, encoder;
  at::Tensor class_embedding;
  torch::nn::Conv2d patch_embedding{nullptr};
  torch::nn::Embedding position_embedding{nullptr};
  torch::nn::LayerNorm pre_layrnorm{nullptr}, post_layernorm{nullptr};
  torch::nn::ModuleList layers{nullptr};
  std::vector<ClipEncoderLayer> layer_list;  // typed view of `layers`
  torch::nn::Linear visual_projection{nullptr};

 private:
  at::ScalarType dtype_ = at::kFloat;
};
TORCH_MODULE(ClipVision);

/// The vision tower's options from a transformers config.json: a CLIPVisionConfig (model_type
/// "clip_vision_model"; architectures CLIPVisionModelWithProjection sets projection_dim) or a CLIPConfig (its
/// "vision_config", projection_dim from the top level). A CLIPConfig without vision_config, or an activation
/// other than quick_gelu / gelu, is refused by name.
ClipVisionOptions clip_vision_options_from_hf(const json& config);
/// The key map of CLIPVisionModel / CLIPVisionModelWithProjection / CLIPModel checkpoints onto ClipVision: a
/// CLIPModel's text tower, text_projection and logit_scale are skipped, and visual_projection too when the
/// model has none (`with_projection` false).
io::KeyMap clip_vision_key_map(bool with_projection);
/// Loads a safetensors file into `model` (io::load_weights with clip_vision_key_map: every parameter present
/// with its exact shape, nothing else left over).
void load_clip_vision_weights(ClipVisionImpl& model, const std::string& path);

}  // namespace dew::nn

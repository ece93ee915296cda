// The CLIP text encoder (`clip_text`) with Hugging Face CLIPTextModel parameter names, so the text towers of
// CLIP / Stable Diffusion checkpoints load as they are, tokenizing with CLIP's BPE (dew/data/clip_tokenizer.h).
//
//   auto clip = dew::nn::ClipText(dew::nn::ClipTextOptions().weights("clip/model.safetensors")
//                                     .tokenizer("clip/tokenizer.json"));
//   dew::TextEncoding e = clip->encode({"a photo of a cat"});   // context [1, 77, 512], pooled [1, 512]
//
// Architecture (transformers' CLIPTextTransformer): token + learned position embeddings; pre-norm layers
// x + out_proj(attn(layer_norm1(x))), x + fc2(act(fc1(layer_norm2(x)))) with causal attention and the
// padding mask; final_layer_norm. pooled = the final state at the first eos_token_id, or, when
// eos_token_id == 2 (the value in OpenAI's original configs), at argmax(ids), as transformers does.
#pragma once
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include <memory>
#include <string>
#include <vector>

#include "dew/data/clip_tokenizer.h"
#include "dew/io/weights.h"
#include "dew/nn/option_fields.h"
#include "dew/nn/text_encoder.h"

namespace dew::nn {

/// Fields of `clip_text` (names and defaults of transformers' CLIPTextConfig, openai/clip-vit-base-patch32).
struct ClipTextOptions {
  // The outputs stay float32 whatever dtype the layers compute in.
#define DEW_CLIP_TEXT_FIELDS(F, C)                                                                               \
  F(int64_t, vocab_size, 49408, "token ids are in [0, vocab_size)")                                              \
  F(int64_t, hidden_size, 512, "width D of the states, context and pooled vector")                               \
  F(int64_t, intermediate_size, 2048, "MLP hidden width")                                                        \
  F(int64_t, num_hidden_layers, 12, "transformer layers")                                                        \
  F(int64_t, num_attention_heads, 8, "attention heads (hidden_size divisible by it)")                            \
  F(int64_t, max_position_embeddings, 77, "longest sequence; tokenize() pads/truncates to it")                   \
  C(hidden_act, "quick_gelu", ({"quick_gelu", "gelu"}),                                                          \
    "MLP activation: quick_gelu (x sigmoid(1.702 x), OpenAI CLIP) or gelu (erf; OpenCLIP, SD 2 towers)")         \
  F(double, layer_norm_eps, 1e-5, "LayerNorm epsilon")                                                           \
  F(int64_t, bos_token_id, 49406, "HF config value (tokenize() uses the tokenizer's <|startoftext|>)")           \
  F(int64_t, eos_token_id, 49407, "pooled at the first eos_token_id; 2 = at argmax(ids) (OpenAI configs)")       \
  F(int64_t, pad_token_id, 1, "HF config value (tokenize() pads with the tokenizer's pad token)")                \
  F(int64_t, projection_dim, 0,                                                                                  \
    "text_projection width (CLIPTextModelWithProjection: pooled is then the projected text_embeds); 0 = none")   \
  F(std::string, weights, "", "safetensors file with CLIPTextModel names, loaded at build (\"\" = random init)") \
  F(std::string, tokenizer, "",                                                                                  \
    "CLIP tokenizer: tokenizer.json, vocab.json + merges.txt, or their folder (\"\" = tokenize() unavailable)")  \
  DEW_COMPUTE_FIELDS(F, C, "layer")
  DEW_OPTIONS(DEW_CLIP_TEXT_FIELDS)
#undef DEW_CLIP_TEXT_FIELDS
};

/// One CLIP encoder layer. Parameters (relative): self_attn.{q,k,v,out}_proj.{weight,bias},
/// layer_norm1.{weight,bias}, mlp.fc1.{weight,bias}, mlp.fc2.{weight,bias}, layer_norm2.{weight,bias}.
class ClipEncoderLayerImpl : public torch::nn::Module {
 public:
  ClipEncoderLayerImpl(const ClipTextOptions& o);
  /// x: [B, S, D] in the compute dtype; mask: bool [B, 1, S, S] (true = attend) -> [B, S, D]
  at::Tensor forward(const at::Tensor& x, const at::Tensor& mask);
  /// transformers' CLIPPreTrainedModel init of a layer in a tower of `num_layers` (text and vision alike).
  void reset_parameters(int64_t num_layers);

  torch::nn::Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, out_proj{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::LayerNorm layer_norm1{nullptr}, layer_norm2{nullptr};

 private:
  int64_t heads_;
  std::string act_, impl_;
};
TORCH_MODULE(ClipEncoderLayer);

/// The CLIP text encoder. Parameters, exactly transformers' CLIPTextModel state dict:
///   text_model.embeddings.token_embedding.weight [vocab_size, D]
///   text_model.embeddings.position_embedding.weight [max_position_embeddings, D]
///   text_model.encoder.layers.N.self_attn.{q,k,v,out}_proj.{weight [D, D], bias [D]}
///   text_model.encoder.layers.N.layer_norm1.{weight,bias}, ....layer_norm2.{weight,bias} [D]
///   text_model.encoder.layers.N.mlp.fc1.{weight [I, D], bias [I]}, ....mlp.fc2.{weight [D, I], bias [D]}
///   text_model.final_layer_norm.{weight,bias} [D]
///   text_projection.weight [projection_dim, D] (CLIPTextModelWithProjection only)
class ClipTextImpl : public TextEncoderImpl {
 public:
  /// Builds, then loads `weights` and the `tokenizer` when set (errors name the file and the problem).
  explicit ClipTextImpl(ClipTextOptions options = {});
  void reset();
  /// transformers' init: embeddings N(0, 0.02), attention and MLP weights N(0, D^-0.5 scaled), zero biases.
  void reset_parameters();
  /// Needs the `tokenizer` field: [bos, ..., eos, pad...] of length max_position_embeddings.
  std::pair<at::Tensor, at::Tensor> tokenize(const std::vector<std::string>& texts) const override;
  /// ids: [B, S] int64 in [0, vocab_size), S <= max_position_embeddings; mask: [B, S] bool (undefined =
  /// all real). context = last_hidden_state (float32, or float64 for a float64 model; not zeroed at padding),
  /// pooled as described above.
  TextEncoding forward(const at::Tensor& ids, const at::Tensor& mask) override;
  /// forward with the context taken `from_end` layers before the end: 0 = last_hidden_state (after the
  /// final LayerNorm), k >= 1 = transformers' hidden_states[-(k + 1)], the output of layer L - k without the
  /// final norm (SDXL's prompt embeddings are hidden_states[-2], k = 1). pooled is unchanged.
  TextEncoding forward_hidden(const at::Tensor& ids, const at::Tensor& mask, int64_t from_end);
  /// transformers' outputs of one forward: last_hidden_state [B, S, D], pooler_output [B, D] (the pooled
  /// state before text_projection), text_embeds [B, projection_dim] (CLIPTextModelWithProjection; undefined
  /// without a projection) and hidden_states[-2], the output of the last layer but one (undefined with fewer
  /// than 2 layers). Float32, or float64 for a float64 model.
  struct Outputs {
    at::Tensor last_hidden_state, pooler_output, text_embeds, penultimate_hidden_state;
  };
  Outputs forward_outputs(const at::Tensor& ids, const at::Tensor& mask);
  int64_t features() const override { return options.hidden_size(); }
  /// The tokenizer, or null when none is configured.
  const data::ClipTokenizer* clip_tokenizer() const { return tokenizer_.get(); }

  ClipTextOptions options;
  std::shared_ptr<torch::nn::Module> text_model, embeddings, encoder;
  torch::nn::Embedding token_embedding{nullptr}, position_embedding{nullptr};
  torch::nn::ModuleList layers{nullptr};
  std::vector<ClipEncoderLayer> layer_list;  // typed view of `layers`
  torch::nn::LayerNorm final_layer_norm{nullptr};
  torch::nn::Linear text_projection{nullptr};  // projection_dim > 0 only

 private:
  /// One forward: last_hidden_state, pooler_output, text_embeds, and in penultimate_hidden_state the output of
  /// layer L - from_end (from_end >= 1; undefined for 0). `mask_out` (optional) receives the mask used.
  Outputs run(const at::Tensor& ids, const at::Tensor& mask, int64_t from_end, at::Tensor* mask_out);

  at::ScalarType dtype_ = at::kFloat;
  std::shared_ptr<const data::ClipTokenizer> tokenizer_;
};
TORCH_MODULE(ClipText);

/// Loads a safetensors file into `model`: names are CLIPTextModel's ("text_model." prefix optional; a
/// whole CLIPModel file's text_model.* entries are taken and its vision tower ignored; the buffer
/// text_model.embeddings.position_ids of older files is skipped). Every parameter must be present with its
/// exact shape and no other tensor may be left over; floating dtypes are converted to the parameters'. Errors
/// name the file and the offending tensors. (io::load_weights with clip_text_key_map().)
void load_clip_text_weights(ClipTextImpl& model, const std::string& path);
/// ClipText's options from a transformers CLIPTextConfig config.json (model_type "clip_text_model"), or a
/// CLIPConfig's "text_config"; architectures CLIPTextModelWithProjection sets projection_dim; an activation
/// other than quick_gelu / gelu is refused by name. Keys without a ClipText counterpart (dropout rates, the
/// initializer, projection_dim of a plain text model) do not change the forward and are not read.
ClipTextOptions clip_text_options_from_hf(const json& config);

/// The key map of CLIPTextModel checkpoints onto ClipText; `whole_clip` (a CLIPModel file, with a vision
/// tower) also skips the vision tower, the projections and the logit scale.
io::KeyMap clip_text_key_map(bool whole_clip);
/// Whether a checkpoint is a whole CLIPModel (it holds a vision tower).
bool is_whole_clip(const io::WeightSource& source);
/// Writes the parameters under their CLIPTextModel names (float32) to `path`.
void save_clip_text_weights(const ClipTextImpl& model, const std::string& path);

}  // namespace dew::nn

// The T5 encoder (`t5_encoder`) with transformers' T5EncoderModel parameter names, so the text encoders of
// SD3 (text_encoder_3) and Flux (text_encoder_2) load as they are, tokenizing with SentencePiece
// (spiece.model through libsentencepiece, dew/data/tokenizer.h).
//
//   auto t5 = dew::nn::T5Encoder(dew::nn::T5EncoderOptions().weights("sd3/text_encoder_3")
//                                    .tokenizer("sd3/tokenizer_3").max_length(256));
//   dew::TextEncoding e = t5->encode({"a photo of a cat"});   // context [1, 256, 4096], pooled [1, 4096]
//
// Architecture (transformers 5.25's T5Stack, encoder side): token embedding (no position embedding); per
// block x + o(attn(layer_norm(x))) then x + DenseReluDense(layer_norm(x)); final_layer_norm. The layer norms
// are T5's RMS norm (no mean, no bias, the variance in float32). Attention has no 1/sqrt(d_kv) scaling; its
// scores get a learned bias per head over bucketed relative positions (bidirectional buckets: half for keys
// before, half after; exact up to num_buckets / 4, logarithmic up to relative_attention_max_distance), held by
// the first block only and shared by every block. Padded keys get the dtype's lowest value added (as
// transformers' sdpa path), so padding never changes the real tokens' states. Feed-forward: "relu" (T5 v1.0:
// wo(relu(wi x))) or "gated-gelu" (v1.1, flan-t5, SD3 / Flux's T5-XXL: wo(gelu_tanh(wi_0 x) * wi_1 x)).
// Under float16 compute each block's output is clamped to the finite range as transformers does.
#pragma once
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <memory>
#include <string>
#include <vector>

#include "dew/data/tokenizer.h"
#include "dew/io/weights.h"
#include "dew/nn/option_fields.h"
#include "dew/nn/text_encoder.h"

namespace dew::nn {

/// Fields of `t5_encoder` (names and defaults of transformers' T5Config, google-t5/t5-small).
/// Example: T5EncoderOptions().d_model(4096).d_ff(10240).num_layers(24).num_heads(64)
///              .feed_forward_proj("gated-gelu")   // T5-XXL v1.1 (SD3 / Flux)
struct T5EncoderOptions {
  // The outputs stay float32 whatever dtype the layers compute in.
#define DEW_T5_ENCODER_FIELDS(F, C)                                                                                \
  F(int64_t, vocab_size, 32128, "token ids are in [0, vocab_size) (32128 = 32000 pieces + 100 sentinels, padded)") \
  F(int64_t, d_model, 512, "width D of the states, context and pooled vector")                                     \
  F(int64_t, d_kv, 64, "width of one attention head (num_heads * d_kv need not equal d_model)")                    \
  F(int64_t, d_ff, 2048, "feed-forward hidden width")                                                              \
  F(int64_t, num_layers, 6, "encoder blocks")                                                                      \
  F(int64_t, num_heads, 8, "attention heads")                                                                      \
  F(int64_t, relative_attention_num_buckets, 32, "relative position buckets (half per direction)")                 \
  F(int64_t, relative_attention_max_distance, 128, "distance from which all positions share the last bucket")      \
  F(double, layer_norm_epsilon, 1e-6, "RMS norm epsilon")                                                          \
  C(feed_forward_proj, "relu", ({"relu", "gated-gelu", "gelu", "gated-relu", "silu", "gated-silu"}),               \
    "feed-forward: relu (T5 v1.0), gated-gelu (v1.1: tanh GELU gate), gelu / silu (erf GELU, SiLU), gated-ACT")    \
  F(int64_t, pad_token_id, 0, "padding id (tokenize() pads with it; T5's spiece.model has pad = 0)")               \
  F(int64_t, eos_token_id, 1, "</s>, appended by tokenize() (T5's spiece.model has eos = 1)")                      \
  F(int64_t, max_length, 512, "tokens per caption for tokenize() (SD3: 256 or 77, Flux: 512 dev / 256 schnell)")   \
  F(std::string, weights, "",                                                                                      \
    "T5EncoderModel checkpoint: model.safetensors, its shard index or their folder (\"\" = random init)")          \
  F(std::string, tokenizer, "",                                                                                    \
    "SentencePiece model: spiece.model / tokenizer.model or a folder holding one (\"\" = tokenize() unavailable)") \
  DEW_COMPUTE_FIELDS(F, C, "block")
  DEW_OPTIONS(DEW_T5_ENCODER_FIELDS)
#undef DEW_T5_ENCODER_FIELDS
};

/// T5's layer norm: weight * x / sqrt(mean(x^2) + eps) over the last axis, the mean of squares in float32
/// (as transformers, whatever the dtype; float64 included). Parameter: weight [D] (init 1).
class T5LayerNormImpl : public torch::nn::Module {
 public:
  T5LayerNormImpl(int64_t dim, double eps);
  /// x: [..., D] -> [..., D] in x's dtype (float32 or wider for float32 and float64 inputs).
  at::Tensor forward(const at::Tensor& x);

  at::Tensor weight;

 private:
  double eps_;
};
TORCH_MODULE(T5LayerNorm);

/// The bucket of each relative position (key - query), as transformers' T5Attention._relative_position_bucket
/// with bidirectional = true: [..] int64 -> [..] int64 in [0, num_buckets).
at::Tensor t5_relative_position_bucket(const at::Tensor& relative_position, int64_t num_buckets, int64_t max_distance);

/// One encoder block. Parameters (relative, transformers' names):
///   layer.0.SelfAttention.{q,k,v}.weight [H * d_kv, D], layer.0.SelfAttention.o.weight [D, H * d_kv]
///   layer.0.SelfAttention.relative_attention_bias.weight [num_buckets, H]  (the first block only)
///   layer.0.layer_norm.weight [D]
///   layer.1.DenseReluDense.wi.weight [d_ff, D] (not gated) or .wi_0.weight, .wi_1.weight [d_ff, D] (gated),
///   layer.1.DenseReluDense.wo.weight [D, d_ff], layer.1.layer_norm.weight [D]
class T5BlockImpl : public torch::nn::Module {
 public:
  T5BlockImpl(const T5EncoderOptions& o, bool has_relative_attention_bias);
  /// x: [B, L, D] in the compute dtype; bias: [B or 1, H, L, L] additive scores (position bias + padding) ->
  /// [B, L, D].
  at::Tensor forward(const at::Tensor& x, const at::Tensor& bias);

  torch::nn::Linear q{nullptr}, k{nullptr}, v{nullptr}, o{nullptr};
  torch::nn::Embedding relative_attention_bias{nullptr};  // first block only
  T5LayerNorm attention_norm{nullptr}, ff_norm{nullptr};  // layer.0.layer_norm, layer.1.layer_norm
  torch::nn::Linear wi{nullptr}, wi_0{nullptr}, wi_1{nullptr}, wo{nullptr};

 private:
  int64_t heads_, d_kv_;
  bool gated_;
  std::string act_, impl_;
};
TORCH_MODULE(T5Block);

/// The T5 encoder as a text encoder. Parameters, transformers' T5EncoderModel state dict less its tied copy:
///   shared.weight [vocab_size, D]   (encoder.embed_tokens.weight is the same tensor in transformers: the key
///                                    map reads either)
///   encoder.block.N.layer.{0,1}.* (T5BlockImpl)
///   encoder.final_layer_norm.weight [D]
class T5EncoderImpl : public TextEncoderImpl {
 public:
  /// Builds, then loads `weights` and the `tokenizer` when set (errors name the file and the problem).
  explicit T5EncoderImpl(T5EncoderOptions options = {});
  void reset();
  /// transformers' init (initializer_factor 1): shared N(0, 1), q N(0, (D d_kv)^-1/2), k, v N(0, D^-1/2),
  /// o N(0, (H d_kv)^-1/2), relative bias N(0, D^-1/2), wi* N(0, D^-1/2), wo N(0, d_ff^-1/2), norms 1.
  void reset_parameters();
  /// Needs the `tokenizer` field: SentencePiece pieces of each text, truncated to max_length - 1, then </s>,
  /// then pad_token_id up to max_length (transformers' T5 tokenizer with padding="max_length",
  /// truncation=True). mask = the pieces and </s>.
  std::pair<at::Tensor, at::Tensor> tokenize(const std::vector<std::string>& texts) const override;
  /// ids: [B, L] int64 in [0, vocab_size); mask: [B, L] bool (undefined = all real). context =
  /// last_hidden_state (float32, or float64 for a float64 model; not zeroed at padding, as transformers);
  /// pooled = the mean of last_hidden_state over the real tokens (T5 has no pooled output; zeros for a row
  /// without any).
  TextEncoding forward(const at::Tensor& ids, const at::Tensor& mask) override;
  /// transformers' T5EncoderModel(input_ids, attention_mask).last_hidden_state: [B, L, D].
  at::Tensor last_hidden_state(const at::Tensor& ids, const at::Tensor& mask);
  /// The position bias of the first block for L tokens: [1, H, L, L] in the parameters' dtype.
  at::Tensor position_bias(int64_t length);
  int64_t features() const override { return options.d_model(); }
  /// The tokenizer, or null when none is configured.
  const data::Tokenizer* sentencepiece() const { return tokenizer_.get(); }

  T5EncoderOptions options;
  torch::nn::Embedding shared{nullptr};
  std::shared_ptr<torch::nn::Module> encoder;
  torch::nn::ModuleList block{nullptr};
  std::vector<T5Block> block_list;  // typed view of `block`
  T5LayerNorm final_layer_norm{nullptr};

 private:
  at::ScalarType dtype_ = at::kFloat;
  data::TokenizerPtr tokenizer_;
};
TORCH_MODULE(T5Encoder);

/// T5Encoder's options from a transformers T5Config config.json (model_type "t5"; a whole T5 model's config
/// serves, its decoder keys unread). Refused by name: is_decoder true, a feed_forward_proj other than the
/// accepted ones, a model_type other than t5 (umt5 keeps a position bias in every block). Dropout, initializer
/// and decoder keys do not change the encoder's forward and are not read.
T5EncoderOptions t5_encoder_options_from_hf(const json& config);
/// The key map of T5EncoderModel checkpoints onto T5Encoder: encoder.embed_tokens.weight is skipped when the
/// checkpoint also holds shared.weight (the same tensor) and read as shared.weight otherwise; a whole T5 model's
/// decoder.* and lm_head.* are skipped.
io::KeyMap t5_encoder_key_map(bool has_shared);
/// Loads a checkpoint (file, shard index or folder) into `model` through t5_encoder_key_map(): every parameter
/// present with its exact shape; errors name the file and the tensors.
void load_t5_encoder_weights(T5EncoderImpl& model, const std::string& path);
/// The spiece.model a `tokenizer` field names: the file itself, or spiece.model / tokenizer.model inside a
/// folder; dew::Error naming the path and what was expected otherwise.
std::string t5_sentencepiece_path(const std::string& tokenizer);

}  // namespace dew::nn

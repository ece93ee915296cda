// Text encoders (docs/core.md, docs/backbones.md: text conditioning is a context [B, L, D_text] with a mask) and the
// `text_encoders` registry: a trainable byte-level encoder, the CLIP text encoder (dew/nn/clip_text.h) and the T5
// encoder (dew/nn/t5_encoder.h).
//
//   auto enc = dew::text_encoders::build("byte_text_encoder", {{"features", 128}});
//   dew::TextEncoding e = enc->encode({"a red square", ""});   // "" is the unconditional caption
//   model->forward(x, t, {labels, e.context, e.mask});         // e.context: [2, 64, 128] float32
//
// An encoder is a torch::nn::Module: trained with the backbone (byte_text_encoder) or loaded frozen
// (clip_text with weights). config() is the {architecture, fields} record that rebuilds it.
#pragma once
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include <string>
#include <utility>
#include <vector>

#include "dew/core/registry.h"
#include "dew/nn/attention.h"
#include "dew/nn/blocks.h"
#include "dew/nn/option_fields.h"

namespace dew {

/// The output of a text encoder: per-token features, which tokens are real, and a pooled vector.
struct TextEncoding {
  at::Tensor context;  // [B, L, features()] float32
  at::Tensor mask;     // [B, L] bool, true = real token
  at::Tensor pooled;   // [B, features()] float32
};

/// Base of text encoders: strings -> (ids, mask) -> TextEncoding.
class TextEncoderImpl : public torch::nn::Module {
 public:
  /// Token ids [B, L] int64 and mask [B, L] bool for a batch of strings (CPU tensors).
  virtual std::pair<at::Tensor, at::Tensor> tokenize(const std::vector<std::string>& texts) const = 0;
  /// ids, mask on the module's device -> encoding.
  virtual TextEncoding forward(const at::Tensor& ids, const at::Tensor& mask) = 0;
  /// tokenize + forward on the module's device (the device of its first parameter; CPU without any).
  TextEncoding encode(const std::vector<std::string>& texts);
  /// Width of context and pooled.
  virtual int64_t features() const = 0;
  /// The {architecture, fields} record the encoder was built from.
  const json& config() const { return config_; }
  void set_config(json c) { config_ = std::move(c); }

 private:
  json config_;
};
using TextEncoderPtr = std::shared_ptr<TextEncoderImpl>;

namespace text_encoders {

/// Every registered text encoder: "byte_text_encoder", "clip_text", "t5_encoder".
Registry<TextEncoderImpl>& registry();
/// Builds encoder `name` from its fields and records {architecture, fields} as its config.
TextEncoderPtr build(const std::string& name, const json& fields);
/// Builds from a {"architecture": NAME, "fields": {...}} record (as stored in run.json).
TextEncoderPtr build(const json& record);

}  // namespace text_encoders

namespace nn {

/// Fields of `byte_text_encoder`. Example: ByteTextEncoderOptions().features(64).num_layers(2)
struct ByteTextEncoderOptions {
  // The outputs stay float32 whatever dtype the layers compute in.
#define DEW_BYTE_TEXT_ENCODER_FIELDS(F, C)                                                                       \
  F(int64_t, features, 128, "width of the token states, context and pooled vector")                              \
  F(int64_t, num_layers, 2, "transformer layers")                                                                \
  F(int64_t, num_heads, 4, "attention heads (features divisible by it)")                                         \
  F(double, mlp_ratio, 4.0, "MLP hidden width = mlp_ratio * features")                                           \
  F(int64_t, max_length, 64, "tokens per caption (UTF-8 bytes; truncated, or padded with id 0, to this length)") \
  F(double, dropout, 0.0, "dropout on attention outputs and in the MLPs")                                        \
  DEW_COMPUTE_FIELDS(F, C, "layer")
  DEW_OPTIONS(DEW_BYTE_TEXT_ENCODER_FIELDS)
#undef DEW_BYTE_TEXT_ENCODER_FIELDS
};

/// One pre-norm bidirectional transformer layer: x + attn(norm1(x), key mask), then + mlp(norm2(x)).
/// Parameters: norm1.{weight,bias}, attn.qkv.{weight,bias}, attn.proj.{weight,bias}, norm2.{weight,bias},
/// mlp.fc1.{weight,bias}, mlp.fc2.{weight,bias}.
class ByteTextLayerImpl : public torch::nn::Module {
 public:
  ByteTextLayerImpl(int64_t features, int64_t num_heads, double mlp_ratio, double dropout, const std::string& impl);
  /// x: [B, L, D] in the compute dtype; mask: [B, L] bool (keys) -> [B, L, D]
  at::Tensor forward(const at::Tensor& x, const at::Tensor& mask);

  torch::nn::LayerNorm norm1{nullptr}, norm2{nullptr};
  SelfAttention attn{nullptr};
  Mlp mlp{nullptr};
};
TORCH_MODULE(ByteTextLayer);

/// A small trainable text encoder over UTF-8 bytes. Token ids are byte + 1 (0 = padding), truncated and
/// padded to max_length; an empty caption has no real token (mask all false), and encodes to a zero
/// context and a zero pooled vector: the unconditional datum of classifier-free guidance.
/// forward: token embedding + learned position embedding, pre-norm transformer layers attending only to
/// real tokens, final LayerNorm; the context is zero at padding; pooled = masked mean of the final states.
/// Parameters (stable across dtype, attention_impl and remat):
///   token_embedding.weight [257, D]        (row 0, the padding id, is never read by a real token)
///   position_embedding.weight [max_length, D]
///   layers.N.norm1.*, layers.N.attn.qkv.*, layers.N.attn.proj.*, layers.N.norm2.*, layers.N.mlp.fc1.*,
///   layers.N.mlp.fc2.*
///   final_norm.{weight,bias} [D]
class ByteTextEncoderImpl : public TextEncoderImpl {
 public:
  explicit ByteTextEncoderImpl(ByteTextEncoderOptions options = {});
  void reset();
  void reset_parameters();
  /// ids = bytes + 1, [B, max_length] int64, with mask [B, max_length] bool (CPU).
  std::pair<at::Tensor, at::Tensor> tokenize(const std::vector<std::string>& texts) const override;
  /// ids: [B, L] int64 in [0, 256], L <= max_length; mask: [B, L] bool (undefined = ids != 0).
  TextEncoding forward(const at::Tensor& ids, const at::Tensor& mask) override;
  int64_t features() const override { return options.features(); }

  ByteTextEncoderOptions options;
  torch::nn::Embedding token_embedding{nullptr}, position_embedding{nullptr};
  torch::nn::ModuleList layers{nullptr};
  std::vector<ByteTextLayer> layer_list;  // typed view of `layers`
  torch::nn::LayerNorm final_norm{nullptr};

 private:
  at::ScalarType dtype_ = at::kFloat;
};
TORCH_MODULE(ByteTextEncoder);

}  // namespace nn
}  // namespace dew

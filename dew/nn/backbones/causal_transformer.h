// CausalTransformer (docs/lm.md): a decoder-only language model with the
// Hugging Face decoder layout (Llama / Qwen3 / Gemma3 family features).
//
//   auto lm = dew::nn::CausalTransformer(dew::nn::CausalTransformerOptions().vocab_size(256)
//                                           .emb_features(128).num_layers(4).num_heads(4).num_kv_heads(2));
//   at::Tensor logits = lm->forward_tokens(ids);              // ids: [B, S] int64 -> [B, S, V] float32
//
//   dew::nn::KVCache cache;                                   // generation: prefill, then one token a step
//   auto l0 = lm->forward_tokens(prompt, {}, {}, {}, &cache); // [B, P, V]
//   auto l1 = lm->forward_tokens(next, {}, {}, {}, &cache);   // next: [B, 1] -> [B, 1, V]
//
// Blocks are pre-norm: h += attn(norm(h)); h += mlp(norm(h)) (sandwich_norms adds a norm on each
// branch output, as Gemma 2/3). RMSNorm and RoPE (rotate-half, the first rotary_dim of each head) run in
// fp32; the MLP is down(act(gate x) * up x) with act = silu (swiglu) or tanh-gelu (geglu).
// Attention of query i to key j: j <= i (causal), same segment id (packed batches: block-diagonal),
// key j not padding, and for sliding-window layers pos_i - pos_j < sliding_window.
#pragma once
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

#include <map>
#include <optional>

#include "dew/core/registry.h"
#include "dew/nn/attention.h"
#include "dew/nn/backbones/backbone.h"
#include "dew/nn/fused.h"  // rms_norm

namespace dew::nn {

/// Fields of `causal_transformer`. Example:
///   CausalTransformerOptions().vocab_size(32000).emb_features(512).num_layers(8).num_heads(8).num_kv_heads(2)
struct CausalTransformerOptions {
#define DEW_CAUSAL_TRANSFORMER_FIELDS(F, C)                                                                         \
  F(int64_t, vocab_size, 256, "token ids are in [0, vocab_size) (256 for bytes)")                                   \
  F(int64_t, emb_features, 512, "model width D")                                                                    \
  F(int64_t, num_layers, 8, "decoder layers")                                                                       \
  F(int64_t, num_heads, 8, "query heads")                                                                           \
  F(int64_t, num_kv_heads, 0, "key/value heads for GQA (0 = num_heads; num_heads a multiple of it)")                \
  F(int64_t, head_dim, 0, "width of a head (0 = emb_features / num_heads)")                                         \
  C(mlp, "swiglu", ({"swiglu", "geglu"}), "gated MLP: silu (swiglu: Llama, Qwen) or tanh-gelu (geglu: Gemma) gate") \
  F(int64_t, mlp_features, 0, "MLP hidden width (0 = 8/3 D rounded up to a multiple of 64)")                        \
  F(int64_t, max_seq_len, 2048, "longest sequence (positions are < max_seq_len)")                                   \
  F(double, rope_theta, 10000.0, "RoPE base of full-attention layers")                                              \
  F(double, partial_rotary_factor, 1.0, "fraction of each head's dimensions that rotate (the first ones)")          \
  F(std::vector<std::string>, layer_types, {}, "per layer: full_attention | sliding_attention (empty = all full)")  \
  F(int64_t, sliding_window, 4096,                                                                                  \
    "window of sliding-attention layers in tokens (a query sees keys with pos_q - pos_k < window)")                 \
  F(std::optional<double>, sliding_rope_theta, std::nullopt,                                                        \
    "RoPE base of sliding layers (null = rope_theta; Gemma 3: 1e4 local, 1e6 global)")                              \
  F(double, norm_eps, 1e-5, "RMSNorm epsilon")                                                                      \
  F(double, scale_offset, 0.0, "RMSNorm scale = scale_offset + weight (Gemma: 1)")                                  \
  F(bool, sandwich_norms, false, "also normalise each branch output (Gemma 2/3)")                                   \
  F(bool, qk_norm, true, "RMSNorm of queries and keys over head_dim (Qwen3, Gemma 3)")                              \
  F(bool, attention_bias, false, "biases in the q/k/v/o projections")                                               \
  F(double, embedding_scale, 1.0, "embedding multiplier (Gemma: sqrt(D); 1 = none)")                                \
  F(double, final_logit_softcap, 0.0, "logits = cap * tanh(logits / cap) (0 = none)")                               \
  F(bool, tie_embeddings, true, "output head shares embed_tokens.weight (no lm_head.weight)")                       \
  F(double, dropout, 0.0, "dropout on branch outputs while training")                                               \
  F(double, init_std, 0.02, "std of the normal init of embeddings and projections")                                 \
  F(bool, force_fp32_for_softmax, true, "softmax in fp32 under bf16/fp16 compute")                                  \
  F(bool, remat, false, "recompute layer activations in backward (gradient checkpointing)")                         \
  C(attention_impl, "auto", ({"auto", "reference", "chunked", "sdpa"}), "attention implementation")                 \
  C(dtype, "float32", ({"float32", "bfloat16", "float16"}), "compute dtype (parameters stay float32)")
  DEW_OPTIONS(DEW_CAUSAL_TRANSFORMER_FIELDS)
#undef DEW_CAUSAL_TRANSFORMER_FIELDS

 public:
  /// Resolved values of the 0 = derived fields.
  int64_t kv_heads() const { return num_kv_heads_ > 0 ? num_kv_heads_ : num_heads_; }
  int64_t head_size() const { return head_dim_ > 0 ? head_dim_ : emb_features_ / num_heads_; }
  int64_t mlp_hidden() const { return mlp_features_ > 0 ? mlp_features_ : (emb_features_ * 8 / 3 + 63) / 64 * 64; }
  /// Rotated dimensions per head (even): floor(head_dim * partial_rotary_factor / 2) * 2.
  int64_t rotary_dim() const;
  /// The kind of layer i ("full_attention" when layer_types is empty).
  const std::string& layer_type(int64_t i) const;
};

/// Rotate-half RoPE of the first `rotary_dim` features of x: [B, H, S, Dh] at positions [B, S] (int64)
/// with base theta, in fp32, the remaining Dh - rotary_dim features unchanged; returns x's dtype.
at::Tensor apply_partial_rope(const at::Tensor& x, const at::Tensor& positions, int64_t rotary_dim, double theta);
/// The same with precomputed tables (rope_1d(positions, rotary_dim, theta)).
at::Tensor apply_partial_rope(const at::Tensor& x, const Rope& rope);

/// Keys and values of the tokens seen so far, per layer, for incremental decoding. Empty = no tokens yet.
struct KVCache {
  std::vector<at::Tensor> keys;    // per layer [B, Hkv, T, Dh] (after qk-norm and RoPE), compute dtype
  std::vector<at::Tensor> values;  // per layer [B, Hkv, T, Dh]
  at::Tensor valid;                // [B, T] bool: false = padding
  at::Tensor positions;            // [B, T] int64
  at::Tensor segments;             // [B, T] int64
  bool padded = false;             // some cached token is padding (valid has a false)
  bool segmented = false;          // segment ids were given (the segments may differ)
  int64_t length() const { return valid.defined() ? valid.size(1) : 0; }
  void clear() { *this = KVCache{}; }
  /// Keeps rows `index` (int64 [B']) of every tensor, e.g. to drop finished sequences.
  void select_rows(const at::Tensor& index);
};

/// RMSNorm module: parameter `weight` [dim] (ones, or zeros when offset is 1 so the scale starts at 1).
class RMSNormImpl : public torch::nn::Module {
 public:
  RMSNormImpl(int64_t dim, double eps, double offset);
  void reset_parameters();
  /// x: [..., dim] -> [..., dim] in x's dtype.
  at::Tensor forward(const at::Tensor& x) { return rms_norm(x, weight, eps, offset); }
  double eps, offset;
  at::Tensor weight;
};
TORCH_MODULE(RMSNorm);

/// Grouped-query self-attention. Parameters: {q,k,v,o}_proj.weight (+ .bias), {q,k}_norm.weight.
class CausalAttentionImpl : public torch::nn::Module {
 public:
  CausalAttentionImpl(const CausalTransformerOptions& options, double theta);
  void reset_parameters();
  /// x: [B, S, D]; rope: tables of the S positions over rotary_dim (undefined = no rotation); mask:
  /// prepared from [B, 1, S, T] bool with T = cached + S (undefined = every key attends); cache_k, cache_v: this layer's cached keys/values
  /// [B, Hkv, T - S, Dh] (null = no cache; undefined = empty), replaced by the concatenation with the
  /// new ones. Returns [B, S, D].
  at::Tensor forward(const at::Tensor& x, const Rope& rope, const AttentionMask& mask, at::Tensor* cache_k,
                     at::Tensor* cache_v);
  CausalTransformerOptions options;
  double theta;
  torch::nn::Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};
  RMSNorm q_norm{nullptr}, k_norm{nullptr};
};
TORCH_MODULE(CausalAttention);

/// Gated MLP down(act(gate x) * up x). Parameters: {gate,up,down}_proj.weight.
class GatedMLPImpl : public torch::nn::Module {
 public:
  explicit GatedMLPImpl(const CausalTransformerOptions& options);
  void reset_parameters();
  at::Tensor forward(const at::Tensor& x);  // [B, S, D] -> [B, S, D]
  CausalTransformerOptions options;
  torch::nn::Linear gate_proj{nullptr}, up_proj{nullptr}, down_proj{nullptr};
};
TORCH_MODULE(GatedMLP);

/// One decoder layer. Parameters: input_layernorm.weight, self_attn.*, post_attention_layernorm.weight,
/// mlp.*, and with sandwich_norms pre_feedforward_layernorm.weight and post_feedforward_layernorm.weight
/// (Gemma 3 names: there post_attention_layernorm normalises the attention output and
/// pre_feedforward_layernorm the MLP input).
class DecoderLayerImpl : public torch::nn::Module {
 public:
  DecoderLayerImpl(const CausalTransformerOptions& options, int64_t index);
  /// h: [B, S, D] compute dtype; the rest as CausalAttention. Returns [B, S, D].
  at::Tensor forward(const at::Tensor& h, const Rope& rope, const AttentionMask& mask, at::Tensor* cache_k,
                     at::Tensor* cache_v);

  CausalTransformerOptions options;
  int64_t index;
  bool sliding = false;  // a sliding_attention layer
  double theta = 1e4;    // its RoPE base
  RMSNorm input_layernorm{nullptr}, post_attention_layernorm{nullptr};
  RMSNorm pre_feedforward_layernorm{nullptr}, post_feedforward_layernorm{nullptr};
  CausalAttention self_attn{nullptr};
  GatedMLP mlp{nullptr};
};
TORCH_MODULE(DecoderLayer);

/// The language model. Parameters (Hugging Face decoder names; independent of dtype, attention_impl and
/// remat): embed_tokens.weight [V, D], layers.N.* (DecoderLayer), norm.weight [D], lm_head.weight [V, D]
/// (absent when tie_embeddings).
class CausalTransformerImpl : public torch::nn::Module {
 public:
  explicit CausalTransformerImpl(CausalTransformerOptions options = {});
  void reset();
  void reset_parameters();

  /// Logits of token ids. ids: [B, S] int64 in [0, vocab_size). positions: [B, S] int64 (undefined =
  /// 0.. S-1 after the cache's length, or per row after its last cached position). segment_ids: [B, S]
  /// int64 for packed rows (undefined = one segment). attention_mask: [B, S] bool, false = padding (its
  /// key is never attended). cache: when given, the new tokens attend to the cached ones and are appended.
  /// Returns [B, S, vocab_size] float32.
  at::Tensor forward_tokens(const at::Tensor& ids, const at::Tensor& positions = {}, const at::Tensor& segment_ids = {},
                            const at::Tensor& attention_mask = {}, KVCache* cache = nullptr);
  /// The final-normed hidden states [B, S, D] (compute dtype) of the same inputs: forward_tokens = logits(hidden).
  /// final_norm false: the last layer's output before that norm (what Qwen-Image's text path reads).
  at::Tensor hidden_states(const at::Tensor& ids, const at::Tensor& positions = {}, const at::Tensor& segment_ids = {},
                           const at::Tensor& attention_mask = {}, KVCache* cache = nullptr, bool final_norm = true);
  /// Hidden states [..., D] -> logits [..., V] float32 (head + softcap).
  at::Tensor logits(const at::Tensor& hidden);
  /// The output projection [V, D]: lm_head.weight, or embed_tokens.weight when tied.
  const at::Tensor& head_weight() const { return options.tie_embeddings() ? embed_tokens->weight : lm_head->weight; }

  /// The {architecture: "causal_transformer", fields} record it was built from (every field resolved).
  json config() const;

  CausalTransformerOptions options;
  torch::nn::Embedding embed_tokens{nullptr};
  torch::nn::ModuleList layers{nullptr};
  std::vector<DecoderLayer> layer_list;  // typed view of `layers`
  RMSNorm norm{nullptr};
  torch::nn::Linear lm_head{nullptr};  // untied only

 private:
  /// RoPE tables of positions 0 .. at least `length` - 1 for base `theta` on `device`, built once and
  /// grown as needed (up to max_seq_len): a forward at positions 0.. (or any computed positions) slices or
  /// gathers them instead of recomputing cos and sin.
  const Rope& rope_table(double theta, int64_t length, const c10::Device& device);

  at::ScalarType dtype_ = at::kFloat;
  std::map<double, Rope> rope_tables_;
};
TORCH_MODULE(CausalTransformer);

}  // namespace dew::nn

namespace dew::models {

/// The language-model families (the models registry's kind "language_model"; `dew models` lists them):
/// causal_transformer.
Registry<nn::CausalTransformerImpl>& language_models();
/// Builds from a {"architecture": NAME, "fields": {...}} record (as stored in run.json).
nn::CausalTransformer build_language_model(const json& record);

}  // namespace dew::models

namespace dew::nn {

/// The CausalTransformer options of an HF config.json of a supported family; unsupported model types
/// and settings (rope_scaling, a query_pre_attn_scalar other than head_dim, attention softcapping, ...)
/// are a dew::Error naming the field. (The family's config.json translation: models::fields_from_reference_config.)
CausalTransformerOptions options_from_hf_config(const json& config);
/// The key map of a transformers decoder checkpoint (model.* names, lm_head) onto CausalTransformer: the
/// "model." prefix dropped, old rotary_emb.inv_freq buffers and (tied models) a saved lm_head skipped.
io::KeyMap hf_decoder_key_map(const CausalTransformerOptions& options);

/// The attention mask of query tokens against keys: [B, 1, Sq, Sk] bool, true = attend. Query i of row b
/// is key index offset + i; it sees key j when j <= offset + i, key_valid[b, j], key_seg[b, j] ==
/// q_seg[b, i] and (window > 0) q_pos[b, i] - key_pos[b, j] < window. q_*: [B, Sq]; key_*: [B, Sk].
at::Tensor causal_mask(const at::Tensor& q_pos, const at::Tensor& q_seg, const at::Tensor& key_pos,
                       const at::Tensor& key_seg, const at::Tensor& key_valid, int64_t offset, int64_t window);

}  // namespace dew::nn

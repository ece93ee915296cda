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
#include <torch/arg.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

#include <map>
#include <optional>

#include "dew/nn/attention.h"
#include "dew/nn/fused.h"  // rms_norm
#include "dew/core/registry.h"
#include "dew/nn/backbones/backbone.h"

namespace dew::nn {

/// Fields of `causal_transformer`. Example:
///   CausalTransformerOptions().vocab_size(32000).emb_features(512).num_layers(8).num_heads(8).num_kv_heads(2)
struct CausalTransformerOptions {
  /// token ids are in [0, vocab_size), e.g. 256 for bytes
  TORCH_ARG(int64_t, vocab_size) = 256;
  /// model width D, e.g. 512
  TORCH_ARG(int64_t, emb_features) = 512;
  /// decoder layers
  TORCH_ARG(int64_t, num_layers) = 8;
  /// query heads
  TORCH_ARG(int64_t, num_heads) = 8;
  /// key/value heads (GQA); 0 = num_heads. num_heads must be a multiple of it
  TORCH_ARG(int64_t, num_kv_heads) = 0;
  /// width of one head; 0 = emb_features / num_heads
  TORCH_ARG(int64_t, head_dim) = 0;
  /// "swiglu" (silu gate, Llama/Qwen) or "geglu" (tanh-gelu gate, Gemma)
  TORCH_ARG(std::string, mlp) = "swiglu";
  /// MLP hidden width; 0 = 8/3 D rounded up to a multiple of 64
  TORCH_ARG(int64_t, mlp_features) = 0;
  /// longest sequence (positions are < max_seq_len)
  TORCH_ARG(int64_t, max_seq_len) = 2048;
  /// RoPE base of full-attention layers
  TORCH_ARG(double, rope_theta) = 10000.0;
  /// fraction of each head's dimensions that rotate (the first ones), e.g. 0.5
  TORCH_ARG(double, partial_rotary_factor) = 1.0;
  /// kind of each layer: "full_attention" or "sliding_attention"; empty = all full
  TORCH_ARG(std::vector<std::string>, layer_types) = {};
  /// window of sliding-attention layers in tokens (query sees keys with pos_q - pos_k < window)
  TORCH_ARG(int64_t, sliding_window) = 4096;
  /// RoPE base of sliding-attention layers; null = rope_theta (Gemma 3 uses 1e4 local, 1e6 global)
  TORCH_ARG(std::optional<double>, sliding_rope_theta) = std::nullopt;
  /// epsilon of every RMSNorm
  TORCH_ARG(double, norm_eps) = 1e-5;
  /// RMSNorm scale is (scale_offset + weight): 0 (Llama) or 1 (Gemma, weights initialised to 0)
  TORCH_ARG(double, scale_offset) = 0.0;
  /// Gemma 2/3 norms after the attention and MLP branches too
  TORCH_ARG(bool, sandwich_norms) = false;
  /// RMSNorm of queries and keys over head_dim (Qwen3, Gemma 3)
  TORCH_ARG(bool, qk_norm) = true;
  /// biases in q/k/v/o projections (Qwen2 style: q, k, v and o all get one when true)
  TORCH_ARG(bool, attention_bias) = false;
  /// embeddings are multiplied by this (Gemma: sqrt(D)); 1 = none
  TORCH_ARG(double, embedding_scale) = 1.0;
  /// logits = cap * tanh(logits / cap); 0 = none
  TORCH_ARG(double, final_logit_softcap) = 0.0;
  /// the output head reuses embed_tokens.weight (no lm_head.weight)
  TORCH_ARG(bool, tie_embeddings) = true;
  /// dropout on each branch output (training only)
  TORCH_ARG(double, dropout) = 0.0;
  /// std of the normal initialisation of embeddings and projections
  TORCH_ARG(double, init_std) = 0.02;
  /// softmax in fp32 under bf16/fp16 compute
  TORCH_ARG(bool, force_fp32_for_softmax) = true;
  /// recompute each layer's activations in backward
  TORCH_ARG(bool, remat) = false;
  /// auto, reference, chunked or sdpa
  TORCH_ARG(std::string, attention_impl) = "auto";
  /// compute dtype: float32, bfloat16 or float16 (parameters stay float32)
  TORCH_ARG(std::string, dtype) = "float32";

 public:
  /// Resolved values of the 0 = derived fields.
  int64_t kv_heads() const { return num_kv_heads_ > 0 ? num_kv_heads_ : num_heads_; }
  int64_t head_size() const { return head_dim_ > 0 ? head_dim_ : emb_features_ / num_heads_; }
  int64_t mlp_hidden() const { return mlp_features_ > 0 ? mlp_features_ : (emb_features_ * 8 / 3 + 63) / 64 * 64; }
  /// Rotated dimensions per head (even): floor(head_dim * partial_rotary_factor / 2) * 2.
  int64_t rotary_dim() const;
  /// The kind of layer i ("full_attention" when layer_types is empty).
  const std::string& layer_type(int64_t i) const;

  template <class V>
  void visit(V& v) {
    v("vocab_size", vocab_size_, "token ids are in [0, vocab_size)");
    v("emb_features", emb_features_, "model width D");
    v("num_layers", num_layers_, "decoder layers");
    v("num_heads", num_heads_, "query heads");
    v("num_kv_heads", num_kv_heads_, "key/value heads for GQA (0 = num_heads)");
    v("head_dim", head_dim_, "width of a head (0 = emb_features / num_heads)");
    v.choice("mlp", mlp_, {"swiglu", "geglu"}, "gated MLP: silu (swiglu) or tanh-gelu (geglu) gate");
    v("mlp_features", mlp_features_, "MLP hidden width (0 = 8/3 D rounded up to 64)");
    v("max_seq_len", max_seq_len_, "longest sequence");
    v("rope_theta", rope_theta_, "RoPE base of full-attention layers");
    v("partial_rotary_factor", partial_rotary_factor_, "fraction of head dims that rotate");
    v("layer_types", layer_types_, "per layer: full_attention | sliding_attention (empty = all full)");
    v("sliding_window", sliding_window_, "window of sliding-attention layers in tokens");
    v("sliding_rope_theta", sliding_rope_theta_, "RoPE base of sliding layers (null = rope_theta)");
    v("norm_eps", norm_eps_, "RMSNorm epsilon");
    v("scale_offset", scale_offset_, "RMSNorm scale = scale_offset + weight (Gemma: 1)");
    v("sandwich_norms", sandwich_norms_, "also normalise each branch output (Gemma 2/3)");
    v("qk_norm", qk_norm_, "RMSNorm of queries and keys over head_dim");
    v("attention_bias", attention_bias_, "biases in the q/k/v/o projections");
    v("embedding_scale", embedding_scale_, "embedding multiplier (Gemma: sqrt(D))");
    v("final_logit_softcap", final_logit_softcap_, "cap * tanh(logits / cap) (0 = none)");
    v("tie_embeddings", tie_embeddings_, "output head shares embed_tokens.weight");
    v("dropout", dropout_, "dropout on branch outputs while training");
    v("init_std", init_std_, "std of the normal init of embeddings and projections");
    v("force_fp32_for_softmax", force_fp32_for_softmax_, "softmax in fp32 under bf16/fp16 compute");
    v("remat", remat_, "recompute layer activations in backward (gradient checkpointing)");
    v.choice("attention_impl", attention_impl_, {"auto", "reference", "chunked", "sdpa"}, "attention implementation");
    v.choice("dtype", dtype_, {"float32", "bfloat16", "float16"}, "compute dtype (parameters stay float32)");
  }
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
  at::Tensor hidden_states(const at::Tensor& ids, const at::Tensor& positions = {}, const at::Tensor& segment_ids = {},
                           const at::Tensor& attention_mask = {}, KVCache* cache = nullptr);
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
  torch::nn::Linear lm_head{nullptr};    // untied only

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

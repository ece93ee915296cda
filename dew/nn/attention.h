// Scaled dot-product attention with interchangeable implementations (docs/backbones.md),
// and the attention modules the backbones share.
//
//   auto out = dew::nn::attention(q, k, v, key_mask, "chunked");    // q, k, v: [B, H, S, D]
//   dew::nn::SelfAttention attn(dew::nn::SelfAttentionOptions(512, 8).qk_norm("rms"));
//   auto y = attn(x, rope);                                          // x: [B, S, 512]
//
// `reference` is the readable path (matmul + fp32 softmax); every fast path is tested against it.
#pragma once
#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <string>
#include <vector>

#include "dew/nn/embeddings.h"

namespace dew::nn {

using at::Tensor;

/// The accepted values of `attention_impl`: auto, reference, chunked, sdpa.
const std::vector<std::string>& attention_impls();
/// Throws dew::Error unless `impl` is an accepted value usable in this build (`where` names the field).
void check_attention_impl(const std::string& impl, const std::string& where);

/// softmax(q k^T / sqrt(D)) v. q: [B, H, Sq, D], k, v: [B, H, Sk, D] -> [B, H, Sq, D].
/// `mask` (optional, bool, true = attend) is [B, Sk] (a key mask) or broadcastable to [B, H, Sq, Sk];
/// a query row whose keys are all masked out yields zeros. `impl` is one of attention_impls().
Tensor attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask = {},
                 const std::string& impl = "auto", bool force_fp32_for_softmax = true);

/// A bool mask turned once into what attention() needs, for every layer that shares it (a model's
/// layers all attend under the same mask).
struct AttentionMask {
  Tensor mask;        // bool, 4-D, broadcastable to [B, H, Sq, Sk]; rows without a key opened to every key
  Tensor bias;        // 0 where mask is true, -inf where false (float32, or q's dtype when wider): added to the scores
  Tensor empty_rows;  // bool [.., Sq, 1]: rows the caller's mask left without a key (zeroed); undefined: none
  bool defined() const { return mask.defined(); }
};
/// mask: 4-D bool; `dtype`: that of q and k (the bias is float32 for half types); undefined gives an
/// undefined AttentionMask (no masking). rows_may_be_empty = false skips the empty-row handling: the caller
/// guarantees every query row keeps a key (a causal mask over valid tokens keeps the query's own key).
AttentionMask prepare_attention_mask(const Tensor& mask, at::ScalarType dtype, bool rows_may_be_empty = true);
/// Fused projections to heads: [B, S, n * H * Dh] -> n tensors [B, H, S, Dh] (e.g. n = 3 for q, k, v).
std::vector<Tensor> split_heads(const Tensor& t, int64_t n, int64_t heads);
/// [B, H, S, Dh] -> [B, S, H * Dh].
Tensor merge_heads(const Tensor& t);
/// attention() with a prepared mask (its shape is checked against k only).
Tensor attention_masked(const Tensor& q, const Tensor& k, const Tensor& v, const AttentionMask& mask,
                        const std::string& impl = "auto", bool force_fp32_for_softmax = true);

/// The reference path: one matmul for the scores, softmax (in fp32 if asked), one matmul for the output.
/// The mask must already be 4-D (broadcastable to [B, H, Sq, Sk]) with no fully masked row.
Tensor attention_reference(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask,
                           bool force_fp32_for_softmax);
/// The reference path over blocks of `chunk_size` query rows: the live scores never exceed
/// [B, H, chunk, Sk]. Under autograd each block's probabilities are kept for backward (use remat on the
/// enclosing block to bound training memory too).
Tensor attention_chunked(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask,
                         bool force_fp32_for_softmax, int64_t chunk_size = 256);
/// Query rows per block of the "chunked" impl (256 unless a scope below says otherwise).
int64_t attention_chunk_rows();
/// Sets attention_chunk_rows() for the lifetime of the scope (this thread), e.g. to bound attention memory
/// of a large model further, or to make a small test model's attention really split into blocks.
class AttentionChunkRowsScope {
 public:
  explicit AttentionChunkRowsScope(int64_t rows);
  ~AttentionChunkRowsScope();
  AttentionChunkRowsScope(const AttentionChunkRowsScope&) = delete;
  AttentionChunkRowsScope& operator=(const AttentionChunkRowsScope&) = delete;

 private:
  int64_t previous_;
};

/// at::scaled_dot_product_attention (flash / memory-efficient kernels on CUDA).
Tensor attention_sdpa(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask);

/// torch::linear(x, W, b) with the parameters cast to x's dtype: the fused addmm path (torch::nn::Linear's
/// forward on a 3-D input runs matmul + add in LibTorch 1.13), and params stay fp32 under bf16 compute.
Tensor dense(const Tensor& x, const torch::nn::Linear& layer);

// ---- normalisation of queries and keys over head_dim ----

/// Options of HeadNorm: RMSNorm ("rms") or LayerNorm ("layer") over the last dimension, in fp32.
struct HeadNormOptions {
  /* implicit */ HeadNormOptions(int64_t dim) : dim_(dim) {}
  /// normalised size, e.g. 64 (the head dimension)
  TORCH_ARG(int64_t, dim);
  /// "rms" (scale only) or "layer" (scale and bias)
  TORCH_ARG(std::string, kind) = "rms";
  /// added to the variance
  TORCH_ARG(double, eps) = 1e-6;
};

/// Learned normalisation over the last axis, computed in fp32 and returned in the input's dtype.
class HeadNormImpl : public torch::nn::Module {
 public:
  explicit HeadNormImpl(HeadNormOptions options);
  void reset();
  void reset_parameters();
  /// x: [..., dim] -> [..., dim]
  Tensor forward(const Tensor& x);

  HeadNormOptions options;
  Tensor weight;  // [dim], ones
  Tensor bias;    // [dim], zeros; "layer" only
};
TORCH_MODULE(HeadNorm);

// ---- attention modules ----

/// Options of SelfAttention. Example: SelfAttentionOptions(768, 12).qk_norm("rms").impl("chunked")
struct SelfAttentionOptions {
  SelfAttentionOptions(int64_t dim, int64_t num_heads) : dim_(dim), num_heads_(num_heads) {}
  /// model width, e.g. 768
  TORCH_ARG(int64_t, dim);
  /// heads, e.g. 12; dim must be divisible by it
  TORCH_ARG(int64_t, num_heads);
  /// bias in the qkv projection
  TORCH_ARG(bool, qkv_bias) = true;
  /// "none", "rms" or "layer": normalise q and k over head_dim before the scores
  TORCH_ARG(std::string, qk_norm) = "none";
  /// epsilon of the qk norm
  TORCH_ARG(double, norm_eps) = 1e-6;
  /// one of attention_impls()
  TORCH_ARG(std::string, impl) = "auto";
  /// softmax in fp32 under bf16/fp16 compute
  TORCH_ARG(bool, force_fp32_for_softmax) = true;
  /// dropout on the output projection
  TORCH_ARG(double, dropout) = 0.0;
};

/// Multi-head self-attention: fused qkv projection, optional qk-norm and RoPE, output projection.
/// Parameters (timm names): qkv.{weight,bias}, proj.{weight,bias}, q_norm.weight, k_norm.weight.
class SelfAttentionImpl : public torch::nn::Module {
 public:
  explicit SelfAttentionImpl(SelfAttentionOptions options);
  void reset();
  void reset_parameters();
  /// x: [B, S, dim]; rope: tables for S positions (undefined = no rotation); mask: as attention().
  /// Returns [B, S, dim].
  Tensor forward(const Tensor& x, const Rope& rope = {}, const Tensor& mask = {});

  SelfAttentionOptions options;
  torch::nn::Linear qkv{nullptr}, proj{nullptr};
  HeadNorm q_norm{nullptr}, k_norm{nullptr};
};
TORCH_MODULE(SelfAttention);

/// Options of CrossAttention. Example: CrossAttentionOptions(256, 768, 4)
struct CrossAttentionOptions {
  CrossAttentionOptions(int64_t dim, int64_t context_dim, int64_t num_heads)
      : dim_(dim), context_dim_(context_dim), num_heads_(num_heads) {}
  /// width of the queries' stream, e.g. 256
  TORCH_ARG(int64_t, dim);
  /// width of the context tokens, e.g. 768
  TORCH_ARG(int64_t, context_dim);
  /// heads; dim must be divisible by it
  TORCH_ARG(int64_t, num_heads);
  /// "none", "rms" or "layer"
  TORCH_ARG(std::string, qk_norm) = "none";
  TORCH_ARG(double, norm_eps) = 1e-6;
  TORCH_ARG(std::string, impl) = "auto";
  TORCH_ARG(bool, force_fp32_for_softmax) = true;
  TORCH_ARG(double, dropout) = 0.0;
};

/// Multi-head cross-attention: queries from x, keys and values (one fused projection) from a context.
/// Parameters: q.{weight,bias}, kv.{weight,bias}, proj.{weight,bias}, q_norm.weight, k_norm.weight.
class CrossAttentionImpl : public torch::nn::Module {
 public:
  explicit CrossAttentionImpl(CrossAttentionOptions options);
  void reset();
  void reset_parameters();
  /// x: [B, S, dim]; context: [B, L, context_dim]; context_mask: [B, L] bool (true = real token) or
  /// undefined. Returns [B, S, dim]; a row whose context is entirely masked receives zeros.
  Tensor forward(const Tensor& x, const Tensor& context, const Tensor& context_mask = {});

  CrossAttentionOptions options;
  torch::nn::Linear q{nullptr}, kv{nullptr}, proj{nullptr};
  HeadNorm q_norm{nullptr}, k_norm{nullptr};
};
TORCH_MODULE(CrossAttention);

}  // namespace dew::nn

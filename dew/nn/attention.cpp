#include "dew/nn/attention.h"

#include <torch/version.h>

#include <cmath>
#include <limits>

#include "dew/core/error.h"
#include "dew/nn/fused.h"
#include "dew/nn/lora.h"

namespace dew::nn {

namespace {

// A [B, Sk] key mask becomes [B, 1, 1, Sk]; 4-D masks pass through.
Tensor as_4d_mask(const Tensor& mask, const Tensor& q, const Tensor& k) {
  DEW_CHECK(mask.scalar_type() == at::kBool, "attention: mask must be bool (true = attend), got ", mask.scalar_type());
  if (mask.dim() == 2) {
    DEW_CHECK(mask.size(0) == q.size(0) && mask.size(1) == k.size(2), "attention: key mask ", mask.sizes(),
              " does not match batch ", q.size(0), " and keys ", k.size(2));
    return mask.view({mask.size(0), 1, 1, mask.size(1)});
  }
  DEW_CHECK(mask.dim() == 4, "attention: mask must be [B, Sk] or 4-D, got ", mask.sizes());
  return mask;
}

void check_qkv(const Tensor& q, const Tensor& k, const Tensor& v) {
  DEW_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "attention: q, k, v must be [B, H, S, D], got ", q.sizes(),
            ", ", k.sizes(), ", ", v.sizes());
  DEW_CHECK(q.size(-1) == k.size(-1) && k.size(2) == v.size(2), "attention: q ", q.sizes(), ", k ", k.sizes(), ", v ",
            v.sizes(), " do not fit together");
}

}  // namespace

const std::vector<std::string>& attention_impls() {
  static const std::vector<std::string> impls{"auto", "reference", "chunked", "sdpa"};
  return impls;
}

void check_attention_impl(const std::string& impl, const std::string& where) {
  bool known = false;
  for (const auto& i : attention_impls()) known |= (i == impl);
  DEW_CHECK(known, where, ": got \"", impl, "\", accepted: auto, reference, chunked, sdpa");
}

namespace {

// 0 where `mask` (bool) is true, -inf where false, in `dtype`: added to the scores, so the backward of the
// masking is the identity (masked_fill's is another pass over the scores).
Tensor mask_bias(const Tensor& mask, at::ScalarType dtype) {
  return at::zeros(mask.sizes(), mask.options().dtype(dtype))
      .masked_fill_(mask.logical_not(), -std::numeric_limits<double>::infinity());
}

// The reference path with an additive bias (undefined = none) broadcastable to the scores.
Tensor reference_with_bias(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& bias,
                           bool force_fp32_for_softmax) {
  // Scaling q ([S, D]) is cheaper than scaling the scores ([S, S]).
  const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
  Tensor scores = at::matmul(q * scale, k.transpose(-2, -1));  // [B, H, Sq, Sk], a new tensor
  // Half-precision scores are upcast; float32 and float64 keep their precision.
  if (force_fp32_for_softmax && at::elementSize(scores.scalar_type()) < 4) scores = scores.to(at::kFloat);
  if (bias.defined()) scores.add_(bias.scalar_type() == scores.scalar_type() ? bias : bias.to(scores.scalar_type()));
  Tensor probs = at::softmax(scores, -1).to(v.scalar_type());
  return at::matmul(probs, v);  // [B, H, Sq, D]
}

Tensor chunked_with_bias(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& bias,
                         bool force_fp32_for_softmax, int64_t chunk_size) {
  DEW_CHECK(chunk_size > 0, "attention_chunked: chunk_size must be > 0, got ", chunk_size);
  const int64_t sq = q.size(2);
  if (sq <= chunk_size) return reference_with_bias(q, k, v, bias, force_fp32_for_softmax);
  std::vector<Tensor> outs;
  outs.reserve((sq + chunk_size - 1) / chunk_size);
  const bool per_query = bias.defined() && bias.size(-2) != 1;
  for (int64_t s = 0; s < sq; s += chunk_size) {
    const int64_t n = std::min(chunk_size, sq - s);
    outs.push_back(
        reference_with_bias(q.narrow(2, s, n), k, v, per_query ? bias.narrow(-2, s, n) : bias, force_fp32_for_softmax));
  }
  return at::cat(outs, 2);
}

// The bias for scores computed from q, k of `dtype`: float32 for half types (the softmax's precision).
Tensor bias_of(const Tensor& mask, at::ScalarType dtype) {
  return mask.defined() ? mask_bias(mask, at::elementSize(dtype) < 4 ? at::kFloat : dtype) : Tensor();
}

}  // namespace

Tensor attention_reference(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask,
                           bool force_fp32_for_softmax) {
  return reference_with_bias(q, k, v, bias_of(mask, q.scalar_type()), force_fp32_for_softmax);
}

Tensor attention_chunked(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask,
                         bool force_fp32_for_softmax, int64_t chunk_size) {
  return chunked_with_bias(q, k, v, bias_of(mask, q.scalar_type()), force_fp32_for_softmax, chunk_size);
}

Tensor attention_sdpa(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask) {
  // The kernels compute the softmax in fp32 internally whatever the input dtype.
  std::optional<Tensor> m;
  if (mask.defined()) m = mask;
  return at::scaled_dot_product_attention(q, k, v, m, /*dropout_p=*/0.0, /*is_causal=*/false);
}

namespace {
thread_local int64_t t_chunk_rows = 256;
}  // namespace

int64_t attention_chunk_rows() { return t_chunk_rows; }

AttentionChunkRowsScope::AttentionChunkRowsScope(int64_t rows) : previous_(t_chunk_rows) {
  DEW_CHECK(rows >= 1, "attention chunk rows: must be >= 1, got ", rows);
  t_chunk_rows = rows;
}

AttentionChunkRowsScope::~AttentionChunkRowsScope() { t_chunk_rows = previous_; }

AttentionMask prepare_attention_mask(const Tensor& mask, at::ScalarType dtype, bool rows_may_be_empty) {
  AttentionMask out;
  if (!mask.defined()) return out;
  DEW_CHECK(mask.dim() == 4 && mask.scalar_type() == at::kBool, "attention: a prepared mask must be 4-D bool, got ",
            mask.scalar_type(), " ", mask.sizes());
  Tensor m = mask;
  if (rows_may_be_empty) {
    // A row with every key masked would be softmax(-inf...) = NaN in every impl: let it attend to all keys
    // (finite, harmless) and zero its output afterwards. No host sync, so it stays cheap on CUDA.
    Tensor has_key = m.any(-1, /*keepdim=*/true);  // [B?, H?, Sq?, 1]
    out.empty_rows = has_key.logical_not();
    m = m.logical_or(out.empty_rows);
  }
  out.mask = m;
  out.bias = bias_of(m, dtype);
  return out;
}

namespace {

// attention_masked once q, k and v are checked.
Tensor attention_checked(const Tensor& q, const Tensor& k, const Tensor& v, const AttentionMask& mask,
                         const std::string& impl, bool force_fp32_for_softmax) {
  DEW_CHECK(!mask.defined() || (mask.mask.dim() == 4 && mask.mask.size(-1) == k.size(2)), "attention: mask ",
            mask.mask.sizes(), " does not match ", k.size(2), " keys");
  Tensor out;
  if (impl == "reference") {
    out = reference_with_bias(q, k, v, mask.bias, force_fp32_for_softmax);
  } else if (impl == "chunked") {
    out = chunked_with_bias(q, k, v, mask.bias, force_fp32_for_softmax, attention_chunk_rows());
  } else if (impl == "sdpa") {
    out = attention_sdpa(q, k, v, mask.mask);
  } else if (impl == "auto") {
    // Small unmasked float32 attention on the CPU runs the fused kernel where it measured faster than
    // ATen's scaled_dot_product_attention (fused_attention_preferred); everything else runs sdpa.
    if (!mask.defined() && fused_attention_applies(q, k, v) && fused_attention_preferred(k.size(2))) {
      out = fused_attention(q, k, v);
    } else {
      out = attention_sdpa(q, k, v, mask.mask);
    }
  } else {
    check_attention_impl(impl, "attention_impl");
  }
  if (mask.empty_rows.defined()) out = out.masked_fill(mask.empty_rows, 0.0);
  return out;
}

}  // namespace

Tensor attention_masked(const Tensor& q, const Tensor& k, const Tensor& v, const AttentionMask& mask,
                        const std::string& impl, bool force_fp32_for_softmax) {
  check_qkv(q, k, v);
  return attention_checked(q, k, v, mask, impl, force_fp32_for_softmax);
}

Tensor attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask, const std::string& impl,
                 bool force_fp32_for_softmax) {
  check_qkv(q, k, v);
  const AttentionMask m =
      mask.defined() ? prepare_attention_mask(as_4d_mask(mask, q, k), q.scalar_type()) : AttentionMask{};
  return attention_checked(q, k, v, m, impl, force_fp32_for_softmax);
}

Tensor dense(const Tensor& x, const torch::nn::Linear& layer) {
  const auto dt = x.scalar_type();
  const Tensor& w = layer->weight;
  const Tensor& b = layer->bias;
  Tensor y = row_parallel_linear(x, w.scalar_type() == dt ? w : w.to(dt),
                                 !b.defined() || b.scalar_type() == dt ? b : b.to(dt));
  // A LoRA adapter attached to the layer (lora.h) adds scale * B(A(dropout(x))).
  if (Tensor d = lora_delta(x, *layer); d.defined()) y = y + d;
  return y;
}

// ---- HeadNorm ----

HeadNormImpl::HeadNormImpl(HeadNormOptions options_) : options(std::move(options_)) {
  DEW_CHECK(options.dim() > 0, "HeadNorm: dim must be > 0, got ", options.dim());
  DEW_CHECK(options.kind() == "rms" || options.kind() == "layer", "HeadNorm: kind must be \"rms\" or \"layer\", got \"",
            options.kind(), "\"");
  DEW_CHECK(options.eps() > 0, "HeadNorm: eps must be > 0, got ", options.eps());
  reset();
}

void HeadNormImpl::reset() {
  weight = register_parameter("weight", torch::ones({options.dim()}));
  if (options.kind() == "layer") bias = register_parameter("bias", torch::zeros({options.dim()}));
  reset_parameters();
}

void HeadNormImpl::reset_parameters() {
  torch::NoGradGuard no_grad;
  weight.fill_(1.0);
  if (bias.defined()) bias.zero_();
}

Tensor HeadNormImpl::forward(const Tensor& x) {
  if (options.kind() == "rms") return rms_norm(x, weight, options.eps());
  return at::layer_norm(x.to(at::kFloat), {options.dim()}, weight, bias, options.eps()).to(x.scalar_type());
}

namespace {
HeadNorm make_qk_norm(const std::string& kind, int64_t head_dim, double eps) {
  return HeadNorm(HeadNormOptions(head_dim).kind(kind == "layer" ? "layer" : "rms").eps(eps));
}

void check_heads(const char* who, int64_t dim, int64_t heads, const std::string& qk_norm, const std::string& impl) {
  DEW_CHECK(dim > 0, who, ": dim must be > 0, got ", dim);
  DEW_CHECK(heads > 0 && dim % heads == 0, who, ": num_heads must be > 0 and divide dim ", dim, ", got ", heads);
  DEW_CHECK(qk_norm == "none" || qk_norm == "rms" || qk_norm == "layer", who,
            ": qk_norm must be \"none\", \"rms\" or \"layer\", got \"", qk_norm, "\"");
  check_attention_impl(impl, std::string(who) + ": impl");
}

}  // namespace

std::vector<Tensor> split_heads(const Tensor& t, int64_t n, int64_t heads) {
  // One view and one unbind: one backward node, not n.
  const int64_t B = t.size(0), S = t.size(1), dh = t.size(2) / (n * heads);
  return t.view({B, S, n, heads, dh}).permute({2, 0, 3, 1, 4}).unbind(0);
}

Tensor merge_heads(const Tensor& t) { return t.transpose(1, 2).reshape({t.size(0), t.size(2), t.size(1) * t.size(3)}); }

// ---- SelfAttention ----

SelfAttentionImpl::SelfAttentionImpl(SelfAttentionOptions options_) : options(std::move(options_)) {
  check_heads("SelfAttention", options.dim(), options.num_heads(), options.qk_norm(), options.impl());
  DEW_CHECK(options.dropout() >= 0 && options.dropout() < 1, "SelfAttention: dropout must be in [0, 1), got ",
            options.dropout());
  reset();
}

void SelfAttentionImpl::reset() {
  const int64_t d = options.dim();
  qkv = register_module("qkv", torch::nn::Linear(torch::nn::LinearOptions(d, 3 * d).bias(options.qkv_bias())));
  proj = register_module("proj", torch::nn::Linear(d, d));
  if (options.qk_norm() != "none") {
    const int64_t dh = d / options.num_heads();
    q_norm = register_module("q_norm", make_qk_norm(options.qk_norm(), dh, options.norm_eps()));
    k_norm = register_module("k_norm", make_qk_norm(options.qk_norm(), dh, options.norm_eps()));
  }
  reset_parameters();
}

void SelfAttentionImpl::reset_parameters() {
  // Xavier-uniform weights, zero biases (DiT / timm ViT).
  torch::NoGradGuard no_grad;
  for (auto* l : {&qkv, &proj}) {
    torch::nn::init::xavier_uniform_((*l)->weight);
    if ((*l)->bias.defined()) (*l)->bias.zero_();
  }
}

Tensor SelfAttentionImpl::forward(const Tensor& x, const Rope& rope, const Tensor& mask) {
  DEW_CHECK(x.dim() == 3 && x.size(2) == options.dim(), "SelfAttention: x must be [B, S, ", options.dim(), "], got ",
            x.sizes());
  auto qkv_ = split_heads(dense(x, qkv), 3, options.num_heads());  // 3 x [B, H, S, Dh]
  Tensor q = qkv_[0], k = qkv_[1], v = qkv_[2];
  if (!q_norm.is_empty()) {
    q = q_norm(q);
    k = k_norm(k);
  }
  q = apply_rope(q, rope);
  k = apply_rope(k, rope);
  Tensor o = attention(q, k, v, mask, options.impl(), options.force_fp32_for_softmax());
  o = dense(merge_heads(o), proj);  // [B, S, dim]
  return torch::dropout(o, options.dropout(), is_training());
}

// ---- CrossAttention ----

CrossAttentionImpl::CrossAttentionImpl(CrossAttentionOptions options_) : options(std::move(options_)) {
  check_heads("CrossAttention", options.dim(), options.num_heads(), options.qk_norm(), options.impl());
  DEW_CHECK(options.context_dim() > 0, "CrossAttention: context_dim must be > 0, got ", options.context_dim());
  DEW_CHECK(options.dropout() >= 0 && options.dropout() < 1, "CrossAttention: dropout must be in [0, 1), got ",
            options.dropout());
  reset();
}

void CrossAttentionImpl::reset() {
  const int64_t d = options.dim();
  q = register_module("q", torch::nn::Linear(d, d));
  kv = register_module("kv", torch::nn::Linear(options.context_dim(), 2 * d));
  proj = register_module("proj", torch::nn::Linear(d, d));
  if (options.qk_norm() != "none") {
    const int64_t dh = d / options.num_heads();
    q_norm = register_module("q_norm", make_qk_norm(options.qk_norm(), dh, options.norm_eps()));
    k_norm = register_module("k_norm", make_qk_norm(options.qk_norm(), dh, options.norm_eps()));
  }
  reset_parameters();
}

void CrossAttentionImpl::reset_parameters() {
  torch::NoGradGuard no_grad;
  for (auto* l : {&q, &kv, &proj}) {
    torch::nn::init::xavier_uniform_((*l)->weight);
    (*l)->bias.zero_();
  }
}

Tensor CrossAttentionImpl::forward(const Tensor& x, const Tensor& context, const Tensor& context_mask) {
  DEW_CHECK(x.dim() == 3 && x.size(2) == options.dim(), "CrossAttention: x must be [B, S, ", options.dim(), "], got ",
            x.sizes());
  DEW_CHECK(context.dim() == 3 && context.size(0) == x.size(0) && context.size(2) == options.context_dim(),
            "CrossAttention: context must be [", x.size(0), ", L, ", options.context_dim(), "], got ", context.sizes());
  const int64_t h = options.num_heads();
  Tensor qh = split_heads(dense(x, q), 1, h)[0];                         // [B, H, S, Dh]
  auto kvh = split_heads(dense(context.to(x.scalar_type()), kv), 2, h);  // 2 x [B, H, L, Dh]
  Tensor kh = kvh[0], vh = kvh[1];
  if (!q_norm.is_empty()) {
    qh = q_norm(qh);
    kh = k_norm(kh);
  }
  Tensor o = attention(qh, kh, vh, context_mask, options.impl(), options.force_fp32_for_softmax());
  o = dense(merge_heads(o), proj);
  return torch::dropout(o, options.dropout(), is_training());
}

}  // namespace dew::nn

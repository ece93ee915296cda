#include "dew/nn/diffusers_blocks.h"

#include <ATen/ATen.h>
#include <torch/nn/functional/padding.h>
#include <torch/nn/functional/upsampling.h>

#include <cmath>

#include "dew/core/error.h"

namespace dew::nn {

namespace {

torch::nn::Conv2d conv2d(int64_t in, int64_t out, int64_t kernel, int64_t stride = 1, int64_t padding = 0) {
  return torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, kernel).stride(stride).padding(padding));
}

// [B, S, H * D] -> [B, H, S, D]
Tensor split_heads(const Tensor& x, int64_t heads) { return x.view({x.size(0), x.size(1), heads, -1}).transpose(1, 2); }

}  // namespace

// ---- Downsample2D / Upsample2D ----

Downsample2DImpl::Downsample2DImpl(Downsample2DOptions options_) : options(options_) {
  DEW_CHECK(options.channels() > 0, "Downsample2D: channels must be > 0, got ", options.channels());
  DEW_CHECK(options.padding() == 0 || options.padding() == 1, "Downsample2D: padding must be 0 or 1, got ",
            options.padding());
  reset();
}

void Downsample2DImpl::reset() {
  conv = register_module("conv", conv2d(options.channels(), options.channels(), 3, 2, options.padding()));
}

Tensor Downsample2DImpl::forward(const Tensor& x) {
  DEW_CHECK(x.dim() == 4 && x.size(1) == options.channels(), "Downsample2D: x must be [B, ", options.channels(),
            ", H, W], got ", x.sizes());
  if (options.padding() == 1) return nn::conv(x, conv);
  // AutoencoderKL's encoder pads one zero row and column at the end (diffusers' Downsample2D, padding 0).
  namespace F = torch::nn::functional;
  return nn::conv(F::pad(x, F::PadFuncOptions({0, 1, 0, 1})), conv);
}

Upsample2DImpl::Upsample2DImpl(int64_t channels_) : channels(channels_) {
  DEW_CHECK(channels > 0, "Upsample2D: channels must be > 0, got ", channels);
  reset();
}

void Upsample2DImpl::reset() { conv = register_module("conv", conv2d(channels, channels, 3, 1, 1)); }

Tensor Upsample2DImpl::forward(const Tensor& x, at::IntArrayRef size) {
  DEW_CHECK(x.dim() == 4 && x.size(1) == channels, "Upsample2D: x must be [B, ", channels, ", H, W], got ", x.sizes());
  DEW_CHECK(size.empty() || size.size() == 2, "Upsample2D: size must be (H, W), got ", size);
  const Tensor up =
      size.empty() ? at::upsample_nearest2d(x, {2 * x.size(2), 2 * x.size(3)}) : at::upsample_nearest2d(x, size);
  return nn::conv(up, conv);
}

// ---- attention ----

DiffusersAttentionImpl::DiffusersAttentionImpl(DiffusersAttentionOptions options_) : options(std::move(options_)) {
  const auto& o = options;
  DEW_CHECK(o.features() > 0 && o.heads() > 0, "DiffusersAttention: features and heads must be > 0, got ", o.features(),
            " and ", o.heads());
  DEW_CHECK(o.head_features() > 0 || o.features() % o.heads() == 0, "DiffusersAttention: heads (", o.heads(),
            ") must divide features (", o.features(), ")");
  check_attention_impl(o.impl(), "attention_impl");
  reset();
}

void DiffusersAttentionImpl::reset() {
  const auto& o = options;
  const int64_t inner = o.heads() * (o.head_features() > 0 ? o.head_features() : o.features() / o.heads());
  const int64_t src = o.context_features() > 0 ? o.context_features() : o.features();
  to_q = register_module("to_q", torch::nn::Linear(torch::nn::LinearOptions(o.features(), inner).bias(o.qkv_bias())));
  to_k = register_module("to_k", torch::nn::Linear(torch::nn::LinearOptions(src, inner).bias(o.qkv_bias())));
  to_v = register_module("to_v", torch::nn::Linear(torch::nn::LinearOptions(src, inner).bias(o.qkv_bias())));
  out = torch::nn::Linear(inner, o.features());
  to_out = register_module("to_out", torch::nn::ModuleList(out));
}

Tensor DiffusersAttentionImpl::forward(const Tensor& x, const Tensor& context, const Tensor& mask) {
  const auto& o = options;
  const int64_t src = o.context_features() > 0 ? o.context_features() : o.features();
  DEW_CHECK(x.dim() == 3 && x.size(2) == o.features(), "attention: x must be [B, S, ", o.features(), "], got ",
            x.sizes());
  const Tensor& c = context.defined() ? context : x;
  DEW_CHECK(c.dim() == 3 && c.size(0) == x.size(0) && c.size(2) == src, "attention: the context must be [", x.size(0),
            ", L, ", src, "], got ", c.sizes());
  const Tensor q = split_heads(dense(x, to_q), o.heads());
  const Tensor k = split_heads(dense(c, to_k), o.heads());
  const Tensor v = split_heads(dense(c, to_v), o.heads());
  const Tensor a = attention(q, k, v, mask, o.impl(), o.force_fp32_for_softmax());  // [B, H, S, D]
  return dense(a.transpose(1, 2).reshape({x.size(0), x.size(1), -1}), out);
}

SpatialSelfAttentionImpl::SpatialSelfAttentionImpl(int64_t channels_, int64_t groups_, double eps_, std::string impl_)
    : channels(channels_), groups(groups_), eps(eps_), impl(std::move(impl_)) {
  DEW_CHECK(channels > 0 && groups > 0 && channels % groups == 0, "mid-block attention: groups (", groups,
            ") must divide channels (", channels, ")");
  reset();
}

void SpatialSelfAttentionImpl::reset() {
  group_norm =
      register_module("group_norm", torch::nn::GroupNorm(torch::nn::GroupNormOptions(groups, channels).eps(eps)));
  attn = DiffusersAttention(DiffusersAttentionOptions(channels, 1).qkv_bias(true).impl(impl));
  // The projections are this module's own children (diffusers: attentions.0.to_q ...), not attn.*.
  for (const auto& child : attn->named_children()) register_module(child.key(), child.value());
}

Tensor SpatialSelfAttentionImpl::forward(const Tensor& x) {
  DEW_CHECK(x.dim() == 4 && x.size(1) == channels, "mid-block attention: x must be [B, ", channels, ", H, W], got ",
            x.sizes());
  const int64_t b = x.size(0), h = x.size(2), w = x.size(3);
  const Tensor tokens = group_norm_fp32(x, group_norm).view({b, channels, h * w}).transpose(1, 2);  // [B, HW, C]
  return x + attn(tokens).transpose(1, 2).reshape({b, channels, h, w});
}

// ---- transformer ----

BasicTransformerBlockImpl::BasicTransformerBlockImpl(BasicTransformerBlockOptions options_)
    : options(std::move(options_)) {
  DEW_CHECK(!options.cross_only() || options.context_features() > 0,
            "transformer block: cross_only needs a context (context_features > 0)");
  reset();
}

void BasicTransformerBlockImpl::reset() {
  const auto& o = options;
  auto ln = [&] { return torch::nn::LayerNorm(torch::nn::LayerNormOptions({o.features()}).eps(o.norm_eps())); };
  auto attn_options = [&](int64_t context) {
    return DiffusersAttentionOptions(o.features(), o.heads())
        .context_features(context)
        .impl(o.impl())
        .force_fp32_for_softmax(o.force_fp32_for_softmax());
  };
  norm1 = register_module("norm1", ln());
  attn1 = register_module("attn1", DiffusersAttention(attn_options(o.cross_only() ? o.context_features() : 0)));
  if (o.context_features() > 0) {
    norm2 = register_module("norm2", ln());
    attn2 = register_module("attn2", DiffusersAttention(attn_options(o.context_features())));
  }
  norm3 = register_module("norm3", ln());
  // ff.net = [GEGLU(proj), Dropout, Linear]: the names of diffusers' FeedForward
  const int64_t inner = 4 * o.features();
  ff_in = torch::nn::Linear(o.features(), 2 * inner);
  ff_out = torch::nn::Linear(inner, o.features());
  auto geglu = std::make_shared<torch::nn::Module>();
  geglu->register_module("proj", ff_in);
  auto net = std::make_shared<torch::nn::Module>();
  net->register_module("0", geglu);
  net->register_module("2", ff_out);
  auto ff = std::make_shared<torch::nn::Module>();
  ff->register_module("net", net);
  register_module("ff", ff);
}

Tensor BasicTransformerBlockImpl::forward(const Tensor& x, const Tensor& context, const Tensor& mask) {
  const auto& o = options;
  DEW_CHECK(o.context_features() == 0 || context.defined(), "transformer block: a text context [B, L, ",
            o.context_features(), "] is required");
  const bool train = is_training() && o.dropout() > 0;
  auto drop = [&](const Tensor& t) { return train ? at::dropout(t, o.dropout(), true) : t; };
  Tensor h =
      x + drop(o.cross_only() ? attn1(layer_norm_affine(x, norm1), context, mask) : attn1(layer_norm_affine(x, norm1)));
  if (attn2) h = h + drop(attn2(layer_norm_affine(h, norm2), context, mask));
  const auto parts = dense(layer_norm_affine(h, norm3), ff_in).chunk(2, -1);  // hidden, gate
  const Tensor gated = parts[0] * at::gelu(parts[1], o.approximate_gelu() ? "tanh" : "none");
  return h + dense(drop(gated), ff_out);
}

Transformer2DImpl::Transformer2DImpl(Transformer2DOptions options_) : options(std::move(options_)) {
  const auto& o = options;
  DEW_CHECK(o.channels() > 0 && o.heads() > 0 && o.channels() % o.heads() == 0, "transformer: heads (", o.heads(),
            ") must divide the channels (", o.channels(), ")");
  DEW_CHECK(o.norm_groups() > 0 && o.channels() % o.norm_groups() == 0, "transformer: norm_groups (", o.norm_groups(),
            ") must divide the channels (", o.channels(), ")");
  DEW_CHECK(o.depth() >= 1, "transformer: depth must be >= 1, got ", o.depth());
  reset();
}

void Transformer2DImpl::reset() {
  const auto& o = options;
  const int64_t c = o.channels();
  norm =
      register_module("norm", torch::nn::GroupNorm(torch::nn::GroupNormOptions(o.norm_groups(), c).eps(o.norm_eps())));
  if (o.linear_projection()) proj_in_linear = register_module("proj_in", torch::nn::Linear(c, c));
  else proj_in_conv = register_module("proj_in", conv2d(c, c, 1));
  transformer_blocks = register_module("transformer_blocks", torch::nn::ModuleList());
  blocks.clear();
  for (int64_t i = 0; i < o.depth(); ++i) {
    BasicTransformerBlock b(BasicTransformerBlockOptions(c, o.heads())
                                .context_features(o.context_features())
                                .cross_only(o.cross_only())
                                .norm_eps(o.block_norm_eps())
                                .approximate_gelu(o.approximate_gelu())
                                .dropout(o.dropout())
                                .impl(o.impl())
                                .force_fp32_for_softmax(o.force_fp32_for_softmax()));
    transformer_blocks->push_back(b);
    blocks.push_back(b);
  }
  if (o.linear_projection()) proj_out_linear = register_module("proj_out", torch::nn::Linear(c, c));
  else proj_out_conv = register_module("proj_out", conv2d(c, c, 1));
}

Tensor Transformer2DImpl::forward(const Tensor& x, const Tensor& context, const Tensor& mask) {
  const auto& o = options;
  DEW_CHECK(x.dim() == 4 && x.size(1) == o.channels(), "transformer: x must be [B, ", o.channels(), ", H, W], got ",
            x.sizes());
  const int64_t b = x.size(0), c = o.channels(), h = x.size(2), w = x.size(3);
  const Tensor normed = group_norm_fp32(x, norm);
  Tensor t = o.linear_projection() ? dense(normed.view({b, c, h * w}).transpose(1, 2), proj_in_linear)
                                   : nn::conv(normed, proj_in_conv).view({b, c, h * w}).transpose(1, 2);
  for (auto& block : blocks) {
    if (o.remat() && is_training() && at::GradMode::is_enabled()) {
      std::vector<Tensor> in{t};
      if (context.defined()) in.push_back(context);
      const Tensor m = mask;
      t = remat(
          *block,
          [block, m](const std::vector<Tensor>& v) mutable { return block(v[0], v.size() > 1 ? v[1] : Tensor(), m); },
          in);
    } else {
      t = block(t, context, mask);
    }
  }
  const Tensor out = o.linear_projection() ? dense(t, proj_out_linear).transpose(1, 2).reshape({b, c, h, w})
                                           : nn::conv(t.transpose(1, 2).reshape({b, c, h, w}), proj_out_conv);
  return out + x;
}

// ---- time projection ----

Tensor timestep_embedding(const Tensor& t, int64_t dim, bool cosine_first, double shift, bool wide, double scale) {
  DEW_CHECK(t.dim() == 1, "timestep embedding: t must be [B], got ", t.sizes());
  DEW_CHECK(dim >= 2, "timestep embedding: dim must be >= 2, got ", dim);
  const int64_t half = dim / 2;
  // float32 throughout, as diffusers' get_timestep_embedding (timesteps.float()) computes it; wide: float64
  // throughout (float32 exp / sin / cos go through oneMKL kernels that differ in the last bit between CPUs, and a
  // frequency's last bit times t up to 1000 moves the result by up to 6e-5)
  const auto dt = wide ? at::kDouble : at::kFloat;
  const Tensor exponent = at::arange(0, half, at::TensorOptions().dtype(dt).device(t.device())) * (-std::log(10000.0)) /
                          (static_cast<double>(half) - shift);
  Tensor args = t.to(dt).unsqueeze(1) * at::exp(exponent).unsqueeze(0);  // [B, half]
  if (scale != 1.0) args = args * scale;
  Tensor emb = cosine_first ? at::cat({at::cos(args), at::sin(args)}, 1) : at::cat({at::sin(args), at::cos(args)}, 1);
  if (dim % 2 == 1) emb = at::constant_pad_nd(emb, {0, 1});
  return emb;
}

}  // namespace dew::nn

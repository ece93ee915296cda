#include "dew/nn/backbones/uvit.h"

#include <algorithm>
#include <cmath>

#include "dew/core/error.h"
#include "dew/nn/fused.h"
#include "dew/nn/scan.h"

namespace dew::nn {

using at::Tensor;

namespace {

void xavier_zero(torch::nn::Linear& l) {
  torch::nn::init::xavier_uniform_(l->weight);
  if (l->bias.defined()) l->bias.zero_();
}

}  // namespace

// ---- UViTAttention ----

UViTAttentionImpl::UViTAttentionImpl(int64_t dim_, int64_t num_heads_, std::string impl_, bool force_fp32_for_softmax_,
                                     double dropout_)
    : dim(dim_),
      num_heads(num_heads_),
      impl(std::move(impl_)),
      force_fp32_for_softmax(force_fp32_for_softmax_),
      dropout(dropout_) {
  DEW_CHECK(dim > 0 && num_heads > 0 && dim % num_heads == 0, "UViTAttention: dim must be divisible by num_heads, got ",
            dim, " / ", num_heads);
  reset();
}

void UViTAttentionImpl::reset() {
  auto lin = [&] { return torch::nn::Linear(torch::nn::LinearOptions(dim, dim).bias(false)); };
  to_q = register_module("to_q", lin());
  to_k = register_module("to_k", lin());
  to_v = register_module("to_v", lin());
  to_out = register_module("to_out", lin());
  reset_parameters();
}

void UViTAttentionImpl::reset_parameters() {
  torch::NoGradGuard no_grad;
  for (auto* l : {&to_q, &to_k, &to_v, &to_out}) xavier_zero(*l);
}

Tensor UViTAttentionImpl::forward(const Tensor& x, const Tensor& context, const Tensor& key_mask) {
  const int64_t B = x.size(0), S = x.size(1), L = context.size(1), hd = dim / num_heads;
  auto heads = [&](const Tensor& t, int64_t n) { return t.view({B, n, num_heads, hd}).transpose(1, 2); };
  Tensor q = heads(dense(x, to_q), S), k = heads(dense(context, to_k), L), v = heads(dense(context, to_v), L);
  Tensor o = attention(q, k, v, key_mask, impl, force_fp32_for_softmax);  // [B, H, S, hd]
  o = o.transpose(1, 2).reshape({B, S, dim});
  return torch::dropout(dense(o, to_out), dropout, is_training());
}

// ---- GegluMlp ----

GegluMlpImpl::GegluMlpImpl(int64_t dim_, int64_t hidden_, double dropout_)
    : dim(dim_), hidden(hidden_), dropout(dropout_) {
  DEW_CHECK(dim > 0 && hidden > 0, "GegluMlp: dim and hidden must be > 0, got ", dim, " and ", hidden);
  reset();
}

void GegluMlpImpl::reset() {
  net_0 = register_module("net_0", torch::nn::Linear(dim, 2 * hidden));
  net_2 = register_module("net_2", torch::nn::Linear(hidden, dim));
  reset_parameters();
}

void GegluMlpImpl::reset_parameters() {
  torch::NoGradGuard no_grad;
  xavier_zero(net_0);
  xavier_zero(net_2);
}

Tensor GegluMlpImpl::forward(const Tensor& x) {
  auto ag = dense(x, net_0).chunk(2, -1);  // the linear half first, then the gate (as FlaxGEGLU)
  return torch::dropout(dense(ag[0] * gelu_tanh(ag[1]), net_2), dropout, is_training());
}

// ---- UViTBlock ----

UViTBlockImpl::UViTBlockImpl(const UViTOptions& options_) : options(options_) { reset(); }

void UViTBlockImpl::reset() {
  const auto& o = options;
  const int64_t d = o.emb_features();
  auto rms = [&] { return HeadNorm(HeadNormOptions(d).kind("rms").eps(o.norm_epsilon())); };
  auto attn = [&] {
    return UViTAttention(d, o.num_heads(), o.attention_impl(), o.force_fp32_for_softmax(), o.dropout_rate());
  };
  if (o.norm_inputs()) norm_in = register_module("norm_in", rms());
  // FlaxDiff's inner width is heads * (D / heads) = D, so both projections are D -> D.
  if (o.use_projection())
    project_in = register_module("project_in", torch::nn::Linear(torch::nn::LinearOptions(d, d).bias(false)));
  if (o.use_self_and_cross()) {
    norm1 = register_module("norm1", rms());
    attn1 = register_module("attn1", attn());
  }
  norm2 = register_module("norm2", rms());
  attn2 = register_module("attn2", attn());
  norm3 = register_module("norm3", rms());
  const auto hidden = static_cast<int64_t>(o.mlp_ratio() * static_cast<double>(d));
  ff = register_module("ff", GegluMlp(d, hidden, o.dropout_rate()));
  if (o.use_projection())
    project_out = register_module("project_out", torch::nn::Linear(torch::nn::LinearOptions(d, d).bias(false)));
  reset_parameters();
}

void UViTBlockImpl::reset_parameters() {
  torch::NoGradGuard no_grad;
  if (!project_in.is_empty()) xavier_zero(project_in);
  if (!project_out.is_empty()) xavier_zero(project_out);
}

Tensor UViTBlockImpl::forward(const Tensor& x_in, const Tensor& key_mask) {
  const auto& o = options;
  const Tensor x = o.norm_inputs() ? norm_in(x_in) : x_in;
  Tensor h = o.use_projection() ? dense(x, project_in) : x;
  const Tensor ctx = h;  // the second attention's keys and values: the block body's un-normed input
  if (o.use_self_and_cross()) {
    const Tensor n = norm1(h);
    h = h + attn1(n, n, key_mask);
  }
  h = h + attn2(norm2(h), ctx, key_mask);
  h = h + ff(norm3(h));
  if (o.use_projection()) h = dense(h, project_out);
  return o.explicitly_add_residual() ? x + h : h;
}

// ---- UViT ----

UViTImpl::UViTImpl(UViTOptions options_) : options(std::move(options_)) {
  const auto& o = options;
  const std::string w = "uvit";
  DEW_CHECK(o.patch_size() > 0, w, ": patch_size must be > 0, got ", o.patch_size());
  DEW_CHECK(o.in_channels() > 0, w, ": in_channels must be > 0, got ", o.in_channels());
  DEW_CHECK(o.output_channels() > 0, w, ": output_channels must be > 0, got ", o.output_channels());
  DEW_CHECK(o.num_layers() > 0 && o.num_layers() % 2 == 0, w,
            ": num_layers must be even and > 0 (num_layers / 2 down blocks, one mid block, num_layers / 2 up "
            "blocks), got ",
            o.num_layers());
  DEW_CHECK(o.num_heads() > 0, w, ": num_heads must be > 0, got ", o.num_heads());
  DEW_CHECK(o.emb_features() > 0 && o.emb_features() % 2 == 0, w, ": emb_features must be even and > 0, got ",
            o.emb_features());
  DEW_CHECK(o.emb_features() % o.num_heads() == 0, w, ": emb_features must be divisible by num_heads, got ",
            o.emb_features(), " / ", o.num_heads());
  DEW_CHECK(o.mlp_ratio() > 0 && o.mlp_ratio() * static_cast<double>(o.emb_features()) >= 1, w,
            ": mlp_ratio must be > 0 (hidden width >= 1), got ", o.mlp_ratio());
  DEW_CHECK(o.dropout_rate() >= 0 && o.dropout_rate() < 1, w, ": dropout_rate must be in [0, 1), got ",
            o.dropout_rate());
  DEW_CHECK(o.norm_epsilon() > 0, w, ": norm_epsilon must be > 0, got ", o.norm_epsilon());
  DEW_CHECK(o.image_size() >= o.patch_size(), w, ": image_size must be >= patch_size (", o.patch_size(), "), got ",
            o.image_size());
  DEW_CHECK(o.num_classes() >= 0, w, ": num_classes must be >= 0, got ", o.num_classes());
  DEW_CHECK(o.context_features() >= 0, w, ": context_features must be >= 0, got ", o.context_features());
  const auto& acts = activations();
  DEW_CHECK(std::find(acts.begin(), acts.end(), o.activation()) != acts.end(), w, ".activation: got \"", o.activation(),
            "\", accepted: swish, silu, gelu, gelu_tanh, relu, mish");
  dtype_ = parse_compute_dtype(o.dtype(), w + ".dtype");
  check_attention_impl(o.attention_impl(), w + ".attention_impl");
  reset();
}

void UViTImpl::reset() {
  const auto& o = options;
  const int64_t d = o.emb_features(), p = o.patch_size(), half = o.num_layers() / 2;
  const int64_t side = o.image_size() / p;
  x_embedder =
      register_module("x_embedder", torch::nn::Conv2d(torch::nn::Conv2dOptions(o.in_channels(), d, p).stride(p)));
  pos_encoding = register_parameter("pos_encoding", at::zeros({side * side, d}));
  t_embedder = register_module("t_embedder", TimeEmbedding(d));
  if (o.num_classes() > 0) y_embedder = register_module("y_embedder", torch::nn::Embedding(o.num_classes() + 1, d));
  if (o.context_features() > 0)
    context_embedder = register_module("context_embedder", torch::nn::Linear(o.context_features(), d));
  down_blocks = register_module("down_blocks", torch::nn::ModuleList());
  mid_block = register_module("mid_block", UViTBlock(o));
  up_dense = register_module("up_dense", torch::nn::ModuleList());
  up_blocks = register_module("up_blocks", torch::nn::ModuleList());
  down_list.clear();
  up_list.clear();
  up_dense_list.clear();
  for (int64_t i = 0; i < half; ++i) {
    UViTBlock down(o), up(o);
    torch::nn::Linear fuse(2 * d, d);
    down_blocks->push_back(down);
    down_list.push_back(down);
    up_dense->push_back(fuse);
    up_dense_list.push_back(fuse);
    up_blocks->push_back(up);
    up_list.push_back(up);
  }
  final_norm =
      register_module("final_norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d}).eps(o.norm_epsilon())));
  final_proj = register_module("final_proj", torch::nn::Linear(d, p * p * o.output_channels()));
  if (o.add_residualblock_output()) {
    constexpr int64_t kMid = 64;  // the original's refinement width
    final_conv1 = register_module(
        "final_conv1",
        torch::nn::Conv2d(torch::nn::Conv2dOptions(o.in_channels() + o.output_channels(), kMid, 3).padding(1)));
    final_norm_conv = register_module("final_norm_conv",
                                      torch::nn::LayerNorm(torch::nn::LayerNormOptions({kMid}).eps(o.norm_epsilon())));
    final_conv2 = register_module("final_conv2",
                                  torch::nn::Conv2d(torch::nn::Conv2dOptions(kMid, o.output_channels(), 3).padding(1)));
  }
  reset_parameters();
}

void UViTImpl::reset_parameters() {
  torch::NoGradGuard no_grad;
  const auto& w = x_embedder->weight;  // xavier over the flattened [D, C p p] kernel, as a Linear
  torch::nn::init::xavier_uniform_(w.view({w.size(0), -1}));
  x_embedder->bias.zero_();
  pos_encoding.normal_(0.0, 0.02);
  if (!y_embedder.is_empty()) y_embedder->weight.normal_(0.0, 0.02);
  if (!context_embedder.is_empty()) xavier_zero(context_embedder);
  // flax's Dense default, as the original's up_dense: LeCun normal kernel (std 1/sqrt(fan_in)), zero bias.
  for (auto& fuse : up_dense_list) {
    fuse->weight.normal_(0.0, 1.0 / std::sqrt(static_cast<double>(fuse->weight.size(1))));
    fuse->bias.zero_();
  }
  // Zero-initialised output projection: the model starts by predicting 0 (before the optional refinement).
  final_proj->weight.zero_();
  final_proj->bias.zero_();
}

Tensor UViTImpl::run_block(UViTBlock& block, const Tensor& h, const Tensor& key_mask) {
  if (!options.remat()) return block(h, key_mask);
  // Captured by value: backward runs the function after this frame is gone.
  return remat(*block, [block, key_mask](const std::vector<Tensor>& in) mutable { return block(in[0], key_mask); },
               {h});
}

Tensor UViTImpl::forward(const Tensor& x, const Tensor& time_in, const Conditioning& cond) {
  cond.check_inputs("uvit", /*takes_pooled=*/false);
  const auto& o = options;
  const int64_t p = o.patch_size();
  DEW_CHECK(x.dim() == 4 && x.size(1) == o.in_channels(), "uvit: x must be [B, ", o.in_channels(), ", H, W], got ",
            x.sizes());
  DEW_CHECK(x.size(2) % p == 0 && x.size(3) % p == 0, "uvit: H and W must be multiples of patch_size ", p, ", got ",
            x.size(2), " x ", x.size(3));
  const int64_t B = x.size(0), gh = x.size(2) / p, gw = x.size(3) / p, N = gh * gw;
  DEW_CHECK(N <= pos_encoding.size(0), "uvit: ", x.size(2), " x ", x.size(3), " gives ", N,
            " patches, more than the position table's ", pos_encoding.size(0), " rows (image_size ", o.image_size(),
            "); raise image_size");
  const Tensor time = time_in.to(x.device());
  DEW_CHECK(time.dim() == 0 || (time.dim() == 1 && time.size(0) == B), "uvit: time must be [", B, "] or a scalar, got ",
            time.sizes());

  // Patches in raster order; a smaller grid uses the first N rows of the table (as the original).
  Tensor patches = conv(x.to(dtype_), x_embedder).flatten(2).transpose(1, 2);  // [B, N, D]
  patches = patches + pos_encoding.narrow(0, 0, N).to(dtype_);
  std::vector<Tensor> tokens{patches};
  // Time token: Fourier features -> Dense -> GELU -> Dense -> GELU (FlaxDiff's TimeProjection).
  auto& te = t_embedder;
  Tensor tf = te->fourier(time.dim() == 0 ? time.expand({B}) : time).to(dtype_);
  tokens.push_back(gelu_tanh(dense(gelu_tanh(dense(tf, te->linear_1)), te->linear_2)).unsqueeze(1));
  if (o.num_classes() > 0) {
    Tensor labels = cond.labels.defined() ? cond.labels : at::full({B}, o.num_classes(), x.options().dtype(at::kLong));
    DEW_CHECK(labels.dim() == 1 && labels.size(0) == B, "uvit: labels must be [", B, "], got ", labels.sizes());
    DEW_CHECK(!(labels.lt(0) | labels.gt(o.num_classes())).any().item<bool>(), "uvit: labels must lie in [0, ",
              o.num_classes(), "] (", o.num_classes(), " = null class)");
    tokens.push_back(at::embedding(y_embedder->weight.to(dtype_), labels.to(at::kLong)).unsqueeze(1));
  } else {
    DEW_CHECK(!cond.labels.defined(), "uvit: labels given but num_classes is 0");
  }
  Tensor key_mask;
  if (cond.context.defined()) {
    DEW_CHECK(o.context_features() > 0, "uvit: a text context was given but context_features is 0");
    DEW_CHECK(cond.context.dim() == 3 && cond.context.size(0) == B && cond.context.size(2) == o.context_features(),
              "uvit: context must be [", B, ", L, ", o.context_features(), "], got ", cond.context.sizes());
    const int64_t L = cond.context.size(1);
    tokens.push_back(dense(cond.context.to(x.device()).to(dtype_), context_embedder));  // [B, L, D]
    if (cond.context_mask.defined()) {
      DEW_CHECK(cond.context_mask.dim() == 2 && cond.context_mask.size(0) == B && cond.context_mask.size(1) == L,
                "uvit: context_mask must be [", B, ", ", L, "], got ", cond.context_mask.sizes());
      const int64_t lead = N + static_cast<int64_t>(tokens.size()) - 2;  // patches + time (+ label)
      key_mask = at::cat(
          {at::ones({B, lead}, x.options().dtype(at::kBool)), cond.context_mask.to(x.device()).to(at::kBool)}, 1);
    }
  }
  Tensor h = at::cat(tokens, 1);  // [B, N + 1 (+ 1) (+ L), D]

  std::vector<Tensor> skips;
  skips.reserve(down_list.size());
  for (auto& block : down_list) {
    h = run_block(block, h, key_mask);
    skips.push_back(h);
  }
  h = run_block(mid_block, h, key_mask);
  for (size_t i = 0; i < up_list.size(); ++i) {
    h = dense(at::cat({h, skips.back()}, -1), up_dense_list[i]);  // [B, S, 2D] -> [B, S, D]
    skips.pop_back();
    h = run_block(up_list[i], h, key_mask);
  }

  Tensor out = dense(layer_norm_affine(h, final_norm).narrow(1, 0, N), final_proj);  // [B, N, p p out]
  Scan raster;
  raster.order = "raster";
  raster.h = gh;
  raster.w = gw;
  Tensor image = unpatchify(out, p, raster);  // [B, out, H, W]
  if (!o.add_residualblock_output()) return image.to(at::kFloat);
  Tensor r = conv(at::cat({x.to(dtype_), image}, 1), final_conv1);                        // [B, 64, H, W]
  r = layer_norm_affine(r.permute({0, 2, 3, 1}), final_norm_conv).permute({0, 3, 1, 2});  // over channels
  r = activation(r, o.activation());
  return conv(r.to(at::kFloat), final_conv2);  // the original runs this conv in float32
}

}  // namespace dew::nn

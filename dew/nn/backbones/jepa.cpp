#include "dew/nn/backbones/jepa.h"

#include <ATen/ATen.h>
#include <torch/nn/init.h>

#include <cmath>

#include "dew/core/error.h"
#include "dew/nn/embeddings.h"

namespace dew::nn {

namespace {

// I-JEPA's initialisation: linear and conv weights from N(0, std) truncated at +-2 (absolute, as
// timm's trunc_normal_; at std 0.02 the bound never binds, so a plain normal draw is the same law), zero
// biases, unit LayerNorms; then each block's output projections scaled by 1 / sqrt(2 * depth index).
void init_vit(torch::nn::Module& root, double std, torch::nn::ModuleList& blocks) {
  torch::NoGradGuard ng;
  for (auto& m : root.modules(/*include_self=*/false)) {
    if (auto* l = m->as<torch::nn::Linear>()) {
      l->weight.normal_(0.0, std);
      if (l->bias.defined()) l->bias.zero_();
    } else if (auto* c = m->as<torch::nn::Conv2d>()) {
      c->weight.normal_(0.0, std);
      if (c->bias.defined()) c->bias.zero_();
    } else if (auto* c3 = m->as<torch::nn::Conv3d>()) {
      c3->weight.normal_(0.0, std);
      if (c3->bias.defined()) c3->bias.zero_();
    } else if (auto* n = m->as<torch::nn::LayerNorm>()) {
      n->weight.fill_(1.0);
      n->bias.zero_();
    }
  }
  for (size_t i = 0; i < blocks->size(); ++i) {
    auto b = blocks[i]->as<ViTBlockImpl>();
    const double s = 1.0 / std::sqrt(2.0 * double(i + 1));
    b->attn->proj->weight.mul_(s);
    b->mlp->fc2->weight.mul_(s);
  }
}

torch::nn::ModuleList make_blocks(int64_t n, int64_t dim, int64_t heads, double mlp_ratio, double eps,
                                  const std::string& impl) {
  torch::nn::ModuleList list;
  for (int64_t i = 0; i < n; ++i) list->push_back(ViTBlock(dim, heads, mlp_ratio, eps, impl));
  return list;
}

void check_width(const std::string& where, int64_t dim, int64_t heads, int64_t layers, double mlp_ratio, bool video) {
  DEW_CHECK(layers >= 1, where, ".num_layers: must be >= 1, got ", layers);
  DEW_CHECK(heads >= 1 && dim >= 1 && dim % heads == 0, where,
            ".emb_features: must be a positive multiple of num_heads ", heads, ", got ", dim);
  DEW_CHECK(dim % (video ? 8 : 4) == 0, where, ".emb_features: the ", video ? "3D" : "2D",
            " sin-cos table needs a multiple of ", video ? 8 : 4, ", got ", dim);
  DEW_CHECK(mlp_ratio > 0, where, ".mlp_ratio: must be > 0, got ", mlp_ratio);
}

}  // namespace

TokenGrid jepa_grid(int64_t image_size, int64_t patch_size, int64_t frames, int64_t tubelet_size,
                    const std::string& where) {
  DEW_CHECK(patch_size >= 1, where, ".patch_size: must be >= 1, got ", patch_size);
  DEW_CHECK(image_size >= patch_size && image_size % patch_size == 0, where,
            ".image_size: must be a positive multiple of patch_size ", patch_size, ", got ", image_size);
  DEW_CHECK(frames >= 0, where, ".frames: must be >= 0 (0 = images), got ", frames);
  TokenGrid g;
  g.h = g.w = image_size / patch_size;
  if (frames > 0) {
    DEW_CHECK(tubelet_size >= 1 && frames % tubelet_size == 0, where, ".tubelet_size: must divide frames ", frames,
              ", got ", tubelet_size);
    g.t = frames / tubelet_size;
  }
  return g;
}

at::Tensor jepa_position_table(int64_t dim, const TokenGrid& g, bool video) {
  if (!video) return sincos_2d_table(dim, g.h, g.w);  // I-JEPA: the column in the first half
  // V-JEPA's get_3d_sincos_pos_embed: [time (D/2), row (D/4), column (D/4)] per token, raster (t, h, w).
  const int64_t n = g.tokens();
  at::Tensor idx = at::arange(n, at::kLong);
  at::Tensor t = idx.div(g.h * g.w, "floor"), h = idx.div(g.w, "floor").remainder(g.h), w = idx.remainder(g.w);
  return at::cat({sincos_1d_table(dim / 2, t), sincos_1d_table(dim / 4, h), sincos_1d_table(dim / 4, w)}, 1);
}

at::Tensor gather_tokens(const at::Tensor& tokens, const at::Tensor& idx) {
  DEW_CHECK(tokens.dim() == 3, "gather_tokens: tokens must be [B, N, D], got ", tokens.sizes());
  DEW_CHECK(idx.dim() == 2 && idx.size(0) == tokens.size(0) && idx.scalar_type() == at::kLong,
            "gather_tokens: indices must be int64 [", tokens.size(0), ", K], got ", idx.scalar_type(), " ",
            idx.sizes());
  if (idx.numel() > 0) {
    const auto lo = idx.min().item<int64_t>(), hi = idx.max().item<int64_t>();
    DEW_CHECK(lo >= 0 && hi < tokens.size(1), "gather_tokens: token indices must be in [0, ", tokens.size(1),
              "), got [", lo, ", ", hi, "]");
  }
  return tokens.gather(1, idx.to(tokens.device()).unsqueeze(-1).expand({idx.size(0), idx.size(1), tokens.size(2)}));
}

// ---- ViT block, patch embedding ----

ViTBlockImpl::ViTBlockImpl(int64_t dim, int64_t heads, double mlp_ratio, double eps, const std::string& impl) {
  auto ln = torch::nn::LayerNormOptions({dim}).eps(eps);
  norm1 = register_module("norm1", torch::nn::LayerNorm(ln));
  attn = register_module("attn", SelfAttention(SelfAttentionOptions(dim, heads).qkv_bias(true).impl(impl)));
  norm2 = register_module("norm2", torch::nn::LayerNorm(ln));
  mlp = register_module("mlp", Mlp(MlpOptions(dim, int64_t(double(dim) * mlp_ratio)).activation("gelu")));
}

at::Tensor ViTBlockImpl::forward(const at::Tensor& x) {
  at::Tensor h = x + attn->forward(norm1->forward(x));
  return h + mlp->forward(norm2->forward(h));
}

PatchEmbedImpl::PatchEmbedImpl(int64_t in_channels, int64_t dim, int64_t patch, int64_t tubelet, bool video) {
  if (video)
    proj3d = register_module(
        "proj",
        torch::nn::Conv3d(
            torch::nn::Conv3dOptions(in_channels, dim, {tubelet, patch, patch}).stride({tubelet, patch, patch})));
  else
    proj2d =
        register_module("proj", torch::nn::Conv2d(torch::nn::Conv2dOptions(in_channels, dim, patch).stride(patch)));
}

at::Tensor PatchEmbedImpl::forward(const at::Tensor& x) {
  at::Tensor y = proj3d ? proj3d->forward(x) : proj2d->forward(x);  // [B, D, (T'), H', W']
  return y.flatten(2).transpose(1, 2);
}

// ---- encoder ----

JepaEncoderImpl::JepaEncoderImpl(JepaEncoderOptions o) : options(std::move(o)) {
  const std::string where = video() ? "jepa_video_encoder" : "jepa_encoder";
  grid_ = jepa_grid(options.image_size(), options.patch_size(), options.frames(), options.tubelet_size(), where);
  DEW_CHECK(options.in_channels() >= 1, where, ".in_channels: must be >= 1, got ", options.in_channels());
  check_width(where, options.emb_features(), options.num_heads(), options.num_layers(), options.mlp_ratio(), video());
  DEW_CHECK(options.norm_eps() > 0, where, ".norm_eps: must be > 0, got ", options.norm_eps());
  check_attention_impl(options.attention_impl(), where + ".attention_impl");
  reset();
}

void JepaEncoderImpl::reset() {
  const int64_t d = options.emb_features();
  patch_embed = register_module(
      "patch_embed", PatchEmbed(options.in_channels(), d, options.patch_size(), options.tubelet_size(), video()));
  pos_embed = register_buffer("pos_embed", jepa_position_table(d, grid_, video()).unsqueeze(0));
  blocks = register_module("blocks", make_blocks(options.num_layers(), d, options.num_heads(), options.mlp_ratio(),
                                                 options.norm_eps(), options.attention_impl()));
  norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d}).eps(options.norm_eps())));
  reset_parameters();
}

void JepaEncoderImpl::reset_parameters() { init_vit(*this, options.init_std(), blocks); }

at::Tensor JepaEncoderImpl::forward(const at::Tensor& x, const at::Tensor& keep) {
  const int64_t s = options.image_size(), c = options.in_channels();
  if (video())
    DEW_CHECK(x.dim() == 5 && x.size(1) == c && x.size(2) == options.frames() && x.size(3) == s && x.size(4) == s,
              "jepa_video_encoder: x must be [B, ", c, ", ", options.frames(), ", ", s, ", ", s, "], got ", x.sizes());
  else
    DEW_CHECK(x.dim() == 4 && x.size(1) == c && x.size(2) == s && x.size(3) == s, "jepa_encoder: x must be [B, ", c,
              ", ", s, ", ", s, "], got ", x.sizes());
  at::Tensor h = patch_embed->forward(x) + pos_embed.to(x.dtype());
  if (keep.defined()) h = gather_tokens(h, keep);
  for (const auto& b : *blocks) h = b->as<ViTBlockImpl>()->forward(h);
  return norm->forward(h);
}

// ---- predictor ----

JepaPredictorImpl::JepaPredictorImpl(JepaPredictorOptions o) : options(std::move(o)) {
  const std::string where = "jepa_predictor";
  grid_ = jepa_grid(options.image_size(), options.patch_size(), options.frames(), options.tubelet_size(), where);
  DEW_CHECK(options.encoder_features() >= 1, where, ".encoder_features: must be >= 1, got ",
            options.encoder_features());
  check_width(where, options.emb_features(), options.num_heads(), options.num_layers(), options.mlp_ratio(),
              options.frames() > 0);
  DEW_CHECK(options.norm_eps() > 0, where, ".norm_eps: must be > 0, got ", options.norm_eps());
  check_attention_impl(options.attention_impl(), where + ".attention_impl");
  reset();
}

void JepaPredictorImpl::reset() {
  const int64_t p = options.emb_features(), e = options.encoder_features();
  predictor_embed = register_module("predictor_embed", torch::nn::Linear(e, p));
  mask_token = register_parameter("mask_token", at::zeros({1, 1, p}));
  predictor_pos_embed =
      register_buffer("predictor_pos_embed", jepa_position_table(p, grid_, options.frames() > 0).unsqueeze(0));
  predictor_blocks =
      register_module("predictor_blocks", make_blocks(options.num_layers(), p, options.num_heads(), options.mlp_ratio(),
                                                      options.norm_eps(), options.attention_impl()));
  predictor_norm =
      register_module("predictor_norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({p}).eps(options.norm_eps())));
  predictor_proj = register_module("predictor_proj", torch::nn::Linear(p, e));
  reset_parameters();
}

void JepaPredictorImpl::reset_parameters() {
  init_vit(*this, options.init_std(), predictor_blocks);
  torch::NoGradGuard ng;
  mask_token.normal_(0.0, options.init_std());
}

at::Tensor JepaPredictorImpl::forward(const at::Tensor& context, const at::Tensor& context_idx,
                                      const at::Tensor& targets) {
  const int64_t e = options.encoder_features();
  DEW_CHECK(context.dim() == 3 && context.size(2) == e, "jepa_predictor: context must be [B, Kc, ", e, "], got ",
            context.sizes());
  const int64_t b = context.size(0);
  DEW_CHECK(context_idx.dim() == 2 && context_idx.size(0) == b && context_idx.size(1) == context.size(1),
            "jepa_predictor: context_idx must be [", b, ", ", context.size(1), "], got ", context_idx.sizes());
  DEW_CHECK(targets.dim() == 3 && targets.size(1) == b && targets.size(0) >= 1 && targets.size(2) >= 1,
            "jepa_predictor: targets must be [M, ", b, ", Kt] with M, Kt >= 1, got ", targets.sizes());
  const int64_t m = targets.size(0), kc = context.size(1), kt = targets.size(2), n = grid_.tokens();
  for (const at::Tensor* idx : {&context_idx, &targets}) {
    DEW_CHECK(idx->scalar_type() == at::kLong, "jepa_predictor: token indices must be int64, got ", idx->scalar_type());
    const auto lo = idx->min().item<int64_t>(), hi = idx->max().item<int64_t>();
    DEW_CHECK(lo >= 0 && hi < n, "jepa_predictor: token indices must be in [0, ", n, "), got [", lo, ", ", hi, "]");
  }
  // Rows of the position table at the indices (the same values I-JEPA gathers from its batch-repeated table).
  const at::Tensor table = predictor_pos_embed[0].to(context.dtype());  // [N, P]
  const auto rows = [&](const at::Tensor& idx) {
    return table.index_select(0, idx.reshape({-1}).to(table.device())).view({idx.size(0), idx.size(1), -1});
  };
  at::Tensor x = predictor_embed->forward(context) + rows(context_idx);  // [B, Kc, P]
  // Block m of item b sits at row m * B + b, as I-JEPA's apply_masks concatenates its masks.
  const at::Tensor tpos = rows(targets.reshape({m * b, kt}));  // [M B, Kt, P]
  at::Tensor h = at::cat({x.repeat({m, 1, 1}), mask_token.to(context.dtype()) + tpos}, 1);
  for (const auto& blk : *predictor_blocks) h = blk->as<ViTBlockImpl>()->forward(h);
  h = predictor_norm->forward(h).slice(1, kc);
  return predictor_proj->forward(h);
}

}  // namespace dew::nn

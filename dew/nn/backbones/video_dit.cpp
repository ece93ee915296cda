#include "dew/nn/backbones/video_dit.h"

#include "dew/core/error.h"
#include "dew/nn/backbones/dit_common.h"

namespace dew::nn {

using at::Tensor;

// ---- VideoDiTBlock ----

VideoDiTBlockImpl::VideoDiTBlockImpl(DiTBlockOptions options_) : options(std::move(options_)) {
  DEW_CHECK(options.mlp_ratio() > 0, "VideoDiTBlock: mlp_ratio must be > 0, got ", options.mlp_ratio());
  DEW_CHECK(options.norm_eps() > 0, "VideoDiTBlock: norm_eps must be > 0, got ", options.norm_eps());
  reset();
}

void VideoDiTBlockImpl::reset() {
  const auto& o = options;
  const int64_t d = o.dim();
  auto self_attention = [&] {
    return SelfAttention(SelfAttentionOptions(d, o.num_heads())
                             .qk_norm(o.qk_norm() ? "rms" : "none")
                             .norm_eps(1e-6)
                             .impl(o.attention_impl())
                             .force_fp32_for_softmax(o.force_fp32_for_softmax())
                             .dropout(o.dropout()));
  };
  adaLN_modulation = register_module("adaLN_modulation", torch::nn::Linear(d, 9 * d));
  attn = register_module("attn", self_attention());
  temporal_attn = register_module("temporal_attn", self_attention());
  const auto hidden = static_cast<int64_t>(o.mlp_ratio() * static_cast<double>(d));
  mlp = register_module("mlp", Mlp(MlpOptions(d, hidden).activation("gelu_tanh").dropout(o.dropout())));
  reset_parameters();
}

void VideoDiTBlockImpl::reset_parameters() {
  // adaLN-Zero: the three gates start at 0, so the block starts as the identity.
  torch::NoGradGuard no_grad;
  adaLN_modulation->weight.zero_();
  adaLN_modulation->bias.zero_();
}

Tensor VideoDiTBlockImpl::forward(const Tensor& x, const Tensor& c, int64_t frames, const Rope& rope_spatial,
                                  const Rope& rope_temporal) {
  const int64_t D = options.dim();
  DEW_CHECK(x.dim() == 3 && x.size(2) == D && frames > 0 && x.size(1) % frames == 0 && c.dim() == 2 &&
                c.size(0) == x.size(0) && c.size(1) == D,
            "VideoDiTBlock: x must be [B, T*N, ", D, "] with T = ", frames, " and c [B, ", D, "], got ", x.sizes(),
            " and ", c.sizes());
  const int64_t B = x.size(0), T = frames, N = x.size(1) / frames;
  const auto m = dense(at::silu(c.to(x.scalar_type())), adaLN_modulation).chunk(9, 1);  // 9 x [B, D]
  const double eps = options.norm_eps();
  // Modulation is per video, so it applies to [B, T N, D] before the tokens are regrouped.
  // Spatial: the N patches of each frame attend to each other; tokens [B T, N, D].
  Tensor s = modulate(layer_norm_fp32(x, eps), m[0], m[1]).reshape({B * T, N, D});
  s = attn(s, rope_spatial).reshape({B, T * N, D});
  Tensor h = x + m[2].unsqueeze(1) * s;
  // Temporal: the T frames at each patch position attend to each other; tokens [B N, T, D].
  Tensor t = modulate(layer_norm_fp32(h, eps), m[3], m[4]).view({B, T, N, D}).transpose(1, 2).reshape({B * N, T, D});
  t = temporal_attn(t, rope_temporal).view({B, N, T, D}).transpose(1, 2).reshape({B, T * N, D});
  h = h + m[5].unsqueeze(1) * t;
  return h + m[8].unsqueeze(1) * mlp(modulate(layer_norm_fp32(h, eps), m[6], m[7]));
}

// ---- VideoDiT ----

VideoDiTImpl::VideoDiTImpl(VideoDiTOptions options_) : options(std::move(options_)) {
  const auto& o = options;
  const std::string w = "video_dit";
  check_dit_fields(o, w);
  DEW_CHECK(o.context_features() >= 0, w, ": context_features must be >= 0, got ", o.context_features());
  dtype_ = checked_compute_fields(o, w);
  reset();
}

void VideoDiTImpl::reset() {
  const auto& o = options;
  const int64_t d = o.emb_features(), p = o.patch_size();
  register_dit_embedders(*this, o);
  blocks = register_module("blocks", torch::nn::ModuleList());
  block_list.clear();
  for (int64_t i = 0; i < o.num_layers(); ++i) {
    VideoDiTBlock b(dit_block_options<DiTBlockOptions>(o, d, o.num_heads()));
    blocks->push_back(b);
    block_list.push_back(b);
  }
  final_layer = register_module(
      "final_layer", FinalLayer(FinalLayerOptions(d, p * p * o.output_channels()).norm_eps(o.norm_epsilon())));
  reset_parameters();
}

void VideoDiTImpl::reset_parameters() {
  // DiT's initialisation; the blocks and the final layer initialise themselves (adaLN-Zero, zero output).
  init_dit_embedders(x_embedder, y_embedder, {context_embedder});
}

Tensor VideoDiTImpl::condition(const Tensor& time, const Conditioning& cond, int64_t batch) {
  return dit_condition(t_embedder, y_embedder, context_embedder, options.num_classes(), options.context_features(),
                       time, cond, batch, dtype_, "video_dit");
}

Tensor VideoDiTImpl::forward(const Tensor& x, const Tensor& time, const Conditioning& cond) {
  cond.check_inputs("video_dit", /*takes_pooled=*/false);
  const auto& o = options;
  const int64_t p = o.patch_size(), D = o.emb_features();
  DEW_CHECK(x.dim() == 5 && x.size(1) == o.in_channels() && x.size(2) > 0, "video_dit: x must be [B, ", o.in_channels(),
            ", T, H, W] with T >= 1, got ", x.sizes());
  DEW_CHECK(x.size(3) % p == 0 && x.size(4) % p == 0, "video_dit: H and W must be multiples of patch_size ", p,
            ", got ", x.size(3), " x ", x.size(4));
  const int64_t B = x.size(0), C = x.size(1), T = x.size(2), H = x.size(3), W = x.size(4);
  const Grid g = grid(H / p, W / p, T, x.device());
  const int64_t N = g.h * g.w;

  // Per-frame patch embedding: [B, C, T, H, W] -> [B T, C, H, W] -> [B T, N, D] -> [B, T N, D].
  Tensor frames = x.to(dtype_).permute({0, 2, 1, 3, 4}).reshape({B * T, C, H, W});
  Tensor h = conv(frames, x_embedder).flatten(2).transpose(1, 2).reshape({B, T * N, D});
  h = h + g.pos.to(dtype_);

  const Tensor c = condition(time.to(x.device()), cond, B);  // [B, D]
  const Rope& rs = g.rope_spatial;
  const Rope& rt = g.rope_temporal;
  for (auto& block : block_list) {
    if (o.remat()) {
      // Captured by value: backward runs the function after this frame is gone.
      h = remat(*block,
                [block, T, rs, rt](const std::vector<Tensor>& in) mutable { return block(in[0], in[1], T, rs, rt); },
                {h, c});
    } else {
      h = block(h, c, T, rs, rt);
    }
  }
  Tensor out = final_layer(h, c).to(at::kFloat);                      // [B, T N, p p out]
  out = unpatchify(out.reshape({B * T, N, out.size(2)}), p, g.scan);  // [B T, out, H, W]
  return out.view({B, T, o.output_channels(), H, W}).permute({0, 2, 1, 3, 4}).contiguous();
}

VideoDiTImpl::Grid VideoDiTImpl::grid(int64_t gh, int64_t gw, int64_t t, const at::Device& device) {
  std::lock_guard<std::mutex> lock(grid_mutex_);
  if (grid_.h == gh && grid_.w == gw && grid_.t == t && grid_.device == device) return grid_;
  const int64_t d = options.emb_features(), head_dim = d / options.num_heads();
  Grid g;
  g.h = gh;
  g.w = gw;
  g.t = t;
  g.device = device;
  g.scan = make_scan("raster", gh, gw);
  const Tensor spatial = sincos_2d_table(d, gh, gw);                                            // [N, D]
  const Tensor temporal = sincos_1d_table(d, at::arange(t, at::kLong));                         // [T, D]
  g.pos = (temporal.unsqueeze(1) + spatial.unsqueeze(0)).reshape({t * gh * gw, d}).to(device);  // frame-major
  const auto idx = at::TensorOptions(at::kLong).device(device);
  g.rope_spatial = rope_1d(at::arange(gh * gw, idx), head_dim);
  g.rope_temporal = rope_1d(at::arange(t, idx), head_dim);
  grid_ = g;
  return g;
}

}  // namespace dew::nn

#include "dew/nn/backbones/unet_3d.h"

#include <algorithm>
#include <set>

#include "dew/core/error.h"

namespace dew::nn {

using at::Tensor;

// ---- TemporalBlock ----

TemporalBlockImpl::TemporalBlockImpl(TemporalBlockOptions options_) : options(std::move(options_)) {
  const auto& o = options;
  DEW_CHECK(o.channels() > 0 && o.channels() % 2 == 0, "TemporalBlock: channels must be even and > 0, got ",
            o.channels());
  DEW_CHECK(o.num_heads() > 0 && o.channels() % o.num_heads() == 0, "TemporalBlock: num_heads must divide channels ",
            o.channels(), ", got ", o.num_heads());
  DEW_CHECK(o.norm_groups() > 0 && o.channels() % o.norm_groups() == 0,
            "TemporalBlock: norm_groups must divide channels ", o.channels(), ", got ", o.norm_groups());
  reset();
}

void TemporalBlockImpl::reset() {
  const auto& o = options;
  norm = register_module(
      "norm", torch::nn::GroupNorm(torch::nn::GroupNormOptions(o.norm_groups(), o.channels()).eps(o.norm_eps())));
  attn = register_module("attn", SelfAttention(SelfAttentionOptions(o.channels(), o.num_heads())
                                                   .impl(o.impl())
                                                   .force_fp32_for_softmax(o.force_fp32_for_softmax())));
  reset_parameters();
}

void TemporalBlockImpl::reset_parameters() {
  // Zero output projection: the block adds exactly 0 until trained, so an inflated 2D model is unchanged.
  torch::NoGradGuard no_grad;
  attn->proj->weight.zero_();
  attn->proj->bias.zero_();
}

Tensor TemporalBlockImpl::forward(const Tensor& h, int64_t frames) {
  const int64_t C = options.channels();
  DEW_CHECK(frames > 0 && h.dim() == 4 && h.size(0) % frames == 0 && h.size(1) == C, "TemporalBlock: h must be [B*",
            frames, ", ", C, ", H, W], got ", h.sizes());
  const int64_t B = h.size(0) / frames, H = h.size(2), W = h.size(3);
  Tensor v = h.view({B, frames, C, H, W}).permute({0, 2, 1, 3, 4});  // [B, C, T, H, W]
  // GroupNorm over (C/groups, T, H, W) of each video, in fp32.
  Tensor n = at::group_norm(v.to(at::kFloat), options.norm_groups(), norm->weight, norm->bias, options.norm_eps());
  Tensor pos = sincos_1d_table(C, at::arange(frames, at::TensorOptions(at::kLong).device(h.device())));  // [T, C]
  Tensor tokens = (n.permute({0, 3, 4, 2, 1}) + pos).to(h.scalar_type()).reshape({B * H * W, frames, C});
  Tensor out = attn(tokens);  // [B H W, T, C]
  out = out.view({B, H, W, frames, C}).permute({0, 3, 4, 1, 2}).reshape({B * frames, C, H, W});
  return h + out;
}

// ---- UNet3D ----

namespace {

UnetOptions checked_unet_options(const UNet3DOptions& o) {
  const std::string w = "unet_3d";
  DEW_CHECK(o.temporal_heads() > 0, w, ": temporal_heads must be > 0, got ", o.temporal_heads());
  for (size_t i = 0; i < o.feature_depths().size(); ++i) {
    const int64_t d = o.feature_depths()[i];
    DEW_CHECK(d > 0 && d % 2 == 0, w, ": feature_depths[", i, "] must be even (frame position table), got ", d);
    DEW_CHECK(d % o.temporal_heads() == 0, w, ": temporal_heads must divide every feature depth; feature_depths[", i,
              "] = ", d, ", temporal_heads = ", o.temporal_heads());
  }
  return o.unet_options();
}

}  // namespace

UNet3DImpl::UNet3DImpl(UNet3DOptions options_)
    : UnetImpl(checked_unet_options(options_), "unet_3d"), options3d(std::move(options_)) {
  reset_temporal();
}

void UNet3DImpl::reset_temporal() {
  const auto& o = options3d;
  const auto& depths = o.feature_depths();
  const int64_t levels = static_cast<int64_t>(depths.size());
  auto block = [&](int64_t channels) {
    return TemporalBlock(TemporalBlockOptions(channels, o.temporal_heads())
                             .norm_groups(o.norm_groups())
                             .impl(o.attention_impl())
                             .force_fp32_for_softmax(o.force_fp32_for_softmax()));
  };
  temporal_down = register_module("temporal_down", torch::nn::ModuleList());
  temporal_up = register_module("temporal_up", torch::nn::ModuleList());
  temporal_down_list.clear();
  temporal_up_list.clear();
  for (int64_t i = 0; i < levels; ++i) {
    temporal_down_list.push_back(block(depths[i]));
    temporal_down->push_back(temporal_down_list.back());
  }
  temporal_mid = register_module("temporal_mid", block(depths.back()));
  for (int64_t u = 0; u < levels; ++u) {
    temporal_up_list.push_back(block(depths[levels - 1 - u]));
    temporal_up->push_back(temporal_up_list.back());
  }
}

Tensor UNet3DImpl::run_temporal(TemporalBlock block, const Tensor& h, int64_t frames) {
  if (!options3d.remat()) return block(h, frames);
  return remat(*block, [block, frames](const std::vector<Tensor>& in) mutable { return block(in[0], frames); }, {h});
}

Tensor UNet3DImpl::forward(const Tensor& x, const Tensor& time, const Conditioning& cond) {
  cond.check_inputs("unet_3d", /*takes_pooled=*/false);
  const auto& o = options3d;
  DEW_CHECK(x.dim() == 5 && x.size(1) == o.in_channels() && x.size(2) > 0, "unet_3d: x must be [B, ", o.in_channels(),
            ", T, H, W] with T >= 1, got ", x.sizes());
  const int64_t B = x.size(0), C = x.size(1), T = x.size(2), H = x.size(3), W = x.size(4);
  DEW_CHECK(time.dim() == 0 || (time.dim() == 1 && time.size(0) == B), "unet_3d: time must be [", B,
            "] or a scalar, got ", time.sizes());
  if (cond.labels.defined())
    DEW_CHECK(cond.labels.dim() == 1 && cond.labels.size(0) == B, "unet_3d: labels must be [", B, "], got ",
              cond.labels.sizes());
  if (cond.context.defined())
    DEW_CHECK(cond.context.dim() == 3 && cond.context.size(0) == B, "unet_3d: context must be [", B, ", L, ",
              o.context_features(), "], got ", cond.context.sizes());
  if (cond.context_mask.defined())
    DEW_CHECK(cond.context_mask.dim() == 2 && cond.context_mask.size(0) == B, "unet_3d: context_mask must be [", B,
              ", L], got ", cond.context_mask.sizes());

  // Frames folded into the batch, frame-minor: row b T + t is frame t of video b.
  Tensor frames = x.permute({0, 2, 1, 3, 4}).reshape({B * T, C, H, W});
  auto per_frame = [T](const Tensor& v) { return v.defined() ? v.repeat_interleave(T, 0) : v; };
  Conditioning fc;
  fc.labels = per_frame(cond.labels);
  fc.context = per_frame(cond.context);
  fc.context_mask = per_frame(cond.context_mask);
  Tensor ft = time.dim() == 0 ? time : time.repeat_interleave(T, 0);

  auto hook = [this, T](const Tensor& h, Site site, int64_t index) -> Tensor {
    switch (site) {
      case Site::down: return run_temporal(temporal_down_list[index], h, T);
      case Site::mid: return run_temporal(temporal_mid, h, T);
      case Site::up: return run_temporal(temporal_up_list[index], h, T);
    }
    return h;
  };
  Tensor out = run(frames, ft, fc, hook);  // [B T, out, H, W]
  return out.view({B, T, out.size(1), H, W}).permute({0, 2, 1, 3, 4}).contiguous();
}

bool is_temporal_parameter(const std::string& name) {
  for (const char* prefix : {"temporal_down.", "temporal_mid.", "temporal_up."})
    if (name.rfind(prefix, 0) == 0) return true;
  return false;
}

io::KeyMap unet_3d_inflation_map() {
  io::KeyMap map;
  const std::string temporal = R"(temporal_(down|mid|up)\..*)";
  map.refuse(temporal, "a 2D unet state has no temporal blocks (is it a unet_3d's?)");
  map.allow_missing(temporal);
  return map;
}

std::vector<std::string> load_unet_weights(UNet3DImpl& model, const std::map<std::string, Tensor>& unet_state) {
  io::LoadOptions o;
  o.require_buffers = false;
  return io::load_weights(model, io::WeightSource::of_tensors(unet_state, "the unet state"), unet_3d_inflation_map(), o)
      .loaded;
}

std::vector<std::string> load_unet_weights(UNet3DImpl& model, const UnetImpl& unet) {
  std::map<std::string, Tensor> state;
  for (const auto& kv : unet.named_parameters()) state[kv.key()] = kv.value();
  for (const auto& kv : unet.named_buffers()) state[kv.key()] = kv.value();
  return load_unet_weights(model, state);
}

}  // namespace dew::nn

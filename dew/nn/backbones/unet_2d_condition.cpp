#include "dew/nn/backbones/unet_2d_condition.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <set>

#include "dew/core/error.h"

namespace dew::nn {

namespace {

const char* kArch = "unet_2d_condition";

// Compute dtype of a forward pass: the configured one, or float64 when the model was moved to float64.
at::ScalarType compute_dtype(const torch::nn::Conv2d& first, at::ScalarType configured) {
  return first->weight.scalar_type() == at::kDouble ? at::kDouble : configured;
}

}  // namespace

TimestepMLPImpl::TimestepMLPImpl(int64_t in, int64_t out) {
  DEW_CHECK(in > 0 && out > 0, "time embedding: widths must be > 0, got ", in, " and ", out);
  linear_1 = register_module("linear_1", torch::nn::Linear(in, out));
  linear_2 = register_module("linear_2", torch::nn::Linear(out, out));
}

Tensor TimestepMLPImpl::forward(const Tensor& x) { return dense(at::silu(dense(x, linear_1)), linear_2); }

UNet2DConditionImpl::UNet2DConditionImpl(UNet2DConditionOptions options_) : options(std::move(options_)) {
  const auto& o = options;
  const auto& st = o.stages();
  DEW_CHECK(!st.empty(), kArch, ": stages must not be empty");
  DEW_CHECK(o.norm_groups() > 0, kArch, ": norm_groups must be > 0, got ", o.norm_groups());
  for (size_t i = 0; i < st.size(); ++i) {
    DEW_CHECK(st[i].features > 0 && st[i].features % o.norm_groups() == 0, kArch, ": stages[", i,
              "].features must be a positive multiple of norm_groups ", o.norm_groups(), ", got ", st[i].features);
    if (st[i].cross_attention || (i + 1 == st.size() && o.middle_attention()))
      DEW_CHECK(st[i].heads > 0 && st[i].features % st[i].heads == 0 && st[i].depth >= 1, kArch, ": stages[", i,
                "]: heads must divide features (", st[i].features, ") and depth be >= 1, got heads ", st[i].heads,
                ", depth ", st[i].depth);
    DEW_CHECK(!st[i].cross_only || (st[i].cross_attention && o.context_features() > 0), kArch, ": stages[", i,
              "].cross_only needs cross_attention and context_features > 0");
  }
  DEW_CHECK(o.blocks_per_level() >= 1, kArch, ": blocks_per_level must be >= 1, got ", o.blocks_per_level());
  DEW_CHECK(o.in_channels() > 0 && o.output_channels() > 0, kArch,
            ": in_channels and output_channels must be > 0, got ", o.in_channels(), " and ", o.output_channels());
  DEW_CHECK(o.inpaint_channels() == 0 || o.inpaint_channels() >= 2, kArch,
            ": inpaint_channels must be 0 or >= 2 (mask + masked-image latents), got ", o.inpaint_channels());
  DEW_CHECK(o.context_features() >= 0, kArch, ": context_features must be >= 0, got ", o.context_features());
  DEW_CHECK(o.num_classes() >= 0, kArch, ": num_classes must be >= 0, got ", o.num_classes());
  DEW_CHECK(o.additional_time_features() >= 0 && o.additional_embedding_features() >= 0, kArch,
            ": additional_time_features and additional_embedding_features must be >= 0");
  DEW_CHECK((o.additional_time_features() == 0) == (o.additional_embedding_features() == 0), kArch,
            ": additional_time_features (", o.additional_time_features(), ") and additional_embedding_features (",
            o.additional_embedding_features(), ") are set together (SDXL's text_time conditioning) or both 0");
  DEW_CHECK(o.additional_time_features() % 2 == 0, kArch, ": additional_time_features must be even, got ",
            o.additional_time_features());
  DEW_CHECK(o.dropout() >= 0 && o.dropout() < 1, kArch, ": dropout must be in [0, 1), got ", o.dropout());
  DEW_CHECK(o.norm_epsilon() > 0 && o.attention_norm_epsilon() > 0, kArch, ": the norm epsilons must be > 0");
  dtype_ = parse_compute_dtype(o.dtype(), std::string(kArch) + ".dtype");
  check_attention_impl(o.attention_impl(), std::string(kArch) + ".attention_impl");
  reset();
}

bool UNet2DConditionImpl::requires_text() const { return options.context_features() > 0; }

void UNet2DConditionImpl::reset() {
  const auto& o = options;
  const auto& st = o.stages();
  const int64_t levels = static_cast<int64_t>(st.size());
  const int64_t c0 = st[0].features, temb = 4 * c0;
  auto res = [&](int64_t in, int64_t out) {
    return ResBlock(ResBlockOptions(in, out, temb)
                        .norm_groups(o.norm_groups())
                        .norm_eps(o.norm_epsilon())
                        .activation("silu")
                        .dropout(o.dropout())
                        .zero_init(false));
  };
  auto transformer = [&](const UNetStage& s) {
    return Transformer2D(Transformer2DOptions(s.features, s.heads)
                             .depth(s.depth)
                             .context_features(o.context_features())
                             .cross_only(s.cross_only)
                             .linear_projection(o.linear_projection())
                             .norm_groups(o.norm_groups())
                             .norm_eps(o.attention_norm_epsilon())
                             .approximate_gelu(o.approximate_gelu())
                             .dropout(o.dropout())
                             .impl(o.attention_impl())
                             .force_fp32_for_softmax(o.force_fp32_for_softmax() || o.upcast_attention())
                             .remat(o.remat()));
  };
  // A plain Module as a named container: "down_blocks.I.resnets.J" and so on.
  auto container = [](const Level& lv) {
    auto m = std::make_shared<torch::nn::Module>();
    auto rl = m->register_module("resnets", torch::nn::ModuleList());
    for (const auto& r : lv.resnets) rl->push_back(r);
    if (!lv.attentions.empty()) {
      auto al = m->register_module("attentions", torch::nn::ModuleList());
      for (const auto& a : lv.attentions) al->push_back(a);
    }
    if (!lv.downsample.is_empty()) m->register_module("downsamplers", torch::nn::ModuleList(lv.downsample));
    if (!lv.upsample.is_empty()) m->register_module("upsamplers", torch::nn::ModuleList(lv.upsample));
    return m;
  };

  conv_in = register_module(
      "conv_in", torch::nn::Conv2d(torch::nn::Conv2dOptions(o.in_channels() + o.inpaint_channels(), c0, 3).padding(1)));
  time_embedding = register_module("time_embedding", TimestepMLP(c0, temb));
  if (o.num_classes() > 0)
    class_embedding = register_module("class_embedding", torch::nn::Embedding(o.num_classes() + 1, temb));
  if (o.additional_time_features() > 0)
    add_embedding = register_module("add_embedding", TimestepMLP(o.additional_embedding_features(), temb));

  down.assign(levels, {});
  auto down_blocks = register_module("down_blocks", torch::nn::ModuleList());
  int64_t ch = c0;
  for (int64_t i = 0; i < levels; ++i) {
    auto& lv = down[i];
    for (int64_t j = 0; j < o.blocks_per_level(); ++j) {
      lv.resnets.push_back(res(j == 0 ? ch : st[i].features, st[i].features));
      if (st[i].cross_attention) lv.attentions.push_back(transformer(st[i]));
    }
    ch = st[i].features;
    if (i + 1 < levels) lv.downsample = Downsample2D(Downsample2DOptions(ch));
    down_blocks->push_back(container(lv));
  }

  mid = {};
  const auto& last = st.back();
  mid.resnets.push_back(res(last.features, last.features));
  if (o.middle_attention()) {
    mid.attentions.push_back(transformer(UNetStage{last.features, last.heads, last.depth, true, false}));
    mid.resnets.push_back(res(last.features, last.features));
  }
  register_module("mid_block", container(mid));

  // Up, deepest first: resnet j of level i takes the previous output (prev channels for j = 0) concatenated
  // with a skip: the level's own outputs, then for the last resnet the level above's output.
  up.assign(levels, {});
  auto up_blocks = register_module("up_blocks", torch::nn::ModuleList());
  int64_t prev = last.features;
  for (int64_t i = 0; i < levels; ++i) {
    const int64_t level = levels - 1 - i;
    const int64_t out = st[level].features, skip_in = st[std::max<int64_t>(level - 1, 0)].features;
    auto& lv = up[i];
    const int64_t n = o.blocks_per_level() + 1;
    for (int64_t j = 0; j < n; ++j) {
      const int64_t skip = j == n - 1 ? skip_in : out;
      lv.resnets.push_back(res((j == 0 ? prev : out) + skip, out));
      if (st[level].cross_attention) lv.attentions.push_back(transformer(st[level]));
    }
    if (i + 1 < levels) lv.upsample = Upsample2D(out);
    prev = out;
    up_blocks->push_back(container(lv));
  }

  conv_norm_out = register_module(
      "conv_norm_out", torch::nn::GroupNorm(torch::nn::GroupNormOptions(o.norm_groups(), c0).eps(o.norm_epsilon())));
  conv_out =
      register_module("conv_out", torch::nn::Conv2d(torch::nn::Conv2dOptions(c0, o.output_channels(), 3).padding(1)));
}

Tensor UNet2DConditionImpl::run_res(ResBlock& block, const Tensor& h, const Tensor& temb) {
  if (!(options.remat() && is_training() && at::GradMode::is_enabled())) return block(h, temb);
  ResBlock b = block;
  return remat(*b, [b](const std::vector<Tensor>& in) mutable { return b(in[0], in[1]); }, {h, temb});
}

Tensor UNet2DConditionImpl::forward(const Tensor& x, const Tensor& time, const Conditioning& cond) {
  const auto& o = options;
  std::vector<std::string> accepted;
  if (o.additional_time_features() > 0) accepted.push_back("time_ids");
  if (o.inpaint_channels() > 0) accepted.insert(accepted.end(), {"mask", "masked_image_latents"});
  cond.check_inputs(kArch, /*takes_pooled=*/o.additional_time_features() > 0, accepted);
  const auto dt = compute_dtype(conv_in, dtype_);
  DEW_CHECK(x.dim() == 4 && x.size(1) == o.in_channels(), kArch, ": x must be [B, ", o.in_channels(), ", H, W], got ",
            x.sizes());
  const int64_t B = x.size(0);
  DEW_CHECK(time.dim() == 0 || (time.dim() == 1 && time.size(0) == B), kArch, ": time must be [", B,
            "] or a scalar, got ", time.sizes());

  // Time: diffusers' float32 sinusoid, then the MLP in the compute dtype.
  const Tensor t = time.to(x.device());
  Tensor temb = time_embedding(timestep_embedding(t.dim() == 0 ? t.expand({B}) : t, o.stages()[0].features,
                                                  o.cosine_first(), o.frequency_shift())
                                   .to(dt));
  if (o.num_classes() > 0) {
    Tensor labels = cond.labels.defined() ? cond.labels : at::full({B}, o.num_classes(), x.options().dtype(at::kLong));
    DEW_CHECK(labels.dim() == 1 && labels.size(0) == B, kArch, ": labels must be [", B, "], got ", labels.sizes());
    DEW_CHECK(!(labels.lt(0) | labels.gt(o.num_classes())).any().item<bool>(), kArch, ": labels must lie in [0, ",
              o.num_classes(), "] (", o.num_classes(), " = null class)");
    temb = temb + at::embedding(class_embedding->weight.to(dt), labels.to(at::kLong).to(x.device()));
  } else {
    DEW_CHECK(!cond.labels.defined(), kArch, ": labels given but num_classes is 0");
  }
  if (o.additional_time_features() > 0) {
    auto it = cond.extra.find("time_ids");
    DEW_CHECK(cond.pooled.defined() && it != cond.extra.end(), kArch,
              ": SDXL conditioning needs the pooled text (text_embeds) and time_ids");
    const Tensor& ids = it->second;
    DEW_CHECK(ids.dim() == 2 && ids.size(0) == B && cond.pooled.dim() == 2 && cond.pooled.size(0) == B &&
                  cond.pooled.size(1) + ids.size(1) * o.additional_time_features() == o.additional_embedding_features(),
              kArch, ": text_embeds [", B, ", P] and time_ids [", B, ", n] need P + n * ", o.additional_time_features(),
              " = ", o.additional_embedding_features(), ", got ", cond.pooled.sizes(), " and ", ids.sizes());
    const Tensor time_embeds = timestep_embedding(ids.reshape({-1}).to(x.device()), o.additional_time_features(),
                                                  o.cosine_first(), o.frequency_shift())
                                   .reshape({B, -1});
    temb = temb + add_embedding(at::cat({cond.pooled.to(x.device()).to(dt), time_embeds.to(dt)}, 1));
  }
  Tensor context, mask;
  if (o.context_features() > 0) {
    DEW_CHECK(cond.context.defined(), kArch, ": a text context [B, L, ", o.context_features(),
              "] (encoder_hidden_states) is required");
    DEW_CHECK(cond.context.dim() == 3 && cond.context.size(0) == B && cond.context.size(2) == o.context_features(),
              kArch, ": context must be [", B, ", L, ", o.context_features(), "], got ", cond.context.sizes());
    context = cond.context.to(x.device()).to(dt);
    mask = cond.context_mask;
  } else {
    DEW_CHECK(!cond.context.defined(), kArch, ": a text context was given but context_features is 0");
  }

  Tensor xin = x.to(dt);
  if (o.inpaint_channels() > 0) {
    auto m = cond.extra.find("mask"), l = cond.extra.find("masked_image_latents");
    DEW_CHECK(m != cond.extra.end() && l != cond.extra.end(), kArch,
              ": an inpainting model needs the inputs mask and masked_image_latents");
    const Tensor extra = at::cat({m->second.to(x.device()).to(dt), l->second.to(x.device()).to(dt)}, 1);
    DEW_CHECK(extra.dim() == 4 && extra.size(0) == B && extra.size(1) == o.inpaint_channels() &&
                  extra.size(2) == x.size(2) && extra.size(3) == x.size(3),
              kArch, ": mask and masked_image_latents must give [", B, ", ", o.inpaint_channels(), ", ", x.size(2),
              ", ", x.size(3), "] together, got ", extra.sizes());
    xin = at::cat({xin, extra}, 1);
  }

  Tensor h = conv(xin, conv_in);
  std::vector<Tensor> skips{h};
  for (auto& lv : down) {
    for (size_t j = 0; j < lv.resnets.size(); ++j) {
      h = run_res(lv.resnets[j], h, temb);
      if (!lv.attentions.empty()) h = lv.attentions[j](h, context, mask);
      skips.push_back(h);
    }
    if (!lv.downsample.is_empty()) {
      h = lv.downsample(h);
      skips.push_back(h);
    }
  }
  h = run_res(mid.resnets[0], h, temb);
  if (!mid.attentions.empty()) {
    h = mid.attentions[0](h, context, mask);
    h = run_res(mid.resnets[1], h, temb);
  }
  for (auto& lv : up) {
    for (size_t j = 0; j < lv.resnets.size(); ++j) {
      h = run_res(lv.resnets[j], at::cat({h, skips.back()}, 1), temb);
      skips.pop_back();
      if (!lv.attentions.empty()) h = lv.attentions[j](h, context, mask);
    }
    // The next skip's size: the input need not be a multiple of the total downsampling.
    if (!lv.upsample.is_empty()) h = lv.upsample->forward(h, {skips.back().size(2), skips.back().size(3)});
  }
  h = conv(at::silu(group_norm_fp32(h, conv_norm_out)), conv_out);
  return h.to(dt == at::kDouble ? at::kDouble : at::kFloat);
}

}  // namespace dew::nn

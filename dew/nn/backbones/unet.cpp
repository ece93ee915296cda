#include "dew/nn/backbones/unet.h"

#include <algorithm>

#include "dew/core/error.h"

namespace dew::nn {

using at::Tensor;

namespace {

torch::nn::Conv2d conv3x3(int64_t in, int64_t out, int64_t stride = 1) {
  return torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, 3).stride(stride).padding(1));
}

}  // namespace

// ---- UnetAttention ----

UnetAttentionImpl::UnetAttentionImpl(UnetAttentionOptions options_) : options(std::move(options_)) {
  DEW_CHECK(options.context_dim() >= 0, "UnetAttention: context_dim must be >= 0, got ", options.context_dim());
  reset();
}

void UnetAttentionImpl::reset() {
  const int64_t c = options.channels();
  norm1 = register_module("norm1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c}).eps(1e-5)));
  attn1 = register_module("attn1", SelfAttention(SelfAttentionOptions(c, options.num_heads())
                                                     .impl(options.impl())
                                                     .force_fp32_for_softmax(options.force_fp32_for_softmax())));
  if (options.context_dim() > 0) {
    norm2 = register_module("norm2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c}).eps(1e-5)));
    attn2 = register_module("attn2", CrossAttention(CrossAttentionOptions(c, options.context_dim(), options.num_heads())
                                                        .impl(options.impl())
                                                        .force_fp32_for_softmax(options.force_fp32_for_softmax())));
  }
}

Tensor UnetAttentionImpl::forward(const Tensor& x, const Tensor& context, const Tensor& context_mask) {
  DEW_CHECK(x.dim() == 4 && x.size(1) == options.channels(), "UnetAttention: x must be [B, ", options.channels(),
            ", H, W], got ", x.sizes());
  const int64_t B = x.size(0), C = x.size(1), H = x.size(2), W = x.size(3);
  Tensor t = x.flatten(2).transpose(1, 2);  // [B, H W, C]
  t = t + attn1(layer_norm_affine(t, norm1));
  if (!attn2.is_empty() && context.defined())
    t = t + attn2(layer_norm_affine(t, norm2), context.to(x.scalar_type()), context_mask);
  return t.transpose(1, 2).reshape({B, C, H, W});
}

// ---- Unet ----

UnetImpl::UnetImpl(UnetOptions options_) : UnetImpl(std::move(options_), "unet") {}

UnetImpl::UnetImpl(UnetOptions options_, std::string arch) : options(std::move(options_)), arch_(std::move(arch)) {
  const auto& o = options;
  const std::string& w = arch_;
  const auto& depths = o.feature_depths();
  DEW_CHECK(!depths.empty(), w, ": feature_depths must not be empty");
  DEW_CHECK(o.norm_groups() > 0, w, ": norm_groups must be > 0, got ", o.norm_groups());
  for (size_t i = 0; i < depths.size(); ++i)
    DEW_CHECK(depths[i] > 0 && depths[i] % o.norm_groups() == 0, w, ": feature_depths[", i,
              "] must be a positive multiple of norm_groups ", o.norm_groups(), ", got ", depths[i]);
  DEW_CHECK(o.attention_configs().size() == depths.size(), w, ": attention_configs needs one entry per level (",
            depths.size(), "), got ", o.attention_configs().size());
  for (size_t i = 0; i < depths.size(); ++i) {
    const auto& heads = o.attention_configs()[i];
    DEW_CHECK(!heads || (*heads > 0 && depths[i] % *heads == 0), w, ": attention_configs[", i,
              "] must be null or heads dividing feature_depths[", i, "] = ", depths[i], ", got ", heads ? *heads : 0);
  }
  DEW_CHECK(o.emb_features() > 0 && o.emb_features() % 2 == 0, w, ": emb_features must be even and > 0, got ",
            o.emb_features());
  DEW_CHECK(o.num_res_blocks() > 0, w, ": num_res_blocks must be > 0, got ", o.num_res_blocks());
  DEW_CHECK(o.num_middle_res_blocks() >= 0, w, ": num_middle_res_blocks must be >= 0, got ", o.num_middle_res_blocks());
  DEW_CHECK(o.in_channels() > 0, w, ": in_channels must be > 0, got ", o.in_channels());
  DEW_CHECK(o.output_channels() > 0, w, ": output_channels must be > 0, got ", o.output_channels());
  DEW_CHECK(o.num_classes() >= 0, w, ": num_classes must be >= 0, got ", o.num_classes());
  DEW_CHECK(o.context_features() >= 0, w, ": context_features must be >= 0, got ", o.context_features());
  // The text context reaches the unet only through cross-attention; without an attention level it would
  // be silently ignored (a "text-conditioned" run that learns an unconditional model).
  DEW_CHECK(o.context_features() == 0 || std::any_of(o.attention_configs().begin(), o.attention_configs().end(),
                                                     [](const std::optional<int64_t>& h) { return h.has_value(); }),
            w, ": context_features = ", o.context_features(),
            " needs at least one attention level (text enters through cross-attention); set attention_configs, "
            "e.g. [null, 4]");
  DEW_CHECK(o.dropout_rate() >= 0 && o.dropout_rate() < 1, w, ": dropout_rate must be in [0, 1), got ",
            o.dropout_rate());
  activation(at::zeros({1}), o.activation());
  dtype_ = parse_compute_dtype(o.dtype(), w + ".dtype");
  check_attention_impl(o.attention_impl(), w + ".attention_impl");
  reset();
}

void UnetImpl::reset() {
  const auto& o = options;
  const auto& depths = o.feature_depths();
  const int64_t levels = static_cast<int64_t>(depths.size()), E = o.emb_features();
  auto res = [&](int64_t in, int64_t out) {
    return ResBlock(
        ResBlockOptions(in, out, E).norm_groups(o.norm_groups()).activation(o.activation()).dropout(o.dropout_rate()));
  };
  auto attn = [&](int64_t ch, int64_t heads) {
    return UnetAttention(UnetAttentionOptions(ch, heads)
                             .context_dim(o.context_features())
                             .impl(o.attention_impl())
                             .force_fp32_for_softmax(o.force_fp32_for_softmax()));
  };
  // A plain Module as a named container: gives "down_blocks.I.resnets.J" style parameter names.
  auto container = [](Level& lv, const char* resample_name) {
    auto m = std::make_shared<torch::nn::Module>();
    auto list = m->register_module("resnets", torch::nn::ModuleList());
    for (auto& r : lv.resnets) list->push_back(r);
    if (!lv.attention.is_empty()) m->register_module("attention", lv.attention);
    if (!lv.resample.is_empty()) m->register_module(resample_name, lv.resample);
    return m;
  };

  t_embedder = register_module("t_embedder", TimeEmbedding(E));
  if (o.num_classes() > 0) {
    // N(0, 1), as diffusers' class_embedding (torch.nn.Embedding's default): the label starts as loud as
    // the time embedding. A DiT-style 0.02 init left class conditioning weak after a 12-minute demo run.
    y_embedder = register_module("y_embedder", torch::nn::Embedding(o.num_classes() + 1, E));
  }
  conv_in = register_module("conv_in", conv3x3(o.in_channels(), depths[0]));

  int64_t ch = depths[0];
  std::vector<int64_t> skips{ch};  // channels of every skip, in push order
  down.assign(levels, Level{});
  auto down_list = register_module("down_blocks", torch::nn::ModuleList());
  for (int64_t i = 0; i < levels; ++i) {
    Level& lv = down[i];
    for (int64_t j = 0; j < o.num_res_blocks(); ++j) {
      lv.resnets.push_back(res(ch, depths[i]));
      ch = depths[i];
      skips.push_back(ch);
    }
    if (const auto& heads = o.attention_configs()[i]) lv.attention = attn(ch, *heads);
    if (i != levels - 1) {
      lv.resample = conv3x3(ch, ch, 2);
      skips.push_back(ch);
    }
    down_list->push_back(container(lv, "downsample"));
  }

  mid = Level{};
  for (int64_t k = 0; k < o.num_middle_res_blocks(); ++k) {
    mid.resnets.push_back(res(ch, ch));
    mid.resnets.push_back(res(ch, ch));
  }
  if (o.num_middle_res_blocks() > 0 && o.attention_configs().back())
    mid.attention = attn(ch, *o.attention_configs().back());
  register_module("mid_block", container(mid, "resample"));

  up.assign(levels, Level{});
  auto up_list = register_module("up_blocks", torch::nn::ModuleList());
  for (int64_t u = 0; u < levels; ++u) {
    const int64_t i = levels - 1 - u;  // level index, deepest first
    Level& lv = up[u];
    for (int64_t j = 0; j <= o.num_res_blocks(); ++j) {
      lv.resnets.push_back(res(ch + skips.back(), depths[i]));
      skips.pop_back();
      ch = depths[i];
    }
    if (const auto& heads = o.attention_configs()[i]) lv.attention = attn(ch, *heads);
    if (i != 0) lv.resample = conv3x3(ch, ch);
    up_list->push_back(container(lv, "upsample"));
  }
  DEW_CHECK(skips.empty(), arch_, ": internal error, ", skips.size(), " skips left unconsumed");

  norm_out = register_module("norm_out", torch::nn::GroupNorm(torch::nn::GroupNormOptions(o.norm_groups(), ch)));
  conv_out = register_module("conv_out", conv3x3(ch, o.output_channels()));
  torch::NoGradGuard no_grad;
  conv_out->weight.zero_();  // the prediction starts at exactly 0
  conv_out->bias.zero_();
}

Tensor UnetImpl::run_res(ResBlock block, const Tensor& h, const Tensor& temb) {
  if (!options.remat()) return block(h, temb);
  return remat(*block, [block](const std::vector<Tensor>& in) mutable { return block(in[0], in[1]); }, {h, temb});
}

Tensor UnetImpl::run_attention(UnetAttention block, const Tensor& h, const Conditioning& cond) {
  const bool cross = !block->attn2.is_empty() && cond.context.defined();
  const Tensor context = cross ? cond.context.to(dtype_) : Tensor();
  const Tensor mask = cross ? cond.context_mask : Tensor();
  if (!options.remat()) return block(h, context, mask);
  // The context may itself be trained (a text encoder), so it goes in as an input; the mask is a constant.
  std::vector<Tensor> inputs{h};
  if (cross) inputs.push_back(context);
  return remat(
      *block,
      [block, cross, mask](const std::vector<Tensor>& in) mutable {
        return block(in[0], cross ? in[1] : Tensor(), mask);
      },
      inputs);
}

Tensor UnetImpl::forward(const Tensor& x, const Tensor& time, const Conditioning& cond) {
  cond.check_inputs("unet", /*takes_pooled=*/false);
  return run(x, time, cond, {});
}

Tensor UnetImpl::run(const Tensor& x, const Tensor& time, const Conditioning& cond, const LevelHook& hook) {
  const auto& o = options;
  const std::string& w = arch_;
  const int64_t levels = static_cast<int64_t>(o.feature_depths().size());
  const int64_t factor = int64_t{1} << (levels - 1);
  DEW_CHECK(x.dim() == 4 && x.size(1) == o.in_channels(), w, ": x must be [B, ", o.in_channels(), ", H, W], got ",
            x.sizes());
  DEW_CHECK(x.size(2) % factor == 0 && x.size(3) % factor == 0, w, ": H and W must be multiples of ", factor,
            " (2^(levels - 1)), got ", x.size(2), " x ", x.size(3));
  const int64_t B = x.size(0);
  DEW_CHECK(time.dim() == 0 || (time.dim() == 1 && time.size(0) == B), w, ": time must be [", B, "] or a scalar, got ",
            time.sizes());

  // Conditioning: time embedding + label embedding; the text context feeds the cross-attention stages.
  const Tensor t = time.to(x.device());
  Tensor temb = t_embedder(t.dim() == 0 ? t.expand({B}) : t, dtype_);  // [B, E]
  if (o.num_classes() > 0) {
    Tensor labels = cond.labels.defined() ? cond.labels : at::full({B}, o.num_classes(), x.options().dtype(at::kLong));
    DEW_CHECK(labels.dim() == 1 && labels.size(0) == B, w, ": labels must be [", B, "], got ", labels.sizes());
    DEW_CHECK(!(labels.lt(0) | labels.gt(o.num_classes())).any().item<bool>(), w, ": labels must lie in [0, ",
              o.num_classes(), "] (", o.num_classes(), " = null class)");
    temb = temb + at::embedding(y_embedder->weight.to(dtype_), labels.to(at::kLong));
  } else {
    DEW_CHECK(!cond.labels.defined(), w, ": labels given but num_classes is 0");
  }
  if (cond.context.defined()) {
    DEW_CHECK(o.context_features() > 0, w, ": a text context was given but context_features is 0");
    DEW_CHECK(cond.context.dim() == 3 && cond.context.size(0) == B && cond.context.size(2) == o.context_features(), w,
              ": context must be [", B, ", L, ", o.context_features(), "], got ", cond.context.sizes());
  }

  // On the CPU the float32 network runs channels-last (cpu_channels_last: 1.3-1.6x faster convolutions
  // at 28 x 28, docs/benchmarks.md). Every op after conv_in keeps the layout; the output is returned
  // contiguous.
  Tensor h = cpu_channels_last(conv(cpu_channels_last(x.to(dtype_)), conv_in));  // [B, d0, H, W]
  std::vector<Tensor> skips{h};
  for (size_t i = 0; i < down.size(); ++i) {
    auto& lv = down[i];
    for (size_t j = 0; j < lv.resnets.size(); ++j) {
      h = run_res(lv.resnets[j], h, temb);
      if (j + 1 == lv.resnets.size()) {
        if (!lv.attention.is_empty()) h = run_attention(lv.attention, h, cond);
        if (hook) h = hook(h, Site::down, static_cast<int64_t>(i));
      }
      skips.push_back(h);
    }
    if (!lv.resample.is_empty()) {
      h = conv(h, lv.resample);  // [B, C, H/2, W/2]
      skips.push_back(h);
    }
  }
  for (size_t k = 0; k < mid.resnets.size(); k += 2) {
    h = run_res(mid.resnets[k], h, temb);
    if (k + 2 == mid.resnets.size() && !mid.attention.is_empty()) h = run_attention(mid.attention, h, cond);
    h = run_res(mid.resnets[k + 1], h, temb);
  }
  if (hook) h = hook(h, Site::mid, 0);
  for (size_t u = 0; u < up.size(); ++u) {
    auto& lv = up[u];
    for (size_t j = 0; j < lv.resnets.size(); ++j) {
      h = at::cat({h, skips.back()}, 1);  // skips in reverse order
      skips.pop_back();
      h = run_res(lv.resnets[j], h, temb);
      if (j + 1 == lv.resnets.size()) {
        if (!lv.attention.is_empty()) h = run_attention(lv.attention, h, cond);
        if (hook) h = hook(h, Site::up, static_cast<int64_t>(u));
      }
    }
    if (!lv.resample.is_empty()) {
      h = at::upsample_nearest2d(h, {h.size(2) * 2, h.size(3) * 2});
      h = conv(h, lv.resample);
    }
  }
  h = group_norm_act(h, norm_out, o.activation());
  return conv(h, conv_out).to(at::kFloat).contiguous();  // [B, output_channels, H, W]
}

}  // namespace dew::nn

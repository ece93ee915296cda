#include "dew/nn/backbones/qwen_image_vae.h"

#include <ATen/ATen.h>
#include <torch/nn/modules/linear.h>

#include <cmath>
#include <set>

#include "dew/core/error.h"
#include "dew/nn/attention.h"
#include "dew/nn/blocks.h"

namespace dew::nn {

using at::Tensor;

namespace {

torch::nn::Conv2d same_conv(int64_t in, int64_t out, int64_t kernel) {
  return torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, kernel).padding(kernel / 2));
}

// The widths of the encoder's levels (base_dim, then base_dim x each multiplier) or the decoder's
// (decoder_base_dim x the deepest multiplier, then the multipliers deepest first).
std::vector<int64_t> level_widths(const QwenImageVaeOptions& o, bool decoder) {
  const auto& m = o.dim_mult();
  std::vector<int64_t> d;
  if (!decoder) {
    d.push_back(o.base_dim());
    for (int64_t u : m) d.push_back(o.base_dim() * u);
  } else {
    d.push_back(o.decoder_base_dim() * m.back());
    for (auto it = m.rbegin(); it != m.rend(); ++it) d.push_back(o.decoder_base_dim() * *it);
  }
  return d;
}

// Whether the level's resampling is temporal (the encoder's temperal_downsample, the decoder's reversed).
bool temporal_level(const QwenImageVaeOptions& o, bool decoder, size_t i) {
  const auto& t = o.temperal_downsample();
  if (i + 1 >= o.dim_mult().size()) return false;
  return decoder ? t[t.size() - 1 - i] : t[i];
}

// AvgDown3D on one frame: the frame (after a zero frame when ft = 2, as the reference pads time to the factor),
// its fs x fs pixels folded into channels (channel c x factor + t x fs^2 + dy x fs + dx), averaged in groups of
// in x factor / out consecutive channels. x: [B, in, H, W] -> [B, out, H / fs, W / fs].
Tensor avg_down(const Tensor& x, int64_t out, int64_t ft, int64_t fs) {
  const int64_t b = x.size(0), c = x.size(1), h = x.size(2), w = x.size(3);
  const Tensor frames = ft == 2 ? at::stack({at::zeros_like(x), x}, 2) : x.unsqueeze(2);
  const int64_t group = c * ft * fs * fs / out;
  return frames.view({b, c, ft, h / fs, fs, w / fs, fs})
      .permute({0, 1, 2, 4, 6, 3, 5})
      .reshape({b, out, group, h / fs, w / fs})
      .mean(2);
}

// DupUp3D of the first chunk: every channel repeated out x factor / in times, unfolded into ft frames of fs x fs
// pixels, the last frame kept. x: [B, in, h, w] -> [B, out, h fs, w fs].
Tensor dup_up(const Tensor& x, int64_t out, int64_t ft, int64_t fs) {
  const int64_t b = x.size(0), c = x.size(1), h = x.size(2), w = x.size(3);
  return x.repeat_interleave(out * ft * fs * fs / c, 1)
      .view({b, out, ft, fs, fs, h, w})
      .select(2, ft - 1)
      .permute({0, 1, 4, 2, 5, 3})
      .reshape({b, out, h * fs, w * fs});
}

// Runs block(x) with its activations recomputed in backward when remat applies.
template <class M>
Tensor run_level(M& block, const Tensor& x, bool remat_on) {
  if (!remat_on || !block->is_training() || !at::GradMode::is_enabled()) return block(x);
  auto b = block;
  return remat(*b, [b](const std::vector<Tensor>& in) mutable { return b(in[0]); }, {x});
}

// The reference's [B, C, 1, H, W] (one frame) or dew's [B, C, H, W] -> [B, C, H, W]; `frame` says which it was.
Tensor one_frame(const Tensor& t, const std::string& name, const std::string& where, bool& frame) {
  DEW_CHECK(at::isFloatingType(t.scalar_type()), where, ": input \"", name, "\" must be floating point");
  frame = t.dim() == 5;
  if (!frame) return t;
  DEW_CHECK(t.size(2) == 1, where, ": ", name, " has ", t.size(2),
            " frames; accepted: 1 (AutoencoderKLQwenImage21 is image-only: its causal convolutions are 2-D), got ",
            t.sizes());
  return t.squeeze(2);
}

}  // namespace

// ---- blocks ----

QwenVaeRmsNormImpl::QwenVaeRmsNormImpl(int64_t channels, bool images) {
  gamma = register_parameter("gamma", images ? at::ones({channels, 1, 1}) : at::ones({channels, 1, 1, 1}));
}

Tensor QwenVaeRmsNormImpl::forward(const Tensor& x) {
  const auto dt = x.scalar_type();
  const bool half = dt == at::kHalf || dt == at::kBFloat16;
  const Tensor xf = half ? x.to(at::kFloat) : x;
  // F.normalize: x / max(|x|_2, 1e-12) over the channels.
  const Tensor normalized = (xf / xf.norm(2, {1}, true).clamp_min(1e-12)).to(dt);
  const int64_t c = gamma.size(0);
  return normalized * std::sqrt(double(c)) * gamma.view({c, 1, 1}).to(dt);
}

QwenVaeResBlockImpl::QwenVaeResBlockImpl(int64_t in, int64_t out, double dropout_) : dropout(dropout_) {
  norm1 = register_module("norm1", QwenVaeRmsNorm(in, false));
  conv1 = register_module("conv1", same_conv(in, out, 3));
  norm2 = register_module("norm2", QwenVaeRmsNorm(out, false));
  conv2 = register_module("conv2", same_conv(out, out, 3));
  if (in != out) conv_shortcut = register_module("conv_shortcut", same_conv(in, out, 1));
}

Tensor QwenVaeResBlockImpl::forward(const Tensor& x) {
  const Tensor h = conv_shortcut.is_empty() ? x : conv(x, conv_shortcut);
  Tensor y = conv(at::silu(norm1(x)), conv1);
  y = at::silu(norm2(y));
  if (dropout > 0 && is_training()) y = at::dropout(y, dropout, true);
  return conv(y, conv2) + h;
}

QwenVaeMidBlockImpl::QwenVaeMidBlockImpl(int64_t channels, const QwenImageVaeOptions& o)
    : attention_impl(o.attention_impl()), force_fp32_for_softmax(o.force_fp32_for_softmax()) {
  auto list = register_module("resnets", torch::nn::ModuleList());
  for (int i = 0; i < 2; ++i) {
    resnets.push_back(QwenVaeResBlock(channels, channels, o.dropout()));
    list->push_back(resnets.back());
  }
  auto attn = std::make_shared<torch::nn::Module>();
  norm = attn->register_module("norm", QwenVaeRmsNorm(channels, true));
  to_qkv = attn->register_module("to_qkv", same_conv(channels, 3 * channels, 1));
  proj = attn->register_module("proj", same_conv(channels, channels, 1));
  register_module("attentions", torch::nn::ModuleList(attn));
}

Tensor QwenVaeMidBlockImpl::forward(const Tensor& x) {
  Tensor h = resnets[0](x);
  // One head over all channels: q, k, v are to_qkv's three channel thirds, one token per pixel.
  const int64_t b = h.size(0), c = h.size(1), height = h.size(2), width = h.size(3);
  const Tensor qkv = conv(norm(h), to_qkv).reshape({b, 1, 3 * c, height * width}).permute({0, 1, 3, 2});
  const auto parts = qkv.chunk(3, -1);
  Tensor a = attention(parts[0], parts[1], parts[2], {}, attention_impl, force_fp32_for_softmax);
  a = a.squeeze(1).permute({0, 2, 1}).reshape({b, c, height, width});
  h = conv(a, proj) + h;
  return resnets[1](h);
}

QwenVaeLevelImpl::QwenVaeLevelImpl(int64_t in_, int64_t out_, int64_t blocks, bool decoder_, bool resample_,
                                   bool temporal_, double dropout)
    : in(in_), out(out_), decoder(decoder_), resampling(resample_), temporal(temporal_) {
  auto list = register_module("resnets", torch::nn::ModuleList());
  for (int64_t i = 0; i < blocks; ++i) {
    resnets.push_back(QwenVaeResBlock(i == 0 ? in : out, out, dropout));
    list->push_back(resnets.back());
  }
  if (!resampling) return;
  // Named as the reference's Resample: resample.1 is the convolution (resample.0 its padding or upsampling).
  resample = decoder ? same_conv(out, out, 3) : torch::nn::Conv2d(torch::nn::Conv2dOptions(out, out, 3).stride(2));
  auto sampler = std::make_shared<torch::nn::Module>();
  sampler->register_module("resample", torch::nn::ModuleList(torch::nn::Identity(), resample));
  if (temporal) {
    // The temporal convolution of the reference's later frames: never reached by an image (see the header).
    const int64_t t_out = decoder ? 2 * out : out;
    auto time_conv = std::make_shared<torch::nn::Module>();
    time_conv->register_buffer("weight", at::zeros({t_out, out, 1, 1}));
    time_conv->register_buffer("bias", at::zeros({t_out}));
    sampler->register_module("time_conv", time_conv);
  }
  register_module(decoder ? "upsampler" : "downsampler", sampler);
}

Tensor QwenVaeLevelImpl::forward(const Tensor& x) {
  Tensor h = x;
  for (auto& r : resnets) h = r(h);
  const int64_t ft = temporal ? 2 : 1;
  if (!decoder) {
    if (resampling) h = conv(at::constant_pad_nd(h, {0, 1, 0, 1}), resample);
    return h + avg_down(x, out, ft, resampling ? 2 : 1);
  }
  if (!resampling) return h;
  // nearest-exact 2x, through float32 as the reference (exact either way)
  h = at::upsample_nearest2d(h.to(at::kFloat), {2 * h.size(2), 2 * h.size(3)}).to(h.scalar_type());
  return conv(h, resample) + dup_up(x, out, ft, 2);
}

QwenVaeCoderImpl::QwenVaeCoderImpl(const QwenImageVaeOptions& o, bool decoder_) : decoder(decoder_) {
  const auto d = level_widths(o, decoder);
  conv_in = register_module("conv_in", same_conv(decoder ? o.z_dim() : o.in_channels(), d.front(), 3));
  if (decoder) mid_block = register_module("mid_block", QwenVaeMidBlock(d.front(), o));
  auto list = register_module(decoder ? "up_blocks" : "down_blocks", torch::nn::ModuleList());
  const size_t n = o.dim_mult().size();
  for (size_t i = 0; i < n; ++i) {
    const bool resample = i + 1 != n;
    levels.push_back(QwenVaeLevel(d[i], d[i + 1], o.num_res_blocks() + (decoder ? 1 : 0), decoder, resample,
                                  temporal_level(o, decoder, i), o.dropout()));
    list->push_back(levels.back());
  }
  if (!decoder) mid_block = register_module("mid_block", QwenVaeMidBlock(d.back(), o));
  norm_out = register_module("norm_out", QwenVaeRmsNorm(d.back(), false));
  conv_out = register_module("conv_out", same_conv(d.back(), decoder ? o.out_channels() : 2 * o.z_dim(), 3));
  remat = o.remat();
}

Tensor QwenVaeCoderImpl::forward(const Tensor& x) {
  Tensor h = conv(x, conv_in);
  if (decoder) h = run_level(mid_block, h, remat);
  for (auto& l : levels) h = run_level(l, h, remat);
  if (!decoder) h = run_level(mid_block, h, remat);
  return conv(at::silu(norm_out(h)), conv_out);
}

// ---- the model ----

QwenImageVaeImpl::QwenImageVaeImpl(QwenImageVaeOptions options_) : options(std::move(options_)) {
  const auto& o = options;
  const std::string w = "autoencoder_kl_qwen_image";
  const auto& m = o.dim_mult();
  DEW_CHECK(!m.empty(), w, ": dim_mult must not be empty");
  for (size_t i = 0; i < m.size(); ++i) DEW_CHECK(m[i] > 0, w, ": dim_mult[", i, "] must be > 0, got ", m[i]);
  DEW_CHECK(
      o.in_channels() > 0 && o.out_channels() > 0 && o.z_dim() > 0 && o.base_dim() > 0 && o.decoder_base_dim() > 0, w,
      ": in_channels, out_channels, z_dim, base_dim and decoder_base_dim must be > 0, got ", o.in_channels(), ", ",
      o.out_channels(), ", ", o.z_dim(), ", ", o.base_dim(), ", ", o.decoder_base_dim());
  DEW_CHECK(o.num_res_blocks() >= 1, w, ": num_res_blocks must be >= 1, got ", o.num_res_blocks());
  DEW_CHECK(o.temperal_downsample().size() + 1 == m.size(), w, ": temperal_downsample needs one value per downsampling",
            " level (", m.size() - 1, " for ", m.size(), " dim_mult levels), got ", o.temperal_downsample().size());
  DEW_CHECK(o.dropout() >= 0 && o.dropout() < 1, w, ": dropout must be in [0, 1), got ", o.dropout());
  // The shortcuts fold pixels (and a frame) into channels and average or repeat them: the widths must divide.
  for (bool decoder : {false, true}) {
    const auto d = level_widths(o, decoder);
    for (size_t i = 0; i < m.size(); ++i) {
      const bool resample = i + 1 != m.size();
      if (decoder && !resample) continue;
      const int64_t factor = (temporal_level(o, decoder, i) ? 2 : 1) * (resample ? 4 : 1);
      const int64_t in = d[i], out = d[i + 1];
      DEW_CHECK(decoder ? (out * factor) % in == 0 : (in * factor) % out == 0, w, ": ",
                decoder ? "decoder level " : "encoder level ", i, " goes from ", in, " to ", out,
                " channels, which its shortcut cannot ", decoder ? "repeat" : "average", " with factor ", factor, " (",
                decoder ? "out x factor must be a multiple of in" : "in x factor must be a multiple of out",
                "); change dim_mult");
    }
  }
  DEW_CHECK(o.latents_mean().has_value() == o.latents_std().has_value(), w,
            ": latents_mean and latents_std go together (both or neither)");
  if (o.latents_mean()) {
    DEW_CHECK(int64_t(o.latents_mean()->size()) == o.z_dim() && int64_t(o.latents_std()->size()) == o.z_dim(), w,
              ": latents_mean and latents_std need one value per latent channel (", o.z_dim(), "), got ",
              o.latents_mean()->size(), " and ", o.latents_std()->size());
    for (double s : *o.latents_std()) DEW_CHECK(s > 0 && std::isfinite(s), w, ": latents_std must be > 0, got ", s);
    for (double s : *o.latents_mean()) DEW_CHECK(std::isfinite(s), w, ": latents_mean must be finite, got ", s);
  }
  dtype_ = parse_compute_dtype(o.dtype(), w + ".dtype");
  check_attention_impl(o.attention_impl(), w + ".attention_impl");
  reset();
}

void QwenImageVaeImpl::reset() {
  const auto& o = options;
  encoder = register_module("encoder", QwenVaeCoder(o, false));
  quant_conv = register_module("quant_conv", same_conv(2 * o.z_dim(), 2 * o.z_dim(), 1));
  post_quant_conv = register_module("post_quant_conv", same_conv(o.z_dim(), o.z_dim(), 1));
  decoder = register_module("decoder", QwenVaeCoder(o, true));
}

int64_t QwenImageVaeImpl::downsampling() const { return int64_t(1) << (options.dim_mult().size() - 1); }

at::ScalarType QwenImageVaeImpl::compute_dtype() const {
  return encoder->conv_in->weight.scalar_type() == at::kDouble ? at::kDouble : dtype_;
}

DiagonalGaussian QwenImageVaeImpl::encode(const Tensor& x) {
  const auto& o = options;
  const int64_t f = downsampling();
  DEW_CHECK(x.dim() == 4 && x.size(1) == o.in_channels(), "autoencoder_kl_qwen_image: the image must be [B, ",
            o.in_channels(), ", H, W], got ", x.sizes());
  DEW_CHECK(x.size(2) > 0 && x.size(3) > 0 && x.size(2) % f == 0 && x.size(3) % f == 0,
            "autoencoder_kl_qwen_image: the image's height and width must be positive multiples of ", f,
            " (the VAE's downsampling), got ", x.size(2), " x ", x.size(3));
  const Tensor h = conv(encoder(x.to(compute_dtype())), quant_conv);
  const auto out = compute_dtype() == at::kDouble ? at::kDouble : at::kFloat;
  const auto parts = h.to(out).chunk(2, 1);
  return DiagonalGaussian(parts[0], parts[1]);
}

Tensor QwenImageVaeImpl::decode(const Tensor& z) {
  const auto& o = options;
  DEW_CHECK(z.dim() == 4 && z.size(1) == o.z_dim() && z.size(2) > 0 && z.size(3) > 0,
            "autoencoder_kl_qwen_image: latents must be [B, ", o.z_dim(), ", h, w], got ", z.sizes());
  const Tensor h = decoder(conv(z.to(compute_dtype()), post_quant_conv));
  const auto out = compute_dtype() == at::kDouble ? at::kDouble : at::kFloat;
  return h.to(out).clamp(-1.0, 1.0);
}

Tensor QwenImageVaeImpl::statistics(const std::optional<std::vector<double>>& values, double fallback,
                                    const Tensor& like) const {
  const auto f = at::TensorOptions().dtype(at::kDouble);
  const Tensor t = values ? at::tensor(*values, f) : at::full({options.z_dim()}, fallback, f);
  // float32 statistics as the pipeline's torch.tensor(config list), applied in the latents' dtype
  return t.to(at::kFloat).to(like.scalar_type()).to(like.device()).view({1, -1, 1, 1});
}

Tensor QwenImageVaeImpl::to_latent(const Tensor& z) const {
  DEW_CHECK(z.dim() == 4 && z.size(1) == options.z_dim(), "autoencoder_kl_qwen_image: latents must be [B, ",
            options.z_dim(), ", h, w], got ", z.sizes());
  return (z - statistics(options.latents_mean(), 0.0, z)) / statistics(options.latents_std(), 1.0, z);
}

Tensor QwenImageVaeImpl::from_latent(const Tensor& latent) const {
  DEW_CHECK(latent.dim() == 4 && latent.size(1) == options.z_dim(), "autoencoder_kl_qwen_image: latents must be [B, ",
            options.z_dim(), ", h, w], got ", latent.sizes());
  return latent * statistics(options.latents_std(), 1.0, latent) + statistics(options.latents_mean(), 0.0, latent);
}

// ---- diffusers config ----

std::vector<models::ReferenceMethod> qwen_image_vae_methods() {
  using Tensors = std::map<std::string, Tensor>;
  auto vae_of = [](torch::nn::Module& m, const std::string& where) {
    auto* vae = dynamic_cast<QwenImageVaeImpl*>(&m);
    DEW_CHECK(vae, where, ": the model is not an autoencoder_kl_qwen_image");
    return vae;
  };
  // Back to the reference's one-frame layout when the input was in it.
  auto as_input = [](const Tensor& t, bool frame) { return frame ? t.unsqueeze(2) : t; };
  auto encode = [=](torch::nn::Module& m, const Tensors& in, const std::string& where) {
    bool frame = false;
    const Tensor x = one_frame(in.at("sample"), "sample", where, frame);
    const DiagonalGaussian q = vae_of(m, where)->encode(x);
    return Tensors{{"latent_mean", as_input(q.mean, frame)}, {"latent_logvar", as_input(q.logvar, frame)}};
  };
  auto decode = [=](torch::nn::Module& m, const Tensors& in, const std::string& where) {
    bool frame = false;
    const Tensor z = one_frame(in.at("z"), "z", where, frame);
    return Tensors{{"sample", as_input(vae_of(m, where)->decode(z), frame)}};
  };
  auto reconstruct = [=](torch::nn::Module& m, const Tensors& in, const std::string& where) {
    bool frame = false;
    const Tensor x = one_frame(in.at("sample"), "sample", where, frame);
    auto* vae = vae_of(m, where);
    return Tensors{{"sample", as_input(vae->decode(vae->encode(x).mean), frame)}};
  };
  return {{"encode", {"sample"}, {}, {"latent_mean", "latent_logvar"}, encode},
          {"decode", {"z"}, {}, {"sample"}, decode},
          {"forward", {"sample"}, {}, {"sample"}, reconstruct}};
}

}  // namespace dew::nn

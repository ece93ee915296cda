#include "dew/nn/backbones/autoencoder_kl.h"

#include <ATen/ATen.h>
#include <torch/nn/modules/container/modulelist.h>

#include <cmath>
#include <functional>
#include <set>

#include "dew/core/error.h"

namespace dew::nn {

using at::Tensor;

namespace {

// A convolution padded to keep the spatial size (odd kernels).
torch::nn::Conv2d same_conv2d(int64_t in, int64_t out, int64_t kernel) {
  return torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, kernel).padding(kernel / 2));
}

torch::nn::GroupNorm group_norm(int64_t channels, const AutoencoderKLOptions& o) {
  return torch::nn::GroupNorm(torch::nn::GroupNormOptions(o.norm_groups(), channels).eps(o.norm_eps()));
}

ResBlock resnet(int64_t in, int64_t out, const AutoencoderKLOptions& o) {
  // diffusers' ResnetBlock2D with temb_channels None, PyTorch's default initialisation
  return ResBlock(ResBlockOptions(in, out, 0)
                      .norm_groups(o.norm_groups())
                      .norm_eps(o.norm_eps())
                      .activation("silu")
                      .zero_init(false));
}

// Runs module(x) with its activations recomputed in backward when `remat` applies.
template <class M>
Tensor run_block(M& block, const Tensor& x, bool remat_on) {
  if (!remat_on || !block->is_training() || !at::GradMode::is_enabled()) return block(x);
  auto b = block;
  return remat(*b, [b](const std::vector<Tensor>& in) mutable { return b(in[0]); }, {x});
}

// diffusers' blend_v / blend_h: b's first `extent` rows (dim 2) or columns (dim 3) become
// a's last ones * (1 - i / extent) + b's * (i / extent). In place on b, as diffusers (later tiles blend
// with the already-blended ones).
void blend(const Tensor& a, Tensor& b, int64_t extent, int64_t dim) {
  extent = std::min({a.size(dim), b.size(dim), extent});
  if (extent <= 0) return;
  std::vector<double> w(static_cast<size_t>(extent)), v(static_cast<size_t>(extent));
  for (int64_t i = 0; i < extent; ++i) {
    w[size_t(i)] = double(i) / double(extent);
    v[size_t(i)] = 1.0 - double(i) / double(extent);
  }
  std::vector<int64_t> shape(4, 1);
  shape[size_t(dim)] = extent;
  const auto f = at::TensorOptions().dtype(at::kDouble);
  const Tensor wb = at::tensor(w, f).view(shape).to(b.scalar_type()).to(b.device());
  const Tensor wa = at::tensor(v, f).view(shape).to(b.scalar_type()).to(b.device());
  Tensor head = b.narrow(dim, 0, extent);
  head.copy_(a.narrow(dim, a.size(dim) - extent, extent) * wa + head * wb);
}

// diffusers' tiling, shared by tiled_decode and tiled_encode: tiles of `tile` input positions every `step`,
// each mapped by fn; every output tile is blended with the one above and the one to its left over `extent`,
// cropped to `limit` and the crops concatenated. Only the previous row of mapped tiles is kept.
Tensor map_tiles(const Tensor& x, int64_t tile, int64_t step, int64_t extent, int64_t limit,
                 const std::function<Tensor(const Tensor&)>& fn) {
  std::vector<Tensor> prev_row, rows;
  for (int64_t i = 0; i < x.size(2); i += step) {
    std::vector<Tensor> row, cropped;
    for (int64_t j = 0; j < x.size(3); j += step) {
      Tensor m = fn(x.narrow(2, i, std::min(tile, x.size(2) - i)).narrow(3, j, std::min(tile, x.size(3) - j)));
      if (!prev_row.empty()) blend(prev_row[row.size()], m, extent, 2);
      if (!row.empty()) blend(row.back(), m, extent, 3);
      cropped.push_back(m.narrow(2, 0, std::min(limit, m.size(2))).narrow(3, 0, std::min(limit, m.size(3))));
      row.push_back(m);
    }
    rows.push_back(at::cat(cropped, 3));
    prev_row = std::move(row);
  }
  return at::cat(rows, 2);
}

}  // namespace

// ---- blocks ----

VaeMidBlockImpl::VaeMidBlockImpl(int64_t channels, const AutoencoderKLOptions& o) {
  auto list = register_module("resnets", torch::nn::ModuleList());
  for (int i = 0; i < 2; ++i) {
    resnets.push_back(resnet(channels, channels, o));
    list->push_back(resnets.back());
  }
  if (o.mid_block_attention()) {
    attention = SpatialSelfAttention(channels, o.norm_groups(), o.norm_eps(), o.attention_impl());
    attention->attn->options.force_fp32_for_softmax(o.force_fp32_for_softmax());
    register_module("attentions", torch::nn::ModuleList(attention));
  }
}

Tensor VaeMidBlockImpl::forward(const Tensor& x) {
  Tensor h = resnets[0](x);
  if (!attention.is_empty()) h = attention(h);
  return resnets[1](h);
}

VaeLevelImpl::VaeLevelImpl(int64_t in, int64_t out, int64_t blocks, bool decoder, bool resample,
                           const AutoencoderKLOptions& o) {
  auto list = register_module("resnets", torch::nn::ModuleList());
  for (int64_t i = 0; i < blocks; ++i) {
    resnets.push_back(resnet(i == 0 ? in : out, out, o));
    list->push_back(resnets.back());
  }
  if (!resample) return;
  if (decoder) {
    up = Upsample2D(out);
    register_module("upsamplers", torch::nn::ModuleList(up));
  } else {
    down = Downsample2D(Downsample2DOptions(out).padding(0));
    register_module("downsamplers", torch::nn::ModuleList(down));
  }
}

Tensor VaeLevelImpl::forward(const Tensor& x) {
  Tensor h = x;
  for (auto& r : resnets) h = r(h);
  if (!down.is_empty()) h = down(h);
  if (!up.is_empty()) h = up->forward(h);
  return h;
}

// ---- encoder / decoder ----

VaeEncoderImpl::VaeEncoderImpl(const AutoencoderKLOptions& o) : remat(o.remat()) {
  const auto& ch = o.block_out_channels();
  const int64_t levels = int64_t(ch.size());
  conv_in = register_module("conv_in", same_conv2d(o.in_channels(), ch[0], 3));
  auto list = register_module("down_blocks", torch::nn::ModuleList());
  int64_t prev = ch[0];
  for (int64_t i = 0; i < levels; ++i) {
    down_blocks.push_back(VaeLevel(prev, ch[size_t(i)], o.layers_per_block(), false, i + 1 < levels, o));
    list->push_back(down_blocks.back());
    prev = ch[size_t(i)];
  }
  mid_block = register_module("mid_block", VaeMidBlock(ch.back(), o));
  conv_norm_out = register_module("conv_norm_out", group_norm(ch.back(), o));
  conv_out = register_module("conv_out", same_conv2d(ch.back(), 2 * o.latent_channels(), 3));
}

// Both halves run channels-last on the CPU in float32 (cpu_channels_last), so their 3 x 3 convolutions
// take the Winograd path; the output is returned contiguous.
Tensor VaeEncoderImpl::forward(const Tensor& x) {
  Tensor h = cpu_channels_last(conv(cpu_channels_last(x), conv_in));
  for (auto& b : down_blocks) h = run_block(b, h, remat);
  h = run_block(mid_block, h, remat);
  return conv(group_norm_act(h, conv_norm_out, "silu"), conv_out).contiguous();
}

VaeDecoderImpl::VaeDecoderImpl(const AutoencoderKLOptions& o) : remat(o.remat()) {
  const auto& ch = o.block_out_channels();
  const int64_t levels = int64_t(ch.size());
  conv_in = register_module("conv_in", same_conv2d(o.latent_channels(), ch.back(), 3));
  mid_block = register_module("mid_block", VaeMidBlock(ch.back(), o));
  auto list = register_module("up_blocks", torch::nn::ModuleList());
  int64_t prev = ch.back();
  for (int64_t i = 0; i < levels; ++i) {
    const int64_t out = ch[size_t(levels - 1 - i)];
    up_blocks.push_back(VaeLevel(prev, out, o.layers_per_block() + 1, true, i + 1 < levels, o));
    list->push_back(up_blocks.back());
    prev = out;
  }
  conv_norm_out = register_module("conv_norm_out", group_norm(ch[0], o));
  conv_out = register_module("conv_out", same_conv2d(ch[0], o.out_channels(), 3));
}

Tensor VaeDecoderImpl::forward(const Tensor& z) {
  Tensor h = cpu_channels_last(conv(cpu_channels_last(z), conv_in));
  h = run_block(mid_block, h, remat);
  for (auto& b : up_blocks) h = run_block(b, h, remat);
  return conv(group_norm_act(h, conv_norm_out, "silu"), conv_out).contiguous();
}

// ---- AutoencoderKL ----

AutoencoderKLImpl::AutoencoderKLImpl(AutoencoderKLOptions options_) : options(std::move(options_)) {
  const auto& o = options;
  const std::string w = "autoencoder_kl";
  DEW_CHECK(!o.block_out_channels().empty(), w, ": block_out_channels must not be empty");
  DEW_CHECK(o.norm_groups() > 0, w, ": norm_groups must be > 0, got ", o.norm_groups());
  for (size_t i = 0; i < o.block_out_channels().size(); ++i)
    DEW_CHECK(o.block_out_channels()[i] > 0 && o.block_out_channels()[i] % o.norm_groups() == 0, w,
              ": block_out_channels[", i, "] must be a positive multiple of norm_groups ", o.norm_groups(), ", got ",
              o.block_out_channels()[i]);
  DEW_CHECK(o.layers_per_block() >= 1, w, ": layers_per_block must be >= 1, got ", o.layers_per_block());
  DEW_CHECK(o.in_channels() > 0 && o.out_channels() > 0 && o.latent_channels() > 0, w,
            ": in_channels, out_channels and latent_channels must be > 0, got ", o.in_channels(), ", ",
            o.out_channels(), ", ", o.latent_channels());
  DEW_CHECK(o.norm_eps() > 0, w, ": norm_eps must be > 0, got ", o.norm_eps());
  DEW_CHECK(std::isfinite(o.scaling_factor()) && o.scaling_factor() != 0, w,
            ": scaling_factor must be finite and non-zero, got ", o.scaling_factor());
  DEW_CHECK(o.latents_mean().has_value() == o.latents_std().has_value(), w,
            ": latents_mean and latents_std go together (both or neither)");
  if (o.latents_mean()) {
    DEW_CHECK(int64_t(o.latents_mean()->size()) == o.latent_channels() &&
                  int64_t(o.latents_std()->size()) == o.latent_channels(),
              w, ": latents_mean and latents_std need one value per latent channel (", o.latent_channels(), "), got ",
              o.latents_mean()->size(), " and ", o.latents_std()->size());
    for (double s : *o.latents_std()) DEW_CHECK(s > 0, w, ": latents_std must be > 0, got ", s);
  }
  DEW_CHECK(o.sample_size() >= 1, w, ": sample_size must be >= 1, got ", o.sample_size());
  dtype_ = parse_compute_dtype(o.dtype(), w + ".dtype");
  check_attention_impl(o.attention_impl(), w + ".attention_impl");
  reset();
}

void AutoencoderKLImpl::reset() {
  const auto& o = options;
  encoder = register_module("encoder", VaeEncoder(o));
  decoder = register_module("decoder", VaeDecoder(o));
  const int64_t c = o.latent_channels();
  if (o.use_quant_conv()) quant_conv = register_module("quant_conv", same_conv2d(2 * c, 2 * c, 1));
  if (o.use_post_quant_conv()) post_quant_conv = register_module("post_quant_conv", same_conv2d(c, c, 1));
}

int64_t AutoencoderKLImpl::downsampling() const { return int64_t(1) << (options.block_out_channels().size() - 1); }

at::ScalarType AutoencoderKLImpl::compute_dtype() const {
  return encoder->conv_in->weight.scalar_type() == at::kDouble ? at::kDouble : dtype_;
}

Tensor AutoencoderKLImpl::moments(const Tensor& x) {
  const auto& o = options;
  DEW_CHECK(x.dim() == 4 && x.size(1) == o.in_channels(), "autoencoder_kl: the image must be [B, ", o.in_channels(),
            ", H, W], got ", x.sizes());
  Tensor h = encoder(x.to(compute_dtype()));
  if (!quant_conv.is_empty()) h = conv(h, quant_conv);
  return h;
}

DiagonalGaussian AutoencoderKLImpl::encode(const Tensor& x) {
  const auto out = compute_dtype() == at::kDouble ? at::kDouble : at::kFloat;
  const auto parts = moments(x).to(out).chunk(2, 1);
  return DiagonalGaussian(parts[0], parts[1]);
}

Tensor AutoencoderKLImpl::decode(const Tensor& z) {
  const auto& o = options;
  DEW_CHECK(z.dim() == 4 && z.size(1) == o.latent_channels(), "autoencoder_kl: latents must be [B, ",
            o.latent_channels(), ", h, w], got ", z.sizes());
  Tensor h = z.to(compute_dtype());
  if (!post_quant_conv.is_empty()) h = conv(h, post_quant_conv);
  const auto out = compute_dtype() == at::kDouble ? at::kDouble : at::kFloat;
  return decoder(h).to(out);
}

Tensor AutoencoderKLImpl::reconstruct(const Tensor& x, std::optional<at::Generator> gen) {
  const DiagonalGaussian q = encode(x);
  return decode(gen ? q.sample(*gen) : q.mean);
}

Tensor AutoencoderKLImpl::tiled_decode(const Tensor& z, const VaeTileOptions& tile) {
  const auto& o = options;
  DEW_CHECK(z.dim() == 4 && z.size(1) == o.latent_channels(), "autoencoder_kl: latents must be [B, ",
            o.latent_channels(), ", h, w], got ", z.sizes());
  DEW_CHECK(tile.overlap() >= 0 && tile.overlap() < 1, "autoencoder_kl: tile overlap must be in [0, 1), got ",
            tile.overlap());
  const int64_t sample = tile.sample_size() > 0 ? tile.sample_size() : o.sample_size();
  // diffusers: tile_latent_min_size = int(sample_size / 2^(L-1)); the integer casts below are Python's int()
  const int64_t latent = int64_t(double(sample) / double(downsampling()));
  DEW_CHECK(latent >= 1, "autoencoder_kl: a tile of ", sample, " pixels is under one latent (", downsampling(),
            " pixels)");
  const int64_t step = int64_t(double(latent) * (1 - tile.overlap()));
  const int64_t extent = int64_t(double(sample) * tile.overlap());
  const int64_t limit = sample - extent;
  DEW_CHECK(step >= 1, "autoencoder_kl: tiles of ", latent, " latents with overlap ", tile.overlap(),
            " do not advance");
  return map_tiles(z, latent, step, extent, limit, [this](const Tensor& t) { return decode(t); });
}

DiagonalGaussian AutoencoderKLImpl::tiled_encode(const Tensor& x, const VaeTileOptions& tile) {
  const auto& o = options;
  DEW_CHECK(x.dim() == 4 && x.size(1) == o.in_channels(), "autoencoder_kl: the image must be [B, ", o.in_channels(),
            ", H, W], got ", x.sizes());
  DEW_CHECK(tile.overlap() >= 0 && tile.overlap() < 1, "autoencoder_kl: tile overlap must be in [0, 1), got ",
            tile.overlap());
  const int64_t sample = tile.sample_size() > 0 ? tile.sample_size() : o.sample_size();
  const int64_t latent = int64_t(double(sample) / double(downsampling()));
  DEW_CHECK(latent >= 1, "autoencoder_kl: a tile of ", sample, " pixels is under one latent (", downsampling(),
            " pixels)");
  const int64_t step = int64_t(double(sample) * (1 - tile.overlap()));
  const int64_t extent = int64_t(double(latent) * tile.overlap());
  const int64_t limit = latent - extent;
  DEW_CHECK(step >= 1, "autoencoder_kl: tiles of ", sample, " pixels with overlap ", tile.overlap(), " do not advance");
  const auto out = compute_dtype() == at::kDouble ? at::kDouble : at::kFloat;
  const auto parts = map_tiles(x, sample, step, extent, limit, [this, out](const Tensor& t) {
                       return moments(t).to(out);
                     }).chunk(2, 1);
  return DiagonalGaussian(parts[0], parts[1]);
}

Tensor AutoencoderKLImpl::to_latent(const Tensor& z) const {
  const auto& o = options;
  if (!o.latents_mean()) return AutoencoderImpl::to_latent(z);
  const auto f = at::TensorOptions().dtype(at::kDouble);
  const Tensor mean = at::tensor(*o.latents_mean(), f).view({1, -1, 1, 1}).to(z.scalar_type()).to(z.device());
  const Tensor std = at::tensor(*o.latents_std(), f).view({1, -1, 1, 1}).to(z.scalar_type()).to(z.device());
  return (z - mean) * o.scaling_factor() / std;
}

Tensor AutoencoderKLImpl::from_latent(const Tensor& latent) const {
  const auto& o = options;
  if (!o.latents_mean()) return AutoencoderImpl::from_latent(latent);
  const auto f = at::TensorOptions().dtype(at::kDouble);
  const auto dt = latent.scalar_type();
  const Tensor mean = at::tensor(*o.latents_mean(), f).view({1, -1, 1, 1}).to(dt).to(latent.device());
  const Tensor std = at::tensor(*o.latents_std(), f).view({1, -1, 1, 1}).to(dt).to(latent.device());
  return latent * std / o.scaling_factor() + mean;
}

json autoencoder_kl_diffusers_config(const AutoencoderKLOptions& o) {
  const size_t levels = o.block_out_channels().size();
  auto opt = [](const auto& v) { return v ? json(*v) : json(nullptr); };
  return {{"_class_name", "AutoencoderKL"},
          {"in_channels", o.in_channels()},
          {"out_channels", o.out_channels()},
          {"down_block_types", std::vector<std::string>(levels, "DownEncoderBlock2D")},
          {"up_block_types", std::vector<std::string>(levels, "UpDecoderBlock2D")},
          {"block_out_channels", o.block_out_channels()},
          {"layers_per_block", o.layers_per_block()},
          {"act_fn", "silu"},
          {"latent_channels", o.latent_channels()},
          {"norm_num_groups", o.norm_groups()},
          {"sample_size", o.sample_size()},
          {"scaling_factor", o.scaling_factor()},
          {"shift_factor", opt(o.shift_factor())},
          {"latents_mean", opt(o.latents_mean())},
          {"latents_std", opt(o.latents_std())},
          {"force_upcast", o.force_upcast()},
          {"use_quant_conv", o.use_quant_conv()},
          {"use_post_quant_conv", o.use_post_quant_conv()},
          {"mid_block_add_attention", o.mid_block_attention()}};
}

io::KeyMap autoencoder_kl_key_map(const AutoencoderKLOptions& o, const io::WeightSource& source) {
  io::KeyMap m;
  const auto names = source.names();
  const bool full_sd = std::any_of(names.begin(), names.end(),
                                   [](const std::string& n) { return n.rfind("first_stage_model.", 0) == 0; });
  if (full_sd) {
    // A whole Stable Diffusion checkpoint: its VAE is first_stage_model.*; the UNet and text encoder are not ours.
    m.skip("^(?!first_stage_model\\.).*");
    m.prefix("first_stage_model.", "");
  }
  // Original LDM / CompVis names (ldm.modules.diffusionmodules.model.Encoder / Decoder).
  m.regex("^(encoder|decoder)\\.mid\\.block_1\\.(.*)$", "$1.mid_block.resnets.0.$2");
  m.regex("^(encoder|decoder)\\.mid\\.block_2\\.(.*)$", "$1.mid_block.resnets.1.$2");
  m.regex("^(encoder|decoder)\\.mid\\.attn_1\\.norm\\.(.*)$", "$1.mid_block.attentions.0.group_norm.$2");
  m.regex("^(encoder|decoder)\\.mid\\.attn_1\\.q\\.(.*)$", "$1.mid_block.attentions.0.to_q.$2");
  m.regex("^(encoder|decoder)\\.mid\\.attn_1\\.k\\.(.*)$", "$1.mid_block.attentions.0.to_k.$2");
  m.regex("^(encoder|decoder)\\.mid\\.attn_1\\.v\\.(.*)$", "$1.mid_block.attentions.0.to_v.$2");
  m.regex("^(encoder|decoder)\\.mid\\.attn_1\\.proj_out\\.(.*)$", "$1.mid_block.attentions.0.to_out.0.$2");
  m.regex("^encoder\\.down\\.(\\d+)\\.block\\.(\\d+)\\.(.*)$", "encoder.down_blocks.$1.resnets.$2.$3");
  m.regex("^encoder\\.down\\.(\\d+)\\.downsample\\.conv\\.(.*)$", "encoder.down_blocks.$1.downsamplers.0.conv.$2");
  const int64_t levels = int64_t(o.block_out_channels().size());
  for (int64_t i = 0; i < levels; ++i) {  // LDM's decoder.up.N runs deepest last; diffusers' up_blocks.0 is the deepest
    const std::string from = "^decoder\\.up\\." + std::to_string(i) + "\\.";
    const std::string to = "decoder.up_blocks." + std::to_string(levels - 1 - i) + ".";
    m.regex(from + "block\\.(\\d+)\\.(.*)$", to + "resnets.$1.$2");
    m.regex(from + "upsample\\.conv\\.(.*)$", to + "upsamplers.0.conv.$1");
  }
  m.regex("^(.*)\\.nin_shortcut\\.(.*)$", "$1.conv_shortcut.$2");
  m.regex("^(encoder|decoder)\\.norm_out\\.(.*)$", "$1.conv_norm_out.$2");
  // diffusers' deprecated attention block names (files saved before its Attention refactor)
  m.regex("^(.*\\.attentions\\.0)\\.query\\.(.*)$", "$1.to_q.$2");
  m.regex("^(.*\\.attentions\\.0)\\.key\\.(.*)$", "$1.to_k.$2");
  m.regex("^(.*\\.attentions\\.0)\\.value\\.(.*)$", "$1.to_v.$2");
  m.regex("^(.*\\.attentions\\.0)\\.proj_attn\\.(.*)$", "$1.to_out.0.$2");
  // LDM's q, k, v, proj_out are 1x1 convs: [C, C, 1, 1] -> the linear's [C, C]
  m.squeeze("^.*\\.attentions\\.0\\.(to_q|to_k|to_v|to_out\\.0)\\.weight$");
  return m;
}

}  // namespace dew::nn

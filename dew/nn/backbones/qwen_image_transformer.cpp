#include "dew/nn/backbones/qwen_image_transformer.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <set>

#include "dew/core/error.h"
#include "dew/nn/blocks.h"
#include "dew/nn/diffusers_blocks.h"

namespace dew::nn {

using at::Tensor;

namespace qwen_image_detail {

const char* kQwenArch = "qwen_image_transformer";

// Compute dtype of a forward pass: the configured one, or float64 when the model was moved to float64.
at::ScalarType qwen_compute_dtype(const torch::nn::Linear& first, at::ScalarType configured) {
  return first->weight.scalar_type() == at::kDouble ? at::kDouble : configured;
}

// diffusers' RMSNorm over the head width: the variance in float32 (even for float64 inputs), the product in the
// input's dtype; half types take HeadNorm's float32 path.
Tensor qwen_rms_heads(const Tensor& x, HeadNorm& norm) {
  if (x.scalar_type() != at::kDouble && x.scalar_type() != at::kFloat) return norm(x);
  const Tensor var = x.to(at::kFloat).pow(2).mean(-1, /*keepdim=*/true);
  return x * at::rsqrt(var + norm->options.eps()).to(x.scalar_type()) * norm->weight.to(x.scalar_type());
}

// QwenImage21Rope's tables for positions [S, 3] (frame, height, width; int64, negative allowed): per axis of
// width d, the frequencies 1 / theta^(2j / d) and their products with the positions in float32, then
// torch.polar, as diffusers builds them (rope_params).
QwenRope qwen_rope(const Tensor& pos, const std::vector<int64_t>& axes_dims) {
  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(pos.device());
  std::vector<Tensor> parts;
  for (size_t i = 0; i < axes_dims.size(); ++i) {
    const int64_t d = axes_dims[i];
    const Tensor inv = 1.0 / at::pow(10000.0, at::arange(0, d, 2, f32).div(static_cast<double>(d)));
    const Tensor angles = at::outer(pos.select(1, static_cast<int64_t>(i)).to(at::kFloat), inv);  // [S, d / 2]
    parts.push_back(at::polar(at::ones_like(angles), angles));
  }
  return {at::cat(parts, 1)};
}

QwenRope qwen_rope_rows(const QwenRope& r, int64_t start) {
  return {r.freqs.narrow(0, start, r.freqs.size(0) - start)};
}

// _select_modulation_rows: params [B + 1, X] with causal_condition (the last row from t = 0) -> [B, S, X], the
// target tokens taking their sample's row and the others the t = 0 row; [B, X] without -> [B, 1, X].
Tensor qwen_select_rows(const Tensor& params, const Tensor& target) {
  if (!target.defined()) return params.unsqueeze(1);
  const int64_t B = params.size(0) - 1;
  return at::where(target.view({1, -1, 1}), params.narrow(0, 0, B).unsqueeze(1), params.narrow(0, B, 1).unsqueeze(0));
}

Tensor qwen_clip_fp16(const Tensor& x) { return x.scalar_type() == at::kHalf ? x.clamp(-65504, 65504) : x; }

torch::nn::Linear qwen_linear(int64_t in, int64_t out) {
  return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(false));
}

}  // namespace qwen_image_detail

using namespace qwen_image_detail;

// ---- RoPE and layout ----

Tensor qwen_apply_rope(const Tensor& x, const QwenRope& rope) {
  DEW_CHECK(
      x.dim() == 4 && rope.freqs.dim() == 2 && x.size(1) == rope.freqs.size(0) && x.size(3) == 2 * rope.freqs.size(1),
      "qwen_apply_rope: x [B, S, H, D] ", x.sizes(), " does not match tables ", rope.freqs.sizes());
  // In diffusers' layout ([B, S, H, D / 2] times [S, 1, D / 2]): the complex product's kernel rounds differently
  // for other broadcast layouts (by up to 2.4e-7 in float32).
  const Tensor xc = at::view_as_complex(x.to(at::kFloat).unflatten(-1, {-1, 2}).contiguous());
  return at::view_as_real(xc * rope.freqs.to(x.device()).unsqueeze(1)).flatten(-2).to(x.scalar_type());
}

QwenImageLayout qwen_image_layout(const std::vector<std::vector<int64_t>>& img_shapes, const Tensor& vlm_image,
                                  const Tensor& text_mask, const std::vector<int64_t>& axes_dims,
                                  const std::string& where, const at::Device& device) {
  DEW_CHECK(!img_shapes.empty(), where, ": img_shapes is empty (at least the target image's (1, height, width))");
  DEW_CHECK(vlm_image.defined() && vlm_image.dim() == 1, where, ": img_mask must be [V] (one row), got ",
            vlm_image.defined() ? vlm_image.sizes() : at::IntArrayRef{});
  std::vector<int64_t> lengths;
  for (size_t i = 0; i < img_shapes.size(); ++i) {
    const auto& s = img_shapes[i];
    DEW_CHECK(s.size() == 3 && s[0] == 1 && s[1] > 0 && s[2] > 0, where, ": img_shapes[", i,
              "] must be (1, height, width) in latent tokens (one frame), got ", json(s).dump());
    lengths.push_back(s[1] * s[2]);
  }
  const auto slots = vlm_image.to(at::kCPU).to(at::kBool).contiguous();
  const bool* is_slot = slots.data_ptr<bool>();
  const int64_t V = slots.size(0);
  // Each image slot of the vision-language sequence stands for 2 x 2 latent tokens.
  std::vector<bool> image;
  std::vector<int64_t> text_pos, text_cols;
  for (int64_t i = 0; i < V; ++i) {
    if (is_slot[i]) {
      image.insert(image.end(), 4, true);
    } else {
      text_pos.push_back(static_cast<int64_t>(image.size()));
      text_cols.push_back(i);
      image.push_back(false);
    }
  }
  const int64_t S = static_cast<int64_t>(image.size());
  const int64_t n_image = S - static_cast<int64_t>(text_pos.size());
  const int64_t total = std::accumulate(lengths.begin(), lengths.end(), int64_t(0));
  DEW_CHECK(total == n_image, where, ": img_shapes ", json(img_shapes).dump(), " accounts for ", total,
            " image tokens but img_mask's ", n_image / 4, " image slots stand for ", n_image,
            " (each slot 2 x 2 latent tokens)");
  DEW_CHECK(lengths.back() % 4 == 0, where, ": the target image (img_shapes' last, ", json(img_shapes.back()).dump(),
            ") must have a multiple of 4 tokens (its 2 x 2 slots)");

  // Image block ids and the RoPE positions (QwenImage21Rope.forward): text advances one shared position on all
  // three axes; an image block freezes the frame axis at the position the text reached, lays its tokens on a
  // height x width grid centred on zero, and advances the position by max(height, width).
  std::vector<int64_t> ids(S, -1), frame(S), hi(S), wi(S);
  int64_t cursor = 0, position = 0;
  for (size_t b = 0; b < img_shapes.size(); ++b) {
    const int64_t h = img_shapes[b][1], w = img_shapes[b][2];
    int64_t start = cursor;
    while (start < S && !image[start]) ++start;
    for (int64_t i = cursor; i < start; ++i) frame[i] = hi[i] = wi[i] = position++;
    for (int64_t r = 0; r < h; ++r)
      for (int64_t c = 0; c < w; ++c) {
        const int64_t i = start + r * w + c;
        DEW_CHECK(i < S && image[i], where, ": img_shapes ", json(img_shapes).dump(),
                  " do not match img_mask: image block ", b, " runs into text at joint position ", i);
        ids[i] = static_cast<int64_t>(b);
        frame[i] = position;
        hi[i] = r - (h - h / 2);
        wi[i] = c - (w - w / 2);
      }
    position += std::max(h, w);
    cursor = start + h * w;
  }
  for (int64_t i = cursor; i < S; ++i) {
    DEW_CHECK(!image[i], where, ": img_mask has image slots after the ", img_shapes.size(), " blocks of img_shapes");
    frame[i] = hi[i] = wi[i] = position++;
  }

  QwenImageLayout l;
  const auto i64 = at::TensorOptions().dtype(at::kLong);
  auto tensor = [&](const std::vector<int64_t>& v) { return at::tensor(v, i64).to(device); };
  std::vector<uint8_t> image_u8(image.begin(), image.end());
  l.image_pad = at::tensor(image_u8, at::TensorOptions().dtype(at::kByte)).to(at::kBool).to(device);
  l.image_ids = tensor(ids);
  l.target = l.image_ids.eq(static_cast<int64_t>(img_shapes.size()) - 1);
  l.text_index = tensor(text_pos);
  l.text_cols = tensor(text_cols);
  l.image_index = l.image_pad.nonzero().view({-1});
  l.vlm_len = V;
  l.prefix_len = S - lengths.back();
  l.rope = qwen_rope(at::stack({tensor(frame), tensor(hi), tensor(wi)}, 1), axes_dims);
  if (text_mask.defined()) {
    DEW_CHECK(text_mask.dim() == 2, where, ": encoder_hidden_states_mask must be [B, E], got ", text_mask.sizes());
    const int64_t E = text_mask.size(1);
    DEW_CHECK(E <= V, where, ": encoder_hidden_states_mask has ", E, " entries, longer than the ", V,
              " of the sequence img_mask lays out (text and image slots)");
    // The text positions of the joint sequence line up, in order, with the text entries of the vision-language
    // sequence; those past the mask (none, with the pipeline's layout) stay valid.
    std::vector<int64_t> cols, pos;
    for (size_t j = 0; j < text_cols.size(); ++j)
      if (text_cols[j] < E) {
        cols.push_back(text_cols[j]);
        pos.push_back(text_pos[j]);
      }
    const Tensor m = text_mask.to(device).to(at::kBool);
    l.key_valid = at::ones({m.size(0), S}, m.options());
    l.key_valid.index_put_({at::indexing::Slice(), tensor(pos)}, m.index_select(1, tensor(cols)));
  }
  return l;
}

// ---- modules ----

QwenImageAttentionImpl::QwenImageAttentionImpl(int64_t dim, int64_t heads_, int64_t head_dim_, double eps)
    : heads(heads_), head_dim(head_dim_) {
  const int64_t inner = heads * head_dim;
  to_q = register_module("to_q", qwen_linear(dim, inner));
  to_k = register_module("to_k", qwen_linear(dim, inner));
  to_v = register_module("to_v", qwen_linear(dim, inner));
  out = qwen_linear(inner, dim);
  register_module("to_out", torch::nn::ModuleList(out));  // to_out.1 is a parameterless dropout
  norm_q = register_module("norm_q", HeadNorm(HeadNormOptions(head_dim).kind("rms").eps(eps)));
  norm_k = register_module("norm_k", HeadNorm(HeadNormOptions(head_dim).kind("rms").eps(eps)));
}

QwenImageFeedForwardImpl::QwenImageFeedForwardImpl(int64_t dim, int64_t hidden) {
  proj = register_module("proj", qwen_linear(dim, hidden));
  out = register_module("out", qwen_linear(hidden, dim));
  gate_layer = register_module("gate_layer", qwen_linear(dim, hidden));
}

Tensor QwenImageFeedForwardImpl::forward(const Tensor& x) {
  return dense(at::silu(dense(x, gate_layer)) * dense(x, proj), out);
}

QwenImageBlockImpl::QwenImageBlockImpl(int64_t heads, int64_t head_dim, int64_t mlp_ratio, double eps_,
                                       std::string attention_impl_, bool force_fp32)
    : eps(eps_), attention_impl(std::move(attention_impl_)), force_fp32_for_softmax(force_fp32) {
  const int64_t d = heads * head_dim;
  attn = register_module("attn", QwenImageAttention(d, heads, head_dim, eps));
  img_mlp = register_module("img_mlp", QwenImageFeedForward(d, mlp_ratio * d));
}

Tensor QwenImageBlockImpl::forward(const Tensor& h, const std::vector<Tensor>& mods, const QwenRope& rope,
                                   const AttentionMask& mask, QwenImageCacheMode mode, int64_t prefix_len,
                                   Tensor* k_cache, Tensor* v_cache) {
  const int64_t B = h.size(0), S = h.size(1);
  const Tensor n1 = layer_norm_fp32(h, eps) * (1 + mods[0]);
  auto split = [&](const torch::nn::Linear& l) { return dense(n1, l).view({B, S, attn->heads, attn->head_dim}); };
  // RMSNorm over each head's width, then RoPE (in float32, as diffusers), heads on dimension 1.
  const Tensor q = qwen_apply_rope(qwen_rms_heads(split(attn->to_q), attn->norm_q), rope).transpose(1, 2);
  Tensor k = qwen_apply_rope(qwen_rms_heads(split(attn->to_k), attn->norm_k), rope).transpose(1, 2);
  Tensor v = split(attn->to_v).transpose(1, 2);
  if (mode == QwenImageCacheMode::kExtract) {
    // Copies, not views: a view would pin the whole sequence's keys for the rest of the sampling loop.
    *k_cache = k.narrow(2, 0, prefix_len).clone();
    *v_cache = v.narrow(2, 0, prefix_len).clone();
  } else if (mode == QwenImageCacheMode::kCached) {
    k = at::cat({k_cache->to(k.scalar_type()), k}, 2);
    v = at::cat({v_cache->to(v.scalar_type()), v}, 2);
  }
  const Tensor a = merge_heads(attention_masked(q, k, v, mask, attention_impl, force_fp32_for_softmax));
  Tensor out = h + at::tanh(mods[1]) * dense(a, attn->out);
  out = out + at::tanh(mods[3]) * img_mlp(layer_norm_fp32(out, eps) * (1 + mods[2]));
  return qwen_clip_fp16(out);
}

// ---- the model ----

QwenImageTransformerImpl::QwenImageTransformerImpl(QwenImageTransformerOptions options_)
    : options(std::move(options_)) {
  const auto& o = options;
  const std::string w = kQwenArch;
  DEW_CHECK(o.in_channels() > 0, w, ": in_channels must be > 0, got ", o.in_channels());
  DEW_CHECK(o.output_channels() > 0, w, ": output_channels must be > 0, got ", o.output_channels());
  DEW_CHECK(o.num_classes() == 0, w, ": num_classes must be 0, got ", o.num_classes(),
            " (Qwen-Image conditions on text, not on class labels: train it with a text encoder, e.g. "
            "--text_encoder.architecture byte_text_encoder)");
  DEW_CHECK(o.context_features() > 0, w, ": context_features must be > 0 (context_in_dim), got ", o.context_features());
  DEW_CHECK(o.num_layers() >= 0, w, ": num_layers must be >= 0, got ", o.num_layers());
  DEW_CHECK(o.num_attention_heads() > 0, w, ": num_attention_heads must be > 0, got ", o.num_attention_heads());
  DEW_CHECK(o.attention_head_dim() > 0 && o.attention_head_dim() % 2 == 0, w,
            ": attention_head_dim must be even and > 0, got ", o.attention_head_dim());
  DEW_CHECK(o.mlp_ratio() > 0, w, ": mlp_ratio must be > 0, got ", o.mlp_ratio());
  DEW_CHECK(o.eps() > 0, w, ": eps must be > 0, got ", o.eps());
  const auto& axes = o.axes_dims_rope();
  DEW_CHECK(axes.size() == 3 && std::all_of(axes.begin(), axes.end(), [](int64_t a) { return a > 0 && a % 2 == 0; }) &&
                std::accumulate(axes.begin(), axes.end(), int64_t(0)) == o.attention_head_dim(),
            w, ": axes_dims_rope must be 3 even widths > 0 (frame, height, width) summing to attention_head_dim ",
            o.attention_head_dim(), ", got ", json(axes).dump());
  dtype_ = parse_compute_dtype(o.dtype(), w + ".dtype");
  check_attention_impl(o.attention_impl(), w + ".attention_impl");
  reset();
}

void QwenImageTransformerImpl::reset() {
  // Parameters keep LibTorch's default initialisation (diffusers' too), the zero-centred text norm at zero.
  const auto& o = options;
  const int64_t d = o.num_attention_heads() * o.attention_head_dim();
  img_in = register_module("img_in", qwen_linear(o.in_channels(), d));
  auto txt_in = register_module("txt_in", std::make_shared<torch::nn::Module>());
  auto text_norm = txt_in->register_module("text_norm", std::make_shared<torch::nn::Module>());
  txt_norm_weight = text_norm->register_parameter("weight", at::zeros({o.context_features()}));
  txt_in_layer = txt_in->register_module("in_layer", qwen_linear(o.context_features(), d));
  txt_out_layer = txt_in->register_module("out_layer", qwen_linear(d, d));
  auto tte = register_module("time_text_embed", std::make_shared<torch::nn::Module>());
  auto te = tte->register_module("timestep_embedder", std::make_shared<torch::nn::Module>());
  time_linear_1 = te->register_module("linear_1", qwen_linear(256, d));
  time_linear_2 = te->register_module("linear_2", qwen_linear(d, d));
  auto mod = register_module("modulation", std::make_shared<torch::nn::Module>());
  modulation = mod->register_module("1", qwen_linear(d, 4 * d));  // modulation.0 is the SiLU
  auto list = register_module("transformer_blocks", torch::nn::ModuleList());
  blocks.clear();
  for (int64_t i = 0; i < o.num_layers(); ++i) {
    blocks.emplace_back(o.num_attention_heads(), o.attention_head_dim(), o.mlp_ratio(), o.eps(), o.attention_impl(),
                        o.force_fp32_for_softmax());
    list->push_back(blocks.back());
  }
  auto no = register_module("norm_out", std::make_shared<torch::nn::Module>());
  norm_out = no->register_module("linear", qwen_linear(d, d));
  proj_out = register_module("proj_out", qwen_linear(d, o.output_channels()));
}

Tensor QwenImageTransformerImpl::forward_joint(const Tensor& tokens, const Tensor& context, const Tensor& time,
                                               const QwenImageLayout& layout, QwenImageCacheMode mode,
                                               QwenImageKVCache* cache) {
  const auto& o = options;
  const std::string w = kQwenArch;
  const auto dt = qwen_compute_dtype(img_in, dtype_);
  const int64_t S = layout.image_pad.size(0), P = layout.prefix_len, N = S - layout.text_index.size(0);
  DEW_CHECK(tokens.dim() == 3 && tokens.size(1) == N && tokens.size(2) == o.in_channels(), w,
            ": hidden_states must be [B, ", N, ", ", o.in_channels(), "] (the image tokens img_shapes lays out), got ",
            tokens.sizes());
  const int64_t B = tokens.size(0);
  DEW_CHECK(context.defined() && context.dim() == 3 && context.size(0) == B && context.size(2) == o.context_features(),
            w, ": the text states (encoder_hidden_states) must be [", B, ", E, ", o.context_features(), "], got ",
            context.defined() ? context.sizes() : at::IntArrayRef{});
  const int64_t E = layout.vlm_len - (S - P) / 4;
  DEW_CHECK(context.size(1) == E, w, ": encoder_hidden_states has ", context.size(1), " rows but img_mask lays out ", E,
            " before the target image's ", (S - P) / 4, " slots");
  DEW_CHECK(time.dim() == 1 && time.size(0) == B, w, ": time must be [", B, "], got ", time.sizes());
  DEW_CHECK(!layout.key_valid.defined() || layout.key_valid.size(0) == B, w, ": encoder_hidden_states_mask must have ",
            B, " rows, got ", layout.key_valid.size(0));
  if (mode != QwenImageCacheMode::kNone) {
    DEW_CHECK(o.causal_condition(), w,
              ": the KV cache needs causal_condition (the text's keys and values are independent of t only when it "
              "is modulated from t = 0)");
    DEW_CHECK(cache, w, ": a KV cache mode without a cache");
  }
  if (mode == QwenImageCacheMode::kCached) {
    DEW_CHECK(cache->filled() && static_cast<int64_t>(cache->k.size()) == o.num_layers() && cache->prefix_len == P &&
                  cache->k[0].size(0) == B,
              w, ": the KV cache was not filled by forward_extract for this conditioning (", cache->k.size(),
              " layers, prefix ", cache->prefix_len, "; expected ", o.num_layers(), " layers, prefix ", P, ", batch ",
              B, ")");
  }
  const auto device = tokens.device();

  // The joint sequence: the text states at the text positions, the image tokens at the image positions.
  const Tensor img = dense(tokens.to(device).to(dt), img_in);  // [B, N, D]
  const int64_t D = img.size(2);
  Tensor h;
  if (mode == QwenImageCacheMode::kCached) {
    h = img.narrow(1, N - (S - P), S - P);  // only the target image's tokens are computed
  } else {
    // txt_in: the zero-centred RMSNorm in float32 (its weight stores scale - 1), Linear, GELU-tanh, Linear.
    const Tensor cf = context.to(device).to(at::kFloat);
    const Tensor normed =
        cf * at::rsqrt(cf.pow(2).mean(-1, /*keepdim=*/true) + o.eps()) * (txt_norm_weight.to(at::kFloat) + 1);
    const Tensor txt = dense(activation(dense(normed.to(dt), txt_in_layer), "gelu_tanh"), txt_out_layer);
    h = at::zeros({B, S, D}, img.options());
    h = h.index_copy(1, layout.text_index.to(device), txt.index_select(1, layout.text_cols.to(device)));
    h = h.index_copy(1, layout.image_index.to(device), img);
  }

  // temb from the sinusoid of 1000 t (QwenImage21TemporalTimesteps: diffusers' get_timestep_embedding with cos
  // first and no shift), with causal_condition an extra row at t = 0 that the text and condition-image tokens
  // modulate from. The sinusoid is computed in float64 and rounded to the compute dtype: diffusers' float32 one is
  // the largest error of its float32 model, and its float32 sin / cos of arguments up to 1000 differ between
  // oneMKL's Intel and AMD kernels, which a few guided sampling steps amplify (QwenImagePipeline's golden).
  const bool causal = o.causal_condition();
  Tensor t = time.to(device).to(at::kFloat);
  if (causal) t = at::cat({t, at::zeros({1}, t.options())});
  const Tensor temb =  // [B (+1), D]
      dense(
          at::silu(dense(timestep_embedding(t, 256, /*cosine_first=*/true, 0.0, /*wide=*/true).to(dt), time_linear_1)),
          time_linear_2);
  const auto mod = dense(at::silu(temb), modulation).chunk(4, 1);  // scale1, gate1, scale2, gate2
  Tensor target;
  if (causal)
    target = mode == QwenImageCacheMode::kCached ? at::ones({S - P}, layout.target.options().device(device))
                                                 : layout.target.to(device);
  std::vector<Tensor> mods;
  for (const auto& m : mod) mods.push_back(qwen_select_rows(m, target));

  // The mask: the block-causal one ((q >= k) or same image block) over the whole sequence, or, for the cached
  // target rows (which see every key), the padding mask alone.
  const QwenRope rope = mode == QwenImageCacheMode::kCached ? qwen_rope_rows(layout.rope, P) : layout.rope;
  Tensor mask;
  const Tensor key_valid = layout.key_valid.defined() ? layout.key_valid.to(device) : Tensor();
  if (mode == QwenImageCacheMode::kCached) {
    if (key_valid.defined()) mask = key_valid.view({B, 1, 1, S});
  } else {
    const Tensor pos = at::arange(S, at::TensorOptions().dtype(at::kLong).device(device));
    const Tensor ids = layout.image_ids.to(device);
    const Tensor same_block = ids.unsqueeze(1).eq(ids.unsqueeze(0)) & ids.ge(0).unsqueeze(1);
    mask = (pos.unsqueeze(1).ge(pos.unsqueeze(0)) | same_block).view({1, 1, S, S});
    if (key_valid.defined()) mask = mask & key_valid.view({B, 1, 1, S});
  }
  const AttentionMask prepared = prepare_attention_mask(mask, h.scalar_type());

  if (mode == QwenImageCacheMode::kExtract) {
    cache->k.assign(blocks.size(), Tensor());
    cache->v.assign(blocks.size(), Tensor());
    cache->prefix_len = P;
  }
  const bool use_remat = o.remat() && is_training() && at::GradMode::is_enabled() && mode == QwenImageCacheMode::kNone;
  for (size_t i = 0; i < blocks.size(); ++i) {
    if (use_remat) {
      // Captured by value: backward runs the function after this frame is gone.
      QwenImageBlock b = blocks[i];
      RematFn fn = [b, rope, prepared](const std::vector<Tensor>& in) mutable {
        const std::vector<Tensor> m = {in[1], in[2], in[3], in[4]};
        return std::vector<Tensor>{
            b->forward(in[0], m, rope, prepared, QwenImageCacheMode::kNone, 0, nullptr, nullptr)};
      };
      h = remat(fn, {h, mods[0], mods[1], mods[2], mods[3]}, b->parameters())[0];
    } else {
      Tensor* kc = cache ? &cache->k[i] : nullptr;
      Tensor* vc = cache ? &cache->v[i] : nullptr;
      h = blocks[i]->forward(h, mods, rope, prepared, mode, P, kc, vc);
    }
  }
  // norm_out: AdaLayerNormContinuous with a scale only.
  const Tensor scale = qwen_select_rows(dense(at::silu(temb), norm_out), target);
  h = layer_norm_fp32(h, o.eps()) * (1 + scale);
  return dense(h, proj_out).to(dt == at::kDouble ? at::kDouble : at::kFloat);
}

Tensor QwenImageTransformerImpl::nchw_forward(const Tensor& x, const Tensor& time, const Conditioning& cond,
                                              QwenImageCacheMode mode, QwenImageKVCache* cache) {
  const auto& o = options;
  const std::string w = kQwenArch;
  cond.check_inputs(w, /*takes_pooled=*/false);
  DEW_CHECK(!cond.labels.defined(), w, ": takes no class labels (num_classes is 0; Qwen-Image conditions on text)");
  DEW_CHECK(x.dim() == 4 && x.size(1) == o.in_channels() && x.size(2) > 0 && x.size(3) > 0 &&
                (x.size(2) * x.size(3)) % 4 == 0,
            w, ": x must be [B, ", o.in_channels(),
            ", H, W] with H W a multiple of 4 (the image's 2 x 2 slots in the joint sequence), got ", x.sizes());
  const int64_t B = x.size(0), H = x.size(2), W = x.size(3);
  DEW_CHECK(cond.context.defined() && cond.context.dim() == 3 && cond.context.size(0) == B, w, ": a text context [", B,
            ", L, ", o.context_features(), "] is required (one sequence over text and image)");
  DEW_CHECK(time.dim() == 0 || (time.dim() == 1 && time.size(0) == B), w, ": time must be [", B, "] or a scalar, got ",
            time.sizes());
  const int64_t L = cond.context.size(1);
  if (cond.context_mask.defined())
    DEW_CHECK(cond.context_mask.dim() == 2 && cond.context_mask.size(0) == B && cond.context_mask.size(1) == L, w,
              ": context_mask must be [", B, ", ", L, "] like the context, got ", cond.context_mask.sizes());
  // The pipeline's layout: L text entries, then the target's H W / 4 slots.
  const Tensor vlm = at::cat({at::zeros({L}, at::kBool), at::ones({H * W / 4}, at::kBool)});
  const QwenImageLayout layout =
      qwen_image_layout({{1, H, W}}, vlm, cond.context_mask, o.axes_dims_rope(), w, x.device());
  // QwenImage21Pipeline._pack_latents: a plain spatial flatten, one token per latent position.
  const Tensor tokens = x.flatten(2).transpose(1, 2);
  const Tensor t = time.dim() == 0 ? time.reshape({1}).expand({B}) : time;
  Tensor out = forward_joint(tokens, cond.context, t, layout, mode, cache);
  if (mode != QwenImageCacheMode::kCached) out = out.narrow(1, L, H * W);
  return out.transpose(1, 2).reshape({B, o.output_channels(), H, W});
}

Tensor QwenImageTransformerImpl::forward(const Tensor& x, const Tensor& time, const Conditioning& cond) {
  return nchw_forward(x, time, cond, QwenImageCacheMode::kNone, nullptr);
}

Tensor QwenImageTransformerImpl::forward_extract(const Tensor& x, const Tensor& time, const Conditioning& cond,
                                                 QwenImageKVCache& cache) {
  return nchw_forward(x, time, cond, QwenImageCacheMode::kExtract, &cache);
}

Tensor QwenImageTransformerImpl::forward_cached(const Tensor& x, const Tensor& time, const Conditioning& cond,
                                                const QwenImageKVCache& cache) {
  // The cached step only reads the cache.
  return nchw_forward(x, time, cond, QwenImageCacheMode::kCached, const_cast<QwenImageKVCache*>(&cache));
}

// ---- the reference methods ----

namespace qwen_image_detail {

// The inputs both methods share, read as diffusers reads them: the layout of the first sample (all samples
// share it), timestep in [0, 1] scaled by 1000 in float32.
struct QwenRefInputs {
  Tensor tokens, context, time;
  QwenImageLayout layout;
};

QwenRefInputs qwen_ref_inputs(QwenImageTransformerImpl& model, const std::map<std::string, Tensor>& in,
                              const std::string& where) {
  auto floating = [&](const std::string& name) {
    const Tensor& t = in.at(name);
    DEW_CHECK(at::isFloatingType(t.scalar_type()), where, ": input \"", name, "\" must be floating point");
    return t;
  };
  QwenRefInputs r;
  r.tokens = floating("hidden_states");
  DEW_CHECK(r.tokens.dim() == 3, where, ": hidden_states must be the packed tokens [B, N, C], got ", r.tokens.sizes());
  const int64_t B = r.tokens.size(0);
  r.context = floating("encoder_hidden_states");
  const Tensor ts = in.at("timestep");
  DEW_CHECK(ts.dim() == 0 || (ts.dim() == 1 && (ts.size(0) == B || ts.size(0) == 1)), where,
            ": timestep must be a scalar or [", B, "], got ", ts.sizes());
  r.time = (ts.to(at::kFloat) * 1000).reshape({-1}).expand({B}).contiguous();
  Tensor shapes = in.at("img_shapes");
  DEW_CHECK(
      !at::isFloatingType(shapes.scalar_type()) && (shapes.dim() == 2 || shapes.dim() == 3) && shapes.size(-1) == 3,
      where, ": img_shapes must be an integer tensor [B, n, 3] or [n, 3] of (frame, height, width), got ",
      shapes.sizes());
  if (shapes.dim() == 3) shapes = shapes.select(0, 0);
  shapes = shapes.to(at::kCPU).to(at::kLong).contiguous();
  std::vector<std::vector<int64_t>> list;
  for (int64_t i = 0; i < shapes.size(0); ++i)
    list.push_back({shapes[i][0].item<int64_t>(), shapes[i][1].item<int64_t>(), shapes[i][2].item<int64_t>()});
  Tensor img_mask = in.at("img_mask");
  DEW_CHECK(img_mask.dim() == 2 || img_mask.dim() == 1, where, ": img_mask must be bool [B, V], got ",
            img_mask.sizes());
  if (img_mask.dim() == 2) img_mask = img_mask.select(0, 0);
  Tensor text_mask;
  if (const auto it = in.find("encoder_hidden_states_mask"); it != in.end()) {
    text_mask = it->second;
    DEW_CHECK(text_mask.dim() == 2 && text_mask.size(0) == B && r.context.dim() == 3 &&
                  text_mask.size(1) <= r.context.size(1),
              where, ": encoder_hidden_states_mask must be [", B, ", E] no longer than encoder_hidden_states (",
              r.context.dim() == 3 ? r.context.size(1) : -1, " rows), got ", text_mask.sizes());
  }
  r.layout = qwen_image_layout(list, img_mask, text_mask, model.options.axes_dims_rope(), where, r.tokens.device());
  return r;
}

}  // namespace qwen_image_detail

std::vector<models::ReferenceMethod> qwen_image_transformer_methods() {
  models::ReferenceMethod f;
  f.name = "forward";
  f.required = {"hidden_states", "encoder_hidden_states", "timestep", "img_shapes", "img_mask"};
  f.optional = {"encoder_hidden_states_mask"};
  f.outputs = {"sample"};
  f.run = [](torch::nn::Module& module, const std::map<std::string, Tensor>& in, const std::string& where) {
    auto* model = dynamic_cast<QwenImageTransformerImpl*>(&module);
    DEW_CHECK(model, where, ": the model is not a qwen_image_transformer");
    const auto r = qwen_ref_inputs(*model, in, where);
    return std::map<std::string, Tensor>{{"sample", model->forward_joint(r.tokens, r.context, r.time, r.layout)}};
  };
  models::ReferenceMethod kv = f;
  kv.name = "forward_kv_cache";
  kv.required.push_back("cached_hidden_states");
  kv.required.push_back("cached_timestep");
  kv.outputs = {"sample", "cached_sample"};
  kv.run = [](torch::nn::Module& module, const std::map<std::string, Tensor>& in, const std::string& where) {
    auto* model = dynamic_cast<QwenImageTransformerImpl*>(&module);
    DEW_CHECK(model, where, ": the model is not a qwen_image_transformer");
    const auto r = qwen_ref_inputs(*model, in, where);
    QwenImageKVCache cache;
    const Tensor first =
        model->forward_joint(r.tokens, r.context, r.time, r.layout, QwenImageCacheMode::kExtract, &cache);
    auto next = in;
    next["hidden_states"] = in.at("cached_hidden_states");
    next["timestep"] = in.at("cached_timestep");
    const auto r2 = qwen_ref_inputs(*model, next, where);
    const Tensor cached =
        model->forward_joint(r2.tokens, r2.context, r2.time, r2.layout, QwenImageCacheMode::kCached, &cache);
    return std::map<std::string, Tensor>{{"sample", first}, {"cached_sample", cached}};
  };
  return {f, kv};
}

}  // namespace dew::nn

#include "dew/nn/backbones/flux_transformer.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <map>
#include <numeric>
#include <set>
#include <tuple>

#include "dew/core/error.h"
#include "dew/nn/blocks.h"
#include "dew/nn/diffusers_blocks.h"

namespace dew::nn {

using at::Tensor;

namespace {

const char* kFluxArch = "flux_transformer";

// Compute dtype of a forward pass: the configured one, or float64 when the model was moved to float64.
at::ScalarType flux_compute_dtype(const torch::nn::Linear& first, at::ScalarType configured) {
  return first->weight.scalar_type() == at::kDouble ? at::kDouble : configured;
}

// torch.nn.RMSNorm over the head width: float64 stays float64 (diffusers' float64 model normalises in
// float64); other dtypes take HeadNorm's float32 path.
Tensor flux_rms_heads(const Tensor& x, HeadNorm& norm) {
  if (x.scalar_type() != at::kDouble) return norm(x);
  return x * at::rsqrt(x.pow(2).mean(-1, /*keepdim=*/true) + norm->options.eps()) * norm->weight.to(at::kDouble);
}

// diffusers' FluxAttnProcessor after the projections: joint scaled-dot-product attention over the rows of
// q, k, v ([B, H, S, Dh], already in joint order), RoPE on q and k first. Returns [B, S, H * Dh].
Tensor flux_attend(const Tensor& q, const Tensor& k, const Tensor& v, const FluxRope& rope, const Tensor& key_mask,
                   const FluxBlockOptions& o) {
  const Tensor qr = flux_apply_rope(q, rope), kr = flux_apply_rope(k, rope);
  return merge_heads(attention(qr, kr, v, key_mask, o.attention_impl(), o.force_fp32_for_softmax()));
}

// float16 activations are clipped to the finite range, as diffusers' blocks do.
Tensor flux_clip_fp16(const Tensor& x) { return x.scalar_type() == at::kHalf ? x.clamp(-65504, 65504) : x; }

}  // namespace

// ---- packing and ids ----

Tensor flux_pack_latents(const Tensor& latents) {
  DEW_CHECK(latents.dim() == 4 && latents.size(2) % 2 == 0 && latents.size(3) % 2 == 0,
            "flux_pack_latents: latents must be [B, C, H, W] with H and W even, got ", latents.sizes());
  const int64_t B = latents.size(0), C = latents.size(1), H = latents.size(2), W = latents.size(3);
  return latents.reshape({B, C, H / 2, 2, W / 2, 2}).permute({0, 2, 4, 1, 3, 5}).reshape({B, (H / 2) * (W / 2), 4 * C});
}

Tensor flux_unpack_latents(const Tensor& tokens, int64_t height, int64_t width) {
  DEW_CHECK(height > 0 && width > 0 && height % 2 == 0 && width % 2 == 0,
            "flux_unpack_latents: height and width must be even and > 0, got ", height, " x ", width);
  DEW_CHECK(tokens.dim() == 3 && tokens.size(1) == (height / 2) * (width / 2) && tokens.size(2) % 4 == 0,
            "flux_unpack_latents: tokens must be [B, ", (height / 2) * (width / 2), ", 4 C] for ", height, " x ", width,
            " latents, got ", tokens.sizes());
  const int64_t B = tokens.size(0), C = tokens.size(2) / 4;
  return tokens.reshape({B, height / 2, width / 2, C, 2, 2}).permute({0, 3, 1, 4, 2, 5}).reshape({B, C, height, width});
}

Tensor flux_image_ids(int64_t h, int64_t w, const at::Device& device) {
  DEW_CHECK(h > 0 && w > 0, "flux_image_ids: the grid must be at least 1 x 1, got ", h, " x ", w);
  const auto f = at::TensorOptions().dtype(at::kFloat).device(device);
  const Tensor rows = at::arange(h, f).view({h, 1}).expand({h, w});
  const Tensor cols = at::arange(w, f).view({1, w}).expand({h, w});
  return at::stack({at::zeros({h, w}, f), rows, cols}, -1).reshape({h * w, 3});
}

Tensor flux_text_ids(int64_t length, const at::Device& device) {
  DEW_CHECK(length >= 0, "flux_text_ids: length must be >= 0, got ", length);
  return at::zeros({length, 3}, at::TensorOptions().dtype(at::kFloat).device(device));
}

FluxRope flux_rope(const Tensor& ids, const std::vector<int64_t>& axes_dims, double theta) {
  DEW_CHECK(ids.dim() == 2 && ids.size(1) == static_cast<int64_t>(axes_dims.size()), "flux_rope: ids must be [S, ",
            axes_dims.size(), "] (one column per RoPE axis), got ", ids.sizes());
  const auto f64 = at::TensorOptions().dtype(at::kDouble).device(ids.device());
  // diffusers: pos = ids.float(); the frequencies and their products in float64; cos / sin back to float32.
  const Tensor pos = ids.to(at::kFloat).to(at::kDouble);
  std::vector<Tensor> cos, sin;
  for (size_t i = 0; i < axes_dims.size(); ++i) {
    const int64_t d = axes_dims[i];
    DEW_CHECK(d > 0 && d % 2 == 0, "flux_rope: axes_dims[", i, "] must be even and > 0, got ", d);
    const Tensor inv = 1.0 / at::pow(theta, at::arange(0, d, 2, f64) / static_cast<double>(d));  // [d / 2]
    const Tensor freqs = at::outer(pos.select(1, static_cast<int64_t>(i)), inv);                 // [S, d / 2]
    cos.push_back(freqs.cos().repeat_interleave(2, 1).to(at::kFloat));
    sin.push_back(freqs.sin().repeat_interleave(2, 1).to(at::kFloat));
  }
  return {at::cat(cos, 1), at::cat(sin, 1)};
}

Tensor flux_apply_rope(const Tensor& x, const FluxRope& rope) {
  DEW_CHECK(x.dim() == 4 && rope.cos.dim() == 2 && x.size(2) == rope.cos.size(0) && x.size(3) == rope.cos.size(1),
            "flux_apply_rope: x [B, H, S, D] ", x.sizes(), " does not match tables ", rope.cos.sizes());
  const Tensor xf = x.to(at::kFloat);
  const auto pairs = xf.unflatten(-1, {-1, 2}).unbind(-1);                  // real, imaginary: [B, H, S, D / 2]
  const Tensor rotated = at::stack({-pairs[1], pairs[0]}, -1).flatten(-2);  // (x0, x1) -> (-x1, x0)
  return (xf * rope.cos.to(x.device()) + rotated * rope.sin.to(x.device())).to(x.scalar_type());
}

// ---- modules ----

FluxAdaNormImpl::FluxAdaNormImpl(int64_t dim, int64_t chunks_) : chunks(chunks_) {
  linear = register_module("linear", torch::nn::Linear(dim, chunks * dim));
}

std::vector<Tensor> FluxAdaNormImpl::forward(const Tensor& temb) {
  return dense(at::silu(temb), linear).chunk(chunks, 1);
}

FluxFeedForwardImpl::FluxFeedForwardImpl(int64_t dim) {
  // ff.net = [GELU(proj), Dropout, Linear]: the names of diffusers' FeedForward.
  proj = torch::nn::Linear(dim, 4 * dim);
  out = torch::nn::Linear(4 * dim, dim);
  auto gelu = std::make_shared<torch::nn::Module>();
  gelu->register_module("proj", proj);
  auto net = std::make_shared<torch::nn::Module>();
  net->register_module("0", gelu);
  net->register_module("2", out);
  register_module("net", net);
}

Tensor FluxFeedForwardImpl::forward(const Tensor& x) { return dense(activation(dense(x, proj), "gelu_tanh"), out); }

FluxAttentionImpl::FluxAttentionImpl(int64_t dim, int64_t heads, int64_t head_dim_, bool joint_, bool text_out_)
    : heads_count(heads), head_dim(head_dim_), joint(joint_), text_out(text_out_) {
  const int64_t inner = heads * head_dim;
  auto norm = [&](const char* name) {
    return register_module(name, HeadNorm(HeadNormOptions(head_dim).kind("rms").eps(1e-6)));
  };
  norm_q = norm("norm_q");
  norm_k = norm("norm_k");
  to_q = register_module("to_q", torch::nn::Linear(dim, inner));
  to_k = register_module("to_k", torch::nn::Linear(dim, inner));
  to_v = register_module("to_v", torch::nn::Linear(dim, inner));
  if (joint) {
    out = torch::nn::Linear(inner, dim);
    to_out = register_module("to_out", torch::nn::ModuleList(out));
    if (text_out) norm_added_q = norm("norm_added_q");
    norm_added_k = norm("norm_added_k");
    if (text_out) add_q_proj = register_module("add_q_proj", torch::nn::Linear(dim, inner));
    add_k_proj = register_module("add_k_proj", torch::nn::Linear(dim, inner));
    add_v_proj = register_module("add_v_proj", torch::nn::Linear(dim, inner));
    if (text_out) to_add_out = register_module("to_add_out", torch::nn::Linear(inner, dim));
  }
}

std::vector<Tensor> FluxAttentionImpl::heads(const Tensor& x) {
  // RMSNorm over each head's width before the heads move to dimension 1.
  auto split = [&](const torch::nn::Linear& l) {
    return dense(x, l).view({x.size(0), x.size(1), heads_count, head_dim});
  };
  return {flux_rms_heads(split(to_q), norm_q).transpose(1, 2), flux_rms_heads(split(to_k), norm_k).transpose(1, 2),
          split(to_v).transpose(1, 2)};
}

std::vector<Tensor> FluxAttentionImpl::added_heads(const Tensor& txt) {
  DEW_CHECK(joint && text_out, "FluxAttention: this attention has no text query projections");
  auto split = [&](const torch::nn::Linear& l) {
    return dense(txt, l).view({txt.size(0), txt.size(1), heads_count, head_dim});
  };
  return {flux_rms_heads(split(add_q_proj), norm_added_q).transpose(1, 2),
          flux_rms_heads(split(add_k_proj), norm_added_k).transpose(1, 2), split(add_v_proj).transpose(1, 2)};
}

FluxTransformerBlockImpl::FluxTransformerBlockImpl(FluxBlockOptions options_) : options(std::move(options_)) {
  const int64_t d = options.heads() * options.head_dim();
  norm1 = register_module("norm1", FluxAdaNorm(d, 6));
  norm1_context = register_module("norm1_context", FluxAdaNorm(d, 6));
  attn = register_module("attn", FluxAttention(d, options.heads(), options.head_dim(), /*joint=*/true));
  ff = register_module("ff", FluxFeedForward(d));
  ff_context = register_module("ff_context", FluxFeedForward(d));
}

std::pair<Tensor, Tensor> FluxTransformerBlockImpl::forward(const Tensor& x, const Tensor& txt, const Tensor& temb,
                                                            const FluxRope& rope, const Tensor& key_mask) {
  const int64_t L = txt.size(1), N = x.size(1);
  // modulation: shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp (diffusers' AdaLayerNormZero)
  const auto m = norm1(temb), c = norm1_context(temb);
  const auto hi = attn->heads(modulate(layer_norm_fp32(x, 1e-6), m[0], m[1]));
  const auto ht = attn->added_heads(modulate(layer_norm_fp32(txt, 1e-6), c[0], c[1]));
  // One attention over [text; image].
  const Tensor o = flux_attend(at::cat({ht[0], hi[0]}, 2), at::cat({ht[1], hi[1]}, 2), at::cat({ht[2], hi[2]}, 2), rope,
                               key_mask, options);
  const auto parts = o.split_with_sizes({L, N}, 1);
  Tensor h = x + m[2].unsqueeze(1) * dense(parts[1], attn->out);
  h = h + m[5].unsqueeze(1) * ff(modulate(layer_norm_fp32(h, 1e-6), m[3], m[4]));
  Tensor t = txt + c[2].unsqueeze(1) * dense(parts[0], attn->to_add_out);
  t = t + c[5].unsqueeze(1) * ff_context(modulate(layer_norm_fp32(t, 1e-6), c[3], c[4]));
  return {h, flux_clip_fp16(t)};
}

FluxSingleTransformerBlockImpl::FluxSingleTransformerBlockImpl(FluxBlockOptions options_)
    : options(std::move(options_)) {
  const int64_t d = options.heads() * options.head_dim();
  norm = register_module("norm", FluxAdaNorm(d, 3));
  proj_mlp = register_module("proj_mlp", torch::nn::Linear(d, 4 * d));
  proj_out = register_module("proj_out", torch::nn::Linear(d + 4 * d, d));
  attn = register_module("attn", FluxAttention(d, options.heads(), options.head_dim(), /*joint=*/false));
}

Tensor FluxSingleTransformerBlockImpl::forward(const Tensor& h, const Tensor& temb, const FluxRope& rope,
                                               const Tensor& key_mask) {
  const auto m = norm(temb);  // shift, scale, gate (AdaLayerNormZeroSingle)
  const Tensor n = modulate(layer_norm_fp32(h, 1e-6), m[0], m[1]);
  const Tensor mlp = activation(dense(n, proj_mlp), "gelu_tanh");
  const auto q = attn->heads(n);
  const Tensor a = flux_attend(q[0], q[1], q[2], rope, key_mask, options);
  return flux_clip_fp16(h + m[2].unsqueeze(1) * dense(at::cat({a, mlp}, 2), proj_out));
}

FluxTimeTextEmbedImpl::FluxTimeTextEmbedImpl(int64_t dim, int64_t pooled_dim, bool guidance) {
  timestep_embedder = register_module("timestep_embedder", TimestepMLP(256, dim));
  if (guidance) guidance_embedder = register_module("guidance_embedder", TimestepMLP(256, dim));
  text_embedder = register_module("text_embedder", TimestepMLP(pooled_dim, dim));
}

Tensor FluxTimeTextEmbedImpl::forward(const Tensor& time, const Tensor& guidance, const Tensor& pooled) {
  const auto dt = pooled.scalar_type();
  Tensor temb = timestep_embedder(timestep_embedding(time, 256, /*cosine_first=*/true, 0.0, dt == at::kDouble).to(dt));
  if (!guidance_embedder.is_empty())
    temb = temb +
           guidance_embedder(timestep_embedding(guidance, 256, /*cosine_first=*/true, 0.0, dt == at::kDouble).to(dt));
  return temb + text_embedder(pooled);
}

// ---- the model ----

FluxTransformerImpl::FluxTransformerImpl(FluxTransformerOptions options_) : options(std::move(options_)) {
  const auto& o = options;
  const std::string w = kFluxArch;
  DEW_CHECK(o.in_channels() > 0, w, ": in_channels must be > 0, got ", o.in_channels());
  DEW_CHECK(o.output_channels() > 0, w, ": output_channels must be > 0, got ", o.output_channels());
  DEW_CHECK(o.num_classes() == 0, w, ": num_classes must be 0, got ", o.num_classes(),
            " (Flux conditions on text and pooled text, not on class labels: train it with a text encoder, e.g. "
            "--text_encoder.architecture byte_text_encoder)");
  DEW_CHECK(o.context_features() > 0, w, ": context_features must be > 0 (joint_attention_dim), got ",
            o.context_features());
  DEW_CHECK(o.pooled_projection_dim() > 0, w, ": pooled_projection_dim must be > 0, got ", o.pooled_projection_dim());
  DEW_CHECK(o.num_layers() >= 0 && o.num_single_layers() >= 0, w,
            ": num_layers and num_single_layers must be >= 0, got ", o.num_layers(), " and ", o.num_single_layers());
  DEW_CHECK(o.num_attention_heads() > 0, w, ": num_attention_heads must be > 0, got ", o.num_attention_heads());
  DEW_CHECK(o.attention_head_dim() > 0 && o.attention_head_dim() % 2 == 0, w,
            ": attention_head_dim must be even and > 0, got ", o.attention_head_dim());
  const auto& axes = o.axes_dims_rope();
  DEW_CHECK(!axes.empty() && std::all_of(axes.begin(), axes.end(), [](int64_t a) { return a > 0 && a % 2 == 0; }) &&
                std::accumulate(axes.begin(), axes.end(), int64_t(0)) == o.attention_head_dim(),
            w, ": axes_dims_rope must be even widths > 0 summing to attention_head_dim ", o.attention_head_dim(),
            ", got ", json(axes).dump());
  dtype_ = parse_compute_dtype(o.dtype(), w + ".dtype");
  check_attention_impl(o.attention_impl(), w + ".attention_impl");
  reset();
}

void FluxTransformerImpl::reset() {
  // Parameters keep LibTorch's default initialisation of each layer, as diffusers' model (no zero heads).
  const auto& o = options;
  const int64_t d = o.num_attention_heads() * o.attention_head_dim();
  time_text_embed =
      register_module("time_text_embed", FluxTimeTextEmbed(d, o.pooled_projection_dim(), o.guidance_embeds()));
  context_embedder = register_module("context_embedder", torch::nn::Linear(o.context_features(), d));
  x_embedder = register_module("x_embedder", torch::nn::Linear(4 * o.in_channels(), d));
  const auto bo = FluxBlockOptions(o.num_attention_heads(), o.attention_head_dim())
                      .attention_impl(o.attention_impl())
                      .force_fp32_for_softmax(o.force_fp32_for_softmax());
  auto list = register_module("transformer_blocks", torch::nn::ModuleList());
  blocks.clear();
  for (int64_t i = 0; i < o.num_layers(); ++i) {
    blocks.emplace_back(bo);
    list->push_back(blocks.back());
  }
  auto single = register_module("single_transformer_blocks", torch::nn::ModuleList());
  single_blocks.clear();
  for (int64_t i = 0; i < o.num_single_layers(); ++i) {
    single_blocks.emplace_back(bo);
    single->push_back(single_blocks.back());
  }
  norm_out = register_module("norm_out", FluxAdaNorm(d, 2));
  proj_out = register_module("proj_out", torch::nn::Linear(d, 4 * o.output_channels()));
}

Tensor FluxTransformerImpl::forward_packed(const Tensor& tokens, const Tensor& context, const Tensor& pooled,
                                           const Tensor& time, const Tensor& guidance, const Tensor& img_ids,
                                           const Tensor& txt_ids, const Tensor& context_mask) {
  const auto& o = options;
  const std::string w = kFluxArch;
  const auto dt = flux_compute_dtype(x_embedder, dtype_);
  const int64_t n_axes = static_cast<int64_t>(o.axes_dims_rope().size());
  DEW_CHECK(tokens.dim() == 3 && tokens.size(2) == 4 * o.in_channels(), w, ": packed tokens must be [B, S, ",
            4 * o.in_channels(), "] (4 x in_channels), got ", tokens.sizes());
  const int64_t B = tokens.size(0), S = tokens.size(1);
  DEW_CHECK(context.defined() && context.dim() == 3 && context.size(0) == B && context.size(2) == o.context_features(),
            w, ": the text context (encoder_hidden_states) must be [", B, ", L, ", o.context_features(), "], got ",
            context.defined() ? context.sizes() : at::IntArrayRef{});
  const int64_t L = context.size(1);
  DEW_CHECK(pooled.defined() && pooled.dim() == 2 && pooled.size(0) == B && pooled.size(1) == o.pooled_projection_dim(),
            w, ": the pooled text (pooled_projections) must be [", B, ", ", o.pooled_projection_dim(), "], got ",
            pooled.defined() ? pooled.sizes() : at::IntArrayRef{});
  DEW_CHECK(time.dim() == 1 && time.size(0) == B, w, ": time must be [", B, "], got ", time.sizes());
  DEW_CHECK(img_ids.dim() == 2 && img_ids.size(0) == S && img_ids.size(1) == n_axes && txt_ids.dim() == 2 &&
                txt_ids.size(0) == L && txt_ids.size(1) == n_axes,
            w, ": img_ids must be [", S, ", ", n_axes, "] and txt_ids [", L, ", ", n_axes, "], got ", img_ids.sizes(),
            " and ", txt_ids.sizes());
  if (o.guidance_embeds()) {
    DEW_CHECK(guidance.defined(), w,
              ": guidance_embeds (FLUX.1 dev) needs the input \"guidance\" [B], the guidance scale as FluxPipeline's "
              "guidance_scale (e.g. 3.5)");
    DEW_CHECK(guidance.dim() == 1 && guidance.size(0) == B, w, ": guidance must be [", B, "], got ", guidance.sizes());
  } else {
    DEW_CHECK(!guidance.defined(), w,
              ": \"guidance\" given, but the model has no guidance embedding (guidance_embeds "
              "false, FLUX.1 schnell)");
  }
  Tensor key_mask;
  if (context_mask.defined()) {
    DEW_CHECK(context_mask.dim() == 2 && context_mask.size(0) == B && context_mask.size(1) == L, w,
              ": context_mask must be [", B, ", ", L, "], got ", context_mask.sizes());
    key_mask = at::cat(
        {context_mask.to(tokens.device()).to(at::kBool), at::ones({B, S}, tokens.options().dtype(at::kBool))}, 1);
  }

  const auto device = tokens.device();
  // The sinusoids read time and guidance in float32 (float64 stays float64 until they cast it).
  const auto wide = dt == at::kDouble ? at::kDouble : at::kFloat;
  const Tensor g = guidance.defined() ? guidance.to(device).to(wide) * 1000 : Tensor();
  const Tensor temb = time_text_embed(time.to(device), g, pooled.to(device).to(dt));  // [B, D]
  Tensor h = dense(tokens.to(dt), x_embedder);                                        // [B, S, D]
  Tensor txt = dense(context.to(device).to(dt), context_embedder);                    // [B, L, D]
  const FluxRope rope = flux_rope(at::cat({txt_ids.to(device), img_ids.to(device)}, 0), o.axes_dims_rope());

  const bool use_remat = o.remat() && is_training() && at::GradMode::is_enabled();
  run_double_stream_blocks(blocks, h, txt, temb, rope, key_mask, use_remat);
  // The single-stream blocks run on [text; image]; diffusers splits and re-joins between blocks, which
  // changes nothing.
  Tensor joint = at::cat({txt, h}, 1);
  for (auto& block : single_blocks) {
    if (use_remat) {
      FluxSingleTransformerBlock b = block;
      RematFn fn = [b, rope, key_mask](const std::vector<Tensor>& in) mutable {
        return std::vector<Tensor>{b(in[0], in[1], rope, key_mask)};
      };
      joint = remat(fn, {joint, temb}, b->parameters())[0];
    } else {
      joint = block(joint, temb, rope, key_mask);
    }
  }
  h = joint.narrow(1, L, S);
  // AdaLayerNormContinuous: scale first, then shift.
  const auto m = norm_out(temb);
  h = modulate(layer_norm_fp32(h, 1e-6), m[1], m[0]);
  return dense(h, proj_out).to(dt == at::kDouble ? at::kDouble : at::kFloat);
}

Tensor FluxTransformerImpl::forward(const Tensor& x, const Tensor& time, const Conditioning& cond) {
  const auto& o = options;
  const std::string w = kFluxArch;
  cond.check_inputs(w, /*takes_pooled=*/true,
                    o.guidance_embeds() ? std::vector<std::string>{"guidance"} : std::vector<std::string>{});
  DEW_CHECK(!cond.labels.defined(), w, ": takes no class labels (num_classes is 0; Flux conditions on text)");
  DEW_CHECK(x.dim() == 4 && x.size(1) == o.in_channels() && x.size(2) % 2 == 0 && x.size(3) % 2 == 0 && x.size(2) > 0 &&
                x.size(3) > 0,
            w, ": x must be [B, ", o.in_channels(), ", H, W] with H and W even (packed into 2 x 2 patches), got ",
            x.sizes());
  const int64_t B = x.size(0), H = x.size(2), W = x.size(3);
  DEW_CHECK(cond.context.defined(), w, ": a text context [B, L, ", o.context_features(),
            "] is required (joint attention over text and image tokens)");
  DEW_CHECK(cond.pooled.defined(), w, ": the pooled text [B, ", o.pooled_projection_dim(),
            "] is required (Conditioning::pooled, the CLIP text encoder's pooled output)");
  DEW_CHECK(time.dim() == 0 || (time.dim() == 1 && time.size(0) == B), w, ": time must be [", B, "] or a scalar, got ",
            time.sizes());
  const Tensor t = time.dim() == 0 ? time.reshape({1}).expand({B}) : time;
  Tensor guidance;
  if (auto it = cond.extra.find("guidance"); it != cond.extra.end()) {
    const Tensor& gd = it->second;
    DEW_CHECK(gd.dim() == 0 || (gd.dim() == 1 && (gd.size(0) == B || gd.size(0) == 1)), w, ": guidance must be [", B,
              "] or a scalar, got ", gd.sizes());
    guidance = gd.reshape({-1}).expand({B});
  }
  const int64_t L = cond.context.dim() == 3 ? cond.context.size(1) : 0;
  const Tensor out =
      forward_packed(flux_pack_latents(x), cond.context, cond.pooled, t, guidance,
                     flux_image_ids(H / 2, W / 2, x.device()), flux_text_ids(L, x.device()), cond.context_mask);
  return flux_unpack_latents(out, H, W);
}

// ---- the reference method ----

models::ReferenceMethod flux_transformer_forward_method() {
  models::ReferenceMethod m;
  m.name = "forward";
  m.required = {"hidden_states", "encoder_hidden_states", "pooled_projections", "timestep", "img_ids", "txt_ids"};
  m.optional = {"guidance"};
  m.outputs = {"sample"};
  m.run = [](torch::nn::Module& module, const std::map<std::string, Tensor>& in, const std::string& where) {
    auto* model = dynamic_cast<FluxTransformerImpl*>(&module);
    DEW_CHECK(model, where, ": the model is not a flux_transformer");
    auto floating = [&](const std::string& name) {
      const auto it = in.find(name);
      if (it == in.end()) return Tensor();
      DEW_CHECK(at::isFloatingType(it->second.scalar_type()), where, ": input \"", name, "\" must be floating point");
      return it->second;
    };
    const Tensor hs = floating("hidden_states");
    DEW_CHECK(hs.dim() == 3, where, ": hidden_states must be the packed tokens [B, S, C], got ", hs.sizes());
    const int64_t B = hs.size(0);
    // diffusers: timestep.to(hidden_states.dtype) * 1000, a scalar broadcast over the batch.
    const Tensor ts = in.at("timestep");
    DEW_CHECK(ts.dim() == 0 || (ts.dim() == 1 && (ts.size(0) == B || ts.size(0) == 1)), where,
              ": timestep must be a scalar or [", B, "], got ", ts.sizes());
    const Tensor t = (ts.to(hs.scalar_type()) * 1000).reshape({-1}).expand({B}).contiguous();
    Tensor g = floating("guidance");
    if (g.defined()) {
      DEW_CHECK(g.dim() == 0 || (g.dim() == 1 && (g.size(0) == B || g.size(0) == 1)), where,
                ": guidance must be a scalar or [", B, "], got ", g.sizes());
      g = g.reshape({-1}).expand({B});
    }
    // A batch dimension on the ids is deprecated in diffusers, which reads the first row.
    auto ids = [&](const std::string& name) {
      const Tensor i = floating(name);
      return i.dim() == 3 ? i.select(0, 0) : i;
    };
    const Tensor out = model->forward_packed(hs, floating("encoder_hidden_states"), floating("pooled_projections"), t,
                                             g, ids("img_ids"), ids("txt_ids"));
    return std::map<std::string, Tensor>{{"sample", out}};
  };
  return m;
}

}  // namespace dew::nn

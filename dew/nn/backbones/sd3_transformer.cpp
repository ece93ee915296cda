#include "dew/nn/backbones/sd3_transformer.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <set>

#include "dew/core/error.h"
#include "dew/nn/blocks.h"
#include "dew/nn/diffusers_blocks.h"

namespace dew::nn {

using at::Tensor;

namespace {

const char* kSd3Arch = "sd3_transformer";
constexpr double kSd3Eps = 1e-6;  // every LayerNorm / RMSNorm of the model

// A Linear registered as `name` inside a plain container module registered as `owner` on `parent`
// ("norm1.linear", "to_out.0"): diffusers' wrappers hold no weights of their own.
torch::nn::Linear sd3_linear_in(torch::nn::Module& parent, const std::string& owner, const std::string& name,
                                int64_t in, int64_t out) {
  auto holder = std::make_shared<torch::nn::Module>();
  auto l = holder->register_module(name, torch::nn::Linear(in, out));
  parent.register_module(owner, holder);
  return l;
}

// diffusers' FeedForward(dim, activation_fn="gelu-approximate"): ff.net.0.proj [4 dim, dim], ff.net.2
// [dim, 4 dim] (net.1 is a parameterless dropout). Returns {net.0.proj, net.2}.
std::pair<torch::nn::Linear, torch::nn::Linear> sd3_feed_forward(torch::nn::Module& parent, const std::string& name,
                                                                 int64_t dim) {
  auto gelu = std::make_shared<torch::nn::Module>();
  auto in = gelu->register_module("proj", torch::nn::Linear(dim, 4 * dim));
  auto net = std::make_shared<torch::nn::Module>();
  net->register_module("0", gelu);
  auto out = net->register_module("2", torch::nn::Linear(4 * dim, dim));
  auto ff = std::make_shared<torch::nn::Module>();
  ff->register_module("net", net);
  parent.register_module(name, ff);
  return {in, out};
}

Tensor sd3_feed_forward(const Tensor& x, const torch::nn::Linear& in, const torch::nn::Linear& out) {
  return dense(at::gelu(dense(x, in), "tanh"), out);
}

// The qk norm with diffusers' numerics: for a float64 model its RMSNorm takes the mean square in float32 and
// scales in float64, its LayerNorm runs in float64; otherwise HeadNorm's (fp32 inside, x's dtype out).
Tensor sd3_head_norm(HeadNorm n, const Tensor& x) {
  if (x.scalar_type() != at::kDouble) return n->forward(x);
  const double eps = n->options.eps();
  if (n->options.kind() == "rms") {
    const Tensor ms = x.to(at::kFloat).pow(2).mean(-1, /*keepdim=*/true);
    return x * at::rsqrt(ms + eps).to(at::kDouble) * n->weight.to(at::kDouble);
  }
  return at::layer_norm(x, {x.size(-1)}, n->weight.to(at::kDouble), n->bias.to(at::kDouble), eps);
}

}  // namespace

// ---- position table and patch embedding ----

Tensor sd3_position_table(int64_t dim, int64_t h, int64_t w, int64_t base_size) {
  DEW_CHECK(dim > 0 && dim % 4 == 0, kSd3Arch, ": the position table needs a width divisible by 4, got ", dim);
  DEW_CHECK(h > 0 && w > 0 && base_size > 0, kSd3Arch, ": position table grid ", h, " x ", w, " at base size ",
            base_size, " must be positive");
  // Coordinates i / (n / base_size) in float32, as diffusers computes its grid; the sin-cos in float64.
  auto coords = [&](int64_t n) {
    return at::arange(n, at::kFloat) / static_cast<float>(static_cast<double>(n) / static_cast<double>(base_size));
  };
  const Tensor rows = coords(h).repeat_interleave(w);  // [h*w] row coordinate of each raster index
  const Tensor cols = coords(w).repeat({h});           // [h*w] column coordinate
  return at::cat({sincos_1d_table(dim / 2, cols), sincos_1d_table(dim / 2, rows)}, 1);
}

SD3PatchEmbedImpl::SD3PatchEmbedImpl(int64_t in_channels, int64_t dim_, int64_t patch_size_, int64_t base_size_,
                                     int64_t max_size_)
    : dim(dim_), patch_size(patch_size_), base_size(base_size_), max_size(max_size_) {
  proj = register_module("proj",
                         torch::nn::Conv2d(torch::nn::Conv2dOptions(in_channels, dim, patch_size).stride(patch_size)));
  reset();
}

void SD3PatchEmbedImpl::reset() {
  // The stored table (SD3's checkpoints carry it; loading replaces this one, which equals it).
  if (max_size > 0)
    pos_embed = register_buffer("pos_embed", sd3_position_table(dim, max_size, max_size, base_size).unsqueeze(0));
}

Tensor SD3PatchEmbedImpl::forward(const Tensor& x) {
  const int64_t h = x.size(2) / patch_size, w = x.size(3) / patch_size;
  Tensor tokens = conv(x, proj).flatten(2).transpose(1, 2);  // [B, h*w, dim]
  Tensor table;
  if (max_size > 0) {
    DEW_CHECK(h <= max_size && w <= max_size, kSd3Arch, ": a ", h, " x ", w,
              " patch grid exceeds pos_embed_max_size = ", max_size);
    // Centre crop of the M x M table, as diffusers' cropped_pos_embed.
    const int64_t top = (max_size - h) / 2, left = (max_size - w) / 2;
    table = pos_embed.view({max_size, max_size, dim}).narrow(0, top, h).narrow(1, left, w).reshape({1, h * w, dim});
  } else {
    table = sd3_position_table(dim, h, w, base_size).to(x.device()).unsqueeze(0);
  }
  return tokens + table.to(tokens.scalar_type());
}

// ---- attention ----

SD3AttentionImpl::SD3AttentionImpl(int64_t dim_, int64_t heads_, int64_t head_dim_, std::string qk_norm_, bool joint_,
                                   bool pre_only_, std::string impl_, bool force_fp32_for_softmax_)
    : dim(dim_),
      heads(heads_),
      head_dim(head_dim_),
      qk_norm(std::move(qk_norm_)),
      impl(std::move(impl_)),
      joint(joint_),
      pre_only(pre_only_),
      force_fp32_for_softmax(force_fp32_for_softmax_) {
  reset();
}

void SD3AttentionImpl::reset() {
  const int64_t inner = heads * head_dim;
  to_q = register_module("to_q", torch::nn::Linear(dim, inner));
  to_k = register_module("to_k", torch::nn::Linear(dim, inner));
  to_v = register_module("to_v", torch::nn::Linear(dim, inner));
  auto norm = [&](const char* name) {
    return register_module(
        name, HeadNorm(HeadNormOptions(head_dim).kind(qk_norm == "rms_norm" ? "rms" : "layer").eps(kSd3Eps)));
  };
  if (qk_norm != "none") {
    norm_q = norm("norm_q");
    norm_k = norm("norm_k");
  }
  if (joint) {
    if (!pre_only) add_q_proj = register_module("add_q_proj", torch::nn::Linear(dim, inner));
    add_k_proj = register_module("add_k_proj", torch::nn::Linear(dim, inner));
    add_v_proj = register_module("add_v_proj", torch::nn::Linear(dim, inner));
  }
  to_out_0 = torch::nn::Linear(inner, dim);
  register_module("to_out", torch::nn::ModuleList(to_out_0));  // to_out.0 (to_out.1 is a parameterless dropout)
  if (joint && !pre_only) to_add_out = register_module("to_add_out", torch::nn::Linear(inner, dim));
  if (joint && qk_norm != "none") {
    if (!pre_only) norm_added_q = norm("norm_added_q");
    norm_added_k = norm("norm_added_k");
  }
}

std::pair<Tensor, Tensor> SD3AttentionImpl::forward(const Tensor& x, const Tensor& text, const Tensor& mask) {
  const int64_t B = x.size(0), N = x.size(1);
  auto split = [&](const Tensor& t) { return t.view({B, t.size(1), heads, head_dim}).transpose(1, 2); };
  Tensor q = split(dense(x, to_q)), k = split(dense(x, to_k)), v = split(dense(x, to_v));  // [B, H, N, Dh]
  if (!norm_q.is_empty()) {
    q = sd3_head_norm(norm_q, q);
    k = sd3_head_norm(norm_k, k);
  }
  if (joint) {
    // The joint sequence is [image; text], as JointAttnProcessor2_0 concatenates it.
    Tensor tk = split(dense(text, add_k_proj)), tv = split(dense(text, add_v_proj));
    if (!norm_added_k.is_empty()) tk = sd3_head_norm(norm_added_k, tk);
    k = at::cat({k, tk}, 2);
    v = at::cat({v, tv}, 2);
    if (!pre_only) {
      Tensor tq = split(dense(text, add_q_proj));
      if (!norm_added_q.is_empty()) tq = sd3_head_norm(norm_added_q, tq);
      q = at::cat({q, tq}, 2);
    }
  }
  const Tensor o = merge_heads(attention(q, k, v, mask, impl, force_fp32_for_softmax));  // [B, Sq, inner]
  Tensor image = dense(o.narrow(1, 0, N), to_out_0), words;
  if (joint && !pre_only) words = dense(o.narrow(1, N, o.size(1) - N), to_add_out);
  return {image, words};
}

// ---- joint block ----

SD3JointBlockImpl::SD3JointBlockImpl(int64_t dim_, int64_t heads, int64_t head_dim, bool pre_only_, bool dual_,
                                     std::string qk_norm, std::string impl, bool force_fp32_for_softmax)
    : dim(dim_), pre_only(pre_only_), dual(dual_) {
  norm1 = sd3_linear_in(*this, "norm1", "linear", dim, (dual ? 9 : 6) * dim);
  norm1_context = sd3_linear_in(*this, "norm1_context", "linear", dim, (pre_only ? 2 : 6) * dim);
  attn = register_module(
      "attn", SD3Attention(dim, heads, head_dim, qk_norm, /*joint=*/true, pre_only, impl, force_fp32_for_softmax));
  if (dual)
    attn2 = register_module(
        "attn2", SD3Attention(dim, heads, head_dim, qk_norm, /*joint=*/false, false, impl, force_fp32_for_softmax));
  std::tie(ff_in, ff_out) = sd3_feed_forward(*this, "ff", dim);
  if (!pre_only) std::tie(ff_context_in, ff_context_out) = sd3_feed_forward(*this, "ff_context", dim);
}

std::pair<Tensor, Tensor> SD3JointBlockImpl::forward(const Tensor& x, const Tensor& text, const Tensor& temb,
                                                     const Tensor& mask) {
  // AdaLayerNormZero (SD35AdaLayerNormZeroX when dual): shift, scale, gate of attention, shift, scale, gate of
  // the MLP (then shift, scale, gate of attn2), all from linear(silu(temb)).
  const Tensor e = at::silu(temb);
  const auto m = dense(e, norm1).chunk(dual ? 9 : 6, 1);
  const Tensor nx = layer_norm_fp32(x, kSd3Eps);
  const Tensor nt = layer_norm_fp32(text, kSd3Eps);
  std::vector<Tensor> c = dense(e, norm1_context).chunk(pre_only ? 2 : 6, 1);
  // AdaLayerNormContinuous (the pre-only block) chunks as (scale, shift), AdaLayerNormZero as (shift, scale, ..).
  const Tensor ht = pre_only ? modulate(nt, c[1], c[0]) : modulate(nt, c[0], c[1]);
  const auto [a, ta] = attn(modulate(nx, m[0], m[1]), ht, mask);
  Tensor h = x + m[2].unsqueeze(1) * a;
  if (dual) h = h + m[8].unsqueeze(1) * attn2(modulate(nx, m[6], m[7])).first;
  h = h + m[5].unsqueeze(1) * sd3_feed_forward(modulate(layer_norm_fp32(h, kSd3Eps), m[3], m[4]), ff_in, ff_out);
  if (pre_only) return {h, Tensor()};
  Tensor t = text + c[2].unsqueeze(1) * ta;
  t = t + c[5].unsqueeze(1) *
              sd3_feed_forward(modulate(layer_norm_fp32(t, kSd3Eps), c[3], c[4]), ff_context_in, ff_context_out);
  return {h, t};
}

// ---- the model ----

SD3TransformerImpl::SD3TransformerImpl(SD3TransformerOptions options_) : options(std::move(options_)) {
  const auto& o = options;
  DEW_CHECK(o.patch_size() > 0, kSd3Arch, ": patch_size must be > 0, got ", o.patch_size());
  DEW_CHECK(o.in_channels() > 0 && o.output_channels() > 0, kSd3Arch,
            ": in_channels and output_channels must be > 0, got ", o.in_channels(), " and ", o.output_channels());
  DEW_CHECK(o.num_layers() > 0, kSd3Arch, ": num_layers must be > 0, got ", o.num_layers());
  DEW_CHECK(o.num_attention_heads() > 0 && o.attention_head_dim() > 0, kSd3Arch,
            ": num_attention_heads and attention_head_dim must be > 0, got ", o.num_attention_heads(), " and ",
            o.attention_head_dim());
  const int64_t D = o.num_attention_heads() * o.attention_head_dim();
  DEW_CHECK(D % 4 == 0, kSd3Arch, ": the model width num_attention_heads x attention_head_dim (", D,
            ") must be a multiple of 4 (the 2D sin-cos position table)");
  DEW_CHECK(o.context_features() > 0, kSd3Arch, ": context_features (joint_attention_dim) must be > 0, got ",
            o.context_features(), "; the model needs text");
  DEW_CHECK(o.pooled_projection_dim() > 0, kSd3Arch, ": pooled_projection_dim must be > 0, got ",
            o.pooled_projection_dim());
  DEW_CHECK(o.sample_size() >= o.patch_size(), kSd3Arch, ": sample_size must be >= patch_size (", o.patch_size(),
            "), got ", o.sample_size());
  DEW_CHECK(o.pos_embed_max_size() >= 0, kSd3Arch, ": pos_embed_max_size must be >= 0 (0 = none), got ",
            o.pos_embed_max_size());
  for (const int64_t i : o.dual_attention_layers())
    DEW_CHECK(i >= 0 && i < o.num_layers(), kSd3Arch, ": dual_attention_layers holds ", i,
              "; accepted: block indices 0 .. ", o.num_layers() - 1);
  DEW_CHECK(o.num_classes() >= 0, kSd3Arch, ": num_classes must be >= 0, got ", o.num_classes());
  dtype_ = parse_compute_dtype(o.dtype(), std::string(kSd3Arch) + ".dtype");
  check_attention_impl(o.attention_impl(), std::string(kSd3Arch) + ".attention_impl");
  reset();
}

void SD3TransformerImpl::reset() {
  const auto& o = options;
  const int64_t D = o.num_attention_heads() * o.attention_head_dim(), p = o.patch_size();
  pos_embed =
      register_module("pos_embed", SD3PatchEmbed(o.in_channels(), D, p, o.sample_size() / p, o.pos_embed_max_size()));
  // CombinedTimestepTextProjEmbeddings: a 256-wide sinusoid through timestep_embedder, the pooled text through
  // text_embedder (PixArtAlphaTextProjection with SiLU: the same linear_1, SiLU, linear_2).
  auto tte = std::make_shared<torch::nn::Module>();
  timestep_embedder = tte->register_module("timestep_embedder", TimestepMLP(256, D));
  text_embedder = tte->register_module("text_embedder", TimestepMLP(o.pooled_projection_dim(), D));
  register_module("time_text_embed", tte);
  context_embedder = register_module("context_embedder", torch::nn::Linear(o.context_features(), D));
  if (o.num_classes() > 0)
    class_embedding = register_module("class_embedding", torch::nn::Embedding(o.num_classes() + 1, D));
  const std::set<int64_t> dual(o.dual_attention_layers().begin(), o.dual_attention_layers().end());
  auto list = register_module("transformer_blocks", torch::nn::ModuleList());
  blocks.clear();
  for (int64_t i = 0; i < o.num_layers(); ++i) {
    blocks.push_back(SD3JointBlock(D, o.num_attention_heads(), o.attention_head_dim(), i == o.num_layers() - 1,
                                   dual.count(i) > 0, o.qk_norm(), o.attention_impl(), o.force_fp32_for_softmax()));
    list->push_back(blocks.back());
  }
  norm_out = sd3_linear_in(*this, "norm_out", "linear", D, 2 * D);
  proj_out = register_module("proj_out", torch::nn::Linear(D, p * p * o.output_channels()));
}

Tensor SD3TransformerImpl::forward(const Tensor& x, const Tensor& time, const Conditioning& cond) {
  const auto& o = options;
  cond.check_inputs(kSd3Arch, /*takes_pooled=*/true);
  const at::ScalarType dt = pos_embed->proj->weight.scalar_type() == at::kDouble ? at::kDouble : dtype_;
  const int64_t p = o.patch_size();
  DEW_CHECK(x.dim() == 4 && x.size(1) == o.in_channels(), kSd3Arch, ": x must be [B, ", o.in_channels(),
            ", H, W], got ", x.sizes());
  DEW_CHECK(x.size(2) % p == 0 && x.size(3) % p == 0, kSd3Arch, ": H and W must be multiples of patch_size ", p,
            ", got ", x.size(2), " x ", x.size(3));
  const int64_t B = x.size(0), h = x.size(2) / p, w = x.size(3) / p;
  DEW_CHECK(time.dim() == 0 || (time.dim() == 1 && time.size(0) == B), kSd3Arch, ": time must be [", B,
            "] or a scalar, got ", time.sizes());
  DEW_CHECK(cond.context.defined(), kSd3Arch, ": a text context [B, L, ", o.context_features(),
            "] (encoder_hidden_states) is required");
  DEW_CHECK(cond.context.dim() == 3 && cond.context.size(0) == B && cond.context.size(2) == o.context_features(),
            kSd3Arch, ": context must be [", B, ", L, ", o.context_features(), "], got ", cond.context.sizes());
  DEW_CHECK(cond.pooled.defined(), kSd3Arch, ": a pooled text vector [B, ", o.pooled_projection_dim(),
            "] (pooled_projections) is required");
  DEW_CHECK(cond.pooled.dim() == 2 && cond.pooled.size(0) == B && cond.pooled.size(1) == o.pooled_projection_dim(),
            kSd3Arch, ": pooled must be [", B, ", ", o.pooled_projection_dim(), "], got ", cond.pooled.sizes());
  const int64_t L = cond.context.size(1);

  // Time and pooled text: diffusers' float32 sinusoid (float64 in a float64 model), then the MLPs in the compute
  // dtype.
  const Tensor t = time.to(x.device());
  Tensor temb = timestep_embedder(
                    timestep_embedding(t.dim() == 0 ? t.expand({B}) : t, 256, true, 0.0, dt == at::kDouble).to(dt)) +
                text_embedder(cond.pooled.to(x.device()).to(dt));
  if (o.num_classes() > 0) {
    Tensor labels = cond.labels.defined() ? cond.labels : at::full({B}, o.num_classes(), x.options().dtype(at::kLong));
    DEW_CHECK(labels.dim() == 1 && labels.size(0) == B, kSd3Arch, ": labels must be [", B, "], got ", labels.sizes());
    DEW_CHECK(!(labels.lt(0) | labels.gt(o.num_classes())).any().item<bool>(), kSd3Arch, ": labels must lie in [0, ",
              o.num_classes(), "] (", o.num_classes(), " = null class)");
    temb = temb + at::embedding(class_embedding->weight.to(dt), labels.to(at::kLong).to(x.device()));
  } else {
    DEW_CHECK(!cond.labels.defined(), kSd3Arch, ": labels given but num_classes is 0");
  }

  Tensor hx = pos_embed(x.to(dt)).contiguous();                             // [B, h*w, D]
  Tensor ht = dense(cond.context.to(x.device()).to(dt), context_embedder);  // [B, L, D]
  Tensor mask;
  if (cond.context_mask.defined()) {
    DEW_CHECK(cond.context_mask.dim() == 2 && cond.context_mask.size(0) == B && cond.context_mask.size(1) == L,
              kSd3Arch, ": context_mask must be [", B, ", ", L, "], got ", cond.context_mask.sizes());
    // Key mask over [image; text]: every image token is a real key.
    mask = at::cat({at::ones({B, h * w}, x.options().dtype(at::kBool)), cond.context_mask.to(x.device()).to(at::kBool)},
                   1);
  }
  const bool remat_blocks = o.remat() && is_training() && at::GradMode::is_enabled();
  for (auto& block : blocks) {
    if (!remat_blocks) {
      std::tie(hx, ht) = block(hx, ht, temb, mask);
      continue;
    }
    SD3JointBlock b = block;
    const bool last = b->pre_only;
    auto outs = remat(
        [b, mask, last](const std::vector<Tensor>& in) mutable {
          auto [y, z] = b(in[0], in[1], in[2], mask);
          return last ? std::vector<Tensor>{y} : std::vector<Tensor>{y, z};
        },
        {hx, ht, temb}, b->parameters());
    hx = outs[0];
    ht = last ? Tensor() : outs[1];
  }

  // AdaLayerNormContinuous: (scale, shift) from linear(silu(temb)).
  const auto ss = dense(at::silu(temb), norm_out).chunk(2, 1);
  Tensor y = dense(modulate(layer_norm_fp32(hx, kSd3Eps), ss[1], ss[0]), proj_out);  // [B, h*w, p*p*C]
  // Unpatchify as diffusers: [B, h, w, p, q, C] -> [B, C, h, p, w, q].
  y = y.reshape({B, h, w, p, p, o.output_channels()})
          .permute({0, 5, 1, 3, 2, 4})
          .reshape({B, o.output_channels(), h * p, w * p});
  return y.to(dt == at::kDouble ? at::kDouble : at::kFloat);
}

// ---- diffusers config.json and checkpoint ----

io::KeyMap sd3_transformer_key_map(const SD3TransformerOptions& options) {
  io::KeyMap map;
  const std::string last = "transformer_blocks\\." + std::to_string(options.num_layers() - 1) + "\\.attn\\.";
  map.skip(last + "add_q_proj\\..*").skip(last + "norm_added_q\\..*");
  return map;
}

}  // namespace dew::nn

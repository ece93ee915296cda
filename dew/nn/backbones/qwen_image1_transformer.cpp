#include "dew/nn/backbones/qwen_image1_transformer.h"

#include <ATen/ATen.h>
#include <torch/nn/modules/activation.h>

#include <algorithm>
#include <numeric>
#include <set>

#include "dew/core/error.h"
#include "dew/nn/blocks.h"
#include "dew/nn/diffusers_blocks.h"

namespace dew::nn {

using at::Tensor;
using qwen_image_detail::qwen_rms_heads;
using qwen_image_detail::qwen_rope;

namespace {

const char* kQwen1Arch = "qwen_image1_transformer";

// The packed 2 x 2 latent patches of each token.
constexpr int64_t kPatchFeatures = 4;

// SiLU then the linear, registered as diffusers' nn.Sequential(SiLU, Linear): `name`.1.
torch::nn::Linear modulation(torch::nn::Module& parent, const char* name, int64_t dim) {
  torch::nn::Linear linear(dim, 6 * dim);
  parent.register_module(name, torch::nn::Sequential(torch::nn::SiLU(), linear));
  return linear;
}

// One stream's heads: the projection split into heads [B, S, H, Dh], q and k RMS-normalised (diffusers' RMSNorm)
// and rotated (apply_rotary_emb_qwen in its [B, S, H, Dh] layout), then moved to [B, H, S, Dh].
std::vector<Tensor> stream_heads(const Tensor& x, const torch::nn::Linear& q, const torch::nn::Linear& k,
                                 const torch::nn::Linear& v, HeadNorm& norm_q, HeadNorm& norm_k, const QwenRope& rope,
                                 int64_t heads, int64_t head_dim) {
  auto split = [&](const torch::nn::Linear& l) { return dense(x, l).view({x.size(0), x.size(1), heads, head_dim}); };
  return {qwen_apply_rope(qwen_rms_heads(split(q), norm_q), rope).transpose(1, 2),
          qwen_apply_rope(qwen_rms_heads(split(k), norm_k), rope).transpose(1, 2), split(v).transpose(1, 2)};
}

// The text keys and values alone (a block without text output): {undefined, k, v}, k and v as stream_heads'.
std::vector<Tensor> stream_kv(const Tensor& x, const torch::nn::Linear& k, const torch::nn::Linear& v, HeadNorm& norm_k,
                              const QwenRope& rope, int64_t heads, int64_t head_dim) {
  auto split = [&](const torch::nn::Linear& l) { return dense(x, l).view({x.size(0), x.size(1), heads, head_dim}); };
  return {Tensor(), qwen_apply_rope(qwen_rms_heads(split(k), norm_k), rope).transpose(1, 2), split(v).transpose(1, 2)};
}

Tensor clip_fp16(const Tensor& x) { return x.scalar_type() == at::kHalf ? x.clamp(-65504, 65504) : x; }

}  // namespace

// ---- RoPE ----

QwenImage1Rope qwen_image1_rope(const std::vector<std::vector<int64_t>>& img_shapes, int64_t text_len,
                                const std::vector<int64_t>& axes_dims, const std::string& where,
                                const at::Device& device) {
  DEW_CHECK(!img_shapes.empty(), where, ": img_shapes is empty (at least one image's (frames, height, width))");
  DEW_CHECK(text_len >= 0, where, ": the text length must be >= 0, got ", text_len);
  std::vector<Tensor> rows;
  int64_t half = 0;
  const auto i64 = at::TensorOptions().dtype(at::kLong);
  for (size_t i = 0; i < img_shapes.size(); ++i) {
    const auto& s = img_shapes[i];
    DEW_CHECK(s.size() == 3 && s[0] > 0 && s[1] > 0 && s[2] > 0, where, ": img_shapes[", i,
              "] must be (frames, height, width) of positive sizes in packed tokens, got ", json(s).dump());
    const int64_t f = s[0], h = s[1], w = s[2];
    // scale_rope: rows and columns centred, -(h - h / 2) .. h / 2 - 1; the frames count on from the image's index
    const Tensor frame = at::arange(int64_t(i), int64_t(i) + f, i64).view({f, 1, 1}).expand({f, h, w});
    const Tensor row = at::arange(-(h - h / 2), h / 2, i64).view({1, h, 1}).expand({f, h, w});
    const Tensor col = at::arange(-(w - w / 2), w / 2, i64).view({1, 1, w}).expand({f, h, w});
    rows.push_back(at::stack({frame, row, col}, -1).reshape({f * h * w, 3}));
    half = std::max({half, h / 2, w / 2});
  }
  const Tensor text = at::arange(half, half + text_len, i64).view({text_len, 1}).expand({text_len, 3});
  QwenImage1Rope r{qwen_rope(at::cat(rows, 0), axes_dims), qwen_rope(text.contiguous(), axes_dims)};
  r.image.freqs = r.image.freqs.to(device);
  r.text.freqs = r.text.freqs.to(device);
  return r;
}

// ---- the block ----

QwenImage1BlockImpl::QwenImage1BlockImpl(FluxBlockOptions options_, bool text_out_)
    : options(std::move(options_)), text_out(text_out_) {
  const int64_t d = options.heads() * options.head_dim();
  img_mod = modulation(*this, "img_mod", d);
  attn = register_module("attn", FluxAttention(d, options.heads(), options.head_dim(), /*joint=*/true, text_out));
  img_mlp = register_module("img_mlp", FluxFeedForward(d));
  txt_mod = modulation(*this, "txt_mod", d);
  if (text_out) txt_mlp = register_module("txt_mlp", FluxFeedForward(d));
}

std::pair<Tensor, Tensor> QwenImage1BlockImpl::forward(const Tensor& x, const Tensor& txt, const Tensor& temb,
                                                       const QwenImage1Rope& rope, const Tensor& key_mask) {
  const int64_t L = txt.size(1), N = x.size(1), H = options.heads(), Dh = options.head_dim();
  // per stream: shift, scale, gate for the attention, then for the MLP (diffusers' _modulate)
  const auto m = dense(at::silu(temb), img_mod).chunk(6, 1), c = dense(at::silu(temb), txt_mod).chunk(6, 1);
  auto& a = *attn;
  const auto hi = stream_heads(modulate(layer_norm_fp32(x, 1e-6), m[0], m[1]), a.to_q, a.to_k, a.to_v, a.norm_q,
                               a.norm_k, rope.image, H, Dh);
  const Tensor tn = modulate(layer_norm_fp32(txt, 1e-6), c[0], c[1]);
  // one attention over [text; image]; without text_out only the image tokens ask
  const auto ht = text_out ? stream_heads(tn, a.add_q_proj, a.add_k_proj, a.add_v_proj, a.norm_added_q, a.norm_added_k,
                                          rope.text, H, Dh)
                           : stream_kv(tn, a.add_k_proj, a.add_v_proj, a.norm_added_k, rope.text, H, Dh);
  const Tensor q = text_out ? at::cat({ht[0], hi[0]}, 2) : hi[0];
  const Tensor o = merge_heads(attention(q, at::cat({ht[1], hi[1]}, 2), at::cat({ht[2], hi[2]}, 2), key_mask,
                                         options.attention_impl(), options.force_fp32_for_softmax()));
  Tensor h = x + m[2].unsqueeze(1) * dense(text_out ? o.narrow(1, L, N) : o, a.out);
  h = h + m[5].unsqueeze(1) * img_mlp(modulate(layer_norm_fp32(h, 1e-6), m[3], m[4]));
  if (!text_out) return {clip_fp16(h), txt};
  Tensor t = txt + c[2].unsqueeze(1) * dense(o.narrow(1, 0, L), a.to_add_out);
  t = t + c[5].unsqueeze(1) * txt_mlp(modulate(layer_norm_fp32(t, 1e-6), c[3], c[4]));
  return {clip_fp16(h), clip_fp16(t)};
}

// ---- the model ----

QwenImage1TransformerImpl::QwenImage1TransformerImpl(QwenImage1TransformerOptions options_)
    : options(std::move(options_)) {
  const auto& o = options;
  const std::string w = kQwen1Arch;
  DEW_CHECK(o.in_channels() > 0 && o.output_channels() > 0, w, ": in_channels and output_channels must be > 0, got ",
            o.in_channels(), " and ", o.output_channels());
  DEW_CHECK(o.num_classes() == 0, w, ": num_classes must be 0, got ", o.num_classes(),
            " (Qwen-Image conditions on text, not on class labels: train it with a text encoder, e.g. "
            "--text_encoder.architecture byte_text_encoder)");
  DEW_CHECK(o.context_features() > 0, w, ": context_features must be > 0 (joint_attention_dim), got ",
            o.context_features());
  DEW_CHECK(o.num_layers() >= 0, w, ": num_layers must be >= 0, got ", o.num_layers());
  DEW_CHECK(o.num_attention_heads() > 0, w, ": num_attention_heads must be > 0, got ", o.num_attention_heads());
  DEW_CHECK(o.attention_head_dim() > 0 && o.attention_head_dim() % 2 == 0, w,
            ": attention_head_dim must be even and > 0, got ", o.attention_head_dim());
  const auto& axes = o.axes_dims_rope();
  DEW_CHECK(axes.size() == 3 && std::all_of(axes.begin(), axes.end(), [](int64_t a) { return a > 0 && a % 2 == 0; }) &&
                std::accumulate(axes.begin(), axes.end(), int64_t(0)) == o.attention_head_dim(),
            w, ": axes_dims_rope must be three even widths > 0 (frame, height, width) summing to attention_head_dim ",
            o.attention_head_dim(), ", got ", json(axes).dump());
  dtype_ = parse_compute_dtype(o.dtype(), w + ".dtype");
  check_attention_impl(o.attention_impl(), w + ".attention_impl");
  reset();
}

void QwenImage1TransformerImpl::reset() {
  // Parameters keep LibTorch's default initialisation of each layer, as diffusers' model (no zero heads).
  const auto& o = options;
  const int64_t d = o.num_attention_heads() * o.attention_head_dim();
  auto time_text_embed = register_module("time_text_embed", std::make_shared<torch::nn::Module>());
  timestep_embedder = time_text_embed->register_module("timestep_embedder", TimestepMLP(256, d));
  txt_norm = register_module("txt_norm", HeadNorm(HeadNormOptions(o.context_features()).kind("rms").eps(1e-6)));
  img_in = register_module("img_in", torch::nn::Linear(kPatchFeatures * o.in_channels(), d));
  txt_in = register_module("txt_in", torch::nn::Linear(o.context_features(), d));
  const auto bo = FluxBlockOptions(o.num_attention_heads(), o.attention_head_dim())
                      .attention_impl(o.attention_impl())
                      .force_fp32_for_softmax(o.force_fp32_for_softmax());
  auto list = register_module("transformer_blocks", torch::nn::ModuleList());
  blocks.clear();
  for (int64_t i = 0; i < o.num_layers(); ++i) {
    blocks.emplace_back(bo, /*text_out=*/i + 1 < o.num_layers());
    list->push_back(blocks.back());
  }
  norm_out = register_module("norm_out", FluxAdaNorm(d, 2));
  proj_out = register_module("proj_out", torch::nn::Linear(d, kPatchFeatures * o.output_channels()));
}

Tensor QwenImage1TransformerImpl::forward_packed(const Tensor& tokens, const Tensor& context,
                                                 const Tensor& context_mask, const Tensor& timestep,
                                                 const std::vector<std::vector<int64_t>>& img_shapes) {
  const auto& o = options;
  const std::string w = kQwen1Arch;
  const auto dt = img_in->weight.scalar_type() == at::kDouble ? at::kDouble : dtype_;
  DEW_CHECK(tokens.dim() == 3 && tokens.size(2) == kPatchFeatures * o.in_channels(), w,
            ": packed tokens must be [B, S, ", kPatchFeatures * o.in_channels(), "] (4 x in_channels), got ",
            tokens.sizes());
  const int64_t B = tokens.size(0), S = tokens.size(1);
  DEW_CHECK(context.defined() && context.dim() == 3 && context.size(0) == B && context.size(2) == o.context_features(),
            w, ": the text states (encoder_hidden_states) must be [", B, ", L, ", o.context_features(), "], got ",
            context.defined() ? context.sizes() : at::IntArrayRef{});
  const int64_t L = context.size(1);
  DEW_CHECK(timestep.dim() == 1 && timestep.size(0) == B, w, ": timestep must be [", B, "], got ", timestep.sizes());
  int64_t image_tokens = 0;
  for (const auto& s : img_shapes) image_tokens += s.size() == 3 ? s[0] * s[1] * s[2] : 0;
  DEW_CHECK(image_tokens == S, w, ": img_shapes ", json(img_shapes).dump(), " hold ", image_tokens,
            " packed tokens, but hidden_states has ", S);
  const auto device = tokens.device();
  Tensor key_mask;
  if (context_mask.defined()) {
    DEW_CHECK(context_mask.dim() == 2 && context_mask.size(0) == B && context_mask.size(1) == L, w,
              ": the text mask (encoder_hidden_states_mask) must be [", B, ", ", L, "] like the states, got ",
              context_mask.sizes());
    key_mask = at::cat({context_mask.to(device).to(at::kBool), at::ones({B, S}, tokens.options().dtype(at::kBool))}, 1);
  }
  const QwenImage1Rope rope = qwen_image1_rope(img_shapes, L, o.axes_dims_rope(), w, device);

  Tensor h = dense(tokens.to(dt), img_in);  // [B, S, D]
  // QwenTimestepProjEmbeddings: Timesteps(256, flip_sin_to_cos, shift 0, scale 1000) of t in [0, 1], computed in
  // float64 and rounded to the compute dtype (as qwen_image_transformer's: diffusers' float32 sinusoid is its
  // float32 model's largest error and differs between CPU kernels)
  const Tensor temb = timestep_embedder(
      timestep_embedding(timestep.to(device).to(dt), 256, /*cosine_first=*/true, 0.0, /*wide=*/true, 1000.0).to(dt));
  Tensor txt = dense(qwen_rms_heads(context.to(device).to(dt), txt_norm), txt_in);  // [B, L, D]

  run_double_stream_blocks(blocks, h, txt, temb, rope, key_mask,
                           o.remat() && is_training() && at::GradMode::is_enabled());
  // AdaLayerNormContinuous: scale first, then shift.
  const auto m = norm_out(temb);
  h = modulate(layer_norm_fp32(h, 1e-6), m[1], m[0]);
  return dense(h, proj_out).to(dt == at::kDouble ? at::kDouble : at::kFloat);
}

Tensor QwenImage1TransformerImpl::forward(const Tensor& x, const Tensor& time, const Conditioning& cond) {
  const auto& o = options;
  const std::string w = kQwen1Arch;
  cond.check_inputs(w, /*takes_pooled=*/false, {});
  DEW_CHECK(!cond.labels.defined(), w, ": takes no class labels (num_classes is 0; Qwen-Image conditions on text)");
  DEW_CHECK(x.dim() == 4 && x.size(1) == o.in_channels() && x.size(2) > 0 && x.size(3) > 0 && x.size(2) % 2 == 0 &&
                x.size(3) % 2 == 0,
            w, ": x must be [B, ", o.in_channels(), ", H, W] with H and W even (packed into 2 x 2 patches), got ",
            x.sizes());
  const int64_t B = x.size(0), H = x.size(2), W = x.size(3);
  DEW_CHECK(cond.context.defined(), w, ": a text context [B, L, ", o.context_features(),
            "] is required (joint attention over text and image tokens)");
  DEW_CHECK(time.dim() == 0 || (time.dim() == 1 && time.size(0) == B), w, ": time must be [", B, "] or a scalar, got ",
            time.sizes());
  // QwenImagePipeline hands the transformer timestep / 1000 in the latents' dtype
  const Tensor t = (time.dim() == 0 ? time.reshape({1}).expand({B}) : time).to(x.scalar_type()) / 1000;
  const Tensor out = forward_packed(flux_pack_latents(x), cond.context, cond.context_mask, t, {{1, H / 2, W / 2}});
  return flux_unpack_latents(out, H, W);
}

// ---- diffusers config.json ----

io::KeyMap qwen_image1_transformer_key_map(const QwenImage1TransformerOptions& options) {
  io::KeyMap map;
  if (options.num_layers() == 0) return map;
  const std::string last = "transformer_blocks\\." + std::to_string(options.num_layers() - 1) + "\\.";
  map.skip(last + "attn\\.add_q_proj\\..*")
      .skip(last + "attn\\.norm_added_q\\..*")
      .skip(last + "attn\\.to_add_out\\..*")
      .skip(last + "txt_mlp\\..*");
  return map;
}

models::ReferenceMethod qwen_image1_transformer_forward_method() {
  models::ReferenceMethod m;
  m.name = "forward";
  m.required = {"hidden_states", "encoder_hidden_states", "timestep", "img_shapes"};
  m.optional = {"encoder_hidden_states_mask"};
  m.outputs = {"sample"};
  m.run = [](torch::nn::Module& module, const std::map<std::string, Tensor>& in, const std::string& where) {
    auto* model = dynamic_cast<QwenImage1TransformerImpl*>(&module);
    DEW_CHECK(model, where, ": the model is not a qwen_image1_transformer");
    const Tensor& hs = in.at("hidden_states");
    DEW_CHECK(at::isFloatingType(hs.scalar_type()) && hs.dim() == 3, where,
              ": hidden_states must be the packed tokens [B, S, C] (floating point), got ", hs.sizes());
    const int64_t B = hs.size(0);
    const Tensor ts = in.at("timestep");
    DEW_CHECK(ts.dim() == 0 || (ts.dim() == 1 && (ts.size(0) == B || ts.size(0) == 1)), where,
              ": timestep must be a scalar or [", B, "], got ", ts.sizes());
    // img_shapes: [n, 3] or [B, n, 3] integers; diffusers reads the first sample's
    Tensor shapes = in.at("img_shapes");
    DEW_CHECK(!at::isFloatingType(shapes.scalar_type()) && (shapes.dim() == 2 || shapes.dim() == 3) &&
                  shapes.size(-1) == 3 && (shapes.dim() == 2 || shapes.size(0) >= 1),
              where, ": img_shapes must be integers [n, 3] or [B, n, 3] (frames, height, width per image), got ",
              shapes.sizes());
    if (shapes.dim() == 3) {
      DEW_CHECK(shapes.eq(shapes.select(0, 0).unsqueeze(0)).all().item<bool>(), where,
                ": img_shapes differ between samples (diffusers reads the first sample's for all)");
      shapes = shapes.select(0, 0);
    }
    std::vector<std::vector<int64_t>> img_shapes;
    const Tensor s = shapes.to(at::kLong).contiguous();
    for (int64_t i = 0; i < s.size(0); ++i)
      img_shapes.push_back({s[i][0].item<int64_t>(), s[i][1].item<int64_t>(), s[i][2].item<int64_t>()});
    const auto mask_it = in.find("encoder_hidden_states_mask");
    const Tensor mask = mask_it == in.end() ? Tensor() : mask_it->second.to(at::kBool);
    const Tensor& text = in.at("encoder_hidden_states");
    DEW_CHECK(at::isFloatingType(text.scalar_type()), where,
              ": input \"encoder_hidden_states\" must be floating point");
    // diffusers: timestep.to(hidden_states.dtype), a scalar broadcast over the batch
    const Tensor t = ts.to(hs.scalar_type()).reshape({-1}).expand({B}).contiguous();
    return std::map<std::string, Tensor>{{"sample", model->forward_packed(hs, text, mask, t, img_shapes)}};
  };
  return m;
}

}  // namespace dew::nn

#include "dew/nn/backbones/mmdit.h"

#include "dew/core/error.h"
#include "dew/nn/backbones/dit_common.h"

namespace dew::nn {

using at::Tensor;

namespace {

void init_linear(const torch::nn::Linear& l) {
  torch::nn::init::xavier_uniform_(l->weight);
  if (l->bias.defined()) l->bias.zero_();
}

}  // namespace

// ---- MMDiTStream ----

MMDiTStreamImpl::MMDiTStreamImpl(MMDiTBlockOptions options_, bool pre_only_)
    : options(std::move(options_)), pre_only(pre_only_) {
  const auto& o = options;
  DEW_CHECK(o.dim() > 0 && o.num_heads() > 0 && o.dim() % o.num_heads() == 0,
            "MMDiTBlock: num_heads must be > 0 and divide dim ", o.dim(), ", got ", o.num_heads());
  DEW_CHECK(o.mlp_ratio() > 0, "MMDiTBlock: mlp_ratio must be > 0, got ", o.mlp_ratio());
  DEW_CHECK(o.dropout() >= 0 && o.dropout() < 1, "MMDiTBlock: dropout must be in [0, 1), got ", o.dropout());
  DEW_CHECK(o.norm_eps() > 0, "MMDiTBlock: norm_eps must be > 0, got ", o.norm_eps());
  check_attention_impl(o.attention_impl(), "MMDiTBlock: attention_impl");
  reset();
}

void MMDiTStreamImpl::reset() {
  const int64_t d = options.dim(), dh = d / options.num_heads();
  adaLN_modulation = register_module("adaLN_modulation", torch::nn::Linear(d, (pre_only ? 2 : 6) * d));
  if (pre_only) {
    kv = register_module("kv", torch::nn::Linear(d, 2 * d));
  } else {
    qkv = register_module("qkv", torch::nn::Linear(d, 3 * d));
  }
  if (options.qk_norm()) {
    if (!pre_only) q_norm = register_module("q_norm", HeadNorm(HeadNormOptions(dh).kind("rms").eps(1e-6)));
    k_norm = register_module("k_norm", HeadNorm(HeadNormOptions(dh).kind("rms").eps(1e-6)));
  }
  if (!pre_only) {
    proj = register_module("proj", torch::nn::Linear(d, d));
    const auto hidden = static_cast<int64_t>(options.mlp_ratio() * static_cast<double>(d));
    mlp = register_module("mlp", Mlp(MlpOptions(d, hidden).activation("gelu_tanh").dropout(options.dropout())));
  }
  reset_parameters();
}

void MMDiTStreamImpl::reset_parameters() {
  // adaLN-Zero: every gate (and the pre-only stream's shift and scale) starts at zero; xavier projections
  // with zero biases as DiT. The MLP initialises itself.
  torch::NoGradGuard no_grad;
  adaLN_modulation->weight.zero_();
  adaLN_modulation->bias.zero_();
  for (const auto* l : {&qkv, &kv, &proj})
    if (!l->is_empty()) init_linear(*l);
}

std::vector<Tensor> MMDiTStreamImpl::modulation(const Tensor& c) {
  return dense(at::silu(c), adaLN_modulation).chunk(pre_only ? 2 : 6, 1);
}

std::vector<Tensor> MMDiTStreamImpl::heads(const Tensor& x_mod) {
  const int64_t H = options.num_heads();
  std::vector<Tensor> h = pre_only ? split_heads(dense(x_mod, kv), 2, H) : split_heads(dense(x_mod, qkv), 3, H);
  if (options.qk_norm()) {
    if (!pre_only) h[0] = q_norm(h[0]);
    h[h.size() - 2] = k_norm(h[h.size() - 2]);
  }
  return h;
}

Tensor MMDiTStreamImpl::finish(const Tensor& x, const Tensor& o, const std::vector<Tensor>& mod) {
  DEW_CHECK(!pre_only, "MMDiTStream: a pre-only (keys and values only) stream has no output");
  const double eps = options.norm_eps();
  Tensor a = torch::dropout(dense(merge_heads(o), proj), options.dropout(), is_training());
  Tensor h = x + mod[2].unsqueeze(1) * a;
  return h + mod[5].unsqueeze(1) * mlp(modulate(layer_norm_fp32(h, eps), mod[3], mod[4]));
}

// ---- MMDiTBlock ----

MMDiTBlockImpl::MMDiTBlockImpl(MMDiTBlockOptions options_) : options(std::move(options_)) { reset(); }

void MMDiTBlockImpl::reset() {
  image = register_module("image", MMDiTStream(options, /*pre_only=*/false));
  text = register_module("text", MMDiTStream(options, options.context_pre_only()));
}

std::pair<Tensor, Tensor> MMDiTBlockImpl::forward(const Tensor& x, const Tensor& txt, const Tensor& c, const Rope& rope,
                                                  const Tensor& text_mask) {
  const int64_t D = options.dim();
  DEW_CHECK(x.dim() == 3 && x.size(2) == D && txt.dim() == 3 && txt.size(2) == D && txt.size(0) == x.size(0) &&
                c.dim() == 2 && c.size(0) == x.size(0) && c.size(1) == D,
            "MMDiTBlock: x must be [B, N, ", D, "], text [B, L, ", D, "] and c [B, ", D, "], got ", x.sizes(), ", ",
            txt.sizes(), " and ", c.sizes());
  const int64_t L = txt.size(1), N = x.size(1);
  const double eps = options.norm_eps();
  const Tensor cc = c.to(x.scalar_type());

  const auto mi = image->modulation(cc);
  auto hi = image->heads(modulate(layer_norm_fp32(x, eps), mi[0], mi[1]));  // q, k, v: [B, H, N, Dh]
  hi[0] = apply_rope(hi[0], rope);
  hi[1] = apply_rope(hi[1], rope);
  const auto mt = text->modulation(cc);
  auto ht = text->heads(modulate(layer_norm_fp32(txt.to(x.scalar_type()), eps), mt[0], mt[1]));

  const bool pre_only = options.context_pre_only();
  // Joint sequence [text; image]; a pre-only text stream contributes keys and values only.
  Tensor q = pre_only ? hi[0] : at::cat({ht[0], hi[0]}, 2);
  Tensor k = at::cat({ht[ht.size() - 2], hi[1]}, 2);
  Tensor v = at::cat({ht[ht.size() - 1], hi[2]}, 2);
  Tensor mask;
  if (text_mask.defined())
    mask = at::cat({text_mask.to(at::kBool), at::ones({x.size(0), N}, text_mask.options().dtype(at::kBool))}, 1);
  Tensor o = attention(q, k, v, mask, options.attention_impl(), options.force_fp32_for_softmax());  // [B, H, Sq, Dh]

  if (pre_only) return {image->finish(x, o, mi), Tensor()};
  auto parts = o.split_with_sizes({L, N}, 2);
  return {image->finish(x, parts[1], mi), text->finish(txt.to(x.scalar_type()), parts[0], mt)};
}

Tensor run_mmdit_blocks(const std::vector<MMDiTBlock>& blocks, Tensor x, Tensor txt, const Tensor& c, const Rope& rope,
                        const Tensor& text_mask, bool use_remat) {
  for (size_t i = 0; i < blocks.size(); ++i) {
    MMDiTBlock block = blocks[i];
    const bool pre_only = block->options.context_pre_only();
    DEW_CHECK(!pre_only || i + 1 == blocks.size(), "run_mmdit_blocks: only the last block may be context_pre_only");
    if (use_remat) {
      // Captured by value: backward runs the function after this frame is gone.
      RematFn fn = [block, rope, text_mask, pre_only](const std::vector<Tensor>& in) mutable {
        auto out = block(in[0], in[1], in[2], rope, text_mask);
        return pre_only ? std::vector<Tensor>{out.first} : std::vector<Tensor>{out.first, out.second};
      };
      auto out = remat(fn, {x, txt, c}, block->parameters());
      x = out[0];
      if (!pre_only) txt = out[1];
    } else {
      std::tie(x, txt) = block(x, txt, c, rope, text_mask);
    }
  }
  return x;
}

Tensor checked_text_mask(const Conditioning& cond, int64_t batch, int64_t context_features, const std::string& who) {
  DEW_CHECK(cond.context.defined(), who,
            ": a text context is required (joint attention over text and image tokens): pass context [B, L, ",
            context_features, "]");
  const Tensor& ctx = cond.context;
  DEW_CHECK(ctx.dim() == 3 && ctx.size(0) == batch && ctx.size(1) >= 1 && ctx.size(2) == context_features, who,
            ": context must be [", batch, ", L >= 1, ", context_features, "], got ", ctx.sizes());
  if (!cond.context_mask.defined()) return Tensor();
  const Tensor& m = cond.context_mask;
  DEW_CHECK(m.dim() == 2 && m.size(0) == batch && m.size(1) == ctx.size(1), who, ": context_mask must be [", batch,
            ", ", ctx.size(1), "], got ", m.sizes());
  return m.to(ctx.device()).to(at::kBool);
}

Tensor mmdit_condition(TimeEmbedding& t_embedder, const torch::nn::Embedding& y_embedder,
                       const torch::nn::Linear& pooled, int64_t num_classes, const Tensor& time,
                       const Conditioning& cond, const Tensor& text_mask, int64_t batch, at::ScalarType dtype,
                       const std::string& who) {
  const Tensor c = time_label_condition(t_embedder, y_embedder, num_classes, time, cond, batch, dtype, who);
  return c + dense(masked_mean(cond.context, text_mask).to(dtype), pooled);
}

// ---- SimpleMMDiT ----

SimpleMMDiTImpl::SimpleMMDiTImpl(SimpleMMDiTOptions options_) : options(std::move(options_)) {
  const auto& o = options;
  const std::string w = "simple_mmdit";
  check_dit_fields(o, w);
  DEW_CHECK(o.context_features() > 0, w,
            ": context_features must be > 0 (the model attends jointly over text and image tokens and cannot "
            "run without text), got ",
            o.context_features());
  // The original offers raster and (use_hilbert) Hilbert order only.
  DEW_CHECK(o.scan_order() == "raster" || o.scan_order() == "hilbert", w,
            ": scan_order must be raster or hilbert, got \"", o.scan_order(), "\"");
  dtype_ = checked_compute_fields(o, w);
  reset();
}

void SimpleMMDiTImpl::reset() {
  const auto& o = options;
  const int64_t d = o.emb_features(), p = o.patch_size();
  x_embedder = register_module("x_embedder", patch_embedder(o.in_channels(), d, p));
  context_embedder = register_module("context_embedder", torch::nn::Linear(o.context_features(), d));
  t_embedder = register_module("t_embedder", TimeEmbedding(d));
  if (o.num_classes() > 0) y_embedder = register_module("y_embedder", label_embedder(o.num_classes(), d));
  pooled_text_embedder = register_module("pooled_text_embedder", torch::nn::Linear(o.context_features(), d));
  blocks = register_module("blocks", torch::nn::ModuleList());
  block_list.clear();
  for (int64_t i = 0; i < o.num_layers(); ++i) {
    MMDiTBlock b(dit_block_options<MMDiTBlockOptions>(o, d, o.num_heads()).context_pre_only(i + 1 == o.num_layers()));
    blocks->push_back(b);
    block_list.push_back(b);
  }
  final_layer = register_module(
      "final_layer", FinalLayer(FinalLayerOptions(d, p * p * o.output_channels()).norm_eps(o.norm_epsilon())));
  reset_parameters();
}

void SimpleMMDiTImpl::reset_parameters() {
  // DiT's initialisation; blocks and final layer initialise themselves (adaLN-Zero, zero output).
  init_dit_embedders(x_embedder, y_embedder, {context_embedder, pooled_text_embedder});
}

Tensor SimpleMMDiTImpl::forward(const Tensor& x, const Tensor& time, const Conditioning& cond) {
  cond.check_inputs("simple_mmdit", /*takes_pooled=*/false);
  const auto& o = options;
  const int64_t p = o.patch_size();
  check_patch_input(x, o.in_channels(), p, "simple_mmdit");
  const int64_t B = x.size(0);
  const Tensor mask = checked_text_mask(cond, B, o.context_features(), "simple_mmdit");
  const Grid g = grid(x.size(2) / p, x.size(3) / p, x.device());

  Tensor h = embed_patches(x, x_embedder, g, dtype_);             // [B, N, D] in scan order
  Tensor txt = dense(cond.context.to(dtype_), context_embedder);  // [B, L, D]

  const Tensor c = mmdit_condition(t_embedder, y_embedder, pooled_text_embedder, o.num_classes(), time.to(x.device()),
                                   cond, mask, B, dtype_, "simple_mmdit");  // [B, D]
  h = run_mmdit_blocks(block_list, h, txt, c, g.rope, mask, o.remat());
  Tensor out = final_layer(h, c).to(at::kFloat);  // [B, N, p p out] in scan order
  return unpatchify(out, p, g.scan);              // [B, out, H, W]
}

SimpleMMDiTImpl::Grid SimpleMMDiTImpl::grid(int64_t gh, int64_t gw, const at::Device& device) {
  const int64_t d = options.emb_features();
  return grid_cache_.get(options.scan_order(), gh, gw, d, d / options.num_heads(), device);
}

}  // namespace dew::nn

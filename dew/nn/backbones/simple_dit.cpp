#include "dew/nn/backbones/simple_dit.h"

#include "dew/core/error.h"

namespace dew::nn {

using at::Tensor;

SimpleDiTImpl::SimpleDiTImpl(SimpleDiTOptions options_) : SimpleDiTImpl(std::move(options_), "simple_dit", true) {}

SimpleDiTImpl::SimpleDiTImpl(SimpleDiTOptions options_, std::string arch, bool build_blocks)
    : options(std::move(options_)), arch_(std::move(arch)), build_blocks_(build_blocks) {
  const auto& o = options;
  const std::string& w = arch_;
  DEW_CHECK(o.patch_size() > 0, w, ": patch_size must be > 0, got ", o.patch_size());
  DEW_CHECK(o.in_channels() > 0, w, ": in_channels must be > 0, got ", o.in_channels());
  DEW_CHECK(o.output_channels() > 0, w, ": output_channels must be > 0, got ", o.output_channels());
  DEW_CHECK(o.num_layers() > 0, w, ": num_layers must be > 0, got ", o.num_layers());
  DEW_CHECK(o.num_heads() > 0, w, ": num_heads must be > 0, got ", o.num_heads());
  // The 2D sin-cos table splits D in four; RoPE rotates pairs within each head.
  DEW_CHECK(o.emb_features() > 0 && o.emb_features() % 4 == 0, w, ": emb_features must be a positive multiple of 4, got ",
            o.emb_features());
  DEW_CHECK(o.emb_features() % o.num_heads() == 0 && (o.emb_features() / o.num_heads()) % 2 == 0, w,
            ": emb_features / num_heads must be an even integer, got ", o.emb_features(), " / ", o.num_heads());
  DEW_CHECK(o.mlp_ratio() > 0, w, ": mlp_ratio must be > 0, got ", o.mlp_ratio());
  DEW_CHECK(o.dropout_rate() >= 0 && o.dropout_rate() < 1, w, ": dropout_rate must be in [0, 1), got ", o.dropout_rate());
  DEW_CHECK(o.norm_epsilon() > 0, w, ": norm_epsilon must be > 0, got ", o.norm_epsilon());
  DEW_CHECK(o.num_classes() >= 0, w, ": num_classes must be >= 0, got ", o.num_classes());
  DEW_CHECK(o.context_features() >= 0, w, ": context_features must be >= 0, got ", o.context_features());
  scan_cells(o.scan_order(), 1, 1);  // validates the name
  dtype_ = parse_compute_dtype(o.dtype(), w + ".dtype");
  check_attention_impl(o.attention_impl(), w + ".attention_impl");
  reset();
}

void SimpleDiTImpl::reset() {
  const auto& o = options;
  const int64_t d = o.emb_features(), p = o.patch_size();
  x_embedder = register_module("x_embedder",
                               torch::nn::Conv2d(torch::nn::Conv2dOptions(o.in_channels(), d, p).stride(p)));
  t_embedder = register_module("t_embedder", TimeEmbedding(d));
  if (o.num_classes() > 0)
    y_embedder = register_module("y_embedder", torch::nn::Embedding(o.num_classes() + 1, d));
  if (o.context_features() > 0)
    context_embedder = register_module("context_embedder", torch::nn::Linear(o.context_features(), d));
  block_list.clear();
  if (build_blocks_) {
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int64_t i = 0; i < o.num_layers(); ++i) {
      DiTBlock b = make_block();
      blocks->push_back(b);
      block_list.push_back(b);
    }
  }
  final_layer = register_module("final_layer", FinalLayer(FinalLayerOptions(d, p * p * o.output_channels())
                                                               .norm_eps(o.norm_epsilon())));
  reset_parameters();
}

DiTBlock SimpleDiTImpl::make_block() const {
  const auto& o = options;
  return DiTBlock(DiTBlockOptions(o.emb_features(), o.num_heads())
                      .mlp_ratio(o.mlp_ratio())
                      .dropout(o.dropout_rate())
                      .norm_eps(o.norm_epsilon())
                      .qk_norm(o.qk_norm())
                      .attention_impl(o.attention_impl())
                      .force_fp32_softmax(o.force_fp32_for_softmax()));
}

void SimpleDiTImpl::reset_parameters() {
  // DiT's initialisation; the blocks and the final layer initialise themselves (adaLN-Zero, zero output).
  torch::NoGradGuard no_grad;
  const auto& w = x_embedder->weight;  // xavier over the flattened [D, C p p] kernel, as a Linear
  torch::nn::init::xavier_uniform_(w.view({w.size(0), -1}));
  x_embedder->bias.zero_();
  if (!y_embedder.is_empty()) y_embedder->weight.normal_(0.0, 0.02);
  if (!context_embedder.is_empty()) {
    torch::nn::init::xavier_uniform_(context_embedder->weight);
    context_embedder->bias.zero_();
  }
}

Tensor SimpleDiTImpl::condition(const Tensor& time, const Conditioning& cond, int64_t batch) {
  const auto& o = options;
  DEW_CHECK(time.dim() == 0 || (time.dim() == 1 && time.size(0) == batch), arch_, ": time must be [", batch,
            "] or a scalar, got ", time.sizes());
  Tensor c = t_embedder(time.dim() == 0 ? time.expand({batch}) : time, dtype_);  // [B, D]
  if (o.num_classes() > 0) {
    Tensor labels = cond.labels.defined() ? cond.labels
                                          : at::full({batch}, o.num_classes(), c.options().dtype(at::kLong));
    DEW_CHECK(labels.dim() == 1 && labels.size(0) == batch, arch_, ": labels must be [", batch, "], got ",
              labels.sizes());
    // One host sync; an out-of-range id would otherwise be a device-side assert on CUDA.
    DEW_CHECK(!(labels.lt(0) | labels.gt(o.num_classes())).any().item<bool>(), arch_, ": labels must lie in [0, ",
              o.num_classes(), "] (", o.num_classes(), " = null class)");
    c = c + at::embedding(y_embedder->weight.to(dtype_), labels.to(at::kLong));
  } else {
    DEW_CHECK(!cond.labels.defined(), arch_, ": labels given but num_classes is 0");
  }
  if (cond.context.defined()) {
    DEW_CHECK(o.context_features() > 0, arch_, ": a text context was given but context_features is 0");
    DEW_CHECK(cond.context.dim() == 3 && cond.context.size(0) == batch && cond.context.size(2) == o.context_features(),
              arch_, ": context must be [", batch, ", L, ", o.context_features(), "], got ", cond.context.sizes());
    c = c + dense(masked_mean(cond.context, cond.context_mask).to(dtype_), context_embedder);
  }
  return c;
}

Tensor SimpleDiTImpl::embed(const Tensor& x, Grid& g) {
  const auto& o = options;
  const int64_t p = o.patch_size();
  DEW_CHECK(x.dim() == 4 && x.size(1) == o.in_channels(), arch_, ": x must be [B, ", o.in_channels(),
            ", H, W], got ", x.sizes());
  DEW_CHECK(x.size(2) % p == 0 && x.size(3) % p == 0, arch_, ": H and W must be multiples of patch_size ", p,
            ", got ", x.size(2), " x ", x.size(3));
  g = grid(x.size(2) / p, x.size(3) / p, x.device());

  Tensor h = conv(x.to(dtype_), x_embedder).flatten(2).transpose(1, 2);  // [B, N, D] raster
  if (!g.scan.is_raster()) h = h.index_select(1, g.perm);                 // scan order
  return h + g.pos.to(dtype_);
}

Tensor SimpleDiTImpl::run_block(DiTBlock& block, const Tensor& h, const Tensor& c, const Rope& rope) {
  if (!options.remat()) return block(h, c, rope);
  // Captured by value: backward runs the function after this frame is gone.
  return remat(*block, [block, rope](const std::vector<Tensor>& in) mutable { return block(in[0], in[1], rope); },
               {h, c});
}

Tensor SimpleDiTImpl::output(const Tensor& h, const Tensor& c, const Grid& g) {
  Tensor out = final_layer(h, c).to(at::kFloat);      // [B, N, p p out] in scan order
  return unpatchify(out, options.patch_size(), g.scan);  // [B, out, H, W]
}

Tensor SimpleDiTImpl::forward(const Tensor& x, const Tensor& time, const Conditioning& cond) {
  Grid g;
  Tensor h = embed(x, g);
  const Tensor c = condition(time.to(x.device()), cond, x.size(0));  // [B, D]
  for (auto& block : block_list) h = run_block(block, h, c, g.rope);
  return output(h, c, g);
}

SimpleDiTImpl::Grid SimpleDiTImpl::grid(int64_t gh, int64_t gw, const at::Device& device) {
  std::lock_guard<std::mutex> lock(grid_mutex_);
  if (grid_.h == gh && grid_.w == gw && grid_.device == device) return grid_;
  const int64_t d = options.emb_features();
  Grid g;
  g.h = gh;
  g.w = gw;
  g.device = device;
  g.scan = make_scan(options.scan_order(), gh, gw);
  g.perm = g.scan.perm.to(device);
  // The table is indexed by each token's true grid position, whatever the scan order.
  g.pos = sincos_2d_table(d, gh, gw).index_select(0, g.scan.perm).to(device);
  // RoPE over the sequence index is a 1D position only in raster order; under hilbert and zigzag the
  // identity (no rotation) is used and the 2D table carries the geometry.
  if (g.scan.is_raster()) g.rope = rope_1d(at::arange(gh * gw, at::TensorOptions(at::kLong).device(device)), d / options.num_heads());
  grid_ = g;
  return g;
}

}  // namespace dew::nn

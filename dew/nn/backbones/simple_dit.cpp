#include "dew/nn/backbones/simple_dit.h"

#include "dew/core/error.h"
#include "dew/nn/backbones/dit_common.h"

namespace dew::nn {

using at::Tensor;

SimpleDiTImpl::SimpleDiTImpl(SimpleDiTOptions options_) : SimpleDiTImpl(std::move(options_), "simple_dit", true) {}

SimpleDiTImpl::SimpleDiTImpl(SimpleDiTOptions options_, std::string arch, bool build_blocks)
    : options(std::move(options_)), arch_(std::move(arch)), build_blocks_(build_blocks) {
  const auto& o = options;
  const std::string& w = arch_;
  check_dit_fields(o, w);
  DEW_CHECK(o.context_features() >= 0, w, ": context_features must be >= 0, got ", o.context_features());
  scan_cells(o.scan_order(), 1, 1);  // validates the name
  dtype_ = checked_compute_fields(o, w);
  reset();
}

void SimpleDiTImpl::reset() {
  const auto& o = options;
  const int64_t d = o.emb_features(), p = o.patch_size();
  register_dit_embedders(*this, o);
  block_list.clear();
  if (build_blocks_) {
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int64_t i = 0; i < o.num_layers(); ++i) {
      DiTBlock b = make_block();
      blocks->push_back(b);
      block_list.push_back(b);
    }
  }
  final_layer = register_module(
      "final_layer", FinalLayer(FinalLayerOptions(d, p * p * o.output_channels()).norm_eps(o.norm_epsilon())));
  reset_parameters();
}

DiTBlock SimpleDiTImpl::make_block() const {
  return DiTBlock(dit_block_options<DiTBlockOptions>(options, options.emb_features(), options.num_heads()));
}

void SimpleDiTImpl::reset_parameters() {
  // DiT's initialisation; the blocks and the final layer initialise themselves (adaLN-Zero, zero output).
  init_dit_embedders(x_embedder, y_embedder, {context_embedder});
}

Tensor SimpleDiTImpl::condition(const Tensor& time, const Conditioning& cond, int64_t batch) {
  return dit_condition(t_embedder, y_embedder, context_embedder, options.num_classes(), options.context_features(),
                       time, cond, batch, dtype_, arch_);
}

Tensor SimpleDiTImpl::embed(const Tensor& x, Grid& g) {
  const int64_t p = options.patch_size();
  check_patch_input(x, options.in_channels(), p, arch_);
  g = grid(x.size(2) / p, x.size(3) / p, x.device());
  return embed_patches(x, x_embedder, g, dtype_);
}

Tensor SimpleDiTImpl::run_block(DiTBlock& block, const Tensor& h, const Tensor& c, const Rope& rope) {
  if (!options.remat()) return block(h, c, rope);
  // Captured by value: backward runs the function after this frame is gone.
  return remat(*block, [block, rope](const std::vector<Tensor>& in) mutable { return block(in[0], in[1], rope); },
               {h, c});
}

Tensor SimpleDiTImpl::output(const Tensor& h, const Tensor& c, const Grid& g) {
  Tensor out = final_layer(h, c).to(at::kFloat);         // [B, N, p p out] in scan order
  return unpatchify(out, options.patch_size(), g.scan);  // [B, out, H, W]
}

Tensor SimpleDiTImpl::forward(const Tensor& x, const Tensor& time, const Conditioning& cond) {
  cond.check_inputs("simple_dit", /*takes_pooled=*/false);
  Grid g;
  Tensor h = embed(x, g);
  const Tensor c = condition(time.to(x.device()), cond, x.size(0));  // [B, D]
  for (auto& block : block_list) h = run_block(block, h, c, g.rope);
  return output(h, c, g);
}

SimpleDiTImpl::Grid SimpleDiTImpl::grid(int64_t gh, int64_t gw, const at::Device& device) {
  const int64_t d = options.emb_features();
  return grid_cache_.get(options.scan_order(), gh, gw, d, d / options.num_heads(), device);
}

}  // namespace dew::nn

#include "dew/nn/backbones/simple_udit.h"

#include <cmath>

#include "dew/core/error.h"

namespace dew::nn {

using at::Tensor;

namespace {

// Checked before the SimpleDiT stem is built: the U layout pairs every down block with an up block.
SimpleDiTOptions checked(SimpleDiTOptions o) {
  DEW_CHECK(o.num_layers() > 0 && o.num_layers() % 2 == 0,
            "simple_udit: num_layers must be even and > 0 (num_layers / 2 down blocks, one mid block, "
            "num_layers / 2 up blocks), got ",
            o.num_layers());
  return o;
}

}  // namespace

SimpleUDiTImpl::SimpleUDiTImpl(SimpleDiTOptions options_)
    : SimpleDiTImpl(checked(std::move(options_)), "simple_udit", /*build_blocks=*/false) {
  build_unet();
}

void SimpleUDiTImpl::build_unet() {
  const int64_t d = options.emb_features(), half = options.num_layers() / 2;
  down_blocks = register_module("down_blocks", torch::nn::ModuleList());
  mid_block = register_module("mid_block", make_block());
  up_dense = register_module("up_dense", torch::nn::ModuleList());
  up_blocks = register_module("up_blocks", torch::nn::ModuleList());
  down_list.clear();
  up_list.clear();
  up_dense_list.clear();
  torch::NoGradGuard no_grad;
  for (int64_t i = 0; i < half; ++i) {
    DiTBlock down = make_block(), up = make_block();
    down_blocks->push_back(down);
    down_list.push_back(down);
    torch::nn::Linear fuse(2 * d, d);
    // flax's Dense default, as the original's up_dense: LeCun normal kernel (std 1/sqrt(fan_in)), zero bias.
    fuse->weight.normal_(0.0, 1.0 / std::sqrt(static_cast<double>(2 * d)));
    fuse->bias.zero_();
    up_dense->push_back(fuse);
    up_dense_list.push_back(fuse);
    up_blocks->push_back(up);
    up_list.push_back(up);
  }
}

Tensor SimpleUDiTImpl::forward(const Tensor& x, const Tensor& time, const Conditioning& cond) {
  cond.check_inputs("simple_udit", /*takes_pooled=*/false);
  Grid g;
  Tensor h = embed(x, g);
  const Tensor c = condition(time.to(x.device()), cond, x.size(0));  // [B, D]
  std::vector<Tensor> skips;
  skips.reserve(down_list.size());
  for (auto& block : down_list) {
    h = run_block(block, h, c, g.rope);
    skips.push_back(h);
  }
  h = run_block(mid_block, h, c, g.rope);
  for (size_t i = 0; i < up_list.size(); ++i) {
    h = dense(at::cat({h, skips.back()}, -1), up_dense_list[i]);  // [B, N, 2D] -> [B, N, D]
    skips.pop_back();
    h = run_block(up_list[i], h, c, g.rope);
  }
  return output(h, c, g);
}

}  // namespace dew::nn

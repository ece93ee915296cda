#include "dew/nn/backbones/dit_common.h"

#include <torch/nn/init.h>

namespace dew::nn {

using at::Tensor;

void init_dit_embedders(const torch::nn::Conv2d& x_embedder, const torch::nn::Embedding& y_embedder,
                        const std::vector<torch::nn::Linear>& dense_layers) {
  torch::NoGradGuard no_grad;
  const auto& w = x_embedder->weight;  // xavier over the flattened [D, C p p] kernel, as a Linear
  torch::nn::init::xavier_uniform_(w.view({w.size(0), -1}));
  x_embedder->bias.zero_();
  if (!y_embedder.is_empty()) y_embedder->weight.normal_(0.0, 0.02);
  for (const auto& l : dense_layers) {
    if (l.is_empty()) continue;
    torch::nn::init::xavier_uniform_(l->weight);
    if (l->bias.defined()) l->bias.zero_();
  }
}

void check_patch_input(const Tensor& x, int64_t in_channels, int64_t patch_size, const std::string& who) {
  DEW_CHECK(x.dim() == 4 && x.size(1) == in_channels, who, ": x must be [B, ", in_channels, ", H, W], got ", x.sizes());
  DEW_CHECK(x.size(2) % patch_size == 0 && x.size(3) % patch_size == 0, who,
            ": H and W must be multiples of patch_size ", patch_size, ", got ", x.size(2), " x ", x.size(3));
}

Tensor time_label_condition(TimeEmbedding& t_embedder, const torch::nn::Embedding& y_embedder, int64_t num_classes,
                            const Tensor& time, const Conditioning& cond, int64_t batch, at::ScalarType dtype,
                            const std::string& who) {
  DEW_CHECK(time.dim() == 0 || (time.dim() == 1 && time.size(0) == batch), who, ": time must be [", batch,
            "] or a scalar, got ", time.sizes());
  Tensor c = t_embedder(time.dim() == 0 ? time.expand({batch}) : time, dtype);  // [B, D]
  if (num_classes > 0) {
    Tensor labels = cond.labels.defined() ? cond.labels.to(c.device())
                                          : at::full({batch}, num_classes, c.options().dtype(at::kLong));
    DEW_CHECK(labels.dim() == 1 && labels.size(0) == batch, who, ": labels must be [", batch, "], got ",
              labels.sizes());
    // One host sync; an out-of-range id would otherwise be a device-side assert on CUDA.
    DEW_CHECK(!(labels.lt(0) | labels.gt(num_classes)).any().item<bool>(), who, ": labels must lie in [0, ",
              num_classes, "] (", num_classes, " = null class)");
    c = c + at::embedding(y_embedder->weight.to(dtype), labels.to(at::kLong));
  } else {
    DEW_CHECK(!cond.labels.defined(), who, ": labels given but num_classes is 0");
  }
  return c;
}

Tensor dit_condition(TimeEmbedding& t_embedder, const torch::nn::Embedding& y_embedder,
                     const torch::nn::Linear& context_embedder, int64_t num_classes, int64_t context_features,
                     const Tensor& time, const Conditioning& cond, int64_t batch, at::ScalarType dtype,
                     const std::string& who) {
  Tensor c = time_label_condition(t_embedder, y_embedder, num_classes, time, cond, batch, dtype, who);
  if (cond.context.defined()) {
    DEW_CHECK(context_features > 0, who, ": a text context was given but context_features is 0");
    DEW_CHECK(cond.context.dim() == 3 && cond.context.size(0) == batch && cond.context.size(2) == context_features, who,
              ": context must be [", batch, ", L, ", context_features, "], got ", cond.context.sizes());
    c = c + dense(masked_mean(cond.context, cond.context_mask).to(dtype), context_embedder);
  }
  return c;
}

PatchGrid make_patch_grid(const std::string& scan_order, int64_t gh, int64_t gw, int64_t dim, int64_t head_dim,
                          const at::Device& device) {
  PatchGrid g;
  g.h = gh;
  g.w = gw;
  g.device = device;
  g.scan = make_scan(scan_order, gh, gw);
  g.perm = g.scan.perm.to(device);
  // The table is indexed by each token's true grid position, whatever the scan order.
  g.pos = sincos_2d_table(dim, gh, gw).index_select(0, g.scan.perm).to(device);
  if (g.scan.is_raster()) g.rope = rope_1d(at::arange(gh * gw, at::TensorOptions(at::kLong).device(device)), head_dim);
  return g;
}

Tensor embed_patches(const Tensor& x, const torch::nn::Conv2d& x_embedder, const PatchGrid& g, at::ScalarType dtype) {
  Tensor h = conv(x.to(dtype), x_embedder).flatten(2).transpose(1, 2);  // [B, N, D] raster
  if (!g.scan.is_raster()) h = h.index_select(1, g.perm);               // scan order
  return h + g.pos.to(dtype);
}

PatchGrid PatchGridCache::get(const std::string& scan_order, int64_t gh, int64_t gw, int64_t dim, int64_t head_dim,
                              const at::Device& device) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (last_.h != gh || last_.w != gw || last_.device != device)
    last_ = make_patch_grid(scan_order, gh, gw, dim, head_dim, device);
  return last_;
}

}  // namespace dew::nn

#include "dew/nn/embeddings.h"

#include <ATen/CPUGeneratorImpl.h>

#include <cmath>

#include "dew/core/error.h"
#include "dew/nn/fused.h"

namespace dew::nn {

// ---- FourierFeatures ----

FourierFeaturesImpl::FourierFeaturesImpl(FourierFeaturesOptions options_) : options(std::move(options_)) {
  DEW_CHECK(options.features() > 0 && options.features() % 2 == 0,
            "FourierFeatures: features must be even and > 0, got ", options.features());
  DEW_CHECK(options.scale() > 0, "FourierFeatures: scale must be > 0, got ", options.scale());
  reset();
}

void FourierFeaturesImpl::reset() {
  // Drawn from a private generator: building a model never consumes the global RNG, and every build
  // (training, resume, sampling) holds identical frequencies even before weights are loaded.
  auto gen = at::detail::createCPUGenerator(options.seed());
  Tensor w = at::normal(0.0, options.scale(), {options.features() / 2}, gen, at::TensorOptions(at::kFloat));
  freqs = register_buffer("freqs", w);
}

Tensor FourierFeaturesImpl::forward(const Tensor& t) {
  DEW_CHECK(t.dim() == 1, "FourierFeatures: t must be [B], got ", t.sizes());
  Tensor arg = t.to(at::kFloat).unsqueeze(1) * (2.0 * M_PI) * freqs.unsqueeze(0);  // [B, features/2]
  return at::cat({at::sin(arg), at::cos(arg)}, 1);                                 // [B, features]
}

// ---- fixed tables ----

Tensor timestep_embedding(const Tensor& t, int64_t dim, double max_period) {
  DEW_CHECK(t.dim() == 1, "timestep_embedding: t must be [B], got ", t.sizes());
  DEW_CHECK(dim > 0, "timestep_embedding: dim must be > 0, got ", dim);
  const int64_t half = dim / 2;
  auto opts = t.options().dtype(at::kFloat);
  Tensor f = at::exp(-std::log(max_period) * at::arange(half, opts) / static_cast<double>(half));  // [half]
  Tensor arg = t.to(at::kFloat).unsqueeze(1) * f.unsqueeze(0);                                     // [B, half]
  Tensor emb = at::cat({at::cos(arg), at::sin(arg)}, 1);
  if (dim % 2) emb = at::cat({emb, at::zeros({t.size(0), 1}, opts)}, 1);
  return emb;
}

Tensor sincos_1d_table(int64_t dim, const Tensor& pos) {
  DEW_CHECK(dim > 0 && dim % 2 == 0, "sincos_1d_table: dim must be even and > 0, got ", dim);
  auto opts = at::TensorOptions(at::kDouble).device(pos.device());
  // float64 like MAE's numpy reference, then float32.
  Tensor omega = 1.0 / at::pow(10000.0, at::arange(dim / 2, opts) / (dim / 2.0));  // [dim/2]
  Tensor arg = pos.to(at::kDouble).reshape({-1, 1}) * omega.unsqueeze(0);          // [N, dim/2]
  return at::cat({at::sin(arg), at::cos(arg)}, 1).to(at::kFloat);
}

Tensor sincos_2d_table(int64_t dim, int64_t h, int64_t w) {
  DEW_CHECK(dim > 0 && dim % 4 == 0, "sincos_2d_table: dim must be divisible by 4, got ", dim);
  DEW_CHECK(h > 0 && w > 0, "sincos_2d_table: grid must be non-empty, got ", h, " x ", w);
  Tensor rows = at::arange(h, at::kLong).repeat_interleave(w);  // [h*w] row of each raster index
  Tensor cols = at::arange(w, at::kLong).repeat({h});           // [h*w] column
  return at::cat({sincos_1d_table(dim / 2, cols), sincos_1d_table(dim / 2, rows)}, 1);  // [h*w, dim]
}

// ---- RoPE ----

Rope rope_1d(const Tensor& positions, int64_t head_dim, double theta) {
  if (!positions.defined()) return {};
  DEW_CHECK(head_dim > 0 && head_dim % 2 == 0, "rope_1d: head_dim must be even and > 0, got ", head_dim);
  DEW_CHECK(positions.dim() == 1 || positions.dim() == 2, "rope_1d: positions must be [S] or [B, S], got ",
            positions.sizes());
  auto opts = at::TensorOptions(at::kFloat).device(positions.device());
  Tensor inv_freq = 1.0 / at::pow(theta, at::arange(0, head_dim, 2, opts) / static_cast<double>(head_dim));
  Tensor freqs = positions.to(at::kFloat).unsqueeze(-1) * inv_freq;  // [.., S, D/2]
  Tensor emb = at::cat({freqs, freqs}, -1);                          // [.., S, D]
  if (positions.dim() == 2) emb = emb.unsqueeze(1);                  // [B, 1, S, D]: broadcast over heads
  return {at::cos(emb), at::sin(emb)};
}

Tensor apply_rope(const Tensor& x, const Rope& rope) {
  if (!rope.defined()) return x;
  DEW_CHECK(x.dim() == 4 && x.size(-1) == rope.cos.size(-1) && x.size(2) == rope.cos.size(-2), "apply_rope: x ",
            x.sizes(), " does not match tables ", rope.cos.sizes());
  return rope_rotate(x, rope.cos, rope.sin);
}

}  // namespace dew::nn

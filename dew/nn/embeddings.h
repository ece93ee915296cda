// Embeddings of time and position: random Fourier features, sinusoidal timestep embedding, the MAE 2D
// sin-cos position table and 1D rotary position embedding (RoPE).
//
//   dew::nn::FourierFeatures f(256);            // f(t): [B] -> [B, 256]
//   auto table = dew::nn::sincos_2d_table(768, 16, 16);               // [256, 768]
//   auto rope = dew::nn::rope_1d(torch::arange(256), 64);              // for [B, H, 256, 64]
//   q = dew::nn::apply_rope(q, rope);
#pragma once
#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

namespace dew::nn {

using at::Tensor;

/// Options of FourierFeatures. Example: FourierFeaturesOptions(256).scale(16)
struct FourierFeaturesOptions {
  /* implicit */ FourierFeaturesOptions(int64_t features) : features_(features) {}
  /// output size (even): features/2 frequencies, each giving a sin and a cos, e.g. 256
  TORCH_ARG(int64_t, features);
  /// standard deviation of the frequencies, drawn once from N(0, scale^2)
  TORCH_ARG(double, scale) = 16.0;
  /// seed of that draw, so every build of a model holds the same frequencies
  TORCH_ARG(uint64_t, seed) = 42;
};

/// Random Fourier features of a scalar: [sin(2 pi t w), cos(2 pi t w)] with fixed frequencies w.
/// Buffer (not trained, saved with the weights): freqs [features/2].
class FourierFeaturesImpl : public torch::nn::Module {
 public:
  explicit FourierFeaturesImpl(FourierFeaturesOptions options);
  void reset();
  /// t: [B] (any float dtype) -> [B, features] float32.
  Tensor forward(const Tensor& t);

  FourierFeaturesOptions options;
  Tensor freqs;  // [features/2] float32
};
TORCH_MODULE(FourierFeatures);

/// Sinusoidal timestep embedding (ADM / DiT): [cos(t f_i), sin(t f_i)], f_i = max_period^(-i/half).
/// t: [B] -> [B, dim] float32 (dim odd: one zero column appended).
Tensor timestep_embedding(const Tensor& t, int64_t dim, double max_period = 10000.0);

/// 1D sin-cos table (MAE): [sin(p w_i), cos(p w_i)], w_i = 10000^(-i/(dim/2)). pos: [N] -> [N, dim].
Tensor sincos_1d_table(int64_t dim, const Tensor& pos);
/// MAE 2D sin-cos position table for an h x w grid in raster order: [h*w, dim] float32; the first half
/// of each row encodes the column, the second half the row (as MAE's get_2d_sincos_pos_embed).
/// dim must be divisible by 4.
Tensor sincos_2d_table(int64_t dim, int64_t h, int64_t w);

/// Rotary tables for a set of positions: cos and sin of [.., S, head_dim], float32.
/// Undefined tables mean "no rotation" (apply_rope returns its input).
struct Rope {
  Tensor cos;  // [S, D] or [B, 1, S, D]
  Tensor sin;
  bool defined() const { return cos.defined(); }
};

/// Rotate-half RoPE tables (GPT-NeoX / Llama layout) for positions [S] or [B, S]; head_dim even.
/// Undefined positions give undefined tables (the identity rotation).
Rope rope_1d(const Tensor& positions, int64_t head_dim, double theta = 10000.0);
/// Rotates x: [B, H, S, D] by the tables: x cos + rotate_half(x) sin, computed in fp32, returned in x's dtype.
Tensor apply_rope(const Tensor& x, const Rope& rope);

}  // namespace dew::nn

// The S5 state-space mixer (Smith et al., "Simplified State Space Layers for Sequence Modeling", 2023)
// and the 2D state fusion of hybrid_dit's SSM blocks (docs/backbones/hybrid_dit.md).
//
//   dew::nn::S5 ssm(dew::nn::S5Options(384, 64));      // bidirectional by default
//   at::Tensor y = ssm(u);                              // u: [B, L, 384] -> [B, L, 384]
//
// One direction: diagonal complex state A = -exp(log_A_real) + i A_imag, ZOH discretisation with a step
// dt per state (Abar = exp(A dt), Bbar = (Abar - 1)/A * B), recurrence x_k = Abar x_{k-1} + Bbar u_k and
// readout y_k = Re(C x_k) + D u_k. On float32 CPU tensors the recurrence runs as one fused loop per
// sequence, forward and backward (its own autograd function); elsewhere (other dtypes, CUDA) as a parallel
// (Hillis-Steele) scan: log2(L) steps, each one vectorised op over the whole sequence.
// Complex numbers are carried as (real, imaginary) fp32 pairs (LibTorch 1.13's complex autograd is
// incomplete); the mixer computes in fp32 whatever the compute dtype and returns the input's dtype.
#pragma once
#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <utility>
#include <vector>

namespace dew::nn {

using at::Tensor;

/// Options of S5 (and of one direction, S5Layer). Example: S5Options(768, 64).bidirectional(false)
struct S5Options {
  S5Options(int64_t dim, int64_t state_dim) : dim_(dim), state_dim_(state_dim) {}
  /// input and output width D, e.g. 768
  TORCH_ARG(int64_t, dim);
  /// complex state size N per direction, e.g. 64
  TORCH_ARG(int64_t, state_dim);
  /// a forward and a backward layer, concatenated and projected back to D (diffusion tokens have no
  /// preferred direction); false = one forward layer
  TORCH_ARG(bool, bidirectional) = true;
  /// range of the initial discretisation steps: log_dt ~ U(log dt_min, log dt_max)
  TORCH_ARG(double, dt_min) = 1e-3;
  TORCH_ARG(double, dt_max) = 1e-1;
};

/// A diagonal linear recurrence in ZOH-discretised form, fp32, complex values as (re, im) pairs:
/// Abar = exp(log_a) (log_a = A dt keeps every power Abar^k = exp(k A dt) exact), Bbar [N, D].
struct S5Discrete {
  Tensor log_a_re, log_a_im;  // [N]
  Tensor b_re, b_im;          // [N, D]
};

/// States of x_k = a x_{k-1} + b_k (x_{-1} = 0). a = exp(log_a): [N] (re, im); b: [B, L, N] (re, im), any
/// floating dtype. Returns the states (re, im), [B, L, N] each. float32 CPU: the fused recurrence (one loop
/// over L per sequence, a hand-written backward); otherwise a parallel scan over offsets 1, 2, 4, ...: after
/// the step with offset s, x_k holds sum_{j < 2s, j <= k} a^j b_{k-j}, the powers a^s = exp(s log_a) exact.
std::pair<Tensor, Tensor> s5_scan(const Tensor& log_a_re, const Tensor& log_a_im, const Tensor& b_re,
                                  const Tensor& b_im);
/// The same states step by step (the readable reference, a loop over L): for tests.
std::pair<Tensor, Tensor> s5_scan_reference(const Tensor& log_a_re, const Tensor& log_a_im, const Tensor& b_re,
                                            const Tensor& b_im);

/// One direction of S5. Parameters (names as in the original, all fp32):
///   log_A_real [N] = log(n + 1/2), A_imag [N] = pi n (HiPPO-diagonal initialisation, n = 0..N-1)
///   B_re, B_im [N, D], C_re, C_im [D, N] (lecun normal), D [D] (N(0, 1)), log_dt [N] (U(log dt_min, log dt_max))
class S5LayerImpl : public torch::nn::Module {
 public:
  explicit S5LayerImpl(S5Options options);
  void reset();
  void reset_parameters();
  /// The ZOH discretisation of the current parameters.
  S5Discrete discretize() const;
  /// u: [B, L, D] -> [B, L, D] in u's dtype (computed in fp32) by the parallel scan.
  Tensor forward(const Tensor& u);
  /// The same output by the step-by-step recurrence (s5_scan_reference): for tests.
  Tensor forward_reference(const Tensor& u);

  S5Options options;
  Tensor log_A_real, A_imag, B_re, B_im, C_re, C_im, D, log_dt;

 private:
  Tensor readout(const Tensor& x_re, const Tensor& x_im, const Tensor& u_f32) const;
};
TORCH_MODULE(S5Layer);

/// The S5 mixer: s5_forward over the sequence; when bidirectional, also s5_backward over the reversed
/// sequence (its output reversed back), the two concatenated and projected back to D by out_proj.
/// Parameters: s5_forward.*, s5_backward.*, out_proj.{weight [D, 2D], bias} (the last two when
/// bidirectional).
class S5Impl : public torch::nn::Module {
 public:
  explicit S5Impl(S5Options options);
  void reset();
  void reset_parameters();
  /// u: [B, L, D] -> [B, L, D] in u's dtype (out_proj runs in that dtype).
  Tensor forward(const Tensor& u);

  S5Options options;
  S5Layer s5_forward{nullptr}, s5_backward{nullptr};
  torch::nn::Linear out_proj{nullptr};
};
TORCH_MODULE(S5);

/// Options of SpatialFusion. Example: SpatialFusionOptions(768).dilations({1, 2, 3})
struct SpatialFusionOptions {
  /* implicit */ SpatialFusionOptions(int64_t dim) : dim_(dim) {}
  /// channels (tokens' width), e.g. 768
  TORCH_ARG(int64_t, dim);
  /// one depthwise 3x3 conv per dilation
  TORCH_ARG(std::vector<int64_t>, dilations) = std::vector<int64_t>{1, 2, 3};
};

/// 2D state fusion (Spatial-Mamba): the tokens, placed back on their patch grid, plus depthwise 3x3
/// convolutions at several dilations ("same" padding, no bias). The kernels start at zero, so the fusion
/// starts as the identity. Gives the 1D scan an isotropic local 2D neighbourhood whatever the scan order.
/// Parameters: dwconv_dil{d}.weight [D, 1, 3, 3] for each dilation d.
class SpatialFusionImpl : public torch::nn::Module {
 public:
  explicit SpatialFusionImpl(SpatialFusionOptions options);
  void reset();
  void reset_parameters();
  /// y: [B, h*w, D] tokens in scan order; perm [h*w] (perm[n] = raster index of token n) and inverse
  /// (its inverse) on y's device, both undefined for raster order. Returns y's shape and dtype.
  Tensor forward(const Tensor& y, int64_t h, int64_t w, const Tensor& perm = {}, const Tensor& inverse = {});

  SpatialFusionOptions options;
  std::vector<torch::nn::Conv2d> convs;
};
TORCH_MODULE(SpatialFusion);

}  // namespace dew::nn

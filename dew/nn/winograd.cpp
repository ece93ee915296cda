#include "dew/nn/winograd.h"

#include <ATen/Parallel.h>
#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/version.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>

#include "dew/core/error.h"
#include "dew/nn/autograd_detail.h"
#include "dew/nn/fused.h"

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define DEW_SIMD_X86 1  // the kernels' intrinsics (dew/nn/simd.inc)
#include <immintrin.h>
#endif

// The kernels pass 64-byte vectors between always-inline helpers only; the ABI note does not apply.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace dew::nn {

// ---- the kernels, compiled once per instruction set ----
namespace wino_kernels {

// Images of N x H x W, cut into th x tw tiles of 2 x 2 outputs.
struct WinoGrid {
  int64_t N, H, W, th, tw;
};

#define DEW_SIMD_KERNELS "dew/nn/winograd_kernels.inc"
#include "dew/nn/simd_variants.inc"
#undef DEW_SIMD_KERNELS
}  // namespace wino_kernels

namespace {

using wino_kernels::WinoGrid;

struct WinoKernels {
  decltype(&wino_kernels::base::wino_input) input;
  decltype(&wino_kernels::base::wino_grad_tiles) grad_tiles;
  decltype(&wino_kernels::base::wino_output) output;
  decltype(&wino_kernels::base::small_gemm) gemm;
};

#define DEW_WINO_SET(NS)                                                                            \
  WinoKernels {                                                                                     \
    wino_kernels::NS::wino_input, wino_kernels::NS::wino_grad_tiles, wino_kernels::NS::wino_output, \
        wino_kernels::NS::small_gemm                                                                \
  }

// The variant of the fused kernels' instruction set (fused_kernel_isa(), which tests switch).
WinoKernels wino_kernels_now() {
#ifdef DEW_SIMD_X86
  const std::string isa = fused_kernel_isa();
  if (isa == "avx512") return DEW_WINO_SET(avx512);
  if (isa == "avx2") return DEW_WINO_SET(avx2);
#endif
  return DEW_WINO_SET(base);
}

// Tiles per block: a multiple of the GEMM's 6 rows; a block's transformed inputs and products (16 x 36 x
// channels floats each) stay in the core's L2 cache.
constexpr int64_t kTileBlock = 36;
// The weight gradient is summed over this many fixed ranges of tiles, each on one thread, then over the
// ranges in order: the same bits at any thread count.
constexpr int64_t kGradRanges = 8;

WinoGrid grid_of(const Tensor& x) {
  const int64_t H = x.size(2), W = x.size(3);
  return {x.size(0), H, W, (H + 1) / 2, (W + 1) / 2};
}

// G of F(2x2, 3x3): U = G g G^T maps a 3 x 3 filter to its 4 x 4 transform.
Tensor wino_g(const at::TensorOptions& options) {
  return at::tensor({1.0f, 0.0f, 0.0f, 0.5f, 0.5f, 0.5f, 0.5f, -0.5f, 0.5f, 0.0f, 0.0f, 1.0f}, options).view({4, 3});
}

// w [O, C, 3, 3] -> U [16, C, O]: G w G^T of every filter, position-major, input channels by output ones.
Tensor transform_weights(const Tensor& w) {
  const Tensor G = wino_g(w.options());
  return at::matmul(at::matmul(G, w), G.t()).permute({2, 3, 1, 0}).reshape({16, w.size(1), w.size(0)}).contiguous();
}

// dU [16, C, O] (the gradient of U) -> dw [O, C, 3, 3] = G^T dU G of every filter.
Tensor weights_from_transform(const Tensor& dU, int64_t C, int64_t O) {
  const Tensor G = wino_g(dU.options());
  const Tensor X = dU.view({4, 4, C, O}).permute({3, 2, 0, 1});  // [O, C, 4, 4]
  return at::matmul(at::matmul(G.t(), X), G).contiguous();
}

std::unique_ptr<float[]> scratch(int64_t n) { return std::unique_ptr<float[]>(new float[static_cast<size_t>(n)]); }

// y = conv(x, U) (+ bias): x channels-last [N, C, H, W], U [16, C, O] -> channels-last [N, O, H, W]. Each
// block of tiles writes its own outputs, so the split over threads does not change a bit.
Tensor wino_forward(const Tensor& x, const Tensor& U, const Tensor& bias) {
  const WinoKernels k = wino_kernels_now();
  const WinoGrid g = grid_of(x);
  const int64_t C = x.size(1), O = U.size(2), T = g.N * g.th * g.tw;
  Tensor y = at::empty({g.N, O, g.H, g.W}, x.options().memory_format(at::MemoryFormat::ChannelsLast));
  const float *xp = x.data_ptr<float>(), *up = U.data_ptr<float>();
  const float* bp = bias.defined() && bias.numel() > 0 ? bias.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t vplane = kTileBlock * C, mplane = kTileBlock * O;
  at::parallel_for(0, (T + kTileBlock - 1) / kTileBlock, 1, [&](int64_t b0, int64_t b1) {
    auto V = scratch(16 * vplane), M = scratch(16 * mplane);
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t t0 = blk * kTileBlock, nt = std::min(kTileBlock, T - t0);
      k.input(xp, g, C, t0, nt, V.get(), vplane);
      for (int64_t xi = 0; xi < 16; ++xi)
        k.gemm(V.get() + xi * vplane, C, 1, up + xi * C * O, O, M.get() + xi * mplane, O, nt, C, O, false);
      k.output(M.get(), mplane, g, O, t0, nt, bp, yp);
    }
  });
  return y;
}

// dU [16, C, O] = sum over tiles of (B^T d B) (A dy A^T) per transform position, for x channels-last
// [N, C, H, W] and dy channels-last [N, O, H, W].
Tensor wino_weight_grad(const Tensor& x, const Tensor& dy) {
  const WinoKernels k = wino_kernels_now();
  const WinoGrid g = grid_of(x);
  const int64_t C = x.size(1), O = dy.size(1), T = g.N * g.th * g.tw;
  const int64_t per = (T + kGradRanges - 1) / kGradRanges, ranges = (T + per - 1) / per;
  Tensor parts = at::empty({ranges, 16, C, O}, x.options());
  const float *xp = x.data_ptr<float>(), *gp = dy.data_ptr<float>();
  float* pp = parts.data_ptr<float>();
  const int64_t vplane = kTileBlock * C, gplane = kTileBlock * O;
  at::parallel_for(0, ranges, 1, [&](int64_t r0, int64_t r1) {
    auto V = scratch(16 * vplane), Gt = scratch(16 * gplane);
    for (int64_t r = r0; r < r1; ++r) {
      float* part = pp + r * 16 * C * O;
      const int64_t end = std::min(T, (r + 1) * per);
      for (int64_t t0 = r * per; t0 < end; t0 += kTileBlock) {
        const int64_t nt = std::min(kTileBlock, end - t0);
        k.input(xp, g, C, t0, nt, V.get(), vplane);
        k.grad_tiles(gp, g, O, t0, nt, Gt.get(), gplane);
        for (int64_t xi = 0; xi < 16; ++xi)
          k.gemm(V.get() + xi * vplane, 1, C, Gt.get() + xi * gplane, O, part + xi * C * O, O, C, nt, O,
                 /*acc=*/t0 != r * per);
      }
    }
  });
  Tensor dU = parts[0].clone();
  for (int64_t r = 1; r < ranges; ++r) dU.add_(parts[r]);
  return dU;
}

bool autocast_cpu_enabled() { return at::autocast::is_autocast_enabled(at::kCPU); }

struct WinogradConvFunction : public torch::autograd::Function<WinogradConvFunction> {
  // bias: [O], or empty for none.
  static Tensor forward(torch::autograd::AutogradContext* ctx, const Tensor& x, const Tensor& weight,
                        const Tensor& bias) {
    ctx->save_for_backward({x, weight, bias});
    return wino_forward(x, transform_weights(weight), bias);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const Tensor &x = saved[0], &w = saved[1], &b = saved[2];
    if (!grads[0].defined()) return {Tensor(), Tensor(), Tensor()};
    if (at::GradMode::is_enabled())  // create_graph: a differentiable backward through ATen's convolution
      return detail::composite_grads(at::conv2d(x, w, b.numel() > 0 ? b : Tensor(), 1, 1), saved, 3, grads[0], 3);
    const Tensor dy = grads[0].contiguous(at::MemoryFormat::ChannelsLast);
    Tensor dx, dw, db;
    // The input gradient is the convolution of dy with the flipped filters, input and output channels swapped.
    if (ctx->needs_input_grad(0)) dx = wino_forward(dy, transform_weights(w.flip({2, 3}).transpose(0, 1)), Tensor());
    if (ctx->needs_input_grad(1)) dw = weights_from_transform(wino_weight_grad(x, dy), w.size(1), w.size(0));
    if (b.numel() > 0 && ctx->needs_input_grad(2)) db = dy.sum({0, 2, 3});
    return {dx, dw, db};
  }
};

}  // namespace

bool winograd_conv_applies(const Tensor& x, const Tensor& weight, const Tensor& bias) {
  if (!x.defined() || !weight.defined() || !fused_kernels_apply(x) || !fused_kernels_apply(weight)) return false;
  if (x.dim() != 4 || weight.dim() != 4 || x.numel() == 0) return false;
  const int64_t C = x.size(1), O = weight.size(0);
  if (weight.size(1) != C || weight.size(2) != 3 || weight.size(3) != 3 || C % 8 != 0 || O % 8 != 0) return false;
  if (bias.defined() && (!fused_kernels_apply(bias) || bias.dim() != 1 || bias.size(0) != O)) return false;
  return x.is_contiguous(at::MemoryFormat::ChannelsLast) && !autocast_cpu_enabled();
}

Tensor conv3x3_winograd(const Tensor& x, const Tensor& weight, const Tensor& bias) {
  DEW_CHECK(winograd_conv_applies(x, weight, bias),
            "conv3x3_winograd: needs float32 CPU x [N, C, H, W] in channels-last "
            "memory, weight [O, C, 3, 3] and bias [O] or none, with C and O multiples of 8; got x ",
            x.sizes(), " (", x.scalar_type(), "), weight ", weight.sizes(), ", bias ",
            bias.defined() ? bias.sizes() : at::IntArrayRef{});
  return WinogradConvFunction::apply(x, weight.contiguous(),
                                     bias.defined() ? bias.contiguous() : at::empty({0}, weight.options()));
}

}  // namespace dew::nn

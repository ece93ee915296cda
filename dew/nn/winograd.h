// 3 x 3 convolutions (stride 1, padding 1) by Winograd's minimal filtering F(2x2, 3x3) on the CPU, forward
// and backward: 16 multiplications per 2 x 2 outputs and channel pair instead of 36.
//
//   if (dew::nn::winograd_conv_applies(x, w, b))
//     y = dew::nn::conv3x3_winograd(x, w, b);       // == at::conv2d(x, w, b, 1, 1)
//
// Why: the unet models' training step is ~90% 3 x 3 convolutions, which oneDNN 2.6 (LibTorch 1.13) runs
// as direct convolutions on AVX2 machines; its Winograd kernels are AVX-512 only. dew::nn::conv() takes
// this path where it applies, so every convolutional family uses it. Measured against what LibTorch 2.13's
// oneDNN runs in its place, a training step's convolution is faster on every instruction set dew compiles
// for: AVX-512 (1.02-1.19x on a Sapphire Rapids Xeon), AVX2 (1.08-1.43x on a Zen 3) and SSE2 (2-3.6x
// oneDNN capped at SSE4.1); docs/benchmarks.md has the figures.
//
// Accuracy: F(2x2, 3x3)'s transforms only add, subtract and halve, and its rounding error is that of a
// direct convolution (smaller for the weight gradient, which sums fewer products per value); the tests
// hold it to the direct convolution's float32 error against float64 (tests/nn/test_winograd.cpp).
// Determinism: the weight gradient is summed over a fixed split of the tiles, then in order, so every
// result has the same bits at any thread count.
#pragma once
#include <ATen/core/Tensor.h>

namespace dew::nn {

using at::Tensor;

/// Whether conv3x3_winograd runs for these operands: float32 CPU x [N, C, H, W] stored channels-last
/// (NHWC), weight [O, C, 3, 3] float32, bias [O] float32 or undefined, C and O multiples of 8, and CPU
/// autocast off (the convolution then belongs to autocast).
bool winograd_conv_applies(const Tensor& x, const Tensor& weight, const Tensor& bias);
/// at::conv2d(x, weight, bias, /*stride=*/1, /*padding=*/1) for operands where winograd_conv_applies
/// (dew::Error otherwise): x [N, C, H, W] -> [N, O, H, W], channels-last. Differentiable in x, weight and
/// bias (a create_graph backward takes the ATen convolution).
Tensor conv3x3_winograd(const Tensor& x, const Tensor& weight, const Tensor& bias);

}  // namespace dew::nn

// Reduced-precision inference (`dew sample --pipeline DIR --weights-dtype bfloat16`, docs/sd3_flux.md): the
// big weights held in bfloat16 / float16, the matmuls and convolutions computed in that dtype with float32
// accumulation (LibTorch's CPU kernels accumulate bf16 / fp16 products in float32), the rest in float32.
//
//   nn::hold_weights_in(*transformer, at::kBFloat16);   // ~half the resident bytes
//   nn::InferenceAutocast scope(at::kBFloat16);          // for the forward calls
#pragma once
#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <cstdint>

namespace dew::nn {

/// Holds every parameter with two or more dims (Linear, Conv and Embedding weights, positional tables) in
/// `dtype`; vectors (biases, norm scales) and buffers stay as they are, so normalisations and the
/// residual stream keep float32. float32 changes nothing. Returns the bytes the parameters hold afterwards.
int64_t hold_weights_in(torch::nn::Module& module, at::ScalarType dtype);

/// CPU autocast in `dtype` for its scope (nothing for float32): linear, matmul, convolutions and attention
/// take their inputs in `dtype`, so a float32 activation meets a reduced-precision weight without a copy of
/// the weight; ops that mix dtypes elsewhere promote to float32. Restores the previous state.
class InferenceAutocast {
 public:
  explicit InferenceAutocast(at::ScalarType dtype);
  ~InferenceAutocast();
  InferenceAutocast(const InferenceAutocast&) = delete;
  InferenceAutocast& operator=(const InferenceAutocast&) = delete;

 private:
  bool on_ = false, was_enabled_ = false;
  at::ScalarType was_dtype_ = at::kBFloat16;
};

}  // namespace dew::nn

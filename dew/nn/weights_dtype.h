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

/// Builds a module (`make()` returns a ModuleHolder or a shared_ptr) with hold_weights_in's layout from the
/// start: the matrix weights are allocated in `dtype` as they are created, so no float32 copy of the model
/// ever exists (loading a bf16 pipeline peaks near its bf16 weights). While `make` runs LibTorch's default
/// dtype is `dtype` — a process-wide setting: call it where no other thread creates tensors; then the vector
/// parameters and the floating buffers are converted to float32 (a buffer a constructor computes in float32 or
/// float64 keeps its dtype and values). Load the weights afterwards: a module that loads them in its
/// constructor would round its vectors through `dtype`. float32: `make()` as it is.
template <class Make>
auto build_weights_in(at::ScalarType dtype, Make&& make) -> decltype(make());

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

namespace detail {
/// Sets LibTorch's default dtype for its scope (restored by the destructor).
class DefaultDtypeScope {
 public:
  explicit DefaultDtypeScope(at::ScalarType dtype);
  ~DefaultDtypeScope();
  DefaultDtypeScope(const DefaultDtypeScope&) = delete;
  DefaultDtypeScope& operator=(const DefaultDtypeScope&) = delete;

 private:
  caffe2::TypeMeta was_;
};
/// The second half of build_weights_in: vector parameters and `dtype` buffers to float32.
void settle_weights_in(torch::nn::Module& module, at::ScalarType dtype);
}  // namespace detail

template <class Make>
auto build_weights_in(at::ScalarType dtype, Make&& make) -> decltype(make()) {
  if (dtype == at::kFloat) return make();
  auto built = [&] {
    detail::DefaultDtypeScope scope(dtype);
    return make();
  }();
  detail::settle_weights_in(*built, dtype);
  return built;
}

}  // namespace dew::nn

// What the custom autograd functions of dew/nn (fused.cpp, winograd.cpp) share; not part of the public API.
#pragma once
#include <torch/csrc/autograd/variable.h>

#include <vector>

namespace dew::nn::detail {

/// For a create_graph backward: the gradients of the composite `y` (rebuilt from the saved inputs, in grad
/// mode) with respect to those of inputs[0..n) that require grad, so the result is itself differentiable.
/// Slots of the other inputs (and of the `total - n` non-tensor arguments) stay undefined.
torch::autograd::variable_list composite_grads(const at::Tensor& y, const std::vector<at::Tensor>& inputs, size_t n,
                                               const at::Tensor& grad, size_t total);

}  // namespace dew::nn::detail

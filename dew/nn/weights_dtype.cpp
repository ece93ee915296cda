#include "dew/nn/weights_dtype.h"

#include <ATen/autocast_mode.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/DefaultDtype.h>

#include "dew/core/error.h"

namespace dew::nn {

int64_t hold_weights_in(torch::nn::Module& module, at::ScalarType dtype) {
  at::NoGradGuard no_grad;
  int64_t bytes = 0;
  for (auto& p : module.parameters()) {
    // One tensor at a time, so converting needs one tensor of extra memory, not a second model.
    if (dtype != at::kFloat && p.dim() >= 2 && p.is_floating_point() && p.scalar_type() != dtype)
      p.set_data(p.to(dtype));
    bytes += int64_t(p.numel()) * int64_t(p.element_size());
  }
  return bytes;
}

namespace detail {

DefaultDtypeScope::DefaultDtypeScope(at::ScalarType dtype) : was_(c10::get_default_dtype()) {
  DEW_CHECK(dtype == at::kBFloat16 || dtype == at::kHalf || dtype == at::kFloat,
            "weights dtype: expected float32, bfloat16 or float16, got ", c10::toString(dtype));
  c10::set_default_dtype(c10::scalarTypeToTypeMeta(dtype));
}

DefaultDtypeScope::~DefaultDtypeScope() { c10::set_default_dtype(was_); }

void settle_weights_in(torch::nn::Module& module, at::ScalarType dtype) {
  at::NoGradGuard no_grad;
  for (auto& p : module.parameters())
    if (p.dim() < 2 && p.scalar_type() == dtype) p.set_data(p.to(at::kFloat));
  for (auto& b : module.buffers())
    if (b.scalar_type() == dtype) b.set_data(b.to(at::kFloat));
}

}  // namespace detail

InferenceAutocast::InferenceAutocast(at::ScalarType dtype) {
  if (dtype == at::kFloat) return;
  was_enabled_ = at::autocast::is_autocast_enabled(c10::kCPU);
  was_dtype_ = at::autocast::get_autocast_dtype(c10::kCPU);
  at::autocast::set_autocast_dtype(c10::kCPU, dtype);
  at::autocast::set_autocast_enabled(c10::kCPU, true);
  on_ = true;
}

InferenceAutocast::~InferenceAutocast() {
  if (!on_) return;
  at::autocast::set_autocast_enabled(c10::kCPU, was_enabled_);
  at::autocast::set_autocast_dtype(c10::kCPU, was_dtype_);
  at::autocast::clear_cache();
}

}  // namespace dew::nn

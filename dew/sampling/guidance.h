// Classifier-free guidance (docs/sampling.md): one forward pass on the doubled batch (conditional rows
// first), out = u + s (c - u) on raw outputs where the progress lies in the interval, optional rescale.
#pragma once
#include "dew/diffusion/process.h"

namespace dew::sampling {

using at::Tensor;

struct CFG {
  double scale = 1.0;
  double start = 0.0;
  double stop = 1.0;
  double rescale = 0.0;
  template <class V>
  void visit(V& v) {
    v("scale", scale, "guidance scale (1 disables guidance)");
    v("start", start, "progress at which guidance starts (progress = 1 - t/T)");
    v("stop", stop, "progress at which guidance stops");
    v("rescale", rescale, "guidance rescale factor r in [0, 1]: out <- r out std_c/std_out + (1 - r) out");
  }
};

/// Checks the fields (scale >= 0, 0 <= start <= stop <= 1, 0 <= rescale <= 1).
void validate(const CFG& cfg);

/// Combines conditional and unconditional raw outputs. progress: [B] float64 in [0, 1].
/// Rows whose progress is outside [start, stop] get scale 1 (the conditional output).
Tensor apply_cfg(const Tensor& cond, const Tensor& uncond, const Tensor& progress, const CFG& cfg);

/// Wraps a raw function that evaluates a doubled batch (rows [0, B) conditional, [B, 2B) unconditional)
/// into a guided raw function of B rows; t_max is the schedule's T for progress = clip(1 - t/T, 0, 1).
diffusion::RawFn guided(diffusion::RawFn doubled, const CFG& cfg, double t_max);

}  // namespace dew::sampling

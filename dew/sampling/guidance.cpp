#include "dew/sampling/guidance.h"

namespace dew::sampling {

void validate(const CFG& c) {
  DEW_CHECK(c.scale >= 0, "guidance.scale: must be >= 0, got ", c.scale);
  DEW_CHECK(c.start >= 0 && c.start <= c.stop && c.stop <= 1, "guidance.start/stop: need 0 <= start <= stop <= 1, got ",
            c.start, ", ", c.stop);
  DEW_CHECK(c.rescale >= 0 && c.rescale <= 1, "guidance.rescale: must be in [0, 1], got ", c.rescale);
}

Tensor apply_cfg(const Tensor& cond, const Tensor& uncond, const Tensor& progress, const CFG& cfg) {
  auto p = progress.to(at::kDouble).cpu();
  auto inside = (p >= cfg.start).logical_and(p <= cfg.stop);
  auto scale = at::where(inside, at::full_like(p, cfg.scale), at::ones_like(p));
  auto s = diffusion::bcast(scale.to(cond.device()), cond);
  auto out = uncond + s * (cond - uncond);
  if (cfg.rescale > 0) {
    // Lin et al. 2023: match the guided output's std to the conditional one's, per row.
    auto std_c = cond.flatten(1).std(1, /*unbiased=*/true);
    auto std_o = out.flatten(1).std(1, /*unbiased=*/true);
    auto ratio = diffusion::bcast(std_c / std_o, out);
    out = cfg.rescale * out * ratio + (1 - cfg.rescale) * out;
  }
  return out;
}

diffusion::RawFn guided(diffusion::RawFn doubled, const CFG& cfg, double t_max) {
  validate(cfg);
  DEW_CHECK(t_max > 0, "guided: t_max must be > 0, got ", t_max);
  return [doubled = std::move(doubled), cfg, t_max](const Tensor& x, const Tensor& t) {
    auto out = doubled(at::cat({x, x}), at::cat({t, t}));
    auto parts = out.chunk(2);
    auto progress = (1.0 - t.to(at::kDouble).cpu() / t_max).clamp(0, 1);
    return apply_cfg(parts[0], parts[1], progress, cfg);
  };
}

}  // namespace dew::sampling

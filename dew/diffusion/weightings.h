// Loss weightings (docs/diffusion.md): the schedule's own weight, MinSNR(gamma) or a constant.
#pragma once
#include "dew/diffusion/transforms.h"

namespace dew::diffusion {

class Weighting {
 public:
  virtual ~Weighting() = default;
  virtual std::string name() const = 0;
  /// w(t) per row (float64), for a given schedule and transform.
  virtual Tensor operator()(const Tensor& t, const Schedule& s, const Transform& tr) const = 0;
};
using WeightingPtr = std::shared_ptr<Weighting>;

struct MinSNROptions {
  double gamma = 5.0;
  template <class V>
  void visit(V& v) {
    v("gamma", gamma, "SNR clip: w = min(SNR, gamma)/target_error_scale(SNR)");
  }
};

/// w = min(SNR, gamma) / target_error_scale(SNR), and w = 1 where SNR = 0.
Tensor min_snr_weight(const Tensor& snr, double gamma, const Transform& tr);

/// schedule | min_snr | constant.
Registry<Weighting>& weightings();

}  // namespace dew::diffusion

#include "dew/diffusion/weightings.h"

namespace dew::diffusion {

Tensor min_snr_weight(const Tensor& snr, double gamma, const Transform& tr) {
  auto w = snr.clamp_max(gamma) / tr.target_error_scale(snr);
  return at::where(snr == 0, at::ones_like(w), w);
}

namespace {

class ScheduleWeighting : public Weighting {
 public:
  std::string name() const override { return "schedule"; }
  Tensor operator()(const Tensor& t, const Schedule& s, const Transform&) const override { return s.weight(t); }
};

class MinSNRWeighting : public Weighting {
 public:
  explicit MinSNRWeighting(double gamma) : gamma_(gamma) {}
  std::string name() const override { return "min_snr"; }
  Tensor operator()(const Tensor& t, const Schedule& s, const Transform& tr) const override {
    return min_snr_weight(s.snr(t), gamma_, tr);
  }

 private:
  double gamma_;
};

class ConstantWeighting : public Weighting {
 public:
  std::string name() const override { return "constant"; }
  Tensor operator()(const Tensor& t, const Schedule&, const Transform&) const override {
    return at::ones(t.sizes(), at::TensorOptions().dtype(at::kDouble));
  }
};

}  // namespace

Registry<Weighting>& weightings() {
  static Registry<Weighting>* r = [] {
    auto* r = new Registry<Weighting>("weighting");
    r->add<NoOptions>("schedule", "the training schedule's own weight (P2, 1/(1+SNR), EDM lambda, 1)",
                      [](const NoOptions&) { return std::make_shared<ScheduleWeighting>(); });
    r->add<MinSNROptions>("min_snr", "Min-SNR-gamma (Hang et al. 2023)", [](const MinSNROptions& o) {
      DEW_CHECK(o.gamma > 0, "weighting.gamma: must be > 0, got ", o.gamma);
      return std::make_shared<MinSNRWeighting>(o.gamma);
    });
    r->add<NoOptions>("constant", "w = 1", [](const NoOptions&) { return std::make_shared<ConstantWeighting>(); });
    return r;
  }();
  return *r;
}

}  // namespace dew::diffusion

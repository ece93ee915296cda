#include "dew/diffusion/transforms.h"

namespace dew::diffusion {

BRates broadcast_rates(const Rates& r, const Tensor& x) { return {bcast(r.alpha, x), bcast(r.sigma, x)}; }

Tensor Transform::c_in(const Rates& r) const { return at::ones_like(r.sigma); }

namespace {

// Division that gives 0 where the denominator is 0 (alpha = 0 at zero terminal SNR, sigma = 0 at t = 0),
// so an undefined read-back is a finite 0 rather than a NaN that poisons a whole sample.
Tensor safe_div(const Tensor& num, const Tensor& den) {
  auto zero = den == 0;
  return at::where(zero, at::zeros_like(num), num / at::where(zero, at::ones_like(den), den));
}

class EpsilonTransform : public Transform {
 public:
  std::string name() const override { return "epsilon"; }
  Tensor target(const Tensor&, const Tensor& eps, const BRates&) const override { return eps; }
  Prediction to_x0_eps(const Tensor& F, const Tensor& x, const BRates& r) const override {
    return {safe_div(x - r.sigma * F, r.alpha), F};
  }
  Tensor raw_output(const Tensor& x0, const Tensor& x, const BRates& r) const override {
    return safe_div(x - r.alpha * x0, r.sigma);
  }
  Tensor target_error_scale(const Tensor& snr) const override { return snr; }
};

class X0Transform : public Transform {
 public:
  std::string name() const override { return "x0"; }
  Tensor target(const Tensor& x0, const Tensor&, const BRates&) const override { return x0; }
  Prediction to_x0_eps(const Tensor& F, const Tensor& x, const BRates& r) const override {
    return {F, safe_div(x - r.alpha * F, r.sigma)};
  }
  Tensor raw_output(const Tensor& x0, const Tensor&, const BRates&) const override { return x0; }
  Tensor target_error_scale(const Tensor& snr) const override { return at::ones_like(snr); }
};

class VTransform : public Transform {
 public:
  std::string name() const override { return "v"; }
  Tensor target(const Tensor& x0, const Tensor& eps, const BRates& r) const override {
    // v / sqrt(alpha^2 + sigma^2), v = alpha eps - sigma x0
    return (r.alpha * eps - r.sigma * x0) / (r.alpha.square() + r.sigma.square()).sqrt();
  }
  Prediction to_x0_eps(const Tensor& F, const Tensor& x, const BRates& r) const override {
    auto n2 = r.alpha.square() + r.sigma.square();
    auto v = F * n2.sqrt();
    return {(r.alpha * x - r.sigma * v) / n2, (r.alpha * v + r.sigma * x) / n2};
  }
  Tensor raw_output(const Tensor& x0, const Tensor& x, const BRates& r) const override {
    auto eps = safe_div(x - r.alpha * x0, r.sigma);
    return target(x0, eps, r);
  }
  Tensor target_error_scale(const Tensor& snr) const override { return snr + 1; }
};

class FlowTransform : public Transform {
 public:
  std::string name() const override { return "flow"; }
  Tensor target(const Tensor& x0, const Tensor& eps, const BRates&) const override { return eps - x0; }
  // With alpha + sigma = 1 (the flow schedule) these are x0 = x_t - sigma F and eps = x_t + alpha F;
  // dividing by alpha + sigma keeps them exact on any schedule.
  Prediction to_x0_eps(const Tensor& F, const Tensor& x, const BRates& r) const override {
    auto n = r.alpha + r.sigma;
    return {(x - r.sigma * F) / n, (x + r.alpha * F) / n};
  }
  Tensor raw_output(const Tensor& x0, const Tensor& x, const BRates& r) const override {
    return safe_div(x - r.alpha * x0, r.sigma) - x0;
  }
  Tensor target_error_scale(const Tensor& snr) const override { return (1 + snr.sqrt()).square(); }
};

// EDM preconditioning (Karras et al. 2022, table 1), for alpha = 1 schedules.
class KarrasTransform : public Transform {
 public:
  explicit KarrasTransform(double sd) : sd_(sd) {}
  std::string name() const override { return "karras"; }
  Tensor c_in(const Rates& r) const override { return 1.0 / (r.sigma.square() + sd_ * sd_).sqrt(); }
  Tensor c_skip(const Tensor& sigma) const { return sd_ * sd_ / (sigma.square() + sd_ * sd_); }
  Tensor c_out(const Tensor& sigma) const { return sigma * sd_ / (sigma.square() + sd_ * sd_).sqrt(); }
  Tensor target(const Tensor& x0, const Tensor&, const BRates&) const override { return x0; }
  Tensor prediction(const Tensor& F, const Tensor& x, const BRates& r) const override {
    return c_skip(r.sigma) * x + c_out(r.sigma) * F;
  }
  Prediction to_x0_eps(const Tensor& F, const Tensor& x, const BRates& r) const override {
    auto d = prediction(F, x, r);
    return {d, safe_div(x - r.alpha * d, r.sigma)};
  }
  Tensor raw_output(const Tensor& x0, const Tensor& x, const BRates& r) const override {
    return safe_div(x0 - c_skip(r.sigma) * x, c_out(r.sigma));
  }
  Tensor target_error_scale(const Tensor& snr) const override { return at::ones_like(snr); }

 private:
  double sd_;
};

}  // namespace

TransformPtr make_transform(const std::string& name, double sigma_data) {
  if (name == "karras") return transforms().build(name, json{{"sigma_data", sigma_data}});
  return transforms().build(name, json::object());
}

Registry<Transform>& transforms() {
  static Registry<Transform>* r = [] {
    auto* r = new Registry<Transform>("transform");
    r->add<NoOptions>("epsilon", "predict eps; x0 = (x_t - sigma F)/alpha",
                      [](const NoOptions&) { return std::make_shared<EpsilonTransform>(); });
    r->add<NoOptions>("x0", "predict x0 directly; eps = (x_t - alpha F)/sigma",
                      [](const NoOptions&) { return std::make_shared<X0Transform>(); });
    r->add<NoOptions>("v", "predict v/sqrt(alpha^2 + sigma^2), v = alpha eps - sigma x0",
                      [](const NoOptions&) { return std::make_shared<VTransform>(); });
    r->add<NoOptions>("flow", "predict the velocity u = eps - x0",
                      [](const NoOptions&) { return std::make_shared<FlowTransform>(); });
    r->add<KarrasTransformOptions>(
        "karras", "EDM preconditioning D = c_skip x_t + c_out F(c_in x_t)", [](const KarrasTransformOptions& o) {
          DEW_CHECK(o.sigma_data > 0, "transform.sigma_data: must be > 0, got ", o.sigma_data);
          return std::make_shared<KarrasTransform>(o.sigma_data);
        });
    return r;
  }();
  return *r;
}

}  // namespace dew::diffusion

#include "dew/sampling/solvers.h"

#include <cmath>
#include <deque>

#include "dew/core/rng.h"

namespace dew::sampling {

using diffusion::ScheduleKind;

NoiseSource seeded_noise(uint64_t seed) {
  return [seed](int64_t step, const Tensor& like) {
    auto gen = rng::generator(seed, static_cast<uint64_t>(step), "sample/noise");
    return at::randn(like.sizes(), gen, at::TensorOptions().dtype(at::kFloat)).to(like.options());
  };
}

Prediction denoise_at(const Denoiser& d, const Tensor& x, double t) {
  return d(x, at::full({x.size(0)}, t, at::TensorOptions().dtype(at::kDouble)));
}

namespace {

void require_ve(const std::string& solver, const Schedule& s) {
  DEW_CHECK(s.kind() == ScheduleKind::variance_exploding, "solver ", solver,
            " works in sigma space and needs a variance-exploding schedule (alpha = 1: karras_ve, edm); schedule ",
            s.name(), " is ", diffusion::kind_name(s.kind()));
}

// Sigma-space helper: eps(x, sigma) = (x - D(x, sigma))/sigma, the probability-flow ODE slope dx/dsigma.
Tensor slope(const StepContext& c, const Tensor& x, double sigma) {
  double t = c.schedule.t_of_sigma(at::full({1}, sigma, at::TensorOptions().dtype(at::kDouble))).item<double>();
  return (x - denoise_at(c.denoiser, x, t).x0) / sigma;
}

/// DDPM ancestral step (Ho et al. 2020): the Gaussian posterior q(x_s | x_t, x0_hat).
class DDPM : public Solver {
 public:
  explicit DDPM(DDPMOptions o) : o_(std::move(o)) {}
  std::string name() const override { return "ddpm"; }
  void check(const Schedule& s) const override {
    DEW_CHECK(o_.variance == "small" || s.kind() == ScheduleKind::variance_preserving,
              "solver ddpm: variance \"large\" (beta) needs a variance-preserving schedule; schedule ", s.name(),
              " is ", diffusion::kind_name(s.kind()), "; use variance \"small\"");
  }
  Tensor step(const Tensor& x, double t, double s, const StepContext& c) override {
    auto [at_, st] = c.schedule.rates_at(t);
    auto [as, ss] = c.schedule.rates_at(s);
    auto p = denoise_at(c.denoiser, x, t);
    auto mean = as * p.x0 + (at_ * ss * ss / (as * st)) * p.eps;
    double ratio = (at_ * at_) / (as * as);
    double g = o_.variance == "small" ? ss * std::sqrt(std::max(0.0, 1 - ratio * ss * ss / (st * st)))
                                      : std::sqrt(std::max(0.0, 1 - ratio));
    if (g == 0) return mean;
    return mean + g * c.noise(c.index, x);
  }

 private:
  DDPMOptions o_;
};

/// DDIM (Song et al. 2021) with stochasticity eta.
class DDIM : public Solver {
 public:
  explicit DDIM(double eta) : eta_(eta) {}
  std::string name() const override { return "ddim"; }
  Tensor step(const Tensor& x, double t, double s, const StepContext& c) override {
    auto [at_, st] = c.schedule.rates_at(t);
    auto [as, ss] = c.schedule.rates_at(s);
    auto p = denoise_at(c.denoiser, x, t);
    double sd = eta_ * (ss / st) * std::sqrt(std::max(0.0, 1 - (at_ * at_) / (as * as)));
    auto out = as * p.x0 + std::sqrt(std::max(0.0, ss * ss - sd * sd)) * p.eps;
    if (sd == 0) return out;
    return out + sd * c.noise(c.index, x);
  }

 private:
  double eta_;
};

/// Euler on the probability-flow ODE, written for any (alpha, sigma).
class Euler : public Solver {
 public:
  std::string name() const override { return "euler"; }
  Tensor step(const Tensor& x, double t, double s, const StepContext& c) override {
    auto [at_, st] = c.schedule.rates_at(t);
    auto [as, ss] = c.schedule.rates_at(s);
    auto p = denoise_at(c.denoiser, x, t);
    if (ss == st) return as * p.x0 + ss * p.eps;  // flat sigma: the step only rescales alpha
    double cc = (at_ * ss - as * st) / (ss - st);
    auto d = (x - cc * p.x0) / st;
    return x + d * (ss - st);
  }
};

/// Euler ancestral (k-diffusion, VE).
class EulerAncestral : public Solver {
 public:
  std::string name() const override { return "euler_ancestral"; }
  void check(const Schedule& s) const override { require_ve(name(), s); }
  Tensor step(const Tensor& x, double t, double s, const StepContext& c) override {
    double st = c.schedule.rates_at(t).second, ss = c.schedule.rates_at(s).second;
    auto p = denoise_at(c.denoiser, x, t);
    double up = std::sqrt(std::max(0.0, ss * ss * (st * st - ss * ss) / (st * st)));
    double down = std::sqrt(std::max(0.0, ss * ss - up * up));
    auto out = x + (x - p.x0) / st * (down - st);
    if (up == 0) return out;
    return out + up * c.noise(c.index, x);
  }
};

/// Heun's second-order method, EDM (Karras et al. 2022) algorithm 2, with optional churn.
class Heun : public Solver {
 public:
  explicit Heun(HeunOptions o) : o_(std::move(o)) {}
  std::string name() const override { return "heun"; }
  void check(const Schedule& s) const override { require_ve(name(), s); }
  Tensor step(const Tensor& x_in, double t, double s, const StepContext& c) override {
    double st = c.schedule.rates_at(t).second, ss = c.schedule.rates_at(s).second;
    double tmax = o_.s_tmax.value_or(INFINITY);
    double gamma = (o_.s_churn > 0 && st >= o_.s_tmin && st <= tmax)
                       ? std::min(o_.s_churn / double(c.num_steps), std::sqrt(2.0) - 1)
                       : 0.0;
    Tensor x = x_in;
    double sh = st * (1 + gamma);
    if (gamma > 0) x = x + o_.s_noise * st * std::sqrt(gamma * (2 + gamma)) * c.noise(c.index, x);
    auto d0 = slope(c, x, sh);
    auto xe = x + d0 * (ss - sh);
    if (ss == 0) return xe;
    auto d1 = slope(c, xe, ss);
    return x + (d0 + d1) * (0.5 * (ss - sh));
  }

 private:
  HeunOptions o_;
};

/// Classic fourth-order Runge-Kutta on dx/dsigma = eps(x, sigma).
class RK4 : public Solver {
 public:
  std::string name() const override { return "rk4"; }
  void check(const Schedule& s) const override { require_ve(name(), s); }
  Tensor step(const Tensor& x, double t, double s, const StepContext& c) override {
    double st = c.schedule.rates_at(t).second, ss = c.schedule.rates_at(s).second;
    double h = ss - st;
    auto k1 = slope(c, x, st);
    if (ss == 0) return x + h * k1;  // the slope is undefined at sigma 0: Euler to the data
    auto k2 = slope(c, x + (h / 2) * k1, st + h / 2);
    auto k3 = slope(c, x + (h / 2) * k2, st + h / 2);
    auto k4 = slope(c, x + h * k3, ss);
    return x + (h / 6) * (k1 + 2 * k2 + 2 * k3 + k4);
  }
};

/// Linear multistep in sigma: integrates the polynomial through the last k (sigma, eps) pairs over
/// [sigma_t, sigma_s] (variable-step Adams-Bashforth; finite differences of eps in sigma).
class MultistepDPM : public Solver {
 public:
  explicit MultistepDPM(int64_t order) : order_(order) {}
  std::string name() const override { return "multistep_dpm"; }
  void check(const Schedule& s) const override { require_ve(name(), s); }
  void reset() override { hist_.clear(); }
  Tensor step(const Tensor& x, double t, double s, const StepContext& c) override {
    double st = c.schedule.rates_at(t).second, ss = c.schedule.rates_at(s).second;
    auto p = denoise_at(c.denoiser, x, t);
    hist_.push_front({st, (x - p.x0) / st});
    if (int64_t(hist_.size()) > order_) hist_.pop_back();
    Tensor out = x;
    for (size_t j = 0; j < hist_.size(); ++j) out = out + coefficient(j, st, ss) * hist_[j].second;
    return out;
  }

 private:
  // Integral over [a, b] of the j-th Lagrange basis polynomial of the stored sigmas; 3-point
  // Gauss-Legendre is exact for the degree <= 2 polynomials used here.
  double coefficient(size_t j, double a, double b) const {
    static const double nodes[3] = {-std::sqrt(0.6), 0.0, std::sqrt(0.6)};
    static const double weights[3] = {5.0 / 9, 8.0 / 9, 5.0 / 9};
    double sum = 0;
    for (int q = 0; q < 3; ++q) {
      double tau = 0.5 * (a + b) + 0.5 * (b - a) * nodes[q];
      double l = 1;
      for (size_t m = 0; m < hist_.size(); ++m)
        if (m != j) l *= (tau - hist_[m].first) / (hist_[j].first - hist_[m].first);
      sum += weights[q] * l;
    }
    return 0.5 * (b - a) * sum;
  }
  int64_t order_;
  std::deque<std::pair<double, Tensor>> hist_;  // newest first: (sigma, eps)
};

/// DPM-Solver++(2M) (Lu et al. 2022), data prediction, multistep second order.
class DPMSolverPP : public Solver {
 public:
  explicit DPMSolverPP(bool lower_order_final) : lower_order_final_(lower_order_final) {}
  std::string name() const override { return "dpmsolver++"; }
  void reset() override {
    prev_x0_.reset();
    prev_h_ = 0;
  }
  Tensor step(const Tensor& x, double t, double s, const StepContext& c) override {
    auto [at_, st] = c.schedule.rates_at(t);
    auto [as, ss] = c.schedule.rates_at(s);
    auto x0 = denoise_at(c.denoiser, x, t).x0;
    const double lt = std::log(at_) - std::log(st), ls = std::log(as) - std::log(ss);
    const double h = ls - lt;
    bool first_order =
        !prev_x0_.has_value() || ss == 0 || (lower_order_final_ && c.num_steps < 15 && c.index == c.num_steps - 2);
    Tensor d = x0;
    if (!first_order) {
      double r = prev_h_ / h;
      d = (1 + 1 / (2 * r)) * x0 - (1 / (2 * r)) * *prev_x0_;
    }
    prev_x0_ = x0;
    prev_h_ = h;
    // x_s = (sigma_s/sigma_t) x - alpha_s (exp(-h) - 1) D, written without exp(-h) so sigma_s = 0 is exact.
    return (ss / st) * (x - at_ * d) + as * d;
  }

 private:
  bool lower_order_final_;
  std::optional<Tensor> prev_x0_;
  double prev_h_ = 0;
};

/// PNDM (Liu et al. 2022): three pseudo-Runge-Kutta warm-up steps, then the fourth-order linear
/// multistep (55, -59, 37, -9)/24. The combination is applied to x0 predictions and transferred with
/// the DDIM map x_s = alpha_s x0 + sigma_s (x - alpha_t x0)/sigma_t, which stays well conditioned
/// where alpha_t is ~0 (zero terminal SNR) unlike the eps form.
class PNDM : public Solver {
 public:
  explicit PNDM(std::string name) : name_(std::move(name)) {}
  std::string name() const override { return name_; }
  void reset() override { hist_.clear(); }
  Tensor step(const Tensor& x, double t, double s, const StepContext& c) override {
    auto d1 = denoise_at(c.denoiser, x, t).x0;
    Tensor d;
    if (hist_.size() < 3) {
      const double m = 0.5 * (t + s);
      auto d2 = denoise_at(c.denoiser, transfer(c, x, d1, t, m), m).x0;
      auto d3 = denoise_at(c.denoiser, transfer(c, x, d2, t, m), m).x0;
      auto d4 = denoise_at(c.denoiser, transfer(c, x, d3, t, s), s).x0;
      d = (d1 + 2 * d2 + 2 * d3 + d4) / 6;
    } else {
      d = (55 * d1 - 59 * hist_[0] + 37 * hist_[1] - 9 * hist_[2]) / 24;
    }
    hist_.push_front(d1);
    if (hist_.size() > 3) hist_.pop_back();
    return transfer(c, x, d, t, s);
  }

 private:
  static Tensor transfer(const StepContext& c, const Tensor& x, const Tensor& x0, double t, double s) {
    auto [at_, st] = c.schedule.rates_at(t);
    auto [as, ss] = c.schedule.rates_at(s);
    return as * x0 + (ss / st) * (x - at_ * x0);
  }
  std::string name_;
  std::deque<Tensor> hist_;
};

}  // namespace

Registry<Solver>& solvers() {
  static Registry<Solver>* r = [] {
    auto* r = new Registry<Solver>("solver");
    r->add<DDPMOptions>("ddpm", "DDPM ancestral sampling (Ho et al. 2020)",
                        [](const DDPMOptions& o) { return std::make_shared<DDPM>(o); });
    r->add<DDIMOptions>("ddim", "DDIM (Song et al. 2021)", [](const DDIMOptions& o) {
      DEW_CHECK(o.eta >= 0, "solver ddim.eta: must be >= 0, got ", o.eta);
      return std::make_shared<DDIM>(o.eta);
    });
    r->add<NoOptions>("euler", "Euler on the probability-flow ODE (any schedule)",
                      [](const NoOptions&) { return std::make_shared<Euler>(); });
    r->add<NoOptions>("euler_ancestral", "Euler ancestral (k-diffusion; VE)",
                      [](const NoOptions&) { return std::make_shared<EulerAncestral>(); });
    r->add<HeunOptions>("heun", "Heun 2nd order, EDM algorithm 2 with churn (VE)", [](const HeunOptions& o) {
      DEW_CHECK(o.s_churn >= 0, "solver heun.s_churn: must be >= 0, got ", o.s_churn);
      DEW_CHECK(o.s_noise >= 0, "solver heun.s_noise: must be >= 0, got ", o.s_noise);
      return std::make_shared<Heun>(o);
    });
    r->add<NoOptions>("rk4", "classic Runge-Kutta 4 on dx/dsigma (VE)",
                      [](const NoOptions&) { return std::make_shared<RK4>(); });
    r->add<MultistepOptions>(
        "multistep_dpm", "linear multistep in sigma, orders 1-3 (VE)", [](const MultistepOptions& o) {
          DEW_CHECK(o.order >= 1 && o.order <= 3, "solver multistep_dpm.order: must be 1, 2 or 3, got ", o.order);
          return std::make_shared<MultistepDPM>(o.order);
        });
    r->add<DPMSolverOptions>("dpmsolver++", "DPM-Solver++(2M) (Lu et al. 2022)", [](const DPMSolverOptions& o) {
      return std::make_shared<DPMSolverPP>(o.lower_order_final);
    });
    r->add<NoOptions>("pndm", "PNDM: pseudo-Runge-Kutta warm-up then PLMS (Liu et al. 2022)",
                      [](const NoOptions&) { return std::make_shared<PNDM>("pndm"); });
    r->add<NoOptions>("plms", "alias of pndm", [](const NoOptions&) { return std::make_shared<PNDM>("plms"); });
    return r;
  }();
  return *r;
}

SolverPtr make_solver(const std::string& name, const json& fields) { return solvers().build(name, fields); }

}  // namespace dew::sampling

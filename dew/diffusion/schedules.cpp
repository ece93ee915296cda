#include "dew/diffusion/schedules.h"

#include <cmath>

namespace dew::diffusion {

namespace {

const auto kF64 = at::TensorOptions().dtype(at::kDouble);

Tensor f64(const Tensor& t) { return t.to(at::kDouble); }

Tensor edm_weight(const Tensor& sigma, double sd) {
  // lambda(sigma) = (sigma^2 + sd^2) / (sigma sd)^2
  return (sigma.square() + sd * sd) / (sigma * sd).square();
}

// Discrete schedules: t is an index into a float64 table of alphabar.
class DiscreteSchedule : public Schedule {
 public:
  DiscreteSchedule(std::string name, Tensor alphabar, const DiscreteOptions& o)
      : name_(std::move(name)), alphabar_(std::move(alphabar)), o_(o) {}
  std::string name() const override { return name_; }
  ScheduleKind kind() const override { return ScheduleKind::variance_preserving; }
  Rates rates(const Tensor& t) const override {
    auto idx = f64(t).round().clamp(0, o_.timesteps - 1).to(at::kLong);
    auto ab = alphabar_.index_select(0, idx.flatten()).view(t.sizes());
    return {ab.sqrt(), (1.0 - ab).clamp_min(0).sqrt()};
  }
  Tensor draw_t(int64_t n, at::Generator gen) const override {
    return at::randint(0, o_.timesteps, {n}, gen, at::TensorOptions().dtype(at::kLong)).to(at::kDouble);
  }
  Tensor weight(const Tensor& t) const override {
    // P2: (k + SNR)^-gamma
    return (o_.p2_k + snr(t)).pow(-o_.p2_gamma);
  }
  double t_max() const override { return double(o_.timesteps - 1); }
  bool discrete() const override { return true; }
  const Tensor& alphabar() const { return alphabar_; }

 private:
  std::string name_;
  Tensor alphabar_;
  DiscreteOptions o_;
};

void check_discrete(const DiscreteOptions& o, bool takes_beta_range = false, const char* name = "") {
  DEW_CHECK(o.timesteps >= 2, "schedule.timesteps: must be >= 2, got ", o.timesteps);
  DEW_CHECK(o.beta_end > 0 && o.beta_end <= 1, "schedule.beta_end: must be in (0, 1], got ", o.beta_end);
  DEW_CHECK(o.p2_k >= 0, "schedule.p2_k: must be >= 0, got ", o.p2_k);
  if (o.beta_range) {
    DEW_CHECK(takes_beta_range, "schedule.beta_range: only linear and scaled_linear take a beta range; schedule ", name,
              " got [", o.beta_range->first, ", ", o.beta_range->second, "]");
    auto [b0, b1] = *o.beta_range;
    DEW_CHECK(b0 > 0 && b0 <= b1 && b1 <= 1, "schedule.beta_range: need 0 < beta_start <= beta_end <= 1, got [", b0,
              ", ", b1, "]");
  }
}

Tensor alphabar_from_betas(const Tensor& beta) { return (1.0 - beta).cumprod(0); }

// The discrete schedule from betas, rescaled to zero terminal SNR when asked.
SchedulePtr discrete_from_betas(std::string name, Tensor beta, const DiscreteOptions& o) {
  if (o.rescale_zero_snr) beta = rescale_zero_terminal_snr(beta);
  return std::make_shared<DiscreteSchedule>(std::move(name), alphabar_from_betas(beta), o);
}

class SqrtSchedule : public Schedule {
 public:
  std::string name() const override { return "sqrt"; }
  ScheduleKind kind() const override { return ScheduleKind::variance_preserving; }
  Rates rates(const Tensor& t) const override {
    // alpha^2 = clip((1 - sqrt(t + 1e-4)) / (1 - sqrt(1e-4)), 0, 1)
    auto a2 = ((1.0 - (f64(t) + 1e-4).sqrt()) / (1.0 - std::sqrt(1e-4))).clamp(0, 1);
    return {a2.sqrt(), (1.0 - a2).sqrt()};
  }
  Tensor draw_t(int64_t n, at::Generator gen) const override { return at::rand({n}, gen, kF64); }
};

class CosineContinuousSchedule : public Schedule {
 public:
  std::string name() const override { return "cosine_continuous"; }
  ScheduleKind kind() const override { return ScheduleKind::variance_preserving; }
  Rates rates(const Tensor& t) const override {
    auto a = f64(t) * (M_PI / 2);
    return {a.cos(), a.sin()};
  }
  Tensor draw_t(int64_t n, at::Generator gen) const override { return at::rand({n}, gen, kF64); }
  Tensor weight(const Tensor& t) const override { return 1.0 / (1.0 + snr(t)); }
};

class KarrasVESchedule : public Schedule {
 public:
  explicit KarrasVESchedule(const KarrasOptions& o) : o_(o) {}
  std::string name() const override { return "karras_ve"; }
  ScheduleKind kind() const override { return ScheduleKind::variance_exploding; }
  Rates rates(const Tensor& t) const override {
    const double a = std::pow(o_.sigma_max, 1 / o_.rho), b = std::pow(o_.sigma_min, 1 / o_.rho);
    auto sigma = (a + (1.0 - f64(t)) * (b - a)).pow(o_.rho);
    return {at::ones_like(sigma), sigma};
  }
  Tensor t_of_sigma(const Tensor& sigma) const override {
    const double a = std::pow(o_.sigma_max, 1 / o_.rho), b = std::pow(o_.sigma_min, 1 / o_.rho);
    return 1.0 - (f64(sigma).pow(1 / o_.rho) - a) / (b - a);
  }
  Tensor draw_t(int64_t n, at::Generator gen) const override { return at::rand({n}, gen, kF64); }
  Tensor weight(const Tensor& t) const override { return edm_weight(rates(t).sigma, o_.sigma_data); }
  Tensor model_time(const Tensor& t) const override { return (rates(t).sigma.log() / 4).to(at::kFloat); }

 private:
  KarrasOptions o_;
};

class EDMSchedule : public Schedule {
 public:
  explicit EDMSchedule(const EDMOptions& o) : o_(o) {
    p_mean_ = o.p_mean ? *o.p_mean : (o.regime == "pixel" ? -1.2 : -0.4);
    p_std_ = o.p_std ? *o.p_std : (o.regime == "pixel" ? 1.2 : 1.0);
  }
  std::string name() const override { return "edm"; }
  ScheduleKind kind() const override { return ScheduleKind::variance_exploding; }
  Rates rates(const Tensor& t) const override {  // t is sigma
    auto sigma = f64(t);
    return {at::ones_like(sigma), sigma};
  }
  Tensor t_of_sigma(const Tensor& sigma) const override { return f64(sigma); }
  Tensor draw_t(int64_t n, at::Generator gen) const override {
    return (p_mean_ + p_std_ * at::randn({n}, gen, kF64)).exp();
  }
  Tensor weight(const Tensor& t) const override { return edm_weight(f64(t), o_.sigma_data); }
  Tensor model_time(const Tensor& t) const override { return (f64(t).log() / 4).to(at::kFloat); }
  double t_max() const override { return o_.sigma_max; }
  double t_min() const override { return o_.sigma_min; }

 private:
  EDMOptions o_;
  double p_mean_, p_std_;
};

class FlowSchedule : public Schedule {
 public:
  explicit FlowSchedule(const FlowOptions& o) : o_(o) {}
  std::string name() const override { return "flow"; }
  ScheduleKind kind() const override { return ScheduleKind::flow; }
  Tensor shifted(const Tensor& t) const {
    auto x = f64(t);
    return o_.shift * x / (1.0 + (o_.shift - 1.0) * x);
  }
  Rates rates(const Tensor& t) const override {
    auto ts = shifted(t);
    return {1.0 - ts, ts};
  }
  Tensor draw_t(int64_t n, at::Generator gen) const override {
    if (o_.density == "logit_normal") return at::sigmoid(o_.m + o_.s * at::randn({n}, gen, kF64));
    auto u = at::rand({n}, gen, kF64);
    if (o_.density == "mode") return 1.0 - u - o_.mode_scale * ((u * (M_PI / 2)).cos().square() - 1.0 + u);
    if (o_.density == "cosmap") return 1.0 - 1.0 / ((u * (M_PI / 2)).tan() + 1.0);
    return u;
  }
  Tensor model_time(const Tensor& t) const override { return (1000.0 * shifted(t)).to(at::kFloat); }

 private:
  FlowOptions o_;
};

}  // namespace

const char* kind_name(ScheduleKind k) {
  switch (k) {
    case ScheduleKind::variance_preserving: return "variance-preserving";
    case ScheduleKind::variance_exploding: return "variance-exploding";
    case ScheduleKind::flow: return "flow";
    default: return "other";
  }
}

Tensor Schedule::weight(const Tensor& t) const { return at::ones(t.sizes(), kF64); }
Tensor Schedule::model_time(const Tensor& t) const { return t.to(at::kFloat); }
Tensor Schedule::t_of_sigma(const Tensor&) const {
  fail("schedule ", name(), " has no t_of_sigma: only variance-exploding schedules (karras_ve, edm) do");
}

Tensor Schedule::grid(int64_t n) const {
  DEW_CHECK(n >= 1, "steps: must be >= 1, got ", n);
  auto g = n == 1 ? at::full({1}, t_max(), kF64) : at::linspace(t_max(), t_min(), n, kF64);
  return discrete() ? g.round() : g;
}

std::pair<double, double> Schedule::rates_at(double t) const {
  auto r = rates(at::full({1}, t, kF64));
  return {r.alpha.item<double>(), r.sigma.item<double>()};
}

double Schedule::prior_std() const {
  auto [a, s] = rates_at(t_max());
  return std::sqrt(a * a + s * s);
}

Tensor Schedule::snr(const Tensor& t) const {
  auto r = rates(t);
  return (r.alpha / r.sigma).square();
}

SchedulePtr make_linear(const DiscreteOptions& o) {
  check_discrete(o, true, "linear");
  const double s = 1000.0 / o.timesteps;
  auto [b0, b1] = o.beta_range.value_or(std::pair<double, double>{s * 1e-4, s * 0.02});
  return discrete_from_betas("linear", at::linspace(b0, b1, o.timesteps, kF64), o);
}

SchedulePtr make_scaled_linear(const DiscreteOptions& o) {
  check_discrete(o, true, "scaled_linear");
  auto [b0, b1] = o.beta_range.value_or(std::pair<double, double>{0.00085, 0.012});
  return discrete_from_betas("scaled_linear", at::linspace(std::sqrt(b0), std::sqrt(b1), o.timesteps, kF64).square(),
                             o);
}

SchedulePtr make_cosine(const DiscreteOptions& o) {
  check_discrete(o, false, "cosine");
  auto f = [](const Tensor& u) { return ((u + 0.008) / 1.008 * (M_PI / 2)).cos().square(); };
  auto i = at::arange(o.timesteps, kF64);
  auto beta = (1.0 - f((i + 1) / o.timesteps) / f(i / o.timesteps)).clamp_max(o.beta_end);
  return discrete_from_betas("cosine", beta, o);
}

SchedulePtr make_exp(const DiscreteOptions& o) {
  check_discrete(o, false, "exp");
  auto i = at::arange(o.timesteps, kF64);
  auto abar = [](const Tensor& u) { return (-12.0 * u).exp(); };
  auto beta = (1.0 - abar((i + 1) / o.timesteps) / abar(i / o.timesteps)).clamp_max(0.999);
  return discrete_from_betas("exp", beta, o);
}

SchedulePtr make_discrete_from_betas(const std::string& name, const Tensor& betas, const DiscreteOptions& o) {
  check_discrete(o, false, name.c_str());
  DEW_CHECK(betas.dim() == 1 && betas.size(0) == o.timesteps, "schedule ", name, ": ", o.timesteps,
            " betas expected (timesteps), got shape ", betas.sizes());
  auto b = betas.to(at::kDouble);
  DEW_CHECK(b.gt(0).all().item<bool>() && b.le(1).all().item<bool>(), "schedule ", name,
            ": betas must lie in (0, 1], got min ", b.min().item<double>(), ", max ", b.max().item<double>());
  return discrete_from_betas(name, b, o);
}

SchedulePtr make_sqrt() { return std::make_shared<SqrtSchedule>(); }
SchedulePtr make_cosine_continuous() { return std::make_shared<CosineContinuousSchedule>(); }

SchedulePtr make_karras_ve(const KarrasOptions& o) {
  DEW_CHECK(o.sigma_min > 0, "schedule.sigma_min: must be > 0, got ", o.sigma_min);
  DEW_CHECK(o.sigma_max > o.sigma_min, "schedule.sigma_max: must exceed sigma_min ", o.sigma_min, ", got ",
            o.sigma_max);
  DEW_CHECK(o.rho > 0, "schedule.rho: must be > 0, got ", o.rho);
  DEW_CHECK(o.sigma_data > 0, "schedule.sigma_data: must be > 0, got ", o.sigma_data);
  return std::make_shared<KarrasVESchedule>(o);
}

SchedulePtr make_edm(const EDMOptions& o) {
  DEW_CHECK(!o.p_std || *o.p_std > 0, "schedule.p_std: must be > 0, got ", o.p_std.value_or(0));
  DEW_CHECK(o.sigma_min > 0 && o.sigma_max > o.sigma_min, "schedule.sigma_min/sigma_max: need 0 < min < max, got ",
            o.sigma_min, ", ", o.sigma_max);
  DEW_CHECK(o.sigma_data > 0, "schedule.sigma_data: must be > 0, got ", o.sigma_data);
  return std::make_shared<EDMSchedule>(o);
}

SchedulePtr make_flow(const FlowOptions& o) {
  DEW_CHECK(o.shift > 0, "schedule.shift: must be > 0, got ", o.shift);
  DEW_CHECK(o.s > 0, "schedule.s: must be > 0, got ", o.s);
  return std::make_shared<FlowSchedule>(o);
}

Tensor alphas_cumprod(const Schedule& s) {
  auto d = dynamic_cast<const DiscreteSchedule*>(&s);
  DEW_CHECK(d, "alphas_cumprod: schedule ", s.name(), " is not discrete (linear, scaled_linear, cosine, exp)");
  return d->alphabar();
}

Tensor rescale_zero_terminal_snr(const Tensor& betas) {
  auto abar_sqrt = alphabar_from_betas(betas.to(at::kDouble)).sqrt();
  const double first = abar_sqrt[0].item<double>(), last = abar_sqrt[-1].item<double>();
  DEW_CHECK(first > last, "rescale_zero_snr: sqrt(alphabar) must decrease, got first ", first, ", last ", last);
  abar_sqrt = (abar_sqrt - last) * (first / (first - last));
  auto abar = abar_sqrt.square();
  // Undo the cumprod: alpha_0 = alphabar_0, alpha_i = alphabar_i / alphabar_{i-1}.
  auto alphas = at::cat({abar.slice(0, 0, 1), abar.slice(0, 1) / abar.slice(0, 0, -1)});
  return 1.0 - alphas;
}

double flow_resolution_shift(int64_t height, int64_t width) {
  const double tokens = double(height / 16) * double(width / 16);
  const double mu = 0.5 + (1.15 - 0.5) / (4096.0 - 256.0) * (tokens - 256.0);
  return std::exp(mu);
}

Tensor bcast(const Tensor& v, const Tensor& x) {
  std::vector<int64_t> shape(x.dim(), 1);
  shape[0] = v.numel() == 1 ? 1 : x.size(0);
  return v.reshape(shape).to(x.scalar_type());
}

Registry<Schedule>& schedules() {
  static Registry<Schedule>* r = [] {
    auto* r = new Registry<Schedule>("schedule");
    auto tag = [](SchedulePtr s, const std::string& name, const json& fields) {
      json spec = fields;
      spec["name"] = name;
      s->set_spec(spec);
      return s;
    };
    r->add<DiscreteOptions>("linear", "DDPM linear betas linspace(1e-4 s, 0.02 s, T), s = 1000/T, or beta_range",
                            [=](const DiscreteOptions& o) { return tag(make_linear(o), "linear", to_json(o)); });
    r->add<DiscreteOptions>(
        "scaled_linear", "Stable Diffusion betas linspace(sqrt(0.00085), sqrt(0.012), T)^2 (diffusers scaled_linear)",
        [=](const DiscreteOptions& o) { return tag(make_scaled_linear(o), "scaled_linear", to_json(o)); });
    r->add<DiscreteOptions>("cosine", "improved-DDPM cosine alphabar, betas clipped at beta_end",
                            [=](const DiscreteOptions& o) { return tag(make_cosine(o), "cosine", to_json(o)); });
    r->add<DiscreteOptions>("exp", "alphabar(u) = exp(-12 u), betas clipped at 0.999",
                            [=](const DiscreteOptions& o) { return tag(make_exp(o), "exp", to_json(o)); });
    r->add<NoOptions>("sqrt", "Diffusion-LM sqrt schedule alpha^2 = 1 - sqrt(t + 1e-4) (rescaled)",
                      [=](const NoOptions&) { return tag(make_sqrt(), "sqrt", json::object()); });
    r->add<NoOptions>(
        "cosine_continuous", "alpha = cos(pi t/2), sigma = sin(pi t/2), weight 1/(1 + SNR)",
        [=](const NoOptions&) { return tag(make_cosine_continuous(), "cosine_continuous", json::object()); });
    r->add<KarrasOptions>("karras_ve", "Karras VE: alpha = 1, sigma on the rho-grid, EDM weight",
                          [=](const KarrasOptions& o) { return tag(make_karras_ve(o), "karras_ve", to_json(o)); });
    r->add<EDMOptions>("edm", "EDM training: log-normal sigma, alpha = 1, t = sigma",
                       [=](const EDMOptions& o) { return tag(make_edm(o), "edm", to_json(o)); });
    r->add<FlowOptions>("flow", "rectified flow: alpha = 1 - t', sigma = t', shifted time t'",
                        [=](const FlowOptions& o) { return tag(make_flow(o), "flow", to_json(o)); });
    return r;
  }();
  return *r;
}

}  // namespace dew::diffusion

#include "dew/sampling/schedulers.h"

#include <algorithm>
#include <cmath>
#include <deque>
#include <limits>

#include "dew/sampling/scheduler_config.h"

namespace dew::sampling {

using at::Tensor;
using Vec = std::vector<double>;

namespace {

using detail::ConfigBase;
using detail::ConfigReader;
using detail::parse_base;

const auto kF64 = at::TensorOptions().dtype(at::kDouble);

Tensor f64(const Tensor& t) { return t.to(at::kDouble); }
Tensor to_tensor(const Vec& v) { return at::tensor(at::ArrayRef<double>(v), kF64); }

// ---- numpy's and torch's grids, reproduced exactly on float64 vectors ----

// np.linspace(a, b, n): a + i (b - a)/(n - 1), the last value set to b.
Vec np_linspace(double a, double b, int64_t n) {
  Vec y(n, a);
  if (n == 1) return y;
  const double step = (b - a) / double(n - 1);
  for (int64_t i = 0; i < n; ++i) y[i] = double(i) * step + a;
  y[n - 1] = b;
  return y;
}

// torch.linspace(a, b, n): the first half counts up from a, the second down from b.
Vec torch_linspace(double a, double b, int64_t n) {
  Vec y(n, a);
  if (n == 1) return y;
  const double step = (b - a) / double(n - 1);
  const int64_t half = n / 2;
  for (int64_t i = 0; i < n; ++i) y[i] = i < half ? a + step * double(i) : b - step * double(n - 1 - i);
  return y;
}

// np.arange(start, stop, step) for floats: ceil((stop - start)/step) values start + i delta.
Vec np_arange(double start, double stop, double step) {
  const auto n = int64_t(std::ceil((stop - start) / step));
  Vec y;
  const double delta = (start + step) - start;
  for (int64_t i = 0; i < n; ++i) y.push_back(start + double(i) * delta);
  return y;
}

// np.round: half to even.
Vec np_round(Vec v) {
  for (auto& x : v) x = std::nearbyint(x);
  return v;
}

// np.interp(x, arange(len(fp)), fp).
Vec interp_index(const Vec& x, const Vec& fp) {
  Vec y;
  const auto n = int64_t(fp.size());
  for (double v : x) {
    if (v <= 0) {
      y.push_back(fp[0]);
      continue;
    }
    if (v >= double(n - 1)) {
      y.push_back(fp[n - 1]);
      continue;
    }
    const auto j = int64_t(std::floor(v));
    y.push_back((fp[j + 1] - fp[j]) * (v - double(j)) + fp[j]);  // slope over a unit step
  }
  return y;
}

// The time of a sigma: linear interpolation of log(sigma) in the training table (diffusers _sigma_to_t).
double sigma_to_t(double sigma, const Vec& log_sigmas) {
  const double ls = std::log(std::max(sigma, 1e-10));
  const auto n = int64_t(log_sigmas.size());
  int64_t count = 0, best = -1, low = 0;  // argmax of cumsum(ls >= log_sigmas): its first maximum
  for (int64_t j = 0; j < n; ++j) {
    count += (ls - log_sigmas[j] >= 0);
    if (count > best) best = count, low = j;
  }
  low = std::min(low, n - 2);
  const double lo = log_sigmas[low], hi = log_sigmas[low + 1];
  const double w = std::clamp((lo - ls) / (lo - hi), 0.0, 1.0);
  return (1 - w) * double(low) + w * double(low + 1);
}

// Karras et al. 2022's rho = 7 grid from sigma_max to sigma_min in n points.
Vec karras_sigmas(double sigma_min, double sigma_max, int64_t n) {
  const double rho = 7.0, lo = std::pow(sigma_min, 1 / rho), hi = std::pow(sigma_max, 1 / rho);
  Vec out;
  for (double r : np_linspace(0, 1, n)) out.push_back(std::pow(hi + r * (lo - hi), rho));
  return out;
}

// Descending inference timesteps of DDIM, Euler, Euler ancestral and LMS (round_linspace: DDIM rounds).
Vec spaced_timesteps(const std::string& spacing, int64_t T, int64_t n, int64_t offset, bool round_linspace) {
  Vec ts;
  if (spacing == "linspace") {
    ts = np_linspace(0, double(T - 1), n);
    if (round_linspace) ts = np_round(ts);
    std::reverse(ts.begin(), ts.end());
  } else if (spacing == "leading") {
    const int64_t ratio = T / n;
    for (int64_t i = n - 1; i >= 0; --i) ts.push_back(double(i * ratio + offset));
  } else {  // trailing
    ts = np_round(np_arange(double(T), 0, -double(T) / double(n)));
    for (auto& t : ts) t -= 1;
  }
  return ts;
}

void check_steps(const std::string& cls, int64_t n, int64_t T) {
  DEW_CHECK(n >= 1 && n <= T, cls, ".set_timesteps: the number of steps must be in [1, num_train_timesteps = ", T,
            "], got ", n);
}

// x0 from the model output at sigma (sigma = sqrt((1 - abar)/abar); the model saw x/sqrt(sigma^2 + 1)).
Tensor x0_from_sigma(const std::string& pred, const Tensor& out, const Tensor& x, double sigma) {
  if (pred == "epsilon") return x - sigma * out;
  if (pred == "v_prediction") return out * (-sigma / std::sqrt(sigma * sigma + 1)) + x / (sigma * sigma + 1);
  return out;  // sample
}

// ---- the classes ----

/// What every class shares: the parsed betas, prediction type and spacing, moved into the Scheduler.
class Common : public Scheduler {
 protected:
  Common(const ConfigReader& r, ConfigBase b) : b_(std::move(b)) {
    class_name_ = r.cls();
    where_ = r.where();
    prediction_type_ = b_.prediction;
    schedule_ = b_.schedule;
    alphas_cumprod_ = to_tensor(b_.ac);
  }
  ConfigBase b_;
};

/// DDIM (Song et al. 2021): x_prev = sqrt(abar_prev) x0 + sqrt(1 - abar_prev - std^2) eps + std z.
class DDIMScheduler : public Common {
 public:
  explicit DDIMScheduler(const ConfigReader& r)
      : Common(r, parse_base(r, {"epsilon", "v_prediction", "sample"}, "leading", true, false)) {
    r.require_flag("thresholding", false, false, " (dynamic thresholding is not supported)");
    clip_ = r.flag("clip_sample", true);
    clip_range_ = r.number("clip_sample_range", 1.0);
    final_ac_ = r.flag("set_alpha_to_one", true) ? 1.0 : b_.ac[0];
  }
  void set_timesteps(int64_t n) override {
    check_steps(class_name_, n, b_.T);
    auto ts = spaced_timesteps(b_.spacing, b_.T, n, b_.offset, true);
    for (double t : ts) {
      DEW_CHECK(t >= 0 && t <= double(b_.T - 1), where_, ": timestep ", t, " (steps_offset ", b_.offset, ", ", n,
                " steps) is outside [0, ", b_.T - 1, "]");
      // An epsilon prediction divides by sqrt(abar), 0 at the last train step under zero terminal SNR: diffusers
      // runs on inf / NaN there. (Betas are > 0, so abar < 1 and the other divisions are safe.)
      const double a = b_.ac[size_t(t)];
      DEW_CHECK(prediction_type_ != "epsilon" || a > 0, where_, ": timestep ", t, " has alphas_cumprod 0 ",
                "(rescale_betas_zero_snr, or betas whose product underflows), where an epsilon prediction gives no ",
                "sample (diffusers divides by zero); accepted: prediction_type v_prediction or sample, or a ",
                "timestep_spacing that skips that step");
    }
    timesteps_ = to_tensor(ts);
    ts_ = ts;
    n_ = n;
  }
  void set_eta(double eta) override {
    DEW_CHECK(eta >= 0, class_name_, ": eta must be >= 0, got ", eta);
    eta_ = eta;
  }
  Tensor step(const Tensor& out, int64_t i, const Tensor& x_in, const NoiseSource& noise) override {
    check_index(i);
    const auto t = int64_t(ts_[i]), prev = t - b_.T / n_;
    const double a = b_.ac[t], ap = prev >= 0 ? b_.ac[prev] : final_ac_;
    auto x = f64(x_in), m = f64(out);
    Tensor x0, eps;
    if (prediction_type_ == "epsilon") {
      x0 = (x - std::sqrt(1 - a) * m) / std::sqrt(a);
      eps = m;
    } else if (prediction_type_ == "sample") {
      x0 = m;
      eps = (x - std::sqrt(a) * x0) / std::sqrt(1 - a);
    } else {
      x0 = std::sqrt(a) * x - std::sqrt(1 - a) * m;
      eps = std::sqrt(a) * m + std::sqrt(1 - a) * x;
    }
    if (clip_) x0 = x0.clamp(-clip_range_, clip_range_);
    const double variance = (1 - ap) / (1 - a) * (1 - a / ap);
    const double sd = eta_ * std::sqrt(variance);
    auto x_prev = std::sqrt(ap) * x0 + std::sqrt(std::max(0.0, 1 - ap - sd * sd)) * eps;
    if (eta_ > 0) x_prev = x_prev + sd * f64(noise(i, x_in));
    return x_prev.to(x_in.scalar_type());
  }

 private:
  bool clip_ = true;
  double clip_range_ = 1, final_ac_ = 1, eta_ = 0;
  Vec ts_;
  int64_t n_ = 0;
};

/// PNDM (Liu et al. 2022): pseudo Runge-Kutta warm-up (unless skip_prk_steps), then linear multistep
/// (55, -59, 37, -9)/24 on the model outputs, moved with the pseudo numerical transfer of the paper.
class PNDMScheduler : public Common {
 public:
  explicit PNDMScheduler(const ConfigReader& r)
      : Common(r, parse_base(r, {"epsilon", "v_prediction"}, "leading", false, false)) {
    skip_prk_ = r.flag("skip_prk_steps", false);
    final_ac_ = r.flag("set_alpha_to_one", false) ? 1.0 : b_.ac[0];
  }
  void set_timesteps(int64_t n) override {
    check_steps(class_name_, n, b_.T);
    DEW_CHECK(skip_prk_ || n >= 4, where_, ": skip_prk_steps false needs at least 4 steps, got ", n);
    Vec base;  // ascending
    if (b_.spacing == "linspace") {
      base = np_round(np_linspace(0, double(b_.T - 1), n));
    } else if (b_.spacing == "leading") {
      for (int64_t i = 0; i < n; ++i) base.push_back(double(i * (b_.T / n) + b_.offset));
    } else {
      base = np_round(np_arange(double(b_.T), 0, -double(b_.T) / double(n)));
      std::reverse(base.begin(), base.end());
      for (auto& t : base) t -= 1;
    }
    prk_.clear();
    Vec plms;
    const auto m = int64_t(base.size());
    if (skip_prk_) {
      // base[:-1] + base[-2:-1] + base[-1:], reversed: the second timestep is taken twice.
      for (int64_t j = 0; j < m - 1; ++j) plms.push_back(base[j]);
      if (m >= 2) plms.push_back(base[m - 2]);
      plms.push_back(base[m - 1]);
      std::reverse(plms.begin(), plms.end());
    } else {
      const int64_t half = b_.T / n / 2;
      Vec p;  // base[-4:].repeat(2) + tile([0, half], 4), minus its last, each repeated twice, ends dropped
      for (int64_t j = m - 4; j < m; ++j) p.push_back(base[j]), p.push_back(base[j] + double(half));
      p.pop_back();
      Vec rep;
      for (double v : p) rep.push_back(v), rep.push_back(v);
      prk_.assign(rep.begin() + 1, rep.end() - 1);
      std::reverse(prk_.begin(), prk_.end());
      for (int64_t j = m - 4; j >= 0; --j) plms.push_back(base[j]);
    }
    Vec all = prk_;
    all.insert(all.end(), plms.begin(), plms.end());
    for (double t : all)
      DEW_CHECK(t >= 0 && t <= double(b_.T - 1), where_, ": timestep ", t, " (steps_offset ", b_.offset, ", ", n,
                " steps) is outside [0, ", b_.T - 1, "]");
    ts_ = all;
    timesteps_ = to_tensor(all);
    n_ = n;
    counter_ = 0;
    ets_.clear();
    cur_model_output_.reset();
    cur_sample_.reset();
  }
  Tensor step(const Tensor& out, int64_t i, const Tensor& x_in, const NoiseSource&) override {
    check_index(i);
    DEW_CHECK(i == counter_, class_name_, ".step: steps must run in order after set_timesteps; expected step ",
              counter_, ", got ", i);
    const auto t = int64_t(ts_[i]);
    auto m = f64(out), x = f64(x_in);
    Tensor result = (counter_ < int64_t(prk_.size()) && !skip_prk_) ? step_prk(m, t, x) : step_plms(m, t, x);
    ++counter_;
    return result.to(x_in.scalar_type());
  }

 private:
  Tensor step_prk(Tensor m, int64_t timestep, const Tensor& x) {
    const int64_t diff = counter_ % 2 ? 0 : b_.T / n_ / 2;
    const int64_t prev = timestep - diff;
    const auto t = int64_t(prk_[counter_ / 4 * 4]);
    const int64_t phase = counter_ % 4;
    auto add = [&](double w) { cur_model_output_ = cur_model_output_ ? *cur_model_output_ + w * m : w * m; };
    if (phase == 0) {
      add(1.0 / 6);
      ets_.push_back(m);
      cur_sample_ = x;
    } else if (phase == 1 || phase == 2) {
      add(1.0 / 3);
    } else {
      m = (cur_model_output_ ? *cur_model_output_ : at::zeros_like(m)) + (1.0 / 6) * m;
      cur_model_output_.reset();
    }
    const Tensor& from = cur_sample_ ? *cur_sample_ : x;
    return prev_sample(from, t, prev, m);
  }
  Tensor step_plms(Tensor m, int64_t timestep, Tensor x) {
    DEW_CHECK(skip_prk_ || ets_.size() >= 3, class_name_,
              ": the PLMS steps need the 12 pseudo Runge-Kutta steps first");
    int64_t prev = timestep - b_.T / n_;
    if (counter_ != 1) {
      while (ets_.size() > 3) ets_.pop_front();
      ets_.push_back(m);
    } else {
      prev = timestep;
      timestep = timestep + b_.T / n_;
    }
    const auto k = ets_.size();
    if (k == 1 && counter_ == 0) {
      cur_sample_ = x;
    } else if (k == 1 && counter_ == 1) {
      m = (m + ets_.back()) / 2;
      x = *cur_sample_;
      cur_sample_.reset();
    } else if (k == 2) {
      m = (3 * ets_[1] - ets_[0]) / 2;
    } else if (k == 3) {
      m = (23 * ets_[2] - 16 * ets_[1] + 5 * ets_[0]) / 12;
    } else {
      m = (55 * ets_[3] - 59 * ets_[2] + 37 * ets_[1] - 9 * ets_[0]) / 24;
    }
    return prev_sample(x, timestep, prev, m);
  }
  // Formula (9) of the PNDM paper: x_prev from x_t and an eps estimate.
  Tensor prev_sample(const Tensor& x, int64_t t, int64_t prev, Tensor m) const {
    const double a = b_.ac[t], ap = prev >= 0 ? b_.ac[prev] : final_ac_;
    if (prediction_type_ == "v_prediction") m = std::sqrt(a) * m + std::sqrt(1 - a) * x;
    const double denom = a * std::sqrt(1 - ap) + std::sqrt(a * (1 - a) * ap);
    return std::sqrt(ap / a) * x - ((ap - a) / denom) * m;
  }
  bool skip_prk_ = false;
  double final_ac_ = 1;
  Vec ts_, prk_;
  int64_t n_ = 0, counter_ = 0;
  std::deque<Tensor> ets_;  // oldest first
  std::optional<Tensor> cur_model_output_, cur_sample_;
};

/// The k-diffusion family: a descending sigma grid (sigma = sqrt((1 - abar)/abar)) ending at 0, the model
/// input x/sqrt(sigma^2 + 1) and initial noise sigma_max (or sqrt(sigma_max^2 + 1) for leading spacing).
class SigmaScheduler : public Common {
 public:
  using Common::Common;
  Tensor scale_model_input(const Tensor& x, int64_t i) const override {
    check_index(i);
    return x / std::sqrt(sigmas_[i] * sigmas_[i] + 1);
  }

 protected:
  Vec train_sigmas() const {
    Vec s;
    for (double a : b_.ac) s.push_back(std::sqrt((1 - a) / a));
    return s;
  }
  static Vec logs(const Vec& v) {
    Vec out;
    for (double x : v) out.push_back(std::log(x));
    return out;
  }
  void finish(const Vec& ts, Vec sigmas) {
    // A schedule whose alphas_cumprod underflow to 0 (large betas over many train steps) has an infinite sigma,
    // which diffusers runs on (inf / NaN samples). One whose alphas_cumprod are merely tiny (1e-254) has finite
    // sigmas whose products in the steps overflow (Euler ancestral's sigma_up is about sigma^4: inf, then NaN), and
    // float32 samples could not hold noise of that scale anyway: a sigma must be a float32 number.
    for (size_t j = 0; j < sigmas.size(); ++j)
      DEW_CHECK(std::isfinite(sigmas[j]) && sigmas[j] <= double(std::numeric_limits<float>::max()), where_, ": sigma ",
                j, " of these ", ts.size(), " steps is ", sigmas[j],
                ": the training schedule's alphas_cumprod reach 0 or nearly (beta_start, beta_end and "
                "num_train_timesteps make sigma = sqrt((1 - abar) / abar) infinite, as in diffusers, or beyond "
                "float32); accepted: betas whose product stays well above 0 (a smaller beta_end or fewer "
                "num_train_timesteps), or rescale_betas_zero_snr");
    timesteps_ = to_tensor(ts);
    sigmas_ = std::move(sigmas);
    const double smax = *std::max_element(sigmas_.begin(), sigmas_.end());
    init_noise_sigma_ = b_.spacing == "leading" ? std::sqrt(smax * smax + 1) : smax;
    steps_taken_ = 0;
  }
  void check_order(int64_t i) {
    DEW_CHECK(i == steps_taken_, class_name_, ".step: steps must run in order after set_timesteps; expected step ",
              steps_taken_, ", got ", i);
    ++steps_taken_;
  }
  Vec sigmas_;  // [num_steps + 1] (more for Euler's log_linear)
  int64_t steps_taken_ = 0;
};

/// Euler (Karras et al. 2022, algorithm 2 without churn): x + (x - x0)/sigma (sigma_next - sigma).
class EulerDiscreteScheduler : public SigmaScheduler {
 public:
  explicit EulerDiscreteScheduler(const ConfigReader& r)
      : SigmaScheduler(r, parse_base(r, {"epsilon", "v_prediction", "sample"}, "linspace", true, true)) {
    interpolation_ = r.choice("interpolation_type", "linear", {"linear", "log_linear"});
    karras_ = r.flag("use_karras_sigmas", false);
    r.require_flag("use_exponential_sigmas", false, false, " (use_karras_sigmas is supported)");
    r.require_flag("use_beta_sigmas", false, false, " (use_karras_sigmas is supported)");
    sigma_min_ = r.optional_number("sigma_min");
    sigma_max_ = r.optional_number("sigma_max");
    continuous_ = r.choice("timestep_type", "discrete", {"discrete", "continuous"}) == "continuous";
    final_ = r.choice("final_sigmas_type", "zero", {"zero", "sigma_min"});
  }
  void set_timesteps(int64_t n) override {
    check_steps(class_name_, n, b_.T);
    auto ts = spaced_timesteps(b_.spacing, b_.T, n, b_.offset, false);
    const auto train = train_sigmas();
    const auto log_train = logs(train);
    Vec sig;
    if (interpolation_ == "linear") {
      sig = interp_index(ts, train);
    } else {
      for (double l : torch_linspace(std::log(train.back()), std::log(train.front()), n + 1))
        sig.push_back(std::exp(l));
    }
    if (karras_) {
      sig = karras_sigmas(sigma_min_.value_or(sig.back()), sigma_max_.value_or(sig.front()), n);
      ts.clear();
      for (double s : sig) ts.push_back(sigma_to_t(s, log_train));
    }
    sig.push_back(final_ == "zero" ? 0.0 : train.front());
    if (continuous_ && b_.prediction == "v_prediction") {
      ts.clear();
      for (size_t j = 0; j + 1 < sig.size(); ++j) ts.push_back(0.25 * std::log(sig[j]));
    }
    finish(ts, sig);
  }
  Tensor step(const Tensor& out, int64_t i, const Tensor& x_in, const NoiseSource&) override {
    check_index(i);
    const double s = sigmas_[i], s_next = sigmas_[i + 1];
    auto x = f64(x_in);
    auto x0 = x0_from_sigma(prediction_type_, f64(out), x, s);
    return (x + (x - x0) / s * (s_next - s)).to(x_in.scalar_type());
  }

 private:
  std::string interpolation_, final_;
  bool karras_ = false, continuous_ = false;
  std::optional<double> sigma_min_, sigma_max_;
};

/// Euler ancestral (k-diffusion): Euler to sigma_down, then noise of std sigma_up.
class EulerAncestralDiscreteScheduler : public SigmaScheduler {
 public:
  explicit EulerAncestralDiscreteScheduler(const ConfigReader& r)
      : SigmaScheduler(r, parse_base(r, {"epsilon", "v_prediction"}, "linspace", true, true)) {}
  void set_timesteps(int64_t n) override {
    check_steps(class_name_, n, b_.T);
    auto ts = spaced_timesteps(b_.spacing, b_.T, n, b_.offset, false);
    auto sig = interp_index(ts, train_sigmas());
    sig.push_back(0.0);
    finish(ts, sig);
  }
  Tensor step(const Tensor& out, int64_t i, const Tensor& x_in, const NoiseSource& noise) override {
    check_index(i);
    const double s = sigmas_[i], s_next = sigmas_[i + 1];
    const double up = std::sqrt(std::max(0.0, s_next * s_next * (s * s - s_next * s_next) / (s * s)));
    const double down = std::sqrt(std::max(0.0, s_next * s_next - up * up));
    auto x = f64(x_in);
    auto x0 = x0_from_sigma(prediction_type_, f64(out), x, s);
    auto x_next = x + (x - x0) / s * (down - s);
    if (up > 0) x_next = x_next + up * f64(noise(i, x_in));
    return x_next.to(x_in.scalar_type());
  }
};

/// Linear multistep (k-diffusion's sample_lms, order 4): integrates the Lagrange polynomial through the
/// last derivatives (x - x0)/sigma over [sigma_i, sigma_{i+1}].
class LMS : public SigmaScheduler {
 public:
  explicit LMS(const ConfigReader& r)
      : SigmaScheduler(r, parse_base(r, {"epsilon", "v_prediction", "sample"}, "linspace", false, false)) {
    karras_ = r.flag("use_karras_sigmas", false);
    r.require_flag("use_exponential_sigmas", false, false, " (use_karras_sigmas is supported)");
    r.require_flag("use_beta_sigmas", false, false, " (use_karras_sigmas is supported)");
  }
  void set_timesteps(int64_t n) override {
    check_steps(class_name_, n, b_.T);
    auto ts = spaced_timesteps(b_.spacing, b_.T, n, b_.offset, false);
    const auto train = train_sigmas();
    auto sig = interp_index(ts, train);
    if (karras_) {
      sig = karras_sigmas(sig.back(), sig.front(), n);
      ts.clear();
      const auto log_train = logs(train);
      for (double s : sig) ts.push_back(sigma_to_t(s, log_train));
    }
    sig.push_back(0.0);
    finish(ts, sig);
    derivatives_.clear();
  }
  Tensor step(const Tensor& out, int64_t i, const Tensor& x_in, const NoiseSource&) override {
    check_index(i);
    check_order(i);
    const double s = sigmas_[i];
    auto x = f64(x_in);
    auto x0 = x0_from_sigma(prediction_type_, f64(out), x, s);
    derivatives_.push_back((x - x0) / s);
    if (derivatives_.size() > 4) derivatives_.pop_front();
    const auto order = std::min<int64_t>(i + 1, 4);
    Tensor x_next = x;
    for (int64_t j = 0; j < order; ++j)  // derivatives_ newest last; coefficient j goes with the j-th newest
      x_next = x_next + coefficient(order, i, j) * derivatives_[derivatives_.size() - 1 - j];
    return x_next.to(x_in.scalar_type());
  }

 private:
  // Integral over [sigma_i, sigma_{i+1}] of prod_{k != j} (tau - sigma_{i-k})/(sigma_{i-j} - sigma_{i-k});
  // 3-point Gauss-Legendre is exact for these degree <= 3 polynomials.
  double coefficient(int64_t order, int64_t i, int64_t j) const {
    static const double nodes[3] = {-std::sqrt(0.6), 0.0, std::sqrt(0.6)};
    static const double weights[3] = {5.0 / 9, 8.0 / 9, 5.0 / 9};
    const double a = sigmas_[i], b = sigmas_[i + 1];
    double sum = 0;
    for (int q = 0; q < 3; ++q) {
      const double tau = 0.5 * (a + b) + 0.5 * (b - a) * nodes[q];
      double p = 1;
      for (int64_t k = 0; k < order; ++k)
        if (k != j) p *= (tau - sigmas_[i - k]) / (sigmas_[i - j] - sigmas_[i - k]);
      sum += weights[q] * p;
    }
    return 0.5 * (b - a) * sum;
  }
  bool karras_ = false;
  std::deque<Tensor> derivatives_;
};

/// DPM-Solver++ (Lu et al. 2022) multistep, orders 1-3, on data predictions in lambda = log(alpha/sigma);
/// sde-dpmsolver++ adds the SDE noise. With solver_order 2 this is "DPM++ 2M" (with Karras sigmas,
/// "DPM++ 2M Karras").
class DPMSolver : public Common {
 public:
  explicit DPMSolver(const ConfigReader& r)
      : Common(r, parse_base(r, {"epsilon", "v_prediction", "sample"}, "linspace", true, true)) {
    order_ = r.integer("solver_order", 2);
    if (order_ < 1 || order_ > 3) r.bad("solver_order", *r.find("solver_order"), "1, 2 or 3");
    r.require_flag("thresholding", false, false, " (dynamic thresholding is not supported)");
    sde_ = r.choice("algorithm_type", "dpmsolver++", {"dpmsolver++", "sde-dpmsolver++"}) == "sde-dpmsolver++";
    heun_ = r.choice("solver_type", "midpoint", {"midpoint", "heun"}) == "heun";
    lower_order_final_ = r.flag("lower_order_final", true);
    euler_at_final_ = r.flag("euler_at_final", false);
    karras_ = r.flag("use_karras_sigmas", false);
    for (const char* k : {"use_exponential_sigmas", "use_beta_sigmas", "use_lu_lambdas", "use_flow_sigmas"})
      r.require_flag(k, false, false, " (use_karras_sigmas is supported)");
    final_zero_ = r.choice("final_sigmas_type", "zero", {"zero", "sigma_min"}) == "zero";
    lambda_min_clipped_ = r.number("lambda_min_clipped", -std::numeric_limits<double>::infinity());
    if (const json* v = r.find("variance_type"))
      r.bad("variance_type", *v, "null (learned variances are not supported)");
  }
  void set_timesteps(int64_t n) override {
    check_steps(class_name_, n, b_.T);
    // Timesteps whose lambda is below lambda_min_clipped are left out (diffusers: searchsorted on flipped lambda).
    int64_t clipped = 0;
    for (double a : b_.ac) clipped += (0.5 * std::log(a) - 0.5 * std::log(1 - a)) < lambda_min_clipped_;
    const int64_t last = b_.T - clipped;
    Vec ts;
    if (b_.spacing == "linspace") {
      ts = np_round(np_linspace(0, double(last - 1), n + 1));
      std::reverse(ts.begin(), ts.end());
      ts.pop_back();
    } else if (b_.spacing == "leading") {
      const int64_t ratio = last / (n + 1);
      for (int64_t i = n; i >= 1; --i) ts.push_back(double(i * ratio + b_.offset));
    } else {
      ts = np_round(np_arange(double(last), 0, -double(b_.T) / double(n)));
      for (auto& t : ts) t -= 1;
    }
    // diffusers takes these as they come; a repeated timestep (more steps than the train steps' spacing holds)
    // makes a higher-order update divide by a zero log-SNR gap (NaN), one past the table reads outside it.
    for (size_t j = 0; j < ts.size(); ++j) {
      DEW_CHECK(ts[j] >= 0 && ts[j] <= double(b_.T - 1), where_, ": timestep ", ts[j], " (steps_offset ", b_.offset,
                ", ", n, " steps) is outside [0, ", b_.T - 1, "]");
      DEW_CHECK(j == 0 || ts[j] < ts[j - 1], where_, ": ", n, " steps give timestep ", ts[j], " twice (", b_.spacing,
                " spacing of ", b_.T, " train steps), where the multistep update divides by zero; ",
                "accepted: fewer steps");
    }
    Vec train;
    for (double a : b_.ac) train.push_back(std::sqrt((1 - a) / a));
    Vec sig;
    if (karras_) {
      Vec log_train;
      for (double s : train) log_train.push_back(std::log(s));
      sig = karras_sigmas(train.front(), train.back(), n);
      ts.clear();
      for (double s : sig) ts.push_back(sigma_to_t(s, log_train));
      if (schedule_->name() != "cosine") ts = np_round(ts);
    } else {
      sig = interp_index(ts, train);
    }
    sig.push_back(final_zero_ ? 0.0 : train.front());
    sigmas_ = sig;
    for (auto& t : ts) t = std::trunc(t);  // diffusers stores int64 timesteps
    timesteps_ = to_tensor(ts);
    outputs_.clear();
    lower_order_nums_ = 0;
    steps_taken_ = 0;
  }
  Tensor step(const Tensor& out, int64_t i, const Tensor& x_in, const NoiseSource& noise) override {
    check_index(i);
    DEW_CHECK(i == steps_taken_, class_name_, ".step: steps must run in order after set_timesteps; expected step ",
              steps_taken_, ", got ", i);
    ++steps_taken_;
    const auto N = num_steps();
    const bool final_low = i == N - 1 && (euler_at_final_ || (lower_order_final_ && N < 15) || final_zero_);
    const bool second_low = i == N - 2 && lower_order_final_ && N < 15;
    auto x = f64(x_in), m = f64(out);
    // The data prediction at sigma_i.
    const auto [a0, s0] = alpha_sigma(sigmas_[i]);
    Tensor x0 = prediction_type_ == "epsilon"        ? (x - s0 * m) / a0
                : prediction_type_ == "v_prediction" ? a0 * x - s0 * m
                                                     : m;
    outputs_.push_back(x0);
    if (int64_t(outputs_.size()) > order_) outputs_.pop_front();
    std::optional<Tensor> z;
    if (sde_) z = f64(noise(i, x_in));
    Tensor x_next;
    if (order_ == 1 || lower_order_nums_ < 1 || final_low) {
      x_next = first_order(x, i, z);
    } else if (order_ == 2 || lower_order_nums_ < 2 || second_low) {
      x_next = second_order(x, i, z);
    } else {
      x_next = third_order(x, i, z);
    }
    if (lower_order_nums_ < order_) ++lower_order_nums_;
    return x_next.to(x_in.scalar_type());
  }

 private:
  static std::pair<double, double> alpha_sigma(double sigma) {
    const double a = 1 / std::sqrt(sigma * sigma + 1);
    return {a, sigma * a};
  }
  static double lambda(double sigma) {
    auto [a, s] = alpha_sigma(sigma);
    return std::log(a) - std::log(s);
  }
  // The last k data predictions, newest first.
  const Tensor& D(size_t k) const { return outputs_[outputs_.size() - 1 - k]; }
  Tensor noise_term(double st, double h, const std::optional<Tensor>& z) const {
    return st * std::sqrt(std::max(0.0, 1 - std::exp(-2 * h))) * *z;
  }
  Tensor first_order(const Tensor& x, int64_t i, const std::optional<Tensor>& z) const {
    const auto [at_, st] = alpha_sigma(sigmas_[i + 1]);
    const auto [as, ss] = alpha_sigma(sigmas_[i]);
    const double h = lambda(sigmas_[i + 1]) - lambda(sigmas_[i]), e = std::exp(-h);
    if (!sde_) return (st / ss) * x - (at_ * (e - 1)) * D(0);
    return (st / ss * e) * x + (at_ * (1 - e * e)) * D(0) + noise_term(st, h, z);
  }
  Tensor second_order(const Tensor& x, int64_t i, const std::optional<Tensor>& z) const {
    const auto [at_, st] = alpha_sigma(sigmas_[i + 1]);
    const double ss0 = alpha_sigma(sigmas_[i]).second;
    const double lt = lambda(sigmas_[i + 1]), l0 = lambda(sigmas_[i]), l1 = lambda(sigmas_[i - 1]);
    const double h = lt - l0, h0 = l0 - l1, r0 = h0 / h, e = std::exp(-h);
    const Tensor& d0 = D(0);
    auto d1 = (1.0 / r0) * (D(0) - D(1));
    if (!sde_) {
      if (!heun_) return (st / ss0) * x - (at_ * (e - 1)) * d0 - 0.5 * (at_ * (e - 1)) * d1;
      return (st / ss0) * x - (at_ * (e - 1)) * d0 + (at_ * ((e - 1) / h + 1)) * d1;
    }
    auto base = (st / ss0 * e) * x + (at_ * (1 - e * e)) * d0 + noise_term(st, h, z);
    if (!heun_) return base + 0.5 * (at_ * (1 - e * e)) * d1;
    return base + (at_ * ((1 - e * e) / (-2 * h) + 1)) * d1;
  }
  Tensor third_order(const Tensor& x, int64_t i, const std::optional<Tensor>& z) const {
    const auto [at_, st] = alpha_sigma(sigmas_[i + 1]);
    const double ss0 = alpha_sigma(sigmas_[i]).second;
    const double lt = lambda(sigmas_[i + 1]), l0 = lambda(sigmas_[i]), l1 = lambda(sigmas_[i - 1]),
                 l2 = lambda(sigmas_[i - 2]);
    const double h = lt - l0, h0 = l0 - l1, h1 = l1 - l2, r0 = h0 / h, r1 = h1 / h, e = std::exp(-h);
    auto d1_0 = (1.0 / r0) * (D(0) - D(1)), d1_1 = (1.0 / r1) * (D(1) - D(2));
    auto d1 = d1_0 + (r0 / (r0 + r1)) * (d1_0 - d1_1);
    auto d2 = (1.0 / (r0 + r1)) * (d1_0 - d1_1);
    if (!sde_)
      return (st / ss0) * x - (at_ * (e - 1)) * D(0) + (at_ * ((e - 1) / h + 1)) * d1 -
             (at_ * ((e - 1 + h) / (h * h) - 0.5)) * d2;
    return (st / ss0 * e) * x + (at_ * (1 - e * e)) * D(0) + (at_ * ((1 - e * e) / (-2 * h) + 1)) * d1 +
           (at_ * ((1 - e * e - 2 * h) / (4 * h * h) - 0.5)) * d2 + noise_term(st, h, z);
  }
  int64_t order_ = 2, lower_order_nums_ = 0, steps_taken_ = 0;
  bool sde_ = false, heun_ = false, lower_order_final_ = true, euler_at_final_ = false, karras_ = false,
       final_zero_ = true;
  double lambda_min_clipped_ = 0;
  Vec sigmas_;
  std::deque<Tensor> outputs_;  // data predictions, oldest first
};

}  // namespace

const std::vector<std::string>& scheduler_classes() {
  static const std::vector<std::string> names = {"DDIMScheduler",
                                                 "PNDMScheduler",
                                                 "EulerDiscreteScheduler",
                                                 "EulerAncestralDiscreteScheduler",
                                                 "LMSDiscreteScheduler",
                                                 "DPMSolverMultistepScheduler",
                                                 "FlowMatchEulerDiscreteScheduler"};
  return names;
}

std::unique_ptr<Scheduler> Scheduler::from_config(const json& cfg, const std::string& where) {
  DEW_CHECK(cfg.is_object(), where, ": a scheduler config must be a JSON object, got ", cfg.type_name());
  std::string list;
  for (const auto& c : scheduler_classes()) list += (list.empty() ? "" : ", ") + c;
  auto it = cfg.find("_class_name");
  DEW_CHECK(it != cfg.end() && it->is_string(), where, ": _class_name is missing; accepted: ", list);
  const auto cls = it->get<std::string>();
  ConfigReader r(cfg, where, cls);
  if (cls == "DDIMScheduler") return std::make_unique<DDIMScheduler>(r);
  if (cls == "PNDMScheduler") return std::make_unique<PNDMScheduler>(r);
  if (cls == "EulerDiscreteScheduler") return std::make_unique<EulerDiscreteScheduler>(r);
  if (cls == "EulerAncestralDiscreteScheduler") return std::make_unique<EulerAncestralDiscreteScheduler>(r);
  if (cls == "LMSDiscreteScheduler") return std::make_unique<LMS>(r);
  if (cls == "DPMSolverMultistepScheduler") return std::make_unique<DPMSolver>(r);
  if (cls == "FlowMatchEulerDiscreteScheduler") return std::make_unique<FlowMatchEulerScheduler>(cfg, where);
  fail(where, ": _class_name \"", cls, "\" is not supported; accepted: ", list);
}

std::unique_ptr<Scheduler> Scheduler::from_file(const std::string& path) {
  return from_config(read_scheduler_config(path), path);
}

const Tensor& Scheduler::timesteps() const {
  DEW_CHECK(timesteps_.defined(), class_name_, ": call set_timesteps before using the timesteps");
  return timesteps_;
}

double Scheduler::timestep(int64_t i) const {
  check_index(i);
  return timesteps_[i].item<double>();
}

int64_t Scheduler::num_steps() const { return timesteps().size(0); }

double Scheduler::init_noise_sigma() const {
  DEW_CHECK(timesteps_.defined(), class_name_, ": call set_timesteps before init_noise_sigma");
  return init_noise_sigma_;
}

Tensor Scheduler::scale_model_input(const Tensor& x, int64_t i) const {
  check_index(i);
  return x;
}

void Scheduler::set_eta(double eta) {
  DEW_CHECK(eta == 0, class_name_, " takes no eta (only DDIMScheduler does), got ", eta);
}

void Scheduler::check_index(int64_t i) const {
  const auto n = num_steps();
  DEW_CHECK(i >= 0 && i < n, class_name_, ": step index ", i, " is outside [0, ", n, ")");
}

// ---- FlowMatchEulerDiscreteScheduler ----

double calculate_shift(int64_t image_seq_len, int64_t base_seq_len, int64_t max_seq_len, double base_shift,
                       double max_shift) {
  DEW_CHECK(max_seq_len != base_seq_len, "calculate_shift: max_image_seq_len must differ from base_image_seq_len (",
            base_seq_len, ")");
  // diffusers' operation order, so that mu is bit-identical to the pipelines'.
  const double m = (max_shift - base_shift) / double(max_seq_len - base_seq_len);
  const double b = base_shift - m * double(base_seq_len);
  return double(image_seq_len) * m + b;
}

FlowMatchEulerScheduler::FlowMatchEulerScheduler(const json& cfg, const std::string& where) {
  ConfigReader r(cfg, where, "FlowMatchEulerDiscreteScheduler");
  class_name_ = r.cls();
  where_ = where;
  prediction_type_ = "flow_prediction";
  T_ = r.integer("num_train_timesteps", 1000);
  DEW_CHECK(T_ >= 2, where, ": num_train_timesteps = ", T_, " is not supported; accepted: an integer >= 2");
  shift_ = r.number("shift", 1.0);
  DEW_CHECK(shift_ > 0, where, ": shift = ", shift_, " is not supported; accepted: a number > 0");
  dynamic_ = r.flag("use_dynamic_shifting", false);
  base_shift_ = r.number("base_shift", 0.5);
  max_shift_ = r.number("max_shift", 1.15);
  max_shift_set_ = r.find("max_shift") != nullptr;
  base_seq_ = r.integer("base_image_seq_len", 256);
  max_seq_ = r.integer("max_image_seq_len", 4096);
  if (dynamic_)
    DEW_CHECK(base_seq_ != max_seq_, where, ": base_image_seq_len = max_image_seq_len = ", base_seq_,
              " is not supported under use_dynamic_shifting; accepted: two different lengths");
  linear_shift_ = r.choice("time_shift_type", "exponential", {"exponential", "linear"}) == "linear";
  shift_terminal_ = r.optional_number("shift_terminal");
  if (shift_terminal_ && *shift_terminal_ == 0) shift_terminal_.reset();  // diffusers: `if shift_terminal:`
  if (shift_terminal_)
    DEW_CHECK(*shift_terminal_ > 0 && *shift_terminal_ < 1, where, ": shift_terminal = ", *shift_terminal_,
              " is not supported; accepted: null or a number in (0, 1)");
  r.require_flag("invert_sigmas", false, false, " (inverted sigmas are not supported)");
  r.require_flag("use_karras_sigmas", false, false, " (Karras sigmas are not supported for flow matching)");
  r.require_flag("use_exponential_sigmas", false, false, " (exponential sigmas are not supported)");
  r.require_flag("use_beta_sigmas", false, false, " (beta sigmas are not supported)");
  r.require_flag("stochastic_sampling", false, false, " (stochastic sampling is not supported)");
  // __init__: sigmas (T..1)/T, shifted by `shift` unless dynamic; set_timesteps spaces between their ends.
  auto init = [&](double s) { return dynamic_ ? s : shift_ * s / (1 + (shift_ - 1) * s); };
  sigma_max_ = init(double(T_) / double(T_));
  sigma_min_ = init(1.0 / double(T_));
}

double FlowMatchEulerScheduler::shifted(double s, std::optional<double> mu) const {
  if (!dynamic_) return shift_ * s / (1 + (shift_ - 1) * s);
  const double e = linear_shift_ ? *mu : std::exp(*mu);
  return e / (e + (1 / s - 1));  // (1/t - 1) ** sigma with sigma = 1
}

void FlowMatchEulerScheduler::set_timesteps(int64_t n) { set_timesteps(n, {}, std::nullopt); }

void FlowMatchEulerScheduler::set_timesteps(int64_t n, const std::vector<double>& sigmas, std::optional<double> mu) {
  DEW_CHECK(n >= 1, class_name_, ".set_timesteps: the number of steps must be >= 1, got ", n);
  DEW_CHECK(!dynamic_ || mu, where_, ": use_dynamic_shifting is true, so set_timesteps needs mu (the pipeline's ",
            "calculate_shift of the image sequence length)");
  // The linear time shift takes mu as the shift itself: mu / (mu + 1/t - 1) is 0 / 0 at t = 1 for mu = 0 (NaN
  // sigmas, as in diffusers) and changes sign or divides by zero for mu < 0.
  if (dynamic_)
    DEW_CHECK(std::isfinite(*mu) && (!linear_shift_ || *mu > 0), where_, ": mu = ", *mu,
              " (calculate_shift of the image sequence length from base_shift and max_shift) is not supported",
              linear_shift_ ? " with time_shift_type linear" : "", "; accepted: a finite mu",
              linear_shift_ ? " > 0 (base_shift and max_shift above 0)" : "");
  DEW_CHECK(sigmas.empty() || int64_t(sigmas.size()) == n, class_name_, ".set_timesteps: ", sigmas.size(),
            " sigmas given for ", n, " steps; accepted: none or one per step");
  Vec s = sigmas;
  if (s.empty())
    for (double t : np_linspace(sigma_max_ * double(T_), sigma_min_ * double(T_), n)) s.push_back(t / double(T_));
  for (double& v : s) {
    DEW_CHECK(v > 0 && v <= 1, class_name_, ".set_timesteps: sigma ", v, " is outside (0, 1]");
    v = shifted(v, mu);
  }
  if (shift_terminal_) {  // stretch so that the last sigma is shift_terminal (LTX-Video)
    // A last sigma of 1 (one step from sigma 1) leaves nothing to stretch: diffusers divides 0 by 0 there and
    // runs on NaN sigmas.
    DEW_CHECK(s.back() < 1, where_, ": shift_terminal ", *shift_terminal_, " stretches the sigmas towards it, but ",
              "the last sigma of these ", n, " step(s) is 1 (diffusers' stretch would divide by zero and give NaN ",
              "sigmas); accepted: at least 2 steps, or sigmas that end below 1");
    const double scale = (1 - s.back()) / (1 - *shift_terminal_);
    for (double& v : s) v = 1 - ((1 - v) / scale);
  }
  Vec ts;
  for (double v : s) ts.push_back(v * double(T_));
  s.push_back(0.0);
  timesteps_ = to_tensor(ts);
  sigmas_v_ = s;
  sigmas_ = to_tensor(s);
}

const Tensor& FlowMatchEulerScheduler::sigmas() const {
  DEW_CHECK(sigmas_.defined(), class_name_, ": call set_timesteps before using the sigmas");
  return sigmas_;
}

double FlowMatchEulerScheduler::sigma(int64_t i) const {
  DEW_CHECK(i >= 0 && i <= num_steps(), class_name_, ": sigma index ", i, " is outside [0, ", num_steps(), "]");
  return sigmas_v_[i];
}

double FlowMatchEulerScheduler::mu_for(int64_t image_seq_len, double max_shift_if_absent) const {
  return calculate_shift(image_seq_len, base_seq_, max_seq_, base_shift_,
                         max_shift_set_ ? max_shift_ : max_shift_if_absent);
}

Tensor FlowMatchEulerScheduler::step(const Tensor& velocity, int64_t i, const Tensor& x, const NoiseSource&) {
  check_index(i);
  const double dt = sigmas_v_[i + 1] - sigmas_v_[i];
  return (f64(x) + dt * f64(velocity)).to(x.scalar_type());
}

}  // namespace dew::sampling

#include "dew/metrics/metrics.h"

#include <cmath>
#include <tuple>

namespace dew::metrics {

namespace {

// Square root of a symmetric positive semi-definite matrix.
Tensor sqrtm_psd(const Tensor& m) {
  auto [w, v] = at::linalg_eigh((m + m.t()) / 2);
  return at::matmul(v * w.clamp_min(0).sqrt().unsqueeze(0), v.t());
}

Tensor gaussian_window(int64_t size, double sigma) {
  auto x = at::arange(size, at::TensorOptions().dtype(at::kDouble)) - (size - 1) / 2.0;
  auto g = (-x.square() / (2 * sigma * sigma)).exp();
  g = g / g.sum();
  return at::outer(g, g);
}

}  // namespace

std::pair<Tensor, Tensor> gaussian_fit(const Tensor& features) {
  DEW_CHECK(features.dim() == 2 && features.size(0) >= 2, "features: expected [N, D] with N >= 2, got ",
            features.sizes());
  auto f = features.to(at::kDouble);
  auto mu = f.mean(0);
  auto c = f - mu;
  return {mu, at::matmul(c.t(), c) / double(f.size(0) - 1)};
}

void check_fid_count(int64_t n, int64_t dims, const std::string& what) {
  DEW_CHECK(n > dims, what, ": ", n, " images give a singular covariance of the ", dims,
            "-d features; a Frechet distance needs at least ", dims + 1,
            " (pytorch-fid's advice: 2048+ for "
            "Inception, 10000+ for comparable numbers)");
}

double frechet_distance(const Tensor& mu1, const Tensor& cov1, const Tensor& mu2, const Tensor& cov2, double eps) {
  DEW_CHECK(
      mu1.sizes() == mu2.sizes() && cov1.sizes() == cov2.sizes() && cov1.dim() == 2 && cov1.size(0) == mu1.numel(),
      "frechet_distance: mismatched shapes ", mu1.sizes(), ", ", cov1.sizes(), ", ", mu2.sizes(), ", ", cov2.sizes());
  auto m1 = mu1.to(at::kDouble), m2 = mu2.to(at::kDouble);
  auto c1 = cov1.to(at::kDouble), c2 = cov2.to(at::kDouble);
  DEW_CHECK(at::isfinite(m1).all().item<bool>() && at::isfinite(m2).all().item<bool>() &&
                at::isfinite(c1).all().item<bool>() && at::isfinite(c2).all().item<bool>(),
            "frechet_distance: the statistics hold NaN or infinite values");
  // Re tr sqrtm(a b) = sum sqrt(max(eig(a^1/2 b a^1/2), 0)); the negative eigenvalues are the imaginary part.
  auto cross_term = [](const Tensor& a, const Tensor& b) -> std::pair<double, double> {
    auto s = sqrtm_psd(a);
    auto w = at::linalg_eigvalsh(at::matmul(at::matmul(s, b), s));
    return {w.clamp_min(0).sqrt().sum().item<double>(), (-w).clamp_min(0).sqrt().sum().item<double>()};
  };
  auto [cross, imag] = cross_term(c1, c2);
  if (!std::isfinite(cross)) {  // pytorch-fid: "fid calculation produces singular product"
    auto offset = at::eye(c1.size(0), c1.options()) * eps;
    std::tie(cross, imag) = cross_term(c1 + offset, c2 + offset);
  }
  DEW_CHECK(imag <= 1e-3, "frechet_distance: imaginary component ", imag,
            " in the matrix square root (a covariance is not positive semi-definite)");
  return ((m1 - m2).square().sum() + c1.trace() + c2.trace()).item<double>() - 2 * cross;
}

double frechet_distance(const Tensor& features_a, const Tensor& features_b) {
  auto [m1, c1] = gaussian_fit(features_a);
  auto [m2, c2] = gaussian_fit(features_b);
  return frechet_distance(m1, c1, m2, c2);
}

double psnr(const Tensor& a, const Tensor& b, double range) {
  DEW_CHECK(a.sizes() == b.sizes(), "psnr: shapes differ: ", a.sizes(), " vs ", b.sizes());
  const double mse = (a.to(at::kDouble) - b.to(at::kDouble)).square().mean().item<double>();
  return mse == 0 ? INFINITY : 10 * std::log10(range * range / mse);
}

double ssim(const Tensor& a, const Tensor& b, double range) {
  DEW_CHECK(a.sizes() == b.sizes() && a.dim() == 4, "ssim: expected two [B, C, H, W] of one shape, got ", a.sizes(),
            " and ", b.sizes());
  DEW_CHECK(a.size(2) >= 11 && a.size(3) >= 11, "ssim: images must be at least 11x11, got ", a.size(2), "x", a.size(3));
  const int64_t C = a.size(1);
  auto w = gaussian_window(11, 1.5).view({1, 1, 11, 11}).repeat({C, 1, 1, 1});
  auto x = a.to(at::kDouble), y = b.to(at::kDouble);
  auto filt = [&](const Tensor& t) {
    return at::conv2d(t, w, Tensor(), at::IntArrayRef{1, 1}, at::IntArrayRef{0, 0}, at::IntArrayRef{1, 1}, C);
  };
  Tensor mx = filt(x);
  Tensor my = filt(y);
  Tensor sxx = filt(x * x) - mx.square();
  Tensor syy = filt(y * y) - my.square();
  Tensor sxy = filt(x * y) - mx * my;
  const double c1 = std::pow(0.01 * range, 2), c2 = std::pow(0.03 * range, 2);
  auto map = ((2 * mx * my + c1) * (2 * sxy + c2)) / ((mx.square() + my.square() + c1) * (sxx + syy + c2));
  return map.mean().item<double>();
}

namespace {

class Fn : public Metric {
 public:
  Fn(std::string name, std::function<double(const Tensor&, const Tensor&)> f)
      : name_(std::move(name)), f_(std::move(f)) {}
  std::string name() const override { return name_; }
  double operator()(const Tensor& a, const Tensor& b) const override { return f_(a, b); }

 private:
  std::string name_;
  std::function<double(const Tensor&, const Tensor&)> f_;
};

}  // namespace

Registry<Metric>& registry() {
  static Registry<Metric>* r = [] {
    auto* r = new Registry<Metric>("metric");
    r->add<RangeOptions>("psnr", "peak signal-to-noise ratio in dB", [](const RangeOptions& o) {
      return std::make_shared<Fn>("psnr", [o](const Tensor& a, const Tensor& b) { return psnr(a, b, o.range); });
    });
    r->add<RangeOptions>("ssim", "structural similarity (11x11 Gaussian, sigma 1.5)", [](const RangeOptions& o) {
      return std::make_shared<Fn>("ssim", [o](const Tensor& a, const Tensor& b) { return ssim(a, b, o.range); });
    });
    r->add<NoOptions>(
        "frechet_distance", "Frechet distance between Gaussian fits of two feature sets [N, D]", [](const NoOptions&) {
          return std::make_shared<Fn>("frechet_distance",
                                      [](const Tensor& a, const Tensor& b) { return frechet_distance(a, b); });
        });
    return r;
  }();
  return *r;
}

}  // namespace dew::metrics

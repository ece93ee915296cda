// Evaluation metrics (docs/evaluation.md) as pure functions, and the `metrics` registry of pairwise metrics.
#pragma once
#include <ATen/ATen.h>

#include "dew/core/registry.h"

namespace dew::metrics {

using at::Tensor;

/// Frechet distance between Gaussians (mu1, cov1) and (mu2, cov2), in float64, as pytorch-fid 0.3.0's
/// calculate_frechet_distance computes it (docs/evaluation.md#fid): |mu1 - mu2|^2 + tr cov1 + tr cov2
/// - 2 Re tr sqrtm(cov1 cov2). pytorch-fid takes scipy's sqrtm of the product (a complex Schur form) and keeps
/// its real trace; for covariances (symmetric PSD) that equals the sum of the square roots of the non-negative
/// eigenvalues of cov1^1/2 cov2 cov1^1/2, which this computes by two symmetric eigendecompositions (eigenvalues
/// of cov1 clipped at 0). Like pytorch-fid: when that is not finite it retries once with eps I added to both
/// covariances (only in the cross term), and imaginary parts (negative eigenvalues: a non-PSD input) larger
/// than 1e-3 in total are an error. scipy's own retry also fires on rounding accidents of its Schur form on
/// exactly singular products, which no eigendecomposition can see; there the results differ by the eps
/// term (tests/metrics/test_fid.cpp measures it).
double frechet_distance(const Tensor& mu1, const Tensor& cov1, const Tensor& mu2, const Tensor& cov2,
                        double eps = 1e-6);
/// Frechet distance between the Gaussians fitted to two feature sets [N, D] (unbiased covariances).
double frechet_distance(const Tensor& features_a, const Tensor& features_b);
/// Mean and unbiased covariance of features [N, D], float64.
std::pair<Tensor, Tensor> gaussian_fit(const Tensor& features);
/// The refusal before any feature is extracted: a Frechet distance of D-dimensional features needs more
/// than D samples for a non-singular covariance (`what` names the image set). Throws dew::Error.
void check_fid_count(int64_t n, int64_t dims, const std::string& what);

/// PSNR in dB of images in a range of width `range` (2 for [-1, 1]): 10 log10(range^2 / MSE), MSE over all.
double psnr(const Tensor& a, const Tensor& b, double range = 2.0);
/// SSIM (Wang et al. 2004): 11x11 Gaussian window, sigma 1.5, K1 0.01, K2 0.03, valid windows, mean over
/// pixels, channels and batch. a, b: [B, C, H, W] with H, W >= 11.
double ssim(const Tensor& a, const Tensor& b, double range = 2.0);

/// A metric of two tensors (images or features).
class Metric {
 public:
  virtual ~Metric() = default;
  virtual std::string name() const = 0;
  virtual double operator()(const Tensor& a, const Tensor& b) const = 0;
};

struct RangeOptions {
  double range = 2.0;
  template <class V>
  void visit(V& v) {
    v("range", range, "width of the value range (2 for [-1, 1])");
  }
};

/// psnr | ssim | frechet_distance.
Registry<Metric>& registry();

}  // namespace dew::metrics

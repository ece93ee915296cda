// Prediction transforms (docs/diffusion.md): what the network predicts and how its raw output F is read
// back as (x0_hat, eps_hat). The network sees x_t * c_in. One object serves training (target,
// prediction) and sampling (to_x0_eps), so the two cannot disagree.
#pragma once
#include "dew/diffusion/schedules.h"

namespace dew::diffusion {

/// A denoised estimate: x0_hat and eps_hat with x_t = alpha x0_hat + sigma eps_hat.
struct Prediction {
  Tensor x0;
  Tensor eps;
};

/// alpha and sigma broadcast against a batch x ([B, 1, ...], x's dtype).
struct BRates {
  Tensor alpha;
  Tensor sigma;
};
BRates broadcast_rates(const Rates& r, const Tensor& x);

class Transform {
 public:
  virtual ~Transform() = default;
  virtual std::string name() const = 0;
  /// Input scaling c_in per row (float64, shape of sigma); 1 except karras.
  virtual Tensor c_in(const Rates& r) const;
  /// The training target for F (karras: x0, compared with D rather than F).
  virtual Tensor target(const Tensor& x0, const Tensor& eps, const BRates& r) const = 0;
  /// What the loss compares with the target: F itself, or D = c_skip x_t + c_out F for karras.
  virtual Tensor prediction(const Tensor& F, const Tensor& x_t, const BRates& r) const { return F; }
  /// Reads a raw output back as (x0_hat, eps_hat).
  virtual Prediction to_x0_eps(const Tensor& F, const Tensor& x_t, const BRates& r) const = 0;
  /// The raw output F that reads back as x0 (the inverse of to_x0_eps; used by oracles and CFG tests).
  virtual Tensor raw_output(const Tensor& x0, const Tensor& x_t, const BRates& r) const = 0;
  /// target_error_scale(SNR): how an x0 error scales into the target's error (squared).
  virtual Tensor target_error_scale(const Tensor& snr) const = 0;
};
using TransformPtr = std::shared_ptr<Transform>;

struct KarrasTransformOptions {
  double sigma_data = 0.5;
  template <class V>
  void visit(V& v) {
    v("sigma_data", sigma_data, "data standard deviation sd");
  }
};

/// epsilon | x0 | v | flow | karras.
Registry<Transform>& transforms();
TransformPtr make_transform(const std::string& name, double sigma_data = 0.5);

}  // namespace dew::diffusion

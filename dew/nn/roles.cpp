#include "dew/nn/roles.h"

#include <ATen/ATen.h>

#include "dew/core/error.h"

namespace dew {

DiagonalGaussian::DiagonalGaussian(at::Tensor m, at::Tensor lv) : mean(std::move(m)), logvar(std::move(lv)) {
  DEW_CHECK(mean.defined() && logvar.defined() && mean.sizes() == logvar.sizes(),
            "DiagonalGaussian: mean and logvar must have one shape, got ", mean.sizes(), " and ", logvar.sizes());
  logvar = logvar.clamp(-30.0, 20.0);
}

at::Tensor DiagonalGaussian::std() const { return (0.5 * logvar).exp(); }

at::Tensor DiagonalGaussian::sample(at::Generator gen) const {
  const at::Tensor eps = at::randn(mean.sizes(), gen, at::TensorOptions().dtype(mean.scalar_type())).to(mean.device());
  return mean + std() * eps;
}

at::Tensor DiagonalGaussian::kl() const {
  std::vector<int64_t> dims;
  for (int64_t d = 1; d < mean.dim(); ++d) dims.push_back(d);
  return 0.5 * (mean.pow(2) + logvar.exp() - 1.0 - logvar).sum(dims);
}

at::Tensor AutoencoderImpl::to_latent(const at::Tensor& z) const { return (z - shift_factor()) * scaling_factor(); }

at::Tensor AutoencoderImpl::from_latent(const at::Tensor& latent) const {
  return latent / scaling_factor() + shift_factor();
}

}  // namespace dew

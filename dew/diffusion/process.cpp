#include "dew/diffusion/process.h"

#include "dew/core/rng.h"

namespace dew::diffusion {

DiffusionProcess::DiffusionProcess(Preset p) : p_(std::move(p)) {
  DEW_CHECK(p_.train && p_.sample && p_.transform && p_.weighting, "DiffusionProcess: preset \"", p_.name,
            "\" is incomplete");
}

TrainingInputs DiffusionProcess::training_inputs(const Tensor& x0, at::Generator gen) const {
  auto t = p_.train->draw_t(x0.size(0), gen);
  auto eps = at::randn(x0.sizes(), gen, at::TensorOptions().dtype(x0.scalar_type())).to(x0.device());
  return training_inputs(x0, t, eps);
}

TrainingInputs DiffusionProcess::training_inputs(const Tensor& x0, const Tensor& t, const Tensor& eps) const {
  DEW_CHECK(t.dim() == 1 && t.size(0) == x0.size(0), "training_inputs: t must be [B] with B = ", x0.size(0), ", got ",
            t.sizes());
  const Schedule& s = *p_.train;
  auto tc = t.to(at::kDouble).cpu();
  Rates r = s.rates(tc);
  auto dev = x0.device();
  Rates rd{r.alpha.to(dev), r.sigma.to(dev)};
  BRates b = broadcast_rates(rd, x0);
  TrainingInputs in;
  in.t = tc;
  in.eps = eps;
  in.x_t = b.alpha * x0 + b.sigma * eps;
  in.net_input = in.x_t * bcast(p_.transform->c_in(rd), x0);
  in.model_time = s.model_time(tc).to(dev);
  in.target = p_.transform->target(x0, eps, b);
  in.weight = (*p_.weighting)(tc, s, *p_.transform).to(at::kFloat).to(dev);
  return in;
}

Tensor DiffusionProcess::loss_per_row(const Tensor& F, const TrainingInputs& in) const {
  Rates r = p_.train->rates(in.t);
  BRates b = broadcast_rates({r.alpha.to(F.device()), r.sigma.to(F.device())}, F);
  auto pred = p_.transform->prediction(F, in.x_t, b);
  auto sq = (pred.to(at::kFloat) - in.target.to(at::kFloat)).square().flatten(1).mean(1);
  return 0.5 * sq * in.weight;
}

Tensor DiffusionProcess::loss(const Tensor& F, const TrainingInputs& in) const { return loss_per_row(F, in).mean(); }

namespace {
Prediction read_back(const Schedule& s, const Transform& tr, const Tensor& F, const Tensor& x_t, const Tensor& t) {
  Rates r = s.rates(t.to(at::kDouble).cpu());
  BRates b = broadcast_rates({r.alpha.to(x_t.device()), r.sigma.to(x_t.device())}, x_t);
  return tr.to_x0_eps(F.to(x_t.scalar_type()), x_t, b);
}
}  // namespace

Prediction DiffusionProcess::denoise(const Tensor& F, const Tensor& x_t, const Tensor& t,
                                     const Schedule* schedule) const {
  return read_back(schedule ? *schedule : *p_.sample, *p_.transform, F, x_t, t);
}

RawFn DiffusionProcess::raw(Model net) const {
  auto schedule = p_.sample;
  auto transform = p_.transform;
  return [net = std::move(net), schedule, transform](const Tensor& x_t, const Tensor& t) {
    auto tc = t.to(at::kDouble).cpu();
    Rates r = schedule->rates(tc);
    auto c_in = bcast(transform->c_in(r).to(x_t.device()), x_t);
    return net(x_t * c_in, schedule->model_time(tc).to(x_t.device()));
  };
}

Denoiser DiffusionProcess::denoiser(RawFn raw) const {
  // Captures the schedule and transform by shared pointer: the denoiser may outlive the process.
  return [s = p_.sample, tr = p_.transform, raw = std::move(raw)](const Tensor& x_t, const Tensor& t) {
    return read_back(*s, *tr, raw(x_t, t), x_t, t);
  };
}

Tensor DiffusionProcess::prior(at::IntArrayRef shape, uint64_t seed, const at::TensorOptions& options) const {
  auto gen = rng::generator(seed, 0, "sample/prior");
  auto z = at::randn(shape, gen, at::TensorOptions().dtype(at::kFloat));
  return (z * p_.sample->prior_std()).to(options.device()).to(options.dtype());
}

}  // namespace dew::diffusion

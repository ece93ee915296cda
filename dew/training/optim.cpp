#include "dew/training/optim.h"

#include <cmath>

#include "dew/nn/fused.h"

namespace dew::training {

void validate(const OptimOptions& o) {
  DEW_CHECK(o.lr > 0, "optim.lr: must be > 0, got ", o.lr);
  DEW_CHECK(o.beta1 >= 0 && o.beta1 < 1, "optim.beta1: must be in [0, 1), got ", o.beta1);
  DEW_CHECK(o.beta2 >= 0 && o.beta2 < 1, "optim.beta2: must be in [0, 1), got ", o.beta2);
  DEW_CHECK(o.eps > 0, "optim.eps: must be > 0, got ", o.eps);
  DEW_CHECK(o.weight_decay >= 0, "optim.weight_decay: must be >= 0, got ", o.weight_decay);
  DEW_CHECK(o.warmup_steps >= 0, "optim.warmup_steps: must be >= 0, got ", o.warmup_steps);
  DEW_CHECK(o.min_lr_ratio >= 0 && o.min_lr_ratio <= 1, "optim.min_lr_ratio: must be in [0, 1], got ", o.min_lr_ratio);
  DEW_CHECK(o.grad_clip >= 0, "optim.grad_clip: must be >= 0 (0 = off), got ", o.grad_clip);
}

double learning_rate(const OptimOptions& o, int64_t step, int64_t total) {
  if (step < o.warmup_steps) return o.lr * double(step + 1) / double(o.warmup_steps + 1);
  if (o.schedule == "constant") return o.lr;
  const double span = std::max<int64_t>(1, total - o.warmup_steps);
  const double p = std::min(1.0, double(step - o.warmup_steps) / span);
  const double floor = o.lr * o.min_lr_ratio;
  if (o.schedule == "linear") return floor + (o.lr - floor) * (1 - p);
  return floor + (o.lr - floor) * 0.5 * (1 + std::cos(M_PI * p));
}

double clip_grad_norm(const NamedTensors& params, double max_norm) {
  at::NoGradGuard ng;
  double sq = 0;
  for (const auto& [name, p] : params)
    if (p.grad().defined()) sq += nn::sum_of_squares(p.grad());
  const double norm = std::sqrt(sq);
  if (max_norm > 0 && norm > max_norm) {
    const double scale = max_norm / (norm + 1e-6);
    for (const auto& [name, p] : params)
      if (p.grad().defined()) p.mutable_grad().mul_(scale);
  }
  return norm;
}

Optimizer::Optimizer(NamedTensors params, OptimOptions options) : params_(std::move(params)), o_(std::move(options)) {
  validate(o_);
  for (const auto& [name, p] : params_) {
    if (o_.name == "sgd") {
      m_[name] = at::zeros_like(p);
    } else {
      m_[name] = at::zeros_like(p);
      v_[name] = at::zeros_like(p);
    }
  }
}

void Optimizer::zero_grad() {
  // Gradients are dropped, not zeroed (PyTorch's set_to_none): the next backward then hands its gradient
  // tensors over instead of adding them into zeros, and a parameter that gets none is skipped by step().
  for (auto& [name, p] : params_)
    if (p.grad().defined()) p.mutable_grad().reset();
}

void Optimizer::step(double lr) {
  at::NoGradGuard ng;
  ++t_;
  const double bc1 = 1 - std::pow(o_.beta1, double(t_)), bc2 = 1 - std::pow(o_.beta2, double(t_));
  for (auto& [name, p] : params_) {
    if (!p.grad().defined()) continue;
    Tensor g = p.grad();
    const bool decay = o_.weight_decay > 0 && p.dim() >= 2;  // no decay on biases and norm scales
    if (o_.name == "sgd") {
      if (decay) g = g + o_.weight_decay * p;
      auto& buf = m_[name];
      buf.mul_(o_.momentum).add_(g);
      p.add_(buf, -lr);
      continue;
    }
    auto& m = m_[name];
    auto& v = v_[name];
    nn::AdamCoefficients c;
    c.l2 = decay && o_.name == "adam" ? o_.weight_decay : 0.0;
    c.decay = decay && o_.name == "adamw" ? 1 - lr * o_.weight_decay : 1.0;
    c.beta1 = o_.beta1;
    c.beta2 = o_.beta2;
    c.step = lr / bc1;
    c.bc2 = bc2;
    c.eps = o_.eps;
    if (nn::fused_adam_update(p, g, m, v, c)) continue;  // float32 CPU: one pass instead of eight ops
    if (decay && o_.name == "adamw") p.mul_(1 - lr * o_.weight_decay);
    if (decay && o_.name == "adam") g = g + o_.weight_decay * p;
    m.mul_(o_.beta1).add_(g, 1 - o_.beta1);
    v.mul_(o_.beta2).addcmul_(g, g, 1 - o_.beta2);
    auto denom = (v / bc2).sqrt_().add_(o_.eps);
    p.addcdiv_(m, denom, -lr / bc1);
  }
}

std::map<std::string, Tensor> Optimizer::state_dict() const {
  std::map<std::string, Tensor> out;
  const std::string first = o_.name == "sgd" ? "momentum/" : "exp_avg/";
  for (const auto& [name, t] : m_) out[first + name] = t;
  for (const auto& [name, t] : v_) out["exp_avg_sq/" + name] = t;
  out["step"] = at::full({1}, t_, at::TensorOptions().dtype(at::kLong));
  return out;
}

void Optimizer::load_state_dict(const std::map<std::string, Tensor>& state) {
  auto get = [&](const std::string& key, const Tensor& like) {
    auto it = state.find(key);
    DEW_CHECK(it != state.end(), "optimizer state: missing \"", key,
              "\" (was the checkpoint written by another optimizer?)");
    DEW_CHECK(it->second.sizes() == like.sizes(), "optimizer state \"", key, "\": shape ", it->second.sizes(),
              " does not match the parameter's ", like.sizes());
    return it->second;
  };
  at::NoGradGuard ng;
  const std::string first = o_.name == "sgd" ? "momentum/" : "exp_avg/";
  for (auto& [name, t] : m_) t.copy_(get(first + name, t));
  for (auto& [name, t] : v_) t.copy_(get("exp_avg_sq/" + name, t));
  auto it = state.find("step");
  DEW_CHECK(it != state.end(), "optimizer state: missing \"step\"");
  t_ = it->second.item<int64_t>();
}

double EmaSpec::at(int64_t step, int64_t total_steps) const {
  if (final_decay < 0) return decay >= 1.0 ? 1.0 : std::min(decay, (1.0 + double(step)) / (10.0 + double(step)));
  const double u = total_steps <= 1 ? 1.0 : std::min(1.0, double(step) / double(total_steps - 1));
  return decay + (final_decay - decay) * u;
}

bool EmaSpec::includes(const std::string& name) const {
  if (prefixes.empty()) return true;
  for (const auto& p : prefixes)
    if (name.rfind(p, 0) == 0) return true;
  return false;
}

EMA::EMA(const NamedTensors& params, EmaSpec spec, int64_t total_steps)
    : spec_(std::move(spec)), total_steps_(total_steps) {
  DEW_CHECK(spec_.decay >= 0 && spec_.decay <= 1, "ema_decay: must be in [0, 1], got ", spec_.decay);
  DEW_CHECK(spec_.final_decay < 0 || spec_.final_decay <= 1, "ema final decay: must be in [0, 1], got ",
            spec_.final_decay);
  for (const auto& [name, p] : params)
    if (spec_.includes(name)) avg_[name] = p.detach().to(at::kFloat).clone();
}

void EMA::update(const NamedTensors& params, int64_t step) {
  const double d = spec_.at(step, total_steps_);
  if (d >= 1.0) return;
  at::NoGradGuard ng;
  for (const auto& [name, p] : params) {
    auto it = avg_.find(name);
    if (it == avg_.end()) continue;
    Tensor& avg = it->second;
    if (!nn::fused_ema_update(avg, p.detach(), d)) avg.mul_(d).add_(p.detach().to(at::kFloat), 1 - d);
  }
}

void EMA::swap_into(const NamedTensors& params) {
  at::NoGradGuard ng;
  for (const auto& [name, p] : params) {
    auto it = avg_.find(name);
    if (it == avg_.end()) continue;
    auto live = p.detach().clone();
    p.copy_(it->second);
    it->second.copy_(live);
  }
}

}  // namespace dew::training

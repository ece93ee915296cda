#include "dew/objectives/policy.h"

#include <ATen/ATen.h>

#include "dew/core/error.h"
#include "dew/io/weights.h"
#include "dew/nn/lora.h"

namespace dew::post_training {

at::Tensor token_logps(nn::CausalTransformerImpl& model, const at::Tensor& ids) {
  DEW_CHECK(ids.dim() == 2 && ids.size(1) >= 2, "token_logps: ids must be [N, L >= 2], got ", ids.sizes());
  const at::Tensor x = ids.to(model.head_weight().device());
  const at::Tensor logits = model.forward_tokens(x.narrow(1, 0, x.size(1) - 1)).to(at::kFloat);  // [N, L - 1, V]
  const at::Tensor picked = logits.gather(-1, x.narrow(1, 1, x.size(1) - 1).unsqueeze(-1)).squeeze(-1);
  const at::Tensor lp = picked - at::logsumexp(logits, -1);
  return at::cat({at::zeros({x.size(0), 1}, lp.options()), lp}, 1);
}

FrozenReference::FrozenReference(const nn::CausalTransformer& policy) : policy_(policy) {
  model_ = nn::CausalTransformer(policy->options);
  model_->to(policy->head_weight().device(), policy->head_weight().scalar_type());
  for (auto& p : model_->parameters()) p.set_requires_grad(false);
  model_->eval();
}

void FrozenReference::set(const std::map<std::string, at::Tensor>& weights, const std::string& what) {
  io::load_weights(*model_, io::WeightSource::of_tensors(weights, what));
  for (auto& p : model_->parameters()) p.set_requires_grad(false);
  set_ = true;
}

void FrozenReference::bind(const std::map<std::string, at::Tensor>& averages) {
  averages_ = &averages;
  if (!set_) return;
  at::NoGradGuard ng;
  for (const auto& kv : model_->named_parameters()) {
    auto it = averages.find(kv.key());
    DEW_CHECK(it != averages.end(), "frozen reference: the EMA holds no \"", kv.key(), "\"");
    it->second.copy_(kv.value());
  }
}

nn::CausalTransformerImpl& FrozenReference::model() {
  if (!loaded_) {
    DEW_CHECK(averages_, "frozen reference: the trainer did not bind its EMA (the reference weights)");
    at::NoGradGuard ng;
    // The EMA holds the trainable parameters; a frozen one (a LoRA policy's base) never moves from its start.
    const auto policy = policy_->named_parameters();
    auto params = model_->named_parameters();
    for (const auto& kv : params) {
      auto it = averages_->find(kv.key());
      const at::Tensor* frozen = it == averages_->end() ? policy.find(kv.key()) : nullptr;
      DEW_CHECK(it != averages_->end() || (frozen && !frozen->requires_grad()), "frozen reference: the EMA holds no \"",
                kv.key(), "\"");
      kv.value().copy_(frozen ? *frozen : it->second);
    }
    // A LoRA policy: its adapters as they started (in the EMA) merged into the reference's weights.
    for (const auto& item : policy_->named_modules("", /*include_self=*/false)) {
      const nn::LoraStateImpl* s = nn::lora_state(*item.value());
      if (!s) continue;
      const auto a = averages_->find(item.key() + ".lora_A.weight"), b = averages_->find(item.key() + ".lora_B.weight");
      at::Tensor* w = params.find(item.key() + ".weight");
      DEW_CHECK(a != averages_->end() && b != averages_->end() && w, "frozen reference: the EMA holds no adapter of ",
                item.key());
      w->add_(nn::lora_delta_weight(a->second, b->second, s->scale).to(w->scalar_type()));
    }
    loaded_ = true;
  }
  return *model_;
}

}  // namespace dew::post_training

namespace dew {

std::map<std::string, double> ReferencePolicyObjective::validate(int64_t step, const std::string& run_dir) {
  return eval_ ? eval_->validate(*model_, step, run_dir) : std::map<std::string, double>{};
}

}  // namespace dew

#include "dew/objectives/dpo.h"

#include <ATen/ATen.h>

#include "dew/core/error.h"
#include "dew/objectives/post_training.h"

namespace dew {

namespace {

// The batch cut to its longest row (right padding beyond it carries no completion token).
int64_t used_length(const at::Tensor& ids, const at::Tensor& mask) {
  const at::Tensor any = mask.reshape({-1, mask.size(-1)}).any(0);  // [L]
  const at::Tensor nz = any.nonzero();
  DEW_CHECK(nz.numel() > 0, "objective dpo: a batch without completion tokens");
  return nz.max().item<int64_t>() + 1;
}

}  // namespace

DPOObjective::DPOObjective(nn::CausalTransformer model, DPOObjectiveOptions o, data::Batch rows,
                           std::shared_ptr<post_training::ChatEvaluator> eval)
    : ReferencePolicyObjective(std::move(model), std::move(eval)), o_(std::move(o)), rows_(std::move(rows)) {
  DEW_CHECK(o_.beta > 0, "objective.beta: must be > 0, got ", o_.beta);
  DEW_CHECK(o_.label_smoothing >= 0 && o_.label_smoothing < 0.5, "objective.label_smoothing: must be in [0, 0.5), got ",
            o_.label_smoothing);
  DEW_CHECK(o_.sft_weight >= 0, "objective.sft_weight: must be >= 0, got ", o_.sft_weight);
  DEW_CHECK(o_.reference_logps == "batch" || o_.reference_logps == "precompute", "objective.reference_logps: got \"",
            o_.reference_logps, "\", accepted: batch, precompute");
}

at::Tensor DPOObjective::reference_logps(const at::Tensor& ids, const at::Tensor& mask) {
  at::NoGradGuard ng;
  const int64_t n = ids.size(0), l = ids.size(2);
  auto& ref = reference_.model();
  const at::Tensor x = ids.reshape({2 * n, l}).to(ref.head_weight().device());
  const at::Tensor logits = ref.forward_tokens(x).to(at::kFloat).view({n, 2, l, -1});
  return post_training::sequence_logps(logits, ids.to(x.device()), mask.to(x.device()));
}

LossOutput DPOObjective::loss(const data::Batch& batch, int64_t step, at::Generator gen) {
  const auto device = model_->head_weight().device();
  const int64_t len = used_length(batch.at("ids"), batch.at("completion_mask"));
  const at::Tensor ids = batch.at("ids").narrow(2, 0, len).to(device);
  const at::Tensor mask = batch.at("completion_mask").narrow(2, 0, len).to(device);
  const int64_t n = ids.size(0);
  at::Tensor ref;
  if (o_.reference_logps == "precompute") {
    if (!precomputed_.defined()) {
      const int64_t total = rows_.at("ids").size(0), chunk = 64;
      std::vector<at::Tensor> parts;
      for (int64_t s = 0; s < total; s += chunk) {
        const int64_t k = std::min(chunk, total - s);
        const at::Tensor ri = rows_.at("ids").narrow(0, s, k), rm = rows_.at("completion_mask").narrow(0, s, k);
        const int64_t rl = used_length(ri, rm);
        parts.push_back(reference_logps(ri.narrow(2, 0, rl), rm.narrow(2, 0, rl)).cpu());
      }
      precomputed_ = at::cat(parts, 0);  // [N, 2]
    }
    ref = precomputed_.index_select(0, batch.at("index")).to(device);
  } else {
    ref = reference_logps(ids, mask);
  }
  const at::Tensor logits = model_->forward_tokens(ids.reshape({2 * n, len})).to(at::kFloat).view({n, 2, len, -1});
  const at::Tensor policy = post_training::sequence_logps(logits, ids, mask);  // [n, 2]
  auto d = post_training::dpo_loss_from_logps(policy, ref, o_.beta, o_.label_smoothing);
  if (o_.sft_weight > 0) {
    // TRL's "sft" loss: cross entropy of the chosen completion tokens, a mean over all of them in the batch.
    const at::Tensor lc = logits.select(1, 0).narrow(1, 0, len - 1);
    const at::Tensor keep = mask.select(1, 0).narrow(1, 1, len - 1).reshape({-1}).nonzero().squeeze(1);
    const at::Tensor ce =
        at::cross_entropy_loss(lc.reshape({-1, lc.size(-1)}).index_select(0, keep),
                               ids.select(1, 0).narrow(1, 1, len - 1).reshape({-1}).index_select(0, keep));
    d.loss = d.loss + o_.sft_weight * ce;
    d.metrics["sft_loss"] = ce.item<double>();
  }
  return {d.loss, d.metrics};
}

}  // namespace dew

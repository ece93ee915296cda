// LMObjective (docs/lm.md): next-token cross entropy of a causal_transformer on rows of seq_len + 1
// ids, computed in fp32 over vocabulary chunks; validation perplexity on a fixed validation set and one
// sampled text per validation written to RUN/samples/step_N.txt.
//
//   auto lm = dew::data::lm_datasets().build(json{{"name", "fortunes"}}, 256);
//   auto obj = std::make_shared<dew::LMObjective>(model, lm, dew::LMObjectiveOptions{});
//   auto out = obj->loss(batch, step, gen);     // batch: {"tokens" [B, 257] (+ segment_ids, positions)}
//   // out.metrics: ce, perplexity, token_accuracy, tokens
#pragma once
#include "dew/data/lm_data.h"
#include "dew/nn/backbones/causal_transformer.h"
#include "dew/training/objective.h"

namespace dew {

/// Summed cross entropy of rows of hidden states against targets, with the output projection applied
/// one vocabulary chunk at a time (the logsumexp combined across chunks) in fp32.
struct ChunkedCE {
  at::Tensor loss_sum;  // scalar float32: sum over rows of logsumexp(logits) - logits[target]
  at::Tensor correct;   // scalar int64: rows whose argmax equals the target
};
/// hidden: [N, D]; weight: [V, D] (the head); targets: [N] int64 in [0, V); softcap: the model's
/// final_logit_softcap (0 = none); chunk: vocabulary columns per chunk (0 = all at once).
ChunkedCE chunked_cross_entropy(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets,
                                double softcap, int64_t chunk);

struct LMObjectiveOptions {
  int64_t seq_len = 256;
  int64_t pad_id = -1;
  std::string loss_role = "all";
  int64_t vocab_chunk = 8192;
  double ema_decay = 0.0;
  int64_t val_windows = 0;
  int64_t val_batch = 32;
  int64_t sample_tokens = 200;
  std::string sample_prompt;
  double sample_temperature = 0.8;
  int64_t sample_top_k = 0;
  template <class V>
  void visit(V& v) {
    v("seq_len", seq_len, "tokens per training row S (rows hold S + 1 ids: inputs ids[:S], targets ids[1:])");
    v("pad_id", pad_id, "targets equal to pad_id carry no loss (-1 = none)");
    v.choice("loss_role", loss_role, {"all", "loss_mask"},
             "which targets count: all, or where batch loss_mask is true");
    v("vocab_chunk", vocab_chunk, "vocabulary columns per cross-entropy chunk (0 = one chunk)");
    v("ema_decay", ema_decay, "EMA decay of the parameters (0 = none: validation uses the live weights)");
    v("val_windows", val_windows, "validation windows (0 = the whole validation stream)");
    v("val_batch", val_batch, "windows per validation forward");
    v("sample_tokens", sample_tokens, "tokens of the text sampled at each validation (0 = none)");
    v("sample_prompt", sample_prompt, "prompt of that sample (empty = a new document, as after an EOS)");
    v("sample_temperature", sample_temperature, "temperature of that sample");
    v("sample_top_k", sample_top_k, "top-k of that sample (0 = off)");
  }
};

class LMObjective : public Objective {
 public:
  /// `data` supplies the validation stream, EOS and the tokenizer spec (may be null: no validation).
  LMObjective(nn::CausalTransformer model, data::LMDataPtr data, LMObjectiveOptions options);
  std::string name() const override { return "lm"; }
  torch::nn::Module& module() override { return *model_; }
  /// batch: "tokens" int64 [B, S + 1] (+ "segment_ids", "positions" [B, S + 1], "loss_mask" bool [B, S + 1]
  /// for loss_role loss_mask: entry t + 1 marks target t). Metrics: ce, perplexity, token_accuracy, tokens.
  LossOutput loss(const data::Batch& batch, int64_t step, at::Generator gen) override;
  /// Data-parallel: rows [begin, end) of the batch, their summed CE over the target count of the whole batch
  /// (every rank holds it), so the ranks' parts add up to the one-process token mean even when the loss mask
  /// leaves the rows different counts; the logged ce and perplexity are the whole batch's (one sum over the
  /// ranks).
  LossOutput loss_of_rows(const data::Batch& batch, int64_t begin, int64_t end, int64_t step,
                          at::Generator gen) override;
  void bind_distributed(std::shared_ptr<training::Distributed> dist) override { dist_ = std::move(dist); }
  /// val/ce, val/perplexity, val/token_accuracy over the fixed validation windows; writes one sampled text
  /// to RUN/samples/step_N.txt.
  std::map<std::string, double> validate(int64_t step, const std::string& run_dir) override;
  /// The same metrics (without the prefix) of any batch of windows, without gradients.
  std::map<std::string, double> evaluate(const data::Batch& windows);
  training::EmaSpec ema() const override { return {o_.ema_decay}; }
  std::vector<std::string> batch_fields() const override;
  nn::CausalTransformer model() const { return model_; }
  const LMObjectiveOptions& options() const { return o_; }

 private:
  // Summed CE, correct count and target count of a batch (differentiable loss_sum).
  std::tuple<at::Tensor, at::Tensor, int64_t> sums(const data::Batch& batch);
  // [B, S] bool on `device`: the targets that carry loss (not padding; the loss mask's); undefined = all.
  at::Tensor carries(const data::Batch& batch, const c10::Device& device) const;
  std::shared_ptr<training::Distributed> dist_;
  nn::CausalTransformer model_;
  data::LMDataPtr data_;
  LMObjectiveOptions o_;
  data::Batch val_;
};

}  // namespace dew

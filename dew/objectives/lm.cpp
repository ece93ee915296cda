#include "dew/objectives/lm.h"

#include <cmath>
#include <filesystem>
#include <fstream>

#include "dew/core/error.h"
#include "dew/data/tokenizer.h"
#include "dew/sampling/generate.h"
#include "dew/training/distributed.h"
#include "dew/training/run_dir.h"

namespace fs = std::filesystem;

namespace dew {

using at::Tensor;

ChunkedCE chunked_cross_entropy(const Tensor& hidden, const Tensor& weight, const Tensor& targets, double softcap,
                                int64_t chunk) {
  DEW_CHECK(hidden.dim() == 2 && weight.dim() == 2 && hidden.size(1) == weight.size(1),
            "chunked_cross_entropy: hidden ", hidden.sizes(), " and weight ", weight.sizes(),
            " must be [N, D] and [V, D]");
  DEW_CHECK(targets.dim() == 1 && targets.size(0) == hidden.size(0), "chunked_cross_entropy: targets ", targets.sizes(),
            " must be [", hidden.size(0), "]");
  DEW_CHECK(chunk >= 0, "chunked_cross_entropy: chunk must be >= 0, got ", chunk);
  const int64_t n = hidden.size(0), v = weight.size(0);
  const int64_t c = chunk > 0 ? std::min(chunk, v) : v;
  const Tensor w = weight.scalar_type() == hidden.scalar_type() ? weight : weight.to(hidden.scalar_type());
  const Tensor tgt = targets.view({n, 1});
  std::vector<Tensor> lses, maxes, argmaxes;
  Tensor target_logit = at::zeros({n}, hidden.options().dtype(at::kFloat));
  for (int64_t s = 0; s < v; s += c) {
    const int64_t k = std::min(c, v - s);
    Tensor l = at::linear(hidden, w.narrow(0, s, k)).to(at::kFloat);  // [N, k]
    if (softcap > 0) l = at::tanh(l / softcap) * softcap;
    lses.push_back(at::logsumexp(l, -1));
    auto [mx, am] = l.max(-1);
    maxes.push_back(mx);
    argmaxes.push_back(am + s);
    // This chunk's contribution to the target logit: rows whose target falls in [s, s + k).
    Tensor in = (tgt >= s).logical_and(tgt < s + k);  // [N, 1]
    Tensor local = (tgt - s).clamp(0, k - 1);         // [N, 1]
    target_logit = target_logit + l.gather(1, local).masked_fill(in.logical_not(), 0.0).squeeze(1);
  }
  Tensor lse = lses.size() == 1 ? lses[0] : at::logsumexp(at::stack(lses, 1), -1);  // [N]
  Tensor best = argmaxes.size() == 1
                    ? argmaxes[0]
                    : at::stack(argmaxes, 1).gather(1, std::get<1>(at::stack(maxes, 1).max(1, true))).squeeze(1);
  return {(lse - target_logit).sum(), (best == targets).sum()};
}

LMObjective::LMObjective(nn::CausalTransformer model, data::LMDataPtr data, LMObjectiveOptions options)
    : model_(std::move(model)), data_(std::move(data)), o_(std::move(options)) {
  DEW_CHECK(o_.seq_len > 0, "objective lm: seq_len must be > 0, got ", o_.seq_len);
  DEW_CHECK(o_.seq_len <= model_->options.max_seq_len(), "objective lm: seq_len ", o_.seq_len,
            " exceeds the model's max_seq_len ", model_->options.max_seq_len());
  DEW_CHECK(o_.pad_id >= -1 && o_.pad_id < model_->options.vocab_size(), "objective lm: pad_id must be in [-1, ",
            model_->options.vocab_size(), "), got ", o_.pad_id);
  DEW_CHECK(o_.loss_role == "all" || o_.loss_role == "loss_mask", "objective lm: loss_role: got \"", o_.loss_role,
            "\", accepted: all, loss_mask");
  DEW_CHECK(o_.vocab_chunk >= 0, "objective lm: vocab_chunk must be >= 0, got ", o_.vocab_chunk);
  DEW_CHECK(o_.ema_decay >= 0 && o_.ema_decay <= 1, "objective lm: ema_decay must be in [0, 1], got ", o_.ema_decay);
  DEW_CHECK(o_.val_windows >= 0 && o_.val_batch > 0, "objective lm: val_windows must be >= 0 and val_batch > 0");
  DEW_CHECK(o_.sample_tokens >= 0 && o_.sample_temperature >= 0 && o_.sample_top_k >= 0,
            "objective lm: sample_tokens, sample_temperature and sample_top_k must be >= 0");
  if (data_) {
    DEW_CHECK(data_->vocab_size <= model_->options.vocab_size(), "objective lm: the data's vocab_size ",
              data_->vocab_size, " exceeds the model's ", model_->options.vocab_size());
    DEW_CHECK(data_->seq_len == o_.seq_len, "objective lm: data windows hold seq_len ", data_->seq_len,
              ", the objective expects ", o_.seq_len);
    if (data_->val_tokens > o_.seq_len) val_ = data_->validation(o_.val_windows);
  }
}

std::vector<std::string> LMObjective::batch_fields() const {
  std::vector<std::string> f{"tokens"};
  if (data_ && data_->packed) {
    f.push_back("segment_ids");
    f.push_back("positions");
  }
  if (o_.loss_role == "loss_mask") f.push_back("loss_mask");
  return f;
}

std::tuple<Tensor, Tensor, int64_t> LMObjective::sums(const data::Batch& batch) {
  auto it = batch.find("tokens");
  DEW_CHECK(it != batch.end(), "objective lm: the batch has no \"tokens\" field");
  const auto device = model_->head_weight().device();  // batches arrive on the CPU
  const Tensor tokens = it->second.to(device);
  DEW_CHECK(tokens.dim() == 2 && tokens.size(1) == o_.seq_len + 1,
            "objective lm: tokens must be [B, seq_len + 1 = ", o_.seq_len + 1, "], got ", tokens.sizes());
  const int64_t s = o_.seq_len;
  auto field = [&](const char* name) {
    auto f = batch.find(name);
    return f == batch.end() ? Tensor() : f->second.narrow(1, 0, s).to(device);
  };
  const Tensor inputs = tokens.narrow(1, 0, s), targets = tokens.narrow(1, 1, s);
  Tensor h = model_->hidden_states(inputs, field("positions"), field("segment_ids"));  // [B, S, D]
  const Tensor keep = carries(batch, device);
  Tensor hf = h.reshape({-1, h.size(-1)}), tf = targets.reshape({-1});
  if (keep.defined()) {
    Tensor idx = keep.reshape({-1}).nonzero().squeeze(1);
    hf = hf.index_select(0, idx);
    tf = tf.index_select(0, idx);
  }
  auto ce = chunked_cross_entropy(hf, model_->head_weight(), tf, model_->options.final_logit_softcap(), o_.vocab_chunk);
  return {ce.loss_sum, ce.correct, tf.size(0)};
}

Tensor LMObjective::carries(const data::Batch& batch, const c10::Device& device) const {
  const int64_t s = o_.seq_len;
  Tensor keep;
  if (o_.pad_id >= 0) keep = batch.at("tokens").narrow(1, 1, s).to(device) != o_.pad_id;
  if (o_.loss_role == "loss_mask") {
    auto f = batch.find("loss_mask");
    DEW_CHECK(f != batch.end(), "objective lm: loss_role \"loss_mask\" needs a batch field \"loss_mask\"");
    Tensor m = f->second.narrow(1, 1, s).to(device, at::kBool);
    keep = keep.defined() ? keep.logical_and(m) : m;
  }
  return keep;
}

LossOutput LMObjective::loss_of_rows(const data::Batch& batch, int64_t begin, int64_t end, int64_t step,
                                     at::Generator gen) {
  auto it = batch.find("tokens");
  DEW_CHECK(it != batch.end(), "objective lm: the batch has no \"tokens\" field");
  const int64_t rows = it->second.size(0);
  const Tensor keep = carries(batch, at::kCPU);
  const int64_t total = keep.defined() ? keep.sum().item<int64_t>() : rows * o_.seq_len;
  DEW_CHECK(total > 0, "objective lm: the batch has no target that carries loss (all padding or masked)");
  data::Batch mine;
  for (const auto& [name, t] : batch) mine[name] = t.dim() > 0 ? t.narrow(0, begin, end - begin) : t;
  auto [loss_sum, correct, count] = sums(mine);
  // The trainer weighs this rank's loss by its share of the rows; its part of the token mean is loss_sum / total.
  const double share = double(end - begin) / double(rows);
  Tensor loss = count > 0 ? loss_sum / (double(total) * share) : model_->head_weight().sum() * 0.0;
  const double part = count > 0 ? loss_sum.item<double>() : 0.0;
  const double ce = (dist_ ? dist_->sum({part})[0] : part) / double(total);
  return {loss,
          {{"ce", ce},  // the whole batch's, on every rank: its share-weighted sum is itself
           {"perplexity", std::exp(ce)},
           {"token_accuracy", (count > 0 ? correct.item<double>() : 0.0) / (double(total) * share)},
           {"tokens", double(count) / share}}};
}

LossOutput LMObjective::loss(const data::Batch& batch, int64_t step, at::Generator gen) {
  auto it = batch.find("tokens");
  DEW_CHECK(it != batch.end(), "objective lm: the batch has no \"tokens\" field");
  return loss_of_rows(batch, 0, it->second.size(0), step, gen);
}

std::map<std::string, double> LMObjective::evaluate(const data::Batch& windows) {
  const bool was_training = model_->is_training();
  model_->eval();
  at::NoGradGuard ng;
  const int64_t n = windows.at("tokens").size(0);
  double loss_sum = 0, correct = 0;
  int64_t count = 0;
  for (int64_t s = 0; s < n; s += o_.val_batch) {
    data::Batch part;
    for (const auto& [k, v] : windows) part[k] = v.narrow(0, s, std::min(o_.val_batch, n - s));
    auto [l, c, k] = sums(part);
    loss_sum += l.item<double>();
    correct += c.item<double>();
    count += k;
  }
  if (was_training) model_->train();
  DEW_CHECK(count > 0, "objective lm: no validation target carries loss");
  const double ce = loss_sum / double(count);
  return {
      {"ce", ce}, {"perplexity", std::exp(ce)}, {"token_accuracy", correct / double(count)}, {"tokens", double(count)}};
}

std::map<std::string, double> LMObjective::validate(int64_t step, const std::string& run_dir) {
  std::map<std::string, double> out;
  if (val_.empty()) return out;
  for (const auto& [k, v] : evaluate(val_)) out["val/" + k] = v;
  if (o_.sample_tokens > 0 && !data_->tokenizer.is_null()) {
    auto tok = data::load_tokenizer(data_->tokenizer);
    std::vector<int64_t> prompt = tok->encode(o_.sample_prompt);
    if (prompt.empty()) {
      DEW_CHECK(data_->eos_id >= 0, "objective lm: an empty sample_prompt needs a tokenizer with EOS");
      prompt = {data_->eos_id};  // after an EOS: the start of a new document
    }
    sampling::GenerationOptions g;
    g.max_new_tokens = std::min(o_.sample_tokens, model_->options.max_seq_len() - int64_t(prompt.size()));
    g.temperature = o_.sample_temperature;
    g.top_k = o_.sample_top_k;
    g.eos_id = data_->eos_id;
    g.seed = uint64_t(step);
    auto res = sampling::generate_tokens(*model_, {prompt}, g);
    const training::RunDir run(run_dir);
    fs::create_directories(run.samples());
    std::ofstream f(run.sample(step, ".txt"));
    f << o_.sample_prompt << tok->decode(res.tokens[0]) << "\n";
  }
  return out;
}

}  // namespace dew

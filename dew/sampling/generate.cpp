#include "dew/sampling/generate.h"

#include <limits>

#include "dew/core/error.h"
#include "dew/core/rng.h"
#include "dew/io/stops.h"

namespace dew::sampling {

using at::Tensor;

void validate(const GenerationOptions& o) {
  DEW_CHECK(o.max_new_tokens >= 0, "generate: max_new_tokens must be >= 0, got ", o.max_new_tokens);
  DEW_CHECK(o.temperature >= 0, "generate: temperature must be >= 0 (0 = greedy), got ", o.temperature);
  DEW_CHECK(o.top_k >= 0, "generate: top_k must be >= 0 (0 = off), got ", o.top_k);
  DEW_CHECK(o.top_p > 0 && o.top_p <= 1, "generate: top_p must be in (0, 1], got ", o.top_p);
  DEW_CHECK(o.min_p >= 0 && o.min_p < 1, "generate: min_p must be in [0, 1), got ", o.min_p);
  DEW_CHECK(o.repetition_penalty > 0, "generate: repetition_penalty must be > 0 (1 = off), got ", o.repetition_penalty);
  DEW_CHECK(o.padding == "left" || o.padding == "right", "generate: padding: got \"", o.padding,
            "\", accepted: left, right");
  DEW_CHECK(o.first_row >= 0, "generate: first_row must be >= 0, got ", o.first_row);
  for (const auto& s : o.stop) DEW_CHECK(!s.empty(), "generate: stop strings must not be empty");
  DEW_CHECK(o.stop.empty() || o.decode, "generate: stop strings need a decode function");
}

Tensor process_logits(const Tensor& logits, const Tensor& seen, const GenerationOptions& o) {
  DEW_CHECK(logits.dim() == 2, "process_logits: logits must be [B, V], got ", logits.sizes());
  const double inf = std::numeric_limits<double>::infinity();
  Tensor x = logits.to(at::kFloat);
  if (seen.defined() && o.repetition_penalty != 1.0) {
    // CTRL (Keskar et al. 2019): a seen token's positive logit is divided by the penalty, a negative one multiplied.
    Tensor penalised = at::where(x > 0, x / o.repetition_penalty, x * o.repetition_penalty);
    x = at::where(seen, penalised, x);
  }
  if (o.temperature > 0 && o.temperature != 1.0) x = x / o.temperature;
  const int64_t v = x.size(1);
  if (o.top_k > 0 && o.top_k < v) {
    Tensor kth = std::get<0>(x.topk(o.top_k, -1)).narrow(-1, o.top_k - 1, 1);  // [B, 1]
    x = x.masked_fill(x < kth, -inf);
  }
  if (o.top_p < 1.0) {
    auto [sorted, order] = x.sort(-1, /*descending=*/true);
    Tensor p = at::softmax(sorted, -1);
    // Drop a token when the tokens ranked above it already reach top_p (the first one always stays).
    Tensor drop_sorted = (p.cumsum(-1) - p) >= o.top_p;
    Tensor drop = at::zeros_like(drop_sorted).scatter(-1, order, drop_sorted);
    x = x.masked_fill(drop, -inf);
  }
  if (o.min_p > 0) {
    Tensor p = at::softmax(x, -1);
    Tensor pmax = std::get<0>(p.max(-1, /*keepdim=*/true));
    x = x.masked_fill(p < pmax * o.min_p, -inf);
  }
  return x;
}

namespace {

// One draw per row from probs [B, V] (rows summing to 1, float): the first token whose cumulative probability
// (float64) exceeds u * total, u in [0, 1) from (the row's stream, step) alone. A token of probability 0 is never
// drawn (its cumulative sum equals its predecessor's).
Tensor draw_rows(const Tensor& probs, const std::vector<uint64_t>& streams, int64_t step) {
  const int64_t b = probs.size(0);
  std::vector<double> u(static_cast<size_t>(b));
  for (int64_t i = 0; i < b; ++i)
    u[size_t(i)] = double(rng::derive(streams[size_t(i)], uint64_t(step), "token") >> 11) * 0x1p-53;
  const Tensor cdf = probs.to(at::kDouble).cumsum(-1);  // [B, V]
  const Tensor target = at::tensor(u, at::kDouble).view({b, 1}) * cdf.narrow(1, probs.size(1) - 1, 1);
  return at::searchsorted(cdf, target, /*out_int32=*/false, /*right=*/true).squeeze(1).clamp_max(probs.size(1) - 1);
}

}  // namespace

GenerationResult generate_tokens(nn::CausalTransformerImpl& model, const std::vector<std::vector<int64_t>>& prompts,
                                 const GenerationOptions& o) {
  validate(o);
  const int64_t b = int64_t(prompts.size());
  DEW_CHECK(b > 0, "generate: no prompts");
  const int64_t vocab = model.options.vocab_size();
  int64_t longest = 0;
  for (size_t i = 0; i < prompts.size(); ++i) {
    DEW_CHECK(!prompts[i].empty(), "generate: prompt ", i, " is empty (start it with at least one token, e.g. EOS)");
    for (int64_t id : prompts[i])
      DEW_CHECK(id >= 0 && id < vocab, "generate: prompt ", i, " has id ", id, " outside [0, ", vocab, ")");
    longest = std::max<int64_t>(longest, int64_t(prompts[i].size()));
  }
  DEW_CHECK(o.pad_id >= 0 && o.pad_id < vocab, "generate: pad_id ", o.pad_id, " outside [0, ", vocab, ")");
  DEW_CHECK(longest + o.max_new_tokens <= model.options.max_seq_len(), "generate: the longest prompt (", longest,
            ") plus max_new_tokens (", o.max_new_tokens, ") exceeds the model's max_seq_len ",
            model.options.max_seq_len());

  const auto device = model.head_weight().device();
  const bool left = o.padding == "left";
  Tensor ids = at::full({b, longest}, o.pad_id, at::kLong);
  Tensor mask = at::zeros({b, longest}, at::kBool);
  Tensor seen = at::zeros({b, vocab}, at::kBool);
  std::vector<int64_t> last(static_cast<size_t>(b));  // column of each row's last prompt token
  for (int64_t i = 0; i < b; ++i) {
    const auto& p = prompts[size_t(i)];
    const int64_t n = int64_t(p.size()), off = left ? longest - n : 0;
    Tensor t = at::tensor(p, at::kLong);
    ids[i].narrow(0, off, n).copy_(t);
    mask[i].narrow(0, off, n).fill_(true);
    seen[i].index_fill_(0, t, true);
    last[size_t(i)] = off + n - 1;
  }
  ids = ids.to(device);
  mask = mask.to(device);
  seen = seen.to(device);

  GenerationResult out;
  out.tokens.resize(size_t(b));
  out.logprobs.resize(size_t(b));
  out.raw_logprobs.resize(size_t(b));
  out.finish_reason.assign(size_t(b), "length");
  if (o.max_new_tokens == 0) {
    out.lengths.assign(size_t(b), 0);
    return out;
  }

  const bool was_training = model.is_training();
  model.eval();
  at::NoGradGuard ng;
  nn::KVCache cache;
  std::vector<uint64_t> streams;  // each row's sampling stream, from (seed, first_row + row)
  for (int64_t i = 0; i < b; ++i) streams.push_back(rng::derive(o.seed, uint64_t(o.first_row + i), "generate/sample"));
  Tensor logits = model.forward_tokens(ids, {}, {}, mask, &cache);  // [B, L, V]
  Tensor next_logits = logits.gather(1, at::tensor(last, at::kLong).to(device).view({b, 1, 1}).expand({b, 1, vocab}))
                           .squeeze(1);  // [B, V]
  std::vector<bool> done(static_cast<size_t>(b), false);
  for (int64_t step = 0; step < o.max_new_tokens; ++step) {
    io::check_stop();
    Tensor proc = process_logits(next_logits, seen, o);
    Tensor tok;
    if (o.temperature == 0) {
      tok = proc.argmax(-1);  // [B]
    } else {
      tok = draw_rows(at::softmax(proc, -1).cpu(), streams, step).to(device);
    }
    Tensor tok_col = tok.view({b, 1});
    // log p of the chosen tokens only: logit - logsumexp, no [B, V] log-softmax. Without any processing
    // (greedy or plain temperature 1) the processed and raw log-probs are the same numbers.
    auto chosen_logprob = [&](const Tensor& l) {
      return (l.gather(1, tok_col).squeeze(1) - at::logsumexp(l, -1)).to(at::kDouble).cpu().contiguous();
    };
    const Tensor raw = next_logits.scalar_type() == at::kFloat ? next_logits : next_logits.to(at::kFloat);
    const Tensor lp = chosen_logprob(proc);
    const Tensor rlp = proc.is_same(raw) ? lp : chosen_logprob(raw);
    const Tensor tok_cpu = tok.cpu().contiguous();
    const int64_t* tv = tok_cpu.data_ptr<int64_t>();
    const double* lv = lp.data_ptr<double>();
    const double* rv = rlp.data_ptr<double>();
    std::vector<int64_t> active(static_cast<size_t>(b), 0);
    for (int64_t i = 0; i < b; ++i) {
      active[size_t(i)] = !done[size_t(i)];
      if (done[size_t(i)]) continue;
      const int64_t t = tv[i];
      auto& row = out.tokens[size_t(i)];
      row.push_back(t);
      out.logprobs[size_t(i)].push_back(lv[i]);
      out.raw_logprobs[size_t(i)].push_back(rv[i]);
      if (o.eos_id >= 0 && t == o.eos_id) {
        done[size_t(i)] = true;
        out.finish_reason[size_t(i)] = "eos";
      } else if (!o.stop.empty()) {
        const std::string text = o.decode(row);
        for (const auto& s : o.stop) {
          if (text.find(s) != std::string::npos) {
            done[size_t(i)] = true;
            out.finish_reason[size_t(i)] = "stop";
            break;
          }
        }
      }
    }
    bool all_done = true;
    for (bool d : done) all_done = all_done && d;
    if (all_done || step + 1 == o.max_new_tokens) break;
    // Rows that finished earlier feed a masked token: nobody attends to it. While every row is still
    // going there is no mask (the model then needs none).
    bool all_active = true;
    for (int64_t a : active) all_active = all_active && a;
    Tensor step_mask = all_active ? Tensor() : at::tensor(active, at::kLong).to(at::kBool).view({b, 1}).to(device);
    if (o.repetition_penalty != 1.0) seen.scatter_(1, tok_col, true);  // only the penalty reads it
    next_logits = model.forward_tokens(tok_col, {}, {}, step_mask, &cache).select(1, 0);
  }
  if (was_training) model.train();
  for (const auto& row : out.tokens) out.lengths.push_back(int64_t(row.size()));
  return out;
}

}  // namespace dew::sampling

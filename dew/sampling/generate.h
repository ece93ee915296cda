// Autoregressive generation with a KV cache (docs/lm.md): the prompts are run once (prefill), then
// one token per step attends to the cache. A batch of prompts of different lengths is padded on the left
// or the right; padding is masked out of attention and does not advance positions, so each row's
// tokens equal what it gets alone.
//
//   dew::sampling::GenerationOptions g;
//   g.max_new_tokens = 100;
//   g.temperature = 0.8;          // 0 = greedy
//   g.top_p = 0.95;
//   g.eos_id = tok->eos_id();
//   auto out = dew::sampling::generate_tokens(*model, {tok->encode("Q: "), tok->encode("Why")}, g);
//   std::string text = tok->decode(out.tokens[0]);
//
// Logit processing order (as Hugging Face transformers): repetition penalty, temperature, top-k, top-p,
// min-p; sampling draws from the processed distribution by inverting its CDF at a uniform that is a pure
// function of (seed, first_row + row, token index): a row's tokens do not depend on the other rows of its
// batch, so prompts split over chunks or ranks sample what one batch of them samples.
#pragma once
#include <functional>
#include <string>
#include <vector>

#include "dew/nn/backbones/causal_transformer.h"

namespace dew::sampling {

struct GenerationOptions {
  int64_t max_new_tokens = 128;     // tokens generated per prompt at most
  double temperature = 1.0;         // 0 = greedy (argmax of the penalised logits)
  int64_t top_k = 0;                // keep the k most likely tokens (0 = off)
  double top_p = 1.0;               // keep the smallest set with probability >= top_p (1 = off)
  double min_p = 0.0;               // drop tokens with p < min_p * p_max (0 = off)
  double repetition_penalty = 1.0;  // CTRL penalty on tokens already in the row (1 = off)
  int64_t eos_id = -1;              // a row stops after generating it (-1 = none)
  std::vector<std::string> stop;    // a row stops once its decoded new text contains one of these
  std::function<std::string(const std::vector<int64_t>&)> decode;  // needed for `stop`
  uint64_t seed = 0;             // sampling is a pure function of (model, prompts, options)
  int64_t first_row = 0;         // row i draws from the stream of row first_row + i (see generate_tokens)
  std::string padding = "left";  // left | right: where a short prompt's padding goes in the batch
  int64_t pad_id = 0;            // id placed in padding slots (masked out; any valid id)
};

/// Throws dew::Error naming the first invalid field.
void validate(const GenerationOptions& o);

struct GenerationResult {
  std::vector<std::vector<int64_t>> tokens;       // new tokens per prompt (EOS or the stop token included)
  std::vector<int64_t> lengths;                   // tokens[i].size()
  std::vector<std::vector<double>> logprobs;      // log p of each token under the processed (sampled) distribution
  std::vector<std::vector<double>> raw_logprobs;  // log p under the model's own distribution (no processing)
  std::vector<std::string> finish_reason;         // "eos", "stop" or "length"
};

/// Processes next-token logits [B, V] (float32) for sampling: repetition penalty over `seen` ([B, V]
/// bool, tokens already in each row; undefined = none), temperature (not applied when 0), top-k, top-p,
/// min-p. Removed tokens get -inf. Returns [B, V] float32.
at::Tensor process_logits(const at::Tensor& logits, const at::Tensor& seen, const GenerationOptions& o);

/// Generates continuations of `prompts` (each non-empty, ids in the model's vocabulary).
GenerationResult generate_tokens(nn::CausalTransformerImpl& model, const std::vector<std::vector<int64_t>>& prompts,
                                 const GenerationOptions& o);

}  // namespace dew::sampling

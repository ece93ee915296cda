// `dew bench --one CASE`: one configuration of one case in this process, the measured child of a sweep. It
// builds the case's model and a fixed batch, times the case's work through timed_loop (the trainer's own step
// for the training-step cases) and returns the result line the sweep parses (the keys its Python peer prints).
//
//   bench::OneOptions o;
//   o.threads = 1;
//   std::cout << bench::run_one(bench::find_case("unet"), o).dump() << std::endl;
#pragma once
#include <c10/core/Device.h>

#include <string>

#include "dew/bench/cases.h"
#include "dew/core/options.h"

namespace dew::bench {

struct OneOptions {
  Sizes sizes;                    // batch, steps, warmup, ... (each unset one the case's default)
  int64_t threads = 1;            // LibTorch intra-op threads; the BLAS's come from OPENBLAS_NUM_THREADS
  std::string profile;            // non-empty: a Chrome trace of the timed steps (lm: FILE.generate.json too)
  c10::Device device{c10::kCPU};  // both the model and the batch
  std::string overlap;            // ddp: dist.overlap (auto, on, off); empty: the recipe's
};

/// Times case c and returns its result line: ms_per_step, samples_per_s, peak_rss_mb, params, threads,
/// blas_threads, blas_core, phases_ms {forward, backward, optimizer}, loss, torch; lm adds tokens_per_s,
/// gen_ms_per_token and prefill_ms, dpo tokens_per_s, grpo_rollout tokens_per_s and prefill_ms, train data_ms;
/// ddp data_ms, ranks, allreduce_ms, allreduce_share and allreduce_exposed_ms. ddp under `dew launch` (WORLD_SIZE
/// set) runs one rank: rank 0 returns the run's line, the other ranks null.
json run_one(const BenchCase& c, const OneOptions& o);

}  // namespace dew::bench

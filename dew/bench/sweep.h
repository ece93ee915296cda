// `dew bench`'s parent: every (case, side, thread configuration) in a fresh process, rounds sweeping all of them
// with C++ and Python alternating, then the training-step cases' peers under torch.compile, then the report.
//
//   bench::SweepOptions o;
//   o.cases = bench::select_cases("unet,lm");
//   o.program = "/path/to/dew";          // its children run `dew bench --one CASE ...`
//   o.peer.python = ".venv/bin/python";
//   std::cout << bench::sweep(o, std::cerr);
#pragma once
#include <c10/core/Device.h>

#include <ostream>
#include <string>
#include <vector>

#include "dew/bench/cases.h"
#include "dew/bench/peers.h"

namespace dew::bench {

struct SweepOptions {
  std::vector<const BenchCase*> cases;  // in the order of the summary
  Sizes sizes;
  std::vector<int64_t> threads = {1, 2};       // LibTorch intra-op thread counts to try
  std::vector<int64_t> blas_threads = {1, 2};  // BLAS thread counts to try (OPENBLAS_NUM_THREADS)
  int64_t rounds = 2;                          // measurements per configuration and side; the fastest is kept
  c10::Device device{c10::kCPU};               // for both sides
  std::string program;                         // the dew binary the C++ children re-execute
  bool peers = true;                           // false: C++ only (--no-peer)
  bool compile = true;                         // false: no torch.compile runs (--no-compile)
  PeerOptions peer;
  std::vector<std::string> command;  // the arguments `dew bench` was given, for the report
};

/// Runs the sweep, with a progress line per measurement on `log`, and returns the report (Markdown).
std::string sweep(const SweepOptions& o, std::ostream& log);

}  // namespace dew::bench

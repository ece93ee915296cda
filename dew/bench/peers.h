// The processes of a `dew bench` sweep: every (case, side, thread configuration) runs in a fresh child, the dew
// binary re-executed with `bench --one CASE` or the case's Python peer (bench/*.py), and prints one JSON result
// line. This finds the peers and probes their Python, builds both sides' command lines and parses the results.
//
//   bench::Peers peers = bench::find_peers(options, cases, program, /*enabled=*/true, std::cerr);
//   auto argv = bench::peer_argv(peers, c, fields, params, args);   // empty: the case runs C++ only
//   for (auto& a : bench::child_args(c, sizes, 1, "cpu")) argv.push_back(a);
//   bench::Measurement m = bench::measure_child(argv, 1, 1, "unet Python", peers.env, peers.unset);
#pragma once
#include <map>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "dew/bench/cases.h"
#include "dew/core/options.h"

namespace dew::bench {

/// One child's result line: a run of one (case, side, thread configuration). Times in ms.
struct Measurement {
  int64_t intra = 0, blas = 0;
  double ms = 0, samples_per_s = 0, peak_mb = 0;
  double fwd = 0, bwd = 0, opt = 0;
  double tokens_per_s = 0, gen_ms_per_token = 0, prefill_ms = 0;  // lm, dpo, grpo_rollout
  double sample_ms = 0, sample_cached_ms = 0;  // qwen_image: ms per sampling step without / with the KV cache
  double sample_cache_max_diff = 0;            // qwen_image: the two samplings' final latents apart
  double data_ms = 0;                          // train: waiting for the loader
  double compile_s = 0;  // the Python peer under torch.compile: its first step's time beyond a steady step
  int64_t ranks = 1;     // ddp: the processes of the data-parallel run
  double allreduce_ms = 0, allreduce_share = 0;  // ddp: the gradient all-reduce per step and its share of the step
  double allreduce_exposed_ms = 0;               // ddp: the part of it not overlapped with backward
  int64_t params = 0;
  std::string torch, blas_core;
};

/// Runs argv (argv[0] a path) with OPENBLAS_NUM_THREADS = blas, `env` added and `unset` removed, and parses the
/// last line of its stdout (anything before it is the child's own chatter). dew::Error naming `what` and the
/// command when it fails or prints no result line.
Measurement measure_child(const std::vector<std::string>& argv, int64_t intra, int64_t blas, const std::string& what,
                          std::map<std::string, std::string> env = {}, const std::vector<std::string>& unset = {});

/// The flags that say where the peers come from and how they run.
struct PeerOptions {
  std::string python;                        // the interpreter of every peer
  std::map<std::string, std::string> files;  // scripts given by flag: "peer", "lm-peer", "sd-peer", ... -> FILE
  std::string diffusers_src;                 // the SD peer imports diffusers from this checkout ("" = installed)
  std::optional<std::string> coretype;       // OPENBLAS_CORETYPE for the peers (--peer-coretype)
  bool malloc_like_dew = false;              // the peers get dew's malloc settings (--peer-malloc-like-dew)
};

/// The peers of a sweep: each kind's script, what their Python reported and why a peer does not run.
struct Peers {
  std::string python;
  std::map<CaseKind, std::string> scripts;  // a kind without one (or "") runs C++ only
  std::string torch;                        // the peer Python's torch.__version__ ("" when none ran)
  std::string diffusers;                    // the SD peer's --probe line, e.g. "diffusers 0.42.1 (PATH)"
  std::string diffusers_src;
  std::string note, lm_note;  // "Python peer skipped: ..." of the diffusion table and the lm ("" when they run)
  std::string sd_note;        // "peer: unavailable (...)" of the SD components ("" when they run)
  std::optional<std::string> coretype;
  bool malloc_like_dew = false;
  std::map<std::string, std::string> env;  // the peers' environment: added
  std::vector<std::string> unset;          // and removed
  /// The script of kind k; "" when it runs C++ only.
  const std::string& script(CaseKind k) const;
};

/// Finds the peer of every kind among `cases` (its flag's file, else bench/FILE beside the build directory of
/// `program`, the dew binary, else under the working directory) and probes the Python and the SD peer's
/// diffusers; says on `log` why a peer does not run. `enabled` false (--no-peer): none runs, nothing is probed.
/// dew::Error when a flag names a file that does not exist.
Peers find_peers(const PeerOptions& o, const std::vector<const BenchCase*>& cases, const std::string& program,
                 bool enabled, std::ostream& log);

/// What a peer's command line carries besides its case.
struct PeerArgs {
  std::string optim_json;  // bench_optim as JSON (--optim)
  std::string train_data;  // train, ddp: the training images and labels dew dumped (safetensors)
  json train_record;       // train, ddp, sample: the prepared default recipe's run record, optim and trainer included
  Sizes sizes;
};

/// The peer's command for case c, built from `fields` (the complete model fields as JSON text; SD: the
/// config.json dict) with `params` parameters, which it checks; without child_args. Empty when c has no peer.
std::vector<std::string> peer_argv(const Peers& peers, const BenchCase& c, const std::string& fields, int64_t params,
                                   const PeerArgs& a);

/// The arguments both sides of case c get: its sizes, `threads` intra-op threads and the device.
std::vector<std::string> child_args(const BenchCase& c, const Sizes& s, int64_t threads, const std::string& device);

}  // namespace dew::bench

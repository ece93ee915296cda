// Data-parallel training on LibTorch's c10d (docs/distributed.md): torchrun's environment, the process
// group (Gloo on the CPU, NCCL on CUDA) over a TCPStore rendezvous, and the collectives the trainer needs:
// the broadcast of the model from rank 0, the bucketed gradient average, the agreement of flags (a
// non-finite loss, a stop request) and sums of logged numbers.
//
//   auto env = dew::training::read_dist_env();          // RANK, WORLD_SIZE, ... (world 1 when unset)
//   if (env.world_size > 1) {
//     auto pg = std::make_shared<dew::training::Distributed>(env, DistOptions{}, device);
//     pg->broadcast_module(model);                      // every rank starts from rank 0's weights
//     ... loss.backward(); pg->average_gradients(params);  // the mean gradient of the global batch
//   }
#pragma once
#include <torch/nn/module.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "dew/core/options.h"
#include "dew/training/optim.h"

namespace dew::training {

/// torchrun's variables of this process. `present` is false when WORLD_SIZE is unset (a one-process run).
struct DistEnv {
  int64_t rank = 0;
  int64_t local_rank = 0;
  int64_t world_size = 1;
  int64_t local_world_size = 1;
  std::string master_addr = "127.0.0.1";
  int64_t master_port = 29500;
  bool present = false;
  /// torchrun's agent already serves the TCPStore at MASTER_ADDR:MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE):
  /// rank 0 joins it as a client instead of serving it.
  bool agent_store = false;
  /// TORCHELASTIC_RESTART_COUNT (0 outside torchrun): keys of a restarted group do not meet the last ones.
  int64_t restart = 0;
};

/// Reads RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT. A value that is not
/// a number, out of range (RANK >= WORLD_SIZE, a port outside 1..65535) or missing while WORLD_SIZE is set
/// gives a dew::Error naming the variable, its value and what is accepted.
DistEnv read_dist_env();

/// The recipe's `dist` section (every kind has it; it does not take part in the resume identity).
struct DistOptions {
  std::string backend = "auto";
  double timeout = 300;
  double bucket_mb = 25;
  std::string overlap = "auto";
  template <class V>
  void visit(V& v) {
    v.choice("backend", backend, {"auto", "gloo", "nccl"},
             "collective backend when WORLD_SIZE > 1 (auto = nccl on CUDA, gloo on the CPU)");
    v("timeout", timeout, "seconds a rendezvous or collective waits for the other ranks before failing");
    v("bucket_mb", bucket_mb, "size of the flattened gradient buckets of one all-reduce, in MB");
    v.choice("overlap", overlap, {"auto", "on", "off"},
             "on: start each bucket's all-reduce as soon as backward has produced its gradients (the first "
             "bucket holds the last layers, at most 1 MB, as DDP's); off: all-reduce after the whole backward; "
             "auto: on with nccl, off with gloo (CPU ranks share the cores backward uses: measured slower on)");
  }
};

void validate(const DistOptions& o);

/// Refuses a global batch the world size does not divide (each rank computes an equal share of it).
void check_global_batch(int64_t batch_size, int64_t world_size);

/// One process's membership of a data-parallel group: rank `rank()` of `world_size()`.
class Distributed {
 public:
  /// Rendezvous at env.master_addr:master_port (rank 0 serves the TCPStore), then the process group of
  /// o.backend for `device`. dew::Error, one line, when the port is taken, the world sizes disagree, a rank
  /// is started twice, or the others do not arrive within o.timeout.
  Distributed(const DistEnv& env, const DistOptions& o, const c10::Device& device);
  ~Distributed();
  Distributed(const Distributed&) = delete;
  Distributed& operator=(const Distributed&) = delete;

  int64_t rank() const { return rank_; }
  int64_t world_size() const { return world_; }
  bool is_main() const { return rank_ == 0; }
  const std::string& backend() const { return backend_; }

  /// Copies rank 0's parameters and buffers into every rank's `m` (in m's stable parameter order).
  void broadcast_module(torch::nn::Module& m);
  /// Replaces each gradient by its mean over the ranks: flattened buckets of about bucket_mb (same dtype
  /// and device), one SUM all-reduce each, divided by the world size. An undefined gradient counts as zeros
  /// (and becomes a zero tensor), so every rank runs the same collectives.
  void average_gradients(const NamedTensors& params);
  /// With dist.overlap on: called before the backward of a step's last micro-batch. Hooks on `params` copy each
  /// gradient (plus what earlier micro-batches accumulated) into its bucket as backward produces it and start
  /// the bucket's all-reduce once it is full, buckets in a fixed order on every rank (the parameters in
  /// reverse); the average_gradients() that follows waits for them and writes the means into the gradients,
  /// the same numbers the whole-backward path gives. With overlap off it does nothing.
  void arm_overlap(const NamedTensors& params);
  /// Element-wise sum of `values` over the ranks (float64 on the wire).
  std::vector<double> sum(const std::vector<double>& values);
  /// True on every rank when `flag` is true on any rank.
  bool any(bool flag);
  void barrier();
  /// Wall time spent in collectives since construction (the all-reduce share of a step).
  double collective_seconds() const { return collective_s_; }
  /// With dist.overlap: the share of the last step's gradient buckets whose all-reduce started during backward.
  double overlapped_share() const { return overlapped_; }
  /// With dist.overlap: seconds from the last step's first bucket all-reduce start to the end of the last one
  /// (the all-reduce in flight, overlapped or not); collective time outside backward is what average_gradients
  /// waited.
  double inflight_seconds() const { return inflight_s_; }

 private:
  struct Impl;
  struct Overlap;
  void finish_overlap(const NamedTensors& params);
  std::unique_ptr<Impl> impl_;
  int64_t rank_ = 0;
  int64_t world_ = 1;
  std::string backend_;
  double collective_s_ = 0;
  double overlapped_ = 0;
  double inflight_s_ = 0;
};

}  // namespace dew::training

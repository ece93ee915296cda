// `dew launch` as a library (docs/distributed.md): starts the ranks of one node of a data-parallel run, each
// a copy of this program with torchrun's variables set, and supervises them: a signal to the launcher goes
// to every rank (each checkpoints and exits), and when one rank fails the others are stopped after a short
// grace, so no process is left behind.
//
//   dew::runs::LaunchOptions o;
//   o.nproc_per_node = 2;
//   dew::runs::launch({"train", "diffusion", "--run", "runs/x"}, o);  // dew::Error naming a failed rank
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace dew::runs {

struct LaunchOptions {
  int64_t nproc_per_node = 1;             // ranks on this node
  int64_t nnodes = 1;                     // nodes of the run
  int64_t node_rank = 0;                  // this node, 0..nnodes-1 (node 0 holds rank 0 and the rendezvous)
  std::string master_addr = "127.0.0.1";  // rank 0's host
  int64_t master_port = 29500;            // the rendezvous port on master_addr
  int64_t threads = 0;                    // intra-op threads per rank (0 = usable cores / nproc_per_node)
  double grace_seconds = 5;               // after a rank fails: SIGTERM to the others, SIGKILL after this
};

/// Checks the options: dew::Error naming the flag, its value and what is accepted.
void validate(const LaunchOptions& o);

/// Runs this program (/proc/self/exe) with `args` as nproc_per_node ranks: RANK = node_rank * nproc_per_node
/// + LOCAL_RANK, WORLD_SIZE = nnodes * nproc_per_node, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
/// MASTER_PORT and OMP_NUM_THREADS set. Waits for all of them. Returns 0 when every rank exits 0; when a
/// rank exits non-zero or by a signal, stops the others and throws dew::Error naming the rank and its status.
int launch(const std::vector<std::string>& args, const LaunchOptions& o);

}  // namespace dew::runs

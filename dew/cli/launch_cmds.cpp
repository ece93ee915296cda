// `dew launch`: flags in, runs::launch, the exit status out.
#include <algorithm>
#include <iostream>

#include "dew/cli/commands.h"
#include "dew/cli/recipe.h"
#include "dew/runs/launch.h"

namespace dew::cli {

namespace {

const char* kLaunchUsage =
    "usage: dew launch --nproc-per-node N [--nnodes M --node-rank R --master-addr A --master-port P]\n"
    "                  [--threads T] [--grace S] -- train KIND [--a.b value ...]\n"
    "Starts N ranks of a data-parallel run on this node (docs/distributed.md): each runs `dew train ...` with\n"
    "torchrun's variables set (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT).\n"
    "  --nproc-per-node N  ranks on this node (one per GPU on CUDA)\n"
    "  --nnodes M          nodes of the run (default 1); start `dew launch` once on each\n"
    "  --node-rank R       this node, 0..M-1 (default 0; node 0 holds rank 0 and the rendezvous)\n"
    "  --master-addr A     rank 0's host (default 127.0.0.1)\n"
    "  --master-port P     rendezvous port on A (default 29500)\n"
    "  --threads T         intra-op threads per rank (default: usable cores / N)\n"
    "  --grace S           seconds the other ranks get to stop after one fails, then SIGKILL (default 5)\n"
    "SIGINT / SIGTERM go to every rank (each checkpoints and exits); a second one stops them at once.\n"
    "When a rank fails, the others are stopped and launch ends with one line naming the rank and its status.\n"
    "example: dew launch --nproc-per-node 2 -- train diffusion --run runs/ddp --trainer.steps 200\n";

}  // namespace

int cmd_launch(const std::vector<std::string>& args) {
  const auto dash = std::find(args.begin(), args.end(), "--");
  const std::vector<std::string> own(args.begin(), dash);
  if (own.empty() && dash == args.end()) {
    std::cout << kLaunchUsage;
    return 2;
  }
  if (std::find(own.begin(), own.end(), "--help") != own.end() ||
      std::find(own.begin(), own.end(), "-h") != own.end()) {
    std::cout << kLaunchUsage;
    return 0;
  }
  const Flags f =
      parse_flags(own, {"nproc-per-node", "nnodes", "node-rank", "master-addr", "master-port", "threads", "grace"});
  DEW_CHECK(f.positional.empty(), "launch: unexpected argument \"", f.positional.empty() ? "" : f.positional[0],
            "\" before --; the ranks' command goes after --, e.g. dew launch --nproc-per-node 2 -- train diffusion");
  DEW_CHECK(dash != args.end() && dash + 1 != args.end(),
            "launch: expected -- and the ranks' command, e.g. dew launch --nproc-per-node 2 -- train diffusion");
  DEW_CHECK(f.has("nproc-per-node"), "launch: --nproc-per-node N is required (ranks on this node)");
  runs::LaunchOptions o;
  o.nproc_per_node = f.get_int("nproc-per-node", 1);
  o.nnodes = f.get_int("nnodes", 1);
  o.node_rank = f.get_int("node-rank", 0);
  o.master_addr = f.get("master-addr", o.master_addr);
  o.master_port = f.get_int("master-port", o.master_port);
  o.threads = f.get_int("threads", 0);
  o.grace_seconds = f.get_double("grace", o.grace_seconds);
  return runs::launch(std::vector<std::string>(dash + 1, args.end()), o);
}

}  // namespace dew::cli

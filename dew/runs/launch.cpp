#include "dew/runs/launch.h"

#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>
#ifdef __linux__
#include <sys/prctl.h>
#endif

#include <atomic>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "dew/core/error.h"
#include "dew/core/log.h"
#include "dew/core/threads.h"

namespace dew::runs {

namespace {

std::atomic<int> g_launch_signal{0};
extern "C" void on_launch_signal(int sig) { g_launch_signal.store(sig); }

// "exit status 3" or "killed by SIGKILL".
std::string launch_status_text(int status) {
  if (WIFEXITED(status)) return "exit status " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    const char* name = sigabbrev_np(WTERMSIG(status));
    return std::string("killed by ") +
           (name ? std::string("SIG") + name : "signal " + std::to_string(WTERMSIG(status)));
  }
  return "status " + std::to_string(status);
}

}  // namespace

void validate(const LaunchOptions& o) {
  DEW_CHECK(o.nproc_per_node >= 1 && o.nproc_per_node <= 4096, "launch: --nproc-per-node ", o.nproc_per_node,
            "; accepted: 1..4096");
  DEW_CHECK(o.nnodes >= 1, "launch: --nnodes ", o.nnodes, "; accepted: >= 1");
  DEW_CHECK(o.node_rank >= 0 && o.node_rank < o.nnodes, "launch: --node-rank ", o.node_rank, "; accepted: 0..",
            o.nnodes - 1, " (--nnodes ", o.nnodes, ")");
  DEW_CHECK(!o.master_addr.empty(), "launch: --master-addr is empty; accepted: a host name or address");
  DEW_CHECK(o.master_port >= 1 && o.master_port <= 65535, "launch: --master-port ", o.master_port,
            "; accepted: 1..65535");
  DEW_CHECK(o.threads >= 0, "launch: --threads ", o.threads, "; accepted: >= 0 (0 = cores / ranks)");
  DEW_CHECK(o.grace_seconds >= 0, "launch: grace ", o.grace_seconds, " s; accepted: >= 0");
}

int launch(const std::vector<std::string>& args, const LaunchOptions& o) {
  validate(o);
  DEW_CHECK(!args.empty(), "launch: expected the command the ranks run after --, e.g. -- train diffusion ...");
  char self[PATH_MAX];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  DEW_CHECK(n > 0, "launch: cannot find this program (/proc/self/exe): ", std::strerror(errno));
  self[n] = '\0';
  const int64_t world = o.nnodes * o.nproc_per_node;
  const int64_t threads = o.threads > 0 ? o.threads : std::max<int64_t>(1, usable_cores() / o.nproc_per_node);
  log::info("launch: ", o.nproc_per_node, " ranks of ", world, " on node ", o.node_rank, ", ", threads,
            " threads each, rendezvous ", o.master_addr, ":", o.master_port);

  // The launcher handles SIGINT / SIGTERM itself and passes them on; the ranks run in their own process
  // group, so a terminal's Ctrl-C reaches them once, through here.
  struct sigaction sa {};
  sa.sa_handler = on_launch_signal;
  sigemptyset(&sa.sa_mask);
  struct sigaction old_int {
  }, old_term{};
  sigaction(SIGINT, &sa, &old_int);
  sigaction(SIGTERM, &sa, &old_term);
  g_launch_signal.store(0);

  std::vector<pid_t> pids(size_t(o.nproc_per_node), -1);
  pid_t group = 0;
  for (int64_t i = 0; i < o.nproc_per_node; ++i) {
    std::vector<std::pair<std::string, std::string>> env = {
        {"RANK", std::to_string(o.node_rank * o.nproc_per_node + i)},
        {"LOCAL_RANK", std::to_string(i)},
        {"WORLD_SIZE", std::to_string(world)},
        {"LOCAL_WORLD_SIZE", std::to_string(o.nproc_per_node)},
        {"GROUP_RANK", std::to_string(o.node_rank)},
        {"MASTER_ADDR", o.master_addr},
        {"MASTER_PORT", std::to_string(o.master_port)},
        {"OMP_NUM_THREADS", std::to_string(threads)}};
    const pid_t pid = fork();
    DEW_CHECK(pid >= 0, "launch: fork failed: ", std::strerror(errno));
    if (pid == 0) {
      setpgid(0, group);  // the first rank leads the group
#ifdef __linux__
      prctl(PR_SET_PDEATHSIG, SIGKILL);  // a launcher killed outright takes its ranks with it
#endif
      signal(SIGINT, SIG_DFL);
      signal(SIGTERM, SIG_DFL);
      for (const auto& [k, v] : env) setenv(k.c_str(), v.c_str(), 1);
      // c10d's own retry and timeout logs would repeat each failure in many lines; dew's one line says it.
      setenv("TORCH_CPP_LOG_LEVEL", "FATAL", 0);
      std::vector<char*> argv;
      argv.push_back(self);
      for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
      argv.push_back(nullptr);
      execv(self, argv.data());
      std::fprintf(stderr, "dew: error: launch: exec %s failed: %s\n", self, std::strerror(errno));
      _exit(127);
    }
    if (group == 0) group = pid;
    setpgid(pid, group);  // also here: whichever of parent and child runs first
    pids[size_t(i)] = pid;
  }

  using clock = std::chrono::steady_clock;
  int64_t alive = o.nproc_per_node;
  int64_t failed_rank = -1;
  std::string failed_status;
  int forwarded = 0;
  clock::time_point stop_at{};
  bool killed = false;
  auto signal_all = [&](int sig) {
    for (pid_t p : pids)
      if (p > 0) kill(p, sig);
  };
  while (alive > 0) {
    int status = 0;
    const pid_t p = waitpid(-1, &status, WNOHANG);
    if (p > 0) {
      for (size_t i = 0; i < pids.size(); ++i) {
        if (pids[i] != p) continue;
        pids[i] = -1;
        --alive;
        const bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
        if (!ok && failed_rank < 0) {
          failed_rank = o.node_rank * o.nproc_per_node + int64_t(i);
          failed_status = launch_status_text(status);
          // The others are stuck in, or about to enter, a collective with the failed rank: ask them to stop
          // (SIGTERM checkpoints at the end of a step), then kill them after the grace.
          signal_all(SIGTERM);
          stop_at = clock::now() + std::chrono::milliseconds(int64_t(o.grace_seconds * 1000));
        }
      }
      continue;
    }
    if (const int sig = g_launch_signal.exchange(0); sig != 0) {
      // The first signal asks every rank to checkpoint and exit; a second one stops them at once.
      signal_all(++forwarded == 1 ? sig : SIGKILL);
    }
    if (failed_rank >= 0 && !killed && clock::now() >= stop_at) {
      signal_all(SIGKILL);
      killed = true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (group > 0) kill(-group, SIGKILL);  // anything the ranks started and left behind
  sigaction(SIGINT, &old_int, nullptr);
  sigaction(SIGTERM, &old_term, nullptr);
  if (failed_rank >= 0 && forwarded == 0)
    fail("launch: rank ", failed_rank, " of ", world, " ended with ", failed_status, "; stopped the other ",
         o.nproc_per_node - 1, " rank", o.nproc_per_node == 2 ? "" : "s", " of this node");
  if (failed_rank >= 0) fail("launch: stopped by a signal; rank ", failed_rank, " ended with ", failed_status);
  return 0;
}

}  // namespace dew::runs

// Child processes of the measuring commands (`dew bench`, `dew tune threads`): each configuration runs in a
// fresh process, so thread pools and allocator state start clean.
#pragma once
#include <map>
#include <string>
#include <vector>

namespace dew::bench {

struct ChildResult {
  int exit_code = -1;  // -1: could not be started or was killed by a signal
  std::string out;     // its stdout
};

/// Runs argv[0] (a path) with argv, in this environment with `env` added (replacing variables of the same
/// name) and the variables in `unset` removed, and waits for it, collecting its stdout. Its stderr passes
/// through, or goes to /dev/null when `quiet`. `what` names the caller in the error when no pipe can be made.
ChildResult run_child(const std::vector<std::string>& argv, const std::map<std::string, std::string>& env,
                      bool quiet = false, const std::vector<std::string>& unset = {}, const char* what = "dew");

/// A TCP port on 127.0.0.1 that is free now (the kernel's pick for port 0), for a data-parallel child's rendezvous;
/// dew::Error when no socket can be bound.
int free_local_port();

}  // namespace dew::bench

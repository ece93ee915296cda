// What SIGINT and SIGTERM do to a command, and the temporary files they remove (docs/reliability.md,
// "Graceful stops"). A command that writes files writes each through a temporary name and a rename; a stop
// that comes while such a file is open removes it, so a stopped command leaves no partial file.
#pragma once
#include <exception>
#include <string>

namespace dew::io {

/// What the first SIGINT or SIGTERM does while a StopScope of this kind is the innermost one. A second
/// signal always stops the process at once, by the signal's default action.
enum class OnStop {
  kExit,       // stop at once (the registered temporary files are removed first)
  kAtCheck,    // remember it; the next check_stop() throws Stopped (sampling, evaluation)
  kAfterStep,  // remember it; the caller polls stop_requested() between steps (training)
};

/// Installs the SIGINT / SIGTERM handler for its lifetime and sets what a first signal does; scopes nest
/// (the innermost decides) and the outermost one restores the handlers it found. Entering a kAtCheck or
/// kAfterStep scope forgets a signal remembered before it. One thread (the command's) creates them.
class StopScope {
 public:
  explicit StopScope(OnStop mode);
  ~StopScope();
  StopScope(const StopScope&) = delete;
  StopScope& operator=(const StopScope&) = delete;

 private:
  OnStop previous_;
};

/// The signal a kAtCheck or kAfterStep scope remembered (SIGINT, SIGTERM), or 0.
int stop_signal();
inline bool stop_requested() { return stop_signal() != 0; }

/// Remembers a stop as if `signal` had come (a data-parallel rank whose peer got the signal).
void note_stop(int signal);

/// A command stopped by a signal before it wrote its outputs. Not a dew::Error: the CLI exits with
/// 128 + the signal's number, as a shell reports a process the signal ended.
class Stopped : public std::exception {
 public:
  explicit Stopped(int signal);
  int signal() const { return signal_; }
  const char* what() const noexcept override { return message_.c_str(); }

 private:
  int signal_;
  std::string message_;
};

/// Throws Stopped when the innermost scope is kAtCheck and a signal came; otherwise nothing. Called between
/// the steps of sampling and the batches of evaluation, on the command's thread.
void check_stop();

/// A file that must not outlive its writer unless renamed into place: removed by the destructor (an
/// exception, a Stopped) and, while registered, by the signal handler before a signal ends the process.
/// Registration holds up to 32 paths of under 4096 bytes at once; others are removed by the destructor only.
class TempFile {
 public:
  explicit TempFile(std::string path);
  ~TempFile();
  TempFile(const TempFile&) = delete;
  TempFile& operator=(const TempFile&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  int slot_ = -1;
};

}  // namespace dew::io

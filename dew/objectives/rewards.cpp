#include "dew/objectives/rewards.h"

#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <optional>
#include <regex>
#include <set>

extern char** environ;

namespace dew::post_training {
namespace {

// A completion longer than this is an error for the regex rewards: libstdc++'s std::regex recurses once per
// character it matches (up to ~1 KiB of stack each), so it would overflow even the large stack below.
constexpr size_t kMaxRegexText = size_t(1) << 18;
// Completions up to this length are matched on the caller's stack (a few MiB at worst).
constexpr size_t kSmallRegexText = 2048;
// The stack of the matching thread for longer ones (reserved, touched only as deep as the recursion goes).
constexpr size_t kRegexStack = size_t(512) << 20;
// A reward command that writes more than this is stopped.
constexpr size_t kMaxCommandOutput = size_t(64) << 20;

// s for a one-line message: control characters escaped, cut after `max` bytes with "...".
std::string one_line(const std::string& s, size_t max = 80) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (i == max) return out + "...";
    char c = s[i];
    if (c == '\n') out += "\\n";
    else if (c == '\r') out += "\\r";
    else if (c == '\t') out += "\\t";
    else if (static_cast<unsigned char>(c) < 0x20) out += '?';
    else out += c;
  }
  return out;
}

std::string trim(const std::string& s) {
  const char* ws = " \t\n\r\f\v";
  size_t b = s.find_first_not_of(ws);
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(ws) - b + 1);
}

// The value of a decimal number (sign, digits with an optional fraction, optional exponent), commas ignored
// ("1,234" = 1234, "82," = 82); nullopt for anything else or a non-finite value.
std::optional<double> decimal_value(const std::string& text) {
  std::string s;
  for (char c : text)
    if (c != ',') s += c;
  size_t i = 0, digits = 0;
  auto run = [&] {
    size_t n = 0;
    while (i < s.size() && s[i] >= '0' && s[i] <= '9') ++i, ++n;
    return n;
  };
  if (i < s.size() && (s[i] == '-' || s[i] == '+')) ++i;
  digits += run();
  if (i < s.size() && s[i] == '.') ++i, digits += run();
  if (digits == 0) return std::nullopt;
  if (i < s.size() && (s[i] == 'e' || s[i] == 'E')) {
    ++i;
    if (i < s.size() && (s[i] == '-' || s[i] == '+')) ++i;
    if (run() == 0) return std::nullopt;
  }
  if (i != s.size()) return std::nullopt;
  double v = std::strtod(s.c_str(), nullptr);
  if (!std::isfinite(v)) return std::nullopt;
  return v;
}

// Trimmed, then equal by value when both are numbers, else equal as text.
bool same_answer(const std::string& got, const std::string& want) {
  std::string a = trim(got), b = trim(want);
  auto x = decimal_value(a), y = decimal_value(b);
  if (x && y) return *x == *y;
  return a == b;
}

std::regex compile(const std::string& reward, const std::string& field, const std::string& pattern) {
  try {
    return std::regex(pattern, std::regex::ECMAScript);
  } catch (const std::regex_error& e) {
    fail("reward ", reward, ": ", field, " is not a valid ECMAScript regex \"", one_line(pattern), "\": ", e.what());
  }
}

// Runs f on a thread with a kRegexStack stack and rethrows what it throws.
void on_large_stack(const std::function<void()>& f) {
  struct Job {
    const std::function<void()>* f;
    std::exception_ptr error;
  } job{&f, nullptr};
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setstacksize(&attr, kRegexStack);
  pthread_t thread;
  int rc = pthread_create(
      &thread, &attr,
      [](void* p) -> void* {
        auto* j = static_cast<Job*>(p);
        try {
          (*j->f)();
        } catch (...) {
          j->error = std::current_exception();
        }
        return nullptr;
      },
      &job);
  pthread_attr_destroy(&attr);
  if (rc != 0) fail("cannot start a thread for regex matching: ", std::strerror(rc));
  pthread_join(thread, nullptr);
  if (job.error) std::rethrow_exception(job.error);
}

// Calls f(i) for every input, on a large stack when a completion is long (see kMaxRegexText).
void match_each(const std::string& reward, const std::vector<RewardInput>& inputs,
                const std::function<void(size_t)>& f) {
  size_t longest = 0;
  for (size_t i = 0; i < inputs.size(); ++i) {
    size_t n = inputs[i].completion.size();
    DEW_CHECK(n <= kMaxRegexText, "reward ", reward, ": completion ", i, " has ", n, " bytes, more than the ",
              kMaxRegexText, " a regex reward can match");
    longest = std::max(longest, n);
  }
  auto all = [&] {
    try {
      for (size_t i = 0; i < inputs.size(); ++i) f(i);
    } catch (const std::regex_error& e) {
      fail("reward ", reward, ": regex matching failed: ", e.what());
    }
  };
  if (longest <= kSmallRegexText) all();
  else on_large_stack(all);
}

class ExactReward : public Reward {
 public:
  explicit ExactReward(const RewardOptions& o)
      : extract_(compile("exact", "extract", o.extract)), field_(o.answer_field) {
    DEW_CHECK(!field_.empty(), "reward exact: answer_field is empty; name the record field of the reference answer");
  }
  std::string name() const override { return "exact"; }

  std::vector<double> score(const std::vector<RewardInput>& inputs) override {
    std::vector<std::string> want;
    for (const auto& in : inputs) want.push_back(reference(in.record));
    std::vector<double> r(inputs.size(), 0.0);
    match_each(name(), inputs, [&](size_t i) {
      auto got = last_answer(inputs[i].completion);
      r[i] = got && same_answer(*got, want[i]) ? 1.0 : 0.0;
    });
    return r;
  }

 private:
  std::string reference(const json& record) const {
    if (record.is_object()) {
      auto it = record.find(field_);
      if (it != record.end() && it->is_string()) return it->get<std::string>();
      if (it != record.end() && it->is_number()) return it->dump();
    }
    fail("reward exact: the prompt record has no \"", field_,
         "\" (string or number): ", one_line(record.dump(-1, ' ', false, json::error_handler_t::replace), 120));
  }

  // Group 1 (or the whole match when there is no group 1 or it did not take part) of the last match.
  std::optional<std::string> last_answer(const std::string& completion) const {
    std::optional<std::string> last;
    for (std::sregex_iterator it(completion.begin(), completion.end(), extract_), end; it != end; ++it) {
      const std::smatch& m = *it;
      last = m.size() > 1 && m[1].matched ? m[1].str() : m[0].str();
    }
    return last;
  }

  std::regex extract_;
  std::string field_;
};

class FormatReward : public Reward {
 public:
  explicit FormatReward(const RewardOptions& o) {
    DEW_CHECK(!o.format.empty(),
              "reward format: format is empty; set it to the ECMAScript regex a whole completion must match");
    format_ = compile("format", "format", o.format);
  }
  std::string name() const override { return "format"; }

  std::vector<double> score(const std::vector<RewardInput>& inputs) override {
    std::vector<double> r(inputs.size(), 0.0);
    match_each(name(), inputs, [&](size_t i) { r[i] = std::regex_match(inputs[i].completion, format_) ? 1.0 : 0.0; });
    return r;
  }

 private:
  std::regex format_;
};

class LengthReward : public Reward {
 public:
  explicit LengthReward(const RewardOptions& o) : target_(o.length_target), scale_(o.length_scale) {
    DEW_CHECK(target_ >= 0, "reward length: length_target must be >= 0, got ", target_);
    DEW_CHECK(std::isfinite(scale_), "reward length: length_scale must be finite, got ", scale_);
  }
  std::string name() const override { return "length"; }

  std::vector<double> score(const std::vector<RewardInput>& inputs) override {
    std::vector<double> r;
    for (size_t i = 0; i < inputs.size(); ++i) {
      int64_t n = inputs[i].completion_tokens;
      DEW_CHECK(n >= 0, "reward length: input ", i, " has completion_tokens ", n, " (must be >= 0)");
      int64_t excess = std::max<int64_t>(0, n - target_);
      r.push_back(excess > 0 ? -scale_ * static_cast<double>(excess) : 0.0);
    }
    return r;
  }

 private:
  int64_t target_;
  double scale_;
};

// ---- the command runner ----

// An owned file descriptor.
struct Fd {
  int fd = -1;
  Fd() = default;
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() { reset(); }
  void reset() {
    if (fd >= 0) ::close(fd);
    fd = -1;
  }
};

// A spawned child: unless reaped, its process group is killed and it is reaped at scope exit.
struct Child {
  pid_t pid = -1;
  Child() = default;
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;
  ~Child() {
    if (pid <= 0) return;
    ::kill(-pid, SIGKILL);
    int status;
    while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {}
  }
};

// SIGPIPE blocked in this thread for the scope; one raised meanwhile by a write to a closed pipe is consumed.
struct SigpipeHold {
  sigset_t previous;
  bool was_pending = false;
  SigpipeHold() {
    sigset_t s;
    sigemptyset(&s);
    sigaddset(&s, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &s, &previous);
    sigset_t pending;
    sigpending(&pending);
    was_pending = sigismember(&pending, SIGPIPE);
  }
  ~SigpipeHold() {
    sigset_t pending;
    sigpending(&pending);
    if (!was_pending && sigismember(&pending, SIGPIPE)) {
      sigset_t s;
      sigemptyset(&s);
      sigaddset(&s, SIGPIPE);
      timespec zero{0, 0};
      while (sigtimedwait(&s, nullptr, &zero) < 0 && errno == EINTR) {}
    }
    pthread_sigmask(SIG_SETMASK, &previous, nullptr);
  }
};

// A pipe, both ends close-on-exec and above the standard descriptors (so dup2 onto 0 and 1 cannot collide).
void make_pipe(Fd& read_end, Fd& write_end, const std::string& who) {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) fail(who, "cannot create a pipe: ", std::strerror(errno));
  for (int k = 0; k < 2; ++k) {
    if (fds[k] <= 2) {
      int high = ::fcntl(fds[k], F_DUPFD_CLOEXEC, 3);
      int e = errno;
      ::close(fds[k]);
      if (high < 0) fail(who, "cannot create a pipe: ", std::strerror(e));
      fds[k] = high;
    }
  }
  read_end.fd = fds[0];
  write_end.fd = fds[1];
}

void set_nonblocking(const Fd& f) { ::fcntl(f.fd, F_SETFL, ::fcntl(f.fd, F_GETFL) | O_NONBLOCK); }

struct CommandResult {
  std::string out;      // what it wrote on stdout
  int status = 0;       // waitpid status
  size_t consumed = 0;  // bytes of the input sent before its stdin closed
};

// Runs `sh -c command` in a new process group with `input` on its stdin, collecting its stdout; stdin and
// stdout are served together by poll() so neither side blocks on a full pipe. A run longer than timeout_s
// kills the group. Errors are dew::Error prefixed by `who`.
CommandResult run_command(const std::string& command, const std::string& input, double timeout_s,
                          const std::string& who) {
  using clock = std::chrono::steady_clock;
  const auto deadline =
      clock::now() + std::chrono::duration_cast<clock::duration>(std::chrono::duration<double>(timeout_s));
  auto timeout = [&] { return fail(who, "timed out after ", timeout_s, " s; its process group was killed"); };

  Fd stdin_read, stdin_write, stdout_read, stdout_write;
  make_pipe(stdin_read, stdin_write, who);
  make_pipe(stdout_read, stdout_write, who);
  set_nonblocking(stdin_write);  // our ends only: the child's block as usual
  set_nonblocking(stdout_read);

  // posix_spawn is fork + exec without copying the page tables of a large (CUDA) process, and with nothing
  // but async-signal-safe steps between the two: a new process group, the pipes on 0 and 1, default SIGPIPE.
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, stdin_read.fd, 0);
  posix_spawn_file_actions_adddup2(&actions, stdout_write.fd, 1);
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETPGROUP | POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
  posix_spawnattr_setpgroup(&attr, 0);
  sigset_t signals;
  sigemptyset(&signals);
  posix_spawnattr_setsigmask(&attr, &signals);
  sigaddset(&signals, SIGPIPE);
  posix_spawnattr_setsigdefault(&attr, &signals);
  std::string sh = "sh", dash_c = "-c", cmd = command;
  char* argv[] = {sh.data(), dash_c.data(), cmd.data(), nullptr};
  Child child;
  int rc = ::posix_spawn(&child.pid, "/bin/sh", &actions, &attr, argv, environ);
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attr);
  if (rc != 0) {
    child.pid = -1;
    fail(who, "cannot start /bin/sh: ", std::strerror(rc));
  }
  stdin_read.reset();
  stdout_write.reset();

  CommandResult res;
  {
    SigpipeHold hold;
    size_t written = 0;
    if (input.empty()) stdin_write.reset();
    while (stdin_write.fd >= 0 || stdout_read.fd >= 0) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - clock::now()).count() + 1;
      if (clock::now() >= deadline) timeout();
      pollfd fds[2];
      int n = 0;
      if (stdin_write.fd >= 0) fds[n++] = {stdin_write.fd, POLLOUT, 0};
      if (stdout_read.fd >= 0) fds[n++] = {stdout_read.fd, POLLIN, 0};
      int ready = ::poll(fds, n, static_cast<int>(std::min<int64_t>(left, 1 << 30)));
      if (ready < 0) {
        if (errno == EINTR) continue;
        fail(who, "poll failed: ", std::strerror(errno));
      }
      for (int k = 0; k < n; ++k) {
        if (fds[k].revents == 0) continue;
        if (fds[k].fd == stdin_write.fd) {
          ssize_t w = ::write(stdin_write.fd, input.data() + written, input.size() - written);
          if (w > 0) {
            written += static_cast<size_t>(w);
            if (written == input.size()) stdin_write.reset();
          } else if (w < 0 && errno != EAGAIN && errno != EINTR) {
            stdin_write.reset();  // EPIPE: it stopped reading; what it wrote decides
          }
        } else {
          char buf[1 << 16];
          ssize_t r = ::read(stdout_read.fd, buf, sizeof buf);
          if (r > 0) {
            res.out.append(buf, static_cast<size_t>(r));
            if (res.out.size() > kMaxCommandOutput)
              fail(who, "wrote more than ", kMaxCommandOutput >> 20, " MiB on stdout; stopped");
          } else if (r == 0 || (errno != EAGAIN && errno != EINTR)) {
            stdout_read.reset();
          }
        }
      }
    }
    res.consumed = written;
  }

  // Its stdout is closed: wait for its exit, still within the deadline.
  long sleep_ns = 100000;
  while (true) {
    pid_t r = ::waitpid(child.pid, &res.status, WNOHANG);
    if (r == child.pid) {
      child.pid = -1;
      break;
    }
    if (r < 0 && errno != EINTR) {
      int e = errno;
      child.pid = -1;
      fail(who, "cannot get its exit status: ", std::strerror(e));
    }
    if (clock::now() >= deadline) timeout();
    timespec pause{0, sleep_ns};
    ::nanosleep(&pause, nullptr);
    sleep_ns = std::min(sleep_ns * 2, 10000000L);
  }
  return res;
}

// The reward on one line of a command's output: a number, or an object with a numeric "reward".
std::optional<double> parse_reward(const std::string& line) {
  if (line.empty()) return std::nullopt;
  if (line[0] == '{') {
    json j = json::parse(line, nullptr, false);
    if (!j.is_object()) return std::nullopt;
    auto it = j.find("reward");
    if (it == j.end() || !it->is_number()) return std::nullopt;
    return it->get<double>();
  }
  char* end = nullptr;
  double v = std::strtod(line.c_str(), &end);  // also "nan", "inf": found non-finite by the caller
  if (end == line.c_str() || *end != '\0') return std::nullopt;
  return v;
}

class CommandReward : public Reward {
 public:
  CommandReward(const std::string& command, const RewardOptions& o) : command_(command), timeout_s_(o.timeout_s) {
    DEW_CHECK(!trim(command_).empty(), "reward command: the command is empty");
    DEW_CHECK(std::isfinite(timeout_s_) && timeout_s_ > 0, who(), "timeout_s must be > 0, got ", timeout_s_);
  }
  std::string name() const override { return "command"; }

  std::vector<double> score(const std::vector<RewardInput>& inputs) override {
    if (inputs.empty()) return {};
    std::string input;
    for (const auto& in : inputs) {
      json line = {{"prompt", in.prompt},
                   {"completion", in.completion},
                   {"completion_tokens", in.completion_tokens},
                   {"record", in.record}};
      input += line.dump(-1, ' ', false, json::error_handler_t::replace);
      input += '\n';
    }
    CommandResult res = run_command(command_, input, timeout_s_, who());
    if (WIFSIGNALED(res.status)) {
      int sig = WTERMSIG(res.status);
      fail(who(), "killed by signal ", sig, " (", strsignal(sig), ")");
    }
    if (WIFEXITED(res.status) && WEXITSTATUS(res.status) != 0) {
      int code = WEXITSTATUS(res.status);
      fail(who(), "exit status ", code, code == 127 ? " (command not found)" : "");
    }

    std::vector<std::string> lines;
    for (size_t start = 0; start < res.out.size();) {
      size_t nl = res.out.find('\n', start);
      if (nl == std::string::npos) nl = res.out.size();
      lines.push_back(res.out.substr(start, nl - start));
      start = nl + 1;
    }
    if (lines.size() != inputs.size()) {
      std::string read_note = res.consumed < input.size() ? str("; its stdin closed with ", res.consumed, " of the ",
                                                                input.size(), " input bytes sent")
                                                          : "";
      fail(who(), "wrote ", lines.size(), lines.size() == 1 ? " line" : " lines", " for ", inputs.size(),
           inputs.size() == 1 ? " input" : " inputs", " (one reward a line expected)", read_note);
    }
    std::vector<double> r;
    for (size_t i = 0; i < lines.size(); ++i) {
      std::string line = trim(lines[i]);
      auto v = parse_reward(line);
      if (!v)
        fail(who(), "line ", i + 1, " is not a number or an object with a numeric \"reward\": \"", one_line(line),
             "\"");
      if (!std::isfinite(*v)) fail(who(), "line ", i + 1, " has a non-finite reward: \"", one_line(line), "\"");
      r.push_back(*v);
    }
    return r;
  }

 private:
  std::string who() const { return str("reward command \"", one_line(command_), "\": "); }

  std::string command_;
  double timeout_s_;
};

}  // namespace

const std::vector<std::string>& builtin_rewards() {
  static const std::vector<std::string> names = {"exact", "format", "length"};
  return names;
}

namespace {
std::string builtin_list() {
  std::string list;
  for (const auto& n : builtin_rewards()) list += (list.empty() ? "" : ", ") + n;
  return list;
}
}  // namespace

RewardPtr make_reward(const std::string& name, const RewardOptions& o) {
  if (name == "exact") return std::make_shared<ExactReward>(o);
  if (name == "format") return std::make_shared<FormatReward>(o);
  if (name == "length") return std::make_shared<LengthReward>(o);
  fail("reward \"", name, "\": unknown; built-in rewards: ", builtin_list(), " (or give a reward command)");
}

RewardPtr make_command_reward(const std::string& command, const RewardOptions& o) {
  return std::make_shared<CommandReward>(command, o);
}

std::vector<RewardPtr> make_rewards(const std::string& names, const std::string& command, const RewardOptions& o) {
  std::vector<RewardPtr> rewards;
  std::set<std::string> seen;
  if (!trim(names).empty()) {
    for (size_t start = 0;;) {
      size_t comma = names.find(',', start);
      std::string name = trim(names.substr(start, comma == std::string::npos ? std::string::npos : comma - start));
      DEW_CHECK(!name.empty(), "rewards \"", names, "\": an empty name (a comma-separated list, e.g. exact,format)");
      DEW_CHECK(seen.insert(name).second, "rewards \"", names, "\": \"", name, "\" is named twice");
      rewards.push_back(make_reward(name, o));
      if (comma == std::string::npos) break;
      start = comma + 1;
    }
  }
  if (!command.empty()) rewards.push_back(make_command_reward(command, o));
  DEW_CHECK(!rewards.empty(), "rewards: none given; name built-ins (", builtin_list(), ") or give a reward command");
  return rewards;
}

}  // namespace dew::post_training

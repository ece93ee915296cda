#include "dew/io/files.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstring>

#include <filesystem>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>
#include "dew/core/error.h"
#include "dew/io/stops.h"

namespace fs = std::filesystem;

namespace dew::io {

std::string read_file(const std::string& path, const std::string& what) {
  std::error_code ec;
  std::ifstream f(path, std::ios::binary);
  DEW_CHECK(f.good() && !fs::is_directory(path, ec), what, ": cannot read \"", path, "\"");
  std::ostringstream s;
  s << f.rdbuf();
  return s.str();
}

void check_json_utf8(const nlohmann::json& value, const std::string& what) {
  try {
    (void)value.dump();
  } catch (const nlohmann::json::type_error& e) {
    // e.what(): "[json.exception.type_error.316] invalid UTF-8 byte at index 6: 0x74"
    const std::string why = e.what();
    const auto at = why.find("invalid UTF-8");
    fail(what, ": not valid UTF-8 (", at == std::string::npos ? why : why.substr(at),
         "); recipes and run records are JSON, whose text is UTF-8");
  }
}

void check_json_depth(const std::string& text, const std::string& what) {
  int depth = 0;
  bool in_string = false, escaped = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (escaped) escaped = false;
      else if (c == '\\') escaped = true;
      else if (c == '"') in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      DEW_CHECK(++depth <= kMaxJsonDepth, what, ": JSON nested more than ", kMaxJsonDepth, " levels deep (at byte ", i,
                "); accepted: at most ", kMaxJsonDepth, " levels of arrays and objects");
    } else if ((c == ']' || c == '}') && depth > 0) {
      --depth;
    }
  }
}

nlohmann::json parse_json(const std::string& text, const std::string& what) {
  check_json_depth(text, what);
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    fail(what, ": invalid JSON: ", e.what());
  }
}

void fsync_path(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

namespace {
// p lies in (or is) root; both canonical.
bool inside(const fs::path& p, const fs::path& root) {
  auto r = root.begin(), q = p.begin();
  for (; r != root.end(); ++r, ++q)
    if (q == p.end() || *q != *r) return false;
  return true;
}
}  // namespace

void check_folder_links(const std::string& dir, const std::string& what) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return;
  const fs::path root = fs::canonical(dir, ec);
  if (ec) return;
  // A Hugging Face cache snapshot's files link into the repository's blobs/: the repository folder is the tree.
  fs::path allowed = root;
  for (fs::path p = root; p.has_parent_path() && p != p.parent_path(); p = p.parent_path()) {
    const std::string repo = p.parent_path().parent_path().filename().string();
    if (p.parent_path().filename() == "snapshots" &&
        (repo.rfind("models--", 0) == 0 || repo.rfind("datasets--", 0) == 0 || repo.rfind("spaces--", 0) == 0)) {
      allowed = p.parent_path().parent_path();
      break;
    }
  }
  constexpr int64_t kMaxEntries = 100000;
  constexpr int kMaxDepth = 32;
  int64_t entries = 0;
  fs::recursive_directory_iterator it(root, fs::directory_options::follow_directory_symlink, ec), end;
  DEW_CHECK(!ec, what, ": cannot list \"", dir, "\": ", ec.message());
  for (; it != end; it.increment(ec)) {
    DEW_CHECK(!ec, what, ": cannot list \"", dir, "\": ", ec.message());
    DEW_CHECK(++entries <= kMaxEntries, what, ": \"", dir, "\" holds more than ", kMaxEntries,
              " files and folders; accepted: a model folder (name the model's own folder)");
    if (it.depth() >= kMaxDepth) it.disable_recursion_pending();
    if (!it->is_symlink(ec)) continue;
    // The link's own target, resolved (weakly: a dangling link's target is judged by where it points).
    std::error_code rec;
    fs::path target = fs::read_symlink(it->path(), rec);
    if (!rec && target.is_relative()) target = it->path().parent_path() / target;
    if (!rec) target = fs::weakly_canonical(target, rec);
    DEW_CHECK(!rec && inside(target, allowed), what, ": \"", it->path().string(), "\" is a symbolic link to \"",
              rec ? fs::read_symlink(it->path(), rec).string() : target.string(), "\", outside the folder \"",
              allowed.string(),
              "\"; accepted: files and links inside the folder (a Hugging Face cache snapshot may link ",
              "into its repository's blobs/)");
  }
}

void write_file_atomic(const std::string& path, const std::string& content) {
  const TempFile guard(path + ".tmp");
  const std::string& tmp = guard.path();
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    DEW_CHECK(f.good(), "cannot write \"", tmp, "\": ", std::strerror(errno));
    f.write(content.data(), static_cast<std::streamsize>(content.size()));
    f.flush();
    DEW_CHECK(f.good(), "writing \"", tmp, "\" failed: ", std::strerror(errno));
  }
  fsync_path(tmp);
  std::error_code ec;
  fs::rename(tmp, path, ec);
  DEW_CHECK(!ec, "cannot rename \"", tmp, "\" to \"", path, "\": ", ec.message());
}

void truncate_jsonl(const std::string& path, int64_t step) {
  if (!fs::exists(path)) return;
  std::string kept;
  if (step > 0) {
    std::ifstream in(path);
    std::string line;
    while (std::getline(in, line)) {
      nlohmann::json j;
      try {
        j = nlohmann::json::parse(line);
      } catch (const std::exception&) {
        break;  // a line torn by a kill ends what was written
      }
      if (!j.is_object() || j.value("step", int64_t(0)) > step) break;
      kept += line + "\n";
    }
  }
  write_file_atomic(path, kept);
}

namespace {

// The PID written in a lock file (0 when it holds none yet).
pid_t written_pid(int fd) {
  char buf[32] = {0};
  const ssize_t n = ::pread(fd, buf, sizeof(buf) - 1, 0);
  return n > 0 ? pid_t(std::strtol(buf, nullptr, 10)) : 0;
}

[[noreturn]] void fail_held(int fd, const std::string& path, const std::string& what, const std::string& advice) {
  const pid_t pid = written_pid(fd);
  ::close(fd);
  fail(what, " is being written by ", pid > 0 ? "process " + std::to_string(pid) : std::string("another process"), " (",
       path, "); ", advice);
}

}  // namespace

FileLock::FileLock(const std::string& path, const std::string& what, const std::string& advice) {
  fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  DEW_CHECK(fd_ >= 0, what, ": cannot open the lock file \"", path, "\": ", std::strerror(errno));
  int rc;
  do rc = ::flock(fd_, LOCK_EX | LOCK_NB);
  while (rc != 0 && errno == EINTR);
  if (rc != 0) {
    const int err = errno, fd = fd_;
    fd_ = -1;
    if (err == EWOULDBLOCK) fail_held(fd, path, what, advice);
    ::close(fd);
    fail(what, ": cannot lock \"", path, "\": ", std::strerror(err));
  }
  const std::string pid = std::to_string(::getpid()) + "\n";
  const bool written = ::ftruncate(fd_, 0) == 0 && ::pwrite(fd_, pid.data(), pid.size(), 0) == ssize_t(pid.size());
  (void)written;  // the PID only serves others' messages: without it the lock holds all the same
}

FileLock::~FileLock() {
  if (fd_ < 0) return;
  const int rc = ::ftruncate(fd_, 0);  // no stale PID; the file stays (removing it would race a new holder)
  (void)rc;
  ::close(fd_);  // releases the lock
}

void FileLock::check_free(const std::string& path, const std::string& what, const std::string& advice) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return;
  if (::flock(fd, LOCK_SH | LOCK_NB) != 0 && errno == EWOULDBLOCK) fail_held(fd, path, what, advice);
  ::close(fd);  // releases the shared lock it took
}

// ---- Stops and temporary files (stops.h) ----
//
// The handler may run on any thread at any moment, so it only touches lock-free atomics and calls
// async-signal-safe functions (unlink, signal, raise); the registry is a fixed array for the same reason.

namespace {

std::atomic<int> g_mode{int(OnStop::kExit)};
std::atomic<int> g_signal{0};
int g_depth = 0;  // scopes alive; changed by the command's thread only
struct sigaction g_old_int, g_old_term;

constexpr int kTempSlots = 32;
constexpr size_t kTempPathMax = 4096;
struct TempSlot {
  std::atomic<int> state{0};  // 0 free, 1 being filled or emptied, 2 holds a path the handler may unlink
  char path[kTempPathMax];
};
TempSlot g_temps[kTempSlots];

void remove_temp_files() {
  for (auto& slot : g_temps)
    if (slot.state.load() == 2) ::unlink(slot.path);
}

extern "C" void on_stop_signal(int sig) {
  // kAtCheck / kAfterStep remember the first signal; a second one, or any under kExit, ends the process.
  if (g_mode.load() != int(OnStop::kExit) && g_signal.exchange(sig) == 0) return;
  remove_temp_files();
  std::signal(sig, SIG_DFL);
  std::raise(sig);  // delivered when the handler returns (the signal is blocked inside it)
}

}  // namespace

StopScope::StopScope(OnStop mode) : previous_(OnStop(g_mode.load())) {
  if (g_depth++ == 0) {
    struct sigaction sa {};
    sa.sa_handler = on_stop_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;  // a remembered signal must not fail the read or write it interrupted
    ::sigaction(SIGINT, &sa, &g_old_int);
    ::sigaction(SIGTERM, &sa, &g_old_term);
  }
  if (mode != OnStop::kExit) g_signal.store(0);
  g_mode.store(int(mode));
}

StopScope::~StopScope() {
  g_mode.store(int(previous_));
  if (--g_depth == 0) {
    ::sigaction(SIGINT, &g_old_int, nullptr);
    ::sigaction(SIGTERM, &g_old_term, nullptr);
  }
}

int stop_signal() { return g_signal.load(); }

void note_stop(int signal) {
  int none = 0;
  g_signal.compare_exchange_strong(none, signal);
}

Stopped::Stopped(int signal)
    : signal_(signal),
      message_(std::string("stopped by ") + (signal == SIGINT    ? "SIGINT"
                                             : signal == SIGTERM ? "SIGTERM"
                                                                 : "signal " + std::to_string(signal))) {}

void check_stop() {
  const int sig = g_signal.load();
  if (sig != 0 && g_mode.load() == int(OnStop::kAtCheck)) throw Stopped(sig);
}

TempFile::TempFile(std::string path) : path_(std::move(path)) {
  if (path_.size() >= kTempPathMax) return;
  for (int i = 0; i < kTempSlots; ++i) {
    int expected = 0;
    if (!g_temps[i].state.compare_exchange_strong(expected, 1)) continue;
    std::memcpy(g_temps[i].path, path_.c_str(), path_.size() + 1);
    g_temps[i].state.store(2);
    slot_ = i;
    return;
  }
}

TempFile::~TempFile() {
  if (slot_ >= 0) g_temps[slot_].state.store(1);  // out of the handler's reach before the path is reused
  ::unlink(path_.c_str());                        // a renamed file is gone from here already
  if (slot_ >= 0) g_temps[slot_].state.store(0);
}

}  // namespace dew::io

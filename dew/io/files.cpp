#include "dew/io/files.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <filesystem>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>
#include "dew/core/error.h"

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

void write_file_atomic(const std::string& path, const std::string& content) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    DEW_CHECK(f.good(), "cannot write \"", tmp, "\"");
    f.write(content.data(), static_cast<std::streamsize>(content.size()));
    f.flush();
    DEW_CHECK(f.good(), "writing \"", tmp, "\" failed");
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

}  // namespace dew::io

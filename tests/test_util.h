// Helpers shared by the test files.
#pragma once
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <string>

#include <nlohmann/json.hpp>

#include "dew/core/error.h"

namespace dew::test {

/// The message of the dew::Error that f throws, or "" if it throws none.
inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const dew::Error& e) {
    return e.what();
  }
  return "";
}

/// A fresh directory under the system temp dir, removed with everything in it at scope exit.
struct TempDir {
  std::filesystem::path path;
  explicit TempDir(const std::string& tag) {
    path = std::filesystem::temp_directory_path() / ("dew_test_" + tag + "_" + std::to_string(::getpid()));
    std::filesystem::remove_all(path);
    std::filesystem::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  std::string file(const std::string& name) const { return (path / name).string(); }
  /// Writes `text` to the file `name` in this directory and returns its path.
  std::string write(const std::string& name, const std::string& text) const {
    std::ofstream(file(name), std::ios::binary) << text;
    return file(name);
  }
};

/// The whole content of a file ("" if it cannot be read).
inline std::string read_bytes(const std::filesystem::path& p) {
  std::ifstream f(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

/// The JSON document in a file.
inline nlohmann::json read_json(const std::string& path) { return nlohmann::json::parse(std::ifstream(path)); }

/// The number of newline characters in s.
inline size_t count_lines(const std::string& s) { return size_t(std::count(s.begin(), s.end(), '\n')); }

/// Exit status and combined stdout + stderr of one run of the dew program.
struct CliResult {
  int code;
  std::string output;
};

#ifdef DEW_BINARY
/// Runs `dew ARGS` (ARGS as a shell would split them) and collects what it prints.
inline CliResult run_dew(const std::string& args) {
  const std::string cmd = std::string(DEW_BINARY) + " " + args + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return {-1, "popen failed: " + cmd};
  std::string out;
  std::array<char, 4096> buf{};
  while (fgets(buf.data(), buf.size(), p)) out += buf.data();
  const int status = pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}
#endif

// This process's resident set (field "VmRSS") or its high-water mark ("VmHWM") in bytes (/proc/self/status).
inline int64_t status_bytes(const std::string& field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind(field + ":", 0) == 0) return std::stoll(line.substr(field.size() + 1)) * 1024;
  return -1;
}

// Resets VmHWM to the current RSS (Linux >= 4.0); false where the kernel refuses.
inline bool reset_peak_rss() {
  std::ofstream out("/proc/self/clear_refs");
  out << "5";
  out.flush();
  return out.good();
}

}  // namespace dew::test

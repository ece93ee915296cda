// What the file-based fuzz targets share: a stop on a broken promise that names it, a scratch folder per
// fuzzing process (libFuzzer's -jobs run several), files written into it, and an input cut at its first NUL
// byte into the contents of two files.
#pragma once
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>
#include <utility>

// A broken promise: the line and the condition are printed, then the run stops as on a crash.
#define FUZZ_REQUIRE(ok)                                                    \
  do {                                                                      \
    if (!(ok)) {                                                            \
      std::fprintf(stderr, "%s:%d: broken: %s\n", __FILE__, __LINE__, #ok); \
      std::abort();                                                         \
    }                                                                       \
  } while (0)

namespace dew_fuzz {

/// /tmp/dew-fuzz-TAG-PID, created.
inline std::filesystem::path make_scratch_dir(const std::string& tag) {
  const auto dir = std::filesystem::path("/tmp") / ("dew-fuzz-" + tag + "-" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  return dir;
}

/// Replaces the file's contents with `bytes`.
inline void write_file(const std::filesystem::path& path, std::string_view bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

/// The input before its first NUL byte and after it (empty when there is none).
inline std::pair<std::string_view, std::string_view> split_at_nul(const uint8_t* data, size_t size) {
  const std::string_view all(reinterpret_cast<const char*>(data), size);
  const size_t nul = std::min(all.find('\0'), all.size());
  return {all.substr(0, nul), nul < size ? all.substr(nul + 1) : std::string_view()};
}

}  // namespace dew_fuzz

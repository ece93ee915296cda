#include "dew/io/files.h"

#include <fcntl.h>
#include <unistd.h>

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

}  // namespace dew::io

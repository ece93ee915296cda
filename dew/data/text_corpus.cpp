#include "dew/data/text_corpus.h"

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "dew/core/error.h"
#include "dew/core/strings.h"

namespace fs = std::filesystem;

namespace dew {
namespace data {
namespace {

bool blank(const std::string& s) {
  return std::all_of(s.begin(), s.end(), [](unsigned char c) { return std::isspace(c); });
}

std::string read_all(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  DEW_CHECK(f.good(), "documents: cannot read \"", path, "\"");
  std::ostringstream s;
  s << f.rdbuf();
  return s.str();
}

}  // namespace

std::vector<std::string> split_fortunes(const std::string& text) {
  std::vector<std::string> out;
  std::string doc;
  auto flush = [&] {
    if (!blank(doc)) out.push_back(doc);
    doc.clear();
  };
  size_t pos = 0;
  while (pos < text.size()) {
    size_t nl = text.find('\n', pos);
    size_t end = nl == std::string::npos ? text.size() : nl;
    std::string line = text.substr(pos, end - pos);
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line == "%") flush();
    else doc += line + "\n";
    pos = end + 1;
  }
  flush();
  return out;
}

bool is_fortune_file(const std::string& path) {
  std::error_code ec;
  return fs::is_regular_file(path + ".dat", ec) || ends_with(path, ".fortune") || ends_with(path, ".fortunes");
}

std::vector<std::string> document_files(const std::string& input) {
  std::error_code ec;
  DEW_CHECK(fs::exists(input, ec), "documents: \"", input, "\" does not exist (expected a file or a folder)");
  if (!fs::is_directory(input, ec)) return {input};
  std::vector<std::string> files;
  for (auto it = fs::recursive_directory_iterator(input, ec); it != fs::recursive_directory_iterator();
       it.increment(ec)) {
    DEW_CHECK(!ec, "documents: cannot list \"", input, "\": ", ec.message());
    const fs::path& p = it->path();
    if (p.filename().string().rfind('.', 0) == 0) {
      if (it->is_directory()) it.disable_recursion_pending();
      continue;
    }
    if (it->is_symlink() || !it->is_regular_file()) continue;
    std::string s = p.string();
    if (ends_with(s, ".dat") && fs::is_regular_file(s.substr(0, s.size() - 4), ec)) continue;
    files.push_back(s);
  }
  std::sort(files.begin(), files.end());
  return files;
}

std::vector<std::string> read_documents(const std::string& input, const std::string& split) {
  DEW_CHECK(split == "auto" || split == "fortune" || split == "file", "documents: split \"", split,
            "\" is not accepted; accepted: auto, fortune, file");
  std::vector<std::string> docs;
  for (const auto& f : document_files(input)) {
    std::string text = read_all(f);
    if (split == "fortune" || (split == "auto" && is_fortune_file(f))) {
      for (auto& d : split_fortunes(text)) docs.push_back(std::move(d));
    } else if (!text.empty()) {
      docs.push_back(std::move(text));
    }
  }
  return docs;
}

}  // namespace data
}  // namespace dew

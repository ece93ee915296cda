#include "dew/interop/model_index.h"

#include <algorithm>
#include <fstream>
#include <iterator>

#include "dew/core/error.h"
#include "dew/io/files.h"

namespace fs = std::filesystem;

namespace dew::interop::detail {

json read_pipeline_json(const fs::path& path) {
  DEW_CHECK(fs::is_regular_file(path), path.string(), ": missing");
  // Nesting bounded before parsing: the configs are copied and quoted in errors, which recurse per level.
  return io::parse_json(io::read_file(path.string(), "pipeline config"), path.string());
}

json read_model_index(const std::string& dir, const std::vector<std::string>& accepted, std::string& class_name) {
  DEW_CHECK(fs::is_directory(dir), dir, ": not a folder (expected a diffusers pipeline folder with model_index.json)");
  io::check_folder_links(dir, "pipeline folder");
  const fs::path file = fs::path(dir) / "model_index.json";
  json index = read_pipeline_json(file);
  DEW_CHECK(index.is_object() && index.contains("_class_name") && index["_class_name"].is_string(), file.string(),
            ": no \"_class_name\"");
  class_name = index["_class_name"].get<std::string>();
  std::string list;
  for (const auto& a : accepted) list += (list.empty() ? "" : ", ") + a;
  DEW_CHECK(std::find(accepted.begin(), accepted.end(), class_name) != accepted.end(), file.string(),
            ": pipeline class \"", class_name, "\" is not supported (accepted: ", list, ")");
  return index;
}

std::string model_index_class(const std::string& dir) {
  const fs::path file = fs::path(dir) / "model_index.json";
  std::error_code ec;
  if (!fs::is_regular_file(file, ec)) return "";
  std::ifstream in(file, std::ios::binary);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  try {
    io::check_json_depth(text, file.string());  // too deep: read_model_index says why
  } catch (const Error&) {
    return "";
  }
  const json index = json::parse(text, nullptr, false);
  if (!index.is_object() || !index.contains("_class_name") || !index["_class_name"].is_string()) return "";
  return index["_class_name"].get<std::string>();
}

std::string index_component(const json& index, const std::string& name, const fs::path& file) {
  DEW_CHECK(index.contains(name), file.string(), ": no \"", name, "\" component");
  const json& e = index[name];
  if (e.is_null()) return "";
  DEW_CHECK(e.is_array() && e.size() == 2 && (e[1].is_string() || e[1].is_null()), file.string(), ": \"", name,
            "\" must be [library, class], got ", e.dump());
  return e[1].is_null() ? "" : e[1].get<std::string>();
}

std::string expect_component(const json& index, const std::string& name, const std::vector<std::string>& accepted,
                             const fs::path& file) {
  const std::string c = index_component(index, name, file);
  std::string list;
  for (const auto& a : accepted) {
    if (c == a) return c;
    list += (list.empty() ? "" : ", ") + (a.empty() ? std::string("null") : a);
  }
  fail(file.string(), ": ", name, " is \"", c, "\"; accepted: ", list);
}

}  // namespace dew::interop::detail

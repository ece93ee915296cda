#include "dew/core/options.h"

#include <algorithm>

namespace dew {
namespace options_detail {

namespace {

// Renders at most `budget` characters of `j`, containers to a few levels: a hostile value can nest
// arrays hundreds of thousands deep, and json::dump() recurses once per level (a stack overflow).
void render(const json& j, int depth, size_t budget, std::string& out) {
  if (out.size() > budget) return;
  if (!j.is_structured()) {
    out += j.dump();
    return;
  }
  const bool array = j.is_array();
  if (depth >= 4) {
    out += array ? "[...]" : "{...}";
    return;
  }
  out += array ? "[" : "{";
  bool first = true;
  for (auto it = j.begin(); it != j.end() && out.size() <= budget; ++it) {
    if (!first) out += ", ";
    first = false;
    if (!array) out += json(it.key()).dump() + ": ";
    render(*it, depth + 1, budget, out);
  }
  out += array ? "]" : "}";
}

}  // namespace

std::string describe(const json& j) {
  std::string kind = j.is_null()             ? "null"
                     : j.is_boolean()        ? "bool"
                     : j.is_number_integer() ? "int"
                     : j.is_number()         ? "float"
                     : j.is_string()         ? "string"
                     : j.is_array()          ? "list"
                                             : "object";
  std::string text;
  render(j, 0, 60, text);
  if (text.size() > 60) text = text.substr(0, 57) + "...";
  return kind + " " + text;
}

}  // namespace options_detail

std::string format_fields(const std::vector<FieldInfo>& fields, const std::string& indent) {
  size_t wn = 0, wt = 0, wd = 0;
  std::vector<std::string> defaults;
  for (const auto& f : fields) {
    defaults.push_back(f.default_value.dump());
    wn = std::max(wn, f.name.size());
    wt = std::max(wt, f.type.size());
    wd = std::max(wd, defaults.back().size());
  }
  std::string out;
  for (size_t i = 0; i < fields.size(); ++i) {
    const auto& f = fields[i];
    std::string line = indent + f.name + std::string(wn - f.name.size() + 2, ' ') + f.type +
                       std::string(wt - f.type.size() + 2, ' ') + "= " + defaults[i] +
                       std::string(wd - defaults[i].size() + 2, ' ') + f.doc;
    if (!f.choices.empty()) {
      line += " (";
      for (size_t c = 0; c < f.choices.size(); ++c) line += (c ? " | " : "") + f.choices[c];
      line += ")";
    }
    out += line + "\n";
  }
  return out;
}

}  // namespace dew

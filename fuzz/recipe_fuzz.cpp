// libFuzzer target for recipes on the command line (dew/cli/recipe_args.cpp: what `dew train KIND --config FILE
// --a.b value ...` does to the kind's default recipe before runs::prepare parses it). The input is cut at NUL
// bytes: the default recipe (JSON), the open objects (comma-separated, e.g. "model.fields,data"), the contents of
// a --config file, then the arguments; an argument "@config" stands for "--config <that file>". Any input must be
// refused with a dew::Error or give a recipe that adds no key to an object of the defaults except under an open one,
// that --help can print, and from which parsing the same arguments again gives the same recipe; a crash, a
// sanitizer report or a hang is a bug.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "dew/cli/recipe_args.h"
#include "dew/core/error.h"
#include "dew/io/files.h"
#include "fuzz/fuzz_util.h"

namespace {

using dew::json;

const std::filesystem::path& scratch_dir() {
  static const auto dir = dew_fuzz::make_scratch_dir("recipe");
  return dir;
}

bool under_open(const std::string& path, const std::vector<std::string>& open) {
  for (const auto& o : open)
    if (path == o || path.rfind(o + ".", 0) == 0) return true;
  return false;
}

// Every key of `got` at `path`, where the defaults hold an object, is one of theirs or lies under an open object.
// (A value given where the default is not an object is a value: its type is the typed recipe's to check.)
void require_known_keys(const json& got, const json& defaults, const std::string& path,
                        const std::vector<std::string>& open) {
  if (!got.is_object() || !defaults.is_object()) return;
  for (auto it = got.begin(); it != got.end(); ++it) {
    const std::string key = path.empty() ? it.key() : path + "." + it.key();
    const bool known = defaults.contains(it.key());
    FUZZ_REQUIRE(known || under_open(path, open));
    if (known) require_known_keys(*it, defaults[it.key()], key, open);
  }
}

std::vector<std::string> split(std::string_view s, char sep) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= s.size()) {
    const size_t end = std::min(s.find(sep, start), s.size());
    out.emplace_back(s.substr(start, end - start));
    start = end + 1;
  }
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::vector<std::string> parts = split(std::string_view(reinterpret_cast<const char*>(data), size), '\0');
  if (parts.size() < 3) return 0;
  json defaults;
  try {
    defaults = dew::io::parse_json(parts[0], "defaults");
  } catch (const dew::Error&) {
    return 0;
  }
  if (!defaults.is_object()) return 0;
  std::vector<std::string> open;
  for (const auto& o : split(parts[1], ','))
    if (!o.empty()) open.push_back(o);
  const std::string config = (scratch_dir() / "config.json").string();
  dew_fuzz::write_file(config, parts[2]);
  std::vector<std::string> args;
  for (size_t i = 3; i < parts.size(); ++i) {
    if (parts[i] == "@config") {
      args.push_back("--config");
      args.push_back(config);
    } else {
      args.push_back(parts[i]);
    }
  }
  dew::cli::RecipeArgs got;
  try {
    got = dew::cli::parse_recipe_args(defaults, args, open);
  } catch (const dew::Error&) {
    return 0;  // refused, named
  }
  FUZZ_REQUIRE(got.recipe.is_object());
  require_known_keys(got.recipe, defaults, "", open);
  (void)dew::cli::format_tree(got.recipe);
  // The same command line gives the same recipe, and no arguments the defaults.
  FUZZ_REQUIRE(dew::cli::parse_recipe_args(defaults, args, open).recipe == got.recipe);
  FUZZ_REQUIRE(dew::cli::parse_recipe_args(defaults, {}, open).recipe == defaults);
  return 0;
}

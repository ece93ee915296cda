#include "dew/cli/recipe_args.h"

#include <algorithm>

#include "dew/io/files.h"
#include "dew/runs/record.h"

namespace dew::cli {

namespace {

bool is_open(const std::string& path, const std::vector<std::string>& open_objects) {
  for (const auto& o : open_objects)
    if (path == o || path.rfind(o + ".", 0) == 0) return true;
  return false;
}

std::string keys_of(const json& obj) {
  std::string out;
  for (auto it = obj.begin(); it != obj.end(); ++it) out += (out.empty() ? "" : ", ") + it.key();
  return out;
}

// Sets each key of `from` in `into` (the object at `path`), recursing into objects that are not open: a key
// unknown there is a dew::Error prefixed by `what` ("config", "--trainer").
void merge(json& into, const json& from, const std::string& path, const std::vector<std::string>& open_objects,
           const std::string& what) {
  for (auto it = from.begin(); it != from.end(); ++it) {
    const std::string key = path.empty() ? it.key() : path + "." + it.key();
    DEW_CHECK(into.contains(it.key()) || is_open(path, open_objects), what, ": unknown key \"", key,
              "\"; valid: ", keys_of(into));
    if (it->is_object() && into.contains(it.key()) && into[it.key()].is_object() && !is_open(key, open_objects))
      merge(into[it.key()], *it, key, open_objects, what);
    else into[it.key()] = *it;
  }
}

}  // namespace

void set_dotted(json& tree, const std::string& key, const std::string& value,
                const std::vector<std::string>& open_objects) {
  json* node = &tree;
  std::string path;
  size_t start = 0;
  while (true) {
    size_t dot = key.find('.', start);
    std::string part = key.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    DEW_CHECK(!part.empty(), "--", key, ": empty key component");
    DEW_CHECK(node->is_object(), "--", key, ": ", path, " is not an object");
    if (!node->contains(part)) {
      DEW_CHECK(is_open(path, open_objects), "unknown option --", key, "; valid keys", path.empty() ? "" : " under ",
                path, ": ", keys_of(*node));
      (*node)[part] = dot == std::string::npos ? json(nullptr) : json::object();
    }
    path = path.empty() ? part : path + "." + part;
    node = &(*node)[part];
    if (dot == std::string::npos) break;
    start = dot + 1;
  }
  // Bounded before parsing: a value nested thousands of levels deep would overflow the stack when the recipe
  // is later copied, compared or printed.
  io::check_json_depth(value, "--" + key);
  json parsed;
  try {
    parsed = json::parse(value);
  } catch (const std::exception&) {
    parsed = value;  // a bare word is a string
  }
  if (node->is_string() && !parsed.is_string()) parsed = value;  // "--run 2024" stays a string
  // A bare word holds the argument's bytes, which need not be UTF-8 (a Latin-1 path); a key may too.
  io::check_json_utf8(json{{key, parsed}}, "--" + key);
  // An object given for a section that is not open sets its keys as --config does (the others keep their
  // defaults; an unknown one is refused); an open object's value is replaced whole.
  if (parsed.is_object() && node->is_object() && !is_open(path, open_objects))
    merge(*node, parsed, path, open_objects, "--" + key);
  else *node = parsed;
}

RecipeArgs parse_recipe_args(const json& defaults, const std::vector<std::string>& args,
                             const std::vector<std::string>& open_objects) {
  RecipeArgs out;
  out.recipe = defaults;
  std::vector<std::pair<std::string, std::string>> overrides;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--help" || a == "-h") {
      out.help = true;
    } else if (a == "--config") {
      DEW_CHECK(i + 1 < args.size(), "--config: expected a file name");
      const std::string file = args[++i];
      json cfg = io::parse_json(io::read_file(file, "--config"), "--config " + file);
      DEW_CHECK(cfg.is_object(), "--config ", file, ": expected a JSON object");
      // A run's run.json reruns that run: its record-only keys are not part of the recipe.
      if (cfg.contains("kind") && cfg.contains("format")) cfg = runs::recipe_of_record(cfg);
      merge(out.recipe, cfg, "", open_objects, "config");
    } else if ((a == "--strict-resume" || a == "--strict_resume") && out.recipe.contains("trainer") &&
               !out.recipe.contains("strict_resume")) {
      // A switch: refuse to resume past a damaged latest checkpoint (trainer.strict_resume).
      overrides.emplace_back("trainer.strict_resume", "true");
    } else if (a.rfind("--", 0) == 0) {
      std::string key = a.substr(2), value;
      auto eq = key.find('=');
      if (eq != std::string::npos) {
        value = key.substr(eq + 1);
        key = key.substr(0, eq);
      } else {
        DEW_CHECK(i + 1 < args.size(), a, ": expected a value");
        value = args[++i];
      }
      // Recipe keys are snake_case; --reward-command reads as --reward_command.
      std::replace(key.begin(), key.end(), '-', '_');
      // --tensorboard off is trainer.tensorboard (docs/tensorboard.md).
      if (key == "tensorboard" && !out.recipe.contains("tensorboard") && out.recipe.contains("trainer"))
        key = "trainer.tensorboard";
      overrides.emplace_back(key, value);
    } else {
      out.positional.push_back(a);
    }
  }
  for (const auto& [k, v] : overrides) set_dotted(out.recipe, k, v, open_objects);
  return out;
}

std::string format_tree(const json& tree, const std::string& prefix) {
  std::string out;
  for (auto it = tree.begin(); it != tree.end(); ++it) {
    const std::string key = prefix.empty() ? it.key() : prefix + "." + it.key();
    if (it->is_object() && !it->empty()) out += format_tree(*it, key);
    else out += "  --" + key + " " + it->dump() + "\n";
  }
  return out;
}

}  // namespace dew::cli

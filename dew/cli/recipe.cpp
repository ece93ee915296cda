#include "dew/cli/recipe.h"

#include <algorithm>
#include <filesystem>
#include <fstream>

#include "dew/core/device.h"
#include "dew/io/files.h"
#include "dew/io/tensorboard.h"
#include "dew/runs/run.h"
#include "dew/training/run_dir.h"

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

void merge(json& into, const json& from, const std::string& path, const std::vector<std::string>& open_objects) {
  for (auto it = from.begin(); it != from.end(); ++it) {
    const std::string key = path.empty() ? it.key() : path + "." + it.key();
    DEW_CHECK(into.contains(it.key()) || is_open(path, open_objects), "config: unknown key \"", key,
              "\"; valid: ", keys_of(into));
    if (it->is_object() && into.contains(it.key()) && into[it.key()].is_object() && !is_open(key, open_objects))
      merge(into[it.key()], *it, key, open_objects);
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
  *node = parsed;
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
      merge(out.recipe, cfg, "", open_objects);
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

std::string Flags::get(const std::string& k, const std::string& def) const {
  auto it = values.find(k);
  return it == values.end() ? def : it->second;
}

int64_t Flags::get_int(const std::string& k, int64_t def) const {
  auto it = values.find(k);
  if (it == values.end()) return def;
  try {
    size_t used = 0;
    int64_t v = std::stoll(it->second, &used);
    if (used == it->second.size()) return v;
  } catch (const std::exception&) {}
  fail("--", k, ": expected an integer, got \"", it->second, "\"");
}

double Flags::get_double(const std::string& k, double def) const {
  auto it = values.find(k);
  if (it == values.end()) return def;
  try {
    size_t used = 0;
    double v = std::stod(it->second, &used);
    if (used == it->second.size()) return v;
  } catch (const std::exception&) {}
  fail("--", k, ": expected a number, got \"", it->second, "\"");
}

Flags parse_flags(const std::vector<std::string>& args, const std::vector<std::string>& known,
                  const std::vector<std::string>& switches) {
  Flags f;
  auto listed = [](const std::vector<std::string>& v, const std::string& k) {
    return std::find(v.begin(), v.end(), k) != v.end();
  };
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a.rfind("--", 0) != 0) {
      f.positional.push_back(a);
      continue;
    }
    std::string key = a.substr(2), value;
    auto eq = key.find('=');
    if (eq != std::string::npos) {
      value = key.substr(eq + 1);
      key = key.substr(0, eq);
    }
    if (!listed(known, key) && !listed(switches, key)) {
      std::string valid;
      for (const auto& k : known) valid += (valid.empty() ? "--" : ", --") + k;
      for (const auto& k : switches) valid += ", --" + k;
      fail("unknown flag --", key, "; accepted: ", valid);
    }
    if (listed(switches, key)) {
      f.values[key] = "1";
      continue;
    }
    if (eq == std::string::npos) {
      DEW_CHECK(i + 1 < args.size(), "--", key, ": expected a value");
      value = args[++i];
    }
    f.values[key] = value;
  }
  return f;
}

std::vector<std::string> take_repeated(std::vector<std::string>& args, const std::string& name) {
  std::vector<std::string> out, rest;
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--" + name) {
      DEW_CHECK(i + 1 < args.size(), "--", name, ": expected a value");
      out.push_back(args[++i]);
    } else if (args[i].rfind("--" + name + "=", 0) == 0) {
      out.push_back(args[i].substr(name.size() + 3));
    } else {
      rest.push_back(args[i]);
    }
  }
  args = rest;
  return out;
}

std::string append_eval_row(const std::string& run_dir, json row, const std::vector<std::string>& args) {
  std::string command = "dew eval";
  for (const auto& a : args) {
    const bool plain = !a.empty() && a.find_first_of(" \t'\"\\$`*?;&|<>(){}[]!#~") == std::string::npos;
    std::string quoted = "'";
    for (char c : a) quoted += c == '\'' ? std::string("'\\''") : std::string(1, c);
    command += " " + (plain ? a : quoted + "'");
  }
  row["command"] = command;
  const std::string path = training::RunDir(run_dir).eval_log();
  std::ofstream log(path, std::ios::app);
  log << row.dump() << "\n";
  DEW_CHECK(log.good(), "eval: cannot append to ", path);
  // TensorBoard, where training wrote it (trainer.tensorboard on): every number as the scalar
  // eval/[string fields/]NAME at the evaluated step (the string fields, e.g. weights and solver, tell rows
  // apart), and the row with its command as text.
  const std::string tb_dir = training::RunDir(run_dir).tensorboard();
  if (std::filesystem::is_directory(tb_dir)) {
    const int64_t step = row.value("step", int64_t(0));
    std::string qualifier;
    for (auto it = row.begin(); it != row.end(); ++it)
      if (it->is_string() && it.key() != "command") qualifier += it->get<std::string>() + "/";
    io::EventWriter tb(tb_dir);
    for (auto it = row.begin(); it != row.end(); ++it)
      if (it->is_number() && it.key() != "step") tb.add_scalar("eval/" + qualifier + it.key(), step, it->get<double>());
    tb.add_text("eval", step, "    " + row.dump());
  }
  return path;
}

runs::OpenOptions open_options(const Flags& f) {
  runs::OpenOptions o;
  o.weights = f.get("weights", "ema");
  DEW_CHECK(o.weights == "ema" || o.weights == "live" || o.weights == "reference", "--weights: got \"", o.weights,
            "\", accepted: ema, live, reference (dpo and grpo runs)");
  o.step = f.get_int("step", -1);
  DEW_CHECK(o.step >= -1, "--step: expected a checkpoint's step, got ", o.step);
  o.device = f.get("device", "auto");
  parse_device(o.device);
  return o;
}

}  // namespace dew::cli

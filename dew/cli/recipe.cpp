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

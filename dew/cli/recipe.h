// The flags of the CLI's commands: recipes (recipe_args.h), plain flags, the options that open a trained run, and
// the rows `dew eval` appends.
#pragma once
#include <map>
#include <string>
#include <vector>

#include "dew/cli/recipe_args.h"
#include "dew/core/options.h"
#include "dew/runs/run.h"

namespace dew::cli {

/// Simple flag parsing for non-recipe commands: --name value pairs and positionals; `known` lists the
/// accepted flags (dew::Error names the valid ones), `switches` those that take no value.
struct Flags {
  std::map<std::string, std::string> values;
  std::vector<std::string> positional;
  bool has(const std::string& k) const { return values.count(k) > 0; }
  std::string get(const std::string& k, const std::string& def) const;
  int64_t get_int(const std::string& k, int64_t def) const;
  double get_double(const std::string& k, double def) const;
};
Flags parse_flags(const std::vector<std::string>& args, const std::vector<std::string>& known,
                  const std::vector<std::string>& switches = {});

/// Takes every `--name VALUE` / `--name=VALUE` of a repeatable flag out of args, in order (before
/// parse_flags, which keeps one value per flag).
std::vector<std::string> take_repeated(std::vector<std::string>& args, const std::string& name);

/// --weights ema|live (default ema), --step N (default: the latest), --device (default: auto) of the
/// commands that open a trained run; checked here, before the run is read.
runs::OpenOptions open_options(const Flags& f);

/// Appends `row` to RUN/eval.jsonl with "command": the `dew eval` command line that measured it (`args`,
/// shell-quoted where needed), so every figure in the file names how it was made. Returns the file's path.
std::string append_eval_row(const std::string& run_dir, json row, const std::vector<std::string>& args);

}  // namespace dew::cli

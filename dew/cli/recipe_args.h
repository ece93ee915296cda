// Recipes (README.md): a JSON tree of defaults per `dew train` kind; `--config FILE` merges a file
// over it and `--a.b value` overrides any leaf (unknown keys list the valid ones; values are typed
// when the tree is parsed into the kind's recipe struct, runs::prepare). Torch-free: fuzzed alone
// (fuzz/recipe_fuzz.cpp).
#pragma once
#include <string>
#include <vector>

#include "dew/core/options.h"

namespace dew::cli {

/// Parsed command line of a recipe command: the recipe after --config and overrides, and whether
/// --help was asked for.
struct RecipeArgs {
  json recipe;
  bool help = false;
  std::vector<std::string> positional;
};

/// Applies `--config FILE` and `--a.b value` flags to `defaults`. Keys under an object listed in
/// `open_objects` (e.g. "model.fields") may be new; elsewhere an unknown key is a dew::Error.
RecipeArgs parse_recipe_args(const json& defaults, const std::vector<std::string>& args,
                             const std::vector<std::string>& open_objects = {});

/// Sets the value at a dotted key; `value` is parsed as JSON, falling back to a plain string. An object value
/// for an object that is not open sets its keys (known ones only), as --config does; elsewhere the value
/// replaces the old one. A key or value that is not valid UTF-8 is a dew::Error naming the flag.
void set_dotted(json& tree, const std::string& key, const std::string& value,
                const std::vector<std::string>& open_objects);

/// Every leaf of a tree as "a.b = value" lines (for --help).
std::string format_tree(const json& tree, const std::string& prefix = "");

}  // namespace dew::cli

// Sub-commands of the dew program. `run` dispatches on args[0]; each command parses its own flags and
// throws dew::Error on bad input.
#pragma once
#include <string>
#include <vector>

namespace dew::cli {

/// Runs the command line (without the program name); returns the exit code.
int run(const std::vector<std::string>& args);

/// `dew list [KIND]`: every registry (or one) with entries, fields and defaults.
int cmd_list(const std::vector<std::string>& args);

}  // namespace dew::cli

// Help texts of the commands that serve several run kinds, and the test for --help.
#pragma once
#include <string>
#include <vector>

namespace dew::cli {

/// Whether --help or -h is among `args`.
bool asks_help(const std::vector<std::string>& args);

/// `dew train --help`: every kind with its doc.
std::string train_usage();
/// `dew sample --help`: a run's flags and a diffusers pipeline's.
const char* sample_usage();
/// `dew eval --help` and `dew eval RUN --help`: the flags of every run kind, grouped by kind.
const char* eval_usage();
const char* models_usage();
const char* list_usage();

}  // namespace dew::cli

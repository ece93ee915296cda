// The report of a `dew bench` sweep, in Markdown: a summary table (each case's fastest time per side and the
// speed-ups vs Python eager and compiled), then a section per kind of case with its step, the machine line,
// each side's fastest configuration and every configuration's rounds.
#pragma once
#include <string>
#include <vector>

#include "dew/bench/cases.h"
#include "dew/bench/peers.h"

namespace dew::bench {

/// One thread configuration of one case: a measurement per round and side (C++, Python eager, Python under
/// torch.compile).
struct Config {
  int64_t intra = 1, blas = 1;
  std::vector<Measurement> cpp, py, pyc;
  int64_t ranks = 1;     // ddp: processes (each with `intra` threads)
  bool overlap = false;  // ddp: dist.overlap on (C++ only; otherwise the recipe's auto)
};

/// One case of a sweep: the fields its peer builds the model from (JSON text), its parameter count and its
/// thread configurations.
struct Row {
  const BenchCase* c = nullptr;
  std::string fields;
  int64_t params = 0;
  std::vector<Config> configs;
};

/// The fastest of a configuration's rounds by `key` (a time: ms/step, or the lm's generation ms/token): the
/// least disturbed by other work on the machine.
const Measurement& best(const std::vector<Measurement>& ms, double Measurement::*key = &Measurement::ms);
/// The fastest run of one side over the configurations that ran it; nullptr when none did.
const Measurement* fastest_of(const std::vector<Config>& configs, std::vector<Measurement> Config::*side,
                              double Measurement::*key = &Measurement::ms);
/// "intra 1, blas 2".
std::string config_name(const Measurement& m);

/// What the report states besides the measurements.
struct ReportContext {
  Sizes sizes;
  int64_t rounds = 1;
  std::string device;  // as both sides were given it, e.g. "cpu"
  Peers peers;
  json train_record;  // train, ddp, sample: the prepared default recipe's record, optim and trainer included
  std::string load_before, load_after;  // the 1-minute load average around the runs
  std::vector<std::string> command;     // the arguments `dew bench` was given
};

/// The whole report: the summary (when any Python peer ran), then the sections in the order of CaseKind.
std::string write_report(const std::vector<Row>& rows, const ReportContext& ctx);

}  // namespace dew::bench

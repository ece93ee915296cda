// `dew eval RUN` for a JEPA run: linear and kNN probes of the frozen encoder, with the baselines.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iostream>

#include "dew/cli/commands.h"
#include "dew/cli/recipe.h"
#include "dew/core/threads.h"
#include "dew/runs/jepa_run.h"

namespace dew::cli {

int cmd_eval_jepa(const std::vector<std::string>& args) {
  auto f = parse_flags(args,
                       {"train-items", "test-items", "knn-k", "probe-epochs", "probe-lr", "weights", "step", "device",
                        "threads", "seed", "pool", "knn-prep", "knn-vote", "knn-temperature"},
                       {"no-baselines"});
  DEW_CHECK(f.positional.size() == 1, "eval: expected one RUN directory, got ", f.positional.size(), " arguments");
  // The run's own probe settings (those of its validation), then the flags.
  runs::ProbeOptions p = runs::probe_options_of(runs::read_record_of_kind(f.positional[0], "jepa", "a JEPA run"));
  p.train_items = f.get_int("train-items", p.train_items);
  p.test_items = f.get_int("test-items", p.test_items);
  p.knn.k = f.get_int("knn-k", p.knn.k);
  p.linear.epochs = f.get_int("probe-epochs", p.linear.epochs);
  p.linear.lr = f.get_double("probe-lr", p.linear.lr);
  p.linear.seed = uint64_t(f.get_int("seed", 0));
  p.baselines = !f.has("no-baselines");
  p.pool = f.get("pool", p.pool);
  p.knn.prep = f.get("knn-prep", p.knn.prep);
  p.knn.vote = f.get("knn-vote", p.knn.vote);
  p.knn.temperature = f.get_double("knn-temperature", p.knn.temperature);
  const auto choice = [](const char* flag, const std::string& v, const std::vector<std::string>& ok) {
    std::string list;
    for (const auto& c : ok) list += (list.empty() ? "" : ", ") + c;
    DEW_CHECK(std::find(ok.begin(), ok.end(), v) != ok.end(), flag, ": got \"", v, "\", accepted: ", list);
  };
  choice("--knn-prep", p.knn.prep, metrics::knn_preps());
  choice("--knn-vote", p.knn.vote, metrics::knn_votes());
  DEW_CHECK(std::isfinite(p.knn.temperature) && p.knn.temperature > 0, "--knn-temperature: must be > 0, got ",
            p.knn.temperature);
  DEW_CHECK(p.train_items >= 0, "--train-items: must be >= 0 (0 = all), got ", p.train_items);
  DEW_CHECK(p.test_items >= 0, "--test-items: must be >= 0 (0 = all), got ", p.test_items);
  DEW_CHECK(p.knn.k >= 1, "--knn-k: must be >= 1, got ", p.knn.k);
  DEW_CHECK(p.linear.epochs >= 1, "--probe-epochs: must be >= 1, got ", p.linear.epochs);
  DEW_CHECK(p.linear.lr > 0, "--probe-lr: must be > 0, got ", p.linear.lr);
  const auto open = open_options(f);
  set_threads(f.get_int("threads", 0), workload_of("jepa_encoder"));
  const auto report = runs::probe_jepa_run(f.positional[0], p, open);
  const auto& rows = report.rows;
  const std::string knn = "kNN (k=" + std::to_string(p.knn.k) + ", " + p.knn.vote + ")";
  std::printf("%-28s %12s %12s\n", "features", "linear probe", knn.c_str());
  for (const auto& r : rows) std::printf("%-28s %12.4f %12.4f\n", r.features.c_str(), r.linear, r.knn);
  json row = report.record;
  row["file"] = report.file;
  std::cout << "written: " << report.file << "\nrow appended to " << append_eval_row(f.positional[0], row, args)
            << "\n";
  return 0;
}

}  // namespace dew::cli

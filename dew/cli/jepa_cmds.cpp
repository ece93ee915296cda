// `dew eval RUN` for a JEPA run: linear and kNN probes of the frozen encoder, with the baselines.
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
                        "threads", "seed", "pool", "knn-prep"},
                       {"no-baselines"});
  DEW_CHECK(f.positional.size() == 1, "eval: expected one RUN directory, got ", f.positional.size(), " arguments");
  runs::ProbeOptions p;
  p.train_items = f.get_int("train-items", p.train_items);
  p.test_items = f.get_int("test-items", p.test_items);
  p.knn_k = f.get_int("knn-k", p.knn_k);
  p.linear.epochs = f.get_int("probe-epochs", p.linear.epochs);
  p.linear.lr = f.get_double("probe-lr", p.linear.lr);
  p.linear.seed = uint64_t(f.get_int("seed", 0));
  p.baselines = !f.has("no-baselines");
  p.pool = f.get("pool", p.pool);
  p.knn_prep = f.get("knn-prep", p.knn_prep);
  DEW_CHECK(p.knn_prep == "none" || p.knn_prep == "center" || p.knn_prep == "standardize", "--knn-prep: got \"",
            p.knn_prep, "\", accepted: none, center, standardize");
  DEW_CHECK(p.train_items >= 0, "--train-items: must be >= 0 (0 = all), got ", p.train_items);
  DEW_CHECK(p.test_items >= 0, "--test-items: must be >= 0 (0 = all), got ", p.test_items);
  DEW_CHECK(p.knn_k >= 1, "--knn-k: must be >= 1, got ", p.knn_k);
  DEW_CHECK(p.linear.epochs >= 1, "--probe-epochs: must be >= 1, got ", p.linear.epochs);
  DEW_CHECK(p.linear.lr > 0, "--probe-lr: must be > 0, got ", p.linear.lr);
  const auto open = open_options(f);
  set_threads(f.get_int("threads", 0), workload_of("jepa_encoder"));
  const auto rows = runs::probe_jepa_run(f.positional[0], p, open);
  const std::string knn = "kNN (k=" + std::to_string(p.knn_k) + ")";
  std::printf("%-28s %12s %12s\n", "features", "linear probe", knn.c_str());
  for (const auto& r : rows) std::printf("%-28s %12.4f %12.4f\n", r.features.c_str(), r.linear, r.knn);
  std::cout << "written: " << f.positional[0] << "/eval/\n";
  return 0;
}

}  // namespace dew::cli

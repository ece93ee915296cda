#include "dew/bench/measure.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>

#include "dew/core/error.h"
#include "dew/data/dataset.h"

namespace dew::bench {

TempDir::TempDir(const std::string& name) {
  std::string pattern = (std::filesystem::temp_directory_path() / ("dew_" + name + "_XXXXXX")).string();
  DEW_CHECK(mkdtemp(pattern.data()) != nullptr, "cannot create a temporary directory like ", pattern, ": ",
            std::strerror(errno));
  path = pattern;
}

TempDir::~TempDir() {
  std::error_code ec;
  std::filesystem::remove_all(path, ec);
}

std::unique_ptr<training::Trainer> fixed_batch_trainer(const ObjectivePtr& objective, const data::Batch& batch,
                                                       const training::OptimOptions& optim, int64_t steps,
                                                       const std::string& run_dir) {
  data::LoaderOptions lo;
  lo.batch_size = batch.begin()->second.size(0);
  lo.shuffle = false;
  lo.num_workers = 0;
  auto loader = std::make_shared<data::DataLoader>(std::make_shared<data::TensorDataset>(batch, "fixed batch"), lo);
  training::TrainerOptions to;
  to.steps = steps;
  to.autocast = "off";
  return std::make_unique<training::Trainer>(objective, loader, optim, to, run_dir, /*seed=*/0);
}

double median(std::vector<double> v) {
  DEW_CHECK(!v.empty(), "median of no values (no timed repetitions)");
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

std::string load_average() {
  std::ifstream in("/proc/loadavg");
  std::string one;
  return in >> one ? one : std::string("n/a");
}

std::string utc_now() {
  const std::time_t t = std::time(nullptr);
  char buf[64];
  std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M UTC", std::gmtime(&t));
  return buf;
}

std::string fixed(double v, int digits) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", digits, v);
  return buf;
}

}  // namespace dew::bench

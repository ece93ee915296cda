#include "dew/cli/measure.h"

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "dew/core/error.h"
#include "dew/data/dataset.h"

namespace dew::cli {

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

}  // namespace dew::cli

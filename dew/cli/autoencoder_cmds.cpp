// `dew eval RUN` for an autoencoder run: PSNR and SSIM of its reconstructions of the held-out set.
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>

#include "dew/cli/commands.h"
#include "dew/cli/recipe.h"
#include "dew/core/threads.h"
#include "dew/runs/autoencoder_run.h"

namespace dew::cli {

int cmd_eval_autoencoder(const std::vector<std::string>& args) {
  auto f = parse_flags(args, {"count", "weights", "step", "device", "threads"});
  DEW_CHECK(f.positional.size() == 1, "eval: expected one RUN directory, got ", f.positional.size(), " arguments");
  const int64_t count = f.get_int("count", 0);
  DEW_CHECK(count >= 0, "--count: must be >= 0 (0 = the whole held-out set), got ", count);
  const auto open = open_options(f);
  set_threads(f.get_int("threads", 0), Workload::kIntraOp);
  const std::string dir = f.positional[0];
  const auto t0 = std::chrono::steady_clock::now();
  int64_t step = 0;
  const auto s = runs::score_autoencoder_run(dir, open, count, &step);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::cout << "| weights | step | images | PSNR (dB) | SSIM | L1 | KL per image | seconds "
               "|\n|---|---|---|---|---|---|---|---|\n"
            << "| " << open.weights << " | " << step << " | " << s.items << " | " << s.psnr << " | " << s.ssim << " | "
            << s.l1 << " | " << s.kl << " | " << secs << " |\n";
  const std::string log = append_eval_row(dir,
                                          {{"step", step},
                                           {"weights", open.weights},
                                           {"images", s.items},
                                           {"psnr", s.psnr},
                                           {"ssim", s.ssim},
                                           {"l1", s.l1},
                                           {"kl", s.kl},
                                           {"seconds", secs}},
                                          args);
  std::cout << "row appended to " << log << "\n";
  return 0;
}

}  // namespace dew::cli

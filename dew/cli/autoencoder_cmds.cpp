// `dew eval RUN` for an autoencoder run: PSNR and SSIM of its reconstructions of the held-out set, and LPIPS with
// --lpips-net / --lpips-weights / --lpips-backbone.
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>

#include "dew/cli/commands.h"
#include "dew/cli/recipe.h"
#include "dew/core/threads.h"
#include "dew/runs/autoencoder_run.h"

namespace dew::cli {

namespace {
// The LPIPS network the flags name (null without --lpips-net), built and its files loaded before anything runs.
std::shared_ptr<metrics::LpipsImpl> lpips_from_flags(const Flags& f) {
  if (!f.has("lpips-net")) {
    DEW_CHECK(!f.has("lpips-weights") && !f.has("lpips-backbone"),
              "--lpips-weights / --lpips-backbone: give --lpips-net alex|vgg as well");
    return nullptr;
  }
  DEW_CHECK(f.has("lpips-weights"),
            "--lpips-weights: required with --lpips-net (lpips' weights/v0.1/NET.pth converted to safetensors, "
            "docs/evaluation.md#clip-score-and-lpips)");
  metrics::LpipsOptions o;
  o.net(f.get("lpips-net", "alex")).weights(f.get("lpips-weights", "")).backbone(f.get("lpips-backbone", ""));
  return metrics::Lpips(o).ptr();
}
}  // namespace

int cmd_eval_autoencoder(const std::vector<std::string>& args) {
  auto f = parse_flags(
      args, {"count", "weights", "step", "device", "threads", "lpips-net", "lpips-weights", "lpips-backbone"});
  DEW_CHECK(f.positional.size() == 1, "eval: expected one RUN directory, got ", f.positional.size(), " arguments");
  const int64_t count = f.get_int("count", 0);
  DEW_CHECK(count >= 0, "--count: must be >= 0 (0 = the whole held-out set), got ", count);
  const auto open = open_options(f);
  set_threads(f.get_int("threads", 0), Workload::kIntraOp);
  const std::string dir = f.positional[0];
  const auto lpips = lpips_from_flags(f);
  json lpips_row = json::object();
  if (lpips) {
    // first: a run whose images the backbone cannot take is refused before the PSNR / SSIM pass
    const double d = runs::lpips_autoencoder_run(dir, *lpips, open, count);
    std::cout << "LPIPS (" << lpips->options.net() << ", lpips 0.1.4's distance, mean over the held-out images): " << d
              << "\n";
    lpips_row = {{"lpips", d}, {"lpips_net", lpips->options.net()}};
  }
  const auto t0 = std::chrono::steady_clock::now();
  int64_t step = 0;
  const auto s = runs::score_autoencoder_run(dir, open, count, &step);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::cout << "| weights | step | images | PSNR (dB) | SSIM | L1 | KL per image | seconds "
               "|\n|---|---|---|---|---|---|---|---|\n"
            << "| " << open.weights << " | " << step << " | " << s.items << " | " << s.psnr << " | " << s.ssim << " | "
            << s.l1 << " | " << s.kl << " | " << secs << " |\n";
  json row = {{"step", step},   {"weights", open.weights}, {"images", s.items},
              {"psnr", s.psnr}, {"ssim", s.ssim},          {"l1", s.l1},
              {"kl", s.kl},     {"seconds", secs}};
  row.update(lpips_row);
  const std::string log = append_eval_row(dir, row, args);
  std::cout << "row appended to " << log << "\n";
  return 0;
}

}  // namespace dew::cli

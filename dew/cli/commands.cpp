#include "dew/cli/commands.h"

#include <iostream>

#include "dew/cli/help.h"
#include "dew/core/registry.h"
#include "dew/io/stops.h"
#include "dew/runs/registries.h"

namespace dew::cli {

namespace {

const char* kUsage =
    "usage: dew COMMAND [ARGS]\n"
    "\n"
    "commands:\n"
    "  train diffusion [--config F] [--a.b v]   train (dew train diffusion --help lists every field)\n"
    "  train autoencoder [--a.b v]              train a KL autoencoder, latent diffusion's first stage\n"
    "  train lm [--config F] [--a.b v]          train a language model (default: bytes of the fortunes corpus)\n"
    "  train sft|dpo|grpo [--a.b v]             post-train a language model (docs/post_training.md)\n"
    "  train jepa [--a.b v]                     train a JEPA image or video encoder (docs/jepa.md)\n"
    "  launch --nproc-per-node N -- train KIND ...   data-parallel training on N ranks (dew launch --help)\n"
    "  sample RUN [flags]   sample a trained run to a PNG grid\n"
    "  sample --pipeline DIR --prompt TEXT --out F.png [flags]   run a diffusers SD / SDXL pipeline folder\n"
    "  generate RUN --prompt TEXT [flags]   continue prompts with a trained language model (dew generate --help)\n"
    "  eval RUN [flags]     a diffusion run: classifier accuracy and Frechet distance; a JEPA run: probes;\n"
    "                       an autoencoder run: PSNR and SSIM of held-out reconstructions;\n"
    "                       a language-model run: --prompts F scored by rewards\n"
    "  pairs RUN --prompts F --out F   DPO pairs from a policy's own samples (dew pairs --help)\n"
    "  task sums --out DIR  the post-training demo's task (sums of two 2-digit numbers)\n"
    "  bench [flags]        time a training step of the small CPU models, C++ vs Python eager\n"
    "  tune threads [flags] measure this machine's best intra-op x BLAS split and cache it\n"
    "  tokenize --input F|DIR --out DIR [flags]   text -> token files (dew tokenize --help)\n"
    "  export RUN DEST [flags]   a language-model run as a Hugging Face folder (dew export --help)\n"
    "  forward DIR --inputs F --out F [flags]   run one diffusers model folder on named tensors (dew forward --help)\n"
    "  models        registered models with fields and defaults\n"
    "  list [KIND]   every registry (models, datasets, presets, schedules, solvers, ...) with fields\n"
    "  version       print the version\n";

}  // namespace

int cmd_list(const std::vector<std::string>& args) {
  if (asks_help(args)) {
    std::cout << list_usage();
    return 0;
  }
  DEW_CHECK(args.size() <= 1, "list: expected at most one KIND, got ", args.size(), " arguments");
  std::string kinds;
  for (const auto* r : all_registries()) {
    kinds += (kinds.empty() ? "" : ", ") + r->kind();
    if (!args.empty() && args[0] != r->kind() && args[0] != r->kind() + "s") continue;
    std::cout << "== " << r->kind() << "s ==\n" << format_registry(*r) << "\n";
    if (!args.empty()) return 0;
  }
  DEW_CHECK(args.empty(), "list: unknown kind \"", args[0], "\"; accepted: ", kinds);
  return 0;
}

int run(const std::vector<std::string>& args) {
  if (args.empty() || args[0] == "--help" || args[0] == "-h" || args[0] == "help") {
    std::cout << kUsage;
    return args.empty() ? 2 : 0;
  }
  const std::string& cmd = args[0];
  std::vector<std::string> rest(args.begin() + 1, args.end());
  if (cmd == "list") return cmd_list(rest);
  if (cmd == "sample" || cmd == "eval" || cmd == "generate" || cmd == "pairs") {
    // A first SIGINT / SIGTERM stops these at their next sampling step or batch, before any output is
    // written (io::Stopped; main exits 128 + the signal); a second one at once.
    const io::StopScope stops(io::OnStop::kAtCheck);
    if (cmd == "sample") return cmd_sample(rest);
    if (cmd == "eval") return cmd_eval(rest);
    if (cmd == "generate") return cmd_generate(rest);
    return cmd_pairs(rest);
  }
  if (cmd == "train") return cmd_train(rest);
  if (cmd == "launch") return cmd_launch(rest);
  if (cmd == "models") return cmd_models(rest);
  if (cmd == "bench") return cmd_bench(rest);
  if (cmd == "tune") return cmd_tune(rest);
  if (cmd == "tokenize") return cmd_tokenize(rest);
  if (cmd == "export") return cmd_export(rest);
  if (cmd == "forward") return cmd_forward(rest);
  if (cmd == "task") return cmd_task(rest);
  if (cmd == "version" || cmd == "--version") {
    std::cout << "dew " << DEW_VERSION << "\n";
    return 0;
  }
  fail("unknown command \"", cmd,
       "\"; accepted: train, launch, sample, generate, eval, pairs, task, bench, tune, tokenize, export, forward, "
       "models, "
       "list, version (dew --help)");
}

}  // namespace dew::cli

// `dew bench`: flags in, one dew::bench call, the report out (dew/bench/ holds the cases, the timed loop, the
// child processes and Python peers, and the report). It times one training step of the small CPU models through
// the trainer's own step, in C++ and, in the same invocation, in Python PyTorch eager and under torch.compile
// doing the same per step (bench/peer.py and the other bench/*_peer.py), with the speed-up of the C++ side;
// `--models` adds the language model, the JEPA, DPO and GRPO-rollout steps, the Stable Diffusion components, the
// SD3 and Flux transformers, `dew train`'s throughput and `dew sample` (dew bench --help).
//
//   dew bench                                   # every diffusion model, intra-op {1,2} x BLAS {1,2} threads
//   dew bench --models unet --steps 10 --threads 1 --blas-threads 1 --out bench.md
//   dew bench --models lm --rounds 1            # the language model
//   dew bench --models dpo,grpo_rollout         # post-training: a DPO step, a GRPO rollout
//   dew bench --models sd_unet,sd_vae           # Stable Diffusion components against diffusers
//   dew bench --models sd3,flux                 # SD3 and Flux transformers' training steps against diffusers
//   dew bench --models sample --rounds 1        # `dew sample`: 100 images, 30 Euler steps
//   dew bench --models ddp                      # 1 rank x 2 threads vs 2 ranks x 1 thread, and PyTorch DDP
//
// Every (model, side, thread configuration) runs in a fresh child process (the dew binary re-executed with the
// hidden `--one MODEL`, or the Python peer), so each peak RSS belongs to one configuration and the BLAS threads
// can be set per child.
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>

#include "dew/bench/run_one.h"
#include "dew/bench/sweep.h"
#include "dew/cli/commands.h"
#include "dew/cli/help.h"
#include "dew/cli/recipe.h"
#include "dew/core/device.h"

namespace dew::cli {

namespace {

// The Python whose torch wheel dew was built against (DEW_PYTHON, the project's .venv), so both sides load
// the same libtorch; DEW_PEER_PYTHON names another.
std::string peer_python() {
  const char* p = std::getenv("DEW_PEER_PYTHON");
  return p && *p ? p : DEW_PYTHON;
}

const char* kBenchUsage =
    "usage: dew bench [--models simple_dit,unet,unet_attn,lm,jepa,dpo,grpo_rollout,sd_unet,sd_unet_lora,sd_vae,sd3,"
    "flux,train,sample,fid"
    " | --all] [--models ddp]\n"
    "                 [--steps N] [--warmup W] [--batch B] [--seq-len S] [--threads 1,2] [--blas-threads 1,2]\n"
    "                 [--images N] [--sample-steps S]\n"
    "                 [--rounds R] [--no-peer] [--peer FILE] [--lm-peer FILE] [--jepa-peer FILE] [--dpo-peer FILE]\n"
    "                 [--grpo-rollout-peer FILE] [--sd-peer FILE] [--train-peer FILE] [--sample-peer FILE]\n"
    "                 [--fid-peer FILE] [--ddp-peer FILE]\n"
    "                 [--diffusers-src DIR]\n"
    "                 [--peer-coretype CORE]\n"
    "                 [--peer-malloc-like-dew] [--out FILE.md]\n"
    "\n"
    "Times the trainer's own training step (Trainer::train_step: the loss, the finite guard, backward, gradient\n"
    "clipping, the warm-up + cosine learning rate, AdamW, the EMA) of one diffusion model per row, on a fixed batch,\n"
    "in C++ and in Python PyTorch eager (bench/peer.py run by the Python dew was built with, its .venv, so both\n"
    "load the same libtorch), for every combination of LibTorch intra-op threads (--threads) and BLAS threads\n"
    "(--blas-threads), each in a fresh process; then the training-step cases' and fid's Python peers under\n"
    "torch.compile (inductor, default mode) in their fastest eager configuration, compile time reported apart.\n"
    "Prints a summary table (each case's fastest time per side, speed-up vs eager and vs compiled = Python /\n"
    "C++), then a section per kind of case.\n"
    "\n"
    "  --models        simple_dit, unet (the demo model), unet_attn (attention at 14x14); default these\n"
    "                  three. Also simple_udit, uvit, simple_mmdit, hierarchical_mmdit, hybrid_dit,\n"
    "                  video_dit and unet_3d (8 x 32 x 32 Moving Fashion-MNIST clips); the Python peer\n"
    "                  implements simple_dit, unet, simple_mmdit and hybrid_dit. lm: the causal_transformer language"
    " model (byte vocab 257, width 256, 4\n"
    "                  layers, 4 heads): a training step (forward, cross entropy, backward, AdamW, EMA)\n"
    "                  in tokens/s, and greedy KV-cache generation in ms/token (batch 1, prompt 32\n"
    "                  tokens, 64 new tokens), against bench/lm_peer.py. jepa: a JEPA training step\n"
    "                  (`dew train jepa`'s models and step) against bench/jepa_peer.py. dpo: a DPO training\n"
    "                  step (DPOObjective on `dew train dpo`'s default byte causal_transformer: width 128,\n"
    "                  4 layers, 4 heads; 48-token pairs, the last 10 tokens the completion) against\n"
    "                  bench/dpo_peer.py (TRL's step). grpo_rollout: a GRPO rollout on that model (16 prompts\n"
    "                  of 36 tokens x group 8 = 128 rows, 16 tokens each sampled at temperature 1 with the\n"
    "                  batched KV-cache generator) in generated tokens/s, against bench/grpo_rollout_peer.py.\n"
    "                  sd_unet: a small Stable Diffusion UNet2DConditionModel's training step (epsilon MSE,\n"
    "                  AdamW, EMA; 8 latents 4x16x16, text 16 x 64); sd_unet_lora: the same step with LoRA\n"
    "                  adapters (rank 4 on to_q, to_k, to_v, to_out.0; the base frozen, no EMA) as\n"
    "                  train_text_to_image_lora.py, against diffusers + peft's add_adapter; sd_vae:\n"
    "                  AutoencoderKL encode + decode of 4 3x64x64 images without gradients; all against the\n"
    "                  pinned diffusers' own classes in Python (bench/sd_peer.py), built from the same\n"
    "                  config.json dict. sd3, flux: a training\n"
    "                  step of a small SD3Transformer2DModel (4 joint blocks) and FluxTransformer2DModel (FLUX.1\n"
    "                  dev's layout, 2 double + 4 single blocks), width 4 heads x 32, 4 latents 16x32x32, text\n"
    "                  16 x 64 and pooled 64: flow matching (logit-normal sigmas, velocity MSE), clip 1.0,\n"
    "                  AdamW, as diffusers' train_dreambooth_sd3.py / _flux.py; against diffusers' classes\n"
    "                  (bench/sd_peer.py) from the same config.json dict. train: `dew train\n"
    "                  diffusion`'s default recipe (unet, flow, batch 32) with its real Fashion-MNIST DataLoader,\n"
    "                  in samples/s over the timed steps, against bench/train_peer.py (the same loop around a\n"
    "                  torch.utils.data.DataLoader, num_workers 0, over the same images, dumped by dew).\n"
    "                  sample: `dew sample RUN` (sample_diffusion with its defaults: solver euler, 30 steps,\n"
    "                  guidance 3, chunks of 64) of 100 images on the default recipe's freshly initialised\n"
    "                  model, without the PNG, in ms per sampling run and images/s, against\n"
    "                  bench/sample_peer.py (the same Euler loop with classifier-free guidance, torch.no_grad)\n"
    "                  fid: FID's InceptionV3 feature extraction (8 images 3x64x64 resized to 299, pool3) in\n"
    "                  ms per pass and images/s, against pytorch-fid's InceptionV3 (bench/fid_peer.py)\n"
    "  --all           every model above, lm, jepa, dpo, grpo_rollout, sd_unet, sd_unet_lora, sd_vae, sd3, flux, "
    "train,\n"
    "                  sample and fid included (not ddp)\n"
    "  --models ddp    data-parallel `dew train`: the train case's run (its recipe, loader and trainer step) as\n"
    "                  1 rank x 2 threads and as 2 ranks x 1 thread under `dew launch` (Gloo on 127.0.0.1), against\n"
    "                  bench/ddp_peer.py (train_peer.py's loop, the model in PyTorch DDP under torchrun, Gloo):\n"
    "                  samples/s, the scaling efficiency (2 ranks / 1 rank) and the gradient all-reduce's share of\n"
    "                  the step; --threads and --blas-threads do not apply. Explicit only: it runs for minutes\n"
    "  --steps N       timed steps (grpo_rollout: rollouts; sample: sampling runs, default 1) per configuration,\n"
    "                  median reported (default 20)\n"
    "  --warmup W      untimed steps first (default 5; sample: untimed sampling runs, default 0, after one\n"
    "                  untimed forward of each chunk's doubled batch)\n"
    "  --images N      sample: images per sampling run (default 100)\n"
    "  --sample-steps S  sample: the sampler's steps (grid points; default 30, as `dew sample`)\n"
    "  --batch B       batch size (default 32; lm, sd_vae, sd3, flux: 4; sd_unet(_lora): 8; dpo: pairs;\n"
    "                  grpo_rollout: not used)\n"
    "  --seq-len S     lm: training tokens per row (default 256)\n"
    "  --threads L     LibTorch intra-op thread counts to try (default 1,2)\n"
    "  --blas-threads L  BLAS threads to try (OPENBLAS_NUM_THREADS; dew sets oneMKL's itself; default 1,2)\n"
    "  --rounds R      measure every configuration R times per side, alternating, keep the fastest\n"
    "                  (default 2: process-to-process spread on a shared machine is 10-30%)\n"
    "  --device D      auto (CUDA when present, else CPU) | cpu | cuda | cuda:N, for both sides (the Python\n"
    "                  peer needs PyTorch >= 2.0 for a CUDA device)\n"
    "  --no-peer       C++ only\n"
    "  --no-compile    Python eager only: skip the torch.compile runs of the training-step cases and fid (each\n"
    "                  compiles for 30-120 s on 2 cores)\n"
    "  --peer FILE     the Python peer (default: bench/peer.py next to the build directory)\n"
    "  --lm-peer FILE  the language model's Python peer (default: bench/lm_peer.py, found the same way)\n"
    "  --jepa-peer FILE  the JEPA step's Python peer (default: bench/jepa_peer.py, found the same way)\n"
    "  --dpo-peer FILE  the DPO step's Python peer (default: bench/dpo_peer.py, found the same way)\n"
    "  --grpo-rollout-peer FILE  the rollout's Python peer (default: bench/grpo_rollout_peer.py)\n"
    "  --sd-peer FILE  the diffusers cases' Python peer: sd_unet(_lora), sd_vae, sd3, flux (default: "
    "bench/sd_peer.py)\n"
    "  --train-peer FILE  the train case's Python peer (default: bench/train_peer.py)\n"
    "  --sample-peer FILE  the sample case's Python peer (default: bench/sample_peer.py)\n"
    "  --fid-peer FILE  the fid case's Python peer (default: bench/fid_peer.py)\n"
    "  --ddp-peer FILE  the ddp case's Python peer (default: bench/ddp_peer.py)\n"
    "  --diffusers-src DIR  the `src` folder of a diffusers checkout the diffusers peer imports instead of\n"
    "                  the environment's diffusers (default: $DEW_DIFFUSERS_SRC, else the installed package)\n"
    "  --peer-coretype CORE  OPENBLAS_CORETYPE for the Python peer (default: the caller's environment;\n"
    "                  dew itself switches OpenBLAS from its SSE3 fallback to the CPU's AVX-512/AVX2\n"
    "                  kernels, Python does not, so --peer-coretype SkylakeX compares like with like)\n"
    "  --peer-malloc-like-dew  give the Python peer dew's malloc settings (GLIBC_TUNABLES: freed memory\n"
    "                  is kept for reuse, as the dew program does for itself; see docs/training.md)\n"
    "  --out FILE.md   also write the report to FILE.md\n"
    "\n"
    "dew bench --one MODEL --threads T [--steps N] [--warmup W] [--profile FILE.json] [--overlap on|off] runs one C++\n"
    "configuration in this process and prints its JSON line; --profile writes a Chrome trace of the timed\n"
    "steps' operators (chrome://tracing, Perfetto); for lm, FILE.generate.json has the timed generations'.\n"
    "--overlap (ddp): dist.overlap, the gradient all-reduce during backward (on) or after it (off).\n";

// The flags naming a peer script, each a key of bench::PeerOptions::files.
const std::vector<std::string> kPeerFlags = {"peer",    "lm-peer",    "jepa-peer",   "dpo-peer", "grpo-rollout-peer",
                                             "sd-peer", "train-peer", "sample-peer", "fid-peer", "ddp-peer"};

std::vector<int64_t> int_list(const Flags& f, const std::string& flag, const std::string& def) {
  std::vector<int64_t> out;
  for (const auto& item : bench::split_list(f.get(flag, def), flag)) {
    size_t used = 0;
    int64_t v = -1;
    try {
      v = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    DEW_CHECK(used == item.size() && v >= 1, "--", flag, ": expected positive integers like 1,2, got \"",
              f.get(flag, def), "\"");
    out.push_back(v);
  }
  return out;
}

}  // namespace

int cmd_bench(const std::vector<std::string>& args) {
  if (asks_help(args)) {
    std::cout << kBenchUsage;
    return 0;
  }
  const Flags f = parse_flags(args, {"models",     "steps",        "warmup",        "batch",
                                     "threads",    "blas-threads", "rounds",        "peer",
                                     "out",        "one",          "peer-coretype", "seq-len",
                                     "lm-peer",    "jepa-peer",    "dpo-peer",      "grpo-rollout-peer",
                                     "profile",    "device",       "sd-peer",       "diffusers-src",
                                     "train-peer", "images",       "sample-steps",  "sample-peer",
                                     "fid-peer",   "ddp-peer",     "overlap"},
                              {"no-peer", "no-compile", "help", "all", "peer-malloc-like-dew"});
  if (f.has("help")) {
    std::cout << kBenchUsage;
    return 0;
  }
  DEW_CHECK(f.positional.empty(), "bench: unexpected argument \"", f.positional.empty() ? "" : f.positional[0],
            "\" (dew bench --help)");
  // Every size is checked at its default; an unset one stays unset, so each case takes its own default.
  bench::Sizes sizes;
  const int64_t steps = f.get_int("steps", 20), warmup = f.get_int("warmup", 5), batch = f.get_int("batch", 32);
  DEW_CHECK(steps >= 1, "--steps: must be >= 1, got ", steps);
  DEW_CHECK(warmup >= 0, "--warmup: must be >= 0, got ", warmup);
  DEW_CHECK(batch >= 1, "--batch: must be >= 1, got ", batch);
  if (f.has("steps")) sizes.steps = steps;
  if (f.has("warmup")) sizes.warmup = warmup;
  if (f.has("batch")) sizes.batch = batch;
  sizes.seq_len = f.get_int("seq-len", sizes.seq_len);
  DEW_CHECK(sizes.seq_len >= 1, "--seq-len: must be >= 1, got ", sizes.seq_len);
  sizes.images = f.get_int("images", sizes.images);
  sizes.sample_steps = f.get_int("sample-steps", sizes.sample_steps);
  DEW_CHECK(sizes.images >= 1, "--images: must be >= 1, got ", sizes.images);
  DEW_CHECK(sizes.sample_steps >= 1, "--sample-steps: must be >= 1, got ", sizes.sample_steps);
  const auto threads = int_list(f, "threads", "1,2");
  const auto blas_threads = int_list(f, "blas-threads", "1,2");
  const int64_t rounds = f.get_int("rounds", 2);
  DEW_CHECK(rounds >= 1, "--rounds: must be >= 1, got ", rounds);
  const c10::Device device = parse_device(f.get("device", "auto"));

  if (f.has("one")) {
    DEW_CHECK(threads.size() == 1, "--one: needs exactly one --threads value, got \"", f.get("threads", ""), "\"");
    bench::OneOptions o;
    o.sizes = sizes;
    o.threads = threads[0];
    o.profile = f.get("profile", "");
    o.device = device;
    o.overlap = f.get("overlap", "");
    DEW_CHECK(o.overlap.empty() || o.overlap == "auto" || o.overlap == "on" || o.overlap == "off", "--overlap: got \"",
              o.overlap, "\"; accepted: auto, on, off");
    const json line = bench::run_one(bench::find_case(f.get("one", "")), o);
    if (!line.is_null()) std::cout << line.dump() << std::endl;  // null: a ddp rank other than 0
    return 0;
  }

  DEW_CHECK(!(f.has("all") && f.has("models")), "--all and --models: give one of them");
  bench::SweepOptions o;
  o.cases = bench::select_cases(f.get("models", f.has("all") ? bench::all_case_names() : "simple_dit,unet,unet_attn"));
  DEW_CHECK(bench::any_of_kind(o.cases, bench::CaseKind::lm) || !f.has("seq-len"),
            "--seq-len: only the language model uses it; add lm to --models");
  DEW_CHECK(bench::any_of_kind(o.cases, bench::CaseKind::sample) || !(f.has("images") || f.has("sample-steps")),
            "--images, --sample-steps: only the sample case uses them; add sample to --models");
  o.sizes = sizes;
  o.threads = threads;
  o.blas_threads = blas_threads;
  o.rounds = rounds;
  o.device = device;
  o.program = std::filesystem::read_symlink("/proc/self/exe").string();
  o.peers = !f.has("no-peer");
  o.compile = !f.has("no-compile");
  o.peer.python = peer_python();
  for (const auto& flag : kPeerFlags)
    if (f.has(flag)) o.peer.files[flag] = f.get(flag, "");
  // The diffusers the SD peer imports: a checkout named by --diffusers-src or $DEW_DIFFUSERS_SRC, else ("") the
  // environment's pinned package.
  const char* diffusers_env = std::getenv("DEW_DIFFUSERS_SRC");
  o.peer.diffusers_src = f.get("diffusers-src", diffusers_env && *diffusers_env ? diffusers_env : "");
  if (f.has("peer-coretype")) o.peer.coretype = f.get("peer-coretype", "");
  o.peer.malloc_like_dew = f.has("peer-malloc-like-dew");
  o.command = args;

  const std::string report = bench::sweep(o, std::cerr);
  std::cout << report;
  if (f.has("out")) {
    std::ofstream out(f.get("out", ""));
    DEW_CHECK(out && (out << report), "--out: cannot write \"", f.get("out", ""), "\"");
    std::cerr << "bench: wrote " << f.get("out", "") << "\n";
  }
  return 0;
}

}  // namespace dew::cli

// `dew bench`: one diffusion training step of the small CPU models through the trainer's own step
// (training::Trainer::train_step: DiffusionObjective's loss, the finite guard, backward, gradient clipping, the
// learning-rate schedule, AdamW, the EMA), timed in C++ and, in the same invocation, in Python PyTorch eager
// doing the same per step (bench/peer.py),
// with the speed-up of the C++ side. `--models lm` times the causal_transformer language model instead
// (a training step with cross entropy, and greedy KV-cache generation) against bench/lm_peer.py; `--models
// jepa`, `dpo` and `grpo_rollout` time `dew train jepa`'s step, `dew train dpo`'s step and GRPO's batched
// sampling rollouts against bench/jepa_peer.py, bench/dpo_peer.py and bench/grpo_rollout_peer.py; `--models
// sd_unet,sd_vae` time a small Stable Diffusion UNet's training step and a VAE's encode + decode against the
// real diffusers classes in Python (bench/sd_peer.py, built from the same config.json dict). `--models train`
// measures `dew train`'s throughput on the default recipe with its real data loader against bench/train_peer.py;
// `--models sample` times `dew sample RUN` (sample_diffusion: 100 images, 30 Euler steps, guidance 3) on the
// default recipe's model against bench/sample_peer.py.
//
//   dew bench                                   # every diffusion model, intra-op {1,2} x BLAS {1,2} threads
//   dew bench --models unet --steps 10 --threads 1 --blas-threads 1 --out bench.md
//   dew bench --models lm --rounds 1            # the language model
//   dew bench --models dpo,grpo_rollout         # post-training: a DPO step, a GRPO rollout
//   dew bench --models sd_unet,sd_vae           # Stable Diffusion components against diffusers
//   dew bench --models sample --rounds 1        # `dew sample`: 100 images, 30 Euler steps
//
// Every (model, side, thread configuration) runs in a fresh child process (the dew binary re-executed
// with the hidden `--one MODEL`, or the Python peer), so each peak RSS belongs to one configuration and
// the BLAS threads can be set per child (OPENBLAS_NUM_THREADS, read by OpenBLAS when it loads; dew's children
// tell oneMKL themselves).
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Version.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/profiler_legacy.h>
#include <dlfcn.h>
#include <sched.h>
#include <torch/cuda.h>
#include <torch/version.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <iostream>

#include "dew/cli/child_process.h"
#include "dew/cli/commands.h"
#include "dew/cli/measure.h"
#include "dew/cli/recipe.h"
#include "dew/core/device.h"
#include "dew/core/threads.h"
#include "dew/diffusion/process.h"
#include "dew/nn/backbones/backbone.h"
#include "dew/nn/backbones/causal_transformer.h"
#include "dew/nn/roles.h"
#include "dew/objectives/dpo.h"
#include "dew/nn/fused.h"
#include "dew/objectives/jepa.h"
#include "dew/objectives/lm.h"
#include "dew/core/rng.h"
#include "dew/data/dataset.h"
#include "dew/io/safetensors.h"
#include "dew/objectives/diffusion.h"
#include "dew/runs/jepa_run.h"
#include "dew/runs/run.h"
#include "dew/sampling/diffusion_sample.h"
#include "dew/sampling/generate.h"
#include "dew/training/optim.h"
#include "dew/training/trainer.h"


namespace fs = std::filesystem;

namespace dew::cli {

namespace {

// The Python whose torch wheel dew was built against (DEW_PYTHON, the project's .venv), so both sides load
// the same libtorch; DEW_PEER_PYTHON names another.
const char* kPython = [] {
  const char* p = std::getenv("DEW_PEER_PYTHON");
  return p && *p ? p : DEW_PYTHON;
}();

// The step's hyper-parameters; bench/peer.py holds the same values.
constexpr double kLr = 1e-3;
constexpr double kEmaDecay = 0.995;
constexpr int64_t kImage = 28;  // input side in pixels (Fashion-MNIST)
// The language model's generation: batch 1, a prompt of kLmPrompt random ids, kLmNewTokens greedy tokens,
// one untimed then kLmGenReps timed generations (median); bench/lm_peer.py gets the same values.
constexpr int64_t kLmPrompt = 32;
constexpr int64_t kLmNewTokens = 64;
constexpr int64_t kLmGenReps = 5;
// Post-training (`dew train dpo` / `grpo`'s default byte model): DPO pairs of kDpoLen tokens whose last
// kDpoCompletion are the completion; GRPO rollouts of kGrpoPrompts prompts of kGrpoPromptLen tokens, each
// sampled kGrpoGroup times (temperature 1, no EOS) for kGrpoNewTokens tokens. The peers get the same values.
constexpr int64_t kDpoLen = 48;
constexpr int64_t kDpoCompletion = 10;
constexpr int64_t kGrpoPrompts = 16;
constexpr int64_t kGrpoGroup = 8;
constexpr int64_t kGrpoPromptLen = 36;
constexpr int64_t kGrpoNewTokens = 16;
// Stable Diffusion components (sd_unet, sd_vae): the step of diffusers' train_text_to_image.py (learning rate
// 1e-4; SD's scaled_linear noise schedule over 1000 steps) on a batch of kSdUnetBatch latents of 4 x kSdLatent^2
// with kSdContextLen text tokens, and the VAE on kSdVaeBatch images of 3 x kSdImage^2 (sizes for a step of
// 0.2-1 s on 2 cores). bench/sd_peer.py holds the same step values.
constexpr int64_t kSdUnetBatch = 8;
constexpr int64_t kSdVaeBatch = 4;
constexpr int64_t kSdLatent = 16;
constexpr int64_t kSdContextLen = 16;
constexpr int64_t kSdImage = 64;
constexpr double kSdLr = 1e-4;
constexpr int64_t kSdTrainTimesteps = 1000;
constexpr double kSdBetaStart = 0.00085, kSdBetaEnd = 0.012;
// `dew sample RUN` on the default recipe's model: kSampleImages images with `dew sample`'s defaults (solver
// euler, kSampleSteps grid points, guidance kSampleGuidance on a class-conditional run, chunks of
// DiffusionSampleOptions' batch_size); kSampleRuns timed sampling runs after kSampleWarmup untimed ones
// (--steps and --warmup for this case), each side warmed up by one forward of every chunk's doubled batch first.
// bench/sample_peer.py gets the same values.
constexpr int64_t kSampleImages = 100;
constexpr int64_t kSampleSteps = 30;
constexpr double kSampleGuidance = 3.0;  // cmd_sample's default for a class-conditional or text run
constexpr int64_t kSampleRuns = 1;    // one run is 60 forwards of 72-128 rows: 20-80 s on 2 shared cores
constexpr int64_t kSampleWarmup = 0;  // the network-alone forwards before the runs warm every chunk's shape up

const char* kBenchUsage =
    "usage: dew bench [--models simple_dit,unet,unet_attn,lm,jepa,dpo,grpo_rollout,sd_unet,sd_vae,train,sample | --all]\n"
    "                 [--steps N] [--warmup W] [--batch B] [--seq-len S] [--threads 1,2] [--blas-threads 1,2]\n"
    "                 [--images N] [--sample-steps S]\n"
    "                 [--rounds R] [--no-peer] [--peer FILE] [--lm-peer FILE] [--jepa-peer FILE] [--dpo-peer FILE]\n"
    "                 [--grpo-rollout-peer FILE] [--sd-peer FILE] [--train-peer FILE] [--sample-peer FILE]\n"
    "                 [--diffusers-src DIR]\n"
    "                 [--peer-coretype CORE]\n"
    "                 [--peer-malloc-like-dew] [--out FILE.md]\n"
    "\n"
    "Times the trainer's own training step (Trainer::train_step: the loss, the finite guard, backward, gradient\n"
    "clipping, the warm-up + cosine learning rate, AdamW, the EMA) of one diffusion model per row, on a fixed batch,\n"
    "in C++ and in Python PyTorch eager (bench/peer.py run by the Python dew was built with, its .venv, so both\n"
    "load the same libtorch), for every combination of LibTorch intra-op threads (--threads) and BLAS threads\n"
    "(--blas-threads), each in a fresh process; then the training-step cases' Python peers under torch.compile\n"
    "(inductor, default mode) in their fastest eager configuration, compile time reported apart. Prints a\n"
    "summary table (each case's fastest time per side, speed-up vs eager and vs compiled = Python / C++), then\n"
    "a section per kind of case.\n"
    "\n"
    "  --models        simple_dit, unet (the demo model), unet_attn (attention at 14x14); default these\n"
    "                  three. Also simple_udit, uvit, simple_mmdit, hierarchical_mmdit, hybrid_dit,\n"
    "                  video_dit and unet_3d (8 x 32 x 32 Moving Fashion-MNIST clips); the Python peer\n"
    "                  implements simple_dit, unet, simple_mmdit and hybrid_dit. lm: the causal_transformer language model (byte vocab 257, width 256, 4\n"
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
    "                  AdamW, EMA; 8 latents 4x16x16, text 16 x 64); sd_vae: AutoencoderKL encode + decode of\n"
    "                  4 3x64x64 images without gradients; both against the real diffusers v0.34.0 classes in\n"
    "                  Python (bench/sd_peer.py), built from the same config.json dict. train: `dew train\n"
    "                  diffusion`'s default recipe (unet, flow, batch 32) with its real Fashion-MNIST DataLoader,\n"
    "                  in samples/s over the timed steps, against bench/train_peer.py (the same loop around a\n"
    "                  torch.utils.data.DataLoader, num_workers 0, over the same images, dumped by dew).\n"
    "                  sample: `dew sample RUN` (sample_diffusion with its defaults: solver euler, 30 steps,\n"
    "                  guidance 3, chunks of 64) of 100 images on the default recipe's freshly initialised\n"
    "                  model, without the PNG, in ms per sampling run and images/s, against\n"
    "                  bench/sample_peer.py (the same Euler loop with classifier-free guidance, torch.no_grad)\n"
    "  --all           every model above, lm, jepa, dpo, grpo_rollout, sd_unet, sd_vae, train and sample included\n"
    "  --steps N       timed steps (grpo_rollout: rollouts; sample: sampling runs, default 1) per configuration,\n"
    "                  median reported (default 20)\n"
    "  --warmup W      untimed steps first (default 5; sample: untimed sampling runs, default 0, after one\n"
    "                  untimed forward of each chunk's doubled batch)\n"
    "  --images N      sample: images per sampling run (default 100)\n"
    "  --sample-steps S  sample: the sampler's steps (grid points; default 30, as `dew sample`)\n"
    "  --batch B       batch size (default 32; lm, sd_vae: 4; sd_unet: 8; dpo: pairs; grpo_rollout: not used)\n"
    "  --seq-len S     lm: training tokens per row (default 256)\n"
    "  --threads L     LibTorch intra-op thread counts to try (default 1,2)\n"
    "  --blas-threads L  BLAS threads to try (OPENBLAS_NUM_THREADS; dew sets oneMKL's itself; default 1,2)\n"
    "  --rounds R      measure every configuration R times per side, alternating, keep the fastest\n"
    "                  (default 2: process-to-process spread on a shared machine is 10-30%)\n"
    "  --device D      auto (CUDA when present, else CPU) | cpu | cuda | cuda:N, for both sides (the Python\n"
    "                  peer needs PyTorch >= 2.0 for a CUDA device)\n"
    "  --no-peer       C++ only\n"
    "  --no-compile    Python eager only: skip the torch.compile runs of the training-step cases (each\n"
    "                  compiles for 30-120 s on 2 cores)\n"
    "  --peer FILE     the Python peer (default: bench/peer.py next to the build directory)\n"
    "  --lm-peer FILE  the language model's Python peer (default: bench/lm_peer.py, found the same way)\n"
    "  --jepa-peer FILE  the JEPA step's Python peer (default: bench/jepa_peer.py, found the same way)\n"
    "  --dpo-peer FILE  the DPO step's Python peer (default: bench/dpo_peer.py, found the same way)\n"
    "  --grpo-rollout-peer FILE  the rollout's Python peer (default: bench/grpo_rollout_peer.py)\n"
    "  --sd-peer FILE  the Stable Diffusion components' Python peer (default: bench/sd_peer.py)\n"
    "  --train-peer FILE  the train case's Python peer (default: bench/train_peer.py)\n"
    "  --sample-peer FILE  the sample case's Python peer (default: bench/sample_peer.py)\n"
    "  --diffusers-src DIR  the `src` folder of a diffusers checkout the SD peer imports instead of\n"
    "                  the environment's diffusers (default: $DEW_DIFFUSERS_SRC, else the installed package)\n"
    "  --peer-coretype CORE  OPENBLAS_CORETYPE for the Python peer (default: the caller's environment;\n"
    "                  dew itself switches OpenBLAS from its SSE3 fallback to the CPU's AVX-512/AVX2\n"
    "                  kernels, Python does not, so --peer-coretype SkylakeX compares like with like)\n"
    "  --peer-malloc-like-dew  give the Python peer dew's malloc settings (GLIBC_TUNABLES: freed memory\n"
    "                  is kept for reuse, as the dew program does for itself; see docs/training.md)\n"
    "  --out FILE.md   also write the report to FILE.md\n"
    "\n"
    "dew bench --one MODEL --threads T [--steps N] [--warmup W] [--profile FILE.json] runs one C++\n"
    "configuration in this process and prints its JSON line; --profile writes a Chrome trace of the timed\n"
    "steps' operators (chrome://tracing, Perfetto); for lm, FILE.generate.json has the timed generations'.\n";

// One benchmarked model: a registry architecture at a fixed small CPU size.
struct BenchCase {
  std::string name;  // what --models selects
  std::string arch;  // dew::models registry name (also the peer's --model)
  std::string size;  // for the table
  json fields;
  std::vector<int64_t> item = {1, kImage, kImage};  // one input: [C, H, W] or [C, T, H, W]
  int64_t context_len = 0;                           // text tokens ([B, L, context_features]); 0 = none
  bool peer = true;                                  // bench/peer.py implements it
};

const std::vector<BenchCase>& bench_cases() {
  // Fashion-MNIST-shaped inputs (1 x 28 x 28, 10 classes; 32 x 32 where a model needs a power of two,
  // Moving Fashion-MNIST's 8 x 32 x 32 for video); unet is the `dew train diffusion` demo model. The
  // transformers share one size: width 128, 4 layers, 4 heads, patch 4 (49 or 64 tokens per frame).
  static const std::vector<BenchCase> cases = [] {
    const json unet = {{"in_channels", 1},         {"output_channels", 1},          {"num_classes", 10},
                       {"emb_features", 64},       {"feature_depths", {32, 64}},    {"num_res_blocks", 1},
                       {"num_middle_res_blocks", 1}, {"norm_groups", 8},
                       {"attention_configs", {nullptr, nullptr}}};
    json unet_attn = unet;
    unet_attn["attention_configs"] = {nullptr, 4};
    const json dit = {{"in_channels", 1}, {"output_channels", 1}, {"num_classes", 10}, {"patch_size", 4},
                      {"emb_features", 128}, {"num_layers", 4}, {"num_heads", 4}};
    auto with = [](json base, const json& extra) {
      base.update(extra);
      return base;
    };
    const std::string dit_size = "1x28x28, patch 4 (49 tokens), width 128, 4 layers, 4 heads";
    const std::vector<int64_t> video = {1, 8, 32, 32};
    json unet_3d = unet;
    unet_3d["temporal_heads"] = 4;
    return std::vector<BenchCase>{
        {"simple_dit", "simple_dit", dit_size, dit},
        {"unet", "unet", "1x28x28, depths [32,64], 1 res block, no attention", unet},
        {"unet_attn", "unet", "1x28x28, depths [32,64], 1 res block, 4-head attention at 14x14", unet_attn},
        {"simple_udit", "simple_udit", dit_size + ", skips 2 -> 2", dit, {1, kImage, kImage}, 0, false},
        {"uvit", "uvit", dit_size + ", time + label tokens, position table for 28 px",
         with(dit, {{"image_size", kImage}}), {1, kImage, kImage}, 0, false},
        {"simple_mmdit", "simple_mmdit", dit_size + ", text 16 tokens x 64", with(dit, {{"context_features", 64}}),
         {1, kImage, kImage}, 16, true},
        {"hierarchical_mmdit", "hierarchical_mmdit",
         "1x32x32, base patch 2, widths [64,128,256], layers [2,2,4], heads [2,4,8], text 16 tokens x 64",
         {{"in_channels", 1}, {"output_channels", 1}, {"num_classes", 10}, {"base_patch_size", 2},
          {"emb_features", {64, 128, 256}}, {"num_layers", {2, 2, 4}}, {"num_heads", {2, 4, 8}},
          {"context_features", 64}},
         {1, 32, 32}, 16, false},
        {"hybrid_dit", "hybrid_dit", dit_size + ", S5 state 64, 3 SSM : 1 attention, bidirectional",
         with(dit, {{"ssm_state_dim", 64}}), {1, kImage, kImage}, 0, true},
        {"video_dit", "video_dit", "1x8x32x32, patch 4 (8 x 64 tokens), width 128, 4 layers, 4 heads", dit, video, 0,
         false},
        {"unet_3d", "unet_3d", "1x8x32x32, the unet above per frame + 4-head temporal attention per level", unet_3d,
         video, 0, false},
    };
  }();
  return cases;
}

// The language model: a byte-level causal_transformer (256 bytes + EOS) at a small CPU size; the other
// fields keep their defaults (SwiGLU MLP of width 704, qk-norm, RoPE on the whole head, tied head).
const BenchCase& lm_case() {
  static const BenchCase c{"lm", "causal_transformer",
                           "byte vocab 257, width 256, 4 layers, 4 heads of 64, SwiGLU 704, qk-norm, tied head",
                           {{"vocab_size", 257}, {"emb_features", 256}, {"num_layers", 4}, {"num_heads", 4}}};
  return c;
}

// The lm fields for a training length: max_seq_len must cover it and the generation.
json lm_fields(int64_t seq_len) {
  json f = lm_case().fields;
  f["max_seq_len"] = std::max<int64_t>({2048, seq_len, kLmPrompt + kLmNewTokens});
  return f;
}

// The JEPA step: `dew train jepa`'s models and masks on Fashion-MNIST-shaped images. The recipe
// (runs::default_recipe("jepa")) is completed for 1 x 28 x 28 inputs by runs::build_jepa_models, as `dew train
// jepa` completes it, so the bench and the recipe cannot drift apart: "model" and "predictor" are then the
// configs of the models timed. The models built here are dropped; their own generator keeps the caller's
// draws where they were.
const json& jepa_recipe() {
  static const json r = [] {
    json c = runs::default_recipe("jepa");
    rng::DefaultGeneratorScope scope(0, 0, "bench");
    runs::build_jepa_models(c, {1, 1, kImage, kImage}, "bench");
    return c;
  }();
  return r;
}
const BenchCase& jepa_case() {
  static const BenchCase c = [] {
    const json &e = jepa_recipe()["model"], &f = e["fields"], &p = jepa_recipe()["predictor"]["fields"];
    const int64_t g = kImage / f["patch_size"].get<int64_t>();
    const std::string size = "1x28x28, patch " + f["patch_size"].dump() + " (" + std::to_string(g * g) +
                             " tokens); encoder width " + f["emb_features"].dump() + ", " + f["num_layers"].dump() +
                             " layers, " + f["num_heads"].dump() + " heads; predictor " + p["emb_features"].dump() +
                             ", " + p["num_layers"].dump() + " layers, " + p["num_heads"].dump() + " heads";
    return BenchCase{"jepa", e["architecture"].get<std::string>(), size, f};
  }();
  return c;
}
JEPAObjectiveOptions jepa_objective_options() {
  return from_json<JEPAObjectiveOptions>(jepa_recipe()["objective"], "objective");
}
std::string jepa_masks_text() {
  const auto m = jepa_objective_options().masks;
  return std::to_string(m.targets) + " target block(s) of scale [" + fixed(m.target_scale.first, 2) + ", " +
         fixed(m.target_scale.second, 2) + "], context scale [" + fixed(m.context_scale.first, 2) + ", " +
         fixed(m.context_scale.second, 2) + "], min_keep " + std::to_string(m.min_keep);
}

// Post-training: the fresh model of `dew train dpo` and `dew train grpo` (post_training_defaults: the byte
// tokenizer's 257 ids, width 128, 4 layers, 4 heads, context 64; the other fields their defaults).
const json& post_training_fields() {
  static const json f = {{"vocab_size", 257}, {"emb_features", 128}, {"num_layers", 4}, {"num_heads", 4},
                         {"max_seq_len", 64}};
  return f;
}
const char* kPostTrainingSize = "byte vocab 257, width 128, 4 layers, 4 heads of 32, SwiGLU 384, qk-norm, tied head, context 64";
const BenchCase& dpo_case() {
  static const BenchCase c{"dpo", "causal_transformer", kPostTrainingSize, post_training_fields()};
  return c;
}
const BenchCase& grpo_rollout_case() {
  static const BenchCase c{"grpo_rollout", "causal_transformer", kPostTrainingSize, post_training_fields()};
  return c;
}

// Stable Diffusion components, each written once as its diffusers config.json dict: the C++ model is built
// from it (models::fields_from_reference_config, as `dew forward` loads a diffusers folder) and
// bench/sd_peer.py gives the same dict to the diffusers class, so the two cannot drift apart.

// The table's size column: "key value" of the config entries that shape the work.
std::string sd_size(const std::string& inputs, const json& config, const std::vector<std::string>& keys) {
  std::string s = inputs;
  for (const auto& k : keys) s += ", " + k + " " + config.at(k).dump();
  return s;
}
// sd_unet: SD 1.x's UNet2DConditionModel layout (conv proj_in / proj_out, attention_head_dim = heads, a
// cross-attention mid-block) at two levels of widths 64 and 128, attention at the first.
const json& sd_unet_config() {
  static const json config = {
      {"_class_name", "UNet2DConditionModel"},
      {"sample_size", kSdLatent},
      {"in_channels", 4},
      {"out_channels", 4},
      {"down_block_types", {"CrossAttnDownBlock2D", "DownBlock2D"}},
      {"up_block_types", {"UpBlock2D", "CrossAttnUpBlock2D"}},
      {"block_out_channels", {64, 128}},
      {"layers_per_block", 2},
      {"norm_num_groups", 32},
      {"cross_attention_dim", 64},
      {"attention_head_dim", 8}};
  return config;
}
// sd_vae: AutoencoderKL with SD's 4 latent channels at three levels (images downsampled 4x).
const json& sd_vae_config() {
  static const json config = {
      {"_class_name", "AutoencoderKL"},
      {"in_channels", 3},
      {"out_channels", 3},
      {"down_block_types", {"DownEncoderBlock2D", "DownEncoderBlock2D", "DownEncoderBlock2D"}},
      {"up_block_types", {"UpDecoderBlock2D", "UpDecoderBlock2D", "UpDecoderBlock2D"}},
      {"block_out_channels", {64, 128, 128}},
      {"layers_per_block", 2},
      {"latent_channels", 4},
      {"norm_num_groups", 32},
      {"sample_size", kSdImage},
      {"scaling_factor", 0.18215}};
  return config;
}
const BenchCase& sd_unet_case() {
  static const BenchCase c = [] {
    const json& config = sd_unet_config();
    const std::string in = "latents 4x" + std::to_string(kSdLatent) + "x" + std::to_string(kSdLatent) + ", text " +
                           std::to_string(kSdContextLen) + " x " + config.at("cross_attention_dim").dump();
    return BenchCase{"sd_unet", "unet_2d_condition",
                     sd_size(in, config, {"down_block_types", "block_out_channels", "layers_per_block",
                                          "attention_head_dim"}),
                     models::fields_from_reference_config("unet_2d_condition", config), {4, kSdLatent, kSdLatent},
                     kSdContextLen, true};
  }();
  return c;
}
const BenchCase& sd_vae_case() {
  static const BenchCase c = [] {
    const json& config = sd_vae_config();
    const std::string in = "images 3x" + std::to_string(kSdImage) + "x" + std::to_string(kSdImage);
    return BenchCase{"sd_vae", "autoencoder_kl",
                     sd_size(in, config, {"block_out_channels", "layers_per_block", "latent_channels"}),
                     models::fields_from_reference_config("autoencoder_kl", config), {3, kSdImage, kSdImage}, 0, true};
  }();
  return c;
}
// `dew train`'s throughput: the default recipe (runs::default_recipe("diffusion"), what `dew train diffusion`
// and scripts/demo run with no flags) with its real data loader; its fields are the recipe's.
const BenchCase& train_case() {
  static const BenchCase c{"train", "unet",
                           "`dew train diffusion`'s default recipe: unet 1x28x28, depths [32,64], 1 res block, flow "
                           "preset, Fashion-MNIST's 60000 training images through the DataLoader",
                           runs::default_recipe("diffusion")["model"]["fields"]};
  return c;
}

// `dew sample RUN` on the model of the default recipe (the fields the train case trains; completed by runs::prepare
// from the data: 1 channel in and out, 10 classes).
const BenchCase& sample_case() {
  static const BenchCase c{"sample", "unet",
                           "`dew train diffusion`'s default recipe model (unet 1x28x28, depths [32,64], 1 res block, "
                           "flow preset), freshly initialised",
                           runs::default_recipe("diffusion")["model"]["fields"]};
  return c;
}

bool is_sd(const BenchCase* c) { return c == &sd_unet_case() || c == &sd_vae_case(); }
// The diffusers config.json dict an SD case is built from.
const json& reference_config(const BenchCase* c) { return c == &sd_unet_case() ? sd_unet_config() : sd_vae_config(); }

// The cases beyond the diffusion table, in --all's order.
const std::vector<const BenchCase*>& other_cases() {
  static const std::vector<const BenchCase*> v = {&lm_case(),      &jepa_case(),   &dpo_case(), &grpo_rollout_case(),
                                                  &sd_unet_case(), &sd_vae_case(), &train_case(),
                                                  &sample_case()};
  return v;
}

const BenchCase& find_case(const std::string& name) {
  std::string names;
  for (const auto& c : bench_cases()) {
    if (c.name == name) return c;
    names += (names.empty() ? "" : ", ") + c.name;
  }
  for (const BenchCase* c : other_cases()) {
    if (c->name == name) return *c;
    names += ", " + c->name;
  }
  fail("bench: unknown model \"", name, "\"; accepted: ", names);
}

std::vector<std::string> split_list(const std::string& s, const std::string& flag) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= s.size()) {
    size_t comma = s.find(',', start);
    if (comma == std::string::npos) comma = s.size();
    std::string item = s.substr(start, comma - start);
    DEW_CHECK(!item.empty(), "--", flag, ": expected a comma-separated list, got \"", s, "\"");
    out.push_back(item);
    start = comma + 1;
  }
  return out;
}

std::vector<int64_t> int_list(const Flags& f, const std::string& flag, const std::string& def) {
  std::vector<int64_t> out;
  for (const auto& item : split_list(f.get(flag, def), flag)) {
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

// Peak resident set size of this process (VmHWM), in MB.
double peak_rss_mb() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("VmHWM:", 0) == 0) return std::stod(line.substr(6)) / 1024.0;  // "VmHWM:  123456 kB"
  return 0.0;
}


// A measured child's threads: `threads` intra-op threads and the configuration's BLAS threads, which the
// parent passes as OPENBLAS_NUM_THREADS (read by OpenBLAS when it loads; oneMKL is told here).
void set_child_threads(int64_t threads) {
  at::set_num_threads(int(threads));
  if (const char* b = std::getenv("OPENBLAS_NUM_THREADS"); b && std::atoll(b) >= 1) set_blas_threads(std::atoll(b));
}

// The result line a measured child prints (the keys bench/peer.py and bench/lm_peer.py print too), from
// per-step seconds: total and the forward / backward / optimizer phases.
json step_result(const std::vector<double>& total, const std::vector<double>& fwd, const std::vector<double>& bwd,
                 const std::vector<double>& upd, int64_t batch, int64_t nparams, double loss_value) {
  const double ms = median(total) * 1e3;
  const char* blas = std::getenv("OPENBLAS_NUM_THREADS");
  return {{"ms_per_step", ms},
          {"samples_per_s", double(batch) / (ms / 1e3)},
          {"peak_rss_mb", peak_rss_mb()},
          {"params", nparams},
          {"threads", at::get_num_threads()},
          {"blas_threads", blas ? blas : ""},
          {"blas_core", blas_core()},
          {"phases_ms", {{"forward", median(fwd) * 1e3}, {"backward", median(bwd) * 1e3},
                         {"optimizer", median(upd) * 1e3}}},
          {"loss", loss_value},
          {"torch", TORCH_VERSION}};
}

// ---- the measured child: `dew bench --one MODEL --threads T ...` ----

// The time once the device has finished its queued work (CUDA runs asynchronously; the CPU does not).
std::chrono::steady_clock::time_point synced_now(const c10::Device& device) {
  if (device.is_cuda()) torch::cuda::synchronize(device.index());
  return std::chrono::steady_clock::now();
}

// The optimizer of every step the bench times through the trainer: the trainer's defaults (AdamW, weight
// decay 0.01 on matrices, global-norm clip 1.0 as every recipe keeps it, cosine decay to 0.1 lr) at peak lr
// kLr, warmed up linearly over the untimed steps so the timed ones run the decay. The peers get it as
// --optim JSON and apply the same schedule, clip and finite check.
training::OptimOptions bench_optim(int64_t warmup) {
  training::OptimOptions oo;
  oo.lr = kLr;
  oo.warmup_steps = warmup;
  return oo;
}

// Per-step seconds of training steps and the last loss. forward = taking the batch + the loss (the
// objective's forward) + its finite check; backward = backward + gradient norm and clip; optimizer = the
// rest of the step (zero_grad, AdamW, the EMA).
struct StepTimes {
  std::vector<double> total, fwd, bwd, upd;
  double loss = 0;
  int64_t params = 0;
};

// warmup + steps steps of `objective` through the trainer's own step (training::Trainer::train_step, the
// step `dew train` takes: zero_grad, the objective's loss with its generators from (seed 0, step), the finite
// guard, backward, clip_grad_norm, the warm-up + cosine learning rate, AdamW, the EMA of objective->ema()),
// on `batch` every step: an in-memory loader over exactly its rows (in order, built on the caller's thread),
// so data costs one gather of the batch. Autocast is off (both sides compute in fp32). The warm-up steps
// are not timed; `profile` (non-empty) writes a Chrome trace of the timed steps.
StepTimes time_trainer_steps(const ObjectivePtr& objective, const data::Batch& batch, int64_t warmup, int64_t steps,
                             const c10::Device& device, const std::string& what, const std::string& profile = "") {
  auto secs = [](std::chrono::steady_clock::duration d) { return std::chrono::duration<double>(d).count(); };
  objective->module().train();
  StepTimes t;
  for (const auto& p : objective->module().parameters())
    if (p.requires_grad()) t.params += p.numel();
  TempDir dir("bench_" + what);
  const auto trainer = fixed_batch_trainer(objective, batch, bench_optim(warmup), warmup + steps, dir.path.string());
  std::unique_ptr<torch::autograd::profiler::RecordProfile> trace;  // --profile: the timed steps only
  for (int64_t i = 0; i < warmup + steps; ++i) {
    if (i == warmup && !profile.empty()) trace = std::make_unique<torch::autograd::profiler::RecordProfile>(profile);
    const auto t0 = synced_now(device);
    const training::StepOutcome out = trainer->train_step();
    const auto t1 = synced_now(device);
    DEW_CHECK(out.finite, "bench ", what, ": non-finite loss at step ", i);
    t.loss = out.loss;
    if (i < warmup) continue;
    const double total = secs(t1 - t0), fwd = out.data_s + out.loss_s;
    t.total.push_back(total);
    t.fwd.push_back(fwd);
    t.bwd.push_back(out.backward_s);
    t.upd.push_back(std::max(0.0, total - fwd - out.backward_s));  // synced: on CUDA the update runs async
  }
  trace.reset();  // writes the trace file
  return t;
}

// DiffusionObjective's loss in pixel space (images to [-1, 1], the process's training inputs, each label
// replaced by the null class with probability unconditional_prob) with a fixed text context in place of the
// text encoder the real objective would need: the bench's objective for the models that read a context
// (simple_mmdit, hierarchical_mmdit). The other diffusion cases train the real DiffusionObjective.
class FixedContextDiffusion : public Objective {
 public:
  FixedContextDiffusion(BackbonePtr model, diffusion::Preset preset, int64_t num_classes, Conditioning context)
      : model_(std::move(model)), process_(std::move(preset)), num_classes_(num_classes), context_(std::move(context)) {}
  std::string name() const override { return "bench_fixed_context_diffusion"; }
  torch::nn::Module& module() override { return *model_; }
  LossOutput loss(const data::Batch& batch, int64_t, at::Generator gen) override {
    const auto device = module_device(*model_);
    const at::Tensor x0 = data::to_model_range(batch.at("image")).to(device);
    auto in = process_.training_inputs(x0, gen);
    Conditioning c = context_;
    if (num_classes_ > 0) {
      const at::Tensor& labels = batch.at("label");
      auto drop = at::rand({x0.size(0)}, gen) < DiffusionObjectiveOptions{}.unconditional_prob;
      c.labels = at::where(drop, at::full_like(labels, num_classes_), labels).to(device);
    }
    return {process_.loss(model_->forward(in.net_input, in.model_time, c), in), {}};
  }
  training::EmaSpec ema() const override { return {kEmaDecay}; }
  std::vector<std::string> batch_fields() const override { return {"image", "label"}; }

 private:
  BackbonePtr model_;
  diffusion::DiffusionProcess process_;
  int64_t num_classes_;
  Conditioning context_;
};

// Runs warmup + steps diffusion training steps of one case through the trainer and prints one JSON line
// (same keys as bench/peer.py). The objective is `dew train diffusion`'s DiffusionObjective (EDM pixel
// preset, unconditional_prob 0.12, EMA decay kEmaDecay) on a fixed batch of uint8 images and labels.
int run_one(const BenchCase& c, int64_t batch, int64_t warmup, int64_t steps, int64_t threads,
            const std::string& profile, const c10::Device& device) {
  set_child_threads(threads);
  at::manual_seed(0);  // parameter initialisation draws from the global generator
  auto model = models::build(c.arch, c.fields);
  model->to(device);
  diffusion::PresetOptions po;
  po.regime = "pixel";
  auto preset = diffusion::preset("edm", po);

  // A fixed batch stands in for the data loader: the bench times the step, not the input pipeline.
  auto data_gen = at::detail::createCPUGenerator(1);
  const auto& f = c.fields;
  const int64_t num_classes = f.value("num_classes", int64_t(0));
  std::vector<int64_t> shape = {batch};
  shape.insert(shape.end(), c.item.begin(), c.item.end());
  data::Batch b{{"image", at::randint(0, 256, shape, data_gen).to(at::kByte)}};
  if (num_classes > 0) b["label"] = at::randint(0, num_classes, {batch}, data_gen);
  else b["label"] = at::zeros({batch}, at::kLong);
  ObjectivePtr objective;
  if (c.context_len > 0) {
    Conditioning cond;
    cond.context = at::randn({batch, c.context_len, f["context_features"].get<int64_t>()}, data_gen).to(device);
    cond.context_mask = at::ones({batch, c.context_len}, at::TensorOptions().dtype(at::kBool).device(device));
    objective = std::make_shared<FixedContextDiffusion>(model, preset, num_classes, cond);
  } else {
    DiffusionObjectiveOptions o;
    o.ema_decay = kEmaDecay;
    objective = std::make_shared<DiffusionObjective>(model, preset, o, num_classes, c.item);
  }
  const StepTimes t = time_trainer_steps(objective, b, warmup, steps, device, c.name, profile);
  std::cout << step_result(t.total, t.fwd, t.bwd, t.upd, batch, t.params, t.loss).dump() << std::endl;
  return 0;
}

// `dew train diffusion`'s default recipe as `dew train` builds it (runs::prepare: model, objective, the
// Fashion-MNIST DataLoader with its worker thread), run directory `dir` (nothing is written there),
// `threads` intra-op threads, `batch` items per batch (0: the recipe's).
runs::PreparedRun prepare_default_train(const std::string& dir, int64_t threads, int64_t batch, const c10::Device& device) {
  json recipe = runs::default_recipe("diffusion");
  recipe["run"] = dir;
  recipe["threads"] = threads;
  recipe["device"] = device.str();
  if (batch > 0) recipe["loader"]["batch_size"] = batch;
  return runs::prepare("diffusion", recipe);
}

// Runs warmup + steps optimizer steps of `dew train`'s default recipe through the Trainer it builds
// (train_step: the loader's next batch, the DiffusionObjective's loss, clip, schedule, AdamW, EMA) and prints
// one JSON line: samples_per_s = items / seconds of the timed steps, ms_per_step their mean (the same
// throughput), phases and data_ms medians (data_ms: waiting for the loader).
int run_one_train(int64_t batch, int64_t warmup, int64_t steps, int64_t threads, const c10::Device& device) {
  auto secs = [](std::chrono::steady_clock::duration d) { return std::chrono::duration<double>(d).count(); };
  TempDir dir("bench_train");
  auto run = prepare_default_train(dir.path.string(), threads, batch, device);
  training::Trainer trainer(run.built.objective, run.built.loader, run.optim, run.trainer, dir.path.string(),
                            uint64_t(run.options.seed));
  std::vector<double> total, data, fwd, bwd, upd;
  double seconds = 0, loss = 0;
  int64_t samples = 0;
  for (int64_t i = 0; i < warmup + steps; ++i) {
    const auto t0 = synced_now(device);
    const training::StepOutcome out = trainer.train_step();
    const auto t1 = synced_now(device);
    DEW_CHECK(out.finite, "bench train: non-finite loss at step ", i);
    loss = out.loss;
    if (i < warmup) continue;
    const double s = secs(t1 - t0);
    seconds += s;
    samples += out.samples;
    total.push_back(s);
    data.push_back(out.data_s);
    fwd.push_back(out.loss_s);
    bwd.push_back(out.backward_s);
    upd.push_back(std::max(0.0, s - out.data_s - out.loss_s - out.backward_s));
  }
  int64_t nparams = 0;
  for (const auto& p : trainer.parameters()) nparams += p.second.numel();
  json j = step_result(total, fwd, bwd, upd, run.built.loader->options().batch_size, nparams, loss);
  j["ms_per_step"] = seconds / double(steps) * 1e3;
  j["samples_per_s"] = double(samples) / seconds;
  j["data_ms"] = median(data) * 1e3;
  std::cout << j.dump() << std::endl;
  return 0;
}

// The sampling options `dew sample RUN` builds (cmd_sample) for a class-conditional run with no flags but
// --count and --steps: solver euler, guidance kSampleGuidance (1 = unguided when the run has no classes), seed
// 0, DiffusionSampleOptions' chunk size, one row per label cycling through the classes (for a count that is a
// multiple of the class count, cmd_sample's labels: the class list repeated).
DiffusionSampleOptions sample_options(const std::vector<int64_t>& shape, int64_t num_classes, int64_t images,
                                      int64_t sample_steps) {
  DiffusionSampleOptions g;
  g.shape = shape;
  g.solver = "euler";
  g.steps = sample_steps;
  g.seed = 0;
  g.count = images;
  g.guidance.scale = num_classes > 0 ? kSampleGuidance : 1.0;
  if (num_classes > 0) g.labels = at::arange(images, at::kLong).remainder(num_classes);
  g.clamp = true;  // a pixel run
  return g;
}

// Runs warmup + steps sampling runs of `dew sample RUN` on the default recipe's model and prints one JSON line:
// ms_per_step = ms per sampling run (median), samples_per_s = images/s. The run is built as
// runs::open_diffusion_run builds a trained one (the recipe's model from its completed record, eval mode, on the
// device; the process from its preset), the weights freshly initialised instead of loaded; each run is what
// cmd_sample does per call after opening the run, except writing the PNG: sample_diffusion (no gradients; per
// chunk of 64 the labels, the prior, sample_steps - 1 Euler steps and the final denoise, each a forward of the
// doubled batch for classifier-free guidance, the clamp) then run.images (nothing in pixel space) and .cpu().
// phases_ms.forward = the network's forwards alone on the same doubled chunks, measured after the runs (the median
// of 3 per chunk, times sample_steps): an estimate of the model's share. One forward per chunk before the runs
// warms every chunk's shape up.
int run_one_sample(int64_t images, int64_t sample_steps, int64_t warmup, int64_t steps, int64_t threads,
                   const c10::Device& device) {
  using clock = std::chrono::steady_clock;
  auto secs = [](clock::duration d) { return std::chrono::duration<double>(d).count(); };
  auto now = [&] { return synced_now(device); };
  json record;
  {
    TempDir dir("bench_sample");
    record = prepare_default_train(dir.path.string(), threads, 0, device).record;  // the loader ends here
  }
  set_child_threads(threads);
  at::manual_seed(0);
  BackbonePtr model = models::build(record["model"]["architecture"], record["model"]["fields"]);
  model->to(device);
  model->eval();
  const diffusion::DiffusionProcess process(*diffusion::presets().build(record["preset"]));
  const auto shape = record["derived"]["sample_shape"].get<std::vector<int64_t>>();
  const int64_t num_classes = record["model"]["fields"].value("num_classes", int64_t(0));
  int64_t nparams = 0;
  for (const auto& p : model->parameters()) nparams += p.numel();
  const DiffusionSampleOptions g = sample_options(shape, num_classes, images, sample_steps);
  dew::validate(g, process);

  // The network alone on each chunk's doubled batch (conditional rows, then the null class): one untimed forward
  // per chunk before the runs (the warm-up of its shape's kernels and allocations), three timed after them.
  const bool guided = g.guidance.scale != 1.0 && g.labels.defined();
  const auto net_forwards = [&](int reps) {
    at::NoGradGuard ng;
    auto gen = at::detail::createCPUGenerator(3);
    double ms = 0;
    for (int64_t b0 = 0; b0 < images; b0 += g.batch_size) {
      const int64_t n = std::min(g.batch_size, images - b0), rows = guided ? 2 * n : n;
      std::vector<int64_t> xs = {rows};
      xs.insert(xs.end(), shape.begin(), shape.end());
      const at::Tensor x = at::randn(xs, gen).to(device);
      const at::Tensor t = at::full({rows}, 500.0f, at::TensorOptions().device(device));
      Conditioning c;
      if (num_classes > 0) {
        const at::Tensor l = g.labels.slice(0, b0, b0 + n);
        c.labels = (guided ? at::cat({l, at::full_like(l, num_classes)}) : l).to(device);
      }
      std::vector<double> s;
      for (int k = 0; k < reps; ++k) {
        const auto t0 = now();
        model->forward(x, t, c);
        s.push_back(secs(now() - t0));
      }
      ms += median(s) * 1e3;
    }
    return ms;  // one forward of every chunk
  };
  net_forwards(1);

  std::vector<double> total;
  double out = 0;
  for (int64_t r = 0; r < warmup + steps; ++r) {
    const auto t0 = now();
    const at::Tensor x = sample_diffusion(*model, process, g).cpu();  // run.images: pixel samples as they are
    const auto t1 = now();
    out = x.square().mean().item<double>();
    DEW_CHECK(x.size(0) == images, "bench sample: ", x.size(0), " images, expected ", images);
    if (r >= warmup) total.push_back(secs(t1 - t0));
  }
  DEW_CHECK(std::isfinite(out), "bench sample: non-finite samples (mean square ", out, ")");

  const double net = net_forwards(3) / 1e3 * double(sample_steps);  // seconds per sampling run
  const std::vector<double> none(total.size(), 0.0), fwd(total.size(), net);
  std::cout << step_result(total, fwd, none, none, images, nparams, out).dump() << std::endl;
  return 0;
}

// --profile FILE.json's second trace for the lm case: FILE.generate.json.
std::string generation_trace(const std::string& profile) {
  const auto dot = profile.rfind('.');
  const auto slash = profile.find_last_of('/');
  const bool ext = dot != std::string::npos && (slash == std::string::npos || dot > slash);
  return (ext ? profile.substr(0, dot) : profile) + ".generate" + (ext ? profile.substr(dot) : ".json");
}

// Runs warmup + steps language-model training steps, then 1 + kLmGenReps greedy generations, and prints
// one JSON line (the keys of run_one plus tokens_per_s, gen_ms_per_token and prefill_ms; as bench/lm_peer.py).
int run_one_lm(int64_t batch, int64_t seq_len, int64_t warmup, int64_t steps, int64_t threads,
               const std::string& profile, const c10::Device& device) {
  using clock = std::chrono::steady_clock;
  auto secs = [](clock::duration d) { return std::chrono::duration<double>(d).count(); };
  auto now = [&] { return synced_now(device); };
  set_child_threads(threads);
  at::manual_seed(0);
  nn::CausalTransformer model(from_json<nn::CausalTransformerOptions>(lm_fields(seq_len), "bench lm"));
  model->to(device);
  // The objective of `dew train lm`: chunked fp32 cross entropy (one chunk at this vocabulary), no data
  // (no validation), no samples.
  LMObjectiveOptions lo;
  lo.seq_len = seq_len;
  lo.sample_tokens = 0;
  lo.ema_decay = kEmaDecay;
  auto objective = std::make_shared<LMObjective>(model, nullptr, lo);

  // Fixed random ids stand in for the data loader, as in the diffusion bench.
  auto data_gen = at::detail::createCPUGenerator(1);
  const int64_t vocab = model->options.vocab_size();
  data::Batch batch_data{{"tokens", at::randint(0, vocab, {batch, seq_len + 1}, data_gen)}};
  const at::Tensor prompt_ids = at::randint(0, vocab, {kLmPrompt}, data_gen);
  const StepTimes t = time_trainer_steps(objective, batch_data, warmup, steps, device, "lm", profile);

  // Generation as `dew generate` runs it: prefill, then one token per forward with the KV cache.
  const std::vector<int64_t> prompt(prompt_ids.data_ptr<int64_t>(), prompt_ids.data_ptr<int64_t>() + kLmPrompt);
  sampling::GenerationOptions go;
  go.max_new_tokens = kLmNewTokens;
  go.temperature = 0;
  std::vector<double> gen, prefill;
  std::unique_ptr<torch::autograd::profiler::RecordProfile> trace;  // --profile: the timed generations
  for (int64_t r = 0; r <= kLmGenReps; ++r) {
    if (r == 1 && !profile.empty()) trace = std::make_unique<torch::autograd::profiler::RecordProfile>(generation_trace(profile));
    const auto t0 = now();
    auto res = sampling::generate_tokens(*model, {prompt}, go);
    const auto t1 = now();
    DEW_CHECK(res.lengths.at(0) == kLmNewTokens, "bench lm: generated ", res.lengths.at(0), " tokens, expected ",
              kLmNewTokens);
    // The prefill alone, as the first forward of generate_tokens does it.
    model->eval();
    at::NoGradGuard ng;
    nn::KVCache cache;
    const auto t2 = now();
    model->forward_tokens(prompt_ids.view({1, kLmPrompt}).to(device), {}, {}, {}, &cache);
    const auto t3 = now();
    if (r == 0) continue;
    gen.push_back(secs(t1 - t0));
    prefill.push_back(secs(t3 - t2));
  }
  json out = step_result(t.total, t.fwd, t.bwd, t.upd, batch, t.params, t.loss);
  const double ms = out["ms_per_step"];
  out["tokens_per_s"] = double(batch * seq_len) / (ms / 1e3);
  out["gen_ms_per_token"] = median(gen) * 1e3 / double(kLmNewTokens);
  out["prefill_ms"] = median(prefill) * 1e3;
  std::cout << out.dump() << std::endl;
  return 0;
}

// Runs warmup + steps JEPA training steps as `dew train jepa` takes them (JEPAObjective: masks drawn each
// step, the target encoder's forward without gradients, context encoder, predictor, MSE; backward; AdamW;
// the EMA that is the target encoder) and prints one JSON line (the keys of run_one).
int run_one_jepa(int64_t batch, int64_t warmup, int64_t steps, int64_t threads, const c10::Device& device) {
  set_child_threads(threads);
  at::manual_seed(0);
  auto encoder = models::build_token_encoder(jepa_recipe()["model"]);
  auto predictor = models::build_token_predictor(jepa_recipe()["predictor"]);
  encoder->to(device);
  predictor->to(device);
  auto objective = std::make_shared<JEPAObjective>(encoder, predictor, jepa_objective_options());
  auto data_gen = at::detail::createCPUGenerator(1);
  data::Batch b{{"image", at::randint(0, 256, {batch, 1, kImage, kImage}, data_gen).to(at::kByte)}};
  const StepTimes t = time_trainer_steps(objective, b, warmup, steps, device, "jepa");
  std::cout << step_result(t.total, t.fwd, t.bwd, t.upd, batch, t.params, t.loss).dump() << std::endl;
  return 0;
}

// The byte causal_transformer of `dew train dpo` / `grpo` (post_training_fields), on `device`.
nn::CausalTransformer post_training_model(const c10::Device& device) {
  nn::CausalTransformer model(from_json<nn::CausalTransformerOptions>(post_training_fields(), "bench post-training"));
  model->to(device);
  return model;
}

// Runs warmup + steps DPO training steps as `dew train dpo` takes them (DPOObjective with its defaults: beta
// 0.1, the reference's log-probs per batch: the frozen reference's forward on the 2B rows without gradient,
// the policy's forward, the completion tokens' summed log-probs, the sigmoid loss and its metrics; backward;
// AdamW; the trainer's EMA, which is the frozen reference and never moves) and prints one JSON line (the keys
// of run_one plus tokens_per_s: policy tokens, 2 x batch x kDpoLen per step).
int run_one_dpo(int64_t batch, int64_t warmup, int64_t steps, int64_t threads, const c10::Device& device) {
  set_child_threads(threads);
  at::manual_seed(0);
  auto model = post_training_model(device);
  // Fixed pairs stand in for the loader (preference_rows' layout): random bytes, a shared prompt, the last
  // kDpoCompletion tokens of each row the chosen (row 0) or rejected (row 1) completion.
  auto data_gen = at::detail::createCPUGenerator(1);
  at::Tensor ids = at::randint(0, 256, {batch, 2, kDpoLen}, data_gen);
  ids.select(1, 1).narrow(1, 0, kDpoLen - kDpoCompletion).copy_(ids.select(1, 0).narrow(1, 0, kDpoLen - kDpoCompletion));
  at::Tensor mask = at::zeros({batch, 2, kDpoLen}, at::kBool);
  mask.narrow(2, kDpoLen - kDpoCompletion, kDpoCompletion).fill_(true);
  data::Batch rows{{"ids", ids}, {"completion_mask", mask}, {"index", at::arange(batch, at::kLong)}};
  auto objective = std::make_shared<DPOObjective>(model, DPOObjectiveOptions{}, rows, nullptr);
  // The trainer builds its EMA from objective->ema() (the frozen reference) and binds it.
  const StepTimes t = time_trainer_steps(objective, rows, warmup, steps, device, "dpo");
  json out = step_result(t.total, t.fwd, t.bwd, t.upd, batch, t.params, t.loss);
  out["tokens_per_s"] = double(2 * batch * kDpoLen) / (out["ms_per_step"].get<double>() / 1e3);
  std::cout << out.dump() << std::endl;
  return 0;
}

// Runs warmup + steps GRPO rollouts' generation as GRPOObjective takes it (roll_out: every prompt repeated
// group_size times, one generate_tokens call on all the rows: prefill, then one batched token per forward
// with the KV cache, sampled at temperature 1 from a seeded generator; eos_id -1 here, so every row
// generates kGrpoNewTokens tokens) and prints one JSON line: ms_per_step = ms per rollout, tokens_per_s =
// generated tokens per second, prefill_ms = the prompts' forward alone (median).
int run_one_grpo_rollout(int64_t warmup, int64_t steps, int64_t threads, const c10::Device& device) {
  using clock = std::chrono::steady_clock;
  auto secs = [](clock::duration d) { return std::chrono::duration<double>(d).count(); };
  auto now = [&] { return synced_now(device); };
  set_child_threads(threads);
  at::manual_seed(0);
  auto model = post_training_model(device);
  int64_t nparams = 0;
  for (const auto& p : model->parameters()) nparams += p.numel();
  auto data_gen = at::detail::createCPUGenerator(1);
  const at::Tensor prompt_ids = at::randint(0, 256, {kGrpoPrompts, kGrpoPromptLen}, data_gen);
  std::vector<std::vector<int64_t>> rows;  // [prompt 0] x group, [prompt 1] x group, ... as GRPOObjective
  for (int64_t i = 0; i < kGrpoPrompts; ++i) {
    const int64_t* p = prompt_ids[i].data_ptr<int64_t>();
    for (int64_t k = 0; k < kGrpoGroup; ++k) rows.emplace_back(p, p + kGrpoPromptLen);
  }
  const int64_t n = int64_t(rows.size());
  const at::Tensor all_ids = prompt_ids.repeat_interleave(kGrpoGroup, 0).to(device);  // [n, P]
  sampling::GenerationOptions go;  // GRPOObjectiveOptions' defaults: temperature 1, top-p 1, top-k 0
  go.max_new_tokens = kGrpoNewTokens;
  go.temperature = 1.0;
  go.eos_id = -1;
  std::vector<double> total, prefill;
  for (int64_t r = 0; r < warmup + steps; ++r) {
    go.seed = uint64_t(r);
    const auto t0 = now();
    auto res = sampling::generate_tokens(*model, rows, go);
    const auto t1 = now();
    for (int64_t i = 0; i < n; ++i)
      DEW_CHECK(res.lengths.at(size_t(i)) == kGrpoNewTokens, "bench grpo_rollout: row ", i, " generated ",
                res.lengths.at(size_t(i)), " tokens, expected ", kGrpoNewTokens);
    // The prefill alone, as generate_tokens' first forward (all prompts the same length: no padding).
    model->eval();
    at::NoGradGuard ng;
    nn::KVCache cache;
    const auto t2 = now();
    model->forward_tokens(all_ids, {}, {}, at::ones({n, kGrpoPromptLen}, at::TensorOptions().dtype(at::kBool).device(device)),
                          &cache);
    const auto t3 = now();
    if (r < warmup) continue;
    total.push_back(secs(t1 - t0));
    prefill.push_back(secs(t3 - t2));
  }
  const std::vector<double> none(total.size(), 0.0);
  json out = step_result(total, total, none, none, n, nparams, 0.0);
  out["tokens_per_s"] = double(n * kGrpoNewTokens) / (out["ms_per_step"].get<double>() / 1e3);
  out["prefill_ms"] = median(prefill) * 1e3;
  std::cout << out.dump() << std::endl;
  return 0;
}

// Runs warmup + steps training steps of sd_unet as diffusers' train_text_to_image.py takes them (epsilon
// prediction): noise ~ N(0, I), timesteps uniform in [0, 1000), noisy = sqrt(alpha_bar_t) latents +
// sqrt(1 - alpha_bar_t) noise (SD's scaled_linear schedule, DDPMScheduler.add_noise), the UNet on (noisy, t, text),
// MSE against the noise; backward; AdamW (lr kSdLr); the fp32 EMA; zero_grad. Prints one JSON line (the keys of
// run_one). A fixed batch of latents and text embeddings stands in for the VAE, the text encoder and the data.
int run_one_sd_unet(int64_t batch, int64_t warmup, int64_t steps, int64_t threads, const std::string& profile,
                    const c10::Device& device) {
  using clock = std::chrono::steady_clock;
  auto secs = [](clock::duration d) { return std::chrono::duration<double>(d).count(); };
  auto now = [&] { return synced_now(device); };
  set_child_threads(threads);
  at::manual_seed(0);
  const BenchCase& c = sd_unet_case();
  auto unet = models::build(c.arch, c.fields);
  unet->to(device);
  unet->train();
  training::NamedTensors params;
  int64_t nparams = 0;
  for (const auto& kv : unet->named_parameters()) {
    params.emplace_back(kv.key(), kv.value());
    nparams += kv.value().numel();
  }
  training::OptimOptions oo;
  oo.lr = kSdLr;
  training::Optimizer opt(params, oo);
  training::EMA ema(params, training::EmaSpec{kEmaDecay});
  // diffusers' scaled_linear betas: linspace(sqrt(beta_start), sqrt(beta_end), T)^2; alpha_bar = cumprod(1 - beta).
  const at::Tensor alpha_bar =
      (1 - at::linspace(std::sqrt(kSdBetaStart), std::sqrt(kSdBetaEnd), kSdTrainTimesteps, at::kFloat).square())
          .cumprod(0)
          .to(device);
  auto data_gen = at::detail::createCPUGenerator(1);
  std::vector<int64_t> shape = {batch};
  shape.insert(shape.end(), c.item.begin(), c.item.end());
  const at::Tensor latents = at::randn(shape, data_gen).to(device);  // [B, 4, h, w]
  Conditioning cond;
  cond.context = at::randn({batch, c.context_len, sd_unet_config().at("cross_attention_dim").get<int64_t>()}, data_gen)
                     .to(device);  // [B, L, D]
  auto step_gen = at::detail::createCPUGenerator(2);

  std::vector<double> total, fwd, bwd, upd;
  double loss_value = 0;
  std::unique_ptr<torch::autograd::profiler::RecordProfile> trace;  // --profile: the timed steps only
  for (int64_t i = 0; i < warmup + steps; ++i) {
    if (i == warmup && !profile.empty()) trace = std::make_unique<torch::autograd::profiler::RecordProfile>(profile);
    const auto t0 = now();
    const at::Tensor noise = at::randn(latents.sizes(), step_gen).to(device);
    const at::Tensor t = at::randint(0, kSdTrainTimesteps, {batch}, step_gen).to(device);
    const at::Tensor ab = alpha_bar.index_select(0, t).view({batch, 1, 1, 1});
    const at::Tensor noisy = ab.sqrt() * latents + (1 - ab).sqrt() * noise;
    const at::Tensor loss = at::mse_loss(unet->forward(noisy, t.to(at::kFloat), cond), noise);
    const auto t1 = now();
    loss.backward();
    const auto t2 = now();
    opt.step(kSdLr);
    ema.update(params, i);
    opt.zero_grad();
    const auto t3 = now();
    loss_value = loss.item<double>();
    if (i < warmup) continue;
    total.push_back(secs(t3 - t0));
    fwd.push_back(secs(t1 - t0));
    bwd.push_back(secs(t2 - t1));
    upd.push_back(secs(t3 - t2));
  }
  trace.reset();  // writes the trace file
  DEW_CHECK(std::isfinite(loss_value), "bench sd_unet: non-finite loss ", loss_value);
  std::cout << step_result(total, fwd, bwd, upd, batch, nparams, loss_value).dump() << std::endl;
  return 0;
}

// Runs warmup + steps encode + decode passes of sd_vae without gradients, as a pipeline runs them:
// z = to_latent(encode(x).sample(gen)) (scaling_factor z), x_hat = decode(from_latent(z)). Prints one JSON line
// with the keys of run_one: phases forward = encode (with the sample), backward = decode, optimizer 0; loss =
// mean(x_hat^2).
int run_one_sd_vae(int64_t batch, int64_t warmup, int64_t steps, int64_t threads, const std::string& profile,
                   const c10::Device& device) {
  using clock = std::chrono::steady_clock;
  auto secs = [](clock::duration d) { return std::chrono::duration<double>(d).count(); };
  auto now = [&] { return synced_now(device); };
  set_child_threads(threads);
  at::manual_seed(0);
  const BenchCase& c = sd_vae_case();
  auto vae = models::build_autoencoder({{"architecture", c.arch}, {"fields", c.fields}});
  vae->to(device);
  vae->eval();
  int64_t nparams = 0;
  for (const auto& p : vae->parameters()) nparams += p.numel();
  auto data_gen = at::detail::createCPUGenerator(1);
  std::vector<int64_t> shape = {batch};
  shape.insert(shape.end(), c.item.begin(), c.item.end());
  const at::Tensor x = (at::rand(shape, data_gen) * 2 - 1).to(device);  // [B, 3, H, W] in [-1, 1]
  auto sample_gen = at::detail::createCPUGenerator(2);
  at::NoGradGuard no_grad;
  std::vector<double> total, enc, dec;
  double out = 0;
  std::unique_ptr<torch::autograd::profiler::RecordProfile> trace;
  for (int64_t i = 0; i < warmup + steps; ++i) {
    if (i == warmup && !profile.empty()) trace = std::make_unique<torch::autograd::profiler::RecordProfile>(profile);
    const auto t0 = now();
    const at::Tensor z = vae->to_latent(vae->encode(x).sample(sample_gen));
    const auto t1 = now();
    const at::Tensor x_hat = vae->decode(vae->from_latent(z));
    const auto t2 = now();
    out = x_hat.square().mean().item<double>();
    if (i < warmup) continue;
    total.push_back(secs(t2 - t0));
    enc.push_back(secs(t1 - t0));
    dec.push_back(secs(t2 - t1));
  }
  trace.reset();
  DEW_CHECK(std::isfinite(out), "bench sd_vae: non-finite output ", out);
  const std::vector<double> none(total.size(), 0.0);
  std::cout << step_result(total, enc, dec, none, batch, nparams, out).dump() << std::endl;
  return 0;
}

// ---- the parent: child processes and the report ----

std::string quoted(const std::vector<std::string>& argv) {
  std::string s;
  for (const auto& a : argv) {
    const bool plain = a.find_first_of(" \"'{}[],$\\") == std::string::npos;
    s += (s.empty() ? "" : " ") + (plain ? a : "'" + a + "'");
  }
  return s;
}

struct Measurement {
  int64_t intra = 0, blas = 0;
  double ms = 0, samples_per_s = 0, peak_mb = 0;
  double fwd = 0, bwd = 0, opt = 0;
  double tokens_per_s = 0, gen_ms_per_token = 0, prefill_ms = 0;  // lm only
  double data_ms = 0;                                             // train: waiting for the loader
  double compile_s = 0;  // the Python peer under torch.compile: its first step's time beyond a steady step
  int64_t params = 0;
  std::string torch, blas_core;
};

Measurement measure(const std::vector<std::string>& argv, int64_t intra, int64_t blas, const std::string& what,
                    std::map<std::string, std::string> env = {}, const std::vector<std::string>& unset = {}) {
  env["OPENBLAS_NUM_THREADS"] = std::to_string(blas);
  auto r = run_child(argv, env, /*quiet=*/false, unset);
  DEW_CHECK(r.exit_code == 0, "bench: the ", what, " run failed (exit ", r.exit_code, "): ", quoted(argv));
  // The JSON line is the last line of stdout; anything before it is the child's own chatter.
  std::string line = r.out;
  while (!line.empty() && line.back() == '\n') line.pop_back();
  line = line.substr(line.rfind('\n') == std::string::npos ? 0 : line.rfind('\n') + 1);
  json j = json::parse(line, nullptr, /*allow_exceptions=*/false);
  DEW_CHECK(j.is_object() && j.contains("ms_per_step") && j.contains("phases_ms"), "bench: the ", what,
            " run printed no result line; got \"", line, "\"");
  Measurement m;
  m.intra = intra;
  m.blas = blas;
  m.ms = j["ms_per_step"];
  m.samples_per_s = j["samples_per_s"];
  m.peak_mb = j["peak_rss_mb"];
  m.params = j["params"];
  m.fwd = j["phases_ms"]["forward"];
  m.bwd = j["phases_ms"]["backward"];
  m.opt = j["phases_ms"]["optimizer"];
  m.tokens_per_s = j.value("tokens_per_s", 0.0);
  m.gen_ms_per_token = j.value("gen_ms_per_token", 0.0);
  m.prefill_ms = j.value("prefill_ms", 0.0);
  m.data_ms = j.value("data_ms", 0.0);
  m.compile_s = j.value("compile_s", 0.0);
  m.torch = j.value("torch", "");
  m.blas_core = j.value("blas_core", "");
  return m;
}

std::string grouped(int64_t v) {
  std::string s = std::to_string(v), out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (i && (s.size() - i) % 3 == 0) out += ',';
    out += s[i];
  }
  return out;
}

std::string config_name(const Measurement& m) {
  return "intra " + std::to_string(m.intra) + ", blas " + std::to_string(m.blas);
}

// One thread configuration of one model: a measurement per round and side (C++, Python eager, Python under
// torch.compile).
struct Config {
  int64_t intra = 1, blas = 1;
  std::vector<Measurement> cpp, py, pyc;
};

// One model: its complete fields (JSON, for the peer), parameter count and configurations.
struct Row {
  const BenchCase* c;
  std::string fields;
  int64_t params = 0;
  std::vector<Config> configs;
};

// The fastest of a configuration's rounds by `key` (a time: ms/step, or the lm's generation ms/token):
// the least disturbed by other work on the machine.
const Measurement& best(const std::vector<Measurement>& ms, double Measurement::*key = &Measurement::ms) {
  return *std::min_element(ms.begin(), ms.end(), [key](const auto& a, const auto& b) { return a.*key < b.*key; });
}

// The fastest run of one side over the configurations that ran it; nullptr when none did.
const Measurement* fastest_of(const std::vector<Config>& configs, std::vector<Measurement> Config::*side,
                              double Measurement::*key = &Measurement::ms) {
  const Measurement* out = nullptr;
  for (const auto& c : configs)
    if (!(c.*side).empty() && (!out || best(c.*side, key).*key < out->*key)) out = &best(c.*side, key);
  return out;
}

// The fastest run of one side over all configurations (the side ran them all).
const Measurement& fastest(const std::vector<Config>& configs, std::vector<Measurement> Config::*side,
                           double Measurement::*key = &Measurement::ms) {
  const Measurement* out = fastest_of(configs, side, key);
  DEW_CHECK(out != nullptr, "bench: no measurement of this side");
  return *out;
}

std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) != 0) continue;
    auto colon = line.find(':');
    return colon == std::string::npos ? line : line.substr(line.find_first_not_of(' ', colon + 1));
  }
  return "unknown CPU";
}

int usable_cpus() {
  // What `nproc` prints: the CPUs this process may run on.
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0) return CPU_COUNT(&set);
  return int(sysconf(_SC_NPROCESSORS_ONLN));
}

// The 1-minute load average: on a shared machine, other work during the run shows up here.
// The peer script: --peer, else bench/peer.py beside the build directory holding this binary, else in
// the working directory. Empty when none is found.
// `flag` and `file` name the peer: "peer", "peer.py" or "lm-peer", "lm_peer.py".
std::string find_peer(const Flags& f, const fs::path& exe, const std::string& flag, const std::string& file) {
  if (f.has(flag)) {
    DEW_CHECK(fs::is_regular_file(f.get(flag, "")), "--", flag, ": no such file \"", f.get(flag, ""), "\"");
    return f.get(flag, "");
  }
  for (const fs::path& p : {exe.parent_path().parent_path() / "bench" / file, exe.parent_path() / "bench" / file,
                            fs::current_path() / "bench" / file})
    if (fs::is_regular_file(p)) return p.lexically_normal().string();
  return "";
}

}  // namespace

int cmd_bench(const std::vector<std::string>& args) {
  const Flags f = parse_flags(args,
                              {"models", "steps", "warmup", "batch", "threads", "blas-threads", "rounds", "peer", "out",
                               "one", "peer-coretype", "seq-len", "lm-peer", "jepa-peer", "dpo-peer", "grpo-rollout-peer",
                               "profile", "device", "sd-peer", "diffusers-src", "train-peer", "images", "sample-steps",
                               "sample-peer"},
                              {"no-peer", "no-compile", "help", "all", "peer-malloc-like-dew"});
  if (f.has("help")) {
    std::cout << kBenchUsage;
    return 0;
  }
  DEW_CHECK(f.positional.empty(), "bench: unexpected argument \"", f.positional.empty() ? "" : f.positional[0],
            "\" (dew bench --help)");
  const int64_t steps = f.get_int("steps", 20), warmup = f.get_int("warmup", 5), batch = f.get_int("batch", 32);
  DEW_CHECK(steps >= 1, "--steps: must be >= 1, got ", steps);
  DEW_CHECK(warmup >= 0, "--warmup: must be >= 0, got ", warmup);
  DEW_CHECK(batch >= 1, "--batch: must be >= 1, got ", batch);
  const int64_t lm_batch = f.get_int("batch", 4), seq_len = f.get_int("seq-len", 256);
  const int64_t sd_unet_batch = f.get_int("batch", kSdUnetBatch), sd_vae_batch = f.get_int("batch", kSdVaeBatch);
  DEW_CHECK(seq_len >= 1, "--seq-len: must be >= 1, got ", seq_len);
  // The sample case: sampling runs (timed, untimed), images per run, the sampler's steps.
  const int64_t sample_runs = f.get_int("steps", kSampleRuns), sample_warmup = f.get_int("warmup", kSampleWarmup);
  const int64_t sample_images = f.get_int("images", kSampleImages);
  const int64_t sample_steps = f.get_int("sample-steps", kSampleSteps);
  DEW_CHECK(sample_images >= 1, "--images: must be >= 1, got ", sample_images);
  DEW_CHECK(sample_steps >= 1, "--sample-steps: must be >= 1, got ", sample_steps);
  const auto threads = int_list(f, "threads", "1,2");
  const auto blas_threads = int_list(f, "blas-threads", "1,2");
  const int64_t rounds = f.get_int("rounds", 2);
  DEW_CHECK(rounds >= 1, "--rounds: must be >= 1, got ", rounds);
  const c10::Device device = parse_device(f.get("device", "auto"));
  const std::string device_name = device.str();

  if (f.has("one")) {
    DEW_CHECK(threads.size() == 1, "--one: needs exactly one --threads value, got \"", f.get("threads", ""), "\"");
    const BenchCase& c = find_case(f.get("one", ""));
    if (&c == &lm_case()) return run_one_lm(lm_batch, seq_len, warmup, steps, threads[0], f.get("profile", ""), device);
    if (&c == &jepa_case()) return run_one_jepa(batch, warmup, steps, threads[0], device);
    if (&c == &dpo_case()) return run_one_dpo(batch, warmup, steps, threads[0], device);
    if (&c == &grpo_rollout_case()) return run_one_grpo_rollout(warmup, steps, threads[0], device);
    if (&c == &sd_unet_case()) return run_one_sd_unet(sd_unet_batch, warmup, steps, threads[0], f.get("profile", ""), device);
    if (&c == &train_case()) return run_one_train(f.get_int("batch", 0), warmup, steps, threads[0], device);
    if (&c == &sample_case())
      return run_one_sample(sample_images, sample_steps, sample_warmup, sample_runs, threads[0], device);
    if (&c == &sd_vae_case()) return run_one_sd_vae(sd_vae_batch, warmup, steps, threads[0], f.get("profile", ""), device);
    return run_one(c, batch, warmup, steps, threads[0], f.get("profile", ""), device);
  }

  std::vector<const BenchCase*> cases;
  DEW_CHECK(!(f.has("all") && f.has("models")), "--all and --models: give one of them");
  std::string all_names;
  for (const auto& c : bench_cases()) all_names += (all_names.empty() ? "" : ",") + c.name;
  for (const BenchCase* c : other_cases()) all_names += "," + c->name;
  bool any_diffusion = false, any_lm = false, any_jepa = false, any_dpo = false, any_rollout = false, any_sd = false,
       any_train = false, any_sample = false;
  for (const auto& name : split_list(f.get("models", f.has("all") ? all_names : "simple_dit,unet,unet_attn"), "models")) {
    const BenchCase* c = &find_case(name);
    DEW_CHECK(std::find(cases.begin(), cases.end(), c) == cases.end(), "--models: \"", name, "\" is listed twice");
    cases.push_back(c);
    (c == &lm_case()             ? any_lm
     : c == &jepa_case()         ? any_jepa
     : c == &dpo_case()          ? any_dpo
     : c == &grpo_rollout_case() ? any_rollout
     : is_sd(c)                  ? any_sd
     : c == &train_case()        ? any_train
     : c == &sample_case()       ? any_sample
                                 : any_diffusion) = true;
  }
  DEW_CHECK(any_lm || !f.has("seq-len"), "--seq-len: only the language model uses it; add lm to --models");
  DEW_CHECK(any_sample || !(f.has("images") || f.has("sample-steps")),
            "--images, --sample-steps: only the sample case uses them; add sample to --models");

  const fs::path exe = fs::read_symlink("/proc/self/exe");
  std::string peer, lm_peer, jepa_peer, dpo_peer, rollout_peer, python_torch, peer_note, lm_peer_note;
  std::string sd_peer, sd_peer_note;  // the SD peer and, when it cannot run, "peer: unavailable (why)"
  std::string python_diffusers;       // what the SD peer's --probe printed: "diffusers 0.42.1 (PATH)"
  std::string train_peer;             // bench/train_peer.py
  std::string sample_peer;            // bench/sample_peer.py
  // The diffusers the SD peer imports: a checkout named by --diffusers-src or $DEW_DIFFUSERS_SRC, else ("")
  // the environment's pinned package.
  const char* diffusers_env = std::getenv("DEW_DIFFUSERS_SRC");
  const std::string diffusers_src = f.get("diffusers-src", diffusers_env && *diffusers_env ? diffusers_env : "");
  if (!f.has("no-peer")) {
    if (any_diffusion) peer = find_peer(f, exe, "peer", "peer.py");
    if (any_lm) lm_peer = find_peer(f, exe, "lm-peer", "lm_peer.py");
    if (any_jepa) jepa_peer = find_peer(f, exe, "jepa-peer", "jepa_peer.py");
    if (any_dpo) dpo_peer = find_peer(f, exe, "dpo-peer", "dpo_peer.py");
    if (any_rollout) rollout_peer = find_peer(f, exe, "grpo-rollout-peer", "grpo_rollout_peer.py");
    if (any_sd) sd_peer = find_peer(f, exe, "sd-peer", "sd_peer.py");
    if (any_train) train_peer = find_peer(f, exe, "train-peer", "train_peer.py");
    if (any_sample) sample_peer = find_peer(f, exe, "sample-peer", "sample_peer.py");
    auto probe = run_child({kPython, "-c", "import torch; print(torch.__version__)"}, {}, /*quiet=*/true);
    if (probe.exit_code != 0) {
      peer_note = std::string("Python peer skipped: ") + kPython + " with torch is not available; C++ side only.";
      lm_peer_note = peer_note;
      peer.clear();
      lm_peer.clear();
      jepa_peer.clear();
      dpo_peer.clear();
      rollout_peer.clear();
      train_peer.clear();
      sample_peer.clear();
      if (any_sd) sd_peer_note = std::string("peer: unavailable (") + kPython + " with torch is not available)";
      sd_peer.clear();
    } else {
      if (any_diffusion && peer.empty())
        peer_note = "Python peer skipped: bench/peer.py not found (pass --peer FILE); C++ side only.";
      if (any_lm && lm_peer.empty())
        lm_peer_note = "Python peer skipped: bench/lm_peer.py not found (pass --lm-peer FILE); C++ side only.";
      python_torch = probe.out.substr(0, probe.out.find('\n'));
      if (any_sd && sd_peer.empty()) {
        sd_peer_note = "peer: unavailable (bench/sd_peer.py not found; pass --sd-peer FILE)";
      } else if (any_sd) {
        // The peer imports diffusers from the checkout, or prints why it cannot (exit 3).
        auto sd_probe = run_child({kPython, sd_peer, "--probe", "--diffusers-src", diffusers_src}, {}, /*quiet=*/true);
        std::string line = sd_probe.out.substr(0, sd_probe.out.find('\n'));
        if (sd_probe.exit_code != 0) {
          sd_peer_note = "peer: unavailable (" + (line.empty() ? "bench/sd_peer.py --probe failed" : line) + ")";
          sd_peer.clear();
        } else {
          python_diffusers = line;
        }
      }
    }
    if (!sd_peer_note.empty()) std::cerr << sd_peer_note << "; sd_unet and sd_vae run C++ only\n";
    for (const auto* note : {&peer_note, &lm_peer_note})
      if (!note->empty() && (note == &peer_note || *note != peer_note)) std::cerr << *note << "\n";
  }

  // The peer runs in the environment the user gave: when OPENBLAS_CORETYPE was set by dew's own re-exec
  // (dew::reexec_with_blas_kernels), Python gets OpenBLAS's default choice, unless --peer-coretype says.
  std::map<std::string, std::string> peer_env;
  std::vector<std::string> peer_unset;
  if (f.has("peer-coretype")) {
    peer_env["OPENBLAS_CORETYPE"] = f.get("peer-coretype", "");
  } else if (std::getenv(kCoretypeMarker)) {
    peer_unset = {"OPENBLAS_CORETYPE", kCoretypeMarker};
  }
  if (f.has("peer-malloc-like-dew")) peer_env["GLIBC_TUNABLES"] = kKeepFreedMemoryTunables;

  // The optimizer both sides of a step case use (bench_optim), and `dew train`'s default recipe for the
  // train case: the parent prepares it once (its complete model fields, the Python peer's settings) and
  // dumps its training images and labels for the peer, which reads them instead of the IDX files.
  const std::string optim_json = to_json(bench_optim(warmup)).dump();
  const int64_t train_batch =
      f.get_int("batch", runs::default_recipe("diffusion")["loader"]["batch_size"].get<int64_t>());
  // The sample case samples from the same recipe's model (its fields and preset from the same record).
  std::unique_ptr<TempDir> train_dir;
  json train_record;
  std::string train_data;
  if (any_train || any_sample) {
    train_dir = std::make_unique<TempDir>("bench_train_data");
    auto run = prepare_default_train((train_dir->path / "run").string(), 0, train_batch, device);
    train_record = run.record;
    train_record["optim"] = to_json(run.optim);
    train_record["trainer"] = to_json(run.trainer);
    const data::TensorDataset& ds = run.built.loader->dataset();
    if (any_train && !train_peer.empty()) {
      train_data = (train_dir->path / "train_data.safetensors").string();
      io::save_safetensors(train_data, ds.fields());
    }
  }

  // The arguments both sides of case `c` get (a rollout's rows are fixed: no --batch).
  const auto common = [&](int64_t t, const BenchCase* c) {
    const bool lm = c == &lm_case();
    const bool sample = c == &sample_case();
    std::vector<std::string> a{"--steps", std::to_string(sample ? sample_runs : steps), "--warmup",
                               std::to_string(sample ? sample_warmup : warmup), "--threads", std::to_string(t),
                               "--device", device_name};
    if (sample)
      a.insert(a.end(), {"--images", std::to_string(sample_images), "--sample-steps", std::to_string(sample_steps)});
    else if (c != &grpo_rollout_case())
      a.insert(a.begin(), {"--batch", std::to_string(lm                     ? lm_batch
                                                     : c == &sd_unet_case() ? sd_unet_batch
                                                     : c == &sd_vae_case()  ? sd_vae_batch
                                                     : c == &train_case()   ? train_batch
                                                                            : batch)});
    if (lm) a.insert(a.end(), {"--seq-len", std::to_string(seq_len)});
    return a;
  };
  // The Python peer's command for row `r` without `common`; empty when it has none.
  const auto peer_argv = [&](const Row& r) -> std::vector<std::string> {
    const BenchCase* c = r.c;
    const std::string n = std::to_string(r.params);
    if (c == &lm_case())
      return lm_peer.empty() ? std::vector<std::string>{}
                             : std::vector<std::string>{kPython, lm_peer, "--config", r.fields, "--params", n,
                                                        "--optim", optim_json, "--prompt-len", std::to_string(kLmPrompt), "--new-tokens",
                                                        std::to_string(kLmNewTokens), "--gen-reps",
                                                        std::to_string(kLmGenReps)};
    if (c == &jepa_case())
      return jepa_peer.empty() ? std::vector<std::string>{}
                               : std::vector<std::string>{kPython, jepa_peer, "--config", r.fields, "--params", n,
                                                          "--optim", optim_json};
    if (c == &dpo_case())
      return dpo_peer.empty() ? std::vector<std::string>{}
                              : std::vector<std::string>{kPython, dpo_peer, "--config", r.fields, "--params", n,
                                                         "--optim", optim_json, "--seq-len", std::to_string(kDpoLen), "--completion-len",
                                                         std::to_string(kDpoCompletion)};
    if (c == &grpo_rollout_case())
      return rollout_peer.empty()
                 ? std::vector<std::string>{}
                 : std::vector<std::string>{kPython, rollout_peer, "--config", r.fields, "--params", n, "--prompts",
                                            std::to_string(kGrpoPrompts), "--group", std::to_string(kGrpoGroup),
                                            "--prompt-len", std::to_string(kGrpoPromptLen), "--new-tokens",
                                            std::to_string(kGrpoNewTokens), "--temperature", "1.0"};
    if (is_sd(c)) {
      if (sd_peer.empty()) return {};
      std::vector<std::string> a{kPython,  sd_peer, "--model", c->name, "--config", r.fields, "--params", n,
                                 "--diffusers-src", diffusers_src};
      if (c == &sd_unet_case())
        a.insert(a.end(), {"--latent-size", std::to_string(c->item[1]), "--context-len", std::to_string(c->context_len)});
      else
        a.insert(a.end(), {"--image-size", std::to_string(c->item[1])});
      return a;
    }
    if (c == &train_case()) {
      if (train_peer.empty()) return {};
      return {kPython, train_peer, "--config", r.fields, "--params", n, "--data", train_data, "--recipe",
              train_record.dump()};
    }
    if (c == &sample_case()) {
      if (sample_peer.empty()) return {};
      const DiffusionSampleOptions g =
          sample_options(train_record["derived"]["sample_shape"].get<std::vector<int64_t>>(),
                         train_record["model"]["fields"].value("num_classes", int64_t(0)), sample_images, sample_steps);
      return {kPython, sample_peer, "--config", r.fields, "--params", n, "--preset", train_record["preset"].dump(),
              "--shape", json(g.shape).dump(), "--solver", g.solver, "--guidance", fixed(g.guidance.scale, 6),
              "--chunk", std::to_string(g.batch_size)};
    }
    if (peer.empty() || !c->peer) return {};
    return {kPython, peer, "--model", c->arch, "--config", r.fields, "--params", n, "--image",
            std::to_string(c->item[1]) + "x" + std::to_string(c->item[2]), "--context-len",
            std::to_string(c->context_len), "--optim", optim_json, "--unconditional-prob",
            fixed(DiffusionObjectiveOptions{}.unconditional_prob, 6)};
  };
  std::vector<Row> rows;
  for (const auto* c : cases) {
    // The parent builds the model once for its complete field set (defaults included) and parameter
    // count, which the peer receives so it builds, and checks, the same model.
    std::shared_ptr<torch::nn::Module> model;
    json config;
    if (c == &lm_case() || c == &dpo_case() || c == &grpo_rollout_case()) {
      auto lm = models::build_language_model(
          {{"architecture", c->arch}, {"fields", c == &lm_case() ? lm_fields(seq_len) : c->fields}});
      config = lm->config();
      model = lm.ptr();
    } else if (c == &train_case() || c == &sample_case()) {
      auto denoiser = models::build(c->arch, train_record["model"]["fields"]);
      config = denoiser->config();
      model = denoiser;
    } else if (c == &sd_vae_case()) {
      auto vae = models::build_autoencoder({{"architecture", c->arch}, {"fields", c->fields}});
      config = vae->config();
      model = vae;
    } else if (c == &jepa_case()) {
      auto enc = models::build_token_encoder(jepa_recipe()["model"]);
      auto pred = models::build_token_predictor(jepa_recipe()["predictor"]);
      model = std::make_shared<torch::nn::Module>();
      model->register_module("encoder", enc);
      model->register_module("predictor", pred);
      config = {{"fields",
                 {{"encoder", enc->config()["fields"]},
                  {"predictor", pred->config()["fields"]},
                  {"masks", jepa_recipe()["objective"]["masks"]}}}};
    } else {
      auto denoiser = models::build(c->arch, c->fields);
      config = denoiser->config();
      model = denoiser;
    }
    // The SD peer gets the diffusers config.json dict the C++ fields came from.
    Row row{c, is_sd(c) ? reference_config(c).dump() : config.at("fields").dump(), 0, {}};
    for (const auto& p : model->parameters()) row.params += p.numel();
    for (int64_t intra : threads)
      for (int64_t blas : blas_threads) row.configs.push_back({intra, blas, {}, {}, {}});
    rows.push_back(std::move(row));
  }
  const auto progress = [&](int64_t round, const std::string& what, const Measurement& m) {
    std::cerr << "bench: round " << round << "/" << rounds << "  " << what << "  " << config_name(m) << ": "
              << fixed(m.ms, 1) << " ms/step";
    if (m.gen_ms_per_token > 0) std::cerr << ", generation " << fixed(m.gen_ms_per_token, 2) << " ms/token";
    if (m.prefill_ms > 0 && m.gen_ms_per_token == 0) std::cerr << ", " << fixed(m.tokens_per_s, 0) << " generated tokens/s";
    std::cerr << "\n";
  };
  const std::string load_before = load_average();
  // Rounds sweep every configuration in turn, and C++ and Python alternate within each, so slow spells of
  // a shared machine spread over both sides and over all configurations.
  for (int64_t round = 1; round <= rounds; ++round) {
    for (auto& row : rows) {
      const std::string& name = row.c->name;
      for (auto& cfg : row.configs) {
        auto cpp_argv = std::vector<std::string>{exe.string(), "bench", "--one", name};
        for (auto& a : common(cfg.intra, row.c)) cpp_argv.push_back(a);
        cfg.cpp.push_back(measure(cpp_argv, cfg.intra, cfg.blas, name + " C++"));
        progress(round, name + "  C++   ", cfg.cpp.back());
        auto py_argv = peer_argv(row);
        if (py_argv.empty()) continue;
        for (auto& a : common(cfg.intra, row.c)) py_argv.push_back(a);
        cfg.py.push_back(measure(py_argv, cfg.intra, cfg.blas, name + " Python", peer_env, peer_unset));
        progress(round, name + "  Python", cfg.py.back());
      }
    }
  }
  // The training-step cases again in Python under torch.compile, in the eager peer's fastest configuration
  // (compiling costs 30-120 s a process, so not every configuration): inductor's cache makes later rounds'
  // compiles shorter; the steady-state steps are timed either way.
  const auto compiles = [](const BenchCase* c) {
    return c != &sd_vae_case() && c != &sample_case() && c != &grpo_rollout_case();
  };
  if (!f.has("no-compile")) {
    for (int64_t round = 1; round <= rounds; ++round) {
      for (auto& row : rows) {
        auto py_argv = peer_argv(row);
        const Measurement* eager = fastest_of(row.configs, &Config::py);
        if (py_argv.empty() || !eager || !compiles(row.c)) continue;
        auto cfg = std::find_if(row.configs.begin(), row.configs.end(),
                                [&](const Config& c) { return c.intra == eager->intra && c.blas == eager->blas; });
        for (auto& a : common(cfg->intra, row.c)) py_argv.push_back(a);
        py_argv.push_back("--compile");
        cfg->pyc.push_back(
            measure(py_argv, cfg->intra, cfg->blas, row.c->name + " Python compiled", peer_env, peer_unset));
        progress(round, row.c->name + "  Python compiled (" + fixed(cfg->pyc.back().compile_s, 1) + " s to compile)",
                 cfg->pyc.back());
      }
    }
  }

  std::vector<const Row*> drows;  // the diffusion models
  const Row* lrow = nullptr;      // the language model
  const Row* jrow = nullptr;      // the JEPA step
  const Row* dpo_row = nullptr;   // the DPO step
  const Row* rollout_row = nullptr;  // the GRPO rollout
  const Row* sd_unet_row = nullptr;  // the Stable Diffusion UNet's step
  const Row* sd_vae_row = nullptr;   // the VAE's encode + decode
  const Row* train_row = nullptr;    // `dew train` throughput
  const Row* sample_row = nullptr;   // `dew sample`
  for (const auto& r : rows) {
    if (r.c == &train_case())
      train_row = &r;
    else if (r.c == &sample_case())
      sample_row = &r;
    else if (r.c == &lm_case())
      lrow = &r;
    else if (r.c == &jepa_case())
      jrow = &r;
    else if (r.c == &dpo_case())
      dpo_row = &r;
    else if (r.c == &grpo_rollout_case())
      rollout_row = &r;
    else if (r.c == &sd_unet_case())
      sd_unet_row = &r;
    else if (r.c == &sd_vae_case())
      sd_vae_row = &r;
    else
      drows.push_back(&r);
  }
  const std::string load_after = load_average();
  // OpenBLAS picks its kernels from the CPU model unless OPENBLAS_CORETYPE forces them; on a CPU it does
  // not recognise it falls back to SSE3 kernels, which shapes every number below. dew sets it for itself.
  const char* by_dew = std::getenv(kCoretypeMarker);
  const char* coretype = by_dew ? nullptr : std::getenv("OPENBLAS_CORETYPE");
  // A side whose BLAS names no kernel set (neither oneMKL nor OpenBLAS) says so.
  auto core_of = [](const std::vector<Measurement>& ms, bool cpp) {
    if (ms.empty()) return std::string("n/a (not run)");
    if (!ms.front().blas_core.empty()) return ms.front().blas_core;
    return std::string("unknown (neither oneMKL nor OpenBLAS answered)");
  };
  // keep_freed_memory() is idempotent; its answer is what the C++ children (dew processes too) did.
  const bool malloc_kept = keep_freed_memory();
  // The machine line and the command; `probe` supplies the kernel sets each side's OpenBLAS chose.
  auto machine = [&](const Row& probe, bool with_peer) {
    std::ostringstream m;
    m << "Machine: " << usable_cpus() << " CPUs (nproc), " << cpu_model() << "; device " << device_name << "; LibTorch "
      << TORCH_VERSION
      << " (C++)";
    if (with_peer) m << ", PyTorch " << python_torch << " (" << kPython << ")";
    const auto& probe_cfg = probe.configs.front();
    m << "; BLAS " << core_of(probe_cfg.cpp, true) << " (C++)";
    if (with_peer) m << ", " << core_of(probe_cfg.py, false) << " (Python)";
    // The children inherit DEW_FUSED_ISA, so this process's choice is theirs.
    m << "; dew's fused kernels " << nn::fused_kernel_isa() << (std::getenv("DEW_FUSED_ISA") ? " (DEW_FUSED_ISA)" : "")
      << "; ATen's CPU kernels " << at::get_cpu_capability();
    m << "; OPENBLAS_CORETYPE " << (by_dew ? std::string("set by dew for itself (") + by_dew + ")"
                                           : coretype ? std::string("set by the user (") + coretype + ")" : "unset");
    if (with_peer && f.has("peer-coretype")) m << ", " << f.get("peer-coretype", "") << " for Python (--peer-coretype)";
    m << (malloc_kept ? "; malloc keeps freed memory in dew" : "; malloc as the environment sets it in dew");
    if (with_peer) m << (f.has("peer-malloc-like-dew") ? " and in Python (--peer-malloc-like-dew)" : ", glibc defaults in Python");
    m << "; " << utc_now() << "; 1-minute load average " << load_before << " before the runs, " << load_after
      << " after (the runs themselves add 1-2).\n\nCommand: `";
    if (coretype) m << "OPENBLAS_CORETYPE=" << coretype << " ";
    m << "dew bench";  // (the re-exec's own setting is not part of the user's command)
    for (const auto& a : args) m << " " << a;
    m << "`\n\n";
    return m.str();
  };
  // Every round's value of `key`, fastest first, so the spread between processes is visible.
  auto rounds_cell = [](const std::vector<Measurement>& ms, double Measurement::*key = &Measurement::ms,
                        int digits = 1) {
    std::vector<double> v;
    for (const auto& m : ms) v.push_back(m.*key);
    std::sort(v.begin(), v.end());
    std::string s;
    for (double x : v) s += (s.empty() ? "" : " / ") + fixed(x, digits);
    return s;
  };
  std::ostringstream md;
  // A training step's tables (the JEPA and DPO steps): each side's fastest run, the speed-up, every
  // configuration. `per_s` names samples_per_s (batch rows per second).
  auto step_tables = [&](const Row& r, bool with_peer, const std::string& per_s) {
    std::vector<std::pair<std::string, std::vector<Measurement> Config::*>> sides{{"C++", &Config::cpp}};
    if (with_peer) sides.push_back({"Python", &Config::py});
    md << "| side | best config | ms/step | " << per_s << " | forward ms | backward ms | optimizer ms | peak MB |\n"
       << "|---|---|---:|---:|---:|---:|---:|---:|\n";
    for (const auto& [side, member] : sides) {
      const auto& m = fastest(r.configs, member);
      md << "| " << side << " | " << config_name(m) << " | " << fixed(m.ms, 1) << " | " << fixed(m.samples_per_s, 1)
         << " | " << fixed(m.fwd, 1) << " | " << fixed(m.bwd, 1) << " | " << fixed(m.opt, 1) << " | "
         << fixed(m.peak_mb, 0) << " |\n";
    }
    if (with_peer)
      md << "\nSpeed-up (Python ms/step / C++ ms/step): "
         << fixed(fastest(r.configs, &Config::py).ms / fastest(r.configs, &Config::cpp).ms, 2) << "x\n";
    md << "\nEvery configuration (each round's median, fastest first):\n\n| intra | blas | C++ ms/step |"
       << (with_peer ? " Python ms/step |" : "") << "\n|---:|---:|---:|" << (with_peer ? "---:|" : "") << "\n";
    for (const auto& cfg : r.configs) {
      md << "| " << cfg.intra << " | " << cfg.blas << " | " << rounds_cell(cfg.cpp) << " |";
      if (with_peer) md << " " << rounds_cell(cfg.py) << " |";
      md << "\n";
    }
  };

  if (!drows.empty()) {
    const bool with_peer = !peer.empty();
    md << "## dew bench: one diffusion training step on the CPU\n\n"
       << "Step: the trainer's own (training::Trainer::train_step, the step of `dew train`) on a fixed batch of "
       << "uint8 images: DiffusionObjective with the EDM pixel preset (labels dropped to the null class with "
       << "probability " << DiffusionObjectiveOptions{}.unconditional_prob << "; the models reading a text context "
       << "get a fixed one), the finite check of the loss, backward, global-norm clip " << bench_optim(warmup).grad_clip
       << ", learning rate warmed up over the untimed steps to " << kLr << " then cosine, AdamW (weight decay 0.01 on "
       << "matrices), fp32 EMA (decay " << kEmaDecay << "); batch " << batch << ". Python: bench/peer.py, the same "
       << "per step (torch.nn.utils.clip_grad_norm_, the lr set per step, loss.item() and isfinite). Each "
       << "configuration runs in a fresh process: " << warmup << " warm-up + " << steps << " timed steps, median; "
       << rounds << " round(s) per side" << (with_peer ? ", alternating C++ and Python" : "")
       << ", the fastest round reported. Thread "
       << "configurations: LibTorch intra-op threads (intra) x BLAS threads (blas).\n\n"
       << machine(*drows.front(), with_peer);
    if (!peer_note.empty()) md << peer_note << "\n\n";

    md << "| model | size | params | C++ best config | C++ ms/step | samples/s | peak MB |";
    if (with_peer) md << " Python best config | Python ms/step | peak MB | speed-up |";
    md << "\n|---|---|---:|---|---:|---:|---:|" << (with_peer ? "---|---:|---:|---:|" : "") << "\n";
    for (const Row* r : drows) {
      const auto& c = fastest(r->configs, &Config::cpp);
      md << "| " << r->c->name << " | " << r->c->size << " | " << grouped(r->params) << " | " << config_name(c)
         << " | " << fixed(c.ms, 1) << " | " << fixed(c.samples_per_s, 1) << " | " << fixed(c.peak_mb, 0) << " |";
      if (with_peer && r->c->peer) {
        const auto& p = fastest(r->configs, &Config::py);
        md << " " << config_name(p) << " | " << fixed(p.ms, 1) << " | " << fixed(p.peak_mb, 0) << " | "
           << fixed(p.ms / c.ms, 2) << "x |";
      } else if (with_peer) {
        md << " no peer | - | - | - |";
      }
      md << "\n";
    }

    md << "\nEvery configuration (ms/step: each round's median, fastest first; peak MB of the fastest round):\n\n"
       << "| model | intra | blas | C++ ms/step | C++ peak MB |"
       << (with_peer ? " Python ms/step | Python peak MB |" : "") << "\n|---|---:|---:|---:|---:|"
       << (with_peer ? "---:|---:|" : "") << "\n";
    for (const Row* r : drows) {
      for (const auto& cfg : r->configs) {
        md << "| " << r->c->name << " | " << cfg.intra << " | " << cfg.blas << " | " << rounds_cell(cfg.cpp) << " | "
           << fixed(best(cfg.cpp).peak_mb, 0) << " |";
        if (with_peer && r->c->peer) md << " " << rounds_cell(cfg.py) << " | " << fixed(best(cfg.py).peak_mb, 0) << " |";
        else if (with_peer) md << " - | - |";
        md << "\n";
      }
    }

    md << "\nWhere the time goes in each side's fastest run (ms, medians of the timed steps; forward: the batch, "
       << "the EDM inputs, the loss and its finite check; backward: backward and the gradient clip; optimizer: the "
       << "rest of the step, zero_grad, AdamW and the EMA update):\n\n"
       << "| model | side | forward | backward | optimizer |\n|---|---|---:|---:|---:|\n";
    for (const Row* r : drows) {
      std::vector<std::pair<std::string, std::vector<Measurement> Config::*>> sides{{"C++", &Config::cpp}};
      if (with_peer && r->c->peer) sides.push_back({"Python", &Config::py});
      for (const auto& [side, member] : sides) {
        const auto& m = fastest(r->configs, member);
        md << "| " << r->c->name << " | " << side << " | " << fixed(m.fwd, 1) << " | " << fixed(m.bwd, 1) << " | "
           << fixed(m.opt, 1) << " |\n";
      }
    }
  }

  if (lrow) {
    const bool with_peer = !lm_peer.empty();
    const Row& r = *lrow;
    if (!drows.empty()) md << "\n";
    md << "## dew bench: a language-model training step and KV-cache generation on the CPU\n\n"
       << "Model: causal_transformer, " << r.c->size << ", " << grouped(r.params) << " parameters.\n\n"
       << "Training step: batch " << lm_batch << " x " << seq_len << " tokens; forward, next-token cross entropy "
       << "(C++: LMObjective, `dew train lm`'s chunked fp32 cross entropy, which also counts correct argmaxes; "
       << "Python: F.cross_entropy of the logits), the finite check, backward, global-norm clip, warm-up + cosine "
       << "lr (peak " << kLr << "), AdamW (weight decay 0.01 on matrices), fp32 EMA (decay " << kEmaDecay
       << "); C++ through the trainer's step (Trainer::train_step); " << warmup << " warm-up + "
       << steps << " timed steps, median. Generation: batch 1, a " << kLmPrompt << "-token prompt, " << kLmNewTokens
       << " greedy new tokens with a KV cache, prefill then one token per forward (C++: sampling::generate_tokens, "
       << "as `dew generate`; Python: the cache as tensors concatenated per step); 1 untimed + " << kLmGenReps
       << " timed generations, median; ms/token = the whole generation, prefill included, / " << kLmNewTokens
       << ". Each configuration runs in a fresh process (training, then generation); " << rounds
       << " round(s) per side" << (with_peer ? ", alternating C++ and Python" : "")
       << ", the fastest round reported, for training and for generation separately. Thread configurations: "
       << "LibTorch intra-op threads (intra) x BLAS threads (blas).\n\n"
       << machine(r, with_peer);
    if (!lm_peer_note.empty()) md << lm_peer_note << "\n\n";

    std::vector<std::pair<std::string, std::vector<Measurement> Config::*>> sides{{"C++", &Config::cpp}};
    if (with_peer) sides.push_back({"Python", &Config::py});
    md << "Training (forward includes the cross entropy; optimizer is AdamW, EMA and zero_grad; peak MB of the "
       << "whole process):\n\n"
       << "| side | best config | ms/step | tokens/s | forward ms | backward ms | optimizer ms | peak MB |\n"
       << "|---|---|---:|---:|---:|---:|---:|---:|\n";
    for (const auto& [side, member] : sides) {
      const auto& m = fastest(r.configs, member);
      md << "| " << side << " | " << config_name(m) << " | " << fixed(m.ms, 1) << " | " << fixed(m.tokens_per_s, 0)
         << " | " << fixed(m.fwd, 1) << " | " << fixed(m.bwd, 1) << " | " << fixed(m.opt, 1) << " | "
         << fixed(m.peak_mb, 0) << " |\n";
    }
    if (with_peer)
      md << "\nTraining speed-up (Python ms/step / C++ ms/step): "
         << fixed(fastest(r.configs, &Config::py).ms / fastest(r.configs, &Config::cpp).ms, 2) << "x\n";

    const auto gen = &Measurement::gen_ms_per_token;
    md << "\nGeneration (prefill: the " << kLmPrompt << "-token prompt's forward alone, median):\n\n"
       << "| side | best config | ms/token | tokens/s | prefill ms |\n|---|---|---:|---:|---:|\n";
    for (const auto& [side, member] : sides) {
      const auto& m = fastest(r.configs, member, gen);
      md << "| " << side << " | " << config_name(m) << " | " << fixed(m.gen_ms_per_token, 2) << " | "
         << fixed(1e3 / m.gen_ms_per_token, 0) << " | " << fixed(m.prefill_ms, 1) << " |\n";
    }
    if (with_peer)
      md << "\nGeneration speed-up (Python ms/token / C++ ms/token): "
         << fixed(fastest(r.configs, &Config::py, gen).gen_ms_per_token /
                      fastest(r.configs, &Config::cpp, gen).gen_ms_per_token,
                  2)
         << "x\n";

    md << "\nEvery configuration (each round's median, fastest first):\n\n"
       << "| intra | blas | C++ ms/step | C++ ms/token |" << (with_peer ? " Python ms/step | Python ms/token |" : "")
       << "\n|---:|---:|---:|---:|" << (with_peer ? "---:|---:|" : "") << "\n";
    for (const auto& cfg : r.configs) {
      md << "| " << cfg.intra << " | " << cfg.blas << " | " << rounds_cell(cfg.cpp) << " | "
         << rounds_cell(cfg.cpp, gen, 2) << " |";
      if (with_peer) md << " " << rounds_cell(cfg.py) << " | " << rounds_cell(cfg.py, gen, 2) << " |";
      md << "\n";
    }
  }

  if (jrow) {
    const bool with_peer = !jepa_peer.empty();
    const Row& r = *jrow;
    if (!drows.empty() || lrow) md << "\n";
    md << "## dew bench: a JEPA training step on the CPU\n\n"
       << "Models: jepa_encoder + jepa_predictor, " << r.c->size << ", " << grouped(r.params)
       << " parameters. Step (`dew train jepa`'s): I-JEPA multi-block masks drawn, the target encoder's "
       << "LayerNorm'd features at the target blocks without gradients (the recipe's masks: " << jepa_masks_text()
       << "), the context encoder on the context block, "
       << "the predictor, MSE; the finite check, backward, global-norm clip, warm-up + cosine lr (peak " << kLr
       << "), AdamW (weight decay 0.01 on matrices), all through the trainer's step (Trainer::train_step); the target "
       << "encoder's momentum update (C++: the trainer's fp32 EMA the objective reads; Python: "
       << "bench/jepa_peer.py, I-JEPA's modules and its per-parameter update). Batch " << batch << "; " << warmup
       << " warm-up + " << steps << " timed steps, median; " << rounds << " round(s) per side"
       << (with_peer ? ", alternating C++ and Python" : "") << ", the fastest round reported.\n\n"
       << machine(r, with_peer);
    step_tables(r, with_peer, "samples/s");
  }

  if (dpo_row) {
    const bool with_peer = !dpo_peer.empty();
    const Row& r = *dpo_row;
    if (!drows.empty() || lrow || jrow) md << "\n";
    md << "## dew bench: a DPO training step on the CPU\n\n"
       << "Model: causal_transformer, " << r.c->size << " (`dew train dpo`'s fresh model), " << grouped(r.params)
       << " parameters. Step (`dew train dpo`'s, beta 0.1, reference log-probs per batch): " << batch
       << " pairs of " << kDpoLen << " tokens, chosen and rejected sharing a " << kDpoLen - kDpoCompletion
       << "-token prompt and differing in the last " << kDpoCompletion << " (the completion mask); the frozen "
       << "reference's forward on the " << 2 * batch << " rows without gradient, the policy's forward, each row's "
       << "summed completion log-probs, the sigmoid loss -logsigmoid(beta * (chosen - rejected log-ratio)) and its "
       << "reward metrics; the finite check, backward, global-norm clip, warm-up + cosine lr (peak " << kLr
       << "), AdamW (weight decay 0.01 on matrices), through the trainer's step (Trainer::train_step). C++: DPOObjective "
       << "with the trainer's EMA as its reference (a frozen copy, never updated); Python: bench/dpo_peer.py, "
       << "TRL's step (concatenated chosen + rejected forward, a deepcopy as the reference). " << warmup
       << " warm-up + " << steps << " timed steps, median; " << rounds << " round(s) per side"
       << (with_peer ? ", alternating C++ and Python" : "") << ", the fastest round reported.\n\n"
       << machine(r, with_peer);
    step_tables(r, with_peer, "pairs/s");
  }

  if (rollout_row) {
    const bool with_peer = !rollout_peer.empty();
    const Row& r = *rollout_row;
    const int64_t n = kGrpoPrompts * kGrpoGroup;
    if (!drows.empty() || lrow || jrow || dpo_row) md << "\n";
    md << "## dew bench: a GRPO rollout (batched sampling with a KV cache) on the CPU\n\n"
       << "Model: causal_transformer, " << r.c->size << " (`dew train grpo`'s fresh model), " << grouped(r.params)
       << " parameters. Rollout (GRPOObjective's generation): " << kGrpoPrompts << " prompts of " << kGrpoPromptLen
       << " tokens x group " << kGrpoGroup << " = " << n << " rows in one batch; prefill, then "
       << kGrpoNewTokens - 1 << " single-token forwards with the KV cache, each row sampling " << kGrpoNewTokens
       << " tokens at temperature 1 (no EOS, so every row generates all of them) and keeping their log-probs. "
       << "C++: sampling::generate_tokens; Python: bench/grpo_rollout_peer.py, torch.multinomial of "
       << "softmax(logits / T), the cache as tensors concatenated per step. " << warmup << " warm-up + " << steps
       << " timed rollouts, median; " << rounds << " round(s) per side"
       << (with_peer ? ", alternating C++ and Python" : "") << ", the fastest round reported.\n\n"
       << machine(r, with_peer);
    std::vector<std::pair<std::string, std::vector<Measurement> Config::*>> sides{{"C++", &Config::cpp}};
    if (with_peer) sides.push_back({"Python", &Config::py});
    md << "| side | best config | ms/rollout | generated tokens/s | prefill ms | peak MB |\n"
       << "|---|---|---:|---:|---:|---:|\n";
    for (const auto& [side, member] : sides) {
      const auto& m = fastest(r.configs, member);
      md << "| " << side << " | " << config_name(m) << " | " << fixed(m.ms, 1) << " | " << fixed(m.tokens_per_s, 0)
         << " | " << fixed(m.prefill_ms, 1) << " | " << fixed(m.peak_mb, 0) << " |\n";
    }
    if (with_peer)
      md << "\nSpeed-up (C++ tokens/s / Python tokens/s, higher is better for C++): "
         << fixed(fastest(r.configs, &Config::cpp).tokens_per_s / fastest(r.configs, &Config::py).tokens_per_s, 2)
         << "x\n";
    md << "\nEvery configuration (ms/rollout, each round's median, fastest first):\n\n| intra | blas | C++ ms/rollout |"
       << (with_peer ? " Python ms/rollout |" : "") << "\n|---:|---:|---:|" << (with_peer ? "---:|" : "") << "\n";
    for (const auto& cfg : r.configs) {
      md << "| " << cfg.intra << " | " << cfg.blas << " | " << rounds_cell(cfg.cpp) << " |";
      if (with_peer) md << " " << rounds_cell(cfg.py) << " |";
      md << "\n";
    }
  }

  if (sd_unet_row || sd_vae_row) {
    const bool with_peer = !sd_peer.empty();
    if (!md.str().empty()) md << "\n";
    md << "## dew bench: Stable Diffusion components on the CPU\n\n"
       << "Both sides build each model from the same diffusers config.json dict (below): C++ through "
       << "models::fields_from_reference_config, Python (bench/sd_peer.py) as diffusers' own class ("
       << python_diffusers << "); the parameter counts "
       << "must agree. Each configuration runs in a fresh process: " << warmup << " warm-up + " << steps
       << " timed steps, median; " << rounds << " round(s) per side" << (with_peer ? ", alternating C++ and Python" : "")
       << ", the fastest round reported. Thread configurations: LibTorch intra-op threads (intra) x "
       << "BLAS threads (blas).\n\n"
       << machine(sd_unet_row ? *sd_unet_row : *sd_vae_row, with_peer);
    if (!sd_peer_note.empty()) md << sd_peer_note << "; C++ side only.\n\n";
    if (sd_unet_row) {
      const Row& r = *sd_unet_row;
      md << "### sd_unet: a UNet2DConditionModel training step\n\n"
         << "Model: unet_2d_condition / UNet2DConditionModel, " << r.c->size << ", " << grouped(r.params)
         << " parameters; config `" << r.fields << "`. Step (diffusers' train_text_to_image.py, epsilon prediction): "
         << "batch " << sd_unet_batch << "; noise and timesteps in [0, " << kSdTrainTimesteps << ") drawn, the noisy latents "
         << "of SD's scaled_linear schedule (" << kSdBetaStart << " .. " << kSdBetaEnd << "; DDPMScheduler.add_noise), "
         << "the UNet on a fixed [" << sd_unet_batch << ", " << kSdContextLen << ", "
         << sd_unet_config().at("cross_attention_dim").get<int64_t>() << "] text context, MSE against the noise; "
         << "backward; AdamW (lr " << kSdLr << "; C++: weight decay 0.01 on matrices, Python: torch.optim.AdamW with "
         << "weight_decay 0.01 on every parameter, as the script); EMA (decay " << kEmaDecay
         << " with the (1 + step)/(10 + step) ramp; Python: diffusers.training_utils.EMAModel); zero_grad. No "
         << "gradient clipping.\n\n";
      step_tables(r, with_peer, "samples/s");
    }
    if (sd_vae_row) {
      const Row& r = *sd_vae_row;
      if (sd_unet_row) md << "\n";
      md << "### sd_vae: AutoencoderKL encode + decode\n\n"
         << "Model: autoencoder_kl / AutoencoderKL, " << r.c->size << ", " << grouped(r.params) << " parameters; "
         << "config `" << r.fields << "`. Pass (as a pipeline runs it, without gradients): batch " << sd_vae_batch
         << "; z = scaling_factor * encode(x).latent_dist.sample(generator), x_hat = decode(z / scaling_factor).\n\n";
      std::vector<std::pair<std::string, std::vector<Measurement> Config::*>> sides{{"C++", &Config::cpp}};
      if (with_peer) sides.push_back({"Python", &Config::py});
      md << "| side | best config | ms/pass | images/s | encode ms | decode ms | peak MB |\n"
         << "|---|---|---:|---:|---:|---:|---:|\n";
      for (const auto& [side, member] : sides) {
        const auto& m = fastest(r.configs, member);
        md << "| " << side << " | " << config_name(m) << " | " << fixed(m.ms, 1) << " | " << fixed(m.samples_per_s, 1)
           << " | " << fixed(m.fwd, 1) << " | " << fixed(m.bwd, 1) << " | " << fixed(m.peak_mb, 0) << " |\n";
      }
      if (with_peer)
        md << "\nSpeed-up (Python ms/pass / C++ ms/pass): "
           << fixed(fastest(r.configs, &Config::py).ms / fastest(r.configs, &Config::cpp).ms, 2) << "x\n";
      md << "\nEvery configuration (each round's median, fastest first):\n\n| intra | blas | C++ ms/pass |"
         << (with_peer ? " Python ms/pass |" : "") << "\n|---:|---:|---:|" << (with_peer ? "---:|" : "") << "\n";
      for (const auto& cfg : r.configs) {
        md << "| " << cfg.intra << " | " << cfg.blas << " | " << rounds_cell(cfg.cpp) << " |";
        if (with_peer) md << " " << rounds_cell(cfg.py) << " |";
        md << "\n";
      }
    }
  }

  if (train_row) {
    const bool with_peer = !train_peer.empty();
    const Row& r = *train_row;
    if (!md.str().empty()) md << "\n";
    const json& rec = train_record;
    md << "## dew bench: `dew train` throughput, the default recipe with its data loader\n\n"
       << "Run: " << r.c->size << " (" << grouped(r.params) << " parameters); batch " << train_batch
       << ", optim " << rec["optim"].dump() << ", trainer.steps " << rec["trainer"]["steps"].dump()
       << " (the schedule's length; " << warmup << " warm-up + " << steps << " timed steps run). C++: "
       << "runs::prepare of the recipe, as `dew train diffusion` with no flags, and training::Trainer::train_step "
       << "(the loader's next batch, DiffusionObjective's loss, the finite guard, backward, clip, the learning-rate "
       << "schedule, AdamW, the EMA), the DataLoader with its " << rec["loader"]["num_workers"].dump()
       << " worker thread(s) and prefetch " << rec["loader"]["prefetch"].dump()
       << ". Python (bench/train_peer.py): the same unet, flow loss, label drop, clip, schedule and EMA around a "
       << "torch.utils.data.DataLoader (num_workers 0, shuffle, same batch size, no augmentation as the recipe) over "
       << "the same uint8 images and labels, dumped by dew. samples/s = items / seconds of the timed steps; data ms = "
       << "median wait for the next batch; " << rounds << " round(s) per side"
       << (with_peer ? ", alternating C++ and Python" : "") << ", the fastest round reported.\n\n"
       << machine(r, with_peer);
    std::vector<std::pair<std::string, std::vector<Measurement> Config::*>> sides{{"C++", &Config::cpp}};
    if (with_peer) sides.push_back({"Python", &Config::py});
    md << "| side | best config | samples/s | ms/step | data ms | forward ms | backward ms | optimizer ms | peak MB |\n"
       << "|---|---|---:|---:|---:|---:|---:|---:|---:|\n";
    for (const auto& [side, member] : sides) {
      const auto& m = fastest(r.configs, member);
      md << "| " << side << " | " << config_name(m) << " | " << fixed(m.samples_per_s, 1) << " | " << fixed(m.ms, 1)
         << " | " << fixed(m.data_ms, 2) << " | " << fixed(m.fwd, 1) << " | " << fixed(m.bwd, 1) << " | "
         << fixed(m.opt, 1) << " | " << fixed(m.peak_mb, 0) << " |\n";
    }
    if (with_peer)
      md << "\nSpeed-up (C++ samples/s / Python samples/s): "
         << fixed(fastest(r.configs, &Config::cpp).samples_per_s / fastest(r.configs, &Config::py).samples_per_s, 2)
         << "x\n";
    md << "\nEvery configuration (ms/step, each round's, fastest first):\n\n| intra | blas | C++ ms/step |"
       << (with_peer ? " Python ms/step |" : "") << "\n|---:|---:|---:|" << (with_peer ? "---:|" : "") << "\n";
    for (const auto& cfg : r.configs) {
      md << "| " << cfg.intra << " | " << cfg.blas << " | " << rounds_cell(cfg.cpp) << " |";
      if (with_peer) md << " " << rounds_cell(cfg.py) << " |";
      md << "\n";
    }
  }

  if (sample_row) {
    const bool with_peer = !sample_peer.empty();
    const Row& r = *sample_row;
    if (!md.str().empty()) md << "\n";
    const DiffusionSampleOptions g =
        sample_options(train_record["derived"]["sample_shape"].get<std::vector<int64_t>>(),
                       train_record["model"]["fields"].value("num_classes", int64_t(0)), sample_images, sample_steps);
    const bool guided = g.guidance.scale != 1.0 && g.labels.defined();
    const int64_t chunks = (sample_images + g.batch_size - 1) / g.batch_size;
    md << "## dew bench: `dew sample`, " << sample_images << " images, " << sample_steps << " " << g.solver
       << " steps\n\n"
       << "Model: " << r.c->size << ", " << grouped(r.params) << " parameters; preset "
       << train_record["preset"].dump() << ". Sampling (`dew sample RUN`'s defaults; C++: sample_diffusion, as "
       << "cmd_sample calls it after opening the run, with run.images and .cpu(), without writing the PNG): "
       << sample_images << " images in " << chunks << " chunk(s) of at most " << g.batch_size
       << ", labels 0, 1, ... cycling through the " << train_record["model"]["fields"].value("num_classes", int64_t(0))
       << " classes (for a multiple of the class count, `dew sample --count N`'s labels), solver " << g.solver
       << " on the grid "
       << "linspace(t_max, t_min, " << sample_steps << ") (" << sample_steps - 1 << " Euler steps, then the final "
       << "denoise)" << (guided ? ", classifier-free guidance " + fixed(g.guidance.scale, 1) +
                                      " (every forward on the doubled batch: the labels, then the null class)"
                                : ", unguided")
       << ", so " << sample_steps << " forwards per chunk, no gradients; then the clamp to [-1, 1]. Python "
       << "(bench/sample_peer.py): bench/peer.py's Unet under torch.no_grad(), the same prior N(0, 1), grid, "
       << "model time, guidance, x0 read-back and Euler update, the same chunks. Network ms: the model's "
       << "forwards alone on the same doubled chunks, measured after the runs (the median of 3 per chunk, x "
       << sample_steps << "; an estimate, noisy on a shared machine); rest = the sampling run minus that. Before "
       << "the runs one forward of every chunk warms its shape up; then " << sample_warmup << " warm-up + "
       << sample_runs << " timed sampling run(s) per configuration, median; " << rounds << " round(s) per side"
       << (with_peer ? ", alternating C++ and Python" : "") << ", the fastest round reported.\n\n"
       << machine(r, with_peer);
    std::vector<std::pair<std::string, std::vector<Measurement> Config::*>> sides{{"C++", &Config::cpp}};
    if (with_peer) sides.push_back({"Python", &Config::py});
    md << "| side | best config | ms/sampling run | images/s | network ms (est.) | rest ms (est.) | peak MB |\n"
       << "|---|---|---:|---:|---:|---:|---:|\n";
    for (const auto& [side, member] : sides) {
      const auto& m = fastest(r.configs, member);
      md << "| " << side << " | " << config_name(m) << " | " << fixed(m.ms, 1) << " | " << fixed(m.samples_per_s, 2)
         << " | " << fixed(m.fwd, 1) << " | " << fixed(m.ms - m.fwd, 1) << " | " << fixed(m.peak_mb, 0) << " |\n";
    }
    if (with_peer)
      md << "\nSpeed-up (Python ms/sampling run / C++ ms/sampling run): "
         << fixed(fastest(r.configs, &Config::py).ms / fastest(r.configs, &Config::cpp).ms, 2) << "x\n";
    md << "\nEvery configuration (ms/sampling run, each round's median, fastest first):\n\n| intra | blas | C++ |"
       << (with_peer ? " Python |" : "") << "\n|---:|---:|---:|" << (with_peer ? "---:|" : "") << "\n";
    for (const auto& cfg : r.configs) {
      md << "| " << cfg.intra << " | " << cfg.blas << " | " << rounds_cell(cfg.cpp) << " |";
      if (with_peer) md << " " << rounds_cell(cfg.py) << " |";
      md << "\n";
    }
  }

  // The summary: every case's time on each side and both ratios, ahead of the sections.
  std::ostringstream summary;
  if (std::any_of(rows.begin(), rows.end(), [](const Row& r) { return !r.configs.front().py.empty(); })) {
    summary << "## dew bench: summary\n\n"
            << "Each case's fastest time per side: C++ (dew), Python eager and Python under torch.compile "
            << "(inductor, default mode; the training-step cases only, in the eager peer's fastest thread "
            << "configuration; its compile time, the first step's time beyond a steady step, apart). Both sides load "
            << "the same libtorch. vs eager = Python eager time / C++ time, vs compiled = Python compiled time / C++ "
            << "time: above 1, dew is faster. The sections below hold every configuration and round.\n\n"
            << machine(rows.front(), true)
            << "| case | unit | C++ | Python eager | Python compiled | vs eager | vs compiled | compile s |\n"
            << "|---|---|---:|---:|---:|---:|---:|---:|\n";
    const auto line = [&](const Row& r, const std::string& name, const std::string& unit, double Measurement::*key) {
      const Measurement* c = fastest_of(r.configs, &Config::cpp, key);
      const Measurement* e = fastest_of(r.configs, &Config::py, key);
      const Measurement* k = key == &Measurement::ms ? fastest_of(r.configs, &Config::pyc, key) : nullptr;
      const int digits = key == &Measurement::ms ? 1 : 2;
      summary << "| " << name << " | " << unit << " | " << (c ? fixed(c->*key, digits) : "-") << " | "
              << (e ? fixed(e->*key, digits) : "-") << " | " << (k ? fixed(k->*key, digits) : "-") << " | "
              << (c && e ? fixed(e->*key / (c->*key), 2) + "x" : "-") << " | "
              << (c && k ? fixed(k->*key / (c->*key), 2) + "x" : "-") << " | " << (k ? fixed(k->compile_s, 0) : "-")
              << " |\n";
    };
    for (const Row& r : rows) {
      const BenchCase* c = r.c;
      const std::string unit = c == &sd_vae_case()          ? "ms/pass"
                               : c == &sample_case()        ? "ms/sampling run"
                               : c == &grpo_rollout_case()  ? "ms/rollout"
                                                            : "ms/step";
      line(r, c == &lm_case() ? "lm training" : c->name, unit, &Measurement::ms);
      if (c == &lm_case()) line(r, "lm generation", "ms/token", &Measurement::gen_ms_per_token);
    }
    summary << "\n";
  }

  std::cout << summary.str() << md.str();
  if (f.has("out")) {
    std::ofstream out(f.get("out", ""));
    DEW_CHECK(out && (out << summary.str() << md.str()), "--out: cannot write \"", f.get("out", ""), "\"");
    std::cerr << "bench: wrote " << f.get("out", "") << "\n";
  }
  return 0;
}

}  // namespace dew::cli

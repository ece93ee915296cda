// The cases of `dew bench`: each one names what it builds and times at a fixed small size that its Python peer
// (bench/*.py) receives too. The diffusion table holds denoisers of the model registry; the other cases are the
// language model, the JEPA, DPO and GRPO-rollout steps, the Stable Diffusion components, the SD3 and Flux
// transformers, `dew train`'s throughput and `dew sample`.
//
//   const bench::BenchCase& c = bench::find_case("unet");
//   bench::Sizes s;                                   // every size at the case's default
//   int64_t b = bench::batch_of(c, s);                // 32
#pragma once
#include <c10/core/Device.h>

#include <optional>
#include <string>
#include <vector>

#include "dew/core/options.h"
#include "dew/nn/lora.h"
#include "dew/objectives/jepa.h"
#include "dew/runs/run.h"
#include "dew/sampling/diffusion_sample.h"
#include "dew/training/optim.h"

namespace dew::bench {

// The training steps' hyper-parameters; bench/peer.py holds the same values.
inline constexpr double kLr = 1e-3;
inline constexpr double kEmaDecay = 0.995;
inline constexpr int64_t kImage = 28;  // input side in pixels (Fashion-MNIST)
// The language model's generation: batch 1, a prompt of kLmPrompt random ids, kLmNewTokens greedy tokens,
// one untimed then kLmGenReps timed generations (median); bench/lm_peer.py gets the same values.
inline constexpr int64_t kLmPrompt = 32;
inline constexpr int64_t kLmNewTokens = 64;
inline constexpr int64_t kLmGenReps = 5;
// Post-training (`dew train dpo` / `grpo`'s default byte model): DPO pairs of kDpoLen tokens whose last
// kDpoCompletion are the completion; GRPO rollouts of kGrpoPrompts prompts of kGrpoPromptLen tokens, each
// sampled kGrpoGroup times (temperature 1, no EOS) for kGrpoNewTokens tokens. The peers get the same values.
inline constexpr int64_t kDpoLen = 48;
inline constexpr int64_t kDpoCompletion = 10;
inline constexpr int64_t kGrpoPrompts = 16;
inline constexpr int64_t kGrpoGroup = 8;
inline constexpr int64_t kGrpoPromptLen = 36;
inline constexpr int64_t kGrpoNewTokens = 16;
// Stable Diffusion components (sd_unet, sd_vae): the step of diffusers' train_text_to_image.py (learning rate
// 1e-4; SD's scaled_linear noise schedule over 1000 steps) on a batch of kSdUnetBatch latents of 4 x kSdLatent^2
// with kSdContextLen text tokens, and the VAE on kSdVaeBatch images of 3 x kSdImage^2 (sizes for a step of
// 0.2-1 s on 2 cores). bench/sd_peer.py holds the same step values.
inline constexpr int64_t kSdUnetBatch = 8;
inline constexpr int64_t kSdVaeBatch = 4;
inline constexpr int64_t kSdLatent = 16;
inline constexpr int64_t kSdContextLen = 16;
inline constexpr int64_t kSdImage = 64;
inline constexpr double kSdLr = 1e-4;
inline constexpr int64_t kSdTrainTimesteps = 1000;
inline constexpr double kSdBetaStart = 0.00085, kSdBetaEnd = 0.012;
// sd_unet_lora: the step of diffusers' train_text_to_image_lora.py on sd_unet's model and batch: LoRA adapters
// (sd_unet_lora_options(): rank and alpha 4 on the attention projections), the base frozen, AdamW (lr kSdLr, weight
// decay 1e-2) on the adapters, their gradient norm clipped to kSdLoraGradClip (--max_grad_norm), no EMA.
inline constexpr double kSdLoraGradClip = 1.0;
// The flow-matching transformers (sd3: SD3Transformer2DModel, flux: FluxTransformer2DModel, FLUX.1 dev's layout):
// the step of diffusers' train_dreambooth_sd3.py / train_dreambooth_flux.py (logit-normal sigmas, velocity target
// noise - latents, gradient clip kFlowGradClip, AdamW lr kFlowLr and weight decay kFlowWeightDecay, no EMA) on
// kFlowBatch latents of kFlowChannels x kFlowLatent^2 with kFlowContextLen text tokens; Flux's guidance input is
// kFlowGuidance. bench/sd_peer.py holds the same step values.
inline constexpr int64_t kFlowBatch = 4;
inline constexpr int64_t kFlowChannels = 16;
inline constexpr int64_t kFlowLatent = 32;
inline constexpr int64_t kFlowContextLen = 16;
inline constexpr double kFlowLr = 1e-4;
inline constexpr double kFlowWeightDecay = 1e-4;
inline constexpr double kFlowGradClip = 1.0;
inline constexpr double kFlowGuidance = 3.5;
// qwen_image (QwenImage21Transformer2DModel, causal_condition): the same flow step on kFlowBatch latents of
// kFlowChannels x kQwenLatent^2 (one token per latent: 256 image tokens, as sd3's and flux's) with kFlowContextLen
// text tokens; then sampling as QwenImage21Pipeline runs it, one image of kFlowChannels x kQwenLatent^2 under a
// kQwenSampleText-token prompt, kQwenSampleSteps Euler steps without and with the prefix KV cache, each timed
// kQwenSampleReps times after one untimed run.
inline constexpr int64_t kQwenLatent = 16;
inline constexpr int64_t kQwenSampleText = 128;
inline constexpr int64_t kQwenSampleSteps = 8;
inline constexpr int64_t kQwenSampleReps = 3;
// `dew sample RUN` on the default recipe's model: kSampleImages images with `dew sample`'s defaults (solver
// euler, kSampleSteps grid points, guidance kSampleGuidance on a class-conditional run, chunks of
// DiffusionSampleOptions' batch_size); kSampleRuns timed sampling runs after kSampleWarmup untimed ones
// (--steps and --warmup for this case), each side warmed up by one forward of every chunk's doubled batch first.
// bench/sample_peer.py gets the same values.
inline constexpr int64_t kSampleImages = 100;
inline constexpr int64_t kSampleSteps = 30;
inline constexpr double kSampleGuidance = 3.0;  // cmd_sample's default for a class-conditional or text run
inline constexpr int64_t kSampleRuns = 1;       // one run is 60 forwards of 72-128 rows: 20-80 s on 2 shared cores
inline constexpr int64_t kSampleWarmup = 0;     // the network-alone forwards before the runs warm every chunk up

// FID's InceptionV3 (dew/metrics/inception.h, pytorch-fid 0.3.0's InceptionV3([3])): pool3 features of
// kFidBatch images of 3 x kFidImage^2 in [0, 1], resized to 299 x 299 inside (bilinear), without gradients;
// random weights (speed does not depend on them). bench/fid_peer.py runs pytorch-fid's own class.
inline constexpr int64_t kFidBatch = 8;
inline constexpr int64_t kFidImage = 64;

// Data-parallel training (--models ddp): the train case's run with kDdpCores cores split two ways, 1 rank x
// kDdpCores threads against kDdpCores ranks x 1 thread (dew launch / torchrun, Gloo on loopback).
inline constexpr int64_t kDdpCores = 2;

/// What a case times, and so which child, peer and report section it has.
enum class CaseKind {
  diffusion,
  lm,
  jepa,
  dpo,
  grpo_rollout,
  sd_unet,
  sd_unet_lora,
  sd_vae,
  sd3,
  flux,
  qwen_image,
  train,
  sample,
  fid,
  ddp
};

/// One benchmarked model: a registry architecture at a fixed small size.
struct BenchCase {
  std::string name;  // what --models selects
  std::string arch;  // dew::models registry name (also the peer's --model)
  std::string size;  // for the table
  json fields;
  std::vector<int64_t> item = {1, kImage, kImage};  // one input: [C, H, W] or [C, T, H, W]
  int64_t context_len = 0;                          // text tokens ([B, L, context_features]); 0 = none
  bool peer = true;                                 // its peer implements it (the diffusion table)
  CaseKind kind = CaseKind::diffusion;
};

/// The diffusion table: a training step of each denoiser.
const std::vector<BenchCase>& bench_cases();
/// The cases beyond the diffusion table, in --all's order.
const std::vector<const BenchCase*>& other_cases();
const BenchCase& lm_case();
const BenchCase& jepa_case();
const BenchCase& dpo_case();
const BenchCase& grpo_rollout_case();
const BenchCase& sd_unet_case();
const BenchCase& sd_unet_lora_case();
const BenchCase& sd_vae_case();
const BenchCase& sd3_case();
const BenchCase& flux_case();
const BenchCase& qwen_image_case();
const BenchCase& train_case();
const BenchCase& sample_case();
const BenchCase& fid_case();
/// Data-parallel training (`dew bench --models ddp`): not in --all (it runs for minutes).
const BenchCase& ddp_case();

/// The case called `name`; dew::Error listing every name otherwise.
const BenchCase& find_case(const std::string& name);
/// Every case's name, comma-separated (--all).
std::string all_case_names();
/// The cases of a comma-separated list, in its order; a name listed twice is a dew::Error.
std::vector<const BenchCase*> select_cases(const std::string& models);
/// Whether any of `cases` is of kind k.
bool any_of_kind(const std::vector<const BenchCase*>& cases, CaseKind k);
/// The items of a comma-separated list; an empty item is a dew::Error naming --flag.
std::vector<std::string> split_list(const std::string& s, const std::string& flag);
/// sd_unet, sd_unet_lora, sd_vae, sd3, flux or qwen_image: built from a diffusers config.json dict, timed against diffusers' own class
/// (bench/sd_peer.py).
bool is_sd(const BenchCase& c);
/// sd3, flux or qwen_image: a flow-matching transformer's training step.
bool is_flow_transformer(const BenchCase& c);
/// The text width of a flow transformer's diffusers config: joint_attention_dim (SD3, Flux) or context_in_dim
/// (Qwen-Image).
json flow_text_width(const json& config);

/// The sizes the flags set; an unset one takes each case's default.
struct Sizes {
  std::optional<int64_t> batch;         // --batch
  std::optional<int64_t> steps;         // --steps: timed steps (grpo_rollout: rollouts; sample: sampling runs)
  std::optional<int64_t> warmup;        // --warmup: untimed steps first
  int64_t seq_len = 256;                // lm: training tokens per row
  int64_t images = kSampleImages;       // sample: images per sampling run
  int64_t sample_steps = kSampleSteps;  // sample: the sampler's grid points
};
/// Rows per step: 32; lm, sd_vae, sd3 and flux 4, sd_unet and sd_unet_lora 8, train the recipe's (dpo: pairs; unused by grpo_rollout, sample).
int64_t batch_of(const BenchCase& c, const Sizes& s);
/// Timed steps: 20; sample kSampleRuns.
int64_t steps_of(const BenchCase& c, const Sizes& s);
/// Untimed steps: 5; sample kSampleWarmup.
int64_t warmup_of(const BenchCase& c, const Sizes& s);

/// The lm fields for a training length: max_seq_len covers it and the generation.
json lm_fields(int64_t seq_len);
/// `dew train jepa`'s recipe, completed for 1 x 28 x 28 inputs as `dew train jepa` completes it: "model" and
/// "predictor" are the configs the jepa case times.
const json& jepa_recipe();
JEPAObjectiveOptions jepa_objective_options();
/// The fresh model of `dew train dpo` and `dew train grpo`: a byte causal_transformer, width 128, 4 layers.
const json& post_training_fields();
/// The diffusers config.json dicts of sd_unet and sd_unet_lora (UNet2DConditionModel), sd_vae (AutoencoderKL), sd3
/// (SD3Transformer2DModel) and flux (FluxTransformer2DModel).
const json& sd_unet_config();
const json& sd_vae_config();
/// sd_unet_lora's adapters, train_text_to_image_lora.py's LoraConfig: r = lora_alpha = 4 (--rank's default),
/// target_modules to_k, to_q, to_v, to_out.0. bench/sd_peer.py holds the same values.
nn::LoraOptions sd_unet_lora_options();
const json& sd3_config();
const json& flux_config();
/// The dict an SD case is built from.
const json& reference_config(const BenchCase& c);

/// The optimizer of every step timed through the trainer: its defaults at peak lr kLr, warmed up linearly over
/// the `warmup` untimed steps so the timed ones run the cosine decay. The peers get it as --optim JSON.
training::OptimOptions bench_optim(int64_t warmup);
/// The options `dew sample RUN --count images --steps sample_steps` builds for a run of sample `shape` [C, H, W]
/// and `num_classes` classes (0: unconditional): euler, guidance kSampleGuidance, seed 0, cycling labels.
DiffusionSampleOptions sample_options(const std::vector<int64_t>& shape, int64_t num_classes, int64_t images,
                                      int64_t sample_steps);
/// `dew train diffusion`'s default recipe as runs::prepare builds it (model, objective, the Fashion-MNIST
/// DataLoader), run directory `dir` (nothing is written there), `threads` intra-op threads (0: the measured
/// default), `batch` items per batch (0: the recipe's).
runs::PreparedRun prepare_default_train(const std::string& dir, int64_t threads, int64_t batch,
                                        const c10::Device& device);

/// A case's model as the registry completes it (defaults included): the fields its peer builds the same model
/// from, and its parameter count, which the peer checks.
struct CaseModel {
  json fields;  // jepa: {"encoder": ..., "predictor": ..., "masks": ...}
  int64_t params = 0;
};
/// Builds case c's model once on the CPU: lm at `seq_len`, train and sample from `train_fields` (the prepared
/// recipe's completed model fields).
CaseModel case_model(const BenchCase& c, int64_t seq_len, const json& train_fields);

}  // namespace dew::bench

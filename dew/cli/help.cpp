// The help of the commands that serve several run kinds (`dew train`, `dew sample`, `dew eval`) and of the
// listing commands: every flag of every kind they serve, grouped by kind.
#include "dew/cli/help.h"

#include <iostream>

#include "dew/runs/run.h"

namespace dew::cli {

bool asks_help(const std::vector<std::string>& args) {
  for (const auto& a : args)
    if (a == "--help" || a == "-h") return true;
  return false;
}

std::string train_usage() {
  std::string out =
      "usage: dew train KIND [--config run.json] [--a.b value ...]\n"
      "Trains a run of KIND into --run DIR (resuming it when DIR holds one). Every recipe field is a flag\n"
      "(--trainer.steps 500, --model.architecture unet); `dew train KIND --help` lists them with their defaults.\n"
      "Every run writes TensorBoard event files into DIR/tensorboard (--tensorboard off: none).\n"
      "\nkinds:\n";
  for (const auto& k : runs::run_kinds())
    out += "  " + k + std::string(k.size() < 12 ? 12 - k.size() : 1, ' ') + runs::run_kind(k).doc + "\n";
  return out;
}

const char* sample_usage() {
  return "usage: dew sample RUN [flags]                       sample a trained diffusion or autoencoder-latent run\n"
         "       dew sample --pipeline DIR --prompt TEXT --out F.png [flags]   run a diffusers pipeline folder\n"
         "\n"
         "a diffusion run (RUN):\n"
         "  --solver euler       a solver of `dew list solvers`\n"
         "  --steps 30           sampling steps\n"
         "  --guidance G         classifier-free guidance scale (3 for a class- or text-conditional run, else 1)\n"
         "  --interval A,B       apply guidance only for schedule times in [A, B]\n"
         "  --rescale 0          guidance rescale (0 = off)\n"
         "  --labels all|1,2     class ids, repeated to fill --count (one grid row per repetition)\n"
         "  --prompt TEXT        a caption, for a text-conditional run (instead of --labels)\n"
         "  --count N            samples (default: 4 per label, 16 for a prompt, 64 unconditional; videos fewer)\n"
         "  --seed 0             noise seed\n"
         "  --eta E, --churn C   the stochastic solvers' noise (ddim's eta, heun's s_churn)\n"
         "  --weights ema|live   which weights; --step N: a checkpoint's step (default: the latest)\n"
         "  --out F.png          default RUN/samples/sample_step_N.png; --nrow N: images per grid row\n"
         "  --threads N, --device cpu|cuda|auto\n"
         "\n"
         "a diffusers pipeline (--pipeline DIR: StableDiffusionPipeline, StableDiffusionXLPipeline,\n"
         "StableDiffusion3Pipeline, FluxPipeline, QwenImage21Pipeline):\n"
         "  --prompt TEXT --out F.png (required), --negative-prompt, --prompt-2, --negative-prompt-2 (SDXL's and\n"
         "  SD3's second CLIP encoder; Flux: --prompt-2 is T5's), --prompt-3, --negative-prompt-3 (SD3's T5)\n"
         "  --steps (30; SD3 / Flux 28), --guidance (7.5; SDXL 5, SD3 7, Flux dev 3.5; schnell takes none),\n"
         "  --seed 0, --size HxW, --count 1, --nrow 4, --eta 0 (DDIM)\n"
         "  --max-sequence-length N   T5 tokens (SD3 256, Flux 512)\n"
         "  --weights-dtype float32|bfloat16|float16   matrix weights held in that dtype, matmuls and\n"
         "                       convolutions computed in it (float32 accumulation), the rest in float32\n"
         "  --scheduler CLASS    another diffusers scheduler class on the folder's config (SD / SDXL)\n"
         "  --lora FILE[:SCALE]  a LoRA file of the UNet or transformer merged at load with its scale times\n"
         "                       SCALE (default 1); repeat it to apply several. SD / SDXL: diffusers'\n"
         "                       pytorch_lora_weights.safetensors or kohya's lora_unet_* layout; SD3 / Flux:\n"
         "                       diffusers' (transformer.* keys, what save_lora_weights writes); Qwen-Image 2.1:\n"
         "                       diffusers' (transformer.* keys)\n"
         "  --latents F          start from the tensor \"latents\" of a safetensors file; --threads N\n"
         "  Qwen-Image 2.1: --guidance is true_cfg_scale (default 1: none; above 1 with --negative-prompt, \"\"\n"
         "  if not given), --steps N the linspace grid (default: the folder's sample_sigmas, else 40 steps),\n"
         "  --size 1024x1024 by default (multiples of 32); RGBA images (the VAE's 4 channels)\n";
}

const char* eval_usage() {
  return "usage: dew eval RUN [flags]    (the run's kind, from RUN/run.json, picks what is measured)\n"
         "\n"
         "diffusion (a class- or caption-conditional 1x28x28 Fashion-MNIST run): samples scored by dew's\n"
         "Fashion-MNIST classifier, accuracy and Frechet distance on its features; rows appended to RUN/eval.jsonl\n"
         "  --solvers euler[,heun,...]   one row per solver\n"
         "  --steps 30, --guidance 3, --count 1000 (a multiple of 10), --seed 0, --batch 100\n"
         "  --classifier                 train (or find cached) the classifier only, no RUN needed\n"
         "  each FD is printed beside its floor (the first --count real training images in place of the samples)\n"
         "  and per-class accuracy goes to RUN/eval.md. FID (Inception, as pytorch-fid 0.3.0) is added when the\n"
         "  weights are given or cached (docs/evaluation.md#fid); it needs --count > 2048:\n"
         "  --inception FILE             pytorch-fid's pt_inception-2015-12-05 weights (.safetensors or zip .pth)\n"
         "  --fid-ref DIR|FILE.npz       reference statistics: a folder of images (cached) or pytorch-fid's .npz\n"
         "                               (default: the Fashion-MNIST test set, cached)\n"
         "  --fid-mode pytorch-fid|clean resize as pytorch-fid (bilinear) or clean-fid (PIL bicubic, antialiased)\n"
         "  --clip DIR                   caption runs: CLIP score (torchmetrics' CLIPScore) of each sample and\n"
         "                               its caption, with the transformers CLIPModel folder DIR\n"
         "\n"
         "--pipeline DIR --prompts FILE --clip CLIP_DIR (no RUN): CLIP score of a diffusers pipeline folder's\n"
         "images, --count per prompt (one per line), also --steps, --guidance, --seed (+1 per prompt)\n"
         "\n"
         "autoencoder: PSNR, SSIM, L1 and KL of held-out reconstructions; a row appended to RUN/eval.jsonl\n"
         "  --count 0                    held-out images (0 = all)\n"
         "  --lpips-net alex|vgg         also LPIPS (lpips 0.1.4) of the reconstructions, with\n"
         "  --lpips-weights FILE         lpips' linear layers (weights/v0.1/NET.pth as safetensors) and\n"
         "  --lpips-backbone FILE        torchvision's alexnet / vgg16 weights (if not in --lpips-weights)\n"
         "\n"
         "jepa: linear and kNN probes of the frozen encoder, beside the baselines (initialisation, pixels);\n"
         "written to RUN/eval/. Defaults are the run's own probe settings.\n"
         "  --train-items N, --test-items N (0 = all), --knn-k K, --knn-prep, --knn-vote, --knn-temperature T\n"
         "  --probe-epochs N, --probe-lr LR, --pool mean|tokens|gridK, --seed 0, --no-baselines\n"
         "\n"
         "lm, sft, dpo, grpo (a language-model run): greedy completions of prompts scored by rewards\n"
         "  --prompts FILE (required)    {\"prompt\", \"answer\", ...} lines\n"
         "  --reward exact, --format REGEX, --max-new-tokens 32, --count 0 (0 = all), --samples 5 (printed)\n"
         "\n"
         "every kind:\n"
         "  --weights ema|live|reference (reference: dpo and grpo runs), --step N (default: the latest)\n"
         "  --threads N, --device cpu|cuda|auto\n";
}

const char* models_usage() {
  return "usage: dew models\n"
         "Every registered denoiser and language model with its fields and defaults (`dew list` for every registry).\n";
}

const char* list_usage() {
  return "usage: dew list [KIND]\n"
         "Every registry of the library with its entries, fields and defaults; KIND (e.g. models, solvers,\n"
         "schedules, datasets, tokenizers, encoders) lists one.\n";
}

}  // namespace dew::cli

// diffusers text-to-image pipeline folders (docs/stable_diffusion.md): a folder as
// diffusers' save_pretrained writes it — model_index.json naming the components, unet/, vae/,
// text_encoder/ (+ text_encoder_2/ for SDXL), tokenizer/ (+ tokenizer_2/), scheduler/ — run the way
// StableDiffusionPipeline / StableDiffusionXLPipeline run it.
//
//   auto pipe = dew::interop::TextToImagePipeline::load("stable-diffusion-v1-5");
//   dew::interop::PipelineRequest r;  r.prompt = "a photo of a cat";  r.steps = 30;
//   auto out = pipe.run(r);                          // out.images: [N, 3, H, W] float32 in [0, 1]
//
// The loop: latents = N(0, I) * init_noise_sigma; per step, the doubled batch [negative, positive] goes
// through scheduler.scale_model_input and the UNet, u + s (c - u) combines the halves, scheduler.step
// advances; the VAE decodes latents / scaling_factor and images are x / 2 + 0.5 clamped to [0, 1].
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "dew/interop/diffusers_forward.h"
#include "dew/nn/clip_text.h"
#include "dew/sampling/schedulers.h"

namespace dew::interop {

/// What to draw.
struct PipelineRequest {
  std::string prompt;
  std::string negative_prompt;          // "" = the empty prompt (SDXL: zeros, force_zeros_for_empty_prompt)
  std::optional<std::string> prompt_2;  // SDXL's and SD3's second CLIP encoder, Flux's T5 (default: prompt)
  std::optional<std::string> negative_prompt_2;
  std::optional<std::string> prompt_3;  // SD3's T5 encoder (default: prompt)
  std::optional<std::string> negative_prompt_3;
  int64_t steps = 30;
  double guidance = 7.5;  // <= 1: no classifier-free guidance (one pass per step)
  double eta = 0.0;       // DDIM only
  uint64_t seed = 0;
  int64_t height = 0, width = 0;  // 0 = the UNet's sample_size x the VAE's scale factor
  int64_t count = 1;
  /// Initial latents [count, C, h, w] before the init_noise_sigma scaling (diffusers' `latents`
  /// argument); undefined = N(0, I) from the generator of (seed, "pipeline/latents").
  at::Tensor latents;
};

/// The prompt embeddings a request turns into ([negative; positive] rows are built from these).
struct PromptEmbeddings {
  at::Tensor positive, negative;                // [count, 77, D]
  at::Tensor pooled_positive, pooled_negative;  // SDXL: [count, P]; undefined otherwise
};

struct PipelineResult {
  at::Tensor latents;  // the final latents [count, C, h, w]
  at::Tensor images;   // [count, 3, H, W] float32 in [0, 1]
};

class TextToImagePipeline {
 public:
  /// Loads and checks every component first: a missing folder or file, an unknown class in
  /// model_index.json or a component that does not fit the others (the UNet's context width against the
  /// text encoders', its channels against the VAE's) is a dew::Error naming the file and what was expected.
  /// `weights_dtype` bfloat16 / float16: every component built with its matrix weights in that dtype and loaded
  /// into them (nn::build_weights_in: no float32 copy of a component at any time; what hold_weights_in(dtype)
  /// gives after a float32 load, bit for bit), and run under nn::InferenceAutocast(dtype). add_lora then refuses.
  static TextToImagePipeline load(const std::string& dir, at::ScalarType weights_dtype = at::kFloat);

  /// "StableDiffusionPipeline" or "StableDiffusionXLPipeline".
  const std::string& class_name() const { return class_name_; }
  bool sdxl() const { return class_name_ == "StableDiffusionXLPipeline"; }
  /// The default output size (the UNet's sample_size times the VAE's scale factor), height = width.
  int64_t default_size() const { return default_size_; }
  int64_t vae_scale_factor() const { return vae_scale_factor_; }
  sampling::Scheduler& scheduler() { return *scheduler_; }
  /// Replaces the folder's scheduler (diffusers' `pipe.scheduler = X.from_config(pipe.scheduler.config)`).
  void set_scheduler(sampling::SchedulerPtr scheduler);
  /// The folder's scheduler_config.json (to build another scheduler class from it).
  const json& scheduler_config() const { return scheduler_config_; }

  /// Token ids [N, 77] of `texts` under the first (index 0) or second tokenizer.
  at::Tensor tokenize(const std::vector<std::string>& texts, int index = 0) const;
  /// The prompt embeddings of a request (validated by check()).
  PromptEmbeddings encode(const PipelineRequest& request);
  /// Refuses a bad request before any work (steps < 1, count < 1, sizes not multiples of the VAE's
  /// factor, latents of the wrong shape).
  void check(const PipelineRequest& request) const;
  /// `--weights-dtype`: every component's matrix weights held in `dtype` (nn::hold_weights_in); encode and
  /// run then compute under nn::InferenceAutocast(dtype). Returns the bytes the components' parameters hold.
  int64_t hold_weights_in(at::ScalarType dtype);
  /// `dew sample --pipeline DIR --lora FILE[:SCALE]`: a LoRA file of the UNet and / or the text encoders
  /// (diffusers' pytorch_lora_weights.safetensors layout, "unet." / "text_encoder." / "text_encoder_2." keys, or
  /// kohya's "lora_unet_" / "lora_te_" (SDXL: "lora_te1_", "lora_te2_") keys; nn::load_lora_file) merged into
  /// each component's weights with each adapter's scale times `scale` (nn::fold_lora), so several files add
  /// up, one after another. Before hold_weights_in. Returns the number of adapted layers.
  int64_t add_lora(const std::string& path, double scale);
  /// Runs the request with the embeddings of encode().
  PipelineResult run(const PipelineRequest& request);
  /// The same with given embeddings (the golden tests feed the reference's own).
  PipelineResult run(const PipelineRequest& request, const PromptEmbeddings& embeddings);

 private:
  std::string dir_, class_name_;
  DiffusersModel unet_, vae_;
  nn::ClipText text_encoder_{nullptr}, text_encoder_2_{nullptr};
  at::ScalarType weights_dtype_ = at::kFloat;
  sampling::SchedulerPtr scheduler_;
  json scheduler_config_;
  int64_t default_size_ = 512, vae_scale_factor_ = 8;
  bool force_zeros_for_empty_prompt_ = true;
};

}  // namespace dew::interop

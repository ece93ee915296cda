// diffusers flow-matching pipeline folders (docs/sd3_flux.md): StableDiffusion3Pipeline and FluxPipeline as
// save_pretrained writes them — model_index.json, transformer/ (SD3Transformer2DModel / FluxTransformer2DModel),
// vae/ (AutoencoderKL, 16 latent channels, shift_factor), the text encoders and tokenizers, scheduler/
// (FlowMatchEulerDiscreteScheduler) — run the way diffusers 0.42.1 runs them.
//
//   auto pipe = dew::interop::FlowPipeline::load("stable-diffusion-3.5-medium");
//   dew::interop::PipelineRequest r;  r.prompt = "a photo of a cat";  r.steps = 28;  r.guidance = 7.0;
//   auto out = pipe.run(r);                          // out.images: [N, 3, H, W] float32 in [0, 1]
//
// SD3: prompt embeddings = [CLIP-L and CLIP-G hidden_states[-2] side by side, zero-padded to T5's width ;
// T5's last_hidden_state (max_sequence_length tokens; zeros when text_encoder_3 is null)] on the sequence,
// pooled = [CLIP-L text_embeds, CLIP-G text_embeds]; classifier-free guidance on [negative; positive] when
// guidance > 1 (the negative prompt "" unless given). Flux: T5's states and CLIP's pooler_output, no CFG, FLUX.1
// dev's guidance embedding takes `guidance`; the scheduler gets FluxPipeline's sigmas linspace(1, 1/n, n) and mu
// of the packed image sequence length. Both: latents x = N(0, I) (no init sigma), per step
// x += (sigma_{i+1} - sigma_i) v(x, sigma_i x 1000), and the VAE decodes x / scaling_factor + shift_factor.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>

#include "dew/interop/diffusers_forward.h"
#include "dew/interop/diffusers_pipeline.h"
#include "dew/interop/hf_decoder.h"
#include "dew/nn/clip_text.h"
#include "dew/nn/t5_encoder.h"
#include "dew/sampling/schedulers.h"

namespace dew::interop {

/// True when DIR/model_index.json names StableDiffusion3Pipeline or FluxPipeline (false for anything else,
/// including a missing or unreadable file: TextToImagePipeline::load then reports it).
bool is_flow_pipeline_folder(const std::string& dir);

class FlowPipeline {
 public:
  /// Loads and checks every component first: a missing folder or file, an unknown class in model_index.json
  /// (the scheduler included), a T5 tokenizer folder without a SentencePiece model, or components that do not
  /// fit each other (text widths against the transformer's, channels against the VAE's) is a dew::Error naming
  /// the file and what was expected.
  /// `weights_dtype`: as TextToImagePipeline::load's.
  static FlowPipeline load(const std::string& dir, at::ScalarType weights_dtype = at::kFloat);

  /// "StableDiffusion3Pipeline" or "FluxPipeline".
  const std::string& class_name() const { return class_name_; }
  bool flux() const { return class_name_ == "FluxPipeline"; }
  /// The pipelines' defaults: output side (transformer sample_size (SD3) or 128 (Flux) x the VAE's factor),
  /// guidance (SD3 7.0, Flux 3.5), T5 tokens (SD3 256, Flux 512).
  int64_t default_size() const { return default_size_; }
  double default_guidance() const { return flux() ? 3.5 : 7.0; }
  int64_t default_max_sequence_length() const { return flux() ? 512 : 256; }
  /// Whether the transformer takes a guidance embedding (FLUX.1 dev).
  bool guidance_embeds() const { return guidance_embeds_; }
  int64_t vae_scale_factor() const { return vae_scale_factor_; }
  sampling::FlowMatchEulerScheduler& scheduler() { return *scheduler_; }

  /// Token ids of `texts`: index 0, 1 = the CLIP tokenizers (Flux: only 0), the T5 tokenizer is index 2 (SD3)
  /// or 1 (Flux), padded / truncated to max_sequence_length.
  at::Tensor tokenize(const std::vector<std::string>& texts, int index, int64_t max_sequence_length) const;
  /// The prompt embeddings of a request: positive / negative [count, L, D] and pooled [count, P] (Flux: no
  /// negative).
  PromptEmbeddings encode(const PipelineRequest& request, int64_t max_sequence_length);
  /// Refuses a bad request before any work: steps < 1, count < 1, a size that is not a multiple of the VAE's
  /// factor x the patch size (Flux: x 2, its packing), latents of the wrong shape (Flux: packed
  /// [count, (h/2)(w/2), 4 C] as FluxPipeline draws them, or unpacked [count, C, h, w]).
  void check(const PipelineRequest& request) const;
  /// `--weights-dtype`: every component's matrix weights held in `dtype` (nn::hold_weights_in); encode and
  /// run then compute under nn::InferenceAutocast(dtype). Returns the bytes the components' parameters hold.
  int64_t hold_weights_in(at::ScalarType dtype);
  /// `dew sample --pipeline DIR --lora FILE[:SCALE]`: a LoRA file of the transformer in diffusers'
  /// pytorch_lora_weights.safetensors layout ("transformer." keys, what SD3's and Flux's save_lora_weights write,
  /// module names as diffusers'), merged into its weights with each adapter's scale times `scale`; before
  /// hold_weights_in. Returns the number of layers adapted.
  int64_t add_lora(const std::string& path, double scale);
  PipelineResult run(const PipelineRequest& request, int64_t max_sequence_length);
  /// The same with given embeddings (the golden tests feed the reference's own).
  PipelineResult run(const PipelineRequest& request, const PromptEmbeddings& embeddings);

 private:
  std::pair<int64_t, int64_t> size_of(const PipelineRequest& r) const;  // image height, width
  std::string dir_, class_name_;
  DiffusersModel transformer_, vae_;
  nn::ClipText clip_{nullptr}, clip_2_{nullptr};
  nn::T5Encoder t5_{nullptr};
  at::ScalarType weights_dtype_ = at::kFloat;
  std::unique_ptr<sampling::FlowMatchEulerScheduler> scheduler_;
  int64_t default_size_ = 1024, vae_scale_factor_ = 8, patch_ = 2, latent_channels_ = 16, context_features_ = 0;
  bool guidance_embeds_ = false;
};

/// True when DIR/model_index.json names QwenImage21Pipeline (false for anything else or an unreadable file).
bool is_qwen_image_pipeline_folder(const std::string& dir);

/// A diffusers QwenImage21Pipeline folder (docs/backbones/qwen_image_transformer.md#the-pipeline): model_index.json,
/// transformer/ (QwenImage21Transformer2DModel), vae/ (AutoencoderKLQwenImage21), text_encoder/
/// (Qwen3VLForConditionalGeneration), processor/ (Qwen3VLProcessor: its tokenizer.json), scheduler/
/// (FlowMatchEulerDiscreteScheduler) and the index's sample_sigmas, run as diffusers 0.42.1 runs text-to-image:
///
///   auto pipe = dew::interop::QwenImagePipeline::load("Qwen-Image-2.1");
///   dew::interop::PipelineRequest r;  r.prompt = "a cat";  r.negative_prompt = "blurry";  r.guidance = 4.0;
///   auto out = pipe.run(r);                     // out.images: [N, 4, H, W] float32 in [0, 1] (RGBA)
///
/// The prompt goes through the Qwen3-VL text path (QwenImageTextEncoder: the pipeline's template, the system
/// tokens dropped, right-padded states and mask). Latents x = N(0, I) [count, C, H / 16, W / 16] (one token per
/// latent position); sigmas = the index's sample_sigmas, else linspace(1, 1/n, n), through the scheduler with mu of
/// the image's token count (calculate_shift); per step v = transformer(x, float32(t / 1000) x 1000, text), true
/// classifier-free guidance v = v_neg + guidance (v - v_neg) with the negative prompt's own states when guidance > 1,
/// x += (sigma_{i+1} - sigma_i) v. Under causal_condition the text's keys and values do not change with t: the first
/// step fills a prefix KV cache per prompt (positive, negative) and later steps recompute only the image tokens,
/// as the pipeline's use_kv_cache. The VAE decodes latents x latents_std + latents_mean, clamped; images are
/// x / 2 + 0.5. Condition images (the edit pipeline's `image`) are not taken.
class QwenImagePipeline {
 public:
  /// Loads and checks every component first: a missing folder or file, another class in model_index.json, a
  /// processor without tokenizer.json, or components that do not fit (the transformer's context_in_dim against
  /// the text model's width, its channels against the VAE's z_dim) is a dew::Error naming the file.
  /// `weights_dtype`: as TextToImagePipeline::load's.
  static QwenImagePipeline load(const std::string& dir, at::ScalarType weights_dtype = at::kFloat);

  /// The pipeline's output_resolution (1024): the default height and width.
  int64_t default_size() const { return 1024; }
  /// One latent per 16 x 16 pixels (the VAE's 16x, latents unpatched); sizes are multiples of 32 as the pipeline's.
  int64_t vae_scale_factor() const { return vae_scale_factor_; }
  /// The index's sample_sigmas (empty when null): the grid run() uses unless the request gives `sigmas`.
  const std::vector<double>& sample_sigmas() const { return sample_sigmas_; }
  bool causal_condition() const { return causal_condition_; }
  /// The pipeline's grid without sample_sigmas: numpy's linspace(1, 1/steps, steps).
  static std::vector<double> linspace_sigmas(int64_t steps);
  sampling::FlowMatchEulerScheduler& scheduler() { return *scheduler_; }

  /// Text states of a batch of prompts: states [B, L, D] float32 right-padded with zeros, mask [B, L] int64.
  QwenImageTextEncoder::States encode_prompts(const std::vector<std::string>& prompts);
  /// The request's prompt (and, when guidance > 1, its negative prompt) encoded, each repeated `count` times.
  struct Prompts {
    QwenImageTextEncoder::States positive, negative;  // negative: undefined without guidance
  };
  Prompts encode(const PipelineRequest& request);
  /// Refuses a bad request before any work: an edit prompt (QwenImageTextEncoder::check_prompt; the negative prompt
  /// is prompt 1), steps < 1, count < 1, a non-finite guidance, sizes
  /// that are not positive multiples of 32, a prompt_2 / prompt_3 (one text encoder),
  /// latents of another shape than [count, C, h, w] or packed [count, h w, C].
  void check(const PipelineRequest& request) const;
  /// `--weights-dtype`: the transformer's, the VAE's and the text model's matrix weights held in `dtype`; encode
  /// and run then compute under nn::InferenceAutocast(dtype). Returns the bytes the components' parameters hold.
  int64_t hold_weights_in(at::ScalarType dtype);
  /// `dew sample --pipeline DIR --lora FILE[:SCALE]`: a LoRA file of the transformer in diffusers'
  /// pytorch_lora_weights.safetensors layout ("transformer." keys, what QwenImage21Pipeline.save_lora_weights
  /// writes and its load_lora_weights reads), merged into its weights with each adapter's scale times `scale`;
  /// before hold_weights_in. Returns the number of layers adapted.
  int64_t add_lora(const std::string& path, double scale);
  /// `sigmas`: the grid to run (QwenImage21Pipeline's `sigmas` argument; empty = sample_sigmas or the linspace of
  /// request.steps). `use_kv_cache` false recomputes the text every step (the same output).
  PipelineResult run(const PipelineRequest& request, const std::vector<double>& sigmas = {}, bool use_kv_cache = true);
  /// The same with given prompt states (the golden tests feed the reference's own). latents in the result are
  /// packed [count, h w, C], as the pipeline holds them.
  PipelineResult run(const PipelineRequest& request, const Prompts& prompts, const std::vector<double>& sigmas = {},
                     bool use_kv_cache = true);

 private:
  std::pair<int64_t, int64_t> size_of(const PipelineRequest& r) const;  // image height, width
  std::string dir_;
  DiffusersModel transformer_, vae_;
  std::unique_ptr<QwenImageTextEncoder> text_;
  at::ScalarType weights_dtype_ = at::kFloat;
  std::unique_ptr<sampling::FlowMatchEulerScheduler> scheduler_;
  std::vector<double> sample_sigmas_;
  int64_t vae_scale_factor_ = 16, latent_channels_ = 64;
  bool causal_condition_ = true;
};

}  // namespace dew::interop

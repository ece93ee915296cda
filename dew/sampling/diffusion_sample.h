// The diffusion sampling driver (docs/sampling.md): a backbone, a process and what to sample (labels, prompts
// or neither) -> images or videos. Validation previews, `dew sample` and `dew eval` all sample through
// sample_diffusion. (Language-model decoding is sampling/generate.h.)
//
//   dew::DiffusionSampleOptions o;  o.shape = {1, 28, 28};  o.count = 10;  o.labels = at::arange(10);
//   at::Tensor images = dew::sample_diffusion(*model, process, o);   // [10, 1, 28, 28] in [-1, 1]
#pragma once
#include "dew/diffusion/process.h"
#include "dew/nn/backbones/backbone.h"
#include "dew/nn/text_encoder.h"
#include "dew/sampling/guidance.h"

namespace dew {

/// Text conditioning of a diffusion run: the encoder and how class labels become captions. The empty
/// caption "" is the unconditional datum (label dropout during training, the guidance's second branch).
struct TextConditioner {
  TextEncoderPtr encoder;
  std::vector<std::string> class_names;  // label id -> name
  std::string caption_template = "a photo of {}";
  /// "a photo of an ankle boot" for "Ankle boot": lower-case name with "a"/"an" put in the template's {}.
  std::string caption(int64_t label) const;
  /// Captions of labels [B] (a label equal to class_names.size() is the null class: "").
  std::vector<std::string> captions(const at::Tensor& labels) const;
};

/// The text encoder of a text-conditioned run lives in the backbone's module tree under "text_encoder"
/// (so one checkpoint, one optimizer and one EMA cover both); this registers it there.
void attach_text_encoder(BackboneImpl& model, const TextEncoderPtr& encoder);

/// What to sample: one row per label or prompt (both absent = unconditional rows).
struct DiffusionSampleOptions {
  int64_t count = 16;
  at::Tensor labels;                      // [count] int64, or undefined
  std::vector<std::string> prompts;       // text runs: count captions (empty: captions of `labels`)
  const TextConditioner* text = nullptr;  // text runs: the encoder; "" is the guidance's null prompt
  std::vector<int64_t> shape;             // [C, H, W] of one sample
  std::string solver = "ddim";
  json solver_fields = json::object();
  int64_t steps = 50;
  sampling::CFG guidance;  // scale 1 = unguided (no doubled batch)
  uint64_t seed = 0;
  int64_t batch_size = 64;
  bool clamp = true;  // clip the result to [-1, 1] (images); latents are returned as they are
};

/// Checks what sample_diffusion would refuse (counts, the solver's name, fields and schedule, guidance), cheaply.
void validate(const DiffusionSampleOptions& o, const diffusion::DiffusionProcess& process);

/// Samples images (float32 [count, C, H, W]) or videos ([count, C, T, H, W]) in [-1, 1] (or, without
/// `clamp`, latents unclipped) from a backbone with a process's sampling schedule.
at::Tensor sample_diffusion(BackboneImpl& model, const diffusion::DiffusionProcess& process,
                            const DiffusionSampleOptions& o);

/// Writes a sample sheet: a grid PNG for images [N, C, H, W] (nrow per row); for videos [N, C, T, H, W]
/// a strip PNG (one video per row) and, next to it, an animated GIF (same name, .gif) of the grid.
void save_samples(const std::string& png_path, const at::Tensor& samples, int64_t nrow);

}  // namespace dew

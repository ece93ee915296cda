// DiffusionObjective (SPEC section 6): trains a backbone with a preset's process (class labels with a
// null class dropped with probability unconditional_prob), keeps an EMA, and validates by sampling a
// preview grid. `generate` is the one sampling path, shared by validation and `dew sample`.
#pragma once
#include "dew/diffusion/process.h"
#include "dew/nn/backbones/backbone.h"
#include "dew/nn/text_encoder.h"
#include "dew/objectives/objective.h"
#include "dew/sampling/guidance.h"

namespace dew {

struct DiffusionObjectiveOptions {
  double unconditional_prob = 0.12;  // probability of replacing the label with the null class
  double ema_decay = 0.999;
  std::string sampler = "ddim";      // solver of the validation preview
  sampling::CFG guidance{3.0};       // guidance of the validation preview
  int64_t steps = 200;               // sampling steps of the preview
  int64_t preview_per_class = 2;     // preview grid: this many samples of each class (or 16 unconditional)
  std::string image_field = "image";
  std::string label_field = "label";
  std::string caption_template = "a photo of {}";  // text runs: caption of a class ({} = "a"/"an" + name)
  template <class V> void visit(V& v) {
    v("unconditional_prob", unconditional_prob, "probability of training a row without its label");
    v("ema_decay", ema_decay, "EMA decay of the parameters");
    v("sampler", sampler, "solver of the validation preview");
    v("guidance", guidance, "classifier-free guidance of the preview");
    v("steps", steps, "sampling steps of the preview");
    v("preview_per_class", preview_per_class, "preview samples per class");
    v("image_field", image_field, "batch field holding uint8 images");
    v("label_field", label_field, "batch field holding int64 labels (if the model is class-conditional)");
    v("caption_template", caption_template,
      "text runs: a label's caption; {} becomes the class name with its article (\"an ankle boot\")");
  }
};

/// Text conditioning of a diffusion run: the encoder and how class labels become captions. The empty
/// caption "" is the unconditional datum (label dropout during training, the guidance's second branch).
struct TextConditioner {
  TextEncoderPtr encoder;
  std::vector<std::string> class_names;            // label id -> name
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
struct GenerateOptions {
  int64_t count = 16;
  at::Tensor labels;                  // [count] int64, or undefined
  std::vector<std::string> prompts;   // text runs: count captions (empty: captions of `labels`)
  const TextConditioner* text = nullptr;  // text runs: the encoder; "" is the guidance's null prompt
  std::vector<int64_t> shape;         // [C, H, W] of one sample
  std::string solver = "ddim";
  json solver_fields = json::object();
  int64_t steps = 50;
  sampling::CFG guidance;             // scale 1 = unguided (no doubled batch)
  uint64_t seed = 0;
  int64_t batch_size = 64;
};

/// Checks what `generate` would refuse (counts, the solver's name, fields and schedule, guidance), cheaply.
void validate(const GenerateOptions& o, const diffusion::DiffusionProcess& process);

/// Samples images (float32 [count, C, H, W]) or videos ([count, C, T, H, W]) in [-1, 1] from a backbone with
/// a process's sampling schedule.
at::Tensor generate(BackboneImpl& model, const diffusion::DiffusionProcess& process, const GenerateOptions& o);

class DiffusionObjective : public Objective {
 public:
  /// A text encoder (optional) conditions on captions of the labels instead of the labels themselves;
  /// it is attached to the model's tree (attach_text_encoder). class_names: label id -> name.
  DiffusionObjective(BackbonePtr model, diffusion::Preset preset, DiffusionObjectiveOptions options, int64_t num_classes,
                     std::vector<int64_t> sample_shape, TextEncoderPtr text_encoder = nullptr,
                     std::vector<std::string> class_names = {});
  std::string name() const override { return "diffusion"; }
  torch::nn::Module& module() override { return *model_; }
  LossOutput loss(const data::Batch& batch, int64_t step, at::Generator gen) override;
  std::map<std::string, double> validate(int64_t step, const std::string& run_dir) override;
  training::EmaSpec ema() const override { return {o_.ema_decay}; }
  std::vector<std::string> batch_fields() const override;
  const diffusion::DiffusionProcess& process() const { return process_; }
  BackbonePtr model() const { return model_; }

 private:
  BackbonePtr model_;
  diffusion::DiffusionProcess process_;
  DiffusionObjectiveOptions o_;
  int64_t num_classes_;
  std::vector<int64_t> sample_shape_;
  TextConditioner text_;
  at::Tensor caption_ids_, caption_mask_;  // text runs: tokenized caption of each class, last row ""
};

/// Writes a sample sheet: a grid PNG for images [N, C, H, W] (nrow per row); for videos [N, C, T, H, W]
/// a strip PNG (one video per row) and, next to it, an animated GIF (same name, .gif) of the grid.
void save_samples(const std::string& png_path, const at::Tensor& samples, int64_t nrow);

}  // namespace dew

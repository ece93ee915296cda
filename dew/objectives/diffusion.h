// DiffusionObjective (docs/training.md): trains a backbone with a preset's process (class labels with a
// null class dropped with probability unconditional_prob), keeps an EMA, and validates by sampling a
// preview grid with sampling::sample_diffusion, the one sampling path it shares with `dew sample`. With a
// LatentSpace it is latent diffusion: it trains on the frozen autoencoder's scaled latents (a batch's
// "latent" field when the run cached them, else the images encoded as they come) and decodes its previews.
#pragma once
#include "dew/diffusion/process.h"
#include "dew/nn/backbones/backbone.h"
#include "dew/nn/text_encoder.h"
#include "dew/objectives/latent.h"
#include "dew/sampling/diffusion_sample.h"
#include "dew/sampling/guidance.h"
#include "dew/training/objective.h"

namespace dew {

struct DiffusionObjectiveOptions {
  double unconditional_prob = 0.12;
  double ema_decay = 0.999;
  std::string sampler = "ddim";
  sampling::CFG guidance{3.0};
  int64_t steps = 200;
  int64_t preview_per_class = 2;
  std::string image_field = "image";
  std::string label_field = "label";
  std::string caption_template = "a photo of {}";
  template <class V>
  void visit(V& v) {
    v("unconditional_prob", unconditional_prob,
      "probability of training a row with the null class instead of its label");
    v("ema_decay", ema_decay, "EMA decay of the parameters");
    v("sampler", sampler, "solver of the validation preview");
    v("guidance", guidance, "classifier-free guidance of the preview");
    v("steps", steps, "sampling steps of the preview");
    v("preview_per_class", preview_per_class,
      "preview samples per class (16 in all for an unconditional model; 0 = no preview of a conditional one)");
    v("image_field", image_field, "batch field holding uint8 images");
    v("label_field", label_field, "batch field holding int64 labels (if the model is class-conditional)");
    v("caption_template", caption_template,
      "text runs: a label's caption; {} becomes the class name with its article (\"an ankle boot\")");
  }
};

class DiffusionObjective : public Objective {
 public:
  /// A text encoder (optional) conditions on captions of the labels instead of the labels themselves;
  /// it is attached to the model's tree (attach_text_encoder). class_names: label id -> name. A latent
  /// space (optional) makes it latent diffusion; sample_shape is then the latent shape [c, h, w].
  DiffusionObjective(BackbonePtr model, diffusion::Preset preset, DiffusionObjectiveOptions options,
                     int64_t num_classes, std::vector<int64_t> sample_shape, TextEncoderPtr text_encoder = nullptr,
                     std::vector<std::string> class_names = {}, LatentSpacePtr latent = nullptr);
  std::string name() const override { return "diffusion"; }
  torch::nn::Module& module() override { return *model_; }
  LossOutput loss(const data::Batch& batch, int64_t step, at::Generator gen) override;
  /// Draws t, the noise and the label drop for the whole batch (as loss() does), then runs the model on
  /// rows [begin, end) only: a rank of a data-parallel run sees the draws a one-process run gives its rows.
  LossOutput loss_of_rows(const data::Batch& batch, int64_t begin, int64_t end, int64_t step,
                          at::Generator gen) override;
  std::map<std::string, double> validate(int64_t step, const std::string& run_dir) override;
  training::EmaSpec ema() const override { return {o_.ema_decay}; }
  std::vector<std::string> batch_fields() const override;
  const diffusion::DiffusionProcess& process() const { return process_; }
  BackbonePtr model() const { return model_; }
  /// The frozen autoencoder of a latent run (null in pixel space).
  const LatentSpacePtr& latent() const { return latent_; }
  /// The batch field of cached latents (float32 [B, c, h, w]).
  static constexpr const char* kLatentField = "latent";

 private:
  // loss() of rows [begin, end) of the batch (end < 0: every row); the draws are those of the whole batch.
  LossOutput loss_rows(const data::Batch& batch, int64_t begin, int64_t end, at::Generator gen);
  // The encoding of the captions of `labels` [B] on `device`. A frozen encoder (no parameter that trains, e.g.
  // text_encoder.trainable false or a LoRA run) is a fixed function of the caption: every caption is encoded
  // once, in eval mode, and batches index the cached rows.
  TextEncoding caption_encoding(const at::Tensor& labels, const c10::Device& device);

  BackbonePtr model_;
  diffusion::DiffusionProcess process_;
  DiffusionObjectiveOptions o_;
  int64_t num_classes_;
  std::vector<int64_t> sample_shape_;
  TextConditioner text_;
  at::Tensor caption_ids_, caption_mask_;  // text runs: tokenized caption of each class, last row ""
  TextEncoding caption_cache_;             // a frozen encoder's encoding of those rows (caption_encoding)
  LatentSpacePtr latent_;
};

}  // namespace dew

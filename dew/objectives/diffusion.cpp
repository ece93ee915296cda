#include "dew/objectives/diffusion.h"

#include <cctype>
#include <filesystem>
#include <tuple>

#include "dew/core/device.h"
#include "dew/io/image.h"
#include "dew/io/video.h"
#include "dew/sampling/sample.h"
#include "dew/training/run_dir.h"

namespace dew {

DiffusionObjective::DiffusionObjective(BackbonePtr model, diffusion::Preset preset, DiffusionObjectiveOptions options,
                                       int64_t num_classes, std::vector<int64_t> sample_shape,
                                       TextEncoderPtr text_encoder, std::vector<std::string> class_names,
                                       LatentSpacePtr latent)
    : model_(std::move(model)),
      process_(std::move(preset)),
      o_(std::move(options)),
      num_classes_(num_classes),
      sample_shape_(std::move(sample_shape)),
      latent_(std::move(latent)) {
  if (text_encoder) {
    DEW_CHECK(num_classes_ > 0 && int64_t(class_names.size()) == num_classes_,
              "diffusion objective: text conditioning captions the labels, so the data needs class names (got ",
              class_names.size(), " names for ", num_classes_, " classes)");
    text_.encoder = text_encoder;
    text_.class_names = std::move(class_names);
    text_.caption_template = o_.caption_template;
    // Every class's caption, tokenized once; the last row is the null caption "".
    std::tie(caption_ids_, caption_mask_) = text_encoder->tokenize(text_.captions(at::arange(num_classes_ + 1)));
    if (!model_->named_children().contains("text_encoder")) attach_text_encoder(*model_, text_encoder);
  }
  DEW_CHECK(o_.unconditional_prob >= 0 && o_.unconditional_prob <= 1,
            "objective.unconditional_prob: must be in [0, 1], got ", o_.unconditional_prob);
  DEW_CHECK(o_.steps >= 1, "objective.steps: must be >= 1, got ", o_.steps);
  DEW_CHECK(o_.preview_per_class >= 0, "objective.preview_per_class: must be >= 0 (0 = no preview), got ",
            o_.preview_per_class);
  sampling::make_solver(o_.sampler);  // fail early on an unknown sampler
  sampling::validate(o_.guidance);
}

std::vector<std::string> DiffusionObjective::batch_fields() const {
  const std::string x = latent_ && latent_->options().cache ? kLatentField : o_.image_field;
  if (num_classes_ > 0) return {x, o_.label_field};
  return {x};
}

LossOutput DiffusionObjective::loss(const data::Batch& batch, int64_t step, at::Generator gen) {
  return loss_rows(batch, 0, -1, gen);
}

LossOutput DiffusionObjective::loss_of_rows(const data::Batch& batch, int64_t begin, int64_t end, int64_t step,
                                            at::Generator gen) {
  return loss_rows(batch, begin, end, gen);
}

TextEncoding DiffusionObjective::caption_encoding(const at::Tensor& labels, const c10::Device& device) {
  bool frozen = true;
  for (const auto& p : text_.encoder->parameters()) frozen = frozen && !p.requires_grad();
  if (!frozen) {
    caption_cache_ = {};
    return text_.encoder->forward(caption_ids_.index_select(0, labels).to(device),
                                  caption_mask_.index_select(0, labels).to(device));
  }
  // As diffusers' training scripts precompute a frozen encoder's prompt embeddings: the num_classes + 1
  // captions are encoded once (no dropout; no graph, nothing trains there), then each batch indexes them.
  if (!caption_cache_.context.defined() || caption_cache_.context.device() != device) {
    at::NoGradGuard no_grad;
    const bool was_training = text_.encoder->is_training();
    text_.encoder->eval();
    caption_cache_ = text_.encoder->forward(caption_ids_.to(device), caption_mask_.to(device));
    text_.encoder->train(was_training);
  }
  const at::Tensor rows = labels.to(device);
  TextEncoding e;
  e.context = caption_cache_.context.index_select(0, rows);
  if (caption_cache_.mask.defined()) e.mask = caption_cache_.mask.index_select(0, rows);
  if (caption_cache_.pooled.defined()) e.pooled = caption_cache_.pooled.index_select(0, rows);
  return e;
}

LossOutput DiffusionObjective::loss_rows(const data::Batch& batch, int64_t begin, int64_t end, at::Generator gen) {
  const auto device = module_device(*model_);
  at::Tensor x0;
  if (auto cached = batch.find(kLatentField); latent_ && cached != batch.end()) {
    x0 = cached->second.to(device);  // latents the run encoded once
  } else {
    auto it = batch.find(o_.image_field);
    DEW_CHECK(it != batch.end(), "diffusion objective: batch has no field \"", o_.image_field, "\"");
    // A posterior sample draws from the step's generator before the noise does.
    x0 = latent_ ? latent_->encode(it->second, gen).to(device) : data::to_model_range(it->second).to(device);
  }
  auto in = process_.training_inputs(x0, gen);
  Conditioning c;
  if (num_classes_ > 0) {
    auto lt = batch.find(o_.label_field);
    DEW_CHECK(lt != batch.end(), "diffusion objective: class-conditional model but the batch has no field \"",
              o_.label_field, "\"");
    auto drop = at::rand({x0.size(0)}, gen) < o_.unconditional_prob;
    auto labels = at::where(drop, at::full_like(lt->second, num_classes_), lt->second);
    if (text_.encoder) {
      // The dropped rows get the empty caption, the unconditional datum of guidance.
      const TextEncoding enc = caption_encoding(labels, device);
      c.context = enc.context;
      c.context_mask = enc.mask;
      if (model_->takes_pooled()) c.pooled = enc.pooled;
    } else {
      c.labels = labels.to(device);
    }
  }
  if (end >= 0) {
    // A rank's rows: every draw above was of the whole batch, in the one-process order.
    auto rows = [&](at::Tensor& x) {
      if (x.defined() && x.dim() > 0) x = x.narrow(0, begin, end - begin);
    };
    for (auto* x : {&in.t, &in.eps, &in.x_t, &in.net_input, &in.model_time, &in.target, &in.weight}) rows(*x);
    for (auto* x : {&c.labels, &c.context, &c.context_mask, &c.pooled}) rows(*x);
  }
  auto F = model_->forward(in.net_input, in.model_time, c);
  auto loss = process_.loss(F, in);
  return {loss, {}};
}

std::map<std::string, double> DiffusionObjective::validate(int64_t step, const std::string& run_dir) {
  DiffusionSampleOptions g;
  g.shape = sample_shape_;
  g.solver = o_.sampler;
  g.steps = o_.steps;
  g.guidance = o_.guidance;
  g.seed = 1234;       // the same prior every validation, so previews are comparable across steps
  g.clamp = !latent_;  // latents are decoded as they are
  if (text_.encoder) g.text = &text_;
  int64_t nrow = 8;
  if (num_classes_ > 0 && o_.preview_per_class == 0) return {};  // no preview asked for
  if (num_classes_ > 0) {
    // every grid row holds one sample of each class, in class order
    g.count = num_classes_ * o_.preview_per_class;
    g.labels = at::arange(num_classes_).repeat({o_.preview_per_class});
    nrow = num_classes_;
  } else {
    g.count = 16;
  }
  auto images = sample_diffusion(*model_, process_, g);
  if (latent_) images = latent_->decode(images);
  namespace fs = std::filesystem;
  fs::create_directories(training::RunDir(run_dir).samples());
  save_samples(training::RunDir(run_dir).sample(step, ".png"), images, nrow);
  return {{"val/sample_std", images.std().item<double>()}, {"val/samples", double(images.size(0))}};
}

}  // namespace dew

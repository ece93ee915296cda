#include "dew/sampling/diffusion_sample.h"

#include <cctype>

#include "dew/core/device.h"
#include "dew/io/image.h"
#include "dew/io/video.h"
#include "dew/sampling/sample.h"
#include "dew/sampling/solvers.h"

namespace dew {

std::string TextConditioner::caption(int64_t label) const {
  DEW_CHECK(label >= 0 && label <= int64_t(class_names.size()), "caption: label ", label, " is not in [0, ",
            class_names.size(), "]");
  if (label == int64_t(class_names.size())) return "";
  std::string name = class_names[size_t(label)];
  for (auto& ch : name) ch = char(std::tolower(static_cast<unsigned char>(ch)));
  const bool vowel = !name.empty() && std::string("aeiou").find(name[0]) != std::string::npos;
  const std::string phrase = std::string(vowel ? "an " : "a ") + name;
  const auto at = caption_template.find("{}");
  if (at == std::string::npos) return caption_template + " " + phrase;
  return caption_template.substr(0, at) + phrase + caption_template.substr(at + 2);
}

std::vector<std::string> TextConditioner::captions(const at::Tensor& labels) const {
  auto l = labels.to(at::kCPU).to(at::kLong).contiguous();
  std::vector<std::string> out;
  for (int64_t i = 0; i < l.numel(); ++i) out.push_back(caption(l.data_ptr<int64_t>()[i]));
  return out;
}

void attach_text_encoder(BackboneImpl& model, const TextEncoderPtr& encoder) {
  DEW_CHECK(encoder, "attach_text_encoder: no encoder");
  model.register_module("text_encoder", encoder);
}

void validate(const DiffusionSampleOptions& o, const diffusion::DiffusionProcess& process) {
  DEW_CHECK(o.count >= 1, "count: must be >= 1, got ", o.count);
  DEW_CHECK(o.steps >= 1, "steps: must be >= 1, got ", o.steps);
  DEW_CHECK(o.batch_size >= 1, "batch: must be >= 1, got ", o.batch_size);
  sampling::make_solver(o.solver, o.solver_fields)->check(process.sample_schedule());
  sampling::validate(o.guidance);
}

at::Tensor sample_diffusion(BackboneImpl& model, const diffusion::DiffusionProcess& process,
                            const DiffusionSampleOptions& o) {
  validate(o, process);
  DEW_CHECK(o.shape.size() >= 3, "sample shape: expected [C, H, W], got ", o.shape.size(), " dims");
  DEW_CHECK(!o.labels.defined() || o.labels.numel() == o.count, "labels: expected ", o.count, " labels, got ",
            o.labels.numel());
  std::vector<std::string> prompts = o.prompts;
  if (o.text) {
    DEW_CHECK(o.text->encoder, "sample_diffusion: text conditioning without an encoder");
    if (prompts.empty() && o.labels.defined()) prompts = o.text->captions(o.labels);
    DEW_CHECK(prompts.empty() || int64_t(prompts.size()) == o.count, "prompts: expected ", o.count, " prompts, got ",
              prompts.size());
  } else {
    DEW_CHECK(prompts.empty(), "prompts: this run has no text encoder");
  }
  sampling::validate(o.guidance);
  torch::NoGradGuard ng;
  const bool was_training = model.is_training();
  model.eval();
  const auto device = module_device(model);
  const int64_t num_classes = model.config().value("fields", json::object()).value("num_classes", int64_t(0));
  const bool text = !prompts.empty();
  const bool guided = o.guidance.scale != 1.0 && (o.labels.defined() || text);
  auto solver = sampling::make_solver(o.solver, o.solver_fields);
  std::vector<at::Tensor> outs;
  for (int64_t b0 = 0; b0 < o.count; b0 += o.batch_size) {
    const int64_t n = std::min(o.batch_size, o.count - b0);
    at::Tensor labels = o.labels.defined() && !text ? o.labels.slice(0, b0, b0 + n).to(device) : at::Tensor();
    TextEncoding enc;  // rows [0, n): the prompts; rows [n, 2n): "" for the guidance's unconditional branch
    if (text) {
      std::vector<std::string> chunk(prompts.begin() + b0, prompts.begin() + b0 + n);
      if (guided) chunk.resize(size_t(2 * n), "");
      enc = o.text->encoder->encode(chunk);
    }
    diffusion::Model net = [&](const at::Tensor& x, const at::Tensor& t) {
      Conditioning c;
      if (labels.defined()) {
        c.labels = x.size(0) == n ? labels : at::cat({labels, at::full_like(labels, num_classes)});
      }
      if (text) {
        c.context = enc.context.slice(0, 0, x.size(0));
        c.context_mask = enc.mask.slice(0, 0, x.size(0));
        if (model.takes_pooled()) c.pooled = enc.pooled.slice(0, 0, x.size(0));
      }
      return model.forward(x, t, c);
    };
    auto raw = process.raw(net);
    if (guided) raw = sampling::guided(raw, o.guidance, process.sample_schedule().t_max());
    auto den = process.denoiser(raw);
    std::vector<int64_t> shape = {n};
    shape.insert(shape.end(), o.shape.begin(), o.shape.end());
    // Each chunk draws its prior and step noise from (seed + first row index).
    auto xT = process.prior(shape, o.seed + uint64_t(b0), at::TensorOptions().device(device));
    auto x = sampling::sample(den, process.sample_schedule(), xT, o.steps, *solver,
                              sampling::seeded_noise(o.seed + uint64_t(b0)));
    outs.push_back((o.clamp ? x.clamp(-1, 1) : x).to(at::kCPU));
  }
  if (was_training) model.train();
  return at::cat(outs);
}

void save_samples(const std::string& png_path, const at::Tensor& samples, int64_t nrow) {
  if (samples.dim() == 5) {
    io::save_video_strip(png_path, samples);
    const auto dot = png_path.rfind(".png");
    io::save_gif((dot == std::string::npos ? png_path : png_path.substr(0, dot)) + ".gif", samples, nrow);
  } else {
    io::save_png(png_path, io::make_grid(samples, nrow, 2));
  }
}

}  // namespace dew

#include "dew/objectives/diffusion.h"

#include <filesystem>

#include "dew/io/image.h"
#include "dew/sampling/sample.h"

namespace dew {

at::Tensor generate(BackboneImpl& model, const diffusion::DiffusionProcess& process, const GenerateOptions& o) {
  DEW_CHECK(o.count >= 1, "count: must be >= 1, got ", o.count);
  DEW_CHECK(o.shape.size() >= 3, "sample shape: expected [C, H, W], got ", o.shape.size(), " dims");
  DEW_CHECK(!o.labels.defined() || o.labels.numel() == o.count, "labels: expected ", o.count, " labels, got ",
            o.labels.numel());
  sampling::validate(o.guidance);
  torch::NoGradGuard ng;
  const bool was_training = model.is_training();
  model.eval();
  auto device = model.parameters().empty() ? at::Device(at::kCPU) : model.parameters().front().device();
  const int64_t num_classes = model.config().value("fields", json::object()).value("num_classes", int64_t(0));
  const bool guided = o.guidance.scale != 1.0 && o.labels.defined();
  auto solver = sampling::make_solver(o.solver, o.solver_fields);
  std::vector<at::Tensor> outs;
  for (int64_t b0 = 0; b0 < o.count; b0 += o.batch_size) {
    const int64_t n = std::min(o.batch_size, o.count - b0);
    at::Tensor labels = o.labels.defined() ? o.labels.slice(0, b0, b0 + n).to(device) : at::Tensor();
    diffusion::Model net = [&](const at::Tensor& x, const at::Tensor& t) {
      Conditioning c;
      if (labels.defined()) {
        c.labels = x.size(0) == n ? labels : at::cat({labels, at::full_like(labels, num_classes)});
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
    outs.push_back(x.clamp(-1, 1).to(at::kCPU));
  }
  if (was_training) model.train();
  return at::cat(outs);
}

DiffusionObjective::DiffusionObjective(BackbonePtr model, diffusion::Preset preset, DiffusionObjectiveOptions options,
                                       int64_t num_classes, std::vector<int64_t> sample_shape)
    : model_(std::move(model)), process_(std::move(preset)), o_(std::move(options)), num_classes_(num_classes),
      sample_shape_(std::move(sample_shape)) {
  DEW_CHECK(o_.unconditional_prob >= 0 && o_.unconditional_prob <= 1,
            "objective.unconditional_prob: must be in [0, 1], got ", o_.unconditional_prob);
  DEW_CHECK(o_.steps >= 1, "objective.steps: must be >= 1, got ", o_.steps);
  sampling::make_solver(o_.sampler);  // fail early on an unknown sampler
  sampling::validate(o_.guidance);
}

std::vector<std::string> DiffusionObjective::batch_fields() const {
  if (num_classes_ > 0) return {o_.image_field, o_.label_field};
  return {o_.image_field};
}

LossOutput DiffusionObjective::loss(const data::Batch& batch, int64_t step, at::Generator gen) {
  auto it = batch.find(o_.image_field);
  DEW_CHECK(it != batch.end(), "diffusion objective: batch has no field \"", o_.image_field, "\"");
  auto device = model_->parameters().front().device();
  auto x0 = data::to_model_range(it->second).to(device);
  auto in = process_.training_inputs(x0, gen);
  Conditioning c;
  if (num_classes_ > 0) {
    auto lt = batch.find(o_.label_field);
    DEW_CHECK(lt != batch.end(), "diffusion objective: class-conditional model but the batch has no field \"",
              o_.label_field, "\"");
    auto drop = at::rand({x0.size(0)}, gen) < o_.unconditional_prob;
    c.labels = at::where(drop, at::full_like(lt->second, num_classes_), lt->second).to(device);
  }
  auto F = model_->forward(in.net_input, in.model_time, c);
  auto loss = process_.loss(F, in);
  return {loss, {}};
}

std::map<std::string, double> DiffusionObjective::validate(int64_t step, const std::string& run_dir) {
  GenerateOptions g;
  g.shape = sample_shape_;
  g.solver = o_.sampler;
  g.steps = o_.steps;
  g.guidance = o_.guidance;
  g.seed = 1234;  // the same prior every validation, so previews are comparable across steps
  int64_t nrow = 8;
  if (num_classes_ > 0) {
    // every grid row holds one sample of each class, in class order
    g.count = num_classes_ * o_.preview_per_class;
    g.labels = at::arange(num_classes_).repeat({o_.preview_per_class});
    nrow = num_classes_;
  } else {
    g.count = 16;
  }
  auto images = generate(*model_, process_, g);
  namespace fs = std::filesystem;
  fs::create_directories(fs::path(run_dir) / "samples");
  io::save_png((fs::path(run_dir) / "samples" / ("step_" + std::to_string(step) + ".png")).string(),
               io::make_grid(images, nrow, 2));
  return {{"val/sample_std", images.std().item<double>()}};
}

}  // namespace dew

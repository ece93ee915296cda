#include "dew/interop/diffusers_pipeline.h"

#include "dew/interop/pipeline_folder.h"
#include "dew/nn/weights_dtype.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>
#include <filesystem>

#include "dew/core/error.h"
#include "dew/core/rng.h"
#include "dew/io/files.h"
#include "dew/io/stops.h"
#include "dew/nn/backbones/autoencoder_kl.h"
#include "dew/nn/backbones/backbone.h"
#include "dew/nn/backbones/unet_2d_condition.h"
#include "dew/nn/lora.h"
#include "dew/nn/roles.h"

namespace fs = std::filesystem;

namespace dew::interop {

using at::Tensor;

namespace detail {

nn::ClipText load_clip_component(const fs::path& folder, const fs::path& tokenizer, bool projection,
                                 at::ScalarType weights_dtype) {
  const json config = read_pipeline_json(folder / "config.json");
  nn::ClipTextOptions o = nn::clip_text_options_from_hf(config);
  DEW_CHECK(!projection || o.projection_dim() > 0, (folder / "config.json").string(),
            ": expected a CLIPTextModelWithProjection (a text_projection, projection_dim > 0)");
  DEW_CHECK(fs::is_directory(tokenizer), tokenizer.string(), ": missing (the CLIP tokenizer folder)");
  o.tokenizer(tokenizer.string());
  // Built first and loaded after, so that reduced-precision weights never pass through a float32 model.
  nn::ClipText encoder = nn::build_weights_in(weights_dtype, [&] { return nn::ClipText(o); });
  nn::load_clip_text_weights(*encoder, folder.string());
  encoder->options.weights(folder.string());
  encoder->eval();
  return encoder;
}

void check_lora_weights_dtype(at::ScalarType weights_dtype, const std::string& path) {
  DEW_CHECK(weights_dtype == at::kFloat, "LoRA: ", path, " must be applied before the weights are held in ",
            c10::toString(weights_dtype), " (load the pipeline in float32, add the LoRA, then hold the weights)");
}

int64_t merge_lora_file(torch::nn::Module& model, at::ScalarType weights_dtype, const std::string& path, double scale,
                        const std::string& component, const std::string& kohya_prefix) {
  check_lora_weights_dtype(weights_dtype, path);
  const auto report = nn::load_lora_file(model, path, scale, component, kohya_prefix);
  nn::fold_lora(model);
  return int64_t(report.targets.size());
}

int64_t merge_lora_parts(const std::vector<LoraPart>& parts, at::ScalarType weights_dtype, const std::string& path,
                         double scale) {
  int64_t layers = 0;
  std::string accepted;
  bool any = false;
  for (const LoraPart& part : parts) {
    accepted += (accepted.empty() ? "" : ", ") + part.diffusers + ". or " + part.kohya + "_";
    if (!nn::lora_file_has(path, part.diffusers, part.kohya)) continue;
    any = true;
    layers += merge_lora_file(*part.module, weights_dtype, path, scale, part.diffusers, part.kohya);
  }
  DEW_CHECK(any, "LoRA: ", path, " holds no key of this pipeline's components; accepted prefixes: ", accepted);
  return layers;
}

}  // namespace detail

using detail::expect_component;
using detail::index_component;
using detail::load_clip_component;
using detail::read_pipeline_json;

TextToImagePipeline TextToImagePipeline::load(const std::string& dir, at::ScalarType weights_dtype) {
  TextToImagePipeline p;
  p.dir_ = dir;
  const json index =
      detail::read_model_index(dir, {"StableDiffusionPipeline", "StableDiffusionXLPipeline"}, p.class_name_);
  const fs::path root(dir), index_file = root / "model_index.json";
  expect_component(index, "unet", {"UNet2DConditionModel"}, index_file);
  expect_component(index, "vae", {"AutoencoderKL"}, index_file);
  expect_component(index, "text_encoder", {"CLIPTextModel"}, index_file);
  expect_component(index, "tokenizer", {"CLIPTokenizer", "CLIPTokenizerFast"}, index_file);
  if (p.sdxl()) {
    expect_component(index, "text_encoder_2", {"CLIPTextModelWithProjection"}, index_file);
    expect_component(index, "tokenizer_2", {"CLIPTokenizer", "CLIPTokenizerFast"}, index_file);
    p.force_zeros_for_empty_prompt_ = index.value("force_zeros_for_empty_prompt", true);
  }
  const std::string scheduler_class = index_component(index, "scheduler", index_file);
  const auto& accepted = sampling::scheduler_classes();
  DEW_CHECK(std::find(accepted.begin(), accepted.end(), scheduler_class) != accepted.end(), index_file.string(),
            ": scheduler \"", scheduler_class, "\" is not supported");
  DEW_CHECK(scheduler_class != "FlowMatchEulerDiscreteScheduler", index_file.string(), ": scheduler \"",
            scheduler_class, "\" is for flow-matching transformers (SD3, Flux), not for a UNet pipeline");

  const fs::path scheduler_file = root / "scheduler" / "scheduler_config.json";
  p.scheduler_ = sampling::Scheduler::from_file(scheduler_file.string());
  p.scheduler_config_ = sampling::read_scheduler_config(scheduler_file.string());
  DiffusersLoadOptions lo;
  lo.weights_dtype = p.weights_dtype_ = weights_dtype;
  p.unet_ = load_diffusers_folder((root / "unet").string(), lo);
  p.vae_ = load_diffusers_folder((root / "vae").string(), lo);
  p.text_encoder_ = load_clip_component(root / "text_encoder", root / "tokenizer", false, weights_dtype);
  if (p.sdxl())
    p.text_encoder_2_ = load_clip_component(root / "text_encoder_2", root / "tokenizer_2", true, weights_dtype);

  // The components must fit each other.
  const auto u = from_json<nn::UNet2DConditionOptions>(p.unet_.fields);
  const auto v = from_json<nn::AutoencoderKLOptions>(p.vae_.fields);
  p.vae_scale_factor_ = int64_t{1} << (v.block_out_channels().size() - 1);
  const json unet_config = read_pipeline_json(root / "unet" / "config.json");
  p.default_size_ = unet_config.value("sample_size", int64_t(64)) * p.vae_scale_factor_;
  DEW_CHECK(u.in_channels() == v.latent_channels() && u.output_channels() == v.latent_channels(), dir,
            ": the unet takes ", u.in_channels(), " and predicts ", u.output_channels(),
            " channels, the vae's latents have ", v.latent_channels(),
            " (an inpainting unet needs an inpainting pipeline)");
  const int64_t text =
      p.text_encoder_->options.hidden_size() + (p.sdxl() ? p.text_encoder_2_->options.hidden_size() : int64_t{0});
  DEW_CHECK(u.context_features() == text, dir, ": the unet's cross_attention_dim is ", u.context_features(),
            " but the text encoder", p.sdxl() ? "s give " : " gives ", text);
  if (p.sdxl()) {
    const int64_t pooled = p.text_encoder_2_->options.projection_dim();
    DEW_CHECK(u.additional_time_features() > 0 &&
                  u.additional_embedding_features() == pooled + 6 * u.additional_time_features(),
              dir, ": the SDXL unet's projection_class_embeddings_input_dim (", u.additional_embedding_features(),
              ") must be text_encoder_2's projection_dim (", pooled, ") + 6 x addition_time_embed_dim (",
              u.additional_time_features(), ")");
  }
  return p;
}

void TextToImagePipeline::set_scheduler(sampling::SchedulerPtr scheduler) {
  DEW_CHECK(scheduler != nullptr, "pipeline: the scheduler is null");
  // A UNet pipeline predicts epsilon / v / x0; the flow-matching scheduler steps on a velocity.
  DEW_CHECK(scheduler->prediction_type() != "flow_prediction", "--scheduler: ", scheduler->class_name(),
            " is for flow-matching transformers (SD3, Flux), not for ", class_name_);
  scheduler_ = std::move(scheduler);
}

Tensor TextToImagePipeline::tokenize(const std::vector<std::string>& texts, int index) const {
  const auto& encoder = index == 0 ? text_encoder_ : text_encoder_2_;
  DEW_CHECK(encoder, "pipeline: there is no tokenizer ", index + 1);
  return encoder->tokenize(texts).first;
}

void TextToImagePipeline::check(const PipelineRequest& r) const {
  DEW_CHECK(r.steps >= 1, "--steps: must be >= 1, got ", r.steps);
  DEW_CHECK(r.count >= 1, "--count: must be >= 1, got ", r.count);
  DEW_CHECK(std::isfinite(r.guidance), "--guidance: must be finite, got ", r.guidance);
  const int64_t h = r.height > 0 ? r.height : default_size_, w = r.width > 0 ? r.width : default_size_;
  DEW_CHECK(r.height >= 0 && r.width >= 0 && h % vae_scale_factor_ == 0 && w % vae_scale_factor_ == 0, "--size: ", h,
            "x", w, " must be positive multiples of the VAE's factor ", vae_scale_factor_);
  DEW_CHECK(r.eta == 0.0 || scheduler_->class_name() == "DDIMScheduler", "--eta: only DDIMScheduler takes eta (",
            scheduler_->class_name(), " does not)");
  if (r.latents.defined()) {
    const auto u = from_json<nn::UNet2DConditionOptions>(unet_.fields);
    const std::vector<int64_t> want{r.count, u.in_channels(), h / vae_scale_factor_, w / vae_scale_factor_};
    DEW_CHECK(r.latents.sizes() == at::IntArrayRef(want), "--latents: expected ", at::IntArrayRef(want), ", got ",
              r.latents.sizes());
  }
}

PromptEmbeddings TextToImagePipeline::encode(const PipelineRequest& r) {
  check(r);
  torch::NoGradGuard no_grad;
  nn::InferenceAutocast autocast(weights_dtype_);
  const std::vector<std::string> pos(size_t(r.count), r.prompt), neg(size_t(r.count), r.negative_prompt);
  PromptEmbeddings e;
  if (!sdxl()) {
    // StableDiffusionPipeline: last_hidden_state, no padding mask.
    auto last = [&](const std::vector<std::string>& texts) {
      return text_encoder_->forward(tokenize(texts, 0), {}).context;
    };
    e.positive = last(pos);
    e.negative = last(neg);
    return e;
  }
  // SDXL: hidden_states[-2] of both encoders side by side; pooled = text_encoder_2's projected eos state.
  auto both = [&](const std::vector<std::string>& t1, const std::vector<std::string>& t2, Tensor& pooled) {
    const Tensor a = text_encoder_->forward_hidden(tokenize(t1, 0), {}, 1).context;
    const auto b = text_encoder_2_->forward_hidden(tokenize(t2, 1), {}, 1);
    pooled = b.pooled;
    return at::cat({a, b.context}, -1);
  };
  e.positive = both(pos, std::vector<std::string>(size_t(r.count), r.prompt_2.value_or(r.prompt)), e.pooled_positive);
  const bool empty_negative = r.negative_prompt.empty() && !r.negative_prompt_2;
  if (empty_negative && force_zeros_for_empty_prompt_) {
    e.negative = at::zeros_like(e.positive);
    e.pooled_negative = at::zeros_like(e.pooled_positive);
  } else {
    e.negative = both(neg, std::vector<std::string>(size_t(r.count), r.negative_prompt_2.value_or(r.negative_prompt)),
                      e.pooled_negative);
  }
  return e;
}

PipelineResult TextToImagePipeline::run(const PipelineRequest& r) { return run(r, encode(r)); }

int64_t TextToImagePipeline::hold_weights_in(at::ScalarType dtype) {
  weights_dtype_ = dtype;
  int64_t bytes = 0;
  bytes += nn::hold_weights_in(*unet_.module, dtype);
  bytes += nn::hold_weights_in(*vae_.module, dtype);
  if (text_encoder_) bytes += nn::hold_weights_in(*text_encoder_, dtype);
  if (text_encoder_2_) bytes += nn::hold_weights_in(*text_encoder_2_, dtype);
  return bytes;
}

int64_t TextToImagePipeline::add_lora(const std::string& path, double scale) {
  detail::check_lora_weights_dtype(weights_dtype_, path);
  // The UNet, and the text encoders kohya trains by default (SD 1.x / 2.x: lora_te_; SDXL: lora_te1_, lora_te2_).
  std::vector<detail::LoraPart> parts = {{unet_.module.get(), "unet", "lora_unet"}};
  if (text_encoder_) parts.push_back({text_encoder_.get(), "text_encoder", sdxl() ? "lora_te1" : "lora_te"});
  if (text_encoder_2_) parts.push_back({text_encoder_2_.get(), "text_encoder_2", "lora_te2"});
  return detail::merge_lora_parts(parts, weights_dtype_, path, scale);
}

PipelineResult TextToImagePipeline::run(const PipelineRequest& r, const PromptEmbeddings& e) {
  check(r);
  torch::NoGradGuard no_grad;
  nn::InferenceAutocast autocast(weights_dtype_);
  const auto u = from_json<nn::UNet2DConditionOptions>(unet_.fields);
  const int64_t h = r.height > 0 ? r.height : default_size_, w = r.width > 0 ? r.width : default_size_;
  const std::vector<int64_t> shape{r.count, u.in_channels(), h / vae_scale_factor_, w / vae_scale_factor_};
  const bool cfg = r.guidance > 1.0;
  auto unet = unet_.backbone();

  scheduler_->set_timesteps(r.steps);
  scheduler_->set_eta(r.eta);
  Tensor x = r.latents.defined() ? r.latents.to(at::kFloat)
                                 : at::randn(shape, rng::generator(r.seed, 0, "pipeline/latents"),
                                             at::TensorOptions().dtype(at::kFloat));
  x = x * scheduler_->init_noise_sigma();

  Conditioning cond;
  cond.context = cfg ? at::cat({e.negative, e.positive}) : e.positive;
  if (sdxl()) {
    const Tensor ids = at::tensor({double(h), double(w), 0.0, 0.0, double(h), double(w)}, at::kFloat);
    cond.pooled = cfg ? at::cat({e.pooled_negative, e.pooled_positive}) : e.pooled_positive;
    cond.extra["time_ids"] = ids.unsqueeze(0).expand({cond.pooled.size(0), 6}).contiguous();
  }
  const auto noise = sampling::seeded_noise(r.seed);
  for (int64_t i = 0; i < scheduler_->num_steps(); ++i) {
    io::check_stop();
    const Tensor in = scheduler_->scale_model_input(cfg ? at::cat({x, x}) : x, i);
    const Tensor t = at::full({in.size(0)}, scheduler_->timestep(i), at::TensorOptions().dtype(at::kFloat));
    Tensor out = unet->forward(in, t, cond);
    if (cfg) {
      const auto halves = out.chunk(2);
      out = halves[0] + r.guidance * (halves[1] - halves[0]);
    }
    x = scheduler_->step(out, i, x, noise);
  }
  PipelineResult res;
  res.latents = x;
  auto vae = vae_.autoencoder();
  const Tensor decoded = vae->decode(vae->from_latent(x));
  res.images = (decoded.to(at::kFloat) / 2 + 0.5).clamp(0, 1);
  return res;
}

}  // namespace dew::interop

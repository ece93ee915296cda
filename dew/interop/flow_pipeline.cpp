#include "dew/interop/flow_pipeline.h"

#include "dew/interop/pipeline_folder.h"
#include "dew/nn/weights_dtype.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "dew/core/error.h"
#include "dew/core/rng.h"
#include "dew/io/files.h"
#include "dew/io/safetensors.h"
#include "dew/io/stops.h"
#include "dew/nn/backbones/autoencoder_kl.h"
#include "dew/nn/backbones/backbone.h"
#include "dew/nn/backbones/flux_transformer.h"
#include "dew/nn/backbones/qwen_image_transformer.h"
#include "dew/nn/backbones/qwen_image_vae.h"
#include "dew/nn/backbones/sd3_transformer.h"

namespace fs = std::filesystem;

namespace dew::interop {

using at::Tensor;

namespace {

using detail::expect_component;
using detail::index_component;
using detail::read_pipeline_json;

nn::T5Encoder load_t5(const fs::path& folder, const fs::path& tokenizer, at::ScalarType weights_dtype) {
  const json config = read_pipeline_json(folder / "config.json");
  nn::T5EncoderOptions o = nn::t5_encoder_options_from_hf(config);
  DEW_CHECK(fs::is_directory(tokenizer), tokenizer.string(), ": missing (the T5 tokenizer folder)");
  // transformers can rebuild T5's tokenizer from tokenizer.json alone; dew reads the SentencePiece model.
  DEW_CHECK(fs::is_regular_file(tokenizer / "spiece.model") || fs::is_regular_file(tokenizer / "tokenizer.model"),
            tokenizer.string(), ": no spiece.model (expected T5's SentencePiece tokenizer model, as the SD3 / FLUX.1 ",
            "repositories ship it)");
  o.tokenizer(tokenizer.string());
  nn::T5Encoder encoder = nn::build_weights_in(weights_dtype, [&] { return nn::T5Encoder(o); });
  nn::load_t5_encoder_weights(*encoder, folder.string());
  encoder->options.weights(folder.string());
  encoder->eval();
  return encoder;
}

// numpy's linspace(a, b, n) (FluxPipeline's sigmas): a + i (b - a)/(n - 1), the last value b.
std::vector<double> flux_sigma_grid(double a, double b, int64_t n) {
  std::vector<double> y(size_t(n), a);
  if (n == 1) return y;
  const double step = (b - a) / double(n - 1);
  for (int64_t i = 0; i < n; ++i) y[size_t(i)] = double(i) * step + a;
  y.back() = b;
  return y;
}

}  // namespace

bool is_flow_pipeline_folder(const std::string& dir) {
  const std::string c = detail::model_index_class(dir);
  return c == "StableDiffusion3Pipeline" || c == "FluxPipeline";
}

FlowPipeline FlowPipeline::load(const std::string& dir, at::ScalarType weights_dtype) {
  FlowPipeline p;
  p.dir_ = dir;
  const json index = detail::read_model_index(dir, {"StableDiffusion3Pipeline", "FluxPipeline"}, p.class_name_);
  const fs::path root(dir), index_file = root / "model_index.json";
  const std::vector<std::string> clip_tok{"CLIPTokenizer", "CLIPTokenizerFast"},
      t5_tok{"T5Tokenizer", "T5TokenizerFast"};
  // Check every model_index entry before loading anything.
  expect_component(index, "transformer", {p.flux() ? "FluxTransformer2DModel" : "SD3Transformer2DModel"}, index_file);
  expect_component(index, "vae", {"AutoencoderKL"}, index_file);
  expect_component(index, "scheduler", {"FlowMatchEulerDiscreteScheduler"}, index_file);
  expect_component(index, "tokenizer", clip_tok, index_file);
  bool has_t5 = true;
  if (p.flux()) {
    expect_component(index, "text_encoder", {"CLIPTextModel"}, index_file);
    expect_component(index, "text_encoder_2", {"T5EncoderModel"}, index_file);
    expect_component(index, "tokenizer_2", t5_tok, index_file);
  } else {
    expect_component(index, "text_encoder", {"CLIPTextModelWithProjection"}, index_file);
    expect_component(index, "text_encoder_2", {"CLIPTextModelWithProjection"}, index_file);
    expect_component(index, "tokenizer_2", clip_tok, index_file);
    // diffusers runs SD3 without T5 (zeros in its place) when text_encoder_3 is null
    has_t5 = !expect_component(index, "text_encoder_3", {"T5EncoderModel", ""}, index_file).empty();
    if (has_t5) expect_component(index, "tokenizer_3", t5_tok, index_file);
  }
  // Every component folder the index names, before anything is loaded.
  std::vector<std::string> components{"transformer",    "vae",        "scheduler", "text_encoder", "tokenizer",
                                      "text_encoder_2", "tokenizer_2"};
  if (has_t5 && !p.flux()) components.insert(components.end(), {"text_encoder_3", "tokenizer_3"});
  for (const auto& c : components)
    DEW_CHECK(fs::is_directory(root / c), (root / c).string(), ": missing (model_index.json names ", c, " as ",
              index_component(index, c, index_file), ")");
  const fs::path scheduler_file = root / "scheduler" / "scheduler_config.json";
  const json sched_cfg = sampling::read_scheduler_config(scheduler_file.string());
  p.scheduler_ = std::make_unique<sampling::FlowMatchEulerScheduler>(sched_cfg, scheduler_file.string());

  DiffusersLoadOptions lo;
  lo.weights_dtype = p.weights_dtype_ = weights_dtype;
  p.transformer_ = load_diffusers_folder((root / "transformer").string(), lo);
  p.vae_ = load_diffusers_folder((root / "vae").string(), lo);
  p.clip_ = detail::load_clip_component(root / "text_encoder", root / "tokenizer", !p.flux(), weights_dtype);
  if (p.flux()) {
    p.t5_ = load_t5(root / "text_encoder_2", root / "tokenizer_2", weights_dtype);
  } else {
    p.clip_2_ = detail::load_clip_component(root / "text_encoder_2", root / "tokenizer_2", true, weights_dtype);
    if (has_t5) p.t5_ = load_t5(root / "text_encoder_3", root / "tokenizer_3", weights_dtype);
  }

  // The components must fit each other.
  const auto v = from_json<nn::AutoencoderKLOptions>(p.vae_.fields);
  p.vae_scale_factor_ = int64_t{1} << (v.block_out_channels().size() - 1);
  p.latent_channels_ = v.latent_channels();
  const fs::path tconf = root / "transformer" / "config.json";
  int64_t pooled = 0, in_ch = 0, out_ch = 0;
  if (p.flux()) {
    const auto t = from_json<nn::FluxTransformerOptions>(p.transformer_.fields);
    p.patch_ = 2;  // FluxPipeline packs 2 x 2 latent patches into tokens
    p.context_features_ = t.context_features();
    pooled = t.pooled_projection_dim();
    in_ch = t.in_channels();
    out_ch = t.output_channels();
    p.guidance_embeds_ = t.guidance_embeds();
    p.default_size_ = 128 * p.vae_scale_factor_;  // FluxPipeline's default_sample_size
    DEW_CHECK(p.clip_->options.hidden_size() == pooled, tconf.string(), ": pooled_projection_dim ", pooled,
              " must equal text_encoder's hidden_size ", p.clip_->options.hidden_size(), " (CLIP's pooler_output)");
  } else {
    const auto t = from_json<nn::SD3TransformerOptions>(p.transformer_.fields);
    p.patch_ = t.patch_size();
    p.context_features_ = t.context_features();
    pooled = t.pooled_projection_dim();
    in_ch = t.in_channels();
    out_ch = t.output_channels();
    p.default_size_ = t.sample_size() * p.vae_scale_factor_;
    const int64_t clip_width = p.clip_->options.hidden_size() + p.clip_2_->options.hidden_size();
    DEW_CHECK(clip_width <= p.context_features_, tconf.string(), ": joint_attention_dim ", p.context_features_,
              " is narrower than the two CLIP widths together (", clip_width, ")");
    const int64_t proj = p.clip_->options.projection_dim() + p.clip_2_->options.projection_dim();
    DEW_CHECK(proj == pooled, tconf.string(), ": pooled_projection_dim ", pooled,
              " must equal the two CLIP projection_dims together (", proj, ")");
  }
  if (p.t5_)
    DEW_CHECK(p.t5_->options.d_model() == p.context_features_, tconf.string(), ": joint_attention_dim ",
              p.context_features_, " must equal T5's d_model ", p.t5_->options.d_model());
  DEW_CHECK(in_ch == p.latent_channels_ && out_ch == p.latent_channels_, tconf.string(),
            ": the transformer's latent channels (in ", in_ch, ", out ", out_ch, ") must equal the VAE's ",
            p.latent_channels_, " (vae/config.json latent_channels)");
  return p;
}

std::pair<int64_t, int64_t> FlowPipeline::size_of(const PipelineRequest& r) const {
  return {r.height > 0 ? r.height : default_size_, r.width > 0 ? r.width : default_size_};
}

Tensor FlowPipeline::tokenize(const std::vector<std::string>& texts, int index, int64_t max_sequence_length) const {
  const int t5_index = flux() ? 1 : 2;
  if (index == t5_index) {
    DEW_CHECK(t5_, "pipeline: this folder has no T5 text encoder (text_encoder_3 is null)");
    DEW_CHECK(max_sequence_length >= 1, "--max-sequence-length: must be >= 1, got ", max_sequence_length);
    // T5's tokenizer with padding="max_length", truncation=True at the pipeline's max_sequence_length: the
    // pieces (at most max_sequence_length - 1), </s>, then padding. tokenize() works at the options' max_length,
    // so its rows are cut back here.
    const int64_t eos = t5_->options.eos_token_id(), n = int64_t(texts.size());
    const Tensor all = t5_->tokenize(texts).first;
    Tensor out = at::full({n, max_sequence_length}, t5_->options.pad_token_id(), at::kLong);
    for (int64_t b = 0; b < n; ++b) {
      const Tensor row = all[b];
      int64_t len = 0;  // pieces before </s>
      while (len < row.size(0) && row[len].item<int64_t>() != eos) ++len;
      const int64_t keep = std::min(len, max_sequence_length - 1);
      if (keep > 0) out[b].slice(0, 0, keep).copy_(row.slice(0, 0, keep));
      out[b][keep] = eos;
    }
    return out;
  }
  DEW_CHECK(index == 0 || (index == 1 && !flux()), "pipeline: there is no tokenizer ", index + 1);
  return (index == 0 ? clip_ : clip_2_)->tokenize(texts).first;
}

void FlowPipeline::check(const PipelineRequest& r) const {
  DEW_CHECK(r.steps >= 1, "--steps: must be >= 1, got ", r.steps);
  DEW_CHECK(r.count >= 1, "--count: must be >= 1, got ", r.count);
  DEW_CHECK(std::isfinite(r.guidance), "--guidance: must be finite, got ", r.guidance);
  DEW_CHECK(!flux() || (!r.prompt_3 && !r.negative_prompt_3),
            "--prompt-3 / --negative-prompt-3: FluxPipeline has two encoders (CLIP: --prompt, T5: --prompt-2)");
  DEW_CHECK(!flux() || !r.negative_prompt_2, "--negative-prompt-2: FluxPipeline uses no negative prompt");
  const auto [h, w] = size_of(r);
  const int64_t m = vae_scale_factor_ * patch_;
  DEW_CHECK(r.height >= 0 && r.width >= 0 && h > 0 && w > 0 && h % m == 0 && w % m == 0, "--size: ", h, "x", w,
            " must be positive multiples of ", m, " (the VAE's factor ", vae_scale_factor_, " x ",
            flux() ? "Flux's 2 x 2 packing" : "the transformer's patch_size", " ", patch_, ")");
  if (r.latents.defined()) {
    const int64_t lh = h / vae_scale_factor_, lw = w / vae_scale_factor_;
    const std::vector<int64_t> nchw{r.count, latent_channels_, lh, lw};
    const std::vector<int64_t> packed{r.count, (lh / 2) * (lw / 2), 4 * latent_channels_};
    const bool ok =
        r.latents.sizes() == at::IntArrayRef(nchw) || (flux() && r.latents.sizes() == at::IntArrayRef(packed));
    DEW_CHECK(ok, "--latents: expected ", at::IntArrayRef(nchw),
              flux() ? dew::str(" or packed ", at::IntArrayRef(packed)) : std::string(), ", got ", r.latents.sizes());
  }
}

PromptEmbeddings FlowPipeline::encode(const PipelineRequest& r, int64_t max_sequence_length) {
  check(r);
  DEW_CHECK(max_sequence_length >= 1, "--max-sequence-length: must be >= 1, got ", max_sequence_length);
  torch::NoGradGuard no_grad;
  nn::InferenceAutocast autocast(weights_dtype_);
  PromptEmbeddings e;
  const auto B = size_t(r.count);
  auto t5_states = [&](const std::vector<std::string>& texts) {
    if (!t5_) return at::zeros({int64_t(B), max_sequence_length, context_features_}, at::kFloat);
    // diffusers passes no attention mask to T5: the padding tokens are attended to as well
    return t5_->last_hidden_state(tokenize(texts, flux() ? 1 : 2, max_sequence_length), {});
  };
  if (flux()) {
    const std::vector<std::string> pos(B, r.prompt), pos_2(B, r.prompt_2.value_or(r.prompt));
    e.pooled_positive = clip_->forward_outputs(tokenize(pos, 0, 0), {}).pooler_output;
    e.positive = t5_states(pos_2);
    return e;
  }
  // SD3's encode_prompt: penultimate CLIP states side by side, padded to T5's width, then T5's states.
  auto both = [&](const std::string& text, const std::string& text_2, const std::string& text_3, Tensor& pooled) {
    const std::vector<std::string> t1(B, text), t2(B, text_2), t3(B, text_3);
    const auto a = clip_->forward_outputs(tokenize(t1, 0, 0), {});
    const auto b = clip_2_->forward_outputs(tokenize(t2, 1, 0), {});
    pooled = at::cat({a.text_embeds, b.text_embeds}, -1);
    Tensor clip = at::cat({a.penultimate_hidden_state, b.penultimate_hidden_state}, -1);
    clip = at::constant_pad_nd(clip, {0, context_features_ - clip.size(-1)});
    return at::cat({clip, t5_states(t3).to(clip.scalar_type())}, 1);
  };
  // prompt_2 and prompt_3 are the prompt where none is given, as diffusers has them
  e.positive = both(r.prompt, r.prompt_2.value_or(r.prompt), r.prompt_3.value_or(r.prompt), e.pooled_positive);
  if (r.guidance > 1.0) {
    e.negative = both(r.negative_prompt, r.negative_prompt_2.value_or(r.negative_prompt),
                      r.negative_prompt_3.value_or(r.negative_prompt), e.pooled_negative);
  }
  return e;
}

int64_t FlowPipeline::add_lora(const std::string& path, double scale) {
  detail::check_lora_weights_dtype(weights_dtype_, path);
  // kohya / sd-scripts files name the original checkpoints' modules: FLUX's (double_blocks with fused qkv, ...)
  // nn::load_kohya_lora maps onto diffusers' names; SD3's (joint_blocks) are not read.
  std::string original;
  for (const auto& key : io::SafetensorsFile::open(path).names())
    if (original.empty() && key.rfind("lora_unet_", 0) == 0) original = key;
  DEW_CHECK(original.empty() || flux(), "LoRA: ", path, " is in kohya's layout (", original,
            "), which names the original SD3 modules; SD3 folders take diffusers' layout (transformer.* keys, what "
            "save_lora_weights writes)");
  // The transformer and the CLIP encoders diffusers' load_lora_weights reads (SD3's text_encoder / _2, Flux's
  // text_encoder; kohya's lora_te1_ / lora_te2_ for them); T5's adapters are not read, as diffusers does not.
  std::vector<detail::LoraPart> parts = {
      {transformer_.module.get(), "transformer", original.empty() ? "lora_transformer" : "lora_unet"}};
  if (clip_) parts.push_back({clip_.get(), "text_encoder", "lora_te1"});
  if (clip_2_) parts.push_back({clip_2_.get(), "text_encoder_2", "lora_te2"});
  return detail::merge_lora_parts(parts, weights_dtype_, path, scale);
}

int64_t FlowPipeline::hold_weights_in(at::ScalarType dtype) {
  weights_dtype_ = dtype;
  int64_t bytes = 0;
  bytes += nn::hold_weights_in(*transformer_.module, dtype);
  bytes += nn::hold_weights_in(*vae_.module, dtype);
  if (clip_) bytes += nn::hold_weights_in(*clip_, dtype);
  if (clip_2_) bytes += nn::hold_weights_in(*clip_2_, dtype);
  if (t5_) bytes += nn::hold_weights_in(*t5_, dtype);
  return bytes;
}

PipelineResult FlowPipeline::run(const PipelineRequest& r, int64_t max_sequence_length) {
  return run(r, encode(r, max_sequence_length));
}

PipelineResult FlowPipeline::run(const PipelineRequest& r, const PromptEmbeddings& e) {
  check(r);
  torch::NoGradGuard no_grad;
  nn::InferenceAutocast autocast(weights_dtype_);
  const auto [h, w] = size_of(r);
  const int64_t lh = h / vae_scale_factor_, lw = w / vae_scale_factor_;
  const bool cfg = !flux() && r.guidance > 1.0;
  DEW_CHECK(!cfg || (e.negative.defined() && e.pooled_negative.defined()),
            "pipeline: guidance > 1 needs the negative prompt embeddings");
  auto model = transformer_.backbone();

  Tensor x;
  if (r.latents.defined()) {
    x = r.latents.to(at::kFloat);
    if (x.dim() == 3) x = nn::flux_unpack_latents(x, lh, lw);  // FluxPipeline's packed draw
  } else {
    x = at::randn({r.count, latent_channels_, lh, lw}, rng::generator(r.seed, 0, "pipeline/latents"),
                  at::TensorOptions().dtype(at::kFloat));
  }
  if (flux()) {
    // FluxPipeline: sigmas linspace(1, 1/n, n), mu of the packed sequence length (used under dynamic shifting)
    const int64_t n = r.steps;
    scheduler_->set_timesteps(n, flux_sigma_grid(1.0, 1.0 / double(n), n),
                              scheduler_->mu_for((lh / 2) * (lw / 2), 1.15));
  } else {
    std::optional<double> mu;
    if (scheduler_->use_dynamic_shifting()) mu = scheduler_->mu_for((lh / patch_) * (lw / patch_), 1.16);
    scheduler_->set_timesteps(r.steps, {}, mu);
  }

  Conditioning cond;
  cond.context = cfg ? at::cat({e.negative, e.positive}) : e.positive;
  cond.pooled = cfg ? at::cat({e.pooled_negative, e.pooled_positive}) : e.pooled_positive;
  if (guidance_embeds_)
    cond.extra["guidance"] = at::full({cond.pooled.size(0)}, r.guidance, at::TensorOptions().dtype(at::kFloat));
  for (int64_t i = 0; i < scheduler_->num_steps(); ++i) {
    io::check_stop();
    const Tensor in = cfg ? at::cat({x, x}) : x;
    const Tensor t = at::full({in.size(0)}, scheduler_->timestep(i), at::TensorOptions().dtype(at::kFloat));
    Tensor v = model->forward(in, t, cond);
    if (cfg) {
      const auto halves = v.chunk(2);
      v = halves[0] + r.guidance * (halves[1] - halves[0]);
    }
    x = scheduler_->step(v, i, x, {});
  }
  PipelineResult res;
  res.latents = flux() ? nn::flux_pack_latents(x) : x;  // as the pipeline holds them
  auto vae = vae_.autoencoder();
  const Tensor decoded = vae->decode(vae->from_latent(x));  // x / scaling_factor + shift_factor
  res.images = (decoded.to(at::kFloat) / 2 + 0.5).clamp(0, 1);
  return res;
}

// ---- QwenImage21Pipeline ----

bool is_qwen_image_pipeline_folder(const std::string& dir) {
  return detail::model_index_class(dir) == "QwenImage21Pipeline";
}

QwenImagePipeline QwenImagePipeline::load(const std::string& dir, at::ScalarType weights_dtype) {
  QwenImagePipeline p;
  p.dir_ = dir;
  std::string class_name;
  const json index = detail::read_model_index(dir, {"QwenImage21Pipeline"}, class_name);
  const fs::path root(dir), index_file = root / "model_index.json";
  expect_component(index, "transformer", {"QwenImage21Transformer2DModel"}, index_file);
  expect_component(index, "vae", {"AutoencoderKLQwenImage21"}, index_file);
  expect_component(index, "scheduler", {"FlowMatchEulerDiscreteScheduler"}, index_file);
  expect_component(index, "text_encoder", {"Qwen3VLForConditionalGeneration"}, index_file);
  expect_component(index, "processor", {"Qwen3VLProcessor"}, index_file);
  for (const char* c : {"transformer", "vae", "scheduler", "text_encoder", "processor"})
    DEW_CHECK(fs::is_directory(root / c), (root / c).string(), ": missing (model_index.json names ", c, " as ",
              index_component(index, c, index_file), ")");
  DEW_CHECK(fs::is_regular_file(root / "processor" / "tokenizer.json"), (root / "processor").string(),
            ": no tokenizer.json (the Qwen3VLProcessor's tokenizer, which dew reads)");
  if (index.contains("sample_sigmas") && !index["sample_sigmas"].is_null()) {
    const json& s = index["sample_sigmas"];
    DEW_CHECK(s.is_array() && !s.empty(), index_file.string(),
              ": sample_sigmas must be null or a non-empty list of numbers, got ", s.dump());
    for (const auto& v : s) {
      DEW_CHECK(v.is_number() && std::isfinite(v.get<double>()) && v.get<double>() > 0 && v.get<double>() <= 1,
                index_file.string(), ": sample_sigmas holds ", v.dump(), "; accepted: numbers in (0, 1]");
      p.sample_sigmas_.push_back(v.get<double>());
    }
  }
  const fs::path scheduler_file = root / "scheduler" / "scheduler_config.json";
  const json sched_cfg = sampling::read_scheduler_config(scheduler_file.string());
  p.scheduler_ = std::make_unique<sampling::FlowMatchEulerScheduler>(sched_cfg, scheduler_file.string());

  // The components must fit each other: checked on their config.json files, before any weight is read.
  const auto t =
      from_json<nn::QwenImageTransformerOptions>(diffusers_model_spec((root / "transformer").string()).fields);
  const auto v = from_json<nn::QwenImageVaeOptions>(diffusers_model_spec((root / "vae").string()).fields);
  const fs::path tconf = root / "transformer" / "config.json", econf = root / "text_encoder" / "config.json";
  const json text_config = read_pipeline_json(econf);
  const json& text = text_config.contains("text_config") ? text_config["text_config"] : text_config;
  DEW_CHECK(text.is_object() && text.contains("hidden_size") && text["hidden_size"].is_number_integer(), econf.string(),
            ": no text_config.hidden_size");
  const int64_t width = text["hidden_size"].get<int64_t>();
  p.latent_channels_ = v.z_dim();
  p.vae_scale_factor_ = int64_t{1} << (v.dim_mult().size() - 1);
  p.causal_condition_ = t.causal_condition();
  DEW_CHECK(p.vae_scale_factor_ == 16, (root / "vae" / "config.json").string(), ": the VAE downsamples ",
            p.vae_scale_factor_, "x; QwenImage21Pipeline is built for 16x (dim_mult of 5 levels)");
  DEW_CHECK(t.in_channels() == p.latent_channels_ && t.output_channels() == p.latent_channels_, tconf.string(),
            ": the transformer's latent channels (in ", t.in_channels(), ", out ", t.output_channels(),
            ") must equal the VAE's z_dim ", p.latent_channels_);
  DEW_CHECK(t.context_features() == width, tconf.string(), ": context_in_dim ", t.context_features(),
            " must equal the text model's hidden_size ", width, " (", econf.string(), ")");

  DiffusersLoadOptions lo;
  lo.weights_dtype = p.weights_dtype_ = weights_dtype;
  p.transformer_ = load_diffusers_folder((root / "transformer").string(), lo);
  p.vae_ = load_diffusers_folder((root / "vae").string(), lo);
  p.text_ = std::make_unique<QwenImageTextEncoder>((root / "text_encoder").string(), (root / "processor").string(),
                                                   weights_dtype);
  return p;
}

std::vector<double> QwenImagePipeline::linspace_sigmas(int64_t steps) {
  DEW_CHECK(steps >= 1, "--steps: must be >= 1, got ", steps);
  return flux_sigma_grid(1.0, 1.0 / double(steps), steps);
}

std::pair<int64_t, int64_t> QwenImagePipeline::size_of(const PipelineRequest& r) const {
  return {r.height > 0 ? r.height : default_size(), r.width > 0 ? r.width : default_size()};
}

void QwenImagePipeline::check(const PipelineRequest& r) const {
  DEW_CHECK(r.steps >= 1, "--steps: must be >= 1, got ", r.steps);
  DEW_CHECK(r.count >= 1, "--count: must be >= 1, got ", r.count);
  DEW_CHECK(std::isfinite(r.guidance), "--guidance: must be finite, got ", r.guidance);
  QwenImageTextEncoder::check_prompt(r.prompt, 0);
  QwenImageTextEncoder::check_prompt(r.negative_prompt, 1);
  DEW_CHECK(!r.prompt_2 && !r.negative_prompt_2 && !r.prompt_3 && !r.negative_prompt_3,
            "--prompt-2 / --prompt-3: QwenImage21Pipeline has one text encoder (--prompt, --negative-prompt)");
  const auto [h, w] = size_of(r);
  const int64_t m = 2 * vae_scale_factor_;
  DEW_CHECK(r.height >= 0 && r.width >= 0 && h % m == 0 && w % m == 0, "--size: ", h, "x", w,
            " must be positive multiples of ", m, " (QwenImage21Pipeline's multiple: twice the VAE's factor ",
            vae_scale_factor_, ")");
  if (r.latents.defined()) {
    const int64_t lh = h / vae_scale_factor_, lw = w / vae_scale_factor_;
    const std::vector<int64_t> nchw{r.count, latent_channels_, lh, lw}, packed{r.count, lh * lw, latent_channels_};
    DEW_CHECK(r.latents.sizes() == at::IntArrayRef(nchw) || r.latents.sizes() == at::IntArrayRef(packed),
              "--latents: expected ", at::IntArrayRef(nchw), " or packed ", at::IntArrayRef(packed), ", got ",
              r.latents.sizes());
  }
}

QwenImageTextEncoder::States QwenImagePipeline::encode_prompts(const std::vector<std::string>& prompts) {
  torch::NoGradGuard no_grad;
  nn::InferenceAutocast autocast(weights_dtype_);
  return text_->encode(prompts);
}

QwenImagePipeline::Prompts QwenImagePipeline::encode(const PipelineRequest& r) {
  check(r);
  // One encoding per prompt, repeated per image (the pipeline's num_images_per_prompt).
  auto repeated = [&](const std::string& prompt) {
    auto s = encode_prompts({prompt});
    s.states = s.states.repeat({r.count, 1, 1});
    s.mask = s.mask.repeat({r.count, 1});
    return s;
  };
  Prompts p;
  p.positive = repeated(r.prompt);
  if (r.guidance > 1.0) p.negative = repeated(r.negative_prompt);
  return p;
}

int64_t QwenImagePipeline::add_lora(const std::string& path, double scale) {
  detail::check_lora_weights_dtype(weights_dtype_, path);
  return detail::merge_lora_parts({{transformer_.module.get(), "transformer", "lora_unet"}}, weights_dtype_, path,
                                  scale);
}

int64_t QwenImagePipeline::hold_weights_in(at::ScalarType dtype) {
  weights_dtype_ = dtype;
  return nn::hold_weights_in(*transformer_.module, dtype) + nn::hold_weights_in(*vae_.module, dtype) +
         nn::hold_weights_in(*text_->model(), dtype);
}

PipelineResult QwenImagePipeline::run(const PipelineRequest& r, const std::vector<double>& sigmas, bool use_kv_cache) {
  return run(r, encode(r), sigmas, use_kv_cache);
}

PipelineResult QwenImagePipeline::run(const PipelineRequest& r, const Prompts& prompts,
                                      const std::vector<double>& sigmas, bool use_kv_cache) {
  check(r);
  for (double s : sigmas)
    DEW_CHECK(std::isfinite(s) && s > 0 && s <= 1, "pipeline: sigmas must be numbers in (0, 1], got ", s);
  const bool cfg = r.guidance > 1.0;
  DEW_CHECK(prompts.positive.states.defined() && prompts.positive.states.size(0) == r.count,
            "pipeline: the prompt states must have one row per image (", r.count, ")");
  DEW_CHECK(!cfg || (prompts.negative.states.defined() && prompts.negative.states.size(0) == r.count),
            "pipeline: guidance > 1 needs the negative prompt's states, one row per image");
  torch::NoGradGuard no_grad;
  nn::InferenceAutocast autocast(weights_dtype_);
  const auto [h, w] = size_of(r);
  const int64_t lh = h / vae_scale_factor_, lw = w / vae_scale_factor_;
  auto* model = dynamic_cast<nn::QwenImageTransformerImpl*>(transformer_.backbone().get());
  DEW_CHECK(model, "pipeline: transformer/ is not a qwen_image_transformer");

  Tensor x;
  if (r.latents.defined()) {
    x = r.latents.to(at::kFloat);
    if (x.dim() == 3) x = x.transpose(1, 2).reshape({r.count, latent_channels_, lh, lw});  // the pipeline's packing
  } else {
    // the pipeline's draw [count, 1, C, h, w], packed as a plain flatten: the same numbers as [count, C, h, w]
    x = at::randn({r.count, latent_channels_, lh, lw}, rng::generator(r.seed, 0, "pipeline/latents"),
                  at::TensorOptions().dtype(at::kFloat));
  }
  const std::vector<double> grid = !sigmas.empty()           ? sigmas
                                   : !sample_sigmas_.empty() ? sample_sigmas_
                                                             : linspace_sigmas(r.steps);
  scheduler_->set_timesteps(int64_t(grid.size()), grid, scheduler_->mu_for(lh * lw, 1.15));

  auto condition = [](const QwenImageTextEncoder::States& s) {
    Conditioning c;
    c.context = s.states;
    c.context_mask = s.mask.to(at::kBool);
    return c;
  };
  const Conditioning pos = condition(prompts.positive);
  const Conditioning neg = cfg ? condition(prompts.negative) : Conditioning();
  const bool cache = use_kv_cache && causal_condition_;
  nn::QwenImageKVCache pos_cache, neg_cache;
  auto predict = [&](const Tensor& t, const Conditioning& c, nn::QwenImageKVCache& kv, int64_t i) {
    if (!cache) return model->forward(x, t, c);
    return i == 0 ? model->forward_extract(x, t, c, kv) : model->forward_cached(x, t, c, kv);
  };
  for (int64_t i = 0; i < scheduler_->num_steps(); ++i) {
    io::check_stop();
    // the pipeline hands the transformer t / 1000 in float32, which it scales by 1000 again
    const Tensor t = at::full({r.count}, scheduler_->timestep(i), at::TensorOptions().dtype(at::kFloat)) / 1000 * 1000;
    Tensor v = predict(t, pos, pos_cache, i);
    if (cfg) {
      const Tensor u = predict(t, neg, neg_cache, i);
      v = u + r.guidance * (v - u);
    }
    x = scheduler_->step(v, i, x, {});
  }
  PipelineResult res;
  res.latents = x.flatten(2).transpose(1, 2).contiguous();  // packed [count, h w, C], as the pipeline holds them
  auto vae = vae_.autoencoder();
  const Tensor decoded = vae->decode(vae->from_latent(x));  // x latents_std + latents_mean, clamped to [-1, 1]
  res.images = (decoded.to(at::kFloat) / 2 + 0.5).clamp(0, 1);
  return res;
}

}  // namespace dew::interop

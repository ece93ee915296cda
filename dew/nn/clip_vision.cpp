#include "dew/nn/clip_vision.h"

#include <algorithm>
#include <cmath>

#include "dew/core/error.h"
#include "dew/nn/attention.h"
#include "dew/nn/blocks.h"

namespace dew::nn {

using at::Tensor;

namespace {
// The encoder layer is the text tower's (same names, same pre-norm block); it reads only these fields.
ClipTextOptions clip_vision_layer_options(const ClipVisionOptions& o) {
  ClipTextOptions t;
  t.hidden_size(o.hidden_size())
      .intermediate_size(o.intermediate_size())
      .num_attention_heads(o.num_attention_heads())
      .hidden_act(o.hidden_act())
      .layer_norm_eps(o.layer_norm_eps())
      .attention_impl(o.attention_impl())
      .dtype(o.dtype());
  return t;
}
}  // namespace

ClipVisionImpl::ClipVisionImpl(ClipVisionOptions options_) : options(std::move(options_)) {
  const auto& o = options;
  const std::string w = "clip_vision";
  DEW_CHECK(o.hidden_size() > 0, w, ".hidden_size must be > 0, got ", o.hidden_size());
  DEW_CHECK(o.intermediate_size() > 0, w, ".intermediate_size must be > 0, got ", o.intermediate_size());
  DEW_CHECK(o.num_hidden_layers() >= 0, w, ".num_hidden_layers must be >= 0, got ", o.num_hidden_layers());
  DEW_CHECK(o.num_attention_heads() > 0 && o.hidden_size() % o.num_attention_heads() == 0, w,
            ".num_attention_heads must be > 0 and divide hidden_size, got ", o.num_attention_heads(),
            " for hidden_size ", o.hidden_size());
  DEW_CHECK(o.num_channels() > 0, w, ".num_channels must be > 0, got ", o.num_channels());
  DEW_CHECK(o.patch_size() > 0 && o.image_size() > 0 && o.image_size() % o.patch_size() == 0, w,
            ".image_size must be a positive multiple of patch_size, got image_size ", o.image_size(), ", patch_size ",
            o.patch_size());
  DEW_CHECK(o.hidden_act() == "quick_gelu" || o.hidden_act() == "gelu", w, ".hidden_act: got \"", o.hidden_act(),
            "\", accepted: quick_gelu, gelu");
  DEW_CHECK(o.layer_norm_eps() > 0, w, ".layer_norm_eps must be > 0, got ", o.layer_norm_eps());
  DEW_CHECK(o.projection_dim() >= 0, w, ".projection_dim must be >= 0, got ", o.projection_dim());
  dtype_ = parse_compute_dtype(o.dtype(), w + ".dtype");
  check_attention_impl(o.attention_impl(), w + ".attention_impl");
  reset();
  if (!o.weights().empty()) load_clip_vision_weights(*this, o.weights());
}

void ClipVisionImpl::reset() {
  const auto& o = options;
  const int64_t d = o.hidden_size(), p = o.image_size() / o.patch_size();
  const auto ln = [&] { return torch::nn::LayerNorm(torch::nn::LayerNormOptions({d}).eps(o.layer_norm_eps())); };
  vision_model = register_module("vision_model", std::make_shared<torch::nn::Module>());
  embeddings = vision_model->register_module("embeddings", std::make_shared<torch::nn::Module>());
  class_embedding = embeddings->register_parameter("class_embedding", torch::zeros({d}));
  patch_embedding = embeddings->register_module(
      "patch_embedding",
      torch::nn::Conv2d(
          torch::nn::Conv2dOptions(o.num_channels(), d, o.patch_size()).stride(o.patch_size()).bias(false)));
  position_embedding = embeddings->register_module("position_embedding", torch::nn::Embedding(p * p + 1, d));
  pre_layrnorm = vision_model->register_module("pre_layrnorm", ln());
  encoder = vision_model->register_module("encoder", std::make_shared<torch::nn::Module>());
  layers = encoder->register_module("layers", torch::nn::ModuleList());
  layer_list.clear();
  const ClipTextOptions lo = clip_vision_layer_options(o);
  for (int64_t i = 0; i < o.num_hidden_layers(); ++i) {
    ClipEncoderLayer l(lo);
    layers->push_back(l);
    layer_list.push_back(l);
  }
  post_layernorm = vision_model->register_module("post_layernorm", ln());
  if (o.projection_dim() > 0)
    visual_projection = register_module("visual_projection",
                                        torch::nn::Linear(torch::nn::LinearOptions(d, o.projection_dim()).bias(false)));
  reset_parameters();
}

void ClipVisionImpl::reset_parameters() {
  torch::NoGradGuard no_grad;
  const double d = static_cast<double>(options.hidden_size());
  const double out_std = std::pow(d, -0.5);
  class_embedding.normal_(0.0, out_std);
  patch_embedding->weight.normal_(0.0, 0.02);
  position_embedding->weight.normal_(0.0, 0.02);
  for (auto& l : layer_list) l->reset_parameters(options.num_hidden_layers());
  for (auto* n : {&pre_layrnorm, &post_layernorm}) {
    (*n)->weight.fill_(1.0);
    (*n)->bias.zero_();
  }
  if (visual_projection) visual_projection->weight.normal_(0.0, out_std);
}

ClipVisionImpl::Outputs ClipVisionImpl::forward(const Tensor& pixel_values) {
  const auto& o = options;
  DEW_CHECK(pixel_values.defined(), "clip_vision: pixel_values are undefined");
  DEW_CHECK(
      pixel_values.dim() == 4 && pixel_values.size(1) == o.num_channels() && pixel_values.size(2) == o.image_size() &&
          pixel_values.size(3) == o.image_size() && pixel_values.is_floating_point(),
      "clip_vision: pixel_values must be floating [B, ", o.num_channels(), ", ", o.image_size(), ", ", o.image_size(),
      "] (num_channels, image_size), got ", pixel_values.sizes(), " ", pixel_values.scalar_type());
  const int64_t b = pixel_values.size(0), d = o.hidden_size();
  // A model moved to float64 (a float64 reference run) computes in float64 throughout; else in `dtype`, with
  // float32 outputs (the embeddings and the LayerNorms run in float32, as transformers' do under autocast).
  const bool f64 = class_embedding.scalar_type() == at::kDouble;
  const at::ScalarType dt = f64 ? at::kDouble : dtype_, out_dt = f64 ? at::kDouble : at::kFloat;
  const auto& pw = patch_embedding->weight;
  Tensor patches = at::conv2d(pixel_values.to(pw.scalar_type()), pw, {}, o.patch_size());  // [B, D, p, p]
  patches = patches.flatten(2).transpose(1, 2);                                            // [B, P, D]
  Tensor h = at::cat({class_embedding.view({1, 1, d}).expand({b, 1, d}), patches}, 1) +
             position_embedding->weight.unsqueeze(0);
  h = at::layer_norm(h, {d}, pre_layrnorm->weight, pre_layrnorm->bias, o.layer_norm_eps()).to(dt);
  const Tensor no_mask;  // every patch attends to every patch
  for (auto& layer : layer_list) {
    if (o.remat()) {
      h = remat(*layer, [layer](const std::vector<Tensor>& in) mutable { return layer(in[0], Tensor()); }, {h});
    } else {
      h = layer(h, no_mask);
    }
  }
  Outputs out;
  out.last_hidden_state = h.to(out_dt);
  out.pooler_output = at::layer_norm(out.last_hidden_state.select(1, 0), {d}, post_layernorm->weight,
                                     post_layernorm->bias, o.layer_norm_eps());
  if (visual_projection) out.image_embeds = at::linear(out.pooler_output, visual_projection->weight);
  return out;
}

// ---------------------------------------------------------------------------------------------------------
// Weights
// ---------------------------------------------------------------------------------------------------------

io::KeyMap clip_vision_key_map(bool with_projection) {
  io::KeyMap map;
  map.skip(R"((text_model\..*|text_projection\..*|logit_scale))");  // a whole CLIPModel's text side
  map.skip(R"((vision_model\.)?embeddings\.position_ids)");         // a buffer in older transformers files
  if (!with_projection) map.skip(R"(visual_projection\..*)");
  return map;
}

void load_clip_vision_weights(ClipVisionImpl& model, const std::string& path) {
  const auto source = io::WeightSource::open(path);
  io::LoadOptions o;
  o.require_buffers = false;
  io::load_weights(model, source, clip_vision_key_map(model.options.projection_dim() > 0), o);
}

}  // namespace dew::nn

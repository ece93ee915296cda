#include "dew/nn/text_encoder.h"

#include "dew/nn/family.h"

#include <torch/nn/init.h>

#include "dew/core/device.h"
#include "dew/core/error.h"
#include "dew/nn/clip_text.h"
#include "dew/nn/t5_encoder.h"

namespace dew {

using at::Tensor;

TextEncoding TextEncoderImpl::encode(const std::vector<std::string>& texts) {
  auto [ids, mask] = tokenize(texts);
  const at::Device device = module_device(*this);
  return forward(ids.to(device), mask.to(device));
}

namespace text_encoders {

namespace {

// The reference inputs of transformers' text models: input_ids (any integer type) and the optional
// attention_mask (1 = real token, any numeric or bool type).
std::pair<Tensor, Tensor> text_model_inputs(const std::map<std::string, Tensor>& inputs, const std::string& where) {
  const Tensor ids = inputs.at("input_ids");
  DEW_CHECK(!at::isFloatingType(ids.scalar_type()) && ids.dim() == 2, where,
            ": input_ids must be [B, S] integers, got ", ids.sizes(), " ", ids.scalar_type());
  const auto it = inputs.find("attention_mask");
  Tensor mask;
  if (it != inputs.end()) {
    DEW_CHECK(it->second.sizes() == ids.sizes(), where, ": attention_mask must be ", ids.sizes(),
              " like input_ids, got ", it->second.sizes());
    mask = it->second.ne(0);
  }
  return {ids.to(at::kLong), mask};
}

// CLIPTextModel / CLIPTextModelWithProjection forward: the outputs of both classes (pooler_output is the text
// model's pooled state, text_embeds its projection where the class has one) and hidden_states[-2], the states
// SDXL and SD3 condition on.
models::ReferenceMethod clip_forward() {
  models::ReferenceMethod m;
  m.name = "forward";
  m.required = {"input_ids"};
  m.optional = {"attention_mask"};
  // text_embeds only where the class has a projection, penultimate_hidden_state only with 2 layers or more.
  m.outputs = {"last_hidden_state", "pooler_output", "text_embeds", "penultimate_hidden_state"};
  m.run = [](torch::nn::Module& module, const std::map<std::string, Tensor>& inputs, const std::string& where) {
    auto* clip = dynamic_cast<nn::ClipTextImpl*>(&module);
    DEW_CHECK(clip, where, ": the model is not a clip_text encoder");
    const auto [ids, mask] = text_model_inputs(inputs, where);
    const auto o = clip->forward_outputs(ids, mask);
    std::map<std::string, Tensor> out{{"last_hidden_state", o.last_hidden_state}, {"pooler_output", o.pooler_output}};
    if (o.text_embeds.defined()) out["text_embeds"] = o.text_embeds;
    if (o.penultimate_hidden_state.defined()) out["penultimate_hidden_state"] = o.penultimate_hidden_state;
    return out;
  };
  return m;
}

// T5EncoderModel forward: input_ids [, attention_mask] -> last_hidden_state.
models::ReferenceMethod t5_forward() {
  models::ReferenceMethod m;
  m.name = "forward";
  m.required = {"input_ids"};
  m.optional = {"attention_mask"};
  m.outputs = {"last_hidden_state"};
  m.run = [](torch::nn::Module& module, const std::map<std::string, Tensor>& inputs, const std::string& where) {
    auto* t5 = dynamic_cast<nn::T5EncoderImpl*>(&module);
    DEW_CHECK(t5, where, ": the model is not a t5_encoder");
    const auto [ids, mask] = text_model_inputs(inputs, where);
    return std::map<std::string, Tensor>{{"last_hidden_state", t5->last_hidden_state(ids, mask)}};
  };
  return m;
}

}  // namespace

Registry<TextEncoderImpl>& registry() {
  // Built on first use; every entry records the full field set it was built with, defaults included.
  static Registry<TextEncoderImpl>* r = [] {
    auto* r = new Registry<TextEncoderImpl>("text_encoder");
    r->add<nn::ByteTextEncoderOptions>(
        "byte_text_encoder",
        "trainable transformer over UTF-8 bytes (ids = byte + 1, 0 = padding); \"\" encodes to zeros",
        [](const nn::ByteTextEncoderOptions& o) -> TextEncoderPtr {
          auto m = nn::ByteTextEncoder(o).ptr();
          m->set_config({{"architecture", "byte_text_encoder"}, {"fields", to_json(o)}});
          return m;
        });
    r->add<nn::ClipTextOptions>(
        "clip_text", "CLIP text encoder (Hugging Face CLIPTextModel names; safetensors weights, CLIP BPE tokenizer)",
        [](const nn::ClipTextOptions& o) -> TextEncoderPtr {
          auto m = nn::ClipText(o).ptr();
          m->set_config({{"architecture", "clip_text"}, {"fields", to_json(o)}});
          return m;
        });
    r->add<nn::T5EncoderOptions>(
        "t5_encoder",
        "T5 encoder (transformers' T5EncoderModel names: SD3's text_encoder_3, Flux's text_encoder_2; "
        "SentencePiece tokenizer); pooled = masked mean",
        [](const nn::T5EncoderOptions& o) -> TextEncoderPtr {
          auto m = nn::T5Encoder(o).ptr();
          m->set_config({{"architecture", "t5_encoder"}, {"fields", to_json(o)}});
          return m;
        });
    // Tiny configurations for the shared family suite: 3 captions of up to 12 tokens.
    using models::Role;
    auto builder = [r](const std::string& name) {
      return [r, name](const json& fields) -> std::shared_ptr<torch::nn::Module> { return r->build(name, fields); };
    };
    models::Family byte(Role::kTextEncoder,
                        {{{"features", 16}, {"num_layers", 1}, {"num_heads", 2}, {"max_length", 12}}, {3, 12}});
    byte.build = builder("byte_text_encoder");
    models::add_family_info("byte_text_encoder", std::move(byte));
    models::Family clip(Role::kTextEncoder,
                        {{{"vocab_size", 40},
                          {"hidden_size", 16},
                          {"intermediate_size", 32},
                          {"num_hidden_layers", 2},
                          {"num_attention_heads", 2},
                          {"max_position_embeddings", 12},
                          {"eos_token_id", 39},
                          {"bos_token_id", 38},
                          {"pad_token_id", 0}},
                         {3, 12}},
                        [](const json& c) { return to_json(nn::clip_text_options_from_hf(c)); });
    clip.reference_key_map = [](const json&, const io::WeightSource& source) {
      return nn::clip_text_key_map(nn::is_whole_clip(source));
    };
    clip.reference_classes = {"CLIPTextModel", "CLIPTextModelWithProjection"};
    clip.reference_methods = {clip_forward()};
    clip.build = builder("clip_text");
    models::add_family_info("clip_text", std::move(clip));
    models::Family t5(Role::kTextEncoder,
                      {{{"vocab_size", 40},
                        {"d_model", 16},
                        {"d_kv", 8},
                        {"d_ff", 32},
                        {"num_layers", 2},
                        {"num_heads", 2},
                        {"relative_attention_num_buckets", 8},
                        {"relative_attention_max_distance", 16},
                        {"feed_forward_proj", "gated-gelu"},
                        {"max_length", 12}},
                       {3, 12}},
                      [](const json& c) { return to_json(nn::t5_encoder_options_from_hf(c)); });
    t5.reference_key_map = [](const json&, const io::WeightSource& source) {
      return nn::t5_encoder_key_map(source.contains("shared.weight"));
    };
    t5.reference_classes = {"T5EncoderModel"};
    t5.reference_methods = {t5_forward()};
    t5.build = builder("t5_encoder");
    models::add_family_info("t5_encoder", std::move(t5));
    return r;
  }();
  return *r;
}

TextEncoderPtr build(const std::string& name, const json& fields) {
  DEW_CHECK(fields.is_null() || fields.is_object(), "text_encoder \"", name, "\": fields must be an object, got ",
            fields.dump());
  return registry().build(name, fields.is_null() ? json::object() : fields);
}

TextEncoderPtr build(const json& record) {
  DEW_CHECK(record.is_object() && record.contains("architecture") && record["architecture"].is_string(),
            "text_encoder record: expected {\"architecture\": NAME, \"fields\": {...}}, got ", record.dump());
  for (auto it = record.begin(); it != record.end(); ++it)
    DEW_CHECK(it.key() == "architecture" || it.key() == "fields", "text_encoder record: unknown key \"", it.key(),
              "\"; valid keys: architecture, fields");
  return build(record["architecture"].get<std::string>(), record.value("fields", json::object()));
}

}  // namespace text_encoders

namespace nn {

// ---- ByteTextLayer ----

ByteTextLayerImpl::ByteTextLayerImpl(int64_t d, int64_t heads, double mlp_ratio, double dropout,
                                     const std::string& impl) {
  norm1 = register_module("norm1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d}).eps(1e-5)));
  attn = register_module("attn", SelfAttention(SelfAttentionOptions(d, heads).impl(impl).dropout(dropout)));
  norm2 = register_module("norm2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d}).eps(1e-5)));
  const auto hidden = static_cast<int64_t>(mlp_ratio * static_cast<double>(d));
  mlp = register_module("mlp", Mlp(MlpOptions(d, hidden).activation("gelu").dropout(dropout)));
}

Tensor ByteTextLayerImpl::forward(const Tensor& x, const Tensor& mask) {
  Tensor h = x + attn(layer_norm_affine(x, norm1), Rope{}, mask);
  return h + mlp(layer_norm_affine(h, norm2));
}

// ---- ByteTextEncoder ----

ByteTextEncoderImpl::ByteTextEncoderImpl(ByteTextEncoderOptions options_) : options(std::move(options_)) {
  const auto& o = options;
  const std::string w = "byte_text_encoder";
  DEW_CHECK(o.features() > 0, w, ": features must be > 0, got ", o.features());
  DEW_CHECK(o.num_layers() >= 0, w, ": num_layers must be >= 0, got ", o.num_layers());
  DEW_CHECK(o.num_heads() > 0 && o.features() % o.num_heads() == 0, w,
            ": num_heads must be > 0 and divide features, got num_heads ", o.num_heads(), " for features ",
            o.features());
  DEW_CHECK(o.mlp_ratio() > 0 && static_cast<int64_t>(o.mlp_ratio() * o.features()) > 0, w,
            ": mlp_ratio must be > 0 (hidden width >= 1), got ", o.mlp_ratio());
  DEW_CHECK(o.max_length() > 0, w, ": max_length must be > 0, got ", o.max_length());
  DEW_CHECK(o.dropout() >= 0 && o.dropout() < 1, w, ": dropout must be in [0, 1), got ", o.dropout());
  dtype_ = parse_compute_dtype(o.dtype(), w + ".dtype");
  check_attention_impl(o.attention_impl(), w + ".attention_impl");
  reset();
}

void ByteTextEncoderImpl::reset() {
  const auto& o = options;
  const int64_t d = o.features();
  token_embedding = register_module("token_embedding", torch::nn::Embedding(257, d));
  position_embedding = register_module("position_embedding", torch::nn::Embedding(o.max_length(), d));
  layers = register_module("layers", torch::nn::ModuleList());
  layer_list.clear();
  for (int64_t i = 0; i < o.num_layers(); ++i) {
    ByteTextLayer l(d, o.num_heads(), o.mlp_ratio(), o.dropout(), o.attention_impl());
    layers->push_back(l);
    layer_list.push_back(l);
  }
  final_norm = register_module("final_norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d}).eps(1e-5)));
  reset_parameters();
}

void ByteTextEncoderImpl::reset_parameters() {
  // Embeddings as GPT-2 / ViT (N(0, 0.02)); attention and MLP layers initialise themselves.
  torch::NoGradGuard no_grad;
  token_embedding->weight.normal_(0.0, 0.02);
  position_embedding->weight.normal_(0.0, 0.02);
}

std::pair<Tensor, Tensor> ByteTextEncoderImpl::tokenize(const std::vector<std::string>& texts) const {
  const int64_t b = static_cast<int64_t>(texts.size()), l = options.max_length();
  Tensor ids = at::zeros({b, l}, at::kLong);
  Tensor mask = at::zeros({b, l}, at::kBool);
  auto id = ids.accessor<int64_t, 2>();
  auto m = mask.accessor<bool, 2>();
  for (int64_t i = 0; i < b; ++i) {
    const std::string& s = texts[static_cast<size_t>(i)];
    const int64_t n = std::min<int64_t>(static_cast<int64_t>(s.size()), l);
    for (int64_t j = 0; j < n; ++j) {
      id[i][j] = static_cast<int64_t>(static_cast<unsigned char>(s[static_cast<size_t>(j)])) + 1;
      m[i][j] = true;
    }
  }
  return {ids, mask};
}

TextEncoding ByteTextEncoderImpl::forward(const Tensor& ids, const Tensor& mask_in) {
  const auto& o = options;
  DEW_CHECK(ids.defined(), "byte_text_encoder: ids are undefined");
  DEW_CHECK(ids.dim() == 2 && ids.scalar_type() == at::kLong, "byte_text_encoder: ids must be [B, L] int64, got ",
            ids.sizes(), " ", ids.scalar_type());
  const int64_t l = ids.size(1);
  DEW_CHECK(l >= 1 && l <= o.max_length(), "byte_text_encoder: ids length must be in [1, max_length = ", o.max_length(),
            "], got ", l);
  if (ids.numel() > 0) {
    const int64_t lo = ids.min().item<int64_t>(), hi = ids.max().item<int64_t>();
    DEW_CHECK(lo >= 0 && hi <= 256, "byte_text_encoder: ids must be in [0, 256] (byte + 1, 0 = padding), got [", lo,
              ", ", hi, "]");
  }
  Tensor mask = mask_in.defined() ? mask_in : ids.ne(0);
  DEW_CHECK(mask.scalar_type() == at::kBool && mask.sizes() == ids.sizes(), "byte_text_encoder: mask must be bool ",
            ids.sizes(), " like ids, got ", mask.scalar_type(), " ", mask.sizes());
  mask = mask.to(ids.device());

  Tensor h = at::embedding(token_embedding->weight, ids) + position_embedding->weight.narrow(0, 0, l).unsqueeze(0);
  h = h.to(dtype_);
  for (auto& layer : layer_list) {
    if (o.remat()) {
      h = remat(*layer, [layer, mask](const std::vector<Tensor>& in) mutable { return layer(in[0], mask); }, {h});
    } else {
      h = layer(h, mask);
    }
  }
  Tensor out = at::layer_norm(h.to(at::kFloat), {o.features()}, final_norm->weight, final_norm->bias, 1e-5);
  TextEncoding e;
  e.mask = mask;
  e.context = out * mask.unsqueeze(-1).to(at::kFloat);  // padding carries nothing
  e.pooled = masked_mean(out, mask);                    // zeros for a caption without tokens
  return e;
}

}  // namespace nn
}  // namespace dew

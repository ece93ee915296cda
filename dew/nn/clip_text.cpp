#include "dew/nn/clip_text.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <set>
#include <sstream>

#include "dew/core/error.h"
#include "dew/io/safetensors.h"

namespace fs = std::filesystem;

namespace dew::nn {

using at::Tensor;

ClipEncoderLayerImpl::ClipEncoderLayerImpl(const ClipTextOptions& o)
    : heads_(o.num_attention_heads()), act_(o.hidden_act()), impl_(o.attention_impl()) {
  const int64_t d = o.hidden_size(), f = o.intermediate_size();
  auto attn = register_module("self_attn", std::make_shared<torch::nn::Module>());
  q_proj = attn->register_module("q_proj", torch::nn::Linear(d, d));
  k_proj = attn->register_module("k_proj", torch::nn::Linear(d, d));
  v_proj = attn->register_module("v_proj", torch::nn::Linear(d, d));
  out_proj = attn->register_module("out_proj", torch::nn::Linear(d, d));
  layer_norm1 =
      register_module("layer_norm1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d}).eps(o.layer_norm_eps())));
  auto mlp = register_module("mlp", std::make_shared<torch::nn::Module>());
  fc1 = mlp->register_module("fc1", torch::nn::Linear(d, f));
  fc2 = mlp->register_module("fc2", torch::nn::Linear(f, d));
  layer_norm2 =
      register_module("layer_norm2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d}).eps(o.layer_norm_eps())));
}

void ClipEncoderLayerImpl::reset_parameters(int64_t num_layers) {
  torch::NoGradGuard no_grad;
  const double d = static_cast<double>(q_proj->weight.size(1)),
               n = static_cast<double>(std::max<int64_t>(1, num_layers));
  const double in_std = std::pow(d, -0.5) * std::pow(2 * n, -0.5);
  for (auto* lin : {&q_proj, &k_proj, &v_proj}) (*lin)->weight.normal_(0.0, in_std);
  out_proj->weight.normal_(0.0, std::pow(d, -0.5));
  fc1->weight.normal_(0.0, std::pow(2 * d, -0.5));
  fc2->weight.normal_(0.0, in_std);
  for (auto* lin : {&q_proj, &k_proj, &v_proj, &out_proj, &fc1, &fc2}) (*lin)->bias.zero_();
  for (auto* ln : {&layer_norm1, &layer_norm2}) {
    (*ln)->weight.fill_(1.0);
    (*ln)->bias.zero_();
  }
}

Tensor ClipEncoderLayerImpl::forward(const Tensor& x, const Tensor& mask) {
  const int64_t b = x.size(0), s = x.size(1), d = x.size(2), dh = d / heads_;
  const auto heads = [&](const Tensor& t) { return t.view({b, s, heads_, dh}).transpose(1, 2); };
  Tensor h = layer_norm_affine(x, layer_norm1);
  Tensor o = attention(heads(dense(h, q_proj)), heads(dense(h, k_proj)), heads(dense(h, v_proj)), mask, impl_, true);
  Tensor y = x + dense(o.transpose(1, 2).reshape({b, s, d}), out_proj);
  h = dense(layer_norm_affine(y, layer_norm2), fc1);
  h = act_ == "quick_gelu" ? h * at::sigmoid(1.702 * h) : at::gelu(h);
  return y + dense(h, fc2);
}

ClipTextImpl::ClipTextImpl(ClipTextOptions options_) : options(std::move(options_)) {
  const auto& o = options;
  const std::string w = "clip_text";
  DEW_CHECK(o.vocab_size() > 0, w, ": vocab_size must be > 0, got ", o.vocab_size());
  DEW_CHECK(o.hidden_size() > 0, w, ": hidden_size must be > 0, got ", o.hidden_size());
  DEW_CHECK(o.intermediate_size() > 0, w, ": intermediate_size must be > 0, got ", o.intermediate_size());
  DEW_CHECK(o.num_hidden_layers() >= 0, w, ": num_hidden_layers must be >= 0, got ", o.num_hidden_layers());
  DEW_CHECK(o.num_attention_heads() > 0 && o.hidden_size() % o.num_attention_heads() == 0, w,
            ": num_attention_heads must be > 0 and divide hidden_size, got ", o.num_attention_heads(),
            " for hidden_size ", o.hidden_size());
  DEW_CHECK(o.max_position_embeddings() >= 2, w, ": max_position_embeddings must be >= 2, got ",
            o.max_position_embeddings());
  DEW_CHECK(o.hidden_act() == "quick_gelu" || o.hidden_act() == "gelu", w, ".hidden_act: got \"", o.hidden_act(),
            "\", accepted: quick_gelu, gelu");
  DEW_CHECK(o.layer_norm_eps() > 0, w, ": layer_norm_eps must be > 0, got ", o.layer_norm_eps());
  dtype_ = parse_compute_dtype(o.dtype(), w + ".dtype");
  check_attention_impl(o.attention_impl(), w + ".attention_impl");
  reset();
  if (!o.weights().empty()) load_clip_text_weights(*this, o.weights());
  if (!o.tokenizer().empty()) {
    tokenizer_ = std::make_shared<const data::ClipTokenizer>(o.tokenizer());
    DEW_CHECK(tokenizer_->vocab_size() <= o.vocab_size(), w, ": the tokenizer \"", o.tokenizer(), "\" has ",
              tokenizer_->vocab_size(), " ids but vocab_size is ", o.vocab_size());
    DEW_CHECK(o.eos_token_id() == 2 || tokenizer_->eos_id() == o.eos_token_id(), w, ": the tokenizer's <|endoftext|>",
              " is id ", tokenizer_->eos_id(), " but eos_token_id is ", o.eos_token_id(),
              "; pooled would be read at the wrong token (set eos_token_id to ", tokenizer_->eos_id(), ")");
  }
}

void ClipTextImpl::reset() {
  const auto& o = options;
  const int64_t d = o.hidden_size();
  text_model = register_module("text_model", std::make_shared<torch::nn::Module>());
  embeddings = text_model->register_module("embeddings", std::make_shared<torch::nn::Module>());
  token_embedding = embeddings->register_module("token_embedding", torch::nn::Embedding(o.vocab_size(), d));
  position_embedding =
      embeddings->register_module("position_embedding", torch::nn::Embedding(o.max_position_embeddings(), d));
  encoder = text_model->register_module("encoder", std::make_shared<torch::nn::Module>());
  layers = encoder->register_module("layers", torch::nn::ModuleList());
  layer_list.clear();
  for (int64_t i = 0; i < o.num_hidden_layers(); ++i) {
    ClipEncoderLayer l(o);
    layers->push_back(l);
    layer_list.push_back(l);
  }
  final_layer_norm = text_model->register_module(
      "final_layer_norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d}).eps(o.layer_norm_eps())));
  if (o.projection_dim() > 0)
    text_projection = register_module("text_projection",
                                      torch::nn::Linear(torch::nn::LinearOptions(d, o.projection_dim()).bias(false)));
  reset_parameters();
}

void ClipTextImpl::reset_parameters() {
  torch::NoGradGuard no_grad;
  const double d = static_cast<double>(options.hidden_size());
  const double out_std = std::pow(d, -0.5);
  token_embedding->weight.normal_(0.0, 0.02);
  position_embedding->weight.normal_(0.0, 0.02);
  for (auto& l : layer_list) l->reset_parameters(options.num_hidden_layers());
  final_layer_norm->weight.fill_(1.0);
  final_layer_norm->bias.zero_();
  if (text_projection) text_projection->weight.normal_(0.0, out_std);
}

std::pair<Tensor, Tensor> ClipTextImpl::tokenize(const std::vector<std::string>& texts) const {
  DEW_CHECK(tokenizer_ != nullptr,
            "clip_text: tokenize() needs a tokenizer file: set the field \"tokenizer\" to a CLIP tokenizer.json, "
            "a vocab.json (merges.txt beside) or their folder (forward(ids, mask) works without one)");
  return tokenizer_->batch(texts, options.max_position_embeddings());
}

TextEncoding ClipTextImpl::forward(const Tensor& ids, const Tensor& mask_in) { return forward_hidden(ids, mask_in, 0); }

TextEncoding ClipTextImpl::forward_hidden(const Tensor& ids, const Tensor& mask_in, int64_t from_end) {
  DEW_CHECK(from_end >= 0 && from_end < options.num_hidden_layers(), "clip_text: from_end must be in [0, ",
            options.num_hidden_layers(), "), got ", from_end);
  TextEncoding e;
  const Outputs out = run(ids, mask_in, from_end, &e.mask);
  e.context = from_end > 0 ? out.penultimate_hidden_state : out.last_hidden_state;
  e.pooled = text_projection ? out.text_embeds : out.pooler_output;
  return e;
}

ClipTextImpl::Outputs ClipTextImpl::forward_outputs(const Tensor& ids, const Tensor& mask_in) {
  return run(ids, mask_in, options.num_hidden_layers() >= 2 ? 1 : 0, nullptr);
}

ClipTextImpl::Outputs ClipTextImpl::run(const Tensor& ids, const Tensor& mask_in, int64_t from_end, Tensor* mask_out) {
  const auto& o = options;
  DEW_CHECK(ids.defined(), "clip_text: ids are undefined");
  DEW_CHECK(ids.dim() == 2 && ids.scalar_type() == at::kLong, "clip_text: ids must be [B, S] int64, got ", ids.sizes(),
            " ", ids.scalar_type());
  const int64_t b = ids.size(0), s = ids.size(1), d = o.hidden_size();
  DEW_CHECK(s >= 1 && s <= o.max_position_embeddings(), "clip_text: sequence length must be in [1, ",
            o.max_position_embeddings(), "] (max_position_embeddings), got ", s);
  if (ids.numel() > 0) {
    const int64_t lo = ids.min().item<int64_t>(), hi = ids.max().item<int64_t>();
    DEW_CHECK(lo >= 0 && hi < o.vocab_size(), "clip_text: token ids must be in [0, ", o.vocab_size(), "), got [", lo,
              ", ", hi, "]");
  }
  Tensor mask = mask_in.defined() ? mask_in : at::ones_like(ids, ids.options().dtype(at::kBool));
  DEW_CHECK(mask.scalar_type() == at::kBool && mask.sizes() == ids.sizes(), "clip_text: mask must be bool ",
            ids.sizes(), " like ids, got ", mask.scalar_type(), " ", mask.sizes());
  mask = mask.to(ids.device());
  if (mask_out) *mask_out = mask;

  // A model moved to float64 (a float64 reference run) computes in float64 throughout; else in `dtype`, with
  // float32 outputs.
  const bool f64 = token_embedding->weight.scalar_type() == at::kDouble;
  const at::ScalarType dt = f64 ? at::kDouble : dtype_, out_dt = f64 ? at::kDouble : at::kFloat;
  Tensor h = at::embedding(token_embedding->weight, ids) + position_embedding->weight.narrow(0, 0, s).unsqueeze(0);
  h = h.to(dt);
  // Causal attention restricted to real keys, as CLIPTextTransformer's causal + padding masks.
  const Tensor causal = at::ones({s, s}, ids.options().dtype(at::kBool)).tril();
  const Tensor m4 = causal.view({1, 1, s, s}).logical_and(mask.view({b, 1, 1, s}));
  Outputs out;
  for (size_t i = 0; i < layer_list.size(); ++i) {
    auto& layer = layer_list[i];
    if (o.remat()) {
      h = remat(*layer, [layer, m4](const std::vector<Tensor>& in) mutable { return layer(in[0], m4); }, {h});
    } else {
      h = layer(h, m4);
    }
    if (from_end > 0 && int64_t(i) + 1 == o.num_hidden_layers() - from_end) out.penultimate_hidden_state = h.to(out_dt);
  }
  out.last_hidden_state =
      at::layer_norm(h.to(out_dt), {d}, final_layer_norm->weight, final_layer_norm->bias, o.layer_norm_eps());
  // transformers' rule (CLIPTextTransformer.forward): eos_token_id 2 marks OpenAI's old configs, pooled at
  // argmax(ids) (the eot id is the largest); else at the first eos_token_id (position 0 when there is none).
  const Tensor index = o.eos_token_id() == 2 ? ids.argmax(-1) : ids.eq(o.eos_token_id()).to(at::kInt).argmax(-1);
  out.pooler_output = out.last_hidden_state.gather(1, index.view({b, 1, 1}).expand({b, 1, d})).squeeze(1);
  if (text_projection) out.text_embeds = at::linear(out.pooler_output, text_projection->weight);
  return out;
}

// ---------------------------------------------------------------------------------------------------------
// Weights
// ---------------------------------------------------------------------------------------------------------

io::KeyMap clip_text_key_map(bool whole_clip) {
  io::KeyMap map;
  // A whole CLIPModel file: the vision tower, both projections and the logit scale are not the text model's.
  if (whole_clip) map.skip(R"((vision_model\..*|visual_projection\..*|text_projection\..*|logit_scale))");
  map.skip(R"((text_model\.)?embeddings\.position_ids)");                     // a buffer in older transformers files
  map.regex(R"(^(?!text_model\.|text_projection\.)(.*)$)", "text_model.$1");  // a bare CLIPTextTransformer file
  return map;
}

bool is_whole_clip(const io::WeightSource& source) {
  const auto names = source.names();
  return std::any_of(names.begin(), names.end(), [](const std::string& n) { return n.rfind("vision_model.", 0) == 0; });
}

void load_clip_text_weights(ClipTextImpl& model, const std::string& path) {
  const auto source = io::WeightSource::open(path);
  io::LoadOptions o;
  o.require_buffers = false;
  io::load_weights(model, source, clip_text_key_map(is_whole_clip(source)), o);
}

void save_clip_text_weights(const ClipTextImpl& model, const std::string& path) {
  std::map<std::string, Tensor> tensors;
  for (const auto& p : model.named_parameters())
    tensors[p.key()] = p.value().detach().to(at::kCPU, at::kFloat).contiguous();
  io::save_safetensors(path, tensors, {{"format", "pt"}});
}

}  // namespace dew::nn

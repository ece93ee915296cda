#include "dew/interop/hf_decoder.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <set>

#include "dew/data/tokenizer.h"
#include "dew/io/files.h"
#include "dew/io/safetensors.h"
#include "dew/io/weights.h"
#include "dew/nn/weights_dtype.h"

namespace fs = std::filesystem;

namespace dew {
namespace interop {
namespace {

bool has_sliding_layers(const nn::CausalTransformerOptions& o) {
  for (const auto& t : o.layer_types())
    if (t == "sliding_attention") return true;
  return false;
}

std::vector<std::string> layer_types_of(const nn::CausalTransformerOptions& o) {
  std::vector<std::string> out;
  for (int64_t i = 0; i < o.num_layers(); ++i) out.push_back(o.layer_type(i));
  return out;
}

json id_or_null(int64_t id) { return id >= 0 ? json(id) : json(nullptr); }

void write_json(const fs::path& path, const json& j) {
  std::ofstream f(path, std::ios::trunc);
  DEW_CHECK(f.good(), "cannot write \"", path.string(), "\"");
  f << j.dump(2) << "\n";
  DEW_CHECK(f.good(), "writing \"", path.string(), "\" failed");
}

json read_json(const fs::path& path, const std::string& what) {
  const std::string text = io::read_file(path.string(), what);
  io::check_json_depth(text, path.string());  // before parsing: copies and error quotes recurse per level
  json j = json::parse(text, nullptr, false);
  DEW_CHECK(!j.is_discarded() && j.is_object(), what, ": \"", path.string(), "\" is not a JSON object");
  return j;
}

}  // namespace

std::string infer_family(const nn::CausalTransformerOptions& o) {
  if (o.scale_offset() == 1.0 || o.sandwich_norms()) return "gemma3_text";
  return o.qk_norm() ? "qwen3" : "llama";
}

void check_family(const nn::CausalTransformerOptions& o, const std::string& family) {
  const auto& fams = decoder_families();
  DEW_CHECK(std::find(fams.begin(), fams.end(), family) != fams.end(), "export: unknown family \"", family,
            "\"; accepted: llama, qwen3, gemma3_text");
  auto refuse = [&](const std::string& feature) { fail("export: ", family, " cannot express ", feature); };
  if (o.partial_rotary_factor() != 1.0)
    refuse(str("partial_rotary_factor ", o.partial_rotary_factor(), " (its RoPE rotates whole heads)"));
  if (family == "gemma3_text") {
    if (!o.qk_norm()) refuse("qk_norm = false (Gemma 3 always normalises queries and keys)");
    if (!o.sandwich_norms()) refuse("sandwich_norms = false (Gemma 3 always normalises branch outputs)");
    if (o.scale_offset() != 1.0) refuse(str("scale_offset ", o.scale_offset(), " (Gemma norms scale by 1 + weight)"));
    double want = std::sqrt(static_cast<double>(o.emb_features()));
    if (std::abs(o.embedding_scale() - want) > 1e-6 * want)
      refuse(str("embedding_scale ", o.embedding_scale(), " (Gemma 3 scales embeddings by sqrt(hidden_size) = ", want,
                 ")"));
    return;
  }
  if (o.mlp() != "swiglu") refuse(str("mlp \"", o.mlp(), "\" (the family's runtimes implement silu gates only)"));
  if (o.sandwich_norms()) refuse("sandwich_norms (norms on branch outputs)");
  if (o.scale_offset() != 0.0) refuse(str("scale_offset ", o.scale_offset(), " (its norms scale by weight)"));
  if (o.embedding_scale() != 1.0) refuse(str("embedding_scale ", o.embedding_scale()));
  if (o.final_logit_softcap() != 0.0) refuse(str("final_logit_softcap ", o.final_logit_softcap()));
  if (has_sliding_layers(o)) refuse("sliding_attention layers");
  if (family == "llama" && o.qk_norm()) refuse("qk_norm (Llama has no query/key norms)");
  if (family == "qwen3" && !o.qk_norm()) refuse("qk_norm = false (Qwen3 always normalises queries and keys)");
}

json hf_config(const nn::CausalTransformerOptions& o, const std::string& family, int64_t bos_id, int64_t eos_id,
               int64_t pad_id) {
  check_family(o, family);
  json c = {{"model_type", family},
            {"vocab_size", o.vocab_size()},
            {"hidden_size", o.emb_features()},
            {"intermediate_size", o.mlp_hidden()},
            {"num_hidden_layers", o.num_layers()},
            {"num_attention_heads", o.num_heads()},
            {"num_key_value_heads", o.kv_heads()},
            {"head_dim", o.head_size()},
            {"max_position_embeddings", o.max_seq_len()},
            {"rms_norm_eps", o.norm_eps()},
            {"rope_theta", o.rope_theta()},
            {"rope_scaling", nullptr},
            {"attention_bias", o.attention_bias()},
            {"attention_dropout", 0.0},
            {"tie_word_embeddings", o.tie_embeddings()},
            {"initializer_range", o.init_std()},
            {"use_cache", true},
            {"torch_dtype", "float32"},
            {"bos_token_id", id_or_null(bos_id)},
            {"eos_token_id", id_or_null(eos_id)},
            {"pad_token_id", id_or_null(pad_id)}};
  if (family == "llama") {
    c["architectures"] = {"LlamaForCausalLM"};
    c["hidden_act"] = "silu";
    c["mlp_bias"] = false;
    c["pretraining_tp"] = 1;
  } else if (family == "qwen3") {
    c["architectures"] = {"Qwen3ForCausalLM"};
    c["hidden_act"] = "silu";
    c["use_sliding_window"] = false;
    c["sliding_window"] = nullptr;
    c["max_window_layers"] = o.num_layers();
  } else {
    c["architectures"] = {"Gemma3ForCausalLM"};
    c["hidden_activation"] = o.mlp() == "swiglu" ? "silu" : "gelu_pytorch_tanh";
    c["query_pre_attn_scalar"] = o.head_size();  // our attention scale is head_dim^-0.5
    c["sliding_window"] = o.sliding_window();
    auto types = layer_types_of(o);
    c["layer_types"] = types;
    // Older transformers derive the layer kinds from a period instead: write it when one fits.
    for (int64_t p = 1; p <= o.num_layers(); ++p) {
      bool fits = true;
      for (int64_t i = 0; i < o.num_layers(); ++i) fits &= (types[i] == "full_attention") == ((i + 1) % p == 0);
      if (fits) {
        c["sliding_window_pattern"] = p;
        break;
      }
    }
    c["rope_local_base_freq"] = o.sliding_rope_theta().value_or(o.rope_theta());
    c["final_logit_softcapping"] = o.final_logit_softcap() > 0 ? json(o.final_logit_softcap()) : json(nullptr);
    c["attn_logit_softcapping"] = nullptr;
  }
  return c;
}

void save_hf_layout(const std::map<std::string, at::Tensor>& params, const json& config, const std::string& dir) {
  fs::create_directories(dir);
  io::save_safetensors((fs::path(dir) / "model.safetensors").string(), params, {{"format", "pt"}});
  write_json(fs::path(dir) / "config.json", config);
}

void save_pretrained_decoder(nn::CausalTransformer& model, const std::string& dir, const data::Tokenizer* tokenizer,
                             const std::string& family) {
  const auto& o = model->options;
  std::string fam = family == "auto" ? infer_family(o) : family;
  check_family(o, fam);
  int64_t bos = -1, eos = -1, pad = -1;
  if (tokenizer) {
    DEW_CHECK(tokenizer->vocab_size() <= o.vocab_size(), "export: the tokenizer has ", tokenizer->vocab_size(),
              " ids but the model's vocab_size is ", o.vocab_size());
    bos = tokenizer->bos_id();
    eos = tokenizer->eos_id();
    pad = tokenizer->pad_id();
  }
  std::map<std::string, at::Tensor> params;
  for (const auto& p : model->named_parameters(/*recurse=*/true)) {
    std::string name = p.key().rfind("lm_head.", 0) == 0 ? p.key() : "model." + p.key();
    params[name] = p.value().detach().to(at::kCPU, at::kFloat).contiguous();
  }
  save_hf_layout(params, hf_config(o, fam, bos, eos, pad), dir);
  json gen = {{"_from_model_config", true}};
  if (bos >= 0) gen["bos_token_id"] = bos;
  if (eos >= 0) gen["eos_token_id"] = eos;
  if (pad >= 0) gen["pad_token_id"] = pad;
  write_json(fs::path(dir) / "generation_config.json", gen);
  if (tokenizer) tokenizer->save(dir);
}

void add_chat_template(const std::string& dir, const std::string& jinja) {
  const fs::path path = fs::path(dir) / "tokenizer_config.json";
  json config = fs::exists(path) ? read_json(path, "export") : json::object();
  config["chat_template"] = jinja;
  write_json(path, config);
}

nn::CausalTransformer load_pretrained_decoder(const std::string& dir, at::ScalarType weights_dtype) {
  fs::path root(dir);
  io::check_folder_links(dir, "model folder");
  json config = read_json(root / "config.json", "import");
  bool dew_layout = config.value("architecture", "") == "causal_transformer";
  // Qwen3-VL (Qwen-Image 2.1's text encoder): its language model, read from text_config and model.language_model.*;
  // the vision tower is not read (text prompts only).
  const bool vl = config.value("model_type", "") == "qwen3_vl";
  if (vl) {
    DEW_CHECK(config.contains("text_config") && config["text_config"].is_object(), (root / "config.json").string(),
              ": a qwen3_vl config without text_config");
    json text = config["text_config"];
    if (!text.contains("tie_word_embeddings")) text["tie_word_embeddings"] = config.value("tie_word_embeddings", false);
    config = text;
  }
  nn::CausalTransformerOptions options =
      dew_layout ? from_json<nn::CausalTransformerOptions>(config.value("fields", json::object()), "config.json fields")
                 : nn::options_from_hf_config(config);
  nn::CausalTransformer model = nn::build_weights_in(weights_dtype, [&] { return nn::CausalTransformer(options); });

  // model.safetensors or its shard index; transformers names carry "model." before the decoder's (a
  // save_hf_layout folder holds dew's own names).
  io::KeyMap map = dew_layout ? io::KeyMap() : nn::hf_decoder_key_map(options);
  if (vl) map.skip(R"(model\.visual\..*)").prefix("language_model.", "");  // after "model." is dropped
  io::LoadOptions lo;
  lo.require_buffers = false;  // the RoPE tables are computed, not stored
  io::load_weights(*model, io::WeightSource::open(root.string()), map, lo);
  model->eval();
  return model;
}

namespace {

// diffusers' QWENIMAGE21_SYSTEM_PROMPT and the template get_qwenimage21_prompt_embeds builds.
constexpr const char* kQwenImageSystem = "Comprehend and analyze the provided prompt.";

std::string qwen_system_turn() { return std::string("<|im_start|>system\n") + kQwenImageSystem + "<|im_end|>\n"; }

}  // namespace

std::string QwenImageTextEncoder::render(const std::string& prompt) {
  return qwen_system_turn() + "<|im_start|>user\n" + (prompt.empty() ? " " : prompt) +
         "<|im_end|>\n<|im_start|>assistant\n";
}

QwenImageTextEncoder::QwenImageTextEncoder(const std::string& text_encoder, const std::string& tokenizer,
                                           at::ScalarType weights_dtype)
    : model_(load_pretrained_decoder(text_encoder, weights_dtype)), tok_(data::load_tokenizer(tokenizer)) {
  for (const char* special : {"<|im_start|>", "<|im_end|>"})
    DEW_CHECK(tok_->piece_to_id(special) >= 0, "Qwen-Image text path: the tokenizer ", tokenizer, " has no ", special,
              " token (a Qwen tokenizer.json is needed)");
  drop_ = int64_t(tok_->encode(qwen_system_turn()).size());
}

void QwenImageTextEncoder::check_prompt(const std::string& prompt, size_t index) {
  // The edit pipeline's prompts carry images at these tokens, which only its vision tower can fill.
  for (const char* vision : {"<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"})
    DEW_CHECK(prompt.find(vision) == std::string::npos, "Qwen-Image text path: prompt ", index, " holds ", vision,
              ": image-conditioned (edit) prompts are not supported; accepted: text-to-image prompts, without the "
              "vision tokens");
}

QwenImageTextEncoder::States QwenImageTextEncoder::encode(const std::vector<std::string>& prompts) {
  DEW_CHECK(!prompts.empty(), "Qwen-Image text path: no prompts");
  for (size_t i = 0; i < prompts.size(); ++i) check_prompt(prompts[i], i);
  at::NoGradGuard ng;
  std::vector<std::vector<int64_t>> ids;
  int64_t longest = 0, kept = 0;
  for (const auto& p : prompts) {
    ids.push_back(tok_->encode(render(p)));
    DEW_CHECK(int64_t(ids.back().size()) <= model_->options.max_seq_len(), "Qwen-Image text path: a prompt of ",
              ids.back().size(), " tokens exceeds the text encoder's max_position_embeddings ",
              model_->options.max_seq_len());
    longest = std::max<int64_t>(longest, int64_t(ids.back().size()));
    kept = std::max<int64_t>(kept, int64_t(ids.back().size()) - drop_);
  }
  // Left-padded as the pipeline batches them; padding neither advances positions nor is attended.
  const int64_t b = int64_t(prompts.size());
  at::Tensor batch = at::zeros({b, longest}, at::kLong), valid = at::zeros({b, longest}, at::kBool);
  for (int64_t i = 0; i < b; ++i) {
    const int64_t n = int64_t(ids[size_t(i)].size());
    batch[i].narrow(0, longest - n, n).copy_(at::tensor(ids[size_t(i)], at::kLong));
    valid[i].narrow(0, longest - n, n).fill_(true);
  }
  const auto device = model_->head_weight().device();
  const at::Tensor h = model_->hidden_states(batch.to(device), {}, {}, valid.to(device), nullptr, /*final_norm=*/false)
                           .to(at::kFloat)
                           .cpu();
  States out{at::zeros({b, kept, h.size(2)}, at::kFloat), at::zeros({b, kept}, at::kLong)};
  for (int64_t i = 0; i < b; ++i) {
    const int64_t n = int64_t(ids[size_t(i)].size()) - drop_;
    out.states[i].narrow(0, 0, n).copy_(h[i].narrow(0, longest - n, n));
    out.mask[i].narrow(0, 0, n).fill_(1);
  }
  return out;
}

}  // namespace interop
}  // namespace dew

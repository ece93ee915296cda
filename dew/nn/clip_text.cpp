#include "dew/nn/clip_text.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <wctype.h>
#include <locale.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <set>
#include <sstream>

#include "dew/core/error.h"
#include "dew/data/tokenizer_detail.h"
#include "dew/io/safetensors.h"

namespace fs = std::filesystem;

namespace dew::nn {

using at::Tensor;

// ---------------------------------------------------------------------------------------------------------
// Tokenizer
// ---------------------------------------------------------------------------------------------------------

namespace {

// CLIP's pre-tokenizer (transformers' CLIPTokenizer.pat, re.IGNORECASE).
const char* kClipPattern =
    R"(<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+)";
const char* kBos = "<|startoftext|>";
const char* kEos = "<|endoftext|>";

/// Decodes the code point of the valid UTF-8 sequence s[i, i + n); false for an invalid one.
bool decode_utf8(const std::string& s, size_t i, size_t n, uint32_t& cp) {
  const auto b = [&](size_t k) { return static_cast<unsigned char>(s[i + k]); };
  if (n == 1) {
    cp = b(0);
    return cp < 0x80;
  }
  for (size_t k = 1; k < n; ++k)
    if ((b(k) & 0xC0) != 0x80) return false;
  if (n == 2) cp = ((b(0) & 0x1Fu) << 6) | (b(1) & 0x3Fu);
  else if (n == 3) cp = ((b(0) & 0x0Fu) << 12) | ((b(1) & 0x3Fu) << 6) | (b(2) & 0x3Fu);
  else cp = ((b(0) & 0x07u) << 18) | ((b(1) & 0x3Fu) << 12) | ((b(2) & 0x3Fu) << 6) | (b(3) & 0x3Fu);
  return true;
}

/// Python's str.isspace() code points (what `\s+` folds in whitespace_clean).
bool is_space(uint32_t c) {
  return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

/// Simple lowercase of one code point: ASCII directly, the rest through the C.UTF-8 locale's tables.
uint32_t to_lower(uint32_t c) {
  if (c < 0x80) return (c >= 'A' && c <= 'Z') ? c + 32 : c;
  static locale_t loc = newlocale(LC_CTYPE_MASK, "C.UTF-8", static_cast<locale_t>(0));
  if (loc == static_cast<locale_t>(0)) return c;
  return static_cast<uint32_t>(towlower_l(static_cast<wint_t>(c), loc));
}

/// whitespace_clean(text).lower(): runs of whitespace become one space, the ends are stripped.
std::string normalize(const std::string& text) {
  std::string out;
  bool pending_space = false;
  for (size_t i = 0; i < text.size();) {
    const size_t n = data::detail::utf8_length(text, i);
    uint32_t cp = 0;
    const bool ok = decode_utf8(text, i, n, cp);
    if (ok && is_space(cp)) {
      pending_space = !out.empty();
    } else {
      if (pending_space) out += ' ';
      pending_space = false;
      if (ok) data::detail::append_utf8(out, to_lower(cp));
      else out.append(text, i, n);  // invalid bytes pass through; the byte-level BPE still encodes them
    }
    i += n;
  }
  return out;
}

std::string pair_key(const std::string& a, const std::string& b) { return a + '\x01' + b; }

/// A special token's text in tokenizer_config.json: "x" or {"content": "x", ...}.
std::string token_text(const json& j) {
  if (j.is_string()) return j.get<std::string>();
  if (j.is_object() && j.contains("content") && j["content"].is_string()) return j["content"].get<std::string>();
  return "";
}

}  // namespace

struct ClipTokenizer::Regex {
  pcre2_code* code = nullptr;
  ~Regex() {
    if (code) pcre2_code_free(code);
  }
  /// Every non-empty match of the pattern in s, in order (re.findall).
  std::vector<std::string> find_all(const std::string& s) const {
    std::vector<std::string> out;
    std::unique_ptr<pcre2_match_data, decltype(&pcre2_match_data_free)> md(
        pcre2_match_data_create_from_pattern(code, nullptr), &pcre2_match_data_free);
    size_t pos = 0;
    while (pos < s.size()) {
      int rc = pcre2_match(code, reinterpret_cast<PCRE2_SPTR>(s.data()), s.size(), pos, 0, md.get(), nullptr);
      if (rc == PCRE2_ERROR_NOMATCH) break;
      DEW_CHECK(rc >= 0, "clip tokenizer: regex matching failed with PCRE2 error ", rc);
      PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md.get());
      const size_t b = ov[0], e = ov[1];
      if (e == b) {
        pos = b + data::detail::utf8_length(s, b);
        continue;
      }
      out.push_back(s.substr(b, e - b));
      pos = e;
    }
    return out;
  }
};

ClipTokenizer::~ClipTokenizer() = default;

ClipTokenizer::ClipTokenizer(const std::string& path) {
  DEW_CHECK(!path.empty(), "clip tokenizer: the path is empty (want tokenizer.json, vocab.json or their folder)");
  std::error_code ec;
  fs::path file(path);
  if (fs::is_directory(file, ec)) {
    if (fs::is_regular_file(file / "tokenizer.json", ec)) file /= "tokenizer.json";
    else if (fs::is_regular_file(file / "vocab.json", ec)) file /= "vocab.json";
    else fail("clip tokenizer: folder \"", path, "\" holds neither tokenizer.json nor vocab.json (+ merges.txt)");
  }
  json j = json::parse(data::detail::read_file(file.string(), "clip tokenizer"), nullptr, false);
  DEW_CHECK(!j.is_discarded() && j.is_object(), "clip tokenizer: \"", file.string(), "\" is not a JSON object");

  auto add_vocab = [&](const json& v, const std::string& where) {
    for (auto it = v.begin(); it != v.end(); ++it) {
      DEW_CHECK(it.value().is_number_integer() && it.value().get<int64_t>() >= 0, "clip tokenizer: ", where, " \"",
                it.key(), "\" needs a non-negative integer id, got ", it.value().dump());
      const int64_t id = it.value().get<int64_t>();
      vocab_[it.key()] = id;
      vocab_size_ = std::max(vocab_size_, id + 1);
    }
  };
  auto add_merge = [&](const std::string& a, const std::string& b, int64_t rank, const std::string& where) {
    DEW_CHECK(vocab_.count(a + b), "clip tokenizer: merge ", rank, " (\"", a, "\", \"", b, "\") of ", where,
              " makes \"", a + b, "\", which is not in the vocabulary");
    ranks_.emplace(pair_key(a, b), rank);
  };
  auto split_merge = [&](const std::string& s, int64_t rank, const std::string& where, std::string& a, std::string& b) {
    const size_t sp = s.find(' ');
    DEW_CHECK(sp != std::string::npos && sp > 0 && sp + 1 < s.size() && s.find(' ', sp + 1) == std::string::npos,
              "clip tokenizer: merge ", rank, " \"", s, "\" of ", where, " must be two pieces separated by one space");
    a = s.substr(0, sp);
    b = s.substr(sp + 1);
  };

  std::string unk_piece = kEos;  // CLIPTokenizer's unk_token
  if (j.contains("model")) {     // tokenizer.json (CLIPTokenizerFast)
    const json& m = j["model"];
    const std::string where = "\"" + file.string() + "\"";
    DEW_CHECK(m.is_object() && m.value("type", "BPE") == "BPE", "clip tokenizer: ", where, " model.type must be BPE");
    DEW_CHECK(m.contains("vocab") && m["vocab"].is_object(), "clip tokenizer: ", where, " has no model.vocab object");
    const std::string suffix = m.contains("end_of_word_suffix") && m["end_of_word_suffix"].is_string()
                                   ? m["end_of_word_suffix"].get<std::string>() : "</w>";
    DEW_CHECK(suffix == "</w>", "clip tokenizer: ", where, " model.end_of_word_suffix is \"", suffix,
              "\"; CLIP's BPE uses \"</w>\"");
    add_vocab(m["vocab"], "model.vocab");
    if (j.contains("added_tokens") && j["added_tokens"].is_array())
      for (const auto& t : j["added_tokens"])
        if (t.is_object() && t.contains("content") && t.contains("id") && t["content"].is_string())
          add_vocab(json{{t["content"].get<std::string>(), t["id"]}}, "added_tokens");
    int64_t rank = 0;
    for (const auto& e : m.value("merges", json::array())) {
      std::string a, b;
      if (e.is_string()) {
        split_merge(e.get<std::string>(), rank, where, a, b);
      } else {
        DEW_CHECK(e.is_array() && e.size() == 2 && e[0].is_string() && e[1].is_string(), "clip tokenizer: merge ",
                  rank, " of ", where, " must be \"a b\" or [\"a\", \"b\"], got ", e.dump());
        a = e[0].get<std::string>();
        b = e[1].get<std::string>();
      }
      add_merge(a, b, rank++, where);
    }
    if (m.contains("unk_token") && m["unk_token"].is_string()) unk_piece = m["unk_token"].get<std::string>();
  } else {  // vocab.json + merges.txt (CLIPTokenizer)
    add_vocab(j, "\"" + file.string() + "\"");
    const fs::path merges = file.parent_path() / "merges.txt";
    const std::string text = data::detail::read_file(merges.string(), "clip tokenizer (merges.txt beside vocab.json)");
    std::istringstream lines(text);
    std::string line;
    int64_t rank = 0;
    bool first = true;
    while (std::getline(lines, line)) {
      if (!line.empty() && line.back() == '\r') line.pop_back();
      if (first && line.rfind("#version", 0) == 0) {
        first = false;
        continue;
      }
      first = false;
      if (line.empty()) continue;
      std::string a, b;
      split_merge(line, rank, "\"" + merges.string() + "\"", a, b);
      add_merge(a, b, rank++, "\"" + merges.string() + "\"");
    }
  }
  auto id_of = [&](const std::string& piece) -> int64_t {
    auto it = vocab_.find(piece);
    return it == vocab_.end() ? -1 : it->second;
  };
  bos_ = id_of(kBos);
  eos_ = id_of(kEos);
  DEW_CHECK(bos_ >= 0 && eos_ >= 0, "clip tokenizer: \"", file.string(), "\" lacks ", kBos, " or ", kEos,
            " in its vocabulary (CLIP's begin / end tokens)");
  unk_ = id_of(unk_piece);
  pad_ = eos_;
  const fs::path config = file.parent_path() / "tokenizer_config.json";
  if (fs::is_regular_file(config, ec)) {
    json c = json::parse(data::detail::read_file(config.string(), "clip tokenizer"), nullptr, false);
    if (c.is_object() && c.contains("pad_token")) {
      const std::string pad = token_text(c["pad_token"]);
      DEW_CHECK(id_of(pad) >= 0, "clip tokenizer: pad_token \"", pad, "\" of \"", config.string(),
                "\" is not in the vocabulary");
      pad_ = id_of(pad);
    }
  }
  regex_ = std::make_unique<Regex>();
  int err = 0;
  PCRE2_SIZE offset = 0;
  regex_->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(kClipPattern), PCRE2_ZERO_TERMINATED,
                               PCRE2_UTF | PCRE2_UCP | PCRE2_CASELESS | PCRE2_MATCH_INVALID_UTF, &err, &offset, nullptr);
  DEW_CHECK(regex_->code != nullptr, "clip tokenizer: CLIP's regex does not compile (PCRE2 error ", err, ")");
}

void ClipTokenizer::bpe(const std::string& word, std::vector<int64_t>& ids) const {
  std::vector<std::string> sym;
  for (size_t i = 0; i < word.size();) {
    const size_t n = data::detail::utf8_length(word, i);
    sym.push_back(word.substr(i, n));
    i += n;
  }
  if (sym.empty()) return;
  sym.back() += "</w>";
  while (sym.size() > 1) {
    int64_t best = -1;
    size_t at = 0;
    for (size_t i = 0; i + 1 < sym.size(); ++i) {
      auto r = ranks_.find(pair_key(sym[i], sym[i + 1]));
      if (r != ranks_.end() && (best < 0 || r->second < best)) {
        best = r->second;
        at = i;
      }
    }
    if (best < 0) break;
    sym[at] += sym[at + 1];
    sym.erase(sym.begin() + static_cast<std::ptrdiff_t>(at) + 1);
  }
  for (const auto& s : sym) {
    auto it = vocab_.find(s);
    if (it != vocab_.end()) {
      ids.push_back(it->second);
    } else {
      DEW_CHECK(unk_ >= 0, "clip tokenizer: the piece \"", s, "\" is not in the vocabulary and there is no unk token");
      ids.push_back(unk_);
    }
  }
}

std::vector<int64_t> ClipTokenizer::encode(const std::string& text) const {
  std::vector<int64_t> ids;
  for (const auto& w : regex_->find_all(normalize(text))) {
    if (w == kBos) {
      ids.push_back(bos_);
    } else if (w == kEos) {
      ids.push_back(eos_);
    } else {
      std::string mapped;
      for (unsigned char c : w) mapped += data::detail::byte_to_unicode()[c];
      bpe(mapped, ids);
    }
  }
  return ids;
}

std::pair<Tensor, Tensor> ClipTokenizer::batch(const std::vector<std::string>& texts, int64_t length) const {
  DEW_CHECK(length >= 2, "clip tokenizer: length must be >= 2 (bos and eos), got ", length);
  const int64_t b = static_cast<int64_t>(texts.size());
  Tensor ids = at::full({b, length}, pad_, at::kLong);
  Tensor mask = at::zeros({b, length}, at::kBool);
  auto id = ids.accessor<int64_t, 2>();
  auto m = mask.accessor<bool, 2>();
  for (int64_t i = 0; i < b; ++i) {
    std::vector<int64_t> t = encode(texts[static_cast<size_t>(i)]);
    if (static_cast<int64_t>(t.size()) > length - 2) t.resize(static_cast<size_t>(length - 2));
    int64_t j = 0;
    id[i][j++] = bos_;
    for (int64_t x : t) id[i][j++] = x;
    id[i][j++] = eos_;
    for (int64_t k = 0; k < j; ++k) m[i][k] = true;
  }
  return {ids, mask};
}

// ---------------------------------------------------------------------------------------------------------
// Model
// ---------------------------------------------------------------------------------------------------------

ClipEncoderLayerImpl::ClipEncoderLayerImpl(const ClipTextOptions& o)
    : heads_(o.num_attention_heads()), act_(o.hidden_act()), impl_(o.attention_impl()) {
  const int64_t d = o.hidden_size(), f = o.intermediate_size();
  auto attn = register_module("self_attn", std::make_shared<torch::nn::Module>());
  q_proj = attn->register_module("q_proj", torch::nn::Linear(d, d));
  k_proj = attn->register_module("k_proj", torch::nn::Linear(d, d));
  v_proj = attn->register_module("v_proj", torch::nn::Linear(d, d));
  out_proj = attn->register_module("out_proj", torch::nn::Linear(d, d));
  layer_norm1 = register_module("layer_norm1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d}).eps(o.layer_norm_eps())));
  auto mlp = register_module("mlp", std::make_shared<torch::nn::Module>());
  fc1 = mlp->register_module("fc1", torch::nn::Linear(d, f));
  fc2 = mlp->register_module("fc2", torch::nn::Linear(f, d));
  layer_norm2 = register_module("layer_norm2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d}).eps(o.layer_norm_eps())));
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
    tokenizer_ = std::make_shared<const ClipTokenizer>(o.tokenizer());
    DEW_CHECK(tokenizer_->vocab_size() <= o.vocab_size(), w, ": the tokenizer \"", o.tokenizer(), "\" has ",
              tokenizer_->vocab_size(), " ids but vocab_size is ", o.vocab_size());
    DEW_CHECK(o.eos_token_id() == 2 || tokenizer_->eos_id() == o.eos_token_id(), w, ": the tokenizer's ", kEos,
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
    text_projection = register_module(
        "text_projection", torch::nn::Linear(torch::nn::LinearOptions(d, o.projection_dim()).bias(false)));
  reset_parameters();
}

void ClipTextImpl::reset_parameters() {
  torch::NoGradGuard no_grad;
  const double d = static_cast<double>(options.hidden_size());
  const double layers_n = static_cast<double>(std::max<int64_t>(1, options.num_hidden_layers()));
  const double in_std = std::pow(d, -0.5) * std::pow(2 * layers_n, -0.5), out_std = std::pow(d, -0.5);
  const double fc_std = std::pow(2 * d, -0.5);
  token_embedding->weight.normal_(0.0, 0.02);
  position_embedding->weight.normal_(0.0, 0.02);
  for (auto& l : layer_list) {
    for (auto* lin : {&l->q_proj, &l->k_proj, &l->v_proj}) (*lin)->weight.normal_(0.0, in_std);
    l->out_proj->weight.normal_(0.0, out_std);
    l->fc1->weight.normal_(0.0, fc_std);
    l->fc2->weight.normal_(0.0, in_std);
    for (auto* lin : {&l->q_proj, &l->k_proj, &l->v_proj, &l->out_proj, &l->fc1, &l->fc2}) (*lin)->bias.zero_();
    for (auto* ln : {&l->layer_norm1, &l->layer_norm2}) {
      (*ln)->weight.fill_(1.0);
      (*ln)->bias.zero_();
    }
  }
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
  const auto& o = options;
  DEW_CHECK(from_end >= 0 && from_end < o.num_hidden_layers(), "clip_text: from_end must be in [0, ",
            o.num_hidden_layers(), "), got ", from_end);
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

  Tensor h = at::embedding(token_embedding->weight, ids) + position_embedding->weight.narrow(0, 0, s).unsqueeze(0);
  h = h.to(dtype_);
  // Causal attention restricted to real keys, as CLIPTextTransformer's causal + padding masks.
  const Tensor causal = at::ones({s, s}, ids.options().dtype(at::kBool)).tril();
  const Tensor m4 = causal.view({1, 1, s, s}).logical_and(mask.view({b, 1, 1, s}));
  Tensor hidden;  // the state after layer L - from_end (from_end >= 1)
  for (size_t i = 0; i < layer_list.size(); ++i) {
    auto& layer = layer_list[i];
    if (o.remat()) {
      h = remat(*layer, [layer, m4](const std::vector<Tensor>& in) mutable { return layer(in[0], m4); }, {h});
    } else {
      h = layer(h, m4);
    }
    if (from_end > 0 && int64_t(i) + 1 == o.num_hidden_layers() - from_end) hidden = h.to(at::kFloat);
  }
  Tensor out = at::layer_norm(h.to(at::kFloat), {d}, final_layer_norm->weight, final_layer_norm->bias,
                              o.layer_norm_eps());
  // transformers' rule (CLIPTextTransformer.forward): eos_token_id 2 marks OpenAI's old configs, pooled at
  // argmax(ids) (the eot id is the largest); else at the first eos_token_id (position 0 when there is none).
  const Tensor index = o.eos_token_id() == 2 ? ids.argmax(-1) : ids.eq(o.eos_token_id()).to(at::kInt).argmax(-1);
  TextEncoding e;
  e.context = from_end > 0 ? hidden : out;
  e.mask = mask;
  e.pooled = out.gather(1, index.view({b, 1, 1}).expand({b, 1, d})).squeeze(1);
  if (text_projection) e.pooled = at::linear(e.pooled, text_projection->weight);
  return e;
}

// ---------------------------------------------------------------------------------------------------------
// Weights
// ---------------------------------------------------------------------------------------------------------

ClipTextOptions clip_text_options_from_hf(const json& config_in) {
  const json& c = config_in.contains("text_config") ? config_in["text_config"] : config_in;
  DEW_CHECK(c.is_object(), "clip_text config.json: expected an object, got ", c.dump());
  const std::string type = c.value("model_type", std::string("clip_text_model"));
  DEW_CHECK(type == "clip_text_model", "clip_text config.json: model_type \"", type,
            "\" is not a CLIP text model (accepted: clip_text_model, or a CLIPConfig with text_config)");
  json fields = json::object();
  if (c.contains("architectures") && c["architectures"].is_array())
    for (const auto& a : c["architectures"])
      if (a == "CLIPTextModelWithProjection") fields["projection_dim"] = c.value("projection_dim", int64_t(512));
  for (const char* k : {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                        "max_position_embeddings", "hidden_act", "layer_norm_eps", "bos_token_id", "eos_token_id",
                        "pad_token_id"})
    if (c.contains(k) && !c[k].is_null()) fields[k] = c[k];
  return from_json<ClipTextOptions>(fields, "clip_text config.json");
}

io::KeyMap clip_text_key_map(bool whole_clip) {
  io::KeyMap map;
  // A whole CLIPModel file: the vision tower, both projections and the logit scale are not the text model's.
  if (whole_clip) map.skip(R"((vision_model\..*|visual_projection\..*|text_projection\..*|logit_scale))");
  map.skip(R"((text_model\.)?embeddings\.position_ids)");  // a buffer in older transformers files
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
  for (const auto& p : model.named_parameters()) tensors[p.key()] = p.value().detach().to(at::kCPU, at::kFloat).contiguous();
  io::save_safetensors(path, tensors, {{"format", "pt"}});
}

}  // namespace dew::nn

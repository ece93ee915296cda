#include "dew/data/clip_tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <locale.h>
#include <pcre2.h>
#include <wctype.h>

#include <filesystem>
#include <sstream>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include "dew/core/error.h"
#include "dew/data/tokenizer_detail.h"
#include "dew/io/files.h"

namespace fs = std::filesystem;

namespace dew::data {

using at::Tensor;
using json = nlohmann::json;

namespace {

// CLIP's pre-tokenizer (transformers' CLIPTokenizer.pat, re.IGNORECASE).
const char* kClipPattern =
    R"(<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+)";
const char* kClipBos = "<|startoftext|>";
const char* kClipEos = "<|endoftext|>";

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
    const size_t n = detail::utf8_length(text, i);
    uint32_t cp = 0;
    const bool ok = decode_utf8(text, i, n, cp);
    if (ok && is_space(cp)) {
      pending_space = !out.empty();
    } else {
      if (pending_space) out += ' ';
      pending_space = false;
      if (ok) detail::append_utf8(out, to_lower(cp));
      else out.append(text, i, n);  // invalid bytes pass through; the byte-level BPE still encodes them
    }
    i += n;
  }
  return out;
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
        pos = b + detail::utf8_length(s, b);
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
    io::check_folder_links(path, "clip tokenizer");
    if (fs::is_regular_file(file / "tokenizer.json", ec)) file /= "tokenizer.json";
    else if (fs::is_regular_file(file / "vocab.json", ec)) file /= "vocab.json";
    else fail("clip tokenizer: folder \"", path, "\" holds neither tokenizer.json nor vocab.json (+ merges.txt)");
  }
  const std::string text = io::read_file(file.string(), "clip tokenizer");
  io::check_json_depth(text, "clip tokenizer: " + file.string());
  json j = json::parse(text, nullptr, false);
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
    merges_.add(a, b, rank);
  };
  std::string unk_piece = kClipEos;  // CLIPTokenizer's unk_token
  if (j.contains("model")) {         // tokenizer.json (CLIPTokenizerFast)
    const json& m = j["model"];
    const std::string where = "\"" + file.string() + "\"";
    DEW_CHECK(m.is_object() && m.value("type", "BPE") == "BPE", "clip tokenizer: ", where, " model.type must be BPE");
    DEW_CHECK(m.contains("vocab") && m["vocab"].is_object(), "clip tokenizer: ", where, " has no model.vocab object");
    const std::string suffix = m.contains("end_of_word_suffix") && m["end_of_word_suffix"].is_string()
                                   ? m["end_of_word_suffix"].get<std::string>()
                                   : "</w>";
    DEW_CHECK(suffix == "</w>", "clip tokenizer: ", where, " model.end_of_word_suffix is \"", suffix,
              "\"; CLIP's BPE uses \"</w>\"");
    add_vocab(m["vocab"], "model.vocab");
    if (j.contains("added_tokens") && j["added_tokens"].is_array())
      for (const auto& t : j["added_tokens"])
        if (t.is_object() && t.contains("content") && t.contains("id") && t["content"].is_string())
          add_vocab(json{{t["content"].get<std::string>(), t["id"]}}, "added_tokens");
    int64_t rank = 0;
    for (const auto& e : m.value("merges", json::array())) {
      const auto [a, b] = detail::BpeMerges::parse(e, rank, "clip tokenizer: " + where);
      add_merge(a, b, rank++, where);
    }
    if (m.contains("unk_token") && m["unk_token"].is_string()) unk_piece = m["unk_token"].get<std::string>();
  } else {  // vocab.json + merges.txt (CLIPTokenizer)
    add_vocab(j, "\"" + file.string() + "\"");
    const fs::path merges = file.parent_path() / "merges.txt";
    const std::string text = io::read_file(merges.string(), "clip tokenizer (merges.txt beside vocab.json)");
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
      const std::string where = "\"" + merges.string() + "\"";
      const auto [a, b] = detail::BpeMerges::parse(line, rank, "clip tokenizer: " + where);
      add_merge(a, b, rank++, where);
    }
  }
  auto id_of = [&](const std::string& piece) -> int64_t {
    auto it = vocab_.find(piece);
    return it == vocab_.end() ? -1 : it->second;
  };
  bos_ = id_of(kClipBos);
  eos_ = id_of(kClipEos);
  DEW_CHECK(bos_ >= 0 && eos_ >= 0, "clip tokenizer: \"", file.string(), "\" lacks ", kClipBos, " or ", kClipEos,
            " in its vocabulary (CLIP's begin / end tokens)");
  unk_ = id_of(unk_piece);
  pad_ = eos_;
  const fs::path config = file.parent_path() / "tokenizer_config.json";
  if (fs::is_regular_file(config, ec)) {
    const std::string text = io::read_file(config.string(), "clip tokenizer");
    io::check_json_depth(text, "clip tokenizer: " + config.string());
    json c = json::parse(text, nullptr, false);
    if (c.is_object() && c.contains("pad_token")) {
      const std::string pad = detail::token_text(c["pad_token"]);
      DEW_CHECK(id_of(pad) >= 0, "clip tokenizer: pad_token \"", pad, "\" of \"", config.string(),
                "\" is not in the vocabulary");
      pad_ = id_of(pad);
    }
  }
  regex_ = std::make_unique<Regex>();
  int err = 0;
  PCRE2_SIZE offset = 0;
  regex_->code =
      pcre2_compile(reinterpret_cast<PCRE2_SPTR>(kClipPattern), PCRE2_ZERO_TERMINATED,
                    PCRE2_UTF | PCRE2_UCP | PCRE2_CASELESS | PCRE2_MATCH_INVALID_UTF, &err, &offset, nullptr);
  DEW_CHECK(regex_->code != nullptr, "clip tokenizer: CLIP's regex does not compile (PCRE2 error ", err, ")");
}

void ClipTokenizer::bpe(const std::string& word, std::vector<int64_t>& ids) const {
  for (const auto& s : merges_.apply(word, "</w>")) {
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
    if (w == kClipBos) {
      ids.push_back(bos_);
    } else if (w == kClipEos) {
      ids.push_back(eos_);
    } else {
      std::string mapped;
      for (unsigned char c : w) mapped += detail::byte_to_unicode()[c];
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

}  // namespace dew::data

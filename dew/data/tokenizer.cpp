#include "dew/data/tokenizer.h"

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "dew/core/strings.h"
#include "dew/data/tokenizer_detail.h"
#include "dew/io/files.h"

namespace fs = std::filesystem;

namespace dew {
namespace data {
namespace detail {

const std::array<std::string, 256>& byte_to_unicode() {
  static const std::array<std::string, 256> table = [] {
    std::array<std::string, 256> t;
    // Printable bytes keep their Latin-1 code point; the rest take U+0100 + n in byte order (GPT-2).
    auto printable = [](int b) {
      return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    };
    uint32_t n = 0;
    for (int b = 0; b < 256; ++b) {
      uint32_t cp = printable(b) ? static_cast<uint32_t>(b) : 256 + n++;
      append_utf8(t[b], cp);
    }
    return t;
  }();
  return table;
}

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

size_t utf8_length(const std::string& s, size_t i) {
  auto c = static_cast<unsigned char>(s[i]);
  size_t n = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 1;
  if (i + n > s.size()) return 1;
  for (size_t k = 1; k < n; ++k)
    if ((static_cast<unsigned char>(s[i + k]) & 0xC0) != 0x80) return 1;
  return n;
}

std::string token_text(const nlohmann::json& j) {
  if (j.is_string()) return j.get<std::string>();
  if (j.is_object() && j.contains("content") && j["content"].is_string()) return j["content"].get<std::string>();
  return "";
}

std::pair<std::string, std::string> BpeMerges::parse(const nlohmann::json& e, int64_t rank, const std::string& who) {
  if (e.is_string()) {  // "a b"
    const std::string s = e.get<std::string>();
    const size_t sp = s.find(' ');
    DEW_CHECK(sp != std::string::npos && sp > 0 && sp + 1 < s.size() && s.find(' ', sp + 1) == std::string::npos, who,
              ": merge ", rank, " \"", s, "\" must be two pieces separated by one space");
    return {s.substr(0, sp), s.substr(sp + 1)};
  }
  DEW_CHECK(e.is_array() && e.size() == 2 && e[0].is_string() && e[1].is_string(), who, ": merge ", rank,
            " must be \"a b\" or [\"a\", \"b\"], got ", options_detail::describe(e));
  return {e[0].get<std::string>(), e[1].get<std::string>()};
}

void BpeMerges::add(const std::string& a, const std::string& b, int64_t rank) { ranks_.emplace(a + '\x01' + b, rank); }

std::vector<std::string> BpeMerges::apply(const std::string& word, const std::string& end_of_word) const {
  std::vector<std::string> sym;
  for (size_t i = 0; i < word.size();) {
    const size_t n = utf8_length(word, i);
    sym.push_back(word.substr(i, n));
    i += n;
  }
  if (sym.empty()) return sym;
  sym.back() += end_of_word;
  while (sym.size() > 1) {
    int64_t best = -1;
    size_t at = 0;
    for (size_t i = 0; i + 1 < sym.size(); ++i) {
      const auto r = ranks_.find(sym[i] + '\x01' + sym[i + 1]);
      if (r != ranks_.end() && (best < 0 || r->second < best)) {
        best = r->second;
        at = i;
      }
    }
    if (best < 0) break;
    sym[at] += sym[at + 1];
    sym.erase(sym.begin() + static_cast<std::ptrdiff_t>(at) + 1);
  }
  return sym;
}

void write_hf_token_configs(const std::string& dir, const std::string& bos, const std::string& eos,
                            const std::string& pad, const std::string& unk, const std::string& tokenizer_class) {
  json config = {{"tokenizer_class", tokenizer_class},
                 {"clean_up_tokenization_spaces", false},
                 {"add_bos_token", !bos.empty()},
                 {"add_eos_token", false}};
  json map = json::object();
  auto put = [&](const char* key, const std::string& v) {
    config[key] = v.empty() ? json(nullptr) : json(v);
    if (!v.empty()) map[key] = v;
  };
  put("bos_token", bos);
  put("eos_token", eos);
  put("pad_token", pad);
  put("unk_token", unk);
  io::write_file_atomic((fs::path(dir) / "tokenizer_config.json").string(), config.dump(2) + "\n");
  io::write_file_atomic((fs::path(dir) / "special_tokens_map.json").string(), map.dump(2) + "\n");
}

}  // namespace detail

namespace {

void check_id(int64_t id, int64_t vocab, const char* who) {
  DEW_CHECK(id >= 0 && id < vocab, who, ": token id ", id, " is outside the vocabulary [0, ", vocab, ")");
}

/// Bytes as ids; id 256 is EOS when enabled.
class ByteTokenizer : public Tokenizer {
 public:
  explicit ByteTokenizer(ByteTokenizerOptions o) : o_(o) {}

  std::vector<int64_t> encode(const std::string& text, bool) const override {
    std::vector<int64_t> ids(text.size());
    for (size_t i = 0; i < text.size(); ++i) ids[i] = static_cast<unsigned char>(text[i]);
    return ids;
  }

  std::string decode(const std::vector<int64_t>& ids, bool skip_special) const override {
    std::string out;
    out.reserve(ids.size());
    for (int64_t id : ids) {
      check_id(id, vocab_size(), "byte tokenizer");
      if (id < 256) out += static_cast<char>(id);
      else if (!skip_special) out += kEos;
    }
    return out;
  }

  int64_t vocab_size() const override { return o_.eos ? 257 : 256; }
  int64_t eos_id() const override { return o_.eos ? 256 : -1; }

  std::string id_to_piece(int64_t id) const override {
    check_id(id, vocab_size(), "byte tokenizer");
    if (id == 256) return kEos;
    char buf[8];
    std::snprintf(buf, sizeof(buf), "<0x%02X>", static_cast<int>(id));
    return buf;
  }

  int64_t piece_to_id(const std::string& piece) const override {
    if (o_.eos && piece == kEos) return 256;
    unsigned v = 0;
    char tail = 0;
    if (piece.size() == 6 && std::sscanf(piece.c_str(), "<0x%2X>%c", &v, &tail) == 1 && piece[5] == '>') return v;
    return -1;
  }

  std::string name() const override { return "byte"; }
  json spec() const override { return {{"name", "byte"}, {"eos", o_.eos}}; }

  void save(const std::string& dir) const override {
    // A byte-level BPE with no merges whose vocabulary maps GPT-2's unicode stand-in of byte b to id b:
    // Hugging Face tokenizers then produce exactly our ids.
    json vocab = json::object();
    const auto& b2u = detail::byte_to_unicode();
    for (int b = 0; b < 256; ++b) vocab[b2u[b]] = b;
    json added = json::array();
    if (o_.eos)
      added.push_back({{"id", 256},
                       {"content", kEos},
                       {"single_word", false},
                       {"lstrip", false},
                       {"rstrip", false},
                       {"normalized", false},
                       {"special", true}});
    json byte_level = {
        {"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", false}, {"use_regex", false}};
    json file = {{"version", "1.0"},
                 {"truncation", nullptr},
                 {"padding", nullptr},
                 {"added_tokens", added},
                 {"normalizer", nullptr},
                 {"pre_tokenizer", byte_level},
                 {"post_processor", nullptr},
                 {"decoder", byte_level},
                 {"model",
                  {{"type", "BPE"},
                   {"dropout", nullptr},
                   {"unk_token", nullptr},
                   {"continuing_subword_prefix", nullptr},
                   {"end_of_word_suffix", nullptr},
                   {"fuse_unk", false},
                   {"byte_fallback", false},
                   {"ignore_merges", false},
                   {"vocab", vocab},
                   {"merges", json::array()}}}};
    io::write_file_atomic((fs::path(dir) / "tokenizer.json").string(), file.dump(2) + "\n");
    detail::write_hf_token_configs(dir, "", o_.eos ? kEos : "", "", "", "PreTrainedTokenizerFast");
  }

 private:
  static constexpr const char* kEos = "<eos>";
  ByteTokenizerOptions o_;
};

}  // namespace

Registry<const Tokenizer>& tokenizers() {
  static Registry<const Tokenizer>* r = [] {
    auto* reg = new Registry<const Tokenizer>("tokenizer");
    reg->add<ByteTokenizerOptions>(
        "byte", "raw bytes as ids 0..255, optional <eos> = 256; exact for any bytes",
        [](const ByteTokenizerOptions& o) -> TokenizerPtr { return std::make_shared<ByteTokenizer>(o); });
    reg->add<SentencePieceOptions>("sentencepiece",
                                   "SentencePiece tokenizer.model: unigram (Viterbi) or BPE, byte fallback",
                                   [](const SentencePieceOptions& o) { return detail::make_sentencepiece(o); });
    reg->add<HfBpeOptions>("hf_bpe", "Hugging Face tokenizer.json byte-level BPE: merges, added tokens, split regex",
                           [](const HfBpeOptions& o) { return detail::make_hf_bpe(o); });
    return reg;
  }();
  return *r;
}

TokenizerPtr load_tokenizer(const json& spec) {
  if (spec.is_string()) return load_tokenizer(spec.get<std::string>());
  return tokenizers().build(spec);
}

TokenizerPtr load_tokenizer(const std::string& spec) {
  if (spec == "byte") return tokenizers().build("byte", json::object());
  if (!spec.empty() && spec[0] == '{') {
    json j = json::parse(spec, nullptr, false);
    DEW_CHECK(!j.is_discarded(), "tokenizer: the spec \"", spec, "\" is not valid JSON");
    return load_tokenizer(j);
  }
  std::error_code ec;
  fs::path p(spec);
  if (fs::is_directory(p, ec)) {
    io::check_folder_links(spec, "tokenizer");
    if (fs::is_regular_file(p / "tokenizer.json", ec)) p /= "tokenizer.json";
    else if (fs::is_regular_file(p / "tokenizer.model", ec)) p /= "tokenizer.model";
    else fail("tokenizer: folder \"", spec, "\" holds neither tokenizer.json nor tokenizer.model");
  }
  DEW_CHECK(fs::is_regular_file(p, ec), "tokenizer: \"", spec,
            "\" is not \"byte\", an existing tokenizer.model / tokenizer.json file, or a folder holding one");
  std::string path = fs::absolute(p).lexically_normal().string();
  if (ends_with(path, ".json")) return tokenizers().build("hf_bpe", json{{"path", path}});
  if (ends_with(path, ".model")) return tokenizers().build("sentencepiece", json{{"path", path}});
  // Other names: a JSON document starts with '{', a ModelProto does not.
  std::ifstream f(path, std::ios::binary);
  char c = 0;
  while (f.get(c) && std::isspace(static_cast<unsigned char>(c))) {}
  return tokenizers().build(c == '{' ? "hf_bpe" : "sentencepiece", json{{"path", path}});
}

}  // namespace data
}  // namespace dew

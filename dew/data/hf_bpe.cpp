// Hugging Face tokenizer.json byte-level BPE: added tokens are split out first, then the pre-tokenizer
// (a Split regex and/or ByteLevel with GPT-2's regex) cuts the text into words, each word's bytes are
// mapped to GPT-2's unicode stand-ins and merged pair by pair in merge-rank order.
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <bitset>
#include <cctype>
#include <filesystem>
#include <unordered_map>

#include "dew/data/tokenizer_detail.h"
#include "dew/io/files.h"

namespace fs = std::filesystem;

namespace dew {
namespace data {
namespace {

// GPT-2's pre-tokenizer regex (ByteLevel with use_regex = true).
const char* kGpt2Pattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

/// A compiled PCRE2 pattern (UTF + Unicode properties; invalid UTF-8 in subjects is tolerated).
class Regex {
 public:
  Regex(const std::string& pattern, bool literal, const std::string& where) {
    int err = 0;
    PCRE2_SIZE offset = 0;
    uint32_t flags = PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF | (literal ? PCRE2_LITERAL : 0);
    code_.reset(
        pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), flags, &err, &offset, nullptr));
    if (!code_) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(err, msg, sizeof(msg));
      fail(where, ": the regex \"", pattern, "\" does not compile at offset ", offset, ": ",
           reinterpret_cast<char*>(msg));
    }
  }

  /// Cuts `s` into matches and the gaps between them, in order (HF's Split with behavior Isolated).
  void split_isolated(const std::string& s, std::vector<std::string>& out) const {
    std::unique_ptr<pcre2_match_data, decltype(&pcre2_match_data_free)> md(
        pcre2_match_data_create_from_pattern(code_.get(), nullptr), &pcre2_match_data_free);
    size_t pos = 0, last = 0;
    while (pos <= s.size()) {
      int rc = pcre2_match(code_.get(), reinterpret_cast<PCRE2_SPTR>(s.data()), s.size(), pos, 0, md.get(), nullptr);
      if (rc == PCRE2_ERROR_NOMATCH) break;
      DEW_CHECK(rc >= 0, "tokenizer regex: matching failed with PCRE2 error ", rc);
      PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md.get());
      size_t b = ov[0], e = ov[1];
      if (e == b) {  // empty match: step one UTF-8 unit so the scan always advances
        if (b >= s.size()) break;
        pos = b + detail::utf8_length(s, b);
        continue;
      }
      if (b > last) out.push_back(s.substr(last, b - last));
      out.push_back(s.substr(b, e - b));
      last = pos = e;
    }
    if (last < s.size()) out.push_back(s.substr(last));
  }

 private:
  struct Free {
    void operator()(pcre2_code* c) const { pcre2_code_free(c); }
  };
  std::unique_ptr<pcre2_code, Free> code_;
};

/// One pre-tokenizer step.
struct PreStep {
  std::shared_ptr<Regex> regex;  // split with this regex (Isolated); null: no split
  bool byte_level = false;       // map bytes to GPT-2's unicode stand-ins after splitting
  bool add_prefix_space = false;
};

struct AddedToken {
  int64_t id;
  std::string content;
  bool special, lstrip, rstrip;
};

// Typed reads of tokenizer.json fields: a field of the wrong type is a dew::Error naming the file and the
// field, never nlohmann's type_error (which names neither). `where` is "FILE: section".
const json& object_at(const json& o, const std::string& where) {
  DEW_CHECK(o.is_object(), "hf_bpe ", where, ": expected an object, got ", options_detail::describe(o));
  return o;
}

std::string string_at(const json& o, const char* key, const std::string& def, const std::string& where) {
  auto it = object_at(o, where).find(key);
  if (it == o.end() || it->is_null()) return def;
  DEW_CHECK(it->is_string(), "hf_bpe ", where, ".", key, ": expected a string, got ", options_detail::describe(*it));
  return it->get<std::string>();
}

bool bool_at(const json& o, const char* key, bool def, const std::string& where) {
  auto it = object_at(o, where).find(key);
  if (it == o.end() || it->is_null()) return def;
  DEW_CHECK(it->is_boolean(), "hf_bpe ", where, ".", key, ": expected true or false, got ",
            options_detail::describe(*it));
  return it->get<bool>();
}

// The member `key` of object `o`, or null when absent: by reference, where json::value() would copy, and
// copying a deeply nested value recurses once per level.
const json& member(const json& o, const char* key) {
  static const json absent;
  auto it = o.find(key);
  return it == o.end() ? absent : *it;
}

// Sequences of pre-tokenizers / post-processors nest; real files use one level. A bound keeps a hostile
// file from recursing until the stack overflows.
constexpr int kMaxNesting = 8;

class HfBpeTokenizer : public Tokenizer {
 public:
  explicit HfBpeTokenizer(const HfBpeOptions& o) : path_(o.path) {
    DEW_CHECK(!o.path.empty(), "hf_bpe: field \"path\" is required (a tokenizer.json file)");
    raw_ = io::read_file(o.path, "hf_bpe");
    io::check_json_depth(raw_, "hf_bpe: " + o.path);
    json j = json::parse(raw_, nullptr, false);
    DEW_CHECK(!j.is_discarded() && j.is_object(), "hf_bpe: \"", o.path, "\" is not a JSON object");
    DEW_CHECK(j.contains("model") && j["model"].is_object(), "hf_bpe: \"", o.path, "\" has no \"model\" object");
    const json& m = j["model"];
    const std::string file = "\"" + o.path + "\"";
    std::string type = string_at(m, "type", "BPE", file + ": model");
    DEW_CHECK(type == "BPE", "hf_bpe: model.type \"", type, "\" in \"", o.path, "\" is not supported; accepted: BPE");
    DEW_CHECK(m.contains("vocab") && m["vocab"].is_object(), "hf_bpe: model.vocab must be an object of piece -> id");
    // Ids must be contiguous (checked in find_specials), so none can reach the number of entries: bounding
    // them first keeps a 100-byte file from sizing the piece table to 2^31 entries.
    max_entries_ = m["vocab"].size();
    if (j.contains("added_tokens") && j["added_tokens"].is_array()) max_entries_ += j["added_tokens"].size();
    for (auto it = m["vocab"].begin(); it != m["vocab"].end(); ++it) add_piece(it.key(), it.value(), "model.vocab");
    parse_merges(m);
    ignore_merges_ = bool_at(m, "ignore_merges", false, file + ": model");
    if (m.contains("unk_token") && m["unk_token"].is_string()) unk_ = piece_to_id(m["unk_token"].get<std::string>());
    if (j.contains("added_tokens") && j["added_tokens"].is_array()) {
      for (size_t i = 0; i < j["added_tokens"].size(); ++i) {
        const json& t = j["added_tokens"][i];
        const std::string where = file + ": added_tokens[" + std::to_string(i) + "]";
        DEW_CHECK(t.is_object() && t.contains("id") && t.contains("content"),
                  "hf_bpe: each added_tokens entry needs \"id\" and \"content\", got ", options_detail::describe(t));
        DEW_CHECK(t["id"].is_number_integer(), "hf_bpe ", where, ".id: expected an integer, got ",
                  options_detail::describe(t["id"]));
        AddedToken a{t["id"].get<int64_t>(), string_at(t, "content", "", where), bool_at(t, "special", false, where),
                     bool_at(t, "lstrip", false, where), bool_at(t, "rstrip", false, where)};
        DEW_CHECK(!a.content.empty(), "hf_bpe: added token ", a.id, " has empty content");
        add_piece(a.content, a.id, "added_tokens");
        added_.push_back(a);
      }
    }
    // Longest first, so "<|a|>" wins over "<|a" at the same position.
    std::stable_sort(added_.begin(), added_.end(),
                     [](const AddedToken& a, const AddedToken& b) { return a.content.size() > b.content.size(); });
    parse_normalizer(member(j, "normalizer"));
    parse_pre_tokenizer(member(j, "pre_tokenizer"), "pre_tokenizer", 0);
    parse_post_processor(member(j, "post_processor"), "post_processor", 0);
    find_specials();
  }

  std::vector<int64_t> encode(const std::string& text, bool add_special) const override {
    std::vector<int64_t> ids;
    if (add_special) ids = prefix_;
    size_t start = 0;
    auto flush = [&](size_t end) {
      if (end > start) encode_plain(text.substr(start, end - start), ids);
    };
    for (size_t i = 0; i < text.size();) {
      const AddedToken* hit = nullptr;
      if (!first_bytes_[static_cast<unsigned char>(text[i])]) {
        ++i;
        continue;
      }
      for (const auto& a : added_)
        if (text.compare(i, a.content.size(), a.content) == 0) {
          hit = &a;
          break;
        }
      if (!hit) {
        ++i;
        continue;
      }
      size_t b = i, e = i + hit->content.size();
      if (hit->lstrip)
        while (b > start && std::isspace(static_cast<unsigned char>(text[b - 1]))) --b;
      if (hit->rstrip)
        while (e < text.size() && std::isspace(static_cast<unsigned char>(text[e]))) ++e;
      flush(b);
      ids.push_back(hit->id);
      start = i = e;
    }
    flush(text.size());
    return ids;
  }

  std::string decode(const std::vector<int64_t>& ids, bool skip_special) const override {
    std::string out;
    for (int64_t id : ids) {
      check(id);
      auto a = added_by_id_.find(id);
      if (a != added_by_id_.end()) {
        if (!(skip_special && a->second->special)) out += a->second->content;
        continue;
      }
      const std::string& p = pieces_[id];
      if (!byte_level_) {
        out += p;
        continue;
      }
      for (size_t i = 0; i < p.size();) {
        size_t n = detail::utf8_length(p, i);
        auto b = unicode_to_byte().find(p.substr(i, n));
        if (b != unicode_to_byte().end()) out += static_cast<char>(b->second);
        else out += p.substr(i, n);  // not a byte stand-in: pass the text through
        i += n;
      }
    }
    return out;
  }

  int64_t vocab_size() const override { return static_cast<int64_t>(pieces_.size()); }
  int64_t bos_id() const override { return bos_; }
  int64_t eos_id() const override { return eos_; }
  int64_t pad_id() const override { return pad_; }
  int64_t unk_id() const override { return unk_; }

  std::string id_to_piece(int64_t id) const override {
    check(id);
    return pieces_[id];
  }

  int64_t piece_to_id(const std::string& piece) const override {
    auto it = ids_.find(piece);
    return it == ids_.end() ? -1 : it->second;
  }

  std::string name() const override { return "hf_bpe"; }
  json spec() const override { return {{"name", "hf_bpe"}, {"path", path_}}; }

  void save(const std::string& dir) const override {
    io::write_file_atomic((fs::path(dir) / "tokenizer.json").string(), raw_);
    // The original tokenizer_config.json (chat template, special tokens) travels when it sits beside.
    fs::path config = fs::path(path_).parent_path() / "tokenizer_config.json";
    fs::path map = fs::path(path_).parent_path() / "special_tokens_map.json";
    std::error_code ec;
    if (fs::is_regular_file(config, ec)) {
      io::write_file_atomic((fs::path(dir) / "tokenizer_config.json").string(),
                            io::read_file(config.string(), "hf_bpe"));
      if (fs::is_regular_file(map, ec))
        io::write_file_atomic((fs::path(dir) / "special_tokens_map.json").string(),
                              io::read_file(map.string(), "hf_bpe"));
    } else {
      auto piece = [&](int64_t id) { return id < 0 ? std::string() : pieces_[id]; };
      detail::write_hf_token_configs(dir, piece(bos_), piece(eos_), piece(pad_), piece(unk_),
                                     "PreTrainedTokenizerFast");
    }
  }

 private:
  void check(int64_t id) const {
    DEW_CHECK(id >= 0 && id < vocab_size(), "hf_bpe: token id ", id, " is outside the vocabulary [0, ", vocab_size(),
              ")");
  }

  void add_piece(const std::string& piece, const json& id_value, const char* where) {
    DEW_CHECK(id_value.is_number_integer() && id_value.get<int64_t>() >= 0, "hf_bpe: ", where, " \"", piece,
              "\" needs a non-negative integer id, got ", options_detail::describe(id_value));
    int64_t id = id_value.get<int64_t>();
    DEW_CHECK(static_cast<uint64_t>(id) < max_entries_, "hf_bpe: ", where, " \"", piece, "\" has id ", id,
              ", but the file lists only ", max_entries_, " entries (ids must be contiguous from 0)");
    if (static_cast<size_t>(id) >= pieces_.size()) pieces_.resize(id + 1);
    pieces_[id] = piece;
    ids_[piece] = id;
  }

  void parse_merges(const json& m) {
    if (!m.contains("merges")) return;
    DEW_CHECK(m["merges"].is_array(), "hf_bpe: model.merges must be a list");
    int64_t rank = 0;
    for (const auto& e : m["merges"]) {
      const auto [a, b] = detail::BpeMerges::parse(e, rank, "hf_bpe");
      DEW_CHECK(ids_.count(a + b), "hf_bpe: merge ", rank, " (\"", a, "\", \"", b, "\") makes \"", a + b,
                "\", which is not in model.vocab");
      merges_.add(a, b, rank++);
    }
  }

  void parse_normalizer(const json& n) {
    if (n.is_null()) return;
    std::string type = string_at(n, "type", "", "\"" + path_ + "\": normalizer");
    // Byte-level files of Qwen2 ask for NFC; we take text as already NFC (true of ASCII and of nearly
    // all UTF-8 in the wild) rather than carry Unicode tables.
    if (type == "NFC") return;
    if (type == "Sequence" && n.contains("normalizers") && n["normalizers"].empty()) return;
    fail("hf_bpe: normalizer \"", type, "\" in \"", path_, "\" is not supported; accepted: null, NFC");
  }

  void parse_pre_tokenizer(const json& p, const std::string& where, int depth) {
    if (p.is_null()) return;
    const std::string at = "\"" + path_ + "\": " + where;
    std::string type = string_at(p, "type", "", at);
    if (type == "Sequence") {
      DEW_CHECK(p.contains("pretokenizers") && p["pretokenizers"].is_array(), "hf_bpe: ", where,
                " needs \"pretokenizers\"");
      DEW_CHECK(depth < kMaxNesting, "hf_bpe ", at, ": Sequences nested more than ", kMaxNesting, " deep");
      for (size_t i = 0; i < p["pretokenizers"].size(); ++i)
        parse_pre_tokenizer(p["pretokenizers"][i], where + ".pretokenizers[" + std::to_string(i) + "]", depth + 1);
    } else if (type == "Split") {
      std::string behavior = string_at(p, "behavior", "Isolated", at);
      DEW_CHECK(behavior == "Isolated" && !bool_at(p, "invert", false, at), "hf_bpe: ", where,
                " Split with behavior \"", behavior, "\" / invert is not supported; accepted: Isolated, invert false");
      const json& pat = member(p, "pattern");
      PreStep s;
      if (pat.is_object() && pat.contains("Regex"))
        s.regex = std::make_shared<Regex>(string_at(pat, "Regex", "", at + ".pattern"), false, "hf_bpe " + where);
      else if (pat.is_object() && pat.contains("String"))
        s.regex = std::make_shared<Regex>(string_at(pat, "String", "", at + ".pattern"), true, "hf_bpe " + where);
      else fail("hf_bpe: ", where, ".pattern must hold \"Regex\" or \"String\", got ", options_detail::describe(pat));
      steps_.push_back(s);
    } else if (type == "ByteLevel") {
      PreStep s;
      s.byte_level = true;
      s.add_prefix_space = bool_at(p, "add_prefix_space", false, at);
      if (bool_at(p, "use_regex", true, at)) s.regex = std::make_shared<Regex>(kGpt2Pattern, false, "hf_bpe " + where);
      steps_.push_back(s);
      byte_level_ = true;
    } else {
      fail("hf_bpe: ", where, " type \"", type, "\" is not supported; accepted: ByteLevel, Split, Sequence of them");
    }
  }

  void parse_post_processor(const json& p, const std::string& where, int depth) {
    if (p.is_null()) return;
    const std::string at = "\"" + path_ + "\": " + where;
    std::string type = string_at(p, "type", "", at);
    if (type == "Sequence") {
      const json& processors = member(p, "processors");
      DEW_CHECK(processors.is_array() || processors.is_null(), "hf_bpe ", at, ".processors: expected a list, got ",
                options_detail::describe(processors));
      DEW_CHECK(depth < kMaxNesting, "hf_bpe ", at, ": Sequences nested more than ", kMaxNesting, " deep");
      for (size_t i = 0; i < processors.size(); ++i)
        parse_post_processor(processors[i], where + ".processors[" + std::to_string(i) + "]", depth + 1);
    } else if (type == "TemplateProcessing") {
      // The special tokens before $A in the single-sequence template are what add_special prepends.
      const json& single = member(p, "single");
      DEW_CHECK(single.is_array() || single.is_null(), "hf_bpe ", at, ".single: expected a list, got ",
                options_detail::describe(single));
      for (const auto& piece : single) {
        if (!piece.is_object()) continue;
        if (piece.contains("Sequence")) break;
        if (piece.contains("SpecialToken")) {
          std::string id = string_at(piece["SpecialToken"], "id", "", at + ".single.SpecialToken");
          int64_t tid = piece_to_id(id);
          DEW_CHECK(tid >= 0, "hf_bpe: post_processor special token \"", id, "\" is not in the vocabulary");
          prefix_.push_back(tid);
        }
      }
    }
    // ByteLevel and other processors only adjust offsets or pairs; ids are unchanged.
  }

  void find_specials() {
    fs::path config = fs::path(path_).parent_path() / "tokenizer_config.json";
    std::error_code ec;
    json c;
    if (fs::is_regular_file(config, ec)) {
      const std::string text = io::read_file(config.string(), "hf_bpe");
      io::check_json_depth(text, "hf_bpe: " + config.string());
      c = json::parse(text, nullptr, false);
    }
    auto from_config = [&](const char* key) -> int64_t {
      if (!c.is_object() || !c.contains(key)) return -1;
      return piece_to_id(detail::token_text(c[key]));
    };
    auto first_of = [&](std::initializer_list<const char*> names) -> int64_t {
      for (const char* n : names)
        if (piece_to_id(n) >= 0) return piece_to_id(n);
      return -1;
    };
    bos_ = from_config("bos_token");
    if (bos_ < 0 && prefix_.size() == 1) bos_ = prefix_[0];
    if (bos_ < 0) bos_ = first_of({"<|begin_of_text|>", "<s>", "<bos>"});
    eos_ = from_config("eos_token");
    if (eos_ < 0) eos_ = first_of({"<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>"});
    pad_ = from_config("pad_token");
    if (pad_ < 0) pad_ = first_of({"<pad>", "<|pad|>"});
    if (c.is_object() && c.contains("add_bos_token") && c["add_bos_token"].is_boolean()) {
      prefix_.clear();
      if (c["add_bos_token"].get<bool>() && bos_ >= 0) prefix_.push_back(bos_);
    }
    for (const auto& a : added_) {
      added_by_id_[a.id] = &a;
      first_bytes_.set(static_cast<unsigned char>(a.content[0]));
    }
    for (size_t i = 0; i < pieces_.size(); ++i)
      DEW_CHECK(!pieces_[i].empty() || added_by_id_.count(i), "hf_bpe: \"", path_, "\" has no vocabulary entry for id ",
                i, " (ids must be contiguous)");
  }

  static const std::unordered_map<std::string, int>& unicode_to_byte() {
    static const auto* m = [] {
      auto* t = new std::unordered_map<std::string, int>();
      for (int b = 0; b < 256; ++b) (*t)[detail::byte_to_unicode()[b]] = b;
      return t;
    }();
    return *m;
  }

  /// Pre-tokenizes text holding no added token and appends the BPE ids of each word.
  void encode_plain(const std::string& text, std::vector<int64_t>& ids) const {
    std::vector<std::string> words{text}, next;
    for (const auto& s : steps_) {
      next.clear();
      for (auto& w : words) {
        if (s.add_prefix_space && !w.empty() && w[0] != ' ') w = " " + w;
        if (s.regex) s.regex->split_isolated(w, next);
        else next.push_back(w);
      }
      words.swap(next);
    }
    for (const auto& w : words) {
      if (w.empty()) continue;
      if (!byte_level_) {
        bpe(w, ids);
        continue;
      }
      std::string mapped;
      for (unsigned char c : w) mapped += detail::byte_to_unicode()[c];
      bpe(mapped, ids);
    }
  }

  /// Merges the characters of `word` by lowest merge rank until no listed pair remains.
  void bpe(const std::string& word, std::vector<int64_t>& ids) const {
    if (ignore_merges_) {
      auto it = ids_.find(word);
      if (it != ids_.end()) {
        ids.push_back(it->second);
        return;
      }
    }
    const std::vector<std::string> sym = merges_.apply(word);
    for (const auto& s : sym) {
      int64_t id = piece_to_id(s);
      if (id < 0) {
        DEW_CHECK(unk_ >= 0, "hf_bpe: the piece \"", s, "\" is not in the vocabulary of \"", path_,
                  "\" and the model has no unk_token");
        id = unk_;
      }
      ids.push_back(id);
    }
  }

  size_t max_entries_ = 0;  // model.vocab + added_tokens: every id is below it
  std::string path_, raw_;
  std::vector<std::string> pieces_;
  std::unordered_map<std::string, int64_t> ids_;
  detail::BpeMerges merges_;
  std::vector<AddedToken> added_;
  std::map<int64_t, const AddedToken*> added_by_id_;
  std::bitset<256> first_bytes_;  // first bytes of added tokens: most positions are skipped at once
  std::vector<PreStep> steps_;
  std::vector<int64_t> prefix_;
  bool byte_level_ = false, ignore_merges_ = false;
  int64_t bos_ = -1, eos_ = -1, pad_ = -1, unk_ = -1;
};

}  // namespace

namespace detail {
TokenizerPtr make_hf_bpe(const HfBpeOptions& o) { return std::make_shared<HfBpeTokenizer>(o); }
}  // namespace detail

}  // namespace data
}  // namespace dew

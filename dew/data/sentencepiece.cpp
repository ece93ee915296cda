// SentencePiece tokenizer.model files, read without libsentencepiece (its protobuf clashes with
// LibTorch's): a reader of the ModelProto protobuf wire format, SentencePiece's whitespace
// normalisation, the unigram (Viterbi over piece scores) and BPE (merge the best-scoring adjacent pair)
// encoders, byte fallback and decoding.
//
// ModelProto field numbers (sentencepiece_model.proto): pieces = 1 {piece 1, score 2, type 3},
// trainer_spec = 2 {model_type 3, byte_fallback 35, unk_id 40, bos_id 41, eos_id 42, pad_id 43},
// normalizer_spec = 3 {name 1, precompiled_charsmap 2, add_dummy_prefix 3, remove_extra_whitespaces 4,
// escape_whitespaces 5}. Piece types: NORMAL 1, UNKNOWN 2, CONTROL 3, USER_DEFINED 4, UNUSED 5, BYTE 6.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <queue>
#include <unordered_map>

#include "dew/data/tokenizer_detail.h"

namespace fs = std::filesystem;

namespace dew {
namespace data {
namespace {

const char* kSpace = "\xE2\x96\x81";  // U+2581 LOWER ONE EIGHTH BLOCK, SentencePiece's visible space

enum PieceType { kNormal = 1, kUnknown = 2, kControl = 3, kUserDefined = 4, kUnused = 5, kByte = 6 };

/// A cursor over protobuf wire-format bytes; every read is bounds-checked.
class Wire {
 public:
  Wire(const char* data, size_t size, std::string where) : p_(data), end_(data + size), where_(std::move(where)) {}
  bool done() const { return p_ >= end_; }

  uint64_t varint() {
    uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      need(1);
      auto b = static_cast<uint8_t>(*p_++);
      v |= static_cast<uint64_t>(b & 0x7F) << shift;
      if (!(b & 0x80)) return v;
    }
    fail(where_, ": malformed varint");
  }

  /// Reads a field key: returns (field number, wire type).
  std::pair<uint32_t, uint32_t> key() {
    uint64_t k = varint();
    return {static_cast<uint32_t>(k >> 3), static_cast<uint32_t>(k & 7)};
  }

  Wire sub() {
    uint64_t n = varint();
    need(n);
    Wire w(p_, n, where_);
    p_ += n;
    return w;
  }

  std::string bytes() {
    uint64_t n = varint();
    need(n);
    std::string s(p_, n);
    p_ += n;
    return s;
  }

  float fixed32_float() {
    need(4);
    uint32_t u = 0;
    for (int i = 0; i < 4; ++i) u |= static_cast<uint32_t>(static_cast<uint8_t>(p_[i])) << (8 * i);
    p_ += 4;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }

  void skip(uint32_t wire_type) {
    switch (wire_type) {
      case 0: varint(); break;
      case 1: need(8); p_ += 8; break;
      case 2: sub(); break;
      case 5: need(4); p_ += 4; break;
      default: fail(where_, ": unsupported protobuf wire type ", wire_type, " (is this a SentencePiece model?)");
    }
  }

  void expect(uint32_t got, uint32_t want, const char* field) {
    DEW_CHECK(got == want, where_, ": field ", field, " has wire type ", got, ", expected ", want,
              " (is this a SentencePiece model?)");
  }

 private:
  void need(uint64_t n) {
    DEW_CHECK(static_cast<uint64_t>(end_ - p_) >= n, where_, ": truncated protobuf data (is this a SentencePiece model?)");
  }
  const char* p_;
  const char* end_;
  std::string where_;
};

struct Piece {
  std::string text;
  float score = 0;
  int type = kNormal;
};

class SentencePieceTokenizer : public Tokenizer {
 public:
  explicit SentencePieceTokenizer(const SentencePieceOptions& o) : path_(o.path) {
    DEW_CHECK(!o.path.empty(), "sentencepiece: field \"path\" is required (a tokenizer.model file)");
    raw_ = detail::read_file(o.path, "sentencepiece");
    parse(raw_);
    index();
  }

  std::vector<int64_t> encode(const std::string& text, bool add_special) const override {
    std::vector<int64_t> ids;
    if (add_special && bos_ >= 0) ids.push_back(bos_);
    std::string norm = normalize(text);
    if (model_type_ == 2) encode_bpe(norm, ids);
    else encode_unigram(norm, ids);
    return ids;
  }

  std::string decode(const std::vector<int64_t>& ids, bool skip_special) const override {
    std::string out, bytes;
    bool at_start = true;  // the dummy-prefix space of the first text piece is dropped
    auto text = [&](const std::string& piece) {
      for (size_t i = 0; i < piece.size();) {
        if (piece.compare(i, 3, kSpace) == 0) {
          if (!(at_start && i == 0 && add_dummy_prefix_)) out += ' ';
          i += 3;
        } else {
          out += piece[i++];
        }
      }
      at_start = false;
    };
    auto flush_bytes = [&] {
      // Byte pieces form UTF-8 text; an invalid sequence decodes to U+FFFD per byte, as SentencePiece does.
      std::string utf8;
      for (size_t i = 0; i < bytes.size();) {
        size_t n = detail::utf8_length(bytes, i);
        if (n == 1 && static_cast<unsigned char>(bytes[i]) >= 0x80) utf8 += "\xEF\xBF\xBD";
        else utf8 += bytes.substr(i, n);
        i += n;
      }
      if (!bytes.empty()) text(utf8);
      bytes.clear();
    };
    for (int64_t id : ids) {
      check(id);
      const Piece& p = pieces_[id];
      if (p.type == kByte) {
        bytes += static_cast<char>(byte_value_[id]);
        continue;
      }
      flush_bytes();
      if (p.type == kControl) {
        if (!skip_special) out += p.text;
      } else if (p.type == kUnknown) {
        out += " \xE2\x81\x87 ";  // SentencePiece's surface of unknown text, " ⁇ "
        at_start = false;
      } else {
        text(p.text);
      }
    }
    flush_bytes();
    return out;
  }

  int64_t vocab_size() const override { return static_cast<int64_t>(pieces_.size()); }
  int64_t bos_id() const override { return bos_; }
  int64_t eos_id() const override { return eos_; }
  int64_t pad_id() const override { return pad_; }
  int64_t unk_id() const override { return unk_; }

  std::string id_to_piece(int64_t id) const override {
    check(id);
    return pieces_[id].text;
  }

  int64_t piece_to_id(const std::string& piece) const override {
    auto it = ids_.find(piece);
    return it == ids_.end() ? -1 : it->second;
  }

  std::string name() const override { return "sentencepiece"; }
  json spec() const override { return {{"name", "sentencepiece"}, {"path", path_}}; }

  void save(const std::string& dir) const override {
    detail::write_file((fs::path(dir) / "tokenizer.model").string(), raw_);
    auto piece = [&](int64_t id) { return id < 0 ? std::string() : pieces_[id].text; };
    detail::write_hf_token_configs(dir, piece(bos_), piece(eos_), piece(pad_), piece(unk_), "LlamaTokenizer");
  }

 private:
  void check(int64_t id) const {
    DEW_CHECK(id >= 0 && id < vocab_size(), "sentencepiece: token id ", id, " is outside the vocabulary [0, ",
              vocab_size(), ")");
  }

  void parse(const std::string& data) {
    Wire w(data.data(), data.size(), "sentencepiece \"" + path_ + "\"");
    while (!w.done()) {
      auto [field, type] = w.key();
      if (field == 1) {
        w.expect(type, 2, "pieces");
        Wire pw = w.sub();
        Piece p;
        while (!pw.done()) {
          auto [f, t] = pw.key();
          if (f == 1) pw.expect(t, 2, "pieces.piece"), p.text = pw.bytes();
          else if (f == 2) pw.expect(t, 5, "pieces.score"), p.score = pw.fixed32_float();
          else if (f == 3) pw.expect(t, 0, "pieces.type"), p.type = static_cast<int>(pw.varint());
          else pw.skip(t);
        }
        DEW_CHECK(p.type >= kNormal && p.type <= kByte, "sentencepiece \"", path_, "\": piece ", pieces_.size(),
                  " has unknown type ", p.type, "; accepted: 1..6");
        pieces_.push_back(std::move(p));
      } else if (field == 2) {
        w.expect(type, 2, "trainer_spec");
        Wire tw = w.sub();
        while (!tw.done()) {
          auto [f, t] = tw.key();
          if (t != 0) {
            tw.skip(t);
            continue;
          }
          auto v = static_cast<int64_t>(static_cast<int32_t>(tw.varint()));
          if (f == 3) model_type_ = v;
          else if (f == 35) byte_fallback_ = v != 0;
          else if (f == 40) unk_ = v;
          else if (f == 41) bos_ = v;
          else if (f == 42) eos_ = v;
          else if (f == 43) pad_ = v;
        }
      } else if (field == 3) {
        w.expect(type, 2, "normalizer_spec");
        Wire nw = w.sub();
        while (!nw.done()) {
          auto [f, t] = nw.key();
          if (f == 1 && t == 2) normalizer_name_ = nw.bytes();
          else if (f == 2 && t == 2) has_charsmap_ = !nw.bytes().empty();
          else if (f == 3 && t == 0) add_dummy_prefix_ = nw.varint() != 0;
          else if (f == 4 && t == 0) remove_extra_whitespaces_ = nw.varint() != 0;
          else if (f == 5 && t == 0) escape_whitespaces_ = nw.varint() != 0;
          else nw.skip(t);
        }
      } else {
        w.skip(type);
      }
    }
    DEW_CHECK(!pieces_.empty(), "sentencepiece \"", path_, "\": the model has no pieces (is this a SentencePiece model?)");
    DEW_CHECK(model_type_ == 1 || model_type_ == 2, "sentencepiece \"", path_, "\": trainer_spec.model_type ", model_type_,
              " is not supported; accepted: 1 (unigram), 2 (bpe)");
  }

  void index() {
    int64_t n = vocab_size();
    auto valid = [&](int64_t& id, int type) {
      if (id >= n || (id >= 0 && pieces_[id].type != type)) id = -1;
    };
    valid(unk_, kUnknown);
    valid(bos_, kControl);
    valid(eos_, kControl);
    valid(pad_, kControl);
    if (unk_ < 0)
      for (int64_t i = 0; i < n; ++i)
        if (pieces_[i].type == kUnknown) unk_ = i;
    byte_value_.assign(n, -1);
    for (int64_t i = 0; i < n; ++i) {
      const Piece& p = pieces_[i];
      ids_.emplace(p.text, i);
      if (p.type == kByte) {
        unsigned v = 0;
        DEW_CHECK(p.text.size() == 6 && std::sscanf(p.text.c_str(), "<0x%2X>", &v) == 1, "sentencepiece \"", path_,
                  "\": byte piece ", i, " is \"", p.text, "\", expected <0xXX>");
        byte_value_[i] = static_cast<int>(v);
        byte_id_[v] = i;
      }
      if (p.type == kNormal || p.type == kUserDefined) {
        max_len_ = std::max(max_len_, p.text.size());
        if (p.type == kNormal) {
          min_score_ = std::min(min_score_, p.score);
          max_score_ = std::max(max_score_, p.score);
        } else {
          user_defined_.push_back(i);
        }
      }
    }
    std::sort(user_defined_.begin(), user_defined_.end(),
              [&](int64_t a, int64_t b) { return pieces_[a].text.size() > pieces_[b].text.size(); });
    if (byte_fallback_)
      for (int b = 0; b < 256; ++b)
        DEW_CHECK(byte_id_[b] >= 0, "sentencepiece \"", path_, "\": byte_fallback is on but there is no piece for byte ", b);
    DEW_CHECK(unk_ >= 0, "sentencepiece \"", path_, "\": the model has no unknown piece");
  }

  /// SentencePiece's whitespace handling (identity character map): drop leading, trailing and repeated
  /// spaces, prefix one space, and make spaces visible as U+2581.
  std::string normalize(const std::string& text) const {
    std::string s;
    size_t i = 0;
    if (remove_extra_whitespaces_)
      while (i < text.size() && text[i] == ' ') ++i;
    if (i == text.size()) return s;
    if (add_dummy_prefix_) s += escape_whitespaces_ ? kSpace : " ";
    bool prev_space = add_dummy_prefix_;
    for (; i < text.size(); ++i) {
      char c = text[i];
      if (c == ' ') {
        if (remove_extra_whitespaces_ && prev_space) continue;
        s += escape_whitespaces_ ? kSpace : " ";
        prev_space = true;
      } else {
        s += c;
        prev_space = false;
      }
    }
    if (remove_extra_whitespaces_) {
      const std::string sp = escape_whitespaces_ ? kSpace : " ";
      while (s.size() >= sp.size() && s.compare(s.size() - sp.size(), sp.size(), sp) == 0) s.erase(s.size() - sp.size());
    }
    return s;
  }

  /// Appends segments (id, or -1 for text no piece covers, with the text): with byte_fallback unknown
  /// text becomes its byte pieces, else each run of unknown segments becomes one unknown id (as in
  /// SentencePiece).
  void emit(const std::vector<std::pair<int64_t, std::string>>& segs, std::vector<int64_t>& ids) const {
    for (size_t k = 0; k < segs.size(); ++k) {
      if (segs[k].first >= 0) {
        ids.push_back(segs[k].first);
      } else if (byte_fallback_) {
        for (unsigned char c : segs[k].second) ids.push_back(byte_id_[c]);
      } else if (k == 0 || segs[k - 1].first >= 0) {
        ids.push_back(unk_);
      }
    }
  }

  /// The user-defined piece that starts at s[i] (longest), or -1.
  int64_t user_defined_at(const std::string& s, size_t i) const {
    for (int64_t id : user_defined_)
      if (s.compare(i, pieces_[id].text.size(), pieces_[id].text) == 0) return id;
    return -1;
  }

  /// Viterbi: the segmentation of s into pieces with the highest total score. A character no piece
  /// covers is an unknown node scored min_score - 10; user-defined pieces score length * max_score - 0.1
  /// so they always win (SentencePiece's rules). Equal-score segmentations ("ee e" / "e ee") are decided
  /// by rounding, so the arithmetic follows SentencePiece's: path scores are stored as float, a piece's
  /// candidate is summed and compared in double against the stored float, an unknown's in float.
  void encode_unigram(const std::string& s, std::vector<int64_t>& ids) const {
    size_t n = s.size();
    if (n == 0) return;
    const float unk_score = min_score_ - 10.0f;
    std::vector<float> best(n + 1, 0.0f);
    std::vector<char> reached(n + 1, 0);
    std::vector<int64_t> from_id(n + 1, -1);
    std::vector<size_t> from_pos(n + 1, 0);
    reached[0] = 1;
    for (size_t i = 0; i < n;) {
      size_t char_len = detail::utf8_length(s, i);
      bool covered = false;
      for (size_t len = 1; len <= max_len_ && i + len <= n; ++len) {
        auto it = ids_.find(s.substr(i, len));
        if (it == ids_.end()) continue;
        const Piece& p = pieces_[it->second];
        if (p.type != kNormal && p.type != kUserDefined) continue;
        const double score = p.type == kUserDefined ? static_cast<double>(static_cast<float>(len) * max_score_) - 0.1
                                                    : static_cast<double>(p.score);
        if (len == char_len) covered = true;
        const double candidate = score + static_cast<double>(best[i]);
        if (!reached[i + len] || candidate > static_cast<double>(best[i + len])) {
          best[i + len] = static_cast<float>(candidate);
          reached[i + len] = 1;
          from_id[i + len] = it->second;
          from_pos[i + len] = i;
        }
      }
      if (!covered) {
        const float candidate = unk_score + best[i];
        if (!reached[i + char_len] || candidate > best[i + char_len]) {
          best[i + char_len] = candidate;
          reached[i + char_len] = 1;
          from_id[i + char_len] = unk_;
          from_pos[i + char_len] = i;
        }
      }
      i += char_len;  // SentencePiece moves one character at a time
    }
    std::vector<std::pair<int64_t, std::string>> segs;
    for (size_t e = n; e > 0; e = from_pos[e]) {
      int64_t id = from_id[e];
      segs.emplace_back(id == unk_ ? -1 : id, s.substr(from_pos[e], e - from_pos[e]));
    }
    std::reverse(segs.begin(), segs.end());
    emit(segs, ids);
  }

  /// BPE: start from characters (user-defined pieces kept whole) and repeatedly merge the adjacent pair
  /// whose concatenation is the highest-scoring piece (leftmost on ties).
  void encode_bpe(const std::string& s, std::vector<int64_t>& ids) const {
    struct Sym {
      size_t begin, len;
      int prev, next;
      bool frozen;
    };
    std::vector<Sym> sym;
    for (size_t i = 0; i < s.size();) {
      int64_t ud = user_defined_at(s, i);
      size_t len = ud >= 0 ? pieces_[ud].text.size() : detail::utf8_length(s, i);
      sym.push_back({i, len, static_cast<int>(sym.size()) - 1, static_cast<int>(sym.size()) + 1, ud >= 0});
      i += len;
    }
    if (sym.empty()) return;
    sym.back().next = -1;
    struct Cand {
      float score;
      int left, right;
      size_t size;
    };
    auto worse = [](const Cand& a, const Cand& b) {
      return a.score < b.score || (a.score == b.score && a.left > b.left);
    };
    std::priority_queue<Cand, std::vector<Cand>, decltype(worse)> queue(worse);
    auto push = [&](int l, int r) {
      if (l < 0 || r < 0 || sym[l].frozen || sym[r].frozen) return;
      auto it = ids_.find(s.substr(sym[l].begin, sym[l].len + sym[r].len));
      if (it == ids_.end() || pieces_[it->second].type != kNormal) return;
      queue.push({pieces_[it->second].score, l, r, sym[l].len + sym[r].len});
    };
    for (size_t i = 0; i + 1 < sym.size(); ++i) push(static_cast<int>(i), static_cast<int>(i) + 1);
    while (!queue.empty()) {
      Cand c = queue.top();
      queue.pop();
      Sym& l = sym[c.left];
      if (l.len == 0 || l.next != c.right || sym[c.right].len == 0 || l.len + sym[c.right].len != c.size) continue;  // stale
      Sym& r = sym[c.right];
      l.len += r.len;
      r.len = 0;
      l.next = r.next;
      if (r.next >= 0) sym[r.next].prev = c.left;
      push(l.prev, c.left);
      push(c.left, l.next);
    }
    std::vector<std::pair<int64_t, std::string>> segs;
    for (int i = 0; i >= 0; i = sym[i].next) {
      std::string piece = s.substr(sym[i].begin, sym[i].len);
      auto it = ids_.find(piece);
      bool known = it != ids_.end() && (pieces_[it->second].type == kNormal || pieces_[it->second].type == kUserDefined);
      segs.emplace_back(known ? it->second : -1, piece);
    }
    emit(segs, ids);
  }

  std::string path_, raw_;
  std::vector<Piece> pieces_;
  std::unordered_map<std::string, int64_t> ids_;
  std::vector<int> byte_value_;
  std::array<int64_t, 256> byte_id_ = [] {
    std::array<int64_t, 256> a{};
    a.fill(-1);
    return a;
  }();
  std::vector<int64_t> user_defined_;
  int64_t model_type_ = 1;  // proto default: unigram
  bool byte_fallback_ = false;
  int64_t unk_ = 0, bos_ = 1, eos_ = 2, pad_ = -1;  // proto defaults
  std::string normalizer_name_;
  bool has_charsmap_ = false;
  bool add_dummy_prefix_ = true, remove_extra_whitespaces_ = true, escape_whitespaces_ = true;  // proto defaults
  size_t max_len_ = 0;
  float min_score_ = std::numeric_limits<float>::max(), max_score_ = std::numeric_limits<float>::lowest();
};

}  // namespace

namespace detail {
TokenizerPtr make_sentencepiece(const SentencePieceOptions& o) { return std::make_shared<SentencePieceTokenizer>(o); }
}  // namespace detail

}  // namespace data
}  // namespace dew

// SentencePiece tokenizer.model files through libsentencepiece (Debian's libsentencepiece-dev): its normaliser and
// unigram / BPE encoders are the reference implementation, so ids and text are exactly SentencePiece's. dew used to
// carry its own ModelProto reader because libsentencepiece's protobuf clashed with LibTorch 1.13's; the library now
// links cleanly beside LibTorch 2's wheel.
#include <sentencepiece_processor.h>

#include <filesystem>

#include "dew/data/tokenizer_detail.h"
#include "dew/io/files.h"

namespace fs = std::filesystem;

namespace dew {
namespace data {
namespace {

/// libsentencepiece's status text ("Internal: ... [model_proto->ParseFromArray(...)] "), less its trailing space.
std::string message(const sentencepiece::util::Status& status) {
  std::string m = status.ToString();
  while (!m.empty() && m.back() == ' ') m.pop_back();
  return m;
}

class SentencePieceTokenizer : public Tokenizer {
 public:
  explicit SentencePieceTokenizer(const SentencePieceOptions& o) : path_(o.path) {
    DEW_CHECK(!o.path.empty(), "sentencepiece: field \"path\" is required (a tokenizer.model file)");
    // The bytes are kept for save(), so the file is read once and parsed from memory.
    raw_ = io::read_file(o.path, "sentencepiece");
    sentencepiece::util::Status status;
    try {
      status = sp_.LoadFromSerializedProto(raw_);
    } catch (const std::exception& e) {
      // The library reports most bad models by status, but some by throwing: its trie builder (darts)
      // throws on an empty piece (found by fuzz/sentencepiece_fuzz.cpp). Either way the file is named.
      fail("sentencepiece \"", path_, "\": cannot load (corrupt SentencePiece model: ", e.what(), ")");
    }
    DEW_CHECK(status.ok(), "sentencepiece \"", path_,
              "\": cannot load (truncated or not a SentencePiece model: ", message(status), ")");
  }

  std::vector<int64_t> encode(const std::string& text, bool add_special) const override {
    std::vector<int> got;
    const auto status = sp_.Encode(text, &got);
    DEW_CHECK(status.ok(), "sentencepiece \"", path_, "\": encoding failed: ", message(status));
    std::vector<int64_t> ids;
    ids.reserve(got.size() + 1);
    if (add_special && bos_id() >= 0) ids.push_back(bos_id());
    ids.insert(ids.end(), got.begin(), got.end());
    return ids;
  }

  std::string decode(const std::vector<int64_t>& ids, bool skip_special) const override {
    std::vector<int> checked;
    checked.reserve(ids.size());
    for (int64_t id : ids) {
      check(id);
      checked.push_back(static_cast<int>(id));
    }
    // The library's decoder gives each piece its surface in context (control ids empty, the dummy-prefix space
    // dropped only at the start, byte pieces joined into UTF-8); to render control ids, their piece text replaces
    // the empty surface in place. Decoding the runs between control ids separately would instead lose the leading
    // space of a run that follows text ("a</s> b").
    sentencepiece::ImmutableSentencePieceText spt;
    const auto status = sp_.Decode(checked, spt.mutable_proto());
    DEW_CHECK(status.ok(), "sentencepiece \"", path_, "\": decoding failed: ", message(status));
    if (skip_special) return spt.text();
    std::string out;
    for (size_t i = 0; i < spt.pieces_size(); ++i) {
      const auto piece = spt.pieces(static_cast<int>(i));
      out += sp_.IsControl(static_cast<int>(piece.id())) ? piece.piece() : piece.surface();
    }
    return out;
  }

  int64_t vocab_size() const override { return sp_.GetPieceSize(); }
  // The processor's ids are -1 when the model lacks the piece (or it is not a control / unknown piece).
  int64_t bos_id() const override { return sp_.bos_id(); }
  int64_t eos_id() const override { return sp_.eos_id(); }
  int64_t pad_id() const override { return sp_.pad_id(); }
  int64_t unk_id() const override { return sp_.unk_id(); }

  std::string id_to_piece(int64_t id) const override {
    check(id);
    return sp_.IdToPiece(static_cast<int>(id));
  }

  int64_t piece_to_id(const std::string& piece) const override {
    // PieceToId answers unk_id() for a piece it does not know: only an exact match counts.
    const int id = sp_.PieceToId(piece);
    return id >= 0 && id < sp_.GetPieceSize() && sp_.IdToPiece(id) == piece ? id : -1;
  }

  std::string name() const override { return "sentencepiece"; }
  json spec() const override { return {{"name", "sentencepiece"}, {"path", path_}}; }

  void save(const std::string& dir) const override {
    io::write_file_atomic((fs::path(dir) / "tokenizer.model").string(), raw_);
    auto piece = [&](int64_t id) { return id < 0 ? std::string() : sp_.IdToPiece(static_cast<int>(id)); };
    detail::write_hf_token_configs(dir, piece(bos_id()), piece(eos_id()), piece(pad_id()), piece(unk_id()),
                                   "LlamaTokenizer");
  }

 private:
  void check(int64_t id) const {
    DEW_CHECK(id >= 0 && id < vocab_size(), "sentencepiece: token id ", id, " is outside the vocabulary [0, ",
              vocab_size(), ")");
  }

  std::string path_, raw_;
  sentencepiece::SentencePieceProcessor sp_;
};

}  // namespace

namespace detail {
TokenizerPtr make_sentencepiece(const SentencePieceOptions& o) { return std::make_shared<SentencePieceTokenizer>(o); }
}  // namespace detail

}  // namespace data
}  // namespace dew

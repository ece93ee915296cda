// Tokenizers (docs/lm.md): text <-> int64 token ids, one interface for the built-in byte tokenizer,
// SentencePiece `tokenizer.model` files (through libsentencepiece, SentencePiece's own library) and
// Hugging Face `tokenizer.json` byte-level BPE. Each is registered in `tokenizers()`
// with options <-> JSON, and `spec()` is the record that rebuilds it (for run.json).
//
// Example:
//   auto tok = dew::data::load_tokenizer("byte");                       // or ".../tokenizer.model",
//   std::vector<int64_t> ids = tok->encode("hello");                    //    ".../tokenizer.json", a folder
//   std::string text = tok->decode(ids);                                // "hello"
//   int64_t eos = tok->eos_id();                                        // -1 when the tokenizer has none
//   dew::json rec = tok->spec();                                        // {"name": "byte", "eos": true}
//   auto same = dew::data::tokenizers().build(rec);
//   tok->save("export_dir");                                            // tokenizer files for an HF export
//
// Special ids of the byte tokenizer: ids 0..255 are the bytes themselves; with `eos` (the default) id 256
// is EOS ("<eos>") and vocab_size() is 257; with eos = false vocab_size() is 256 and there is no EOS.
// There is no BOS, PAD or UNK (pad_id() == -1: LM code pads with EOS or masks by length).
//
// Tokenizers are immutable after construction; every method is const and safe to call from any thread.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "dew/core/registry.h"

namespace dew {
namespace data {

/// Text <-> token ids.
class Tokenizer {
 public:
  virtual ~Tokenizer() = default;

  /// The ids of `text` (UTF-8, or any bytes for the byte tokenizer). add_special prepends BOS when the
  /// tokenizer has one (SentencePiece / HF files that define it); it never appends EOS (callers such as
  /// `dew tokenize --pack` append eos_id() themselves).
  virtual std::vector<int64_t> encode(const std::string& text, bool add_special = false) const = 0;

  /// The text of `ids`. Control ids (BOS, EOS, PAD, and the HF file's special added tokens) are
  /// dropped when skip_special, else rendered as their piece text ("<eos>"). Ids outside
  /// [0, vocab_size()) are a dew::Error naming the id and the vocabulary size.
  virtual std::string decode(const std::vector<int64_t>& ids, bool skip_special = true) const = 0;

  /// Number of ids: every id the tokenizer produces is in [0, vocab_size()).
  virtual int64_t vocab_size() const = 0;

  /// Special ids; -1 when the tokenizer has none.
  virtual int64_t bos_id() const { return -1; }
  virtual int64_t eos_id() const { return -1; }
  virtual int64_t pad_id() const { return -1; }
  virtual int64_t unk_id() const { return -1; }

  /// The vocabulary entry of `id` as stored by the tokenizer ("▁the", "<0x0A>", "Ġthe", "<eos>"; the
  /// byte tokenizer gives "<0xXX>" for each byte). Out-of-range ids are a dew::Error.
  virtual std::string id_to_piece(int64_t id) const = 0;

  /// The id of vocabulary entry `piece`, or -1 when there is none.
  virtual int64_t piece_to_id(const std::string& piece) const = 0;

  /// The registry name: "byte", "sentencepiece" or "hf_bpe".
  virtual std::string name() const = 0;

  /// The {"name": NAME, fields...} record that rebuilds this tokenizer through tokenizers().build().
  virtual json spec() const = 0;

  /// Writes the tokenizer's files into the existing folder `dir` for a Hugging Face export:
  /// SentencePiece -> tokenizer.model (the original bytes); hf_bpe -> tokenizer.json (the original
  /// file); byte -> a byte-level BPE tokenizer.json with no merges that gives the same ids. Each also
  /// writes tokenizer_config.json and special_tokens_map.json.
  virtual void save(const std::string& dir) const = 0;
};
using TokenizerPtr = std::shared_ptr<const Tokenizer>;

// ---- options of the registered tokenizers ----

struct ByteTokenizerOptions {
  bool eos = true;
  template <class V>
  void visit(V& v) {
    v("eos", eos, "reserve id 256 as <eos> (vocab 257); false: vocab 256, no EOS");
  }
};

struct SentencePieceOptions {
  std::string path;
  template <class V>
  void visit(V& v) {
    v("path", path, "tokenizer.model file (SentencePiece ModelProto)");
  }
};

struct HfBpeOptions {
  std::string path;
  template <class V>
  void visit(V& v) {
    v("path", path, "Hugging Face tokenizer.json (byte-level BPE)");
  }
};

/// The registry of tokenizers: byte, sentencepiece, hf_bpe.
Registry<const Tokenizer>& tokenizers();

/// A tokenizer from a spec: "byte", a path to a tokenizer.model or tokenizer.json file, a folder holding
/// one of them (tokenizer.json preferred), or a {"name": ..., fields...} record from spec(). Anything
/// else is a dew::Error saying what is accepted.
TokenizerPtr load_tokenizer(const std::string& spec);
TokenizerPtr load_tokenizer(const json& spec);
inline TokenizerPtr load_tokenizer(const char* spec) { return load_tokenizer(std::string(spec)); }

}  // namespace data
}  // namespace dew

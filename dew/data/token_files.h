// Token files (docs/lm.md), what `dew tokenize` writes and LM training reads:
//   DIR/train.bin, DIR/val.bin   flat little-endian token ids: uint8 when vocab_size <= 256, uint16 when
//                                <= 65536, else uint32
//   DIR/meta.json                {tokenizer, vocab_size, dtype, train_tokens, val_tokens, eos_id, packed}
//
//   dew::data::TokenMeta meta;
//   meta.tokenizer = {{"name", "byte"}};
//   meta.vocab_size = 257;
//   meta.eos_id = 256;
//   dew::data::write_token_files("data/fortunes", train_ids, val_ids, meta);   // fills dtype and counts
//   dew::data::TokenFiles tf("data/fortunes");                                  // memory-mapped, validated
//   at::Tensor window = tf.ids(/*val=*/false, 1000, 513);                      // int64 [513]
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "dew/core/options.h"

namespace dew::data {

/// The contents of meta.json.
struct TokenMeta {
  json tokenizer = nullptr;
  int64_t vocab_size = 0;
  std::string dtype;
  int64_t train_tokens = 0;
  int64_t val_tokens = 0;
  int64_t eos_id = -1;
  bool packed = false;
  template <class V>
  void visit(V& v) {
    v("tokenizer", tokenizer, "tokenizer spec that rebuilds the tokenizer, e.g. {\"name\": \"byte\"}");
    v("vocab_size", vocab_size, "ids are in [0, vocab_size)");
    v.choice("dtype", dtype, {"uint8", "uint16", "uint32"},
             "element type of the .bin files (the writer derives it from vocab_size)");
    v("train_tokens", train_tokens, "ids in train.bin");
    v("val_tokens", val_tokens, "ids in val.bin");
    v("eos_id", eos_id, "end-of-document id (-1 = none)");
    v("packed", packed, "documents joined with eos_id (--pack); batches carry segment ids and positions");
  }
};

/// The element type the format uses for a vocabulary: "uint8" (<= 256), "uint16" (<= 65536), "uint32".
std::string token_dtype_for(int64_t vocab_size);

/// Writes DIR/train.bin, DIR/val.bin and DIR/meta.json (creating DIR). meta.dtype, train_tokens and
/// val_tokens are filled in here; every id must be in [0, meta.vocab_size) (dew::Error naming the first
/// offending id and its index otherwise). Files are written to temporaries and renamed into place.
void write_token_files(const std::string& dir, const std::vector<int64_t>& train_ids,
                       const std::vector<int64_t>& val_ids, TokenMeta meta);

/// Read-only memory maps of a token directory's train.bin and val.bin, read as int64 windows.
class TokenFiles {
 public:
  /// Maps DIR/train.bin and DIR/val.bin after checking meta.json (fields, dtype vs vocab_size, file
  /// sizes vs counts). `check_ids` also scans every id once against vocab_size. Errors name the file.
  explicit TokenFiles(const std::string& dir, bool check_ids = true);
  ~TokenFiles();
  TokenFiles(const TokenFiles&) = delete;
  TokenFiles& operator=(const TokenFiles&) = delete;

  const TokenMeta& meta() const { return meta_; }
  const std::string& dir() const { return dir_; }
  int64_t size(bool val) const { return val ? meta_.val_tokens : meta_.train_tokens; }
  /// Ids [start, start + count) of train.bin (val = false) or val.bin as int64 [count]; a range outside
  /// the file is a dew::Error.
  at::Tensor ids(bool val, int64_t start, int64_t count) const;

 private:
  struct Map;
  std::string dir_;
  TokenMeta meta_;
  std::unique_ptr<Map> train_, val_;
};

}  // namespace dew::data

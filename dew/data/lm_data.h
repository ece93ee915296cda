// Language-model data (docs/training.md#data-dewdata, docs/lm.md): token streams cut into windows of seq_len + 1 ids.
// The `lm_datasets()` registry sits beside `datasets()` because an LM source is a token stream read
// lazily (memory-mapped token files), not a table of items:
//   tokens    a `dew tokenize` output directory (train.bin / val.bin / meta.json, memory-mapped)
//   fortunes  Debian's fortunes (/usr/share/games/fortunes), one document per fortune, byte-level ids
//             (byte tokenizer: 0..255 bytes, 256 = EOS), every val_every-th fortune held out for validation
//
// Training windows: window k covers stream ids [k S, k S + S + 1) (consecutive windows share one id, so
// every id is a target exactly once per epoch); `windows` holds their starts and the DataLoader shuffles
// them per (seed, epoch) and saves its position, so the stream is deterministic and resumable.
// `transform` turns a batch of starts into the batch the LM objective reads:
//   "tokens"       int64 [B, S + 1]
//   "segment_ids"  int64 [B, S + 1]  packed sources only: document index within the window
//   "positions"    int64 [B, S + 1]  packed sources only: position within the document
// A packed stream joins documents with EOS; the EOS ends its document, so the next id starts a new
// segment at position 0, and attention is block-diagonal causal.
//
//   auto lm = dew::data::lm_datasets().build(json{{"name", "fortunes"}}, /*seq_len=*/256);
//   dew::data::DataLoader loader(lm->windows, lo, lm->transform);
//   dew::data::Batch b = loader.next();                    // {"tokens", "segment_ids", "positions"}
//   dew::data::Batch val = lm->validation(64);             // fixed: the first 64 windows of val
#pragma once
#include <functional>

#include "dew/data/dataset.h"

namespace dew::data {

/// A token source for LM training and validation.
struct LMData {
  json spec;                               // the {name, fields...} record it was built from
  json tokenizer;                          // spec that rebuilds the tokenizer (load_tokenizer)
  int64_t vocab_size = 0;                  // ids are in [0, vocab_size)
  int64_t eos_id = -1;                     // -1 = none
  bool packed = false;                     // documents joined with eos_id: batches carry segment_ids and positions
  int64_t seq_len = 0;                     // S: windows hold S + 1 ids
  int64_t train_tokens = 0;                // ids in the training stream
  int64_t val_tokens = 0;                  // ids in the validation stream
  std::shared_ptr<TensorDataset> windows;  // {"start": int64 [N]} training window starts
  DataLoader::BatchTransform transform;    // starts -> tokens (+ segment_ids, positions)
  /// ids [start, start + count) of the training (val = false) or validation stream, int64 [count].
  std::function<at::Tensor(bool val, int64_t start, int64_t count)> read;

  /// The first `max_windows` windows of the validation stream (0 = all of them) as a batch like
  /// transform's. dew::Error when the validation stream is shorter than one window.
  Batch validation(int64_t max_windows = 0) const;
};
using LMDataPtr = std::shared_ptr<LMData>;

/// The batch of windows `tokens` (int64 [B, S + 1]): {"tokens"} plus, when packed, "segment_ids" and
/// "positions" computed from eos_id as described above.
Batch lm_batch(const at::Tensor& tokens, int64_t eos_id, bool packed);

/// Builds an LMData over a stream source; `read` must serve both streams (used by the registry entries
/// and by tests with in-memory streams).
LMDataPtr make_lm_data(json spec, json tokenizer, int64_t vocab_size, int64_t eos_id, bool packed, int64_t seq_len,
                       int64_t train_tokens, int64_t val_tokens,
                       std::function<at::Tensor(bool val, int64_t start, int64_t count)> read);

/// Where Debian's fortune-mod data package installs the fortunes.
inline constexpr const char* kFortunesDir = "/usr/share/games/fortunes";

struct TokensDataOptions {
  std::string dir;
  bool check_ids = true;
  template <class V>
  void visit(V& v) {
    v("dir", dir, "dew tokenize output directory (train.bin, val.bin, meta.json)");
    v("check_ids", check_ids, "scan every id against vocab_size when opening");
  }
};

struct FortunesDataOptions {
  std::string dir = kFortunesDir;
  int64_t val_every = 20;
  bool pack = true;
  template <class V>
  void visit(V& v) {
    v("dir", dir, "folder of fortune files (%-separated)");
    v("val_every", val_every, "every val_every-th fortune (0, N, 2N, ... in file order) is validation");
    v("pack", pack, "block-diagonal attention per fortune (segment ids and positions)");
  }
};

/// The registry of LM sources: tokens, fortunes. Each is built with the window length seq_len.
Registry<LMData, int64_t>& lm_datasets();

}  // namespace dew::data

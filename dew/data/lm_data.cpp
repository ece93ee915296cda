#include "dew/data/lm_data.h"

#include "dew/data/text_corpus.h"
#include "dew/data/token_files.h"
#include "dew/data/tokenizer.h"

namespace dew::data {

using at::Tensor;

Batch lm_batch(const Tensor& tokens, int64_t eos_id, bool packed) {
  DEW_CHECK(tokens.dim() == 2 && tokens.scalar_type() == at::kLong, "lm_batch: tokens must be int64 [B, S + 1], got ",
            tokens.scalar_type(), " ", tokens.sizes());
  Batch b{{"tokens", tokens}};
  if (!packed) return b;
  DEW_CHECK(eos_id >= 0, "lm_batch: packing needs an eos_id");
  const int64_t n = tokens.size(1);
  // boundary[t] = 1 when token t - 1 is EOS: token t opens a new document.
  Tensor boundary = at::zeros_like(tokens);
  if (n > 1) boundary.narrow(1, 1, n - 1).copy_((tokens.narrow(1, 0, n - 1) == eos_id).to(at::kLong));
  Tensor seg = boundary.cumsum(1);
  Tensor idx = at::arange(n, tokens.options()).unsqueeze(0).expand_as(tokens);
  Tensor first = std::get<0>((boundary * idx).cummax(1));  // index of the current document's first token
  b["segment_ids"] = seg;
  b["positions"] = idx - first;
  return b;
}

Batch LMData::validation(int64_t max_windows) const {
  const int64_t s = seq_len;
  const int64_t n = val_tokens > s ? (val_tokens - 1) / s : 0;
  DEW_CHECK(n > 0, "validation: the validation stream has ", val_tokens,
            " ids, fewer than one window of seq_len + 1 = ", s + 1);
  const int64_t k = max_windows > 0 ? std::min(max_windows, n) : n;
  std::vector<Tensor> rows;
  rows.reserve(size_t(k));
  for (int64_t i = 0; i < k; ++i) rows.push_back(read(true, i * s, s + 1));
  return lm_batch(at::stack(rows), eos_id, packed);
}

LMDataPtr make_lm_data(json spec, json tokenizer, int64_t vocab_size, int64_t eos_id, bool packed, int64_t seq_len,
                       int64_t train_tokens, int64_t val_tokens, std::function<Tensor(bool, int64_t, int64_t)> read) {
  DEW_CHECK(seq_len > 0, "lm data: seq_len must be > 0, got ", seq_len);
  const int64_t n = train_tokens > seq_len ? (train_tokens - 1) / seq_len : 0;
  DEW_CHECK(n > 0, "lm data ", spec.dump(), ": the training stream has ", train_tokens,
            " ids, fewer than one window of seq_len + 1 = ", seq_len + 1);
  auto d = std::make_shared<LMData>();
  d->spec = std::move(spec);
  d->tokenizer = std::move(tokenizer);
  d->vocab_size = vocab_size;
  d->eos_id = eos_id;
  d->packed = packed;
  d->seq_len = seq_len;
  d->train_tokens = train_tokens;
  d->val_tokens = val_tokens;
  d->read = std::move(read);
  d->windows = std::make_shared<TensorDataset>(Batch{{"start", at::arange(n, at::kLong) * seq_len}}, "lm_windows");
  d->windows->set_spec(d->spec);
  // Captures the reader by value: the loader's workers may outlive the caller's LMData handle.
  auto reader = d->read;
  d->transform = [reader, seq_len, eos_id, packed](Batch& batch) {
    Tensor starts = batch.at("start");
    const int64_t b = starts.size(0);
    const int64_t* p = starts.data_ptr<int64_t>();
    std::vector<Tensor> rows;
    rows.reserve(size_t(b));
    for (int64_t i = 0; i < b; ++i) rows.push_back(reader(false, p[i], seq_len + 1));
    batch = lm_batch(at::stack(rows), eos_id, packed);
  };
  return d;
}

namespace {

// The byte tokenizer's ids of documents, each followed by EOS.
Tensor byte_stream(const std::vector<std::string>& docs, int64_t eos) {
  size_t total = 0;
  for (const auto& d : docs) total += d.size() + 1;
  Tensor out = at::empty({int64_t(total)}, at::kLong);
  int64_t* o = out.data_ptr<int64_t>();
  for (const auto& d : docs) {
    for (unsigned char c : d) *o++ = c;
    *o++ = eos;
  }
  return out;
}

}  // namespace

Registry<LMData, int64_t>& lm_datasets() {
  static auto* r = [] {
    auto* r = new Registry<LMData, int64_t>("lm_dataset");
    r->add<TokensDataOptions>(
        "tokens", "token files written by dew tokenize (memory-mapped train.bin / val.bin + meta.json)",
        [](const TokensDataOptions& o, int64_t seq_len) {
          DEW_CHECK(!o.dir.empty(), "lm_dataset \"tokens\": dir is required (a dew tokenize output directory)");
          auto files = std::make_shared<TokenFiles>(o.dir, o.check_ids);
          const auto& m = files->meta();
          return make_lm_data(
              json{{"name", "tokens"}, {"dir", o.dir}, {"check_ids", o.check_ids}}, m.tokenizer, m.vocab_size, m.eos_id,
              m.packed, seq_len, m.train_tokens, m.val_tokens,
              [files](bool val, int64_t start, int64_t count) { return files->ids(val, start, count); });
        });
    r->add<FortunesDataOptions>(
        "fortunes", "Debian's fortunes, one document per fortune, byte-level ids (256 = EOS)",
        [](const FortunesDataOptions& o, int64_t seq_len) {
          DEW_CHECK(o.val_every >= 2, "lm_dataset \"fortunes\": val_every must be >= 2, got ", o.val_every);
          auto docs = read_documents(o.dir, "fortune");
          std::vector<std::string> train, val;
          for (size_t i = 0; i < docs.size(); ++i) (i % size_t(o.val_every) == 0 ? val : train).push_back(docs[i]);
          auto tok = load_tokenizer(std::string("byte"));
          DEW_CHECK(tok->eos_id() >= 0, "lm_dataset \"fortunes\": the byte tokenizer has no EOS");
          const int64_t eos = tok->eos_id();
          auto streams = std::make_shared<std::pair<Tensor, Tensor>>(byte_stream(train, eos), byte_stream(val, eos));
          return make_lm_data(json{{"name", "fortunes"}, {"dir", o.dir}, {"val_every", o.val_every}, {"pack", o.pack}},
                              tok->spec(), tok->vocab_size(), eos, o.pack, seq_len, streams->first.numel(),
                              streams->second.numel(), [streams](bool val, int64_t start, int64_t count) {
                                const Tensor& s = val ? streams->second : streams->first;
                                DEW_CHECK(start >= 0 && count >= 0 && start + count <= s.numel(), "fortunes: range [",
                                          start, ", ", start + count, ") outside the ", val ? "validation" : "training",
                                          " stream of ", s.numel(), " ids");
                                return s.narrow(0, start, count);
                              });
        });
    return r;
  }();
  return *r;
}

}  // namespace dew::data

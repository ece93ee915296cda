// CLIP's tokenizer, what the CLIP text encoder (dew/nn/clip_text.h) and the CLIP score read captions with.
//
//   dew::data::ClipTokenizer tok("clip/tokenizer.json");
//   auto [ids, mask] = tok.batch({"a photo of a cat"}, 77);   // [1, 77] int64, [1, 77] bool
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "dew/data/tokenizer_detail.h"

namespace dew::data {

/// CLIP's byte-level BPE tokenizer (transformers' CLIPTokenizer / CLIPTokenizerFast): text is lowercased
/// with runs of whitespace folded to one space; CLIP's regex cuts it into words (<|startoftext|>,
/// <|endoftext|>, 's 't 're 've 'm 'll 'd, letter runs, single digits, runs of other non-space
/// characters); each word's bytes map to GPT-2's unicode stand-ins, its last symbol gets "</w>", and
/// symbol pairs merge in merge-rank order. Text is taken as NFC and ftfy's repairs are not applied.
class ClipTokenizer {
 public:
  /// `path`: a tokenizer.json, a vocab.json (merges.txt beside it), or a folder holding either.
  /// The pad token is tokenizer_config.json's pad_token when that file sits beside, else <|endoftext|>.
  explicit ClipTokenizer(const std::string& path);
  ~ClipTokenizer();
  /// The BPE ids of `text` without bos / eos.
  std::vector<int64_t> encode(const std::string& text) const;
  /// [bos, ids..., eos] truncated to `length` (eos kept) and padded with pad_id(): ids [B, length] int64 and
  /// mask [B, length] bool (true for bos .. eos).
  std::pair<at::Tensor, at::Tensor> batch(const std::vector<std::string>& texts, int64_t length) const;
  int64_t bos_id() const { return bos_; }
  int64_t eos_id() const { return eos_; }
  int64_t pad_id() const { return pad_; }
  /// One more than the largest id.
  int64_t vocab_size() const { return vocab_size_; }

 private:
  struct Regex;
  void bpe(const std::string& word, std::vector<int64_t>& ids) const;
  std::unordered_map<std::string, int64_t> vocab_;
  detail::BpeMerges merges_;
  std::unique_ptr<Regex> regex_;
  int64_t bos_ = -1, eos_ = -1, pad_ = -1, unk_ = -1, vocab_size_ = 0;
};

}  // namespace dew::data

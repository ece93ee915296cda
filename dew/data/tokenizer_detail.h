// Internals shared by the tokenizer implementations (tokenizer.cpp, hf_bpe.cpp, sentencepiece.cpp).
// Not part of the public API.
#pragma once
#include <array>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "dew/data/tokenizer.h"

namespace dew {
namespace data {
namespace detail {

/// GPT-2's byte-to-unicode map: byte b -> the UTF-8 text of one printable code point (printable Latin-1
/// bytes map to themselves, the other 68 to U+0100.. in byte order). Used by byte-level BPE files.
const std::array<std::string, 256>& byte_to_unicode();

/// Appends the UTF-8 encoding of code point `cp` to `out`.
void append_utf8(std::string& out, uint32_t cp);

/// The length in bytes of the UTF-8 sequence starting at s[i] (1 for an invalid or truncated lead byte,
/// so that any byte string splits into units).
size_t utf8_length(const std::string& s, size_t i);

/// Writes tokenizer_config.json and special_tokens_map.json for the given special pieces ("" = absent).
void write_hf_token_configs(const std::string& dir, const std::string& bos, const std::string& eos,
                            const std::string& pad, const std::string& unk, const std::string& tokenizer_class);

/// The text of a special-token entry in tokenizer_config.json: "x" or {"content": "x", ...} ("" otherwise).
std::string token_text(const nlohmann::json& entry);

/// A byte-level BPE merge table and its merge loop, shared by hf_bpe and the CLIP tokenizer.
class BpeMerges {
 public:
  /// One entry of a merges list, "a b" or ["a", "b"]; anything else is a dew::Error naming `who` (the
  /// tokenizer and file) and the rank.
  static std::pair<std::string, std::string> parse(const nlohmann::json& entry, int64_t rank, const std::string& who);
  /// Lists the pair (a, b) at `rank` (a lower rank merges first; the first listing of a pair wins).
  void add(const std::string& a, const std::string& b, int64_t rank);
  /// The symbols of `word`: its UTF-8 characters, the last one followed by `end_of_word` (CLIP's "</w>"),
  /// with the listed adjacent pair of lowest rank merged until no listed pair remains.
  std::vector<std::string> apply(const std::string& word, const std::string& end_of_word = "") const;

 private:
  std::unordered_map<std::string, int64_t> ranks_;  // "a\x01b" -> rank
};

TokenizerPtr make_sentencepiece(const SentencePieceOptions& o);
TokenizerPtr make_hf_bpe(const HfBpeOptions& o);

}  // namespace detail
}  // namespace data
}  // namespace dew

// Internals shared by the tokenizer implementations (tokenizer.cpp, hf_bpe.cpp, sentencepiece.cpp).
// Not part of the public API.
#pragma once
#include <array>
#include <cstdint>
#include <string>

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

/// Reads a whole file as bytes; a missing or unreadable file is a dew::Error naming `what` and the path.
std::string read_file(const std::string& path, const std::string& what);

/// Writes `content` to `path` (replacing it); failures are a dew::Error naming the path.
void write_file(const std::string& path, const std::string& content);

/// Writes tokenizer_config.json and special_tokens_map.json for the given special pieces ("" = absent).
void write_hf_token_configs(const std::string& dir, const std::string& bos, const std::string& eos,
                            const std::string& pad, const std::string& unk, const std::string& tokenizer_class);

TokenizerPtr make_sentencepiece(const SentencePieceOptions& o);
TokenizerPtr make_hf_bpe(const HfBpeOptions& o);

}  // namespace detail
}  // namespace data
}  // namespace dew

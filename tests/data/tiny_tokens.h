// A token directory for language-model tests: a repeated sentence as byte ids, packed with EOS (256).
#pragma once
#include <string>
#include <vector>

#include "dew/data/token_files.h"

namespace dew::test {

/// Writes train.bin (40 copies), val.bin (4 copies) and meta.json under `dir`; returns `dir`.
inline std::string write_tiny_tokens(const std::string& dir) {
  std::vector<int64_t> train, val;
  const std::string doc = "the cat sat on the mat.";
  for (int i = 0; i < 40; ++i) {
    for (unsigned char c : doc) train.push_back(c);
    train.push_back(256);
  }
  for (int i = 0; i < 4; ++i) {
    for (unsigned char c : doc) val.push_back(c);
    val.push_back(256);
  }
  data::TokenMeta meta;
  meta.tokenizer = {{"name", "byte"}, {"eos", true}};
  meta.vocab_size = 257;
  meta.eos_id = 256;
  meta.packed = true;
  data::write_token_files(dir, train, val, meta);
  return dir;
}

}  // namespace dew::test

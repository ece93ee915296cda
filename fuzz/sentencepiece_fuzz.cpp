// libFuzzer target for SentencePiece tokenizer.model files (dew/data/sentencepiece.cpp, through
// libsentencepiece): the input is written to a file, loaded as `dew tokenize --tokenizer FILE` loads it,
// and used to encode and decode a few texts. Any input must either be refused with a dew::Error naming the
// file or give a tokenizer whose ids lie in [0, vocab_size()) and decode without error; a crash, a
// sanitizer report, another exception type (the library's own, which names no file) or a broken promise
// is a bug.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <string>

#include "dew/core/error.h"
#include "dew/data/tokenizer.h"
#include "dew/data/tokenizer_detail.h"

namespace {

void require(bool ok) {
  if (!ok) std::abort();
}

// One file per fuzzing process (libFuzzer's -jobs run several), rewritten for each input.
const std::string& scratch_path() {
  static const std::string path = "/tmp/dew-fuzz-sentencepiece-" + std::to_string(getpid()) + ".model";
  return path;
}

// Bytes that are not UTF-8, a NUL first (a literal array: its size counts the NUL).
const char kBadUtf8[] = "\x00\xff\xfe bad utf8 \xc3";

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  {
    std::ofstream f(scratch_path(), std::ios::binary | std::ios::trunc);
    f.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  }
  dew::data::TokenizerPtr tok;
  try {
    dew::data::SentencePieceOptions o;
    o.path = scratch_path();
    tok = dew::data::detail::make_sentencepiece(o);
  } catch (const dew::Error&) {
    return 0;
  }
  const int64_t vocab = tok->vocab_size();
  require(vocab >= 0);
  const std::string texts[] = {"Hello world, it's 1234!", " the  lower\n\n\ttab",
                               "\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80", std::string(kBadUtf8, sizeof(kBadUtf8) - 1),
                               "<|endoftext|><|user|>x"};
  for (const std::string& text : texts) {
    for (bool special : {false, true}) {
      std::vector<int64_t> ids;
      try {
        ids = tok->encode(text, special);
      } catch (const dew::Error&) {
        continue;  // e.g. a byte the vocabulary lacks and no unk_token: refused with a message
      }
      for (int64_t id : ids) require(id >= 0 && id < vocab);
      (void)tok->decode(ids, true);
      (void)tok->decode(ids, false);
      for (int64_t id : ids) (void)tok->id_to_piece(id);
    }
  }
  (void)tok->spec();
  return 0;
}

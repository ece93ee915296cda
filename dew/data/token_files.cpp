#include "dew/data/token_files.h"

#include <ATen/ATen.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "dew/core/error.h"
#include "dew/io/files.h"

namespace fs = std::filesystem;

namespace dew::data {

namespace {

int64_t width_of(const std::string& dtype) { return dtype == "uint8" ? 1 : dtype == "uint16" ? 2 : 4; }

bool little_endian() {
  const uint16_t one = 1;
  uint8_t b;
  std::memcpy(&b, &one, 1);
  return b == 1;
}

// Little-endian bytes of the ids at the format's width.
std::string encode(const std::vector<int64_t>& ids, int64_t width, int64_t vocab, const std::string& what) {
  std::string out(ids.size() * size_t(width), '\0');
  for (size_t i = 0; i < ids.size(); ++i) {
    const int64_t id = ids[i];
    DEW_CHECK(id >= 0 && id < vocab, "write_token_files: ", what, " id ", id, " at index ", i,
              " is outside [0, vocab_size = ", vocab, ")");
    for (int64_t k = 0; k < width; ++k) out[i * size_t(width) + size_t(k)] = char((uint64_t(id) >> (8 * k)) & 0xff);
  }
  return out;
}

void write_atomic(const fs::path& path, const std::string& bytes) {
  try {
    io::write_file_atomic(path.string(), bytes);
  } catch (const Error& e) {
    fail("write_token_files: ", e.what());
  }
}

}  // namespace

std::string token_dtype_for(int64_t vocab_size) {
  DEW_CHECK(vocab_size > 0 && vocab_size <= (int64_t(1) << 32), "token files: vocab_size must be in [1, 2^32], got ",
            vocab_size);
  return vocab_size <= 256 ? "uint8" : vocab_size <= 65536 ? "uint16" : "uint32";
}

void write_token_files(const std::string& dir, const std::vector<int64_t>& train_ids,
                       const std::vector<int64_t>& val_ids, TokenMeta meta) {
  meta.dtype = token_dtype_for(meta.vocab_size);
  DEW_CHECK(meta.eos_id >= -1 && meta.eos_id < meta.vocab_size, "write_token_files: eos_id ", meta.eos_id,
            " is outside [0, vocab_size = ", meta.vocab_size, ") (or -1 = none)");
  DEW_CHECK(!meta.packed || meta.eos_id >= 0, "write_token_files: packed token files need an eos_id");
  meta.train_tokens = int64_t(train_ids.size());
  meta.val_tokens = int64_t(val_ids.size());
  const int64_t w = width_of(meta.dtype);
  const std::string train = encode(train_ids, w, meta.vocab_size, "train");
  const std::string val = encode(val_ids, w, meta.vocab_size, "val");
  fs::create_directories(dir);
  write_atomic(fs::path(dir) / "train.bin", train);
  write_atomic(fs::path(dir) / "val.bin", val);
  // meta.json last: its presence marks a complete directory.
  write_atomic(fs::path(dir) / "meta.json", to_json(meta).dump(2) + "\n");
}

// ---- reading ----

struct TokenFiles::Map {
  std::string path;
  const uint8_t* data = nullptr;
  size_t bytes = 0;
  Map(const std::string& p, size_t expected) : path(p) {
    const int fd = ::open(p.c_str(), O_RDONLY);
    DEW_CHECK(fd >= 0, p, ": cannot open (", std::strerror(errno), ")");
    struct stat st {};
    ::fstat(fd, &st);
    bytes = size_t(st.st_size);
    if (bytes != expected) {
      ::close(fd);
      fail(p, ": ", bytes, " bytes, but meta.json's token count and dtype give ", expected,
           " (truncated or mismatched file)");
    }
    if (bytes > 0) {
      void* m = ::mmap(nullptr, bytes, PROT_READ, MAP_PRIVATE, fd, 0);
      ::close(fd);
      DEW_CHECK(m != MAP_FAILED, p, ": mmap failed (", std::strerror(errno), ")");
      data = static_cast<const uint8_t*>(m);
    } else {
      ::close(fd);
    }
  }
  ~Map() {
    if (data) ::munmap(const_cast<uint8_t*>(data), bytes);
  }
};

TokenFiles::TokenFiles(const std::string& dir, bool check_ids) : dir_(dir) {
  const fs::path meta_path = fs::path(dir) / "meta.json";
  DEW_CHECK(fs::is_directory(dir), "token files: ", dir, " is not a directory (expected the output of dew tokenize)");
  std::ifstream f(meta_path);
  DEW_CHECK(f.good(), meta_path.string(),
            ": missing (expected {tokenizer, vocab_size, dtype, train_tokens, val_tokens, eos_id})");
  json j;
  try {
    j = io::parse_json(std::string(std::istreambuf_iterator<char>(f), {}), meta_path.string());
  } catch (const std::exception& e) {
    fail(meta_path.string(), ": invalid JSON (", e.what(), ")");
  }
  for (const char* k : {"vocab_size", "dtype", "train_tokens", "val_tokens"})
    DEW_CHECK(j.is_object() && j.contains(k), meta_path.string(), ": missing field \"", k, "\"");
  meta_ = from_json<TokenMeta>(j, meta_path.string());
  const auto& m = meta_;
  const std::string want = token_dtype_for(m.vocab_size);
  DEW_CHECK(m.dtype == want, meta_path.string(), ": dtype \"", m.dtype, "\" does not match vocab_size ", m.vocab_size,
            " (expected \"", want, "\")");
  DEW_CHECK(m.train_tokens >= 0 && m.val_tokens >= 0, meta_path.string(), ": token counts must be >= 0, got ",
            m.train_tokens, " and ", m.val_tokens);
  DEW_CHECK(m.eos_id >= -1 && m.eos_id < m.vocab_size, meta_path.string(), ": eos_id ", m.eos_id,
            " is outside [0, vocab_size = ", m.vocab_size, ") (or -1 = none)");
  DEW_CHECK(!m.packed || m.eos_id >= 0, meta_path.string(), ": packed files need an eos_id >= 0");
  DEW_CHECK(little_endian(), "token files: this reader assumes a little-endian host");
  const int64_t w = width_of(m.dtype);
  train_ = std::make_unique<Map>((fs::path(dir) / "train.bin").string(), size_t(m.train_tokens * w));
  val_ = std::make_unique<Map>((fs::path(dir) / "val.bin").string(), size_t(m.val_tokens * w));
  if (check_ids) {
    for (bool v : {false, true}) {
      const int64_t n = size(v);
      const int64_t block = int64_t(1) << 22;
      for (int64_t s = 0; s < n; s += block) {
        at::Tensor ids_block = ids(v, s, std::min(block, n - s));
        const int64_t hi = ids_block.max().item<int64_t>();
        if (hi >= m.vocab_size) {
          const int64_t at_i = s + (ids_block >= m.vocab_size).nonzero()[0][0].item<int64_t>();
          fail((v ? val_ : train_)->path, ": id ", hi, " (first bad one at index ", at_i, ") is >= vocab_size ",
               m.vocab_size, " of meta.json");
        }
      }
    }
  }
}

TokenFiles::~TokenFiles() = default;

at::Tensor TokenFiles::ids(bool val, int64_t start, int64_t count) const {
  const Map& m = val ? *val_ : *train_;
  const int64_t n = size(val);
  DEW_CHECK(start >= 0 && count >= 0 && start + count <= n, m.path, ": range [", start, ", ", start + count,
            ") is outside its ", n, " tokens");
  at::Tensor out = at::empty({count}, at::kLong);
  int64_t* o = out.data_ptr<int64_t>();
  const uint8_t* p = m.data;
  if (meta_.dtype == "uint8") {
    for (int64_t i = 0; i < count; ++i) o[i] = p[start + i];
  } else if (meta_.dtype == "uint16") {
    const uint8_t* q = p + 2 * start;
    for (int64_t i = 0; i < count; ++i) o[i] = int64_t(q[2 * i]) | (int64_t(q[2 * i + 1]) << 8);
  } else {
    const uint8_t* q = p + 4 * start;
    for (int64_t i = 0; i < count; ++i) {
      uint32_t v;
      std::memcpy(&v, q + 4 * i, 4);
      o[i] = int64_t(v);
    }
  }
  return out;
}

}  // namespace dew::data

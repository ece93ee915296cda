// IDX files (Fashion-MNIST) without LibTorch: the part of read_idx (dew/data/dataset.h) that reads
// untrusted bytes, kept free of ATen so that scripts/fuzz can build it alone (fuzz/idx_fuzz.cpp).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace dew {
namespace data {

/// The dimensions and items of an IDX file of unsigned bytes.
struct IdxBytes {
  std::vector<int64_t> dims;  // e.g. [N, 28, 28] for magic 2051, [N] for 2049
  std::vector<uint8_t> data;  // prod(dims) bytes, row-major
};

/// Reads an IDX file of unsigned bytes, gzipped or plain (zlib reads both), whose 32-bit big-endian
/// magic must equal `magic` (0x0801-0x0804: unsigned bytes with 1-4 dimensions). Missing, truncated,
/// trailing-garbage, bad-magic or zero-dimension files and headers declaring more than 16 GiB are a
/// dew::Error naming the file. Memory grows with the bytes actually read, never with the size the
/// header declares, so a 100-byte file cannot make it allocate gigabytes.
IdxBytes read_idx_bytes(const std::string& path, int32_t magic);

}  // namespace data
}  // namespace dew

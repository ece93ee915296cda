// safetensors header parsing and validation, without LibTorch (so the fuzzer links only this file).
//
// File layout (https://github.com/huggingface/safetensors):
//   [8 bytes]  N, little-endian uint64: length of the JSON header
//   [N bytes]  JSON object {name: {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]},
//                           "__metadata__": {string: string}}   (optional, may be padded with spaces)
//   [rest]     the data section; each tensor's bytes are [begin, end) relative to its start, row-major,
//              little-endian, and the tensors tile the section exactly (no overlaps, no holes).
//
// Example:
//   dew::io::Header h = dew::io::parse_header(bytes, n, "model.safetensors");
//   for (const auto& t : h.tensors) use(bytes + h.data_start + t.begin, t.end - t.begin);
#pragma once
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace dew {
namespace io {

/// Element types of the format, named as in the file ("F32", "BF16", ...).
enum class Dtype { F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL };

/// Bytes per element: 8, 4, 2, 2, 8, 4, 2, 1, 1, 1.
size_t dtype_size(Dtype dtype);

/// The file's name for `dtype`, e.g. "BF16".
const char* dtype_name(Dtype dtype);

/// Parses a dtype name; an unknown one is a dew::Error that starts with `where` and lists the accepted names.
Dtype dtype_from_string(const std::string& name, const std::string& where);

/// One tensor as the header describes it. Offsets are relative to the data section.
struct TensorEntry {
  std::string name;
  Dtype dtype = Dtype::F32;
  std::vector<int64_t> shape;  // empty for a 0-d scalar
  uint64_t begin = 0;          // first byte
  uint64_t end = 0;            // one past the last byte; end - begin == numel * dtype_size
};

/// The validated header of a whole file.
struct Header {
  std::vector<TensorEntry> tensors;             // sorted by begin (the file's data order)
  std::map<std::string, std::string> metadata;  // "__metadata__", empty when absent
  uint64_t data_start = 0;                      // 8 + header length: where the data section starts
  uint64_t data_size = 0;                       // bytes in the data section (file size - data_start)
};

/// Largest accepted JSON header; anything bigger is taken as a corrupt length field.
constexpr uint64_t kMaxHeaderBytes = 100ull * 1000 * 1000;

/// Parses and validates the header of the `size` bytes at `data`; reads nothing outside them. Every
/// length, offset, dtype and shape is checked, so the returned entries can be used without further
/// checks. Throws dew::Error naming `path_for_errors`, the tensor and field, the bad value and what is accepted.
Header parse_header(const uint8_t* data, size_t size, const std::string& path_for_errors);

}  // namespace io
}  // namespace dew

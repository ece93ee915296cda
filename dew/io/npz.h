// NumPy's .npy and .npz files (docs/evaluation.md#reference-statistics): pytorch-fid and clean-fid keep a
// dataset's Inception statistics as `np.savez(path, mu=..., sigma=...)` (stored) or `np.savez_compressed`
// (deflate), so dew reads both and writes either.
//
//   auto stats = dew::io::read_npz("fid_stats_cifar10_train.npz");   // {"mu": [2048], "sigma": [2048, 2048]}
//   dew::io::write_npz("ref.npz", {{"mu", mu}, {"sigma", sigma}}, /*compressed=*/true);
//
// Every length, offset and header field is checked against the bytes actually present: malformed input is
// a dew::Error naming the file and what was wrong, never a crash (tests/io/test_npz.cpp, fuzzed later).
#pragma once
#include <ATen/core/Tensor.h>

#include <map>
#include <string>
#include <string_view>

namespace dew::io {

/// One .npy array (format versions 1.0, 2.0, 3.0) -> a contiguous CPU tensor. dtypes: float16/32/64,
/// int8/16/32/64, uint8, bool, in either byte order; C or Fortran order. `what` names the source in errors.
at::Tensor parse_npy(std::string_view bytes, const std::string& what);
/// A tensor (any shape, a dtype listed above) as .npy 1.0 bytes, little-endian, C order.
std::string npy_bytes(const at::Tensor& tensor);

/// The arrays of an .npz (a zip of NAME.npy members, stored or deflated; zip64 fields understood), keyed
/// by NAME without ".npy". CRC-32 of every member is checked.
std::map<std::string, at::Tensor> parse_npz(std::string_view bytes, const std::string& what);
/// read_file + parse_npz.
std::map<std::string, at::Tensor> read_npz(const std::string& path);
/// The .npz bytes of `arrays` (members NAME.npy, stored, or deflated when `compressed`).
std::string npz_bytes(const std::map<std::string, at::Tensor>& arrays, bool compressed);
/// npz_bytes written atomically (io::write_file_atomic).
void write_npz(const std::string& path, const std::map<std::string, at::Tensor>& arrays, bool compressed = true);

}  // namespace dew::io

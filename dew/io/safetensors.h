// safetensors files on the LibTorch side: a memory-mapped reader and an atomic writer (docs/training.md#runs-dewruns).
//
// Example:
//   auto f = dew::io::SafetensorsFile::open("model.safetensors");
//   at::Tensor w = f.tensor("blocks.0.attn.to_q.weight");          // a copy, owns its memory
//   at::Tensor v = f.tensor("blocks.0.attn.to_q.weight", false);   // zero-copy view of the mapping
//   dew::io::save_safetensors("out.safetensors", {{"w", w}}, {{"format", "pt"}});
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "dew/io/safetensors_header.h"

namespace dew {
namespace io {

/// The LibTorch scalar type of a file dtype (F32 -> at::kFloat, BOOL -> at::kBool, ...).
at::ScalarType scalar_type(Dtype dtype);

/// The file dtype of a LibTorch scalar type; types the format cannot hold are a dew::Error naming `where`.
Dtype dtype_of(at::ScalarType type, const std::string& where);

/// A safetensors file mapped into memory. The header is fully validated by open(); tensor data is only
/// read when a tensor is asked for. The mapping is private copy-on-write: in-place writes to zero-copy
/// tensors stay in this process and never reach the file. The file must not be truncated by another
/// process while mapped (the kernel would signal SIGBUS on access).
class SafetensorsFile {
 public:
  /// Maps and validates `path`; a missing, unreadable or malformed file is a dew::Error naming it.
  static SafetensorsFile open(const std::string& path);

  /// The path the file was opened with.
  const std::string& path() const;

  /// The validated header: entries in data order, metadata, data section bounds.
  const Header& header() const;

  /// Tensor names, sorted.
  std::vector<std::string> names() const;

  /// Whether the file holds a tensor called `name`.
  bool contains(const std::string& name) const;

  /// The tensor `name` on the CPU. copy=true returns a tensor owning its memory. copy=false returns a
  /// view over the mapping that keeps it alive, when the data is aligned for its dtype (else a copy).
  /// An unknown name is a dew::Error listing available names.
  at::Tensor tensor(const std::string& name, bool copy = true) const;

  /// Hands the pages holding `name`'s bytes back to the kernel once they have been copied elsewhere, so a
  /// load through the mapping does not keep the whole file resident (the pages are read again if asked
  /// for). In-place writes to a zero-copy view of `name` are lost: call it only when no such view is kept.
  void release(const std::string& name) const;

  /// The "__metadata__" string map (empty when the file has none).
  std::map<std::string, std::string> metadata() const;

 private:
  struct Mapping;
  SafetensorsFile(std::string path, std::shared_ptr<Mapping> mapping, Header header);

  std::string path_;
  std::shared_ptr<Mapping> mapping_;  // shared with zero-copy tensors' deleters
  Header header_;
  std::map<std::string, size_t> index_;  // name -> position in header_.tensors
};

/// Reads every tensor of `path` into memory (copies; the file is unmapped on return).
std::map<std::string, at::Tensor> load_safetensors(const std::string& path);

/// Writes `tensors` (any device and layout of strides; stored as CPU contiguous little-endian data) and
/// `metadata` to `path` through `path + ".tmp"`, fsync and rename, so a crash never leaves a torn file.
/// Unsupported dtypes, non-dense tensors and the reserved name "__metadata__" are a dew::Error.
void save_safetensors(const std::string& path, const std::map<std::string, at::Tensor>& tensors,
                      const std::map<std::string, std::string>& metadata = {});

}  // namespace io
}  // namespace dew

// The one weight loader (docs/backbones.md, docs/training.md#runs-dewruns): every checkpoint dew reads — its own run checkpoints,
// a diffusers / transformers safetensors file, a sharded `*.safetensors.index.json`, a model folder —
// goes through load_weights(): a source of named tensors, a key map from the source's names to the
// module's, and a load that checks everything before it copies anything.
//
//   auto src = dew::io::WeightSource::open("hf_model/");           // model.safetensors or its index
//   dew::io::KeyMap map;
//   map.prefix("model.", "").skip(R"(.*rotary_emb\.inv_freq)");    // transformers names -> dew's
//   auto report = dew::io::load_weights(*model, src, map);         // throws before copying on any mismatch
//   std::cout << report.summary();                                  // "loaded 54 tensors (3 skipped)"
#pragma once
#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace dew::io {

/// Named tensors to load from. File sources are memory-mapped: a tensor's bytes are read when it is
/// copied into the module, one at a time, so loading needs about one model of memory.
class WeightSource {
 public:
  /// A `.safetensors` file; a sharded `NAME.safetensors.index.json` (its weight_map names shard files
  /// beside it); or a folder holding `model.safetensors[.index.json]` or
  /// `diffusion_pytorch_model.safetensors[.index.json]`. Headers are validated here; dew::Error names the
  /// file and what was expected.
  static WeightSource open(const std::string& path);
  /// Tensors already in memory (a run's checkpoint); `description` names them in errors.
  static WeightSource of_tensors(std::map<std::string, at::Tensor> tensors, std::string description);

  /// The path or description, for messages.
  const std::string& describe() const;
  /// Tensor names, sorted.
  std::vector<std::string> names() const;
  bool contains(const std::string& name) const;
  std::vector<int64_t> shape(const std::string& name) const;
  at::ScalarType dtype(const std::string& name) const;
  /// The tensor (a view of the mapping where its bytes are aligned, else a copy).
  at::Tensor tensor(const std::string& name) const;
  /// After `tensor(name)` has been copied into a module: lets the file's pages go (SafetensorsFile::release),
  /// so loading a folder keeps about one model resident, not the model plus the files. No-op in memory.
  void release(const std::string& name) const;

 private:
  struct Impl;
  explicit WeightSource(std::shared_ptr<const Impl> impl);
  std::shared_ptr<const Impl> impl_;
};

/// Source names -> module names: an ordered list of rules. A name is renamed by every rename rule that
/// matches, in order; a skip rule that matches the original name drops it; a transform rule (matching
/// the renamed name) reshapes the tensor or splits it into several module tensors.
class KeyMap {
 public:
  /// Replaces a leading `from` by `to` ("model." -> "").
  KeyMap& prefix(const std::string& from, const std::string& to);
  /// std::regex_replace with an ECMAScript pattern over the whole name ("(.*)\\.gamma$" -> "$1.weight").
  KeyMap& regex(const std::string& pattern, const std::string& replacement);
  /// Drops source names matching `pattern` entirely (a vision tower, a buffer older files carry).
  KeyMap& skip(const std::string& pattern);
  /// A source name matching `pattern` is an error saying `why` (a 2D unet state must not carry temporal blocks).
  KeyMap& refuse(const std::string& pattern, const std::string& why);
  /// Module names matching `pattern` may be absent from the source and keep their values (an inflated
  /// model's new blocks).
  KeyMap& allow_missing(const std::string& pattern);
  /// A renamed name matching `pattern` is split along `dim` into equal parts named by `targets` (each a
  /// regex replacement of the name, e.g. fused qkv -> "$1.q_proj.weight", "$1.k_proj.weight", ...).
  KeyMap& split(const std::string& pattern, std::vector<std::string> targets, int64_t dim = 0);
  /// A renamed name matching `pattern` has its 2-D tensor transposed (Conv1D-style checkpoints).
  KeyMap& transpose(const std::string& pattern);
  /// A renamed name matching `pattern` loses its trailing size-1 dims beyond the second: the [C, C, 1, 1]
  /// 1x1-conv weights of original LDM checkpoints load into a [C, C] linear. Other shapes pass unchanged.
  KeyMap& squeeze(const std::string& pattern);

  /// What a source name becomes: (module name, tensor transform) pairs; empty when skipped.
  struct Target {
    std::string name;
    std::function<at::Tensor(const at::Tensor&)> transform;  // null = as stored
    std::vector<int64_t> shape;                              // the transformed shape
  };
  std::vector<Target> map(const std::string& source_name, const std::vector<int64_t>& shape) const;
  bool may_be_missing(const std::string& module_name) const;

 private:
  struct Rule;
  std::vector<std::shared_ptr<const Rule>> rules_;
};

struct LoadOptions {
  bool strict = true;           // a source tensor the module does not have is an error (else reported)
  bool require_buffers = true;  // every module buffer must be in the source (else absent buffers keep their values)
  bool keep_dtype = false;      // inference: parameters take the file's dtype instead of being cast to theirs
};

/// What a load did.
struct LoadReport {
  std::vector<std::string> loaded;      // module names, sorted
  std::vector<std::string> skipped;     // source names a skip rule dropped
  std::vector<std::string> unexpected;  // source names the module lacks (only when not strict)
  std::vector<std::string> kept;        // module names absent from the source, allowed to keep their values
  std::string summary() const;
};

/// Loads `source` into `module`'s parameters and buffers through `map`. Everything is checked first
/// (module names exist, no name is written twice, shapes match, floating tensors for floating parameters,
/// nothing required is missing); on any mismatch a dew::Error naming the source, the tensor and what was
/// expected is thrown and the module is unchanged. fp16 / bf16 / fp64 widen or narrow to the parameter's
/// dtype unless keep_dtype.
LoadReport load_weights(torch::nn::Module& module, const WeightSource& source, const KeyMap& map = {},
                        const LoadOptions& options = {});

}  // namespace dew::io

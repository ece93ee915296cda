#include "dew/io/weights.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>

#include "dew/core/error.h"
#include "dew/io/safetensors.h"

namespace fs = std::filesystem;

namespace dew::io {

namespace {

std::string list_some(const std::vector<std::string>& names, size_t most = 5) {
  std::string out;
  for (size_t i = 0; i < names.size() && i < most; ++i) out += (i ? ", \"" : "\"") + names[i] + "\"";
  if (names.size() > most) out += ", ... (" + std::to_string(names.size()) + " in all)";
  return out;
}

std::regex compile(const std::string& pattern, const char* rule) {
  try {
    return std::regex(pattern, std::regex::ECMAScript);
  } catch (const std::regex_error& e) {
    fail("key map ", rule, ": invalid regular expression \"", pattern, "\": ", e.what());
  }
}

}  // namespace

// ---- sources ----

struct WeightSource::Impl {
  std::string description;
  std::vector<SafetensorsFile> files;
  static constexpr size_t kMemory = size_t(-1);
  struct Entry {
    size_t file;  // index into files, or kMemory
    at::ScalarType dtype;
    std::vector<int64_t> shape;
  };
  std::map<std::string, Entry> file_of;       // name -> where it is, its dtype and shape
  std::map<std::string, at::Tensor> tensors;  // in-memory sources
  const Entry& entry(const std::string& name) const;
};

WeightSource::WeightSource(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}

WeightSource WeightSource::of_tensors(std::map<std::string, at::Tensor> tensors, std::string description) {
  auto impl = std::make_shared<Impl>();
  impl->description = std::move(description);
  impl->tensors = std::move(tensors);
  for (const auto& [name, t] : impl->tensors) impl->file_of[name] = {Impl::kMemory, t.scalar_type(), t.sizes().vec()};
  return WeightSource(impl);
}

WeightSource WeightSource::open(const std::string& path_in) {
  fs::path path(path_in);
  if (fs::is_directory(path)) {
    std::string looked;
    for (const char* stem : {"model", "diffusion_pytorch_model"}) {
      for (const char* ext : {".safetensors.index.json", ".safetensors"}) {
        const fs::path p = path / (std::string(stem) + ext);
        if (fs::is_regular_file(p)) return open(p.string());
        looked += (looked.empty() ? "" : ", ") + p.filename().string();
      }
    }
    fail("weights: folder \"", path_in, "\" holds none of ", looked);
  }
  DEW_CHECK(fs::is_regular_file(path), "weights: \"", path_in, "\" does not exist (expected a .safetensors file, ",
            "a .safetensors.index.json or a model folder)");
  auto impl = std::make_shared<Impl>();
  impl->description = path_in;
  const std::string name = path.filename().string();
  const std::string index_ext = ".index.json";
  if (name.size() > index_ext.size() &&
      name.compare(name.size() - index_ext.size(), index_ext.size(), index_ext) == 0) {
    nlohmann::json idx;
    try {
      idx = nlohmann::json::parse(std::ifstream(path));
    } catch (const std::exception& e) {
      fail("weights: \"", path_in, "\": invalid JSON: ", e.what());
    }
    DEW_CHECK(idx.is_object() && idx.contains("weight_map") && idx["weight_map"].is_object(), "weights: \"", path_in,
              "\" has no weight_map object");
    std::map<std::string, size_t> shard_index;
    for (auto it = idx["weight_map"].begin(); it != idx["weight_map"].end(); ++it) {
      DEW_CHECK(it.value().is_string(), "weights: \"", path_in, "\": weight_map entry \"", it.key(),
                "\" must name a file");
      const std::string shard = it.value().get<std::string>();
      DEW_CHECK(!shard.empty() && shard.find('/') == std::string::npos && shard != "." && shard != "..", "weights: \"",
                path_in, "\": weight_map entry \"", it.key(), "\" names \"", shard,
                "\", which is not a file beside it");
      auto s = shard_index.find(shard);
      if (s == shard_index.end()) {
        impl->files.push_back(SafetensorsFile::open((path.parent_path() / shard).string()));
        s = shard_index.emplace(shard, impl->files.size() - 1).first;
      }
      DEW_CHECK(impl->files[s->second].contains(it.key()), "weights: \"", path_in, "\" puts \"", it.key(), "\" in \"",
                shard, "\", which does not hold it");
      impl->file_of[it.key()] = {s->second, at::kFloat, {}};
    }
  } else {
    impl->files.push_back(SafetensorsFile::open(path_in));
    for (const auto& n : impl->files.back().names()) impl->file_of[n] = {0, at::kFloat, {}};
  }
  // Shapes and dtypes from the headers, for checking before any data is read.
  for (size_t i = 0; i < impl->files.size(); ++i)
    for (const auto& e : impl->files[i].header().tensors) {
      auto it = impl->file_of.find(e.name);
      if (it != impl->file_of.end() && it->second.file == i) it->second = {i, scalar_type(e.dtype), e.shape};
    }
  return WeightSource(impl);
}

const std::string& WeightSource::describe() const { return impl_->description; }

std::vector<std::string> WeightSource::names() const {
  std::vector<std::string> out;
  for (const auto& kv : impl_->file_of) out.push_back(kv.first);
  return out;
}

bool WeightSource::contains(const std::string& name) const { return impl_->file_of.count(name) > 0; }

const WeightSource::Impl::Entry& WeightSource::Impl::entry(const std::string& name) const {
  auto it = file_of.find(name);
  DEW_CHECK(it != file_of.end(), "weights: ", description, " has no tensor \"", name, "\"");
  return it->second;
}

std::vector<int64_t> WeightSource::shape(const std::string& name) const { return impl_->entry(name).shape; }

at::ScalarType WeightSource::dtype(const std::string& name) const { return impl_->entry(name).dtype; }

at::Tensor WeightSource::tensor(const std::string& name) const {
  const auto& e = impl_->entry(name);
  return e.file == Impl::kMemory ? impl_->tensors.at(name) : impl_->files[e.file].tensor(name, /*copy=*/false);
}

void WeightSource::release(const std::string& name) const {
  const auto& e = impl_->entry(name);
  if (e.file != Impl::kMemory) impl_->files[e.file].release(name);
}

// ---- key maps ----

struct KeyMap::Rule {
  enum Kind { kPrefix, kRegex, kSkip, kRefuse, kAllowMissing, kSplit, kTranspose, kSqueeze } kind;
  std::string from, to;
  std::regex pattern;
  std::vector<std::string> targets;
  int64_t dim = 0;
};

KeyMap& KeyMap::prefix(const std::string& from, const std::string& to) {
  rules_.push_back(std::make_shared<Rule>(Rule{Rule::kPrefix, from, to, {}, {}, 0}));
  return *this;
}

KeyMap& KeyMap::regex(const std::string& pattern, const std::string& replacement) {
  rules_.push_back(std::make_shared<Rule>(Rule{Rule::kRegex, pattern, replacement, compile(pattern, "regex"), {}, 0}));
  return *this;
}

KeyMap& KeyMap::skip(const std::string& pattern) {
  rules_.push_back(std::make_shared<Rule>(Rule{Rule::kSkip, pattern, "", compile(pattern, "skip"), {}, 0}));
  return *this;
}

KeyMap& KeyMap::refuse(const std::string& pattern, const std::string& why) {
  rules_.push_back(std::make_shared<Rule>(Rule{Rule::kRefuse, pattern, why, compile(pattern, "refuse"), {}, 0}));
  return *this;
}

KeyMap& KeyMap::allow_missing(const std::string& pattern) {
  rules_.push_back(
      std::make_shared<Rule>(Rule{Rule::kAllowMissing, pattern, "", compile(pattern, "allow_missing"), {}, 0}));
  return *this;
}

KeyMap& KeyMap::split(const std::string& pattern, std::vector<std::string> targets, int64_t dim) {
  DEW_CHECK(targets.size() >= 2, "key map split \"", pattern, "\": needs at least two targets, got ", targets.size());
  rules_.push_back(
      std::make_shared<Rule>(Rule{Rule::kSplit, pattern, "", compile(pattern, "split"), std::move(targets), dim}));
  return *this;
}

KeyMap& KeyMap::transpose(const std::string& pattern) {
  rules_.push_back(std::make_shared<Rule>(Rule{Rule::kTranspose, pattern, "", compile(pattern, "transpose"), {}, 0}));
  return *this;
}

KeyMap& KeyMap::squeeze(const std::string& pattern) {
  rules_.push_back(std::make_shared<Rule>(Rule{Rule::kSqueeze, pattern, "", compile(pattern, "squeeze"), {}, 0}));
  return *this;
}

bool KeyMap::may_be_missing(const std::string& module_name) const {
  for (const auto& r : rules_)
    if (r->kind == Rule::kAllowMissing && std::regex_match(module_name, r->pattern)) return true;
  return false;
}

std::vector<KeyMap::Target> KeyMap::map(const std::string& source_name, const std::vector<int64_t>& shape) const {
  for (const auto& r : rules_) {
    if (r->kind == Rule::kSkip && std::regex_match(source_name, r->pattern)) return {};
    if (r->kind == Rule::kRefuse && std::regex_match(source_name, r->pattern))
      fail("weights: \"", source_name, "\" is not accepted here: ", r->to);
  }
  std::string name = source_name;
  for (const auto& r : rules_) {
    if (r->kind == Rule::kPrefix && name.rfind(r->from, 0) == 0) name = r->to + name.substr(r->from.size());
    if (r->kind == Rule::kRegex && std::regex_match(name, r->pattern))
      name = std::regex_replace(name, r->pattern, r->to);
  }
  for (const auto& r : rules_) {
    if (r->kind == Rule::kTranspose && std::regex_match(name, r->pattern)) {
      DEW_CHECK(shape.size() == 2, "key map transpose: \"", source_name, "\" is not 2-D (shape has ", shape.size(),
                " dims)");
      return {{name, [](const at::Tensor& t) { return t.t(); }, {shape[1], shape[0]}}};
    }
    if (r->kind == Rule::kSqueeze && std::regex_match(name, r->pattern)) {
      std::vector<int64_t> squeezed = shape;
      while (squeezed.size() > 2 && squeezed.back() == 1) squeezed.pop_back();
      if (squeezed.size() != shape.size())
        return {{name, [squeezed](const at::Tensor& t) { return t.reshape(squeezed); }, squeezed}};
    }
    if (r->kind == Rule::kSplit && std::regex_match(name, r->pattern)) {
      const int64_t parts = int64_t(r->targets.size());
      const int64_t dim = r->dim < 0 ? r->dim + int64_t(shape.size()) : r->dim;
      DEW_CHECK(dim >= 0 && dim < int64_t(shape.size()) && shape[size_t(dim)] % parts == 0, "key map split: \"",
                source_name, "\" cannot be split into ", parts, " equal parts along dim ", r->dim);
      std::vector<int64_t> part_shape = shape;
      part_shape[size_t(dim)] /= parts;
      std::vector<Target> out;
      for (int64_t i = 0; i < parts; ++i) {
        const int64_t len = part_shape[size_t(dim)];
        out.push_back({std::regex_replace(name, r->pattern, r->targets[size_t(i)]),
                       [dim, i, len](const at::Tensor& t) { return t.narrow(dim, i * len, len); }, part_shape});
      }
      return out;
    }
  }
  return {{name, nullptr, shape}};
}

// ---- loading ----

std::string LoadReport::summary() const {
  std::string s = "loaded " + std::to_string(loaded.size()) + " tensors";
  if (!skipped.empty()) s += ", skipped " + std::to_string(skipped.size());
  if (!kept.empty()) s += ", kept " + std::to_string(kept.size()) + " at their values";
  if (!unexpected.empty()) s += ", ignored " + std::to_string(unexpected.size()) + " the model lacks";
  return s;
}

LoadReport load_weights(torch::nn::Module& module, const WeightSource& source, const KeyMap& map,
                        const LoadOptions& o) {
  const std::string& src = source.describe();
  std::map<std::string, at::Tensor> targets;  // module name -> its tensor
  std::set<std::string> buffers;
  for (const auto& kv : module.named_parameters()) targets[kv.key()] = kv.value();
  for (const auto& kv : module.named_buffers()) {
    targets[kv.key()] = kv.value();
    buffers.insert(kv.key());
  }
  struct Copy {
    std::string source_name;
    KeyMap::Target target;
  };
  std::vector<Copy> plan;
  std::map<std::string, std::string> written;  // module name -> source name
  LoadReport report;
  // Everything is checked before the first copy.
  for (const auto& name : source.names()) {
    const auto shape = source.shape(name);
    auto mapped = map.map(name, shape);
    if (mapped.empty()) {
      report.skipped.push_back(name);
      continue;
    }
    for (auto& t : mapped) {
      auto it = targets.find(t.name);
      if (it == targets.end()) {
        report.unexpected.push_back(t.name == name ? name : name + "\" (as \"" + t.name);
        continue;
      }
      DEW_CHECK(!written.count(t.name), "weights: ", src, ": \"", name, "\" and \"", written[t.name],
                "\" both map to \"", t.name, "\"");
      DEW_CHECK(t.shape == it->second.sizes().vec(), "weights: ", src, ": tensor \"", name, "\"",
                t.name == name ? "" : " (as \"" + t.name + "\")", " has shape ", at::IntArrayRef(t.shape),
                ", the model expects ", it->second.sizes());
      const auto dt = source.dtype(name), want = it->second.scalar_type();
      DEW_CHECK(at::isFloatingType(dt) == at::isFloatingType(want) && (dt == at::kBool) == (want == at::kBool),
                "weights: ", src, ": tensor \"", name, "\" has dtype ", dt, ", the model's \"", t.name, "\" is ",
                it->second.scalar_type());
      written[t.name] = name;
      plan.push_back({name, std::move(t)});
    }
  }
  std::vector<std::string> missing;
  for (const auto& [name, t] : targets) {
    if (written.count(name)) continue;
    if (map.may_be_missing(name) || (!o.require_buffers && buffers.count(name))) {
      report.kept.push_back(name);
      continue;
    }
    missing.push_back(name);
  }
  const bool refuse_unexpected = o.strict && !report.unexpected.empty();
  if (!missing.empty() || refuse_unexpected) {
    std::string msg = "weights: " + src;
    if (!missing.empty())
      msg += " lacks " + std::to_string(missing.size()) + " tensor(s) the model needs: " + list_some(missing);
    if (refuse_unexpected)
      msg += std::string(missing.empty() ? "" : ";") + " holds " + std::to_string(report.unexpected.size()) +
             " tensor(s) the model does not have: " + list_some(report.unexpected);
    fail(msg, " (another architecture, or fields that differ from the checkpoint's?)");
  }

  at::NoGradGuard ng;
  for (const auto& c : plan) {
    at::Tensor t = source.tensor(c.source_name);
    if (c.target.transform) t = c.target.transform(t);
    at::Tensor& dst = targets.at(c.target.name);
    if (o.keep_dtype && t.scalar_type() != dst.scalar_type() && !buffers.count(c.target.name)) {
      dst.set_data(t.to(dst.device(), t.scalar_type(), /*non_blocking=*/false, /*copy=*/true));
    } else {
      dst.copy_(t);
    }
    t = at::Tensor();  // the zero-copy view goes before its pages do
    source.release(c.source_name);
    report.loaded.push_back(c.target.name);
  }
  std::sort(report.loaded.begin(), report.loaded.end());
  return report;
}

}  // namespace dew::io

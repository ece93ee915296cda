#include "dew/nn/lora.h"

#include <torch/nn/functional/conv.h>
#include <torch/nn/init.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <filesystem>
#include <map>
#include <regex>
#include <set>
#include <sstream>

#include "dew/core/error.h"
#include "dew/io/files.h"
#include "dew/io/safetensors.h"

namespace dew::nn {

namespace {

// Set by the first attach: until then dense / conv pay one relaxed load, not a child lookup.
std::atomic<bool> g_any_adapter{false};

void check_options(const LoraOptions& o) {
  DEW_CHECK(o.rank() > 0, "lora.rank must be > 0, got ", o.rank());
  DEW_CHECK(o.alpha() > 0, "lora.alpha must be > 0, got ", o.alpha());
  DEW_CHECK(o.dropout() >= 0 && o.dropout() < 1, "lora.dropout must be in [0, 1), got ", o.dropout());
}

torch::Dtype adapter_dtype(const Tensor& base_weight) {
  const auto dt = base_weight.scalar_type();
  return dt == at::kBFloat16 || dt == at::kHalf ? at::kFloat : dt;
}

// PEFT's init_lora_weights=True: A as nn.Linear's default (Kaiming-uniform, a = sqrt(5), bound
// 1 / sqrt(fan_in)), B zero, so the adapted model starts equal to the base.
void init_adapter(Tensor& a, Tensor& b) {
  torch::NoGradGuard no_grad;
  torch::nn::init::kaiming_uniform_(a, std::sqrt(5.0));
  b.zero_();
}

void check_fresh(const torch::nn::Module& layer, const std::string& name) {
  DEW_CHECK(lora_state(layer) == nullptr, "LoRA: ", name, " already holds an adapter");
}

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

// The up to 5 candidate names nearest to `pattern` (by the distance of the pattern to the name's last
// components), for a pattern that matched nothing.
std::string nearest(const std::string& pattern, const std::vector<std::string>& names) {
  std::vector<std::pair<size_t, std::string>> scored;
  for (const auto& n : names) {
    size_t best = edit_distance(pattern, n);
    for (size_t p = n.find('.'); p != std::string::npos; p = n.find('.', p + 1))
      best = std::min(best, edit_distance(pattern, n.substr(p + 1)));
    scored.emplace_back(best, n);
  }
  std::stable_sort(scored.begin(), scored.end(), [](const auto& x, const auto& y) { return x.first < y.first; });
  std::ostringstream s;
  for (size_t i = 0; i < std::min<size_t>(5, scored.size()); ++i) s << (i ? ", " : "") << scored[i].second;
  return s.str();
}

bool is_adapter_part(const std::string& name) {
  const auto ends = [&](const std::string& suffix) {
    return name == suffix || (name.size() > suffix.size() &&
                              name.compare(name.size() - suffix.size() - 1, std::string::npos, "." + suffix) == 0);
  };
  return ends("lora_A") || ends("lora_B") || ends("lora");
}

}  // namespace

double lora_scale(const LoraOptions& o) {
  check_options(o);
  return o.use_rslora() ? o.alpha() / std::sqrt(static_cast<double>(o.rank()))
                        : o.alpha() / static_cast<double>(o.rank());
}

namespace {

// A target regex, matched in polynomial time: libstdc++'s default executor backtracks, so an adapter_config.json
// with target_modules "(.|.)*X" took minutes per module name (Python's re, PEFT's, backtracks too). Its
// __polynomial mode matches breadth-first (the same matches: only whether the whole name matches is asked) and
// refuses back-references when compiling.
std::regex compile_target_regex(const std::string& pattern) {
#if defined(__GLIBCXX__)
  return std::regex(pattern, std::regex::ECMAScript | std::regex_constants::__polynomial);
#else
  return std::regex(pattern);
#endif
}

}  // namespace

bool lora_target_matches(const LoraOptions& o, const std::string& name) {
  if (!o.target_regex().empty()) return std::regex_match(name, compile_target_regex(o.target_regex()));
  for (const auto& t : o.target_modules()) {
    if (name == t) return true;
    if (name.size() > t.size() && name[name.size() - t.size() - 1] == '.' &&
        name.compare(name.size() - t.size(), std::string::npos, t) == 0)
      return true;
  }
  return false;
}

namespace {

// What both layer kinds share once their adapter pair is built: the base weight's device and the adapter
// dtype, PEFT's initialisation, and the children lora_A, lora_B and lora on the layer.
template <typename Base, typename Adapter>
std::shared_ptr<LoraStateImpl> register_adapter(Base& layer, Adapter& a, Adapter& b, const LoraOptions& o,
                                                double scale) {
  const auto& w = layer.weight;
  a->to(w.device(), adapter_dtype(w));
  b->to(w.device(), adapter_dtype(w));
  init_adapter(a->weight, b->weight);
  layer.register_module("lora_A", a);
  layer.register_module("lora_B", b);
  g_any_adapter.store(true, std::memory_order_relaxed);
  return layer.register_module("lora", LoraState(o.rank(), o.alpha(), scale, o.dropout()));
}

}  // namespace

namespace {

// What attach_lora refuses for a layer, checked without changing anything: bad options, a layer that already
// holds an adapter, a rank above min(in, out) (fan-in for Conv2d), a grouped, dilated or non-zero-padded Conv2d.
void check_attachable(const torch::nn::LinearImpl& layer, const LoraOptions& o, const std::string& name) {
  check_options(o);
  check_fresh(layer, name);
  const int64_t in = layer.options.in_features(), out = layer.options.out_features();
  DEW_CHECK(o.rank() <= std::min(in, out), "lora.rank ", o.rank(), " is larger than ", name, " (Linear ", in, " -> ",
            out, "): the rank must be <= ", std::min(in, out));
}

void check_attachable(const torch::nn::Conv2dImpl& layer, const LoraOptions& o, const std::string& name) {
  check_options(o);
  check_fresh(layer, name);
  const auto& co = layer.options;
  DEW_CHECK(co.groups() == 1, "LoRA: ", name, " is a Conv2d with groups=", co.groups(),
            "; only groups=1 convolutions take adapters");
  DEW_CHECK((*co.dilation())[0] == 1 && (*co.dilation())[1] == 1, "LoRA: ", name,
            " is a dilated Conv2d; only dilation 1 takes adapters (PEFT's lora_A has none)");
  DEW_CHECK(torch::enumtype::get_enum_name(co.padding_mode()) == "kZeros", "LoRA: ", name,
            " pads other than with zeros; only zero padding takes adapters");
  const int64_t in = co.in_channels(), out = co.out_channels();
  const int64_t fan_in = in * (*co.kernel_size())[0] * (*co.kernel_size())[1];
  DEW_CHECK(o.rank() <= std::min(fan_in, out), "lora.rank ", o.rank(), " is larger than ", name, " (Conv2d ", in,
            " -> ", out, ", fan-in ", fan_in, "): the rank must be <= ", std::min(fan_in, out));
}

// The same for a module that must be a Linear or a Conv2d.
void check_attachable(const torch::nn::Module& layer, const LoraOptions& o, const std::string& name) {
  if (const auto* lin = dynamic_cast<const torch::nn::LinearImpl*>(&layer)) return check_attachable(*lin, o, name);
  const auto* cv = dynamic_cast<const torch::nn::Conv2dImpl*>(&layer);
  DEW_CHECK(cv != nullptr, "LoRA: ", name, " is a ", layer.name(), ", not a Linear or Conv2d");
  check_attachable(*cv, o, name);
}

// The shapes of the adapter pair attach_lora gives the Linear or Conv2d `layer` at `rank`: A [r, in] and B [out, r],
// or A [r, in, kh, kw] and B [out, r, 1, 1].
std::pair<std::vector<int64_t>, std::vector<int64_t>> adapter_shapes(const torch::nn::Module& layer, int64_t rank) {
  if (const auto* lin = dynamic_cast<const torch::nn::LinearImpl*>(&layer))
    return {{rank, lin->options.in_features()}, {lin->options.out_features(), rank}};
  const auto& co = dynamic_cast<const torch::nn::Conv2dImpl&>(layer).options;
  return {{rank, co.in_channels(), (*co.kernel_size())[0], (*co.kernel_size())[1]}, {co.out_channels(), rank, 1, 1}};
}

}  // namespace

void attach_lora(torch::nn::Linear& layer, const LoraOptions& o, const std::string& name) {
  const double scale = lora_scale(o);
  check_attachable(*layer, o, name);
  const int64_t in = layer->options.in_features(), out = layer->options.out_features();
  torch::nn::Linear a(torch::nn::LinearOptions(in, o.rank()).bias(false));
  torch::nn::Linear b(torch::nn::LinearOptions(o.rank(), out).bias(false));
  auto state = register_adapter(*layer, a, b, o, scale);
  state->linear_A = a;
  state->linear_B = b;
}

void attach_lora(torch::nn::Conv2d& layer, const LoraOptions& o, const std::string& name) {
  const double scale = lora_scale(o);
  check_attachable(*layer, o, name);
  const auto& co = layer->options;
  torch::nn::Conv2d a(torch::nn::Conv2dOptions(co.in_channels(), o.rank(), co.kernel_size())
                          .stride(co.stride())
                          .padding(co.padding())
                          .bias(false));
  torch::nn::Conv2d b(torch::nn::Conv2dOptions(o.rank(), co.out_channels(), 1).bias(false));
  auto state = register_adapter(*layer, a, b, o, scale);
  state->conv_A = a;
  state->conv_B = b;
}

LoraStateImpl* lora_state(const torch::nn::Module& layer) {
  if (!g_any_adapter.load(std::memory_order_relaxed)) return nullptr;
  const auto children = layer.named_children();
  const auto* found = children.find("lora");
  return found ? dynamic_cast<LoraStateImpl*>(found->get()) : nullptr;
}

namespace {

LoraStateImpl* active_state(const torch::nn::Module& layer) {
  LoraStateImpl* s = lora_state(layer);
  return s && s->enabled && !s->merged ? s : nullptr;
}

Tensor adapter_input(const Tensor& x, const LoraStateImpl& s, bool training) {
  return s.dropout > 0 && training ? at::dropout(x, s.dropout, true) : x;
}

Tensor cast(const Tensor& w, at::ScalarType dt) { return w.scalar_type() == dt ? w : w.to(dt); }

}  // namespace

Tensor lora_delta(const Tensor& x, const torch::nn::LinearImpl& layer) {
  LoraStateImpl* s = active_state(layer);
  if (!s) return {};
  const auto dt = x.scalar_type();
  const Tensor h = at::linear(adapter_input(x, *s, layer.is_training()), cast(s->linear_A->weight, dt));
  return at::linear(h, cast(s->linear_B->weight, dt)) * s->scale;
}

Tensor lora_delta(const Tensor& x, const torch::nn::Conv2dImpl& layer) {
  LoraStateImpl* s = active_state(layer);
  if (!s) return {};
  namespace F = torch::nn::functional;
  const auto dt = x.scalar_type();
  const auto& co = layer.options;
  const Tensor h = F::conv2d(adapter_input(x, *s, layer.is_training()), cast(s->conv_A->weight, dt),
                             F::Conv2dFuncOptions().stride(co.stride()).padding(co.padding()));
  return F::conv2d(h, cast(s->conv_B->weight, dt)) * s->scale;
}

Tensor lora_delta_weight(const torch::nn::Module& layer) {
  const LoraStateImpl* s = lora_state(layer);
  DEW_CHECK(s != nullptr, "LoRA: lora_delta_weight of a layer without an adapter");
  const Tensor& a = s->linear_A ? s->linear_A->weight : s->conv_A->weight;
  const Tensor& b = s->linear_B ? s->linear_B->weight : s->conv_B->weight;
  return lora_delta_weight(a, b, s->scale);
}

Tensor lora_delta_weight(const Tensor& a, const Tensor& b, double scale) {
  DEW_CHECK((a.dim() == 2 && b.dim() == 2) || (a.dim() == 4 && b.dim() == 4 && b.size(2) == 1 && b.size(3) == 1),
            "LoRA: an adapter pair is A [r, in] with B [out, r] (Linear) or A [r, in, kh, kw] with B [out, r, 1, 1] "
            "(Conv2d); got A ",
            a.sizes(), " and B ", b.sizes());
  DEW_CHECK(b.size(1) == a.size(0), "LoRA: A ", a.sizes(), " and B ", b.sizes(), " disagree on the rank");
  // At least float32 (float64 adapters stay float64, so a float64 merge is exact to float64 rounding).
  const auto dt = at::promote_types(a.scalar_type(), at::kFloat);
  if (a.dim() == 2) return b.to(dt).matmul(a.to(dt)) * scale;
  // Conv2d: B is 1x1, so delta[o, i, kh, kw] = sum_r B[o, r] A[r, i, kh, kw] (PEFT's conv of A^T by B).
  return at::einsum("or,rikl->oikl", {b.to(dt).flatten(1), a.to(dt)}) * scale;
}

namespace {

// Each adapted layer of the model with its base weight.
template <class F>
void for_each_adapted(torch::nn::Module& model, F&& f) {
  for (const auto& item : model.named_modules("", /*include_self=*/true)) {
    torch::nn::Module& m = *item.value();
    LoraStateImpl* s = lora_state(m);
    if (!s) continue;
    Tensor w;
    if (auto* lin = dynamic_cast<torch::nn::LinearImpl*>(&m)) w = lin->weight;
    else if (auto* cv = dynamic_cast<torch::nn::Conv2dImpl*>(&m)) w = cv->weight;
    else fail("LoRA: ", item.key(), " holds an adapter but is neither Linear nor Conv2d");
    f(m, *s, w);
  }
}

}  // namespace

void merge_lora(torch::nn::Module& model) {
  torch::NoGradGuard no_grad;
  for_each_adapted(model, [](torch::nn::Module& m, LoraStateImpl& s, Tensor& w) {
    if (s.merged) return;
    w.add_(lora_delta_weight(m).to(w.scalar_type()));
    s.merged = true;
  });
}

void unmerge_lora(torch::nn::Module& model) {
  torch::NoGradGuard no_grad;
  for_each_adapted(model, [](torch::nn::Module& m, LoraStateImpl& s, Tensor& w) {
    if (!s.merged) return;
    w.sub_(lora_delta_weight(m).to(w.scalar_type()));
    s.merged = false;
  });
}

void fold_lora(torch::nn::Module& model) {
  merge_lora(model);
  std::vector<torch::nn::Module*> adapted;
  for_each_adapted(model, [&](torch::nn::Module& m, LoraStateImpl&, Tensor&) { adapted.push_back(&m); });
  for (auto* m : adapted)
    for (const char* child : {"lora_A", "lora_B", "lora"}) m->unregister_module(child);
}

namespace {

// PEFT's _mark_only_adapters_as_trainable (bias="none"): every parameter but the adapters' is frozen.
void freeze_base(torch::nn::Module& model, LoraReport& report) {
  report.trainable = report.frozen = 0;
  for (auto& p : model.named_parameters(/*recurse=*/true)) {
    const std::string& n = p.key();
    const bool adapter = n.find("lora_A.") != std::string::npos || n.find("lora_B.") != std::string::npos;
    if (adapter) {
      report.trainable += p.value().numel();
    } else {
      p.value().requires_grad_(false);
      report.frozen += p.value().numel();
    }
  }
}

}  // namespace

namespace {

// The Linear / Conv2d modules apply_lora adapts with `o`, in module order, after every check it makes (the
// targets, their kinds and ranks, their being free of adapters): nothing of the model is changed.
std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> lora_targets(torch::nn::Module& model,
                                                                                     const LoraOptions& o) {
  check_options(o);
  DEW_CHECK(!o.target_modules().empty() || !o.target_regex().empty(),
            "LoRA: give lora.target_modules (module names) or lora.target_regex; both are empty");
  std::regex regex;  // compiled once (lora_target_matches compiles it per name)
  if (!o.target_regex().empty()) {
    try {
      regex = compile_target_regex(o.target_regex());
    } catch (const std::regex_error& e) {
      fail("lora.target_regex \"", o.target_regex(), "\" is not a valid regular expression: ", e.what());
    }
  }
  const auto matches = [&](const std::string& name) {
    return o.target_regex().empty() ? lora_target_matches(o, name) : std::regex_match(name, regex);
  };
  // Collect first: attaching adds Linear children (lora_A / lora_B) that must not be visited.
  std::vector<std::string> candidates;  // Linear / Conv2d names, for messages
  std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> chosen;
  std::set<std::string> matched_entries;
  for (const auto& item : model.named_modules("", /*include_self=*/false)) {
    const std::string& name = item.key();
    if (is_adapter_part(name)) continue;
    const bool adaptable = dynamic_cast<torch::nn::LinearImpl*>(item.value().get()) ||
                           dynamic_cast<torch::nn::Conv2dImpl*>(item.value().get());
    if (adaptable) candidates.push_back(name);
    if (!matches(name)) continue;
    DEW_CHECK(adaptable, "LoRA: target ", name, " is a ", item.value()->name(),
              "; only Linear and Conv2d layers take adapters (name the layers inside it)");
    chosen.emplace_back(name, item.value());
    for (const auto& t : o.target_modules()) {
      LoraOptions one;
      one.target_modules({t});
      if (lora_target_matches(one, name)) matched_entries.insert(t);
    }
  }
  if (!o.target_regex().empty()) {
    DEW_CHECK(!chosen.empty(), "LoRA: lora.target_regex \"", o.target_regex(),
              "\" matches no Linear or Conv2d module name; nearest names: ", nearest(o.target_regex(), candidates));
  } else {
    for (const auto& t : o.target_modules())
      DEW_CHECK(matched_entries.count(t), "LoRA: target module \"", t,
                "\" matches no Linear or Conv2d module name; nearest names: ", nearest(t, candidates));
  }
  // Check every rank (and then what else attach_lora refuses) before attaching anything, so a refusal leaves the
  // model untouched.
  for (const auto& [name, m] : chosen) {
    int64_t in = 0, out = 0;
    if (auto* lin = dynamic_cast<torch::nn::LinearImpl*>(m.get())) {
      in = lin->options.in_features();
      out = lin->options.out_features();
    } else {
      const auto& co = dynamic_cast<torch::nn::Conv2dImpl*>(m.get())->options;
      in = co.in_channels() * (*co.kernel_size())[0] * (*co.kernel_size())[1];
      out = co.out_channels();
    }
    DEW_CHECK(o.rank() <= std::min(in, out), "lora.rank ", o.rank(), " is larger than ", name, " (", in, " -> ", out,
              "): the rank must be <= ", std::min(in, out));
  }
  for (const auto& [name, m] : chosen) check_attachable(*m, o, name);
  return chosen;
}

}  // namespace

LoraReport apply_lora(torch::nn::Module& model, const LoraOptions& o) {
  auto chosen = lora_targets(model, o);
  LoraReport report;
  for (auto& [name, m] : chosen) {
    if (auto lin = std::dynamic_pointer_cast<torch::nn::LinearImpl>(m)) {
      torch::nn::Linear holder(lin);
      attach_lora(holder, o, name);
    } else {
      torch::nn::Conv2d holder(std::dynamic_pointer_cast<torch::nn::Conv2dImpl>(m));
      attach_lora(holder, o, name);
    }
    report.targets.push_back(name);
  }
  freeze_base(model, report);
  return report;
}

std::vector<std::pair<std::string, Tensor>> lora_parameters(const torch::nn::Module& model) {
  std::vector<std::pair<std::string, Tensor>> out;
  for (const auto& p : model.named_parameters(/*recurse=*/true)) {
    const std::string& n = p.key();
    const auto ends = [&](const char* s) {
      const std::string suffix(s);
      return n.size() >= suffix.size() && n.compare(n.size() - suffix.size(), std::string::npos, suffix) == 0;
    };
    if (ends("lora_A.weight") || ends("lora_B.weight")) out.emplace_back(n, p.value());
  }
  return out;
}

// ---- files users exchange ----

namespace {

const char* kPeftPrefix = "base_model.model.";
const char* kDiffusersMetadataKey = "lora_adapter_metadata";  // diffusers' LORA_ADAPTER_METADATA_KEY

std::string shape_str(at::IntArrayRef s) {
  std::ostringstream o;
  o << s;
  return o.str();
}

// The adapter tensors of `model` by parameter name ("<module>.lora_A.weight").
std::map<std::string, Tensor> adapter_tensors(const torch::nn::Module& model) {
  std::map<std::string, Tensor> out;
  for (const auto& [name, t] : lora_parameters(model)) out[name] = t.detach();
  DEW_CHECK(!out.empty(), "LoRA: the model holds no adapters to save");
  return out;
}

// `adapters` under "<prefix><name>", each checked to be an adapter tensor.
std::map<std::string, Tensor> prefixed(const std::map<std::string, Tensor>& adapters, const std::string& prefix) {
  DEW_CHECK(!adapters.empty(), "LoRA: no adapter tensors to save");
  std::map<std::string, Tensor> out;
  for (const auto& [key, t] : adapters) {
    const std::string& name = key;  // (a structured binding cannot be captured before C++20: clang refuses it)
    const auto ends = [&](const std::string& suffix) {
      return name.size() > suffix.size() && name.compare(name.size() - suffix.size(), std::string::npos, suffix) == 0;
    };
    DEW_CHECK(ends(".lora_A.weight") || ends(".lora_B.weight"), "LoRA: ", name,
              " is not an adapter tensor (<module>.lora_A.weight or <module>.lora_B.weight)");
    out[prefix + name] = t.detach();
  }
  return out;
}

// The adapted module names of adapter tensors, from their lora_A keys.
std::vector<std::string> adapted_modules(const std::map<std::string, Tensor>& adapters) {
  const std::string suffix = ".lora_A.weight";
  std::vector<std::string> out;
  for (const auto& kv : adapters)
    if (kv.first.size() > suffix.size() &&
        kv.first.compare(kv.first.size() - suffix.size(), std::string::npos, suffix) == 0)
      out.push_back(kv.first.substr(0, kv.first.size() - suffix.size()));
  return out;
}

// A file tensor `key` for the adapter parameter `param_name` must have the parameter's shape `want`.
void check_adapter_shape(at::IntArrayRef shape, at::IntArrayRef want, const std::string& key,
                         const std::string& param_name, const std::string& file) {
  DEW_CHECK(shape == want, "LoRA: ", file, " key ", key, " has shape ", shape_str(shape), " but the model's ",
            param_name, " is ", shape_str(want), " (an adapter made for another base?)");
}

// Copies `t` into the adapter parameter `param_name` of `model` ("<module>.lora_A.weight"), checking shape.
void load_adapter_tensor(torch::nn::Module& model, const std::string& param_name, const Tensor& t,
                         const std::string& key, const std::string& file) {
  auto params = model.named_parameters(/*recurse=*/true);
  Tensor* p = params.find(param_name);
  DEW_CHECK(p != nullptr, "LoRA: ", file, " holds ", key, " but the model has no adapter parameter ", param_name);
  check_adapter_shape(t.sizes(), p->sizes(), key, param_name, file);
  torch::NoGradGuard no_grad;
  p->copy_(t);
}

json lora_config_json(const LoraOptions& o, const std::map<std::string, Tensor>& adapters) {
  json j;
  j["r"] = o.rank();
  j["lora_alpha"] = o.alpha();
  j["lora_dropout"] = o.dropout();
  j["use_rslora"] = o.use_rslora();
  if (!o.target_regex().empty()) j["target_modules"] = o.target_regex();
  else if (!o.target_modules().empty()) j["target_modules"] = o.target_modules();
  else j["target_modules"] = adapted_modules(adapters);
  return j;
}

}  // namespace

PeftAdapterConfig read_peft_adapter_config(const std::string& dir) {
  const std::string path = dir + "/adapter_config.json";
  io::check_folder_links(dir, "PEFT adapter folder");
  const json j = io::parse_json(io::read_file(path, "PEFT adapter config"), "LoRA: " + path);
  DEW_CHECK(j.is_object(), "LoRA: ", path, " is not a JSON object");
  const auto is_set = [&](const char* k) {
    if (!j.contains(k) || j[k].is_null()) return false;
    const json& v = j[k];
    if (v.is_boolean()) return v.get<bool>();
    if (v.is_object() || v.is_array() || v.is_string()) return !v.empty() && v != json("");
    return true;
  };
  if (j.contains("peft_type"))
    DEW_CHECK(j["peft_type"] == "LORA", "LoRA: ", path, " has peft_type ", j["peft_type"].dump(),
              "; only LORA adapters are read");
  for (const char* k : {"use_dora", "lora_bias", "fan_in_fan_out", "rank_pattern", "alpha_pattern",
                        "layers_to_transform", "exclude_modules", "modules_to_save", "target_parameters"})
    DEW_CHECK(!is_set(k), "LoRA: ", path, " sets ", k, " = ", j[k].dump(), ", which dew's LoRA does not implement");
  PeftAdapterConfig c;
  try {
    int64_t r = 0;
    options_detail::from_value(j.at("r"), r, "LoRA: " + path + " field r");  // an integer, never cast unchecked
    c.lora.rank(r);
    c.lora.alpha(j.value("lora_alpha", static_cast<double>(c.lora.rank())));
    c.lora.dropout(j.value("lora_dropout", 0.0));
    c.lora.use_rslora(j.value("use_rslora", false));
    const json& t = j.at("target_modules");
    if (t.is_string()) c.lora.target_regex(t.get<std::string>());
    else c.lora.target_modules(t.get<std::vector<std::string>>());
    if (j.contains("base_model_name_or_path") && j["base_model_name_or_path"].is_string())
      c.base_model_name_or_path = j["base_model_name_or_path"].get<std::string>();
  } catch (const json::exception& e) {
    fail("LoRA: ", path, ": r (int), lora_alpha (number) and target_modules (list or string) are needed: ", e.what());
  }
  return c;
}

void save_peft_adapter(const std::string& dir, const torch::nn::Module& model, const LoraOptions& o,
                       const std::string& base_model_name_or_path) {
  save_peft_adapter(dir, adapter_tensors(model), o, base_model_name_or_path);
}

void save_peft_adapter(const std::string& dir, const std::map<std::string, Tensor>& adapters, const LoraOptions& o,
                       const std::string& base_model_name_or_path) {
  const auto tensors = prefixed(adapters, kPeftPrefix);
  json j = lora_config_json(o, adapters);
  j["peft_type"] = "LORA";
  j["base_model_name_or_path"] = base_model_name_or_path.empty() ? json(nullptr) : json(base_model_name_or_path);
  j["bias"] = "none";
  j["fan_in_fan_out"] = false;
  j["init_lora_weights"] = true;
  j["inference_mode"] = true;
  j["task_type"] = nullptr;
  std::filesystem::create_directories(dir);
  io::save_safetensors(dir + "/adapter_model.safetensors", tensors, {{"format", "pt"}});
  io::write_file_atomic(dir + "/adapter_config.json", j.dump(2) + "\n");
}

PeftAdapterConfig load_peft_adapter(torch::nn::Module& model, const std::string& dir) {
  PeftAdapterConfig c = read_peft_adapter_config(dir);
  const std::string file = dir + "/adapter_model.safetensors";
  const auto tensors = io::load_safetensors(file);
  const std::string prefix = kPeftPrefix;
  // Check every target, key and shape before touching the model, so a refused folder leaves it as it was: the
  // adapter parameters apply_lora will make, by name, with their shapes.
  std::map<std::string, std::vector<int64_t>> wanted;
  for (const auto& [name, m] : lora_targets(model, c.lora)) {
    auto [a, b] = adapter_shapes(*m, c.lora.rank());
    wanted[name + ".lora_A.weight"] = std::move(a);
    wanted[name + ".lora_B.weight"] = std::move(b);
  }
  std::set<std::string> in_file;
  for (const auto& [key, t] : tensors) {
    DEW_CHECK(key.rfind(prefix, 0) == 0, "LoRA: ", file, " key ", key, " does not start with ", prefix);
    const std::string name = key.substr(prefix.size());
    const auto w = wanted.find(name);
    DEW_CHECK(w != wanted.end(), "LoRA: ", file, " holds ", key, " but the model has no adapter parameter ", name,
              " (the config's target_modules adapt ", wanted.size() / 2, " modules)");
    check_adapter_shape(t.sizes(), w->second, key, name, file);
    in_file.insert(name);
  }
  for (const auto& kv : wanted)
    DEW_CHECK(in_file.count(kv.first), "LoRA: ", file, " has no ", prefix + kv.first, " for the adapted module (",
              in_file.size(), " adapter tensors in the file)");
  apply_lora(model, c.lora);
  for (const auto& [key, t] : tensors) load_adapter_tensor(model, key.substr(prefix.size()), t, key, file);
  return c;
}

void save_diffusers_lora(const std::string& path, const torch::nn::Module& model, const LoraOptions& o,
                         const std::string& prefix) {
  save_diffusers_lora(path, adapter_tensors(model), o, prefix);
}

void save_diffusers_lora(const std::string& path, const std::map<std::string, Tensor>& adapters, const LoraOptions& o,
                         const std::string& prefix) {
  const auto tensors = prefixed(adapters, prefix + ".");
  // The pipeline-level file prefixes each LoraConfig field with the component ("unet.r"), as
  // save_lora_weights packs it and load_lora_adapter strips it.
  const json config = lora_config_json(o, adapters);  // named: items() does not keep a temporary alive
  json meta = json::object();
  for (const auto& [k, v] : config.items()) meta[prefix + "." + k] = v;
  io::save_safetensors(path, tensors, {{"format", "pt"}, {kDiffusersMetadataKey, meta.dump(2)}});
}

namespace {

// The keys of one module's adapter in a file.
struct FileEntry {
  std::string a, b, alpha;  // alpha: "" when the file has none for it
  // The rows of B this module takes, as (first row, count) pieces concatenated in order; empty: all of B. A
  // fused original module (FLUX's qkv) is one adapter whose B stacks its parts' rows: each part gets A and
  // its rows of B, which is the same update.
  std::vector<std::pair<int64_t, int64_t>> b_rows;
};

// Attaches and loads the adapters `entries` (module name -> keys) of `file`: alpha from `meta_alpha` when
// > 0, else the entry's alpha tensor, else the rank. Everything is checked before anything is attached, so a
// refused file leaves the model as it was: names and kinds, every tensor (read here; a BOOL tensor's bytes are
// checked on reading), ranks, alphas, what attach_lora refuses and the shapes. `key_prefix` is shown in messages.
LoraReport attach_from_file(torch::nn::Module& model, const io::SafetensorsFile& file,
                            const std::map<std::string, FileEntry>& entries, double meta_alpha, bool rslora,
                            const std::string& key_prefix) {
  const std::string& path = file.path();
  const std::string& pre = key_prefix;
  const auto modules = model.named_modules("", /*include_self=*/false);
  for (const auto& [name, e] : entries) {
    DEW_CHECK(!e.a.empty() && !e.b.empty(), "LoRA: ", path, " holds only one of A and B for ", pre + name);
    const auto* m = modules.find(name);
    DEW_CHECK(m != nullptr, "LoRA: ", path, " names module ", name, ", which the model does not have");
    DEW_CHECK(dynamic_cast<torch::nn::LinearImpl*>(m->get()) || dynamic_cast<torch::nn::Conv2dImpl*>(m->get()),
              "LoRA: ", path, " names module ", name, ", a ", (*m)->name(), ", not a Linear or Conv2d");
  }
  struct Adapter {
    std::string name;
    std::shared_ptr<torch::nn::Module> layer;
    LoraOptions o;
    Tensor a, b;  // views of the file's mapping where it allows (B: the entry's rows)
    const FileEntry* keys;
  };
  std::vector<Adapter> adapters;
  for (const auto& [name, e] : entries) {
    const std::shared_ptr<torch::nn::Module> m = *modules.find(name);
    const bool is_conv = dynamic_cast<torch::nn::Conv2dImpl*>(m.get()) != nullptr;
    const Tensor a = file.tensor(e.a, /*copy=*/false);
    Tensor b = file.tensor(e.b, /*copy=*/false);
    if (!e.b_rows.empty()) {
      std::vector<Tensor> pieces;
      for (const auto& [first, count] : e.b_rows) {
        DEW_CHECK(b.dim() == 2 && first + count <= b.size(0), "LoRA: ", path, " key ", e.b, " has shape ", b.sizes(),
                  "; its rows ", first, "..", first + count, " belong to ", name,
                  " (the modules it stands for have more rows: a file for another model size?)");
        pieces.push_back(b.narrow(0, first, count));
      }
      b = at::cat(pieces);
    }
    DEW_CHECK(a.dim() == (is_conv ? 4 : 2) && a.size(0) > 0, "LoRA: ", path, " key ", e.a, " has shape ",
              shape_str(a.sizes()), "; ", name, " is a ",
              is_conv ? "Conv2d, whose A is [r, in, kh, kw]" : "Linear, whose A is [r, in]", " with r >= 1");
    LoraOptions o;
    o.rank(a.size(0));
    o.use_rslora(rslora);
    double alpha = static_cast<double>(o.rank());
    std::string from = "the rank";
    if (meta_alpha > 0) {
      alpha = meta_alpha;
      from = std::string("the metadata ") + kDiffusersMetadataKey;
    } else if (!e.alpha.empty()) {
      const Tensor t = file.tensor(e.alpha);
      DEW_CHECK(t.numel() == 1, "LoRA: ", path, " key ", e.alpha, " has shape ", shape_str(t.sizes()),
                "; an alpha is one number");
      alpha = t.item<double>();
      from = "key " + e.alpha;
    }
    DEW_CHECK(alpha > 0, "LoRA: ", path, " gives ", name, " alpha ", alpha, " (", from, "); alpha must be > 0");
    o.alpha(alpha);
    try {
      check_attachable(*m, o, name);
    } catch (const Error& err) {
      fail("LoRA: ", path, " (", pre + name, "): ", err.what());
    }
    const auto shapes = adapter_shapes(*m, o.rank());
    check_adapter_shape(a.sizes(), shapes.first, e.a, name + ".lora_A.weight", path);
    check_adapter_shape(b.sizes(), shapes.second, e.b, name + ".lora_B.weight", path);
    adapters.push_back({name, m, o, a, b, &e});
  }
  for (const Adapter& ad : adapters) {
    if (auto lin = std::dynamic_pointer_cast<torch::nn::LinearImpl>(ad.layer)) {
      torch::nn::Linear holder(lin);
      attach_lora(holder, ad.o, ad.name);
    } else {
      torch::nn::Conv2d holder(std::dynamic_pointer_cast<torch::nn::Conv2dImpl>(ad.layer));
      attach_lora(holder, ad.o, ad.name);
    }
    load_adapter_tensor(model, ad.name + ".lora_A.weight", ad.a, ad.keys->a, path);
    load_adapter_tensor(model, ad.name + ".lora_B.weight", ad.b, ad.keys->b, path);
  }
  LoraReport report;
  for (const auto& [name, e] : entries) report.targets.push_back(name);
  freeze_base(model, report);
  return report;
}

}  // namespace

namespace {

// transformers 5's CLIPTextModel has no text_model wrapper; transformers 4's (and dew's ClipText) has one. A text
// encoder's adapter file names its modules either way (diffusers' loader strips the wrapper likewise): a name
// the model lacks is looked for under it.
constexpr const char* kTextModel = "text_model.";

}  // namespace

LoraReport load_diffusers_lora(torch::nn::Module& model, const std::string& path, const std::string& prefix) {
  const auto file = io::SafetensorsFile::open(path);
  const std::string pre = prefix + ".";
  std::map<std::string, FileEntry> entries;
  const auto ends = [](const std::string& k, const std::string& suffix) {
    return k.size() > suffix.size() && k.compare(k.size() - suffix.size(), std::string::npos, suffix) == 0;
  };
  for (const auto& key : file.names()) {
    if (key.rfind(pre, 0) != 0) continue;
    const std::string rest = key.substr(pre.size());
    bool matched = false;
    for (const auto& [suffix, slot] : std::vector<std::pair<std::string, int>>{{".lora_A.weight", 0},
                                                                               {".lora.down.weight", 0},
                                                                               {".lora_B.weight", 1},
                                                                               {".lora.up.weight", 1},
                                                                               {".alpha", 2}}) {
      if (!ends(rest, suffix)) continue;
      FileEntry& e = entries[rest.substr(0, rest.size() - suffix.size())];
      (slot == 0 ? e.a : slot == 1 ? e.b : e.alpha) = key;
      matched = true;
      break;
    }
    DEW_CHECK(matched, "LoRA: ", path, " key ", key,
              " is not an adapter tensor (.lora_A.weight, .lora_B.weight, .lora.down.weight, .lora.up.weight, .alpha)");
  }
  DEW_CHECK(!entries.empty(), "LoRA: ", path, " holds no key starting with ", pre, " (the prefix of the component)");
  if (model.named_children().contains("text_model")) {
    const auto modules = model.named_modules("", /*include_self=*/false);
    std::map<std::string, FileEntry> wrapped;
    for (auto& [name, e] : entries)
      wrapped[!modules.contains(name) && modules.contains(kTextModel + name) ? kTextModel + name : name] = e;
    entries = std::move(wrapped);
  }
  double meta_alpha = -1;
  bool rslora = false;
  const auto meta = file.metadata();
  if (auto it = meta.find(kDiffusersMetadataKey); it != meta.end()) {
    io::check_json_depth(it->second, path + " (metadata " + kDiffusersMetadataKey + ")");
    try {
      const json j = json::parse(it->second);
      meta_alpha = j.value(pre + "lora_alpha", -1.0);
      rslora = j.value(pre + "use_rslora", false);
    } catch (const json::exception& e) {
      fail("LoRA: ", path, " metadata ", kDiffusersMetadataKey, " is not valid JSON: ", e.what());
    }
  }
  return attach_from_file(model, file, entries, meta_alpha, rslora, pre);
}
void save_kohya_lora(const std::string& path, const torch::nn::Module& model, const std::string& prefix) {
  std::map<std::string, Tensor> tensors;
  for (const auto& item : model.named_modules("", /*include_self=*/false)) {
    const LoraStateImpl* s = lora_state(*item.value());
    if (!s) continue;
    std::string flat = prefix + "_" + item.key();
    std::replace(flat.begin(), flat.end(), '.', '_');
    tensors[flat + ".lora_down.weight"] = (s->linear_A ? s->linear_A->weight : s->conv_A->weight).detach();
    tensors[flat + ".lora_up.weight"] = (s->linear_B ? s->linear_B->weight : s->conv_B->weight).detach();
    // kohya's scale is alpha / rank: the alpha that gives this adapter's scale (rsLoRA included).
    tensors[flat + ".alpha"] = torch::tensor(static_cast<float>(s->scale * static_cast<double>(s->rank)));
  }
  DEW_CHECK(!tensors.empty(), "LoRA: the model holds no adapters to save");
  io::save_safetensors(path, tensors, {{"format", "pt"}});
}

namespace {

// kohya trains SDXL on its own copy of the original (SGM / LDM) UNet, so its SDXL files name modules as that UNet
// does: input_blocks.I.J, middle_block.I, output_blocks.I.J, and inside a resnet in_layers.2 / out_layers.3 /
// emb_layers.1 / skip_connection. The diffusers name (flattened with '_') of such a flattened name, laid out by
// the model's own blocks: input block I >= 1 is down block (I - 1) / (L + 1), its resnet or attention
// (I - 1) % (L + 1), the last index of a block its downsampler ("op"); output block I is up block I / (L + 1), layer
// I % (L + 1), J = 2 (or 1 in a block without attention) its upsampler; L = resnets per down block. "" when `flat`
// is not of that naming.
std::string diffusers_flat_of_sgm(const std::string& flat, const std::vector<std::string>& modules) {
  static const std::map<std::string, std::string> fixed = {{"input_blocks_0_0", "conv_in"},
                                                           {"out_2", "conv_out"},
                                                           {"time_embed_0", "time_embedding_linear_1"},
                                                           {"time_embed_2", "time_embedding_linear_2"},
                                                           {"label_emb_0_0", "add_embedding_linear_1"},
                                                           {"label_emb_0_2", "add_embedding_linear_2"}};
  if (auto it = fixed.find(flat); it != fixed.end()) return it->second;
  const auto resnet = [](const std::string& rest) {
    for (const auto& [from, to] :
         std::vector<std::pair<std::string, std::string>>{{"in_layers_2", "conv1"},
                                                          {"out_layers_3", "conv2"},
                                                          {"emb_layers_1", "time_emb_proj"},
                                                          {"skip_connection", "conv_shortcut"}})
      if (rest == from) return to;
    return rest;
  };
  const auto has_prefix = [&](const std::string& p) {
    return std::any_of(modules.begin(), modules.end(), [&](const std::string& m) { return m.rfind(p, 0) == 0; });
  };
  int64_t per = 0;  // resnets per down block + 1
  while (has_prefix("down_blocks.0.resnets." + std::to_string(per) + ".")) ++per;
  ++per;
  static const std::regex block(R"((input_blocks|output_blocks)_(\d{1,4})_(\d)_(.+))"),
      middle(R"(middle_block_(\d)_(.+))");
  std::smatch m;
  if (std::regex_match(flat, m, block)) {
    const int64_t i = std::stoll(m[2]), j = std::stoll(m[3]);
    const std::string rest = m[4];
    if (m[1] == "input_blocks") {
      if (i < 1) return "";
      const std::string b = std::to_string((i - 1) / per), k = std::to_string((i - 1) % per);
      if (rest == "op") return "down_blocks_" + b + "_downsamplers_0_conv";
      if (j == 0) return "down_blocks_" + b + "_resnets_" + k + "_" + resnet(rest);
      if (j == 1) return "down_blocks_" + b + "_attentions_" + k + "_" + rest;
      return "";
    }
    const std::string b = std::to_string(i / per), k = std::to_string(i % per);
    const bool attends = has_prefix("up_blocks." + b + ".attentions.");
    if (j == 0) return "up_blocks_" + b + "_resnets_" + k + "_" + resnet(rest);
    if (j == 1 && attends) return "up_blocks_" + b + "_attentions_" + k + "_" + rest;
    if (j == 2 || j == 1) return "up_blocks_" + b + "_upsamplers_0_" + rest;
    return "";
  }
  if (std::regex_match(flat, m, middle)) {
    const std::string rest = m[2];
    if (m[1] == "0") return "mid_block_resnets_0_" + resnet(rest);
    if (m[1] == "1") return "mid_block_attentions_0_" + rest;
    if (m[1] == "2") return "mid_block_resnets_1_" + resnet(rest);
  }
  return "";
}

// FLUX.1's original (Black Forest Labs) module names, which kohya / sd-scripts trains FLUX with: the diffusers
// modules each stands for, with their rows of B. q, k and v are one `qkv` Linear in a double block and, with
// the MLP's input, one `linear1` in a single block; the final layer's modulation holds shift then scale, where
// diffusers' norm_out holds scale then shift. Row counts come from the model's modules, so any FLUX size maps.
// Empty when `flat` is not of that naming or names a module the model lacks.
std::vector<std::pair<std::string, std::vector<std::pair<int64_t, int64_t>>>> flux_targets_of_original(
    const std::string& flat, torch::nn::Module& model) {
  const auto modules = model.named_modules("", /*include_self=*/false);
  const auto rows_of = [&](const std::string& name) -> int64_t {
    const auto* m = modules.find(name);
    const auto* lin = m ? dynamic_cast<torch::nn::LinearImpl*>(m->get()) : nullptr;
    return lin ? lin->options.out_features() : -1;
  };
  std::vector<std::string> parts;
  bool swap_halves = false;
  std::smatch m;
  static const std::regex dbl(R"(double_blocks_(\d{1,4})_(img|txt)_(attn_qkv|attn_proj|mlp_0|mlp_2|mod_lin))"),
      single(R"(single_blocks_(\d{1,4})_(linear1|linear2|modulation_lin))");
  static const std::map<std::string, std::string> fixed = {
      {"img_in", "x_embedder"},
      {"txt_in", "context_embedder"},
      {"time_in_in_layer", "time_text_embed.timestep_embedder.linear_1"},
      {"time_in_out_layer", "time_text_embed.timestep_embedder.linear_2"},
      {"vector_in_in_layer", "time_text_embed.text_embedder.linear_1"},
      {"vector_in_out_layer", "time_text_embed.text_embedder.linear_2"},
      {"guidance_in_in_layer", "time_text_embed.guidance_embedder.linear_1"},
      {"guidance_in_out_layer", "time_text_embed.guidance_embedder.linear_2"},
      {"final_layer_linear", "proj_out"},
      {"final_layer_adaLN_modulation_1", "norm_out.linear"}};
  if (std::regex_match(flat, m, dbl)) {
    const std::string d = "transformer_blocks." + m[1].str() + ".", what = m[3];
    const bool img = m[2] == "img";
    if (what == "attn_qkv")
      for (const char* p : {"q", "k", "v"})
        parts.push_back(d + (img ? std::string("attn.to_") + p : std::string("attn.add_") + p + "_proj"));
    else if (what == "attn_proj") parts = {d + (img ? "attn.to_out.0" : "attn.to_add_out")};
    else if (what == "mlp_0") parts = {d + (img ? "ff" : "ff_context") + ".net.0.proj"};
    else if (what == "mlp_2") parts = {d + (img ? "ff" : "ff_context") + ".net.2"};
    else parts = {d + (img ? "norm1" : "norm1_context") + ".linear"};
  } else if (std::regex_match(flat, m, single)) {
    const std::string d = "single_transformer_blocks." + m[1].str() + ".";
    if (m[2] == "linear1") parts = {d + "attn.to_q", d + "attn.to_k", d + "attn.to_v", d + "proj_mlp"};
    else if (m[2] == "linear2") parts = {d + "proj_out"};
    else parts = {d + "norm.linear"};
  } else if (auto it = fixed.find(flat); it != fixed.end()) {
    parts = {it->second};
    swap_halves = flat == "final_layer_adaLN_modulation_1";
  }
  std::vector<std::pair<std::string, std::vector<std::pair<int64_t, int64_t>>>> out;
  int64_t first = 0;
  for (const auto& p : parts) {
    const int64_t rows = rows_of(p);
    if (rows < 0) return {};
    if (swap_halves) out.push_back({p, {{rows / 2, rows - rows / 2}, {0, rows / 2}}});
    else out.push_back({p, {{first, rows}}});
    first += rows;
  }
  return out;
}

}  // namespace

LoraReport load_kohya_lora(torch::nn::Module& model, const std::string& path, const std::string& prefix) {
  const auto file = io::SafetensorsFile::open(path);
  // kohya flattens module names with '_', which cannot be undone by text: match against the model's
  // Linear / Conv2d names flattened the same way.
  std::map<std::string, std::string> by_flat;
  std::vector<std::string> candidates;
  for (const auto& item : model.named_modules("", /*include_self=*/false)) {
    if (is_adapter_part(item.key())) continue;
    if (!dynamic_cast<torch::nn::LinearImpl*>(item.value().get()) &&
        !dynamic_cast<torch::nn::Conv2dImpl*>(item.value().get()))
      continue;
    std::string flat = prefix + "_" + item.key();
    std::replace(flat.begin(), flat.end(), '.', '_');
    by_flat[flat] = item.key();
    candidates.push_back(flat);
    if (item.key().rfind(kTextModel, 0) == 0) {  // also without the wrapper (transformers 5's names)
      std::string bare = prefix + "_" + item.key().substr(std::string(kTextModel).size());
      std::replace(bare.begin(), bare.end(), '.', '_');
      by_flat.emplace(bare, item.key());
    }
  }
  std::map<std::string, FileEntry> entries;
  std::vector<std::string> modules;  // every module name, for the original UNet's naming (filled when needed)
  std::map<std::string, std::vector<std::pair<std::string, std::vector<std::pair<int64_t, int64_t>>>>> resolved;
  for (const auto& key : file.names()) {
    if (key.rfind(prefix + "_", 0) != 0) continue;  // another component (lora_te_, lora_te1_, ...)
    const size_t dot = key.find('.');
    DEW_CHECK(dot != std::string::npos, "LoRA: ", path, " key ", key, " has no '.' (expected <name>.lora_down.weight)");
    const std::string flat = key.substr(0, dot), suffix = key.substr(dot + 1);
    auto targets = resolved.find(flat);
    if (targets == resolved.end()) {
      // The model's own names flattened; else the original UNet's (kohya's SDXL files); else FLUX's original ones.
      std::vector<std::pair<std::string, std::vector<std::pair<int64_t, int64_t>>>> found;
      auto it = by_flat.find(flat);
      if (it == by_flat.end()) {
        if (modules.empty())
          for (const auto& kv : model.named_modules("", /*include_self=*/false)) modules.push_back(kv.key());
        const std::string mapped = diffusers_flat_of_sgm(flat.substr(prefix.size() + 1), modules);
        if (!mapped.empty()) it = by_flat.find(prefix + "_" + mapped);
      }
      if (it != by_flat.end()) found.push_back({it->second, {}});
      else found = flux_targets_of_original(flat.substr(prefix.size() + 1), model);
      DEW_CHECK(!found.empty(), "LoRA: ", path, " key ", key,
                " names no Linear or Conv2d of the model; nearest: ", nearest(flat, candidates));
      targets = resolved.emplace(flat, std::move(found)).first;
    }
    for (const auto& [module, rows] : targets->second) {
      FileEntry& e = entries[module];
      DEW_CHECK(e.b_rows.empty() || e.b_rows == rows, "LoRA: ", path, " adapts ", module, " twice");
      e.b_rows = rows;
      if (suffix == "lora_down.weight") e.a = key;
      else if (suffix == "lora_up.weight") e.b = key;
      else if (suffix == "alpha") e.alpha = key;
      else fail("LoRA: ", path, " key ", key, " is not a LoRA tensor (lora_down.weight, lora_up.weight, alpha)");
    }
  }
  DEW_CHECK(!entries.empty(), "LoRA: ", path, " holds no key starting with ", prefix, "_");
  // A fused original module's B must hold exactly its parts' rows (a file for another size would otherwise
  // load its first rows).
  for (const auto& [flat, targets] : resolved) {
    if (targets.front().second.empty()) continue;  // a module of its own: its shapes are checked at load
    int64_t rows = 0;
    std::string names;
    for (const auto& [module, pieces] : targets) {
      for (const auto& piece : pieces) rows += piece.second;
      names += (names.empty() ? "" : ", ") + module;
    }
    const FileEntry& e = entries.at(targets.front().first);
    if (e.b.empty()) continue;  // refused by attach_from_file, naming the missing half
    const at::Tensor b = file.tensor(e.b);
    DEW_CHECK(b.dim() == 2 && b.size(0) == rows, "LoRA: ", path, " key ", e.b, " has shape ", b.sizes(),
              "; the modules it stands for (", names, ") have ", rows, " rows in all (a file for another model size?)");
  }
  return attach_from_file(model, file, entries, -1.0, false, prefix + "_");
}

bool lora_file_has(const std::string& path, const std::string& diffusers_prefix, const std::string& kohya_prefix) {
  for (const auto& key : io::SafetensorsFile::open(path).names())
    if (key.rfind(diffusers_prefix + ".", 0) == 0 || key.rfind(kohya_prefix + "_", 0) == 0) return true;
  return false;
}

LoraReport load_lora_file(torch::nn::Module& model, const std::string& path, double scale,
                          const std::string& diffusers_prefix, const std::string& kohya_prefix) {
  DEW_CHECK(std::isfinite(scale), "LoRA: the scale of ", path, " must be a finite number, got ", scale);
  bool kohya = false;
  for (const auto& key : io::SafetensorsFile::open(path).names())
    kohya = kohya || key.rfind(kohya_prefix + "_", 0) == 0;
  LoraReport report =
      kohya ? load_kohya_lora(model, path, kohya_prefix) : load_diffusers_lora(model, path, diffusers_prefix);
  const auto modules = model.named_modules("", /*include_self=*/false);
  for (const auto& name : report.targets) lora_state(**modules.find(name))->scale *= scale;
  return report;
}

}  // namespace dew::nn

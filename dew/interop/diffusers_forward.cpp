#include "dew/interop/diffusers_forward.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <filesystem>

#include "dew/core/error.h"
#include "dew/io/files.h"
#include "dew/nn/backbones/backbone.h"
#include "dew/nn/roles.h"
#include "dew/nn/weights_dtype.h"

namespace fs = std::filesystem;

namespace dew::interop {

using at::Tensor;

namespace {

std::string joined(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : ", ") + x;
  return s.empty() ? "none" : s;
}

std::string class_list() {
  std::vector<std::string> names;
  for (const auto& kv : diffusers_classes()) names.push_back(kv.first);
  return joined(names);
}

json read_config(const std::string& folder) {
  const fs::path path = fs::path(folder) / "config.json";
  DEW_CHECK(fs::is_directory(folder), folder, ": not a folder (expected a diffusers model folder with config.json)");
  io::check_folder_links(folder, "model folder");
  DEW_CHECK(fs::exists(path), path.string(), ": missing (a diffusers model folder has config.json beside its weights)");
  // Nesting bounded before parsing: the config is copied into options and quoted in errors (recursive).
  return io::parse_json(io::read_file(path.string(), "model config"), path.string());
}

const std::string& family_of(const std::string& class_name) {
  const auto it = diffusers_classes().find(class_name);
  DEW_CHECK(it != diffusers_classes().end(), "class \"", class_name, "\" is not supported; accepted: ", class_list());
  return it->second;
}

}  // namespace

std::string reference_class_of(const json& config) {
  if (!config.is_object()) return "";
  if (config.contains("_class_name") && config["_class_name"].is_string())
    return config["_class_name"].get<std::string>();
  // transformers writes the model class as the first (usually only) entry of "architectures".
  if (config.contains("architectures") && config["architectures"].is_array() && !config["architectures"].empty() &&
      config["architectures"][0].is_string())
    return config["architectures"][0].get<std::string>();
  return "";
}

const std::map<std::string, std::string>& diffusers_classes() {
  // Every family of the table that names a diffusers reference class (those with reference methods).
  static const std::map<std::string, std::string> classes = [] {
    std::map<std::string, std::string> m;
    for (const auto& name : models::family_names()) {
      const models::Family& f = models::family(name);
      if (f.reference_methods.empty()) continue;
      for (const auto& cls : f.reference_classes) m[cls] = name;
    }
    return m;
  }();
  return classes;
}

std::shared_ptr<BackboneImpl> DiffusersModel::backbone() const {
  auto b = std::dynamic_pointer_cast<BackboneImpl>(module);
  DEW_CHECK(b, folder, ": ", class_name, " (", family, ") is not a denoiser");
  return b;
}

std::shared_ptr<AutoencoderImpl> DiffusersModel::autoencoder() const {
  auto a = std::dynamic_pointer_cast<AutoencoderImpl>(module);
  DEW_CHECK(a, folder, ": ", class_name, " (", family, ") is not an autoencoder");
  return a;
}

DiffusersModelSpec diffusers_model_spec(const std::string& folder, const std::string& class_name) {
  const json config = read_config(folder);
  DiffusersModelSpec s;
  s.class_name = class_name;
  if (s.class_name.empty()) {
    s.class_name = reference_class_of(config);
    DEW_CHECK(!s.class_name.empty(), folder,
              "/config.json: no \"_class_name\" (diffusers) or \"architectures\" (transformers); pass the class "
              "(accepted: ",
              class_list(), ")");
  }
  DEW_CHECK(diffusers_classes().count(s.class_name), folder, ": class \"", s.class_name,
            "\" is not supported; accepted: ", class_list());
  s.family = family_of(s.class_name);
  s.fields = models::fields_from_reference_config(s.family, config);
  return s;
}

bool is_model_folder(const std::string& path) {
  std::error_code ec;
  return fs::is_directory(path, ec) && fs::is_regular_file(fs::path(path) / "config.json", ec) &&
         !fs::exists(fs::path(path) / "run.json", ec);
}

DiffusersModel load_diffusers_folder(const std::string& folder, const DiffusersLoadOptions& options) {
  DEW_CHECK(options.dtype == at::kFloat || options.dtype == at::kDouble, "diffusers folder ", folder,
            ": dtype must be float32 or float64, got ", c10::toString(options.dtype));
  const DiffusersModelSpec spec = diffusers_model_spec(folder, options.class_name);
  DiffusersModel m;
  m.folder = folder;
  m.dtype = options.dtype;
  m.device = options.device;
  m.class_name = spec.class_name;
  m.family = spec.family;
  m.fields = spec.fields;
  DEW_CHECK(options.weights_dtype == at::kFloat || options.dtype == at::kFloat, "diffusers folder ", folder,
            ": weights held in ", c10::toString(options.weights_dtype), " need the float32 model dtype, got ",
            c10::toString(options.dtype));
  m.module = nn::build_weights_in(options.weights_dtype, [&] { return models::build_module(m.family, m.fields); });
  // Parameters take the model dtype before loading, so a float64 run reads the file's values straight
  // into float64 (an fp64 checkpoint keeps every bit). Weights built in a reduced dtype keep it.
  if (options.weights_dtype == at::kFloat) m.module->to(options.dtype);
  m.report = models::load_reference_weights(*m.module, m.family, m.fields, folder);
  m.module->to(options.device);
  m.module->eval();
  return m;
}

std::vector<DiffusersMethod> diffusers_methods(const std::string& class_name) {
  std::vector<DiffusersMethod> out;
  for (const auto& m : models::family(family_of(class_name)).reference_methods)
    out.push_back({m.name, m.required, m.optional, m.outputs});
  return out;
}

std::map<std::string, Tensor> diffusers_forward(const DiffusersModel& model,
                                                const std::map<std::string, Tensor>& inputs,
                                                const std::string& method_name) {
  const auto& methods = models::family(model.family).reference_methods;
  DEW_CHECK(!methods.empty(), model.class_name, " (", model.family, ") has no reference methods");
  const models::ReferenceMethod* method = method_name.empty() ? &methods.front() : nullptr;
  std::vector<std::string> names;
  for (const auto& m : methods) {
    names.push_back(m.name);
    if (m.name == method_name) method = &m;
  }
  DEW_CHECK(method, model.class_name, ": unknown method \"", method_name, "\"; accepted: ", joined(names));
  const std::string where = model.class_name + "." + method->name;
  // Every missing and every extra input in one message.
  std::vector<std::string> missing, extra;
  for (const auto& r : method->required)
    if (!inputs.count(r)) missing.push_back(r);
  for (const auto& kv : inputs) {
    const bool known = std::count(method->required.begin(), method->required.end(), kv.first) +
                           std::count(method->optional.begin(), method->optional.end(), kv.first) >
                       0;
    if (!known) extra.push_back(kv.first);
  }
  if (!missing.empty() || !extra.empty()) {
    std::string msg = where + ":";
    if (!missing.empty())
      msg += " missing input" + std::string(missing.size() > 1 ? "s " : " ") + joined(missing) + ";";
    if (!extra.empty()) msg += " unexpected input" + std::string(extra.size() > 1 ? "s " : " ") + joined(extra) + ";";
    msg += " it takes " + joined(method->required);
    if (!method->optional.empty()) msg += " (optional: " + joined(method->optional) + ")";
    fail(msg);
  }
  // Floating inputs in the model's dtype on its device; integer and boolean ones (timesteps, labels,
  // masks) keep their kind, which the method reads as it needs.
  std::map<std::string, Tensor> cast;
  for (const auto& [name, t] : inputs)
    cast[name] = at::isFloatingType(t.scalar_type()) ? t.to(model.device, model.dtype) : t.to(model.device);
  at::NoGradGuard no_grad;
  std::map<std::string, Tensor> out = method->run(*model.module, cast, where);
  for (auto& kv : out) kv.second = kv.second.detach().to(at::kCPU).contiguous();
  return out;
}

std::string diffusers_usage() {
  std::string out;
  for (const auto& [cls, family] : diffusers_classes()) {
    out += "  " + cls + " (" + family + ")\n";
    for (const auto& m : diffusers_methods(cls)) {
      std::string in = joined(m.required);
      if (!m.optional.empty()) in += " [, " + joined(m.optional) + "]";
      out += "    " + m.name + ": " + in + " -> " + joined(m.outputs) + "\n";
    }
  }
  return out;
}

}  // namespace dew::interop

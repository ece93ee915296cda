#include "dew/interop/diffusers_forward.h"

#include <ATen/ATen.h>

#include <filesystem>
#include <fstream>
#include <set>

#include "dew/core/error.h"
#include "dew/nn/backbones/autoencoder_kl.h"
#include "dew/nn/backbones/backbone.h"
#include "dew/nn/roles.h"

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
  DEW_CHECK(fs::exists(path), path.string(), ": missing (a diffusers model folder has config.json beside its weights)");
  std::ifstream in(path);
  try {
    return json::parse(in);
  } catch (const json::exception& e) {
    fail(path.string(), ": not valid JSON (", e.what(), ")");
  }
}

}  // namespace

const std::map<std::string, std::string>& diffusers_classes() {
  static const std::map<std::string, std::string> classes = {{"AutoencoderKL", "autoencoder_kl"},
                                                             {"UNet2DConditionModel", "unet_2d_condition"}};
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

DiffusersModel load_diffusers_folder(const std::string& folder, const DiffusersLoadOptions& options) {
  DEW_CHECK(options.dtype == at::kFloat || options.dtype == at::kDouble, "diffusers folder ", folder,
            ": dtype must be float32 or float64, got ", c10::toString(options.dtype));
  const json config = read_config(folder);
  DiffusersModel m;
  m.folder = folder;
  m.dtype = options.dtype;
  m.device = options.device;
  m.class_name = options.class_name;
  if (m.class_name.empty()) {
    DEW_CHECK(config.contains("_class_name") && config["_class_name"].is_string(), folder,
              "/config.json: no \"_class_name\"; pass the class (accepted: ", class_list(), ")");
    m.class_name = config["_class_name"].get<std::string>();
  }
  const auto it = diffusers_classes().find(m.class_name);
  DEW_CHECK(it != diffusers_classes().end(), folder, ": class \"", m.class_name, "\" is not supported; accepted: ",
            class_list());
  m.family = it->second;
  const models::Family& family = models::family(m.family);
  m.fields = models::fields_from_reference_config(m.family, config);
  const json record = {{"architecture", m.family}, {"fields", m.fields}};
  switch (family.role) {
    case models::Role::kDenoiser: m.module = models::build(record); break;
    case models::Role::kAutoencoder: m.module = models::build_autoencoder(record); break;
    default: fail(folder, ": family ", m.family, " cannot be run from a diffusers folder");
  }
  // Parameters take the model dtype before loading, so a float64 run reads the file's values straight
  // into float64 (an fp64 checkpoint keeps every bit).
  m.module->to(options.dtype);
  m.report = models::load_reference_weights(*m.module, m.family, m.fields, folder);
  m.module->to(options.device);
  m.module->eval();
  return m;
}

std::vector<DiffusersMethod> diffusers_methods(const std::string& class_name) {
  if (class_name == "UNet2DConditionModel")
    return {{"forward", {"sample", "timestep", "encoder_hidden_states"},
             {"text_embeds", "time_ids", "class_labels", "encoder_attention_mask"}, {"sample"}}};
  if (class_name == "AutoencoderKL")
    return {{"encode", {"sample"}, {}, {"latent_mean", "latent_logvar"}},
            {"decode", {"z"}, {}, {"sample"}},
            {"forward", {"sample"}, {}, {"sample"}},
            {"tiled_encode", {"sample"}, {}, {"latent_mean", "latent_logvar"}},
            {"tiled_decode", {"z"}, {}, {"sample"}}};
  fail("class \"", class_name, "\" is not supported; accepted: ", class_list());
}

std::map<std::string, Tensor> diffusers_forward(const DiffusersModel& model, const std::map<std::string, Tensor>& inputs,
                                                const std::string& method_name) {
  const auto methods = diffusers_methods(model.class_name);
  const DiffusersMethod* method = method_name.empty() ? &methods.front() : nullptr;
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
                           std::count(method->optional.begin(), method->optional.end(), kv.first) > 0;
    if (!known) extra.push_back(kv.first);
  }
  if (!missing.empty() || !extra.empty()) {
    std::string msg = where + ":";
    if (!missing.empty()) msg += " missing input" + std::string(missing.size() > 1 ? "s " : " ") + joined(missing) + ";";
    if (!extra.empty()) msg += " unexpected input" + std::string(extra.size() > 1 ? "s " : " ") + joined(extra) + ";";
    msg += " it takes " + joined(method->required);
    if (!method->optional.empty()) msg += " (optional: " + joined(method->optional) + ")";
    fail(msg);
  }
  // Floating inputs in the model's dtype on its device; integer ones (class labels) as int64.
  auto get = [&](const std::string& name) -> Tensor {
    auto it = inputs.find(name);
    if (it == inputs.end()) return Tensor();
    const Tensor& t = it->second;
    const auto dt = at::isFloatingType(t.scalar_type()) ? model.dtype : at::kLong;
    return t.to(model.device, name == "class_labels" ? at::kLong : dt);
  };
  auto floating = [&](const std::string& name) {
    Tensor t = get(name);
    DEW_CHECK(!t.defined() || at::isFloatingType(t.scalar_type()) || name == "timestep", where, ": input \"", name,
              "\" must be floating point");
    return t.defined() ? t.to(model.dtype) : t;
  };
  std::map<std::string, Tensor> out;
  at::NoGradGuard no_grad;
  if (model.class_name == "AutoencoderKL") {
    auto vae = std::dynamic_pointer_cast<nn::AutoencoderKLImpl>(model.module);
    DEW_CHECK(vae, where, ": the model is not an autoencoder_kl");
    const std::string& m = method->name;
    if (m == "encode" || m == "tiled_encode") {
      const DiagonalGaussian q = m == "encode" ? vae->encode(floating("sample")) : vae->tiled_encode(floating("sample"));
      out["latent_mean"] = q.mean;
      out["latent_logvar"] = q.logvar;
    } else if (m == "decode") {
      out["sample"] = vae->decode(floating("z"));
    } else if (m == "tiled_decode") {
      out["sample"] = vae->tiled_decode(floating("z"));
    } else {
      out["sample"] = vae->reconstruct(floating("sample"));
    }
  } else {
    auto unet = model.backbone();
    const Tensor x = floating("sample");
    DEW_CHECK(x.dim() >= 1, where, ": sample must be [B, C, H, W], got ", x.sizes());
    Tensor t = floating("timestep");
    DEW_CHECK(t.dim() == 0 || (t.dim() == 1 && (t.size(0) == x.size(0) || t.size(0) == 1)), where,
              ": timestep must be a scalar or [", x.size(0), "], got ", t.sizes());
    t = t.reshape({-1}).expand({x.size(0)}).contiguous();  // diffusers broadcasts a scalar over the batch
    Conditioning cond;
    cond.context = floating("encoder_hidden_states");
    if (inputs.count("encoder_attention_mask")) cond.context_mask = get("encoder_attention_mask").to(at::kBool);
    cond.pooled = floating("text_embeds");
    if (inputs.count("time_ids")) cond.extra["time_ids"] = floating("time_ids");
    if (inputs.count("class_labels")) cond.labels = get("class_labels");
    out["sample"] = unet->forward(x, t, cond);
  }
  for (auto& kv : out) kv.second = kv.second.detach().to(at::kCPU).contiguous();
  return out;
}

}  // namespace dew::interop

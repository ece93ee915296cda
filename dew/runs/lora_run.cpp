// LoRA fine-tuning runs: the recipe section, the base reference and the merged weights of a checkpoint.
#include "dew/runs/lora_run.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>

#include "dew/core/strings.h"
#include "dew/interop/diffusers_forward.h"
#include "dew/interop/hf_decoder.h"
#include "dew/io/files.h"
#include "dew/io/safetensors.h"
#include "dew/nn/text_encoder.h"
#include "dew/runs/post_training_run.h"
#include "dew/training/checkpoint.h"
#include "dew/training/run_dir.h"

namespace fs = std::filesystem;

namespace dew::runs {

// Named, not anonymous: the unity build puts this file in one translation unit with its neighbours.
namespace lora_run_detail {

constexpr const char* kAdapterA = ".lora_A.weight";
constexpr const char* kAdapterB = ".lora_B.weight";

std::vector<std::string> split_targets(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream in(s);
  for (std::string item; std::getline(in, item, ',');) {
    const auto b = item.find_first_not_of(" \t"), e = item.find_last_not_of(" \t");
    if (b != std::string::npos) out.push_back(item.substr(b, e - b + 1));
  }
  return out;
}

// FNV-1a over `n` bytes of `f` from `offset`, folded into `h`.
uint64_t fnv1a(std::ifstream& f, uint64_t offset, uint64_t n, uint64_t h) {
  f.clear();
  f.seekg(static_cast<std::streamoff>(offset));
  std::vector<char> buf(static_cast<size_t>(n));
  f.read(buf.data(), static_cast<std::streamsize>(n));
  for (std::streamsize i = 0; i < f.gcount(); ++i) {
    h ^= static_cast<unsigned char>(buf[static_cast<size_t>(i)]);
    h *= 1099511628211ull;
  }
  return h;
}

// {name, bytes, fnv64}: the size and a hash of the first and last MiB (the header, with every tensor's name,
// shape and offset, and the first and last tensors' bytes): cheap for a checkpoint of any size.
json file_fingerprint(const fs::path& p) {
  DEW_CHECK(fs::is_regular_file(p), "lora base: ", p.string(), " is missing (the base of the adapters)");
  const uint64_t size = fs::file_size(p), chunk = uint64_t(1) << 20;
  std::ifstream f(p, std::ios::binary);
  DEW_CHECK(f.good(), "lora base: cannot read ", p.string());
  uint64_t h = fnv1a(f, 0, std::min(size, chunk), 14695981039346656037ull);
  if (size > chunk) h = fnv1a(f, std::max(chunk, size - chunk), std::min(chunk, size - chunk), h);
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(h));
  return {{"name", p.filename().string()}, {"bytes", size}, {"fnv64", hex}};
}

// The base's weights by the model's parameter and buffer names.
training::TensorMap base_weights(const json& base) {
  const std::string kind = base.value("kind", ""), path = base.value("path", "");
  if (kind == "run") {
    OpenOptions o;
    o.weights = base.value("weights", "ema");
    o.step = base.value("step", int64_t(-1));
    return run_weights(path, o);
  }
  if (kind == "hf") {
    auto model = interop::load_pretrained_decoder(path);
    return training::module_state(*model);
  }
  if (kind == "diffusers") {
    training::TensorMap w = training::module_state(*interop::load_diffusers_folder(path).module);
    if (base.contains("text_encoder"))
      for (auto& [name, t] : training::module_state(*text_encoders::build(base["text_encoder"])))
        w["text_encoder." + name] = t;
    return w;
  }
  DEW_CHECK(kind == "file", "lora base: unknown kind \"", kind, "\"; accepted: run, hf, diffusers, file");
  return io::load_safetensors(path);
}

}  // namespace lora_run_detail

namespace ld = lora_run_detail;

json lora_recipe_defaults() { return to_json(LoraRecipe{}); }

std::optional<nn::LoraOptions> lora_options_of(Omittable<LoraRecipe>& section, const std::string& init_from) {
  if (!section) return std::nullopt;
  const LoraRecipe lr = *section;
  const auto targets = ld::split_targets(lr.targets);
  if (targets.empty() && lr.target_regex.empty()) {
    const json given = to_json(lr), defaults = lora_recipe_defaults();
    for (const auto& [k, v] : given.items())
      DEW_CHECK(v == defaults[k], "lora.", k, ": set to ", v.dump(),
                " but lora.targets is empty; name the modules to adapt (--lora.targets q_proj,v_proj)");
    section.reset();
    return std::nullopt;
  }
  DEW_CHECK(targets.empty() || lr.target_regex.empty(), "lora.targets and lora.target_regex: give one, got \"",
            lr.targets, "\" and \"", lr.target_regex, "\"");
  if (!lr.target_regex.empty()) {
    try {
      std::regex check(lr.target_regex);
    } catch (const std::regex_error& e) {
      fail("lora.target_regex: \"", lr.target_regex, "\" is not a valid regular expression: ", e.what());
    }
  }
  DEW_CHECK(lr.rank > 0, "lora.rank: must be > 0, got ", lr.rank);
  DEW_CHECK(lr.alpha > 0, "lora.alpha: must be > 0, got ", lr.alpha);
  DEW_CHECK(lr.dropout >= 0 && lr.dropout < 1, "lora.dropout: must be in [0, 1), got ", lr.dropout);
  DEW_CHECK(!init_from.empty(),
            "lora: adapters fine-tune a pretrained base, but init_from is empty; pass --init_from with a run or a "
            "model folder (adapters on a randomly initialised base learn nothing reusable)");
  nn::LoraOptions o;
  o.rank(lr.rank).alpha(lr.alpha).dropout(lr.dropout).use_rslora(lr.rslora);
  if (!targets.empty()) o.target_modules(targets);
  else o.target_regex(lr.target_regex);
  return o;
}

json lora_base(const std::string& kind, const std::string& path, int64_t step, const json& text_encoder) {
  json b = {{"kind", kind}, {"path", path}};
  std::vector<fs::path> files;
  if (kind == "diffusers" && text_encoder.is_object() && text_encoder.value("architecture", "none") != "none") {
    b["text_encoder"] = text_encoder;
    b["text_encoder"].erase("trainable");
  }
  if (kind == "run") {
    b["step"] = step;
    b["weights"] = "ema";
    const fs::path dir = training::RunDir(path).checkpoint(step);
    files = {dir / "model.safetensors", dir / "ema.safetensors"};
  } else if (kind == "hf" || kind == "diffusers") {
    DEW_CHECK(fs::is_directory(path), "lora base: ", path, " is not a directory");
    for (const auto& e : fs::directory_iterator(path))
      if (e.path().extension() == ".safetensors") files.push_back(e.path());
    std::sort(files.begin(), files.end());
    files.push_back(fs::path(path) / "config.json");
  } else {
    DEW_CHECK(kind == "file", "lora base: unknown kind \"", kind, "\"; accepted: run, hf, diffusers, file");
    files = {fs::path(path)};
  }
  json fp = json::array();
  for (const auto& f : files) fp.push_back(ld::file_fingerprint(f));
  b["files"] = fp;
  return b;
}

std::string lora_base_change(const json& recorded, const json& now) {
  if (recorded == now) return "";
  for (const char* k : {"kind", "path", "step"})
    if (recorded.value(k, json()) != now.value(k, json()))
      return std::string(k) + " " + recorded.value(k, json()).dump() + " is now " + now.value(k, json()).dump();
  const json a = recorded.value("files", json::array()), b = now.value("files", json::array());
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i)
    if (a[i] != b[i])
      return a[i].value("name", "?") + " was " + a[i].value("bytes", json()).dump() + " bytes (fnv64 " +
             a[i].value("fnv64", "?") + "), is now " + b[i].value("bytes", json()).dump() + " bytes (fnv64 " +
             b[i].value("fnv64", "?") + ")";
  return "its files were " + std::to_string(a.size()) + ", are now " + std::to_string(b.size());
}

json apply_lora_to_run(torch::nn::Module& model, const nn::LoraOptions& o, json base) {
  const nn::LoraReport rep = nn::apply_lora(model, o);
  return {{"options", to_json(o)},
          {"base", std::move(base)},
          {"adapted", rep.targets.size()},
          {"trainable", rep.trainable},
          {"frozen", rep.frozen}};
}

io::KeyMap lora_base_key_map() {
  io::KeyMap map;
  map.allow_missing(R"(.*\.lora_[AB]\.weight)");
  return map;
}

training::TensorMap merged_lora_weights(const training::TensorMap& adapters, const json& lora,
                                        const std::string& where) {
  DEW_CHECK(lora.is_object() && lora.contains("options") && lora.contains("base") && lora["base"].is_object(), where,
            ": state.json's \"lora\" needs the adapters' options and their base");
  const auto o = from_json<nn::LoraOptions>(lora["options"], where + " lora.options");
  const json& recorded = lora["base"];
  const json now = lora_base(recorded.value("kind", ""), recorded.value("path", ""),
                             recorded.value("step", int64_t(-1)), recorded.value("text_encoder", json()));
  const std::string change = lora_base_change(recorded, now);
  DEW_CHECK(change.empty(), where, ": its adapters were trained on the base ", recorded.value("path", "?"),
            ", which has changed since (", change, "); adapters do not carry over to another base");
  training::TensorMap w = ld::base_weights(recorded);
  const double scale = nn::lora_scale(o);
  at::NoGradGuard no_grad;
  for (const auto& [name, a] : adapters) {
    if (!ends_with(name, ld::kAdapterA)) {
      DEW_CHECK(ends_with(name, ld::kAdapterB), where, ": \"", name, "\" is not an adapter tensor");
      continue;
    }
    const std::string module = name.substr(0, name.size() - std::string(ld::kAdapterA).size());
    const auto b = adapters.find(module + ld::kAdapterB);
    DEW_CHECK(b != adapters.end(), where, ": \"", name, "\" has no \"", module + ld::kAdapterB, "\"");
    const auto it = w.find(module + ".weight");
    DEW_CHECK(it != w.end(), where, ": the adapter of ", module, " has no weight \"", module, ".weight\" in its base ",
              recorded.value("path", "?"));
    const at::Tensor d = nn::lora_delta_weight(a, b->second, scale);
    DEW_CHECK(d.sizes() == it->second.sizes(), where, ": the adapter of ", module, " makes a ", d.sizes(),
              " update, its base weight is ", it->second.sizes());
    it->second = it->second + d.to(it->second.scalar_type());  // as merge_lora adds it
  }
  return w;
}

namespace {

std::string last_component(std::string s) {
  while (s.size() > 1 && s.back() == '/') s.pop_back();
  const size_t slash = s.rfind('/');
  return slash == std::string::npos ? s : s.substr(slash + 1);
}

// A local path as one spelling (absolute, no "." / ".." / trailing slash, links resolved); "" when there is none.
std::string local_path(const std::string& s) {
  std::error_code ec;
  if (s.empty() || !fs::exists(s, ec)) return "";
  const fs::path c = fs::weakly_canonical(s, ec);
  return ec ? "" : c.string();
}

}  // namespace

std::string lora_adapter_base_mismatch(const std::string& adapter_base, const std::string& run_dir) {
  if (adapter_base.empty()) return "";
  const json record = read_record(run_dir);
  std::vector<std::string> bases = {run_dir};
  const auto add = [&bases](const json& v) {
    if (v.is_string() && !v.get<std::string>().empty()) bases.push_back(v.get<std::string>());
  };
  add(record.value("init_from", json()));
  add(record.value(json::json_pointer("/derived/lora/base/path"), json()));
  // A transformers folder among them may say what it was saved from (save_pretrained's _name_or_path).
  for (size_t i = 0, n = bases.size(); i < n; ++i) {
    const fs::path config = fs::path(bases[i]) / "config.json";
    std::error_code ec;
    if (!fs::is_regular_file(config, ec)) continue;
    try {  // through io::parse_json, which bounds the nesting; a config that does not parse names nothing
      const json c = io::parse_json(io::read_file(config.string(), "config"), config.string());
      if (c.is_object()) add(c.value("_name_or_path", json()));
    } catch (const Error&) {}
  }
  const std::string wanted = local_path(adapter_base);
  for (const std::string& b : bases) {
    if (b == adapter_base) return "";
    const std::string here = local_path(b);
    if (!wanted.empty() && wanted == here) return "";
    if (wanted.empty() && last_component(b) == last_component(adapter_base)) return "";  // "org/name" vs ".../name"
  }
  std::string list;
  for (const std::string& b : bases) list += (list.empty() ? "" : ", ") + b;
  return "the adapter was trained on base_model_name_or_path \"" + adapter_base + "\" (adapter_config.json), and " +
         run_dir + " stands for " + list;
}

std::string export_lora_adapters(const std::string& run_dir, const OpenOptions& o, const std::string& dest) {
  const json record = read_record(run_dir);
  const std::string kind = record.value("kind", "");
  const json lora = record.value("derived", json::object()).value("lora", json());
  DEW_CHECK(lora.is_object(), "--adapter: ", run_dir, " trained no LoRA adapters (its recipe has no lora.targets)");
  DEW_CHECK(o.weights == "ema" || o.weights == "live", "--adapter: weights \"", o.weights,
            "\"; the adapters export from the ema or live weights");
  int64_t step = o.step < 0 ? training::latest_checkpoint(run_dir) : o.step;
  auto ck = training::load_checkpoint(run_dir, step, /*load_optimizer=*/false);
  const bool average = ck.state.value("ema_role", "average") == "average";
  if (o.weights == "ema" && average)
    for (const auto& [name, avg] : ck.ema)
      if (ck.model.count(name)) ck.model[name] = avg.to(ck.model[name].scalar_type());
  const auto options = from_json<nn::LoraOptions>(ck.state.value("lora", lora).at("options"), "lora.options");
  const std::string base = lora.value("base", json::object()).value("path", "");
  const auto& lm = language_model_kinds();
  if (std::find(lm.begin(), lm.end(), kind) != lm.end()) {
    nn::save_peft_adapter(dest, ck.model, options, base);
    return "a PEFT adapter folder (adapter_config.json, adapter_model.safetensors) of step " + std::to_string(step);
  }
  DEW_CHECK(kind == "diffusion", "--adapter: ", run_dir, " is a ", kind,
            " run; adapters export from language-model and diffusion runs");
  DEW_CHECK(fs::path(dest).extension() == ".safetensors", "--adapter: a diffusion run's adapters are one file, DEST ",
            dest, " must end in .safetensors (e.g. pytorch_lora_weights.safetensors)");
  if (fs::path(dest).has_parent_path()) fs::create_directories(fs::path(dest).parent_path());
  // diffusers' component names: the UNet pipelines' "unet", the transformer ones' "transformer".
  const std::string arch = record.value("model", json::object()).value("architecture", "");
  const std::string prefix = arch.find("unet") != std::string::npos ? "unet" : "transformer";
  nn::save_diffusers_lora(dest, ck.model, options, prefix);
  return "a diffusers LoRA file (" + prefix + ".* keys) of step " + std::to_string(step);
}

}  // namespace dew::runs

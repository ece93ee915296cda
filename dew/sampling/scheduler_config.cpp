#include "dew/sampling/scheduler_config.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <sstream>

#include "dew/sampling/schedulers.h"

namespace dew::sampling {

namespace {

diffusion::SchedulePtr parse_betas(const detail::ConfigReader& r, int64_t T, bool rescale) {
  diffusion::DiscreteOptions o;
  o.timesteps = T;
  o.rescale_zero_snr = rescale;
  if (const json* tb = r.find("trained_betas")) {
    if (!tb->is_array() || int64_t(tb->size()) != T)
      r.bad("trained_betas", *tb, str("a list of ", T, " numbers (num_train_timesteps)"));
    std::vector<double> b;
    for (const auto& e : *tb) {
      if (!e.is_number()) r.bad("trained_betas", *tb, "a list of numbers");
      b.push_back(e.get<double>());
    }
    const auto betas = at::tensor(at::ArrayRef<double>(b), at::TensorOptions().dtype(at::kDouble));
    return diffusion::make_discrete_from_betas("trained_betas", betas, o);
  }
  const auto kind = r.choice("beta_schedule", "linear", {"linear", "scaled_linear", "squaredcos_cap_v2"});
  diffusion::SchedulePtr s;
  std::string name;
  if (kind == "squaredcos_cap_v2") {
    name = "cosine";  // max_beta 0.999, dew's cosine default
    s = diffusion::make_cosine(o);
  } else {
    const double b0 = r.number("beta_start", 1e-4), b1 = r.number("beta_end", 0.02);
    DEW_CHECK(b0 > 0 && b0 <= b1 && b1 <= 1, r.where(), ": beta_start, beta_end = ", b0, ", ", b1,
              " are not supported; accepted: 0 < beta_start <= beta_end <= 1");
    o.beta_range = std::make_pair(b0, b1);
    name = kind;
    s = kind == "linear" ? diffusion::make_linear(o) : diffusion::make_scaled_linear(o);
  }
  json spec = to_json(o);
  spec["name"] = name;
  s->set_spec(spec);
  return s;
}

std::string quote_python_constants(const std::string& text) {
  // Outside strings, Python's json.dumps writes -Infinity, Infinity and NaN; quote them for nlohmann.
  std::string out;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      out += c;
      if (c == '\\' && i + 1 < text.size()) out += text[++i];
      else if (c == '"') in_string = false;
      continue;
    }
    if (c == '"') {
      in_string = true;
      out += c;
      continue;
    }
    bool replaced = false;
    for (const char* tok : {"-Infinity", "Infinity", "NaN"}) {
      const std::string t = tok;
      if (text.compare(i, t.size(), t) == 0) {
        out += "\"" + t + "\"";
        i += t.size() - 1;
        replaced = true;
        break;
      }
    }
    if (!replaced) out += c;
  }
  return out;
}

}  // namespace

namespace detail {

const json* ConfigReader::find(const std::string& key) const {
  auto it = cfg_.find(key);
  return it == cfg_.end() || it->is_null() ? nullptr : &*it;
}

void ConfigReader::bad(const std::string& key, const json& v, const std::string& accepted) const {
  std::string shown = v.dump();
  if (shown.size() > 80) shown = shown.substr(0, 77) + "...";
  fail(where_, ": ", key, " = ", shown, " is not supported by ", cls_, " here; accepted: ", accepted);
}

double ConfigReader::number(const std::string& key, double def) const {
  const json* v = find(key);
  if (!v) return def;
  if (v->is_number()) return v->get<double>();
  if (v->is_string()) {  // Python's json writes -Infinity / Infinity / NaN; from_file quotes them
    const auto s = v->get<std::string>();
    if (s == "-Infinity") return -std::numeric_limits<double>::infinity();
    if (s == "Infinity") return std::numeric_limits<double>::infinity();
    if (s == "NaN") return std::numeric_limits<double>::quiet_NaN();
  }
  bad(key, *v, "a number");
}

std::optional<double> ConfigReader::optional_number(const std::string& key) const {
  if (!find(key)) return std::nullopt;
  return number(key, 0);
}

int64_t ConfigReader::integer(const std::string& key, int64_t def) const {
  const json* v = find(key);
  if (!v) return def;
  if (v->is_number_integer()) return v->get<int64_t>();
  if (v->is_number_float() && std::floor(v->get<double>()) == v->get<double>()) return int64_t(v->get<double>());
  bad(key, *v, "an integer");
}

bool ConfigReader::flag(const std::string& key, bool def) const {
  const json* v = find(key);
  if (!v) return def;
  if (!v->is_boolean()) bad(key, *v, "true or false");
  return v->get<bool>();
}

std::string ConfigReader::choice(const std::string& key, const std::string& def,
                                 const std::vector<std::string>& ok) const {
  const json* v = find(key);
  if (!v) return def;
  std::string list;
  for (const auto& c : ok) list += (list.empty() ? "" : ", ") + c;
  if (!v->is_string() || std::find(ok.begin(), ok.end(), v->get<std::string>()) == ok.end()) bad(key, *v, list);
  return v->get<std::string>();
}

void ConfigReader::require_flag(const std::string& key, bool def, bool ok, const std::string& why) const {
  if (flag(key, def) != ok) bad(key, *find(key), std::string(ok ? "true" : "false") + why);
}

ConfigBase parse_base(const ConfigReader& r, const std::vector<std::string>& predictions,
                      const std::string& default_spacing, bool takes_rescale, bool tiny_terminal_alphabar) {
  ConfigBase b;
  b.T = r.integer("num_train_timesteps", 1000);
  if (b.T < 2) r.bad("num_train_timesteps", *r.find("num_train_timesteps"), "an integer >= 2");
  const bool rescale = takes_rescale && r.flag("rescale_betas_zero_snr", false);
  b.schedule = parse_betas(r, b.T, rescale);
  auto ac = diffusion::alphas_cumprod(*b.schedule).contiguous();
  b.ac.assign(ac.data_ptr<double>(), ac.data_ptr<double>() + ac.numel());
  // Euler, Euler ancestral and DPM-Solver keep sigma finite at zero terminal SNR.
  if (rescale && tiny_terminal_alphabar) b.ac.back() = std::ldexp(1.0, -24);
  b.prediction = r.choice("prediction_type", "epsilon", predictions);
  b.spacing = r.choice("timestep_spacing", default_spacing, {"leading", "trailing", "linspace"});
  b.offset = r.integer("steps_offset", 0);
  if (b.offset < 0) r.bad("steps_offset", *r.find("steps_offset"), "an integer >= 0");
  return b;
}

}  // namespace detail

json read_scheduler_config(const std::string& path) {
  std::ifstream f(path);
  DEW_CHECK(f.good(), path, ": cannot open the scheduler config");
  std::stringstream ss;
  ss << f.rdbuf();
  try {
    return json::parse(quote_python_constants(ss.str()));
  } catch (const json::exception& e) {
    fail(path, ": not valid JSON: ", e.what());
  }
}

}  // namespace dew::sampling

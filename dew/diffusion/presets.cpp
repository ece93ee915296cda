#include "dew/diffusion/presets.h"

namespace dew::diffusion {

Preset preset(const std::string& name, const PresetOptions& o, int64_t height, int64_t width) {
  Preset p;
  p.name = name;
  if (name == "edm") {
    DEW_CHECK(o.regime == "pixel" || o.regime == "latent", "preset edm: field regime is required, got \"", o.regime,
              "\", accepted: pixel, latent");
    EDMOptions e;
    e.regime = o.regime;
    e.p_mean = o.p_mean;
    e.p_std = o.p_std;
    e.sigma_data = o.sigma_data;
    p.train = schedules().build("edm", to_json(e));
    KarrasOptions k;
    k.sigma_data = o.sigma_data;
    p.sample = schedules().build("karras_ve", to_json(k));
    p.transform = make_transform("karras", o.sigma_data);
  } else if (name == "karras") {
    KarrasOptions k;
    k.sigma_data = o.sigma_data;
    p.train = p.sample = schedules().build("karras_ve", to_json(k));
    p.transform = make_transform("karras", o.sigma_data);
  } else if (name == "cosine") {
    DiscreteOptions d;
    d.timesteps = o.timesteps;
    d.beta_end = 1.0;
    p.train = p.sample = schedules().build("cosine", to_json(d));
    p.transform = make_transform("v");
  } else if (name == "flow") {
    FlowOptions f;
    f.density = o.density;
    f.shift = o.shift;
    if (o.resolution_shift) {
      DEW_CHECK(height > 0 && width > 0, "preset flow: resolution_shift needs the image size, got ", height, "x",
                width);
      f.shift = flow_resolution_shift(height, width);
    }
    p.train = p.sample = schedules().build("flow", to_json(f));
    p.transform = make_transform("flow");
  } else if (name == "sqrt") {
    p.train = p.sample = schedules().build("sqrt", json::object());
    p.transform = make_transform("x0");
  } else {
    fail("unknown preset \"", name, "\"; registered: cosine, edm, flow, karras, sqrt");
  }
  if (o.min_snr_gamma) {
    p.weighting = weightings().build("min_snr", json{{"gamma", *o.min_snr_gamma}});
  } else {
    p.weighting = weightings().build("schedule", json::object());
  }
  p.spec = to_json(o);
  p.spec["name"] = name;
  return p;
}

Registry<Preset>& presets() {
  static Registry<Preset>* r = [] {
    auto* r = new Registry<Preset>("preset");
    const std::vector<std::pair<std::string, std::string>> docs = {
        {"cosine", "cosine(1000, beta_end 1.0) with P2 weight; v prediction"},
        {"edm", "EDM training density (regime pixel|latent), Karras VE sampling; karras preconditioning"},
        {"flow", "flow matching (shift 1, logit_normal(0, 1)); flow prediction"},
        {"karras", "Karras VE for training and sampling; karras preconditioning"},
        {"sqrt", "Diffusion-LM sqrt schedule; x0 prediction"}};
    for (const auto& [name, doc] : docs) {
      r->add<PresetOptions>(
          name, doc, [name = name](const PresetOptions& o) { return std::make_shared<Preset>(preset(name, o)); });
    }
    return r;
  }();
  return *r;
}

}  // namespace dew::diffusion

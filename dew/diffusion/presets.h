// Presets (docs/diffusion.md): named bundles of training schedule, sampling schedule, transform and
// weighting.
//
// | name   | train                                     | sample    | transform |
// | edm    | EDM(regime required)                      | Karras VE | karras    |
// | karras | Karras VE                                 | Karras VE | karras    |
// | cosine | cosine(1000, beta_end 1.0), P2 k=1 gamma=1 | same      | v         |
// | flow   | flow matching(shift 1, logit_normal(0,1)) | same      | flow      |
// | sqrt   | sqrt                                      | same      | x0        |
// Each accepts min_snr_gamma, which replaces the weighting with MinSNR(gamma).
#pragma once
#include "dew/diffusion/weightings.h"

namespace dew::diffusion {

struct PresetOptions {
  std::optional<double> min_snr_gamma;
  std::string regime;
  std::optional<double> p_mean, p_std;
  double sigma_data = 0.5;
  double shift = 1.0;
  bool resolution_shift = false;
  std::string density = "logit_normal";
  int64_t timesteps = 1000;
  template <class V>
  void visit(V& v) {
    v("min_snr_gamma", min_snr_gamma, "replace the weighting by MinSNR(gamma), e.g. 5.0");
    v("regime", regime, "edm: pixel | latent (required for edm)");
    v("p_mean", p_mean, "edm: explicit P_mean");
    v("p_std", p_std, "edm: explicit P_std");
    v("sigma_data", sigma_data, "edm/karras: data standard deviation");
    v("shift", shift, "flow: time shift");
    v("resolution_shift", resolution_shift, "flow: derive the shift from the image size");
    v.choice("density", density, {"logit_normal", "mode", "cosmap", "uniform"}, "flow: training density of t");
    v("timesteps", timesteps, "cosine: number of discrete steps");
  }
};

struct Preset {
  std::string name;
  SchedulePtr train;
  SchedulePtr sample;
  TransformPtr transform;
  WeightingPtr weighting;
  json spec;  // {"name": ..., fields...}
};
using PresetPtr = std::shared_ptr<Preset>;

/// Builds a preset; `height`/`width` matter only for flow's resolution shift.
Preset preset(const std::string& name, const PresetOptions& options = {}, int64_t height = 0, int64_t width = 0);

/// edm | karras | cosine | flow | sqrt.
Registry<Preset>& presets();

}  // namespace dew::diffusion

#include "dew/objectives/registry.h"

#include "dew/objectives/diffusion.h"

namespace dew {

Registry<Objective, const ObjectiveContext&>& objectives() {
  static auto* r = [] {
    auto* r = new Registry<Objective, const ObjectiveContext&>("objective");
    r->add<DiffusionObjectiveOptions>(
        "diffusion", "denoising diffusion / flow matching with a preset; preview grid at validation",
        [](const DiffusionObjectiveOptions& o, const ObjectiveContext& c) {
          DEW_CHECK(c.model && c.preset, "objective diffusion: needs a model and a preset");
          return std::make_shared<DiffusionObjective>(c.model, *c.preset, o, c.num_classes, c.sample_shape);
        });
    return r;
  }();
  return *r;
}

}  // namespace dew

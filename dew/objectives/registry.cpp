#include "dew/objectives/registry.h"

#include "dew/objectives/diffusion.h"
#include "dew/objectives/lm.h"

namespace dew {

Registry<Objective, const ObjectiveContext&>& objectives() {
  static auto* r = [] {
    auto* r = new Registry<Objective, const ObjectiveContext&>("objective");
    r->add<DiffusionObjectiveOptions>(
        "diffusion", "denoising diffusion / flow matching with a preset; preview grid at validation",
        [](const DiffusionObjectiveOptions& o, const ObjectiveContext& c) {
          DEW_CHECK(c.model && c.preset, "objective diffusion: needs a model and a preset");
          return std::make_shared<DiffusionObjective>(c.model, *c.preset, o, c.num_classes, c.sample_shape,
                                                      c.text_encoder, c.class_names, c.latent);
        });
    r->add<LMObjectiveOptions>(
        "lm", "next-token cross entropy of a causal_transformer; validation perplexity and a sampled text",
        [](const LMObjectiveOptions& o, const ObjectiveContext& c) -> std::shared_ptr<Objective> {
          DEW_CHECK(!c.language_model.is_empty(), "objective lm: needs a causal_transformer language_model");
          return std::make_shared<LMObjective>(c.language_model, c.lm_data, o);
        });
    return r;
  }();
  return *r;
}

}  // namespace dew

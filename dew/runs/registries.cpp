// The index of every registry, for `dew list` and library users (in runs/, the top layer, so core depends on
// none of them).
#include "dew/core/registry.h"
#include "dew/diffusion/presets.h"
#include "dew/data/dataset.h"
#include "dew/data/lm_data.h"
#include "dew/data/tokenizer.h"
#include "dew/metrics/metrics.h"
#include "dew/objectives/registry.h"
#include "dew/nn/backbones/backbone.h"
#include "dew/nn/backbones/causal_transformer.h"
#include "dew/nn/text_encoder.h"
#include "dew/sampling/solvers.h"

namespace dew {

std::vector<const RegistryBase*> all_registries() {
  return {&models::registry(), &models::language_models(), &data::datasets(), &diffusion::presets(), &diffusion::schedules(), &diffusion::transforms(), &diffusion::weightings(),
          &sampling::solvers(), &objectives(), &metrics::registry(), &data::tokenizers(), &data::lm_datasets(),
          &text_encoders::registry(), &models::autoencoders()};
}

std::string format_registry(const RegistryBase& r) {
  std::string out;
  for (const auto& e : r.entries()) {
    out += e.name + " — " + e.doc + "\n";
    out += format_fields(e.fields, "    ");
  }
  return out;
}

}  // namespace dew

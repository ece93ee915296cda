#include "dew/runs/registries.h"

#include "dew/data/dataset.h"
#include "dew/data/lm_data.h"
#include "dew/data/tokenizer.h"
#include "dew/diffusion/presets.h"
#include "dew/metrics/metrics.h"
#include "dew/nn/backbones/backbone.h"
#include "dew/nn/backbones/causal_transformer.h"
#include "dew/nn/text_encoder.h"
#include "dew/objectives/registry.h"
#include "dew/sampling/solvers.h"

namespace dew {

std::vector<const RegistryBase*> all_registries() {
  return {&models::registry(),       &models::language_models(),  &text_encoders::registry(),
          &models::token_encoders(), &models::token_predictors(), &models::autoencoders(),
          &data::datasets(),         &data::lm_datasets(),        &data::tokenizers(),
          &diffusion::presets(),     &diffusion::schedules(),     &diffusion::transforms(),
          &diffusion::weightings(),  &sampling::solvers(),        &objectives(),
          &metrics::registry()};
}

}  // namespace dew

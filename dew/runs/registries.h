// The index of every registry of the library, for `dew list` and library users. It lives in runs/, the top
// library layer, because it names registries of every layer below (core depends on none of them).
#pragma once
#include <vector>

#include "dew/core/registry.h"

namespace dew {

/// Every registry of the library, one per kind: models, language models, text encoders, token encoders and
/// predictors, autoencoders, datasets, LM datasets, tokenizers, presets, schedules, transforms,
/// weightings, solvers, objectives and metrics.
std::vector<const RegistryBase*> all_registries();

}  // namespace dew

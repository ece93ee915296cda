// The layout of a run's record (RUN/run.json): its format version, and the recipe inside it. Torch-free, so that
// the recipe parsing of the CLI can be fuzzed alone (fuzz/recipe_fuzz.cpp).
#pragma once
#include "dew/core/options.h"

namespace dew::runs {

/// Layout version of run.json. 1: the first dew (kind-specific shapes, the recipe nested under "recipe");
/// 2: one shape for every kind. Version-1 records are read and converted in memory.
inline constexpr int kRunFormat = 2;

/// The recipe inside a run.json record (what `--config RUN/run.json` reruns): the record without its
/// record-only keys (kind, format, dew_version, derived).
json recipe_of_record(json record);

}  // namespace dew::runs

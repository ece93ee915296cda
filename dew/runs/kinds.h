// The run kinds the library registers (internal to dew/runs: users reach them through run_kind()).
#pragma once
#include "dew/runs/run.h"

namespace dew::runs {

RunKind diffusion_kind();
RunKind autoencoder_kind();
RunKind lm_kind();
RunKind jepa_kind();
RunKind sft_kind();
RunKind dpo_kind();
RunKind grpo_kind();

}  // namespace dew::runs

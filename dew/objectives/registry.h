// The `objectives` registry: builds an objective by name from its JSON options and what the run
// already has (model, preset, data facts).
#pragma once
#include "dew/diffusion/presets.h"
#include "dew/nn/backbones/backbone.h"
#include "dew/nn/backbones/causal_transformer.h"
#include "dew/nn/text_encoder.h"
#include "dew/objectives/latent.h"
#include "dew/training/objective.h"

namespace dew {
namespace data {
struct LMData;
}

/// What an objective is built around, besides its own options: its modules by role, and data facts.
struct ObjectiveContext {
  BackbonePtr model;                              // diffusion objectives: the denoiser
  nn::CausalTransformer language_model{nullptr};  // language-model objectives: the policy
  diffusion::PresetPtr preset;                    // diffusion objectives
  int64_t num_classes = 0;                        // 0 = unconditional
  std::vector<int64_t> sample_shape;              // one item, e.g. [1, 28, 28]
  std::shared_ptr<data::LMData> lm_data;          // language-model objectives: validation stream, EOS, tokenizer
  TextEncoderPtr text_encoder;                    // diffusion: condition on captions of the labels (optional)
  std::vector<std::string> class_names;           // label id -> name
  LatentSpacePtr latent;  // latent diffusion: the frozen autoencoder (sample_shape is the latent's)
};

/// diffusion, lm (more with later objectives).
Registry<Objective, const ObjectiveContext&>& objectives();

}  // namespace dew

// Model families (docs/architecture.md): every registered model — denoisers (models::registry()),
// language models (models::language_models()) and text encoders (text_encoders::registry()) — also
// records its role and a tiny configuration here, which the shared family suite
// (tests/nn/test_all_backbones.cpp) runs for every family. models::family(name) (backbone.h) looks a
// family up after every registry has been filled.
#pragma once
#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dew/core/options.h"
#include "dew/io/weights.h"

namespace dew::models {

/// Bounds on every integer field of a model, checked before the module is built (models::build): a count (of
/// layers, heads, blocks: a name with "layers", "heads" or "blocks", or starting "num_") at most 2^16, any other
/// size (a width, a length, a vocabulary) at most 2^24. Far above any model Dew builds or imports, and low enough
/// that an absurd value (a layer count of 2^32) is refused at once instead of building until memory runs out.
constexpr int64_t kMaxModelCount = int64_t(1) << 16;
constexpr int64_t kMaxModelSize = int64_t(1) << 24;

/// What a family's model is for: a denoiser (BackboneImpl::forward), a causal language model
/// (CausalTransformerImpl::forward_tokens), a text encoder (TextEncoderImpl::encode), an encoder of token
/// subsets (TokenEncoderImpl::forward), a predictor of hidden tokens (TokenPredictorImpl::forward) or an
/// autoencoder of latent diffusion (AutoencoderImpl::encode / decode).
enum class Role { kDenoiser, kLanguageModel, kTextEncoder, kTokenEncoder, kTokenPredictor, kAutoencoder };

/// A tiny configuration of a family and the inputs it takes, for the shared family test suite.
struct TinyConfig {
  json fields;                 // a few thousand parameters
  std::vector<int64_t> input;  // denoisers, token encoders and autoencoders: [B, C, H, W] or [B, C, T, H, W]; language
                               // models: [B, S]; text encoders: [B] (the number of captions); token
                               // predictors: [M, B, Kc, Kt] (target blocks, batch, context and target tokens)
  int64_t context = 0;         // denoisers: width of a text context (0: none)
  bool zero_output_at_init = true;  // denoisers: the output is exactly zero before training (zero-initialised heads)
  int64_t pooled = 0;               // denoisers: width of a pooled text vector (Conditioning::pooled; 0: none)
  std::vector<std::string> extra = {};  // denoisers: named inputs [B] it needs (Conditioning::extra: Flux's guidance)
};

/// One method of a reference class as `dew forward` and the reference-parity suite run it (diffusers'
/// forward, encode, decode, ...): the names of its inputs and outputs, and how it runs on the family's module.
struct ReferenceMethod {
  std::string name;
  std::vector<std::string> required, optional;  // the reference call's input names
  std::vector<std::string> outputs;
  /// module (the family's, in eval mode), inputs by reference name (floating ones already in the module's
  /// dtype and device; integer and boolean ones as given), `where` ("Class.method", for messages) ->
  /// outputs by name.
  std::function<std::map<std::string, at::Tensor>(
      torch::nn::Module& module, const std::map<std::string, at::Tensor>& inputs, const std::string& where)>
      run;
};

/// A registered family: the one entry a model family adds (dew/nn/backbones/backbone.cpp), from which its
/// role registry, `dew forward`, the diffusers folder loader, `init_from` and the shared suites read.
struct Family {
  Family() = default;
  Family(Role r, TinyConfig t, std::function<json(const json&)> from = nullptr)
      : role(r), tiny(std::move(t)), from_reference_config(std::move(from)) {}
  Role role = Role::kDenoiser;
  TinyConfig tiny;
  /// Further tiny configurations the shared family suite runs like `tiny` (options that change the model's
  /// structure: scan orders, layer patterns, token layouts).
  std::vector<TinyConfig> variants;
  /// Builds the family's module from its fields (set where the family is registered).
  std::function<std::shared_ptr<torch::nn::Module>(const json& fields)> build;
  /// Imported families: the reference's config.json (transformers / diffusers keys, `_`-prefixed
  /// bookkeeping already removed) -> this family's fields; unsupported settings are a dew::Error naming
  /// them. Null for dew's own families.
  std::function<json(const json& reference_config)> from_reference_config;
  /// Imported families: the key map from the reference checkpoint's names to the module's, for a model of
  /// `fields` and the checkpoint `source` (models::load_reference_weights). Null for dew's own families.
  std::function<io::KeyMap(const json& fields, const io::WeightSource& source)> reference_key_map;
  /// Imported families: the reference classes a folder's config names for this family (diffusers'
  /// `_class_name`) and the reference's methods that `dew forward` runs (the first is the default).
  std::vector<std::string> reference_classes;
  std::vector<ReferenceMethod> reference_methods;
  /// `init_from` across families: the family whose weights start this one (unet_3d from a 2D unet), and the
  /// key map from its names to this one's (buffers may be absent). Empty: init_from loads this family's own.
  std::string inflates_from;
  std::function<io::KeyMap()> inflation_map;
};

/// Records a family (called where its registry entry is added).
void add_family_info(const std::string& name, Family family);
/// The family recorded as `name`, or null.
const Family* find_family_info(const std::string& name);
/// The names of every family recorded so far, sorted.
std::vector<std::string> recorded_family_names();

}  // namespace dew::models

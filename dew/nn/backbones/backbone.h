// The interface every diffusion backbone implements, and the `models` registry.
//
//   auto model = dew::models::build("simple_dit", {{"patch_size", 2}, {"num_layers", 4}});
//   Tensor F = model->forward(x_in, model_time, cond);   // x_in: [B, C, H, W], model_time: [B]
#pragma once
#include <torch/nn/module.h>

#include <map>
#include <string>
#include <vector>

#include "dew/core/registry.h"
#include "dew/nn/family.h"

namespace dew {

class AutoencoderImpl;
class TokenEncoderImpl;
class TokenPredictorImpl;

/// Conditioning inputs of a diffusion backbone. Undefined tensors mean "absent".
struct Conditioning {
  at::Tensor labels;        // [B] int64 class ids; the value num_classes is the null (unconditional) class
  at::Tensor context;       // [B, L, D_text] text features
  at::Tensor context_mask;  // [B, L] bool, true = real token
  at::Tensor pooled;        // [B, P] pooled text (SD3 / Flux / SDXL text_embeds)
  /// Family-specific inputs by the reference's argument name, e.g. "time_ids" [B, 6] (SDXL), "guidance" [B]
  /// (Flux), "img_ids" / "txt_ids" [S, 3], "img_shapes", "mask" / "masked_image_latents" (inpainting). A
  /// family reads the names it documents and refuses others (check_inputs).
  std::map<std::string, at::Tensor> extra;
  /// dew::Error naming `family` when `pooled` is given to a family that takes none, or an `extra` key is not
  /// in `accepted`: an input a model would ignore is refused, not dropped.
  void check_inputs(const std::string& family, bool takes_pooled, const std::vector<std::string>& accepted = {}) const;
};

/// Base of diffusion backbones: F = forward(x_t * c_in, model_time, conditioning).
class BackboneImpl : public torch::nn::Module {
 public:
  /// x: [B, C, H, W] (or [B, C, T, H, W] for video); time: [B] float32; returns x's shape with
  /// output_channels channels.
  virtual at::Tensor forward(const at::Tensor& x, const at::Tensor& time, const Conditioning& cond) = 0;
  /// True for models that cannot run without a text context (the MM-DiTs), so a run without a text
  /// encoder is refused before training starts.
  virtual bool requires_text() const { return false; }
  /// True for models that read a pooled text vector (Conditioning::pooled: SD3, Flux): training and
  /// sampling with a text encoder then pass its pooled output beside the per-token context.
  virtual bool takes_pooled() const { return false; }
  /// The {architecture, fields} record the model was built from.
  const json& config() const { return config_; }
  void set_config(json c) { config_ = std::move(c); }

 private:
  json config_;
};
using BackbonePtr = std::shared_ptr<BackboneImpl>;

namespace models {

/// The family registered as `name` in any of the model registries (dew::Error when there is none).
const Family& family(const std::string& name);
/// Every registered family of every role, sorted.
std::vector<std::string> family_names();
/// Builds family `name` (any role) from its fields.
std::shared_ptr<torch::nn::Module> build_module(const std::string& name, const json& fields);

/// How a denoiser's reference forward names what dew's forward(x, time, Conditioning) reads; "" where the
/// reference has no such input. Floating inputs arrive in the model's dtype; the timestep may be a scalar
/// or one per row, of any numeric type (diffusers broadcasts a scalar over the batch).
struct DenoiserInputs {
  std::string x = "sample";
  std::string time = "timestep";
  std::string context = "encoder_hidden_states";
  bool context_required = true;
  std::string context_mask;        // read as bool
  std::string pooled;              // Conditioning::pooled
  std::string labels;              // Conditioning::labels, read as int64
  std::vector<std::string> extra;  // Conditioning::extra, under the same names (SDXL's time_ids)
  std::string output = "sample";
};
/// The reference method "forward" of a denoiser family with these input names.
ReferenceMethod denoiser_forward(const DenoiserInputs& inputs);
/// An imported family's fields from its reference config.json: keys starting with "_" (diffusers' and
/// transformers' bookkeeping) are dropped, then the family translates; a family that imports nothing, or
/// an unsupported setting, is a dew::Error naming it.
json fields_from_reference_config(const std::string& name, const json& config);
/// Loads an imported family's reference checkpoint (a file, an index or a folder) into `module`, a model
/// of `fields`, through the family's key map; buffers the checkpoint lacks keep their values.
io::LoadReport load_reference_weights(torch::nn::Module& module, const std::string& name, const json& fields,
                                      const std::string& path);

/// Every registered denoiser architecture.
Registry<BackboneImpl>& registry();
/// Builds architecture `name` from its fields and records {architecture, fields} as its config.
BackbonePtr build(const std::string& name, const json& fields);
/// Builds from a {"architecture": NAME, "fields": {...}} record (as stored in run.json).
BackbonePtr build(const json& record);

/// The encoders of token subsets (jepa_encoder, jepa_video_encoder) and the predictors (jepa_predictor).
Registry<TokenEncoderImpl>& token_encoders();
Registry<TokenPredictorImpl>& token_predictors();
/// Builds from an {"architecture": NAME, "fields": {...}} record; the module's config() is the record
/// with every field resolved.
std::shared_ptr<TokenEncoderImpl> build_token_encoder(const json& record);
std::shared_ptr<TokenPredictorImpl> build_token_predictor(const json& record);

/// The autoencoders of latent diffusion (autoencoder_kl): images <-> latents (dew/nn/roles.h).
Registry<AutoencoderImpl>& autoencoders();
/// Builds from an {"architecture": NAME, "fields": {...}} record; config() is the record with every field.
std::shared_ptr<AutoencoderImpl> build_autoencoder(const json& record);

}  // namespace models
}  // namespace dew

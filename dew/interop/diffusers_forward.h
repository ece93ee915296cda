// diffusers model folders (docs/stable_diffusion.md): one component folder of a diffusers pipeline —
// config.json with its `_class_name` (transformers' text encoders: `architectures`) and the weights
// (diffusion_pytorch_model.safetensors or model.safetensors, single or sharded with an index, fp32 / fp16 /
// bf16) — loaded as the dew family of that class, and run on tensors named as the diffusers forward arguments.
//
//   auto vae = dew::interop::load_diffusers_folder("sd15/vae");                 // AutoencoderKL
//   auto out = dew::interop::diffusers_forward(vae, {{"sample", x}}, "encode");  // latent_mean, latent_logvar
//   auto unet = dew::interop::load_diffusers_folder("sd15/unet");               // UNet2DConditionModel
//   auto eps = dew::interop::diffusers_forward(unet, {{"sample", z}, {"timestep", t},
//                                                     {"encoder_hidden_states", text}})["sample"];
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <torch/nn/module.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "dew/core/options.h"
#include "dew/io/weights.h"

namespace dew {
class AutoencoderImpl;
class BackboneImpl;
}  // namespace dew

namespace dew::interop {

/// The diffusers classes a folder may hold, each with the dew family it loads as: every family of the table
/// (models::family) that names reference classes and methods (AutoencoderKL -> autoencoder_kl,
/// UNet2DConditionModel -> unet_2d_condition).
const std::map<std::string, std::string>& diffusers_classes();

/// The reference class a component's config.json names: diffusers' `_class_name`, else transformers'
/// `architectures[0]` (a text encoder folder: T5EncoderModel, CLIPTextModelWithProjection); "" when neither.
std::string reference_class_of(const json& config);

/// How to load a folder.
struct DiffusersLoadOptions {
  /// the reference class; "" = the config's (reference_class_of)
  std::string class_name;
  /// float32, or float64: the whole model in float64 (parameters loaded straight into float64)
  at::ScalarType dtype = at::kFloat;
  /// bfloat16 / float16: the matrix weights built and held in that dtype from the start, vectors and buffers in
  /// float32 (nn::build_weights_in: nn::hold_weights_in's layout without a float32 copy of the model); with
  /// dtype float32 only
  at::ScalarType weights_dtype = at::kFloat;
  c10::Device device = c10::Device(c10::kCPU);
};

/// A loaded component folder.
struct DiffusersModel {
  std::string folder;                         // the folder as given
  std::string class_name;                     // e.g. "AutoencoderKL"
  std::string family;                         // e.g. "autoencoder_kl"
  json fields;                                // the family's fields, from config.json
  std::shared_ptr<torch::nn::Module> module;  // in eval mode, on the device, in the dtype asked for
  io::LoadReport report;
  at::ScalarType dtype = at::kFloat;
  c10::Device device = c10::Device(c10::kCPU);
  /// The module as a denoiser (unet_2d_condition, ...) or as an autoencoder; dew::Error when it is not one.
  std::shared_ptr<BackboneImpl> backbone() const;
  std::shared_ptr<AutoencoderImpl> autoencoder() const;
};

/// Loads `folder`: config.json -> the family's fields (models::fields_from_reference_config) -> the model ->
/// its weights through the family's key map (models::load_reference_weights; no missing or unexpected
/// tensor). A missing config.json or weights file, an unknown class (the accepted ones listed) or a tensor of
/// the wrong shape is a dew::Error naming the file.
DiffusersModel load_diffusers_folder(const std::string& folder, const DiffusersLoadOptions& options = {});

/// What load_diffusers_folder builds, from config.json alone (no weight read): the class (`class_name` "" = the
/// config's), its family and the family's fields. The same errors.
struct DiffusersModelSpec {
  std::string class_name, family;
  json fields;
};
DiffusersModelSpec diffusers_model_spec(const std::string& folder, const std::string& class_name = "");

/// Whether `path` is a model folder (a config.json, no dew run.json) rather than a dew run or a file.
bool is_model_folder(const std::string& path);

/// The methods of a class ("" is the first: forward for a UNet, encode for a VAE) with the input names each
/// reads and the output names it writes.
struct DiffusersMethod {
  std::string name;
  std::vector<std::string> required, optional, outputs;
};
std::vector<DiffusersMethod> diffusers_methods(const std::string& class_name);

/// Runs `method` of a loaded model on tensors named as diffusers' arguments, as the family's entry
/// (models::Family::reference_methods) maps them onto the dew model: e.g.
///   UNet2DConditionModel forward: sample, timestep (scalar or [B]), encoder_hidden_states; optional
///     encoder_attention_mask, text_embeds, class_labels and time_ids (SDXL's added conditions) -> sample.
///   AutoencoderKL encode: sample -> latent_mean, latent_logvar (logvar clamped to [-30, 20]);
///     decode: z -> sample; forward: sample -> sample (decode of the posterior mean);
///     tiled_decode: z -> sample and tiled_encode: sample -> latent_mean, latent_logvar (diffusers'
///     enable_tiling() with the config's sample_size as the tile).
/// Floating inputs are cast to the model's dtype and device; outputs are on the CPU. A missing or extra input
/// is a dew::Error naming every one of them and what the method takes.
/// `dew forward --help` lists every class with its methods (diffusers_usage()).
std::map<std::string, at::Tensor> diffusers_forward(const DiffusersModel& model,
                                                    const std::map<std::string, at::Tensor>& inputs,
                                                    const std::string& method = "");

/// Every supported class with its family and each method's inputs and outputs, one block per class (for
/// `dew forward --help`).
std::string diffusers_usage();

}  // namespace dew::interop

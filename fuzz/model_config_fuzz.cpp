// libFuzzer target for the config.json translations of the imported families (dew/nn/backbones/reference_configs.cpp:
// what `dew forward`, `dew sample --pipeline`, `init_from` and `dew eval`'s CLIP read from a diffusers or
// transformers folder before anything is built). The input is a config.json, parsed as the loaders parse it
// (io::parse_json: depth-bounded) and handed to every translation: the seven diffusers classes (with their
// "_"-prefixed bookkeeping dropped, as models::fields_from_reference_config does), then read into the family's
// options as its registry builder reads them; the four transformers ones (causal LMs, CLIP text and vision, T5)
// as their loaders call them. Any input must either be refused with a dew::Error or give fields the family's options
// accept, and those options must write back to fields that read back to the same options. A crash, a sanitizer
// report or another exception (nlohmann's own type errors included: they name no field) is a bug.
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "dew/core/error.h"
#include "dew/core/options.h"
#include "dew/io/files.h"
#include "dew/nn/backbones/autoencoder_kl.h"
#include "dew/nn/backbones/causal_transformer.h"
#include "dew/nn/backbones/flux_transformer.h"
#include "dew/nn/backbones/qwen_image1_transformer.h"
#include "dew/nn/backbones/qwen_image_transformer.h"
#include "dew/nn/backbones/qwen_image_vae.h"
#include "dew/nn/backbones/sd3_transformer.h"
#include "dew/nn/backbones/unet_2d_condition.h"
#include "dew/nn/clip_text.h"
#include "dew/nn/clip_vision.h"
#include "dew/nn/t5_encoder.h"
#include "fuzz/fuzz_util.h"

namespace {

using dew::json;

// Options accepted once must survive their own round trip: to_json, then from_json, gives the same fields.
template <class Options>
void require_round_trip(const Options& o) {
  const json fields = dew::to_json(o);
  FUZZ_REQUIRE(dew::to_json(dew::from_json<Options>(fields)) == fields);
}

// A diffusers translation, then the family's options as its registry builder reads the fields.
template <class Options>
void diffusers(const json& config, json (*translate)(const json&)) {
  json fields;
  try {
    fields = translate(config);
  } catch (const dew::Error&) {
    return;  // refused, named
  }
  FUZZ_REQUIRE(fields.is_object());
  try {
    require_round_trip(dew::from_json<Options>(fields));
  } catch (const dew::Error&) {}
}

// A transformers translation, which gives the options themselves.
template <class Options>
void transformers(const json& config, Options (*translate)(const json&)) {
  try {
    require_round_trip(translate(config));
  } catch (const dew::Error&) {}
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  json config;
  try {
    config = dew::io::parse_json(std::string(reinterpret_cast<const char*>(data), size), "config.json");
  } catch (const dew::Error&) {
    return 0;
  }
  // models::fields_from_reference_config: an object, "_class_name", "_diffusers_version", ... dropped.
  if (config.is_object()) {
    json c = json::object();
    for (auto it = config.begin(); it != config.end(); ++it)
      if (it.key().rfind('_', 0) != 0) c[it.key()] = it.value();
    namespace nn = dew::nn;
    diffusers<nn::UNet2DConditionOptions>(c, nn::unet_2d_condition_fields_from_diffusers);
    diffusers<nn::AutoencoderKLOptions>(c, nn::autoencoder_kl_fields_from_diffusers);
    diffusers<nn::QwenImageVaeOptions>(c, nn::qwen_image_vae_fields_from_diffusers);
    diffusers<nn::SD3TransformerOptions>(c, nn::sd3_transformer_fields_from_diffusers);
    diffusers<nn::FluxTransformerOptions>(c, nn::flux_transformer_fields_from_diffusers);
    diffusers<nn::QwenImageTransformerOptions>(c, nn::qwen_image_transformer_fields_from_diffusers);
    diffusers<nn::QwenImage1TransformerOptions>(c, nn::qwen_image1_transformer_fields_from_diffusers);
  }
  transformers(config, dew::nn::options_from_hf_config);
  transformers(config, dew::nn::clip_text_options_from_hf);
  transformers(config, dew::nn::clip_vision_options_from_hf);
  transformers(config, dew::nn::t5_encoder_options_from_hf);
  return 0;
}

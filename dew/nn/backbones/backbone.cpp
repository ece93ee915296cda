#include "dew/nn/backbones/backbone.h"

#include "dew/nn/backbones/causal_transformer.h"
#include "dew/nn/backbones/simple_dit.h"
#include "dew/nn/backbones/unet.h"

namespace dew::models {

Registry<BackboneImpl>& registry() {
  // Built on first use (no static initialisers elsewhere): every entry records the full field set it was
  // built with, defaults included, so run.json rebuilds the same model even if defaults change later.
  static Registry<BackboneImpl>* r = [] {
    auto* r = new Registry<BackboneImpl>("model");
    r->add<nn::SimpleDiTOptions>(
        "simple_dit", "DiT with adaLN-Zero blocks, Fourier time features, RoPE and raster/hilbert/zigzag scans",
        [](const nn::SimpleDiTOptions& o) -> BackbonePtr {
          auto m = nn::SimpleDiT(o).ptr();
          m->set_config({{"architecture", "simple_dit"}, {"fields", to_json(o)}});
          return m;
        });
    r->add<nn::UnetOptions>(
        "unet", "U-Net of GroupNorm residual blocks with time injection and self/cross-attention stages",
        [](const nn::UnetOptions& o) -> BackbonePtr {
          auto m = nn::Unet(o).ptr();
          m->set_config({{"architecture", "unet"}, {"fields", to_json(o)}});
          return m;
        });
    r->add<nn::CausalTransformerOptions>(
        "causal_transformer",
        "decoder-only language model (Llama/Qwen3/Gemma3 features, HF parameter names); forward_tokens(ids)",
        [](const nn::CausalTransformerOptions& o) -> BackbonePtr {
          auto m = nn::CausalTransformer(o).ptr();
          m->set_config({{"architecture", "causal_transformer"}, {"fields", to_json(o)}});
          return m;
        });
    return r;
  }();
  return *r;
}

BackbonePtr build(const std::string& name, const json& fields) {
  DEW_CHECK(fields.is_null() || fields.is_object(), "model \"", name, "\": fields must be an object, got ",
            fields.dump());
  return registry().build(name, fields.is_null() ? json::object() : fields);
}

BackbonePtr build(const json& record) {
  DEW_CHECK(record.is_object() && record.contains("architecture") && record["architecture"].is_string(),
            "model record: expected {\"architecture\": NAME, \"fields\": {...}}, got ", record.dump());
  for (auto it = record.begin(); it != record.end(); ++it)
    DEW_CHECK(it.key() == "architecture" || it.key() == "fields", "model record: unknown key \"", it.key(),
              "\"; valid keys: architecture, fields");
  return build(record["architecture"].get<std::string>(), record.value("fields", json::object()));
}

}  // namespace dew::models

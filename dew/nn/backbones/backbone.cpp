#include "dew/nn/backbones/backbone.h"

#include "dew/nn/backbones/causal_transformer.h"
#include "dew/nn/backbones/hierarchical_mmdit.h"
#include "dew/nn/backbones/hybrid_dit.h"
#include "dew/nn/backbones/mmdit.h"
#include "dew/nn/backbones/simple_dit.h"
#include "dew/nn/backbones/simple_udit.h"
#include "dew/nn/backbones/unet.h"
#include "dew/nn/backbones/unet_3d.h"
#include "dew/nn/backbones/uvit.h"
#include "dew/nn/backbones/video_dit.h"

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
    r->add<nn::VideoDiTOptions>(
        "video_dit", "video DiT [B, C, T, H, W]: factorised spatial then temporal attention per adaLN-Zero block",
        [](const nn::VideoDiTOptions& o) -> BackbonePtr {
          auto m = nn::VideoDiT(o).ptr();
          m->set_config({{"architecture", "video_dit"}, {"fields", to_json(o)}});
          return m;
        });
    r->add<nn::UNet3DOptions>(
        "unet_3d", "the unet per frame plus zero-initialised temporal attention at every level; inflates a unet",
        [](const nn::UNet3DOptions& o) -> BackbonePtr {
          auto m = nn::UNet3D(o).ptr();
          m->set_config({{"architecture", "unet_3d"}, {"fields", to_json(o)}});
          return m;
        });
    r->add<nn::SimpleMMDiTOptions>(
        "simple_mmdit", "SD3-style MM-DiT: image and text streams with their own weights, joint attention (needs text)",
        [](const nn::SimpleMMDiTOptions& o) -> BackbonePtr {
          auto m = nn::SimpleMMDiT(o).ptr();
          m->set_config({{"architecture", "simple_mmdit"}, {"fields", to_json(o)}});
          return m;
        });
    r->add<nn::HierarchicalMMDiTOptions>(
        "hierarchical_mmdit", "U-shaped MM-DiT stages with 2x2 patch merging, expansion and skip fusion (needs text)",
        [](const nn::HierarchicalMMDiTOptions& o) -> BackbonePtr {
          auto m = nn::HierarchicalMMDiT(o).ptr();
          m->set_config({{"architecture", "hierarchical_mmdit"}, {"fields", to_json(o)}});
          return m;
        });
    r->add<nn::SimpleDiTOptions>(
        "simple_udit", "SimpleDiT with U-Net long skips: down blocks, mid block, up blocks fusing [h, skip] by a dense layer",
        [](const nn::SimpleDiTOptions& o) -> BackbonePtr {
          auto m = nn::SimpleUDiT(o).ptr();
          m->set_config({{"architecture", "simple_udit"}, {"fields", to_json(o)}});
          return m;
        });
    r->add<nn::UViTOptions>(
        "uvit", "U-ViT: time, label and text as tokens beside the patches, pre-norm blocks with long skips",
        [](const nn::UViTOptions& o) -> BackbonePtr {
          auto m = nn::UViT(o).ptr();
          m->set_config({{"architecture", "uvit"}, {"fields", to_json(o)}});
          return m;
        });
    r->add<nn::HybridDiTOptions>(
        "hybrid_dit", "HybridSSMAttentionDiT: SimpleDiT whose blocks mix by attention or a bidirectional S5 scan",
        [](const nn::HybridDiTOptions& o) -> BackbonePtr {
          auto m = nn::HybridDiT(o).ptr();
          m->set_config({{"architecture", "hybrid_dit"}, {"fields", to_json(o)}});
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

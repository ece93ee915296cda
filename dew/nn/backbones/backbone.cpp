#include "dew/nn/backbones/backbone.h"

#include <algorithm>

#include "dew/nn/backbones/autoencoder_kl.h"
#include "dew/nn/backbones/causal_transformer.h"
#include "dew/nn/backbones/flux_transformer.h"
#include "dew/nn/backbones/hierarchical_mmdit.h"
#include "dew/nn/backbones/hybrid_dit.h"
#include "dew/nn/backbones/jepa.h"
#include "dew/nn/backbones/mmdit.h"
#include "dew/nn/backbones/qwen_image1_transformer.h"
#include "dew/nn/backbones/qwen_image_transformer.h"
#include "dew/nn/backbones/qwen_image_vae.h"
#include "dew/nn/backbones/sd3_transformer.h"
#include "dew/nn/backbones/simple_dit.h"
#include "dew/nn/backbones/simple_udit.h"
#include "dew/nn/backbones/unet.h"
#include "dew/nn/backbones/unet_2d_condition.h"
#include "dew/nn/backbones/unet_3d.h"
#include "dew/nn/backbones/uvit.h"
#include "dew/nn/backbones/video_dit.h"
#include "dew/nn/text_encoder.h"

namespace dew {

void Conditioning::check_inputs(const std::string& family, bool takes_pooled,
                                const std::vector<std::string>& accepted) const {
  DEW_CHECK(takes_pooled || !pooled.defined(), family, ": takes no pooled text conditioning");
  for (const auto& kv : extra) {
    if (std::find(accepted.begin(), accepted.end(), kv.first) != accepted.end()) continue;
    std::string list;
    for (const auto& a : accepted) list += (list.empty() ? "" : ", ") + a;
    fail(family, ": unknown conditioning input \"", kv.first, "\"; accepted: ", list.empty() ? "none" : list);
  }
}

}  // namespace dew

namespace dew::models {

namespace {

// An integer field of a model against kMaxModelCount / kMaxModelSize (family.h).
void check_model_value(const std::string& model, const std::string& field, const json& v, int depth) {
  if (v.is_array() || v.is_object()) {
    if (depth < 4)
      for (const auto& e : v) check_model_value(model, field, e, depth + 1);
    return;
  }
  if (!v.is_number_integer()) return;
  const bool count = field.find("layers") != std::string::npos || field.find("heads") != std::string::npos ||
                     field.find("blocks") != std::string::npos || field.rfind("num_", 0) == 0;
  const int64_t bound = count ? kMaxModelCount : kMaxModelSize;
  const bool within = v.is_number_unsigned() ? v.get<uint64_t>() <= uint64_t(bound) : v.get<int64_t>() <= bound;
  DEW_CHECK(within, model, ": ", field, " ", v.dump(), " is beyond what any model needs; accepted: at most ", bound,
            count ? " (2^16, the bound of a count of layers, heads or blocks)" : " (2^24, the bound of a model size)");
}

// check_model_value of every field of `fields` (an options struct's to_json).
void check_model_sizes(const std::string& name, const json& fields) {
  for (auto it = fields.begin(); it != fields.end(); ++it)
    check_model_value("model \"" + name + "\"", it.key(), *it, 0);
}

// One family: its registry entry (the module built from its options, recording the full field set, defaults
// included, so run.json rebuilds the same model even if defaults change later) and its tiny configuration.
template <class Options, class Module>
void add_family(Registry<BackboneImpl>& r, const std::string& name, const std::string& doc, Family family) {
  r.add<Options>(name, doc, [name](const Options& o) -> BackbonePtr {
    check_model_sizes(name, to_json(o));
    auto m = Module(o).ptr();
    m->set_config({{"architecture", name}, {"fields", to_json(o)}});
    return m;
  });
  family.build = [&r, name](const json& fields) { return r.build(name, fields); };
  add_family_info(name, std::move(family));
}

template <class Options, class Module>
void add_language_model(Registry<nn::CausalTransformerImpl>& r, const std::string& name, const std::string& doc,
                        Family family,
                        std::function<io::KeyMap(const json&, const io::WeightSource&)> reference_key_map) {
  r.add<Options>(name, doc, [name](const Options& o) {
    check_model_sizes(name, to_json(o));
    return Module(o).ptr();
  });
  family.reference_key_map = std::move(reference_key_map);
  family.build = [&r, name](const json& fields) { return r.build(name, fields); };
  add_family_info(name, std::move(family));
}

// AutoencoderKL's methods as diffusers names them: encode (the posterior's mean and log-variance, clamped
// to [-30, 20] as DiagonalGaussianDistribution does), decode, forward (decode of the posterior mean) and the
// tiled variants of enable_tiling().
std::vector<ReferenceMethod> autoencoder_kl_methods() {
  using Tensors = std::map<std::string, at::Tensor>;
  auto vae_of = [](torch::nn::Module& m, const std::string& where) {
    auto* vae = dynamic_cast<nn::AutoencoderKLImpl*>(&m);
    DEW_CHECK(vae, where, ": the model is not an autoencoder_kl");
    return vae;
  };
  auto floating = [](const Tensors& in, const std::string& name, const std::string& where) {
    const at::Tensor& t = in.at(name);
    DEW_CHECK(at::isFloatingType(t.scalar_type()), where, ": input \"", name, "\" must be floating point");
    return t;
  };
  auto encode = [=](bool tiled) {
    return [=](torch::nn::Module& m, const Tensors& in, const std::string& where) {
      auto* vae = vae_of(m, where);
      const at::Tensor x = floating(in, "sample", where);
      const DiagonalGaussian q = tiled ? vae->tiled_encode(x) : vae->encode(x);
      return Tensors{{"latent_mean", q.mean}, {"latent_logvar", q.logvar}};
    };
  };
  auto decode = [=](bool tiled) {
    return [=](torch::nn::Module& m, const Tensors& in, const std::string& where) {
      auto* vae = vae_of(m, where);
      const at::Tensor z = floating(in, "z", where);
      return Tensors{{"sample", tiled ? vae->tiled_decode(z) : vae->decode(z)}};
    };
  };
  auto reconstruct = [=](torch::nn::Module& m, const Tensors& in, const std::string& where) {
    return Tensors{{"sample", vae_of(m, where)->reconstruct(floating(in, "sample", where))}};
  };
  return {{"encode", {"sample"}, {}, {"latent_mean", "latent_logvar"}, encode(false)},
          {"decode", {"z"}, {}, {"sample"}, decode(false)},
          {"forward", {"sample"}, {}, {"sample"}, reconstruct},
          {"tiled_encode", {"sample"}, {}, {"latent_mean", "latent_logvar"}, encode(true)},
          {"tiled_decode", {"z"}, {}, {"sample"}, decode(true)}};
}

json with(json base, const json& extra) {
  base.update(extra);
  return base;
}

}  // namespace

Registry<BackboneImpl>& registry() {
  // Built on first use (no static initialisers elsewhere). The tiny configurations are a few thousand
  // parameters, milliseconds per step: what the shared family suite (tests/nn/test_all_backbones.cpp) runs.
  static Registry<BackboneImpl>* r = [] {
    auto* r = new Registry<BackboneImpl>("model");
    const json dit = {{"patch_size", 2}, {"emb_features", 32}, {"num_layers", 2},      {"num_heads", 2},
                      {"mlp_ratio", 2},  {"in_channels", 1},   {"output_channels", 1}, {"num_classes", 3}};
    const json unet = {{"emb_features", 16},   {"feature_depths", {8, 16}}, {"attention_configs", {nullptr, 2}},
                       {"num_res_blocks", 1},  {"norm_groups", 4},          {"in_channels", 1},
                       {"output_channels", 1}, {"num_classes", 3}};
    const auto denoiser = Role::kDenoiser;
    // Variants: structural options, other resolutions and channel counts, text; they run in the shared
    // suite's checks of shapes, zero output at initialisation, gradients, remat and the record.
    const json rgb = {{"in_channels", 3}, {"output_channels", 3}};
    const json rgb_to_2 = {{"in_channels", 3}, {"output_channels", 2}};
    const json text6 = {{"context_features", 6}};
    const json text8 = {{"context_features", 8}};
    {
      // The scans reorder the tokens of a non-square grid (4 x 6 patches); text through the pooled path.
      Family f{denoiser, {dit, {2, 1, 8, 8}}};
      for (const char* order : {"hilbert", "zigzag"})
        f.variants.push_back({with(with(dit, rgb), {{"scan_order", order}}), {2, 3, 8, 12}});
      f.variants.push_back({with(with(dit, rgb), text8), {2, 3, 8, 8}, 8});
      add_family<nn::SimpleDiTOptions, nn::SimpleDiT>(
          *r, "simple_dit", "DiT with adaLN-Zero blocks, Fourier time features, RoPE and raster/hilbert/zigzag scans",
          std::move(f));
    }
    {
      Family f{denoiser, {unet, {2, 1, 8, 8}}};
      f.variants.push_back({with(with(unet, rgb_to_2), text8), {2, 3, 8, 8}, 8});  // cross-attention
      add_family<nn::UnetOptions, nn::Unet>(
          *r, "unet", "U-Net of GroupNorm residual blocks with time injection and self/cross-attention stages",
          std::move(f));
    }
    {
      // Two resolutions, two frame counts and a single frame; text with qk_norm.
      Family f{denoiser, {dit, {2, 1, 3, 8, 8}}};
      f.variants.push_back({with(dit, rgb_to_2), {2, 3, 4, 4, 8}});
      f.variants.push_back({with(dit, rgb_to_2), {2, 3, 1, 8, 4}});
      f.variants.push_back({with(with(dit, text8), {{"qk_norm", true}}), {2, 1, 3, 8, 8}, 8});
      add_family<nn::VideoDiTOptions, nn::VideoDiT>(
          *r, "video_dit", "video DiT [B, C, T, H, W]: factorised spatial then temporal attention per adaLN-Zero block",
          std::move(f));
    }
    {
      const json unet3d = with(unet, {{"temporal_heads", 2}});
      Family f{denoiser, {unet3d, {2, 1, 3, 8, 8}}};
      f.variants.push_back({with(unet3d, rgb_to_2), {2, 3, 4, 4, 8}});
      f.variants.push_back({with(unet3d, rgb_to_2), {2, 3, 1, 8, 4}});
      f.variants.push_back({with(unet3d, text8), {2, 1, 3, 8, 8}, 8});
      f.inflates_from = "unet";  // init_from a 2D unet: its names are the spatial blocks'
      f.inflation_map = [] { return nn::unet_3d_inflation_map(); };
      add_family<nn::UNet3DOptions, nn::UNet3D>(
          *r, "unet_3d", "the unet per frame plus zero-initialised temporal attention at every level; inflates a unet",
          std::move(f));
    }
    {
      const json mm = with(dit, text8);
      Family f{denoiser, {mm, {2, 1, 8, 8}, 8}};
      f.variants.push_back({with(with(mm, rgb), {{"scan_order", "hilbert"}}), {2, 3, 16, 24}, 8});
      f.variants.push_back({with(mm, {{"qk_norm", true}}), {2, 1, 8, 8}, 8});
      add_family<nn::SimpleMMDiTOptions, nn::SimpleMMDiT>(
          *r, "simple_mmdit",
          "SD3-style MM-DiT: image and text streams with their own weights, joint attention (needs text)",
          std::move(f));
    }
    {
      const json h = {{"base_patch_size", 2}, {"emb_features", {16, 32}}, {"num_layers", {2, 2}},
                      {"num_heads", {2, 2}},  {"mlp_ratio", 2},           {"in_channels", 1},
                      {"output_channels", 1}, {"num_classes", 3},         {"context_features", 8}};
      Family f{denoiser, {h, {2, 1, 8, 8}, 8}};
      f.variants.push_back({with(h, rgb), {2, 3, 16, 24}, 8});
      add_family<nn::HierarchicalMMDiTOptions, nn::HierarchicalMMDiT>(
          *r, "hierarchical_mmdit",
          "U-shaped MM-DiT stages with 2x2 patch merging, expansion and skip fusion (needs text)", std::move(f));
    }
    {
      Family f{denoiser, {dit, {2, 1, 8, 8}}};
      for (const char* order : {"raster", "hilbert"})
        f.variants.push_back(
            {with(with(with(dit, rgb), text6), {{"num_layers", 4}, {"qk_norm", true}, {"scan_order", order}}),
             {2, 3, 8, 12},
             6});
      add_family<nn::SimpleDiTOptions, nn::SimpleUDiT>(
          *r, "simple_udit",
          "SimpleDiT with U-Net long skips: down blocks, mid block, up blocks fusing [h, skip] by a dense layer",
          std::move(f));
    }
    {
      // Every option one at a time and all together, with text, on a grid smaller than image_size.
      Family f{denoiser, {with(dit, {{"image_size", 8}}), {2, 1, 8, 8}}};
      const json v = with(with(with(dit, rgb_to_2), text6), {{"image_size", 16}, {"num_layers", 4}});
      for (const json& option : {json::object(), json{{"use_projection", true}}, json{{"use_self_and_cross", true}},
                                 json{{"norm_inputs", true}}, json{{"explicitly_add_residual", false}},
                                 json{{"use_projection", true},
                                      {"use_self_and_cross", true},
                                      {"norm_inputs", true},
                                      {"explicitly_add_residual", false},
                                      {"add_residualblock_output", true},
                                      {"activation", "gelu"}}})
        f.variants.push_back({with(v, option), {2, 3, 8, 12}, 6});
      f.variants.push_back({f.variants.back().fields, {2, 3, 8, 8}, 6, false});  // all of them, square
      // The refining convolutions after the zero-initialised final_proj make the output non-zero.
      f.variants.push_back({with(v, {{"add_residualblock_output", true}}), {2, 3, 8, 12}, 6, false});
      f.variants[f.variants.size() - 3].zero_output_at_init = false;  // the combination has it too
      add_family<nn::UViTOptions, nn::UViT>(
          *r, "uvit", "U-ViT: time, label and text as tokens beside the patches, pre-norm blocks with long skips",
          std::move(f));
    }
    {
      // Every scan order with the 2D fusion at two resolutions; S5, fusion and text reached by gradients.
      const json hy = with(dit, {{"ssm_state_dim", 4}, {"num_layers", 4}});
      Family f{denoiser, {hy, {2, 1, 8, 8}}};
      for (const char* order : {"raster", "hilbert", "zigzag"})
        f.variants.push_back({with(with(hy, rgb), {{"scan_order", order}, {"use_2d_fusion", true}}), {2, 3, 12, 12}});
      f.variants.push_back(
          {with(with(hy, rgb_to_2), {{"scan_order", "zigzag"}, {"use_2d_fusion", true}}), {2, 3, 8, 12}});
      f.variants.push_back({with(with(hy, text6), {{"scan_order", "zigzag"},
                                                   {"use_2d_fusion", true},
                                                   {"qk_norm", true},
                                                   {"block_pattern", {"attn", "ssm", "ssm", "ssm"}}}),
                            {2, 1, 8, 8},
                            6});
      add_family<nn::HybridDiTOptions, nn::HybridDiT>(
          *r, "hybrid_dit", "HybridSSMAttentionDiT: SimpleDiT whose blocks mix by attention or a bidirectional S5 scan",
          std::move(f));
    }
    {
      // Imported: built from diffusers' config.json, loading diffusers' names as they are.
      Family f{denoiser,
               {{{"in_channels", 1},
                 {"output_channels", 1},
                 {"blocks_per_level", 1},
                 {"norm_groups", 4},
                 {"context_features", 8},
                 {"num_classes", 3},
                 {"stages",
                  {{{"features", 8}, {"heads", 2}, {"cross_attention", false}},
                   {{"features", 16}, {"heads", 2}, {"depth", 1}}}}},
                {2, 1, 8, 8},
                8,
                /*zero_output_at_init=*/false},
               [](const json& c) { return nn::unet_2d_condition_fields_from_diffusers(c); }};
      f.reference_key_map = [](const json&, const io::WeightSource&) { return io::KeyMap(); };
      f.reference_classes = {"UNet2DConditionModel"};
      DenoiserInputs in;
      in.context_mask = "encoder_attention_mask";
      in.pooled = "text_embeds";
      in.labels = "class_labels";
      in.extra = {"time_ids"};
      f.reference_methods = {denoiser_forward(in)};
      add_family<nn::UNet2DConditionOptions, nn::UNet2DCondition>(
          *r, "unet_2d_condition",
          "diffusers' UNet2DConditionModel (SD 1.x/2.x/SDXL): denoise latents on text, pooled/size and optional "
          "inpaint conditions",
          std::move(f));
    }
    {
      // Imported: diffusers' SD3Transformer2DModel, loading diffusers' names as they are (but for the last
      // block's unused text queries, sd3_transformer_key_map). Variants: SD3.5's dual attention with qk
      // rms_norm, qk layer_norm, a non-square grid cropped from the position table, and no stored table.
      const json sd3 = {{"sample_size", 8},         {"patch_size", 2},       {"in_channels", 1},
                        {"output_channels", 1},     {"num_layers", 2},       {"attention_head_dim", 4},
                        {"num_attention_heads", 2}, {"context_features", 8}, {"pooled_projection_dim", 6},
                        {"pos_embed_max_size", 6},  {"num_classes", 3}};
      // Default PyTorch initialisation as diffusers': nothing is zero-initialised, the output is not zero.
      Family f{denoiser, {sd3, {2, 1, 8, 8}, 8, /*zero_output_at_init=*/false, 6}, [](const json& c) {
                 return nn::sd3_transformer_fields_from_diffusers(c);
               }};
      f.variants.push_back(
          {with(with(sd3, rgb_to_2), {{"num_layers", 3}, {"dual_attention_layers", {0, 1}}, {"qk_norm", "rms_norm"}}),
           {2, 3, 8, 8},
           8,
           false,
           6});
      f.variants.push_back({with(sd3, {{"qk_norm", "layer_norm"}}), {2, 1, 8, 8}, 8, false, 6});
      f.variants.push_back({with(with(sd3, rgb), {{"pos_embed_max_size", 8}}), {2, 3, 8, 12}, 8, false, 6});
      f.variants.push_back({with(sd3, {{"pos_embed_max_size", 0}}), {2, 1, 8, 12}, 8, false, 6});
      f.reference_key_map = [](const json& fields, const io::WeightSource&) {
        return nn::sd3_transformer_key_map(from_json<nn::SD3TransformerOptions>(fields));
      };
      f.reference_classes = {"SD3Transformer2DModel"};
      DenoiserInputs in;
      in.x = "hidden_states";
      in.pooled = "pooled_projections";
      f.reference_methods = {denoiser_forward(in)};
      add_family<nn::SD3TransformerOptions, nn::SD3Transformer>(
          *r, "sd3_transformer",
          "diffusers' SD3Transformer2DModel (SD3 / SD3.5 MM-DiT): denoise latents on text states and a pooled text "
          "vector (needs text)",
          std::move(f));
    }
    {
      // Imported: diffusers' FluxTransformer2DModel from its config.json, its names as they are. The tiny one is
      // schnell-like (no guidance embedding), with the pooled text of the context's width; variants: FLUX.1
      // dev's guidance embedding, and a non-square grid with other channel counts and two blocks of each kind.
      const json flux = {{"in_channels", 1},           {"output_channels", 1},    {"context_features", 8},
                         {"pooled_projection_dim", 8}, {"num_layers", 1},         {"num_single_layers", 1},
                         {"num_attention_heads", 2},   {"attention_head_dim", 8}, {"axes_dims_rope", {2, 2, 4}}};
      Family f{denoiser, {flux, {2, 1, 8, 8}, 8, /*zero_output_at_init=*/false, /*pooled=*/8}, [](const json& c) {
                 return nn::flux_transformer_fields_from_diffusers(c);
               }};
      f.variants.push_back({with(flux, {{"guidance_embeds", true}}), {2, 1, 8, 8}, 8, false, 8, {"guidance"}});
      f.variants.push_back(
          {with(with(flux, rgb_to_2), {{"num_layers", 2}, {"num_single_layers", 2}}), {2, 3, 6, 10}, 8, false, 8});
      f.reference_key_map = [](const json&, const io::WeightSource&) { return io::KeyMap(); };
      f.reference_classes = {"FluxTransformer2DModel"};
      f.reference_methods = {nn::flux_transformer_forward_method()};
      add_family<nn::FluxTransformerOptions, nn::FluxTransformer>(
          *r, "flux_transformer",
          "diffusers' FluxTransformer2DModel (FLUX.1 dev / schnell): packed 2x2 latents, double- and single-stream "
          "blocks, 3-axis RoPE (needs text and pooled text)",
          std::move(f));
    }
    {
      // Imported: diffusers' QwenImage21Transformer2DModel (Qwen-Image 2.1) from its config.json, its names as
      // they are. The tiny one has causal_condition (text modulated from t = 0, the KV cache's premise); variants:
      // without it, and a non-square grid with other channel counts and three blocks.
      const json qwen = {{"in_channels", 4}, {"output_channels", 4},       {"context_features", 8},
                         {"num_layers", 2},  {"num_attention_heads", 2},   {"attention_head_dim", 8},
                         {"mlp_ratio", 2},   {"axes_dims_rope", {2, 2, 4}}};
      Family f{denoiser, {qwen, {2, 4, 4, 6}, 8, /*zero_output_at_init=*/false}, [](const json& c) {
                 return nn::qwen_image_transformer_fields_from_diffusers(c);
               }};
      f.variants.push_back({with(qwen, {{"causal_condition", false}}), {2, 4, 4, 6}, 8, false});
      f.variants.push_back(
          {with(qwen, {{"in_channels", 3}, {"output_channels", 2}, {"num_layers", 3}}), {2, 3, 6, 2}, 8, false});
      f.reference_key_map = [](const json&, const io::WeightSource&) { return io::KeyMap(); };
      f.reference_classes = {"QwenImage21Transformer2DModel"};
      f.reference_methods = nn::qwen_image_transformer_methods();
      add_family<nn::QwenImageTransformerOptions, nn::QwenImageTransformer>(
          *r, "qwen_image_transformer",
          "diffusers' QwenImage21Transformer2DModel (Qwen-Image 2.1): one block-causal sequence over text and "
          "latents, shared modulation, 3-axis RoPE, prefix KV cache (needs text)",
          std::move(f));
    }
    {
      // Imported: diffusers' QwenImageTransformer2DModel (Qwen-Image 1) from its config.json, its names as they
      // are. Variant: a non-square grid with an odd number of packed rows (the centred RoPE's uneven halves) and
      // other channel counts, two blocks.
      const json qwen1 = {
          {"in_channels", 1},         {"output_channels", 1},    {"context_features", 8},      {"num_layers", 1},
          {"num_attention_heads", 2}, {"attention_head_dim", 8}, {"axes_dims_rope", {2, 2, 4}}};
      Family f{denoiser, {qwen1, {2, 1, 8, 8}, 8, /*zero_output_at_init=*/false}, [](const json& c) {
                 return nn::qwen_image1_transformer_fields_from_diffusers(c);
               }};
      f.variants.push_back({with(with(qwen1, rgb_to_2), {{"num_layers", 2}}), {2, 3, 6, 10}, 8, false});
      f.reference_key_map = [](const json& fields, const io::WeightSource&) {
        return nn::qwen_image1_transformer_key_map(from_json<nn::QwenImage1TransformerOptions>(fields));
      };
      f.reference_classes = {"QwenImageTransformer2DModel"};
      f.reference_methods = {nn::qwen_image1_transformer_forward_method()};
      add_family<nn::QwenImage1TransformerOptions, nn::QwenImage1Transformer>(
          *r, "qwen_image1_transformer",
          "diffusers' QwenImageTransformer2DModel (Qwen-Image 1): packed 2x2 latents, dual-stream blocks with "
          "per-stream modulation, centred 3-axis RoPE, masked text (needs text)",
          std::move(f));
    }
    return r;
  }();
  return *r;
}

Registry<nn::CausalTransformerImpl>& language_models() {
  static auto* r = [] {
    auto* r = new Registry<nn::CausalTransformerImpl>("language_model");
    add_language_model<nn::CausalTransformerOptions, nn::CausalTransformer>(
        *r, "causal_transformer",
        "decoder-only language model (Llama/Qwen3/Gemma3 features, HF parameter names); forward_tokens(ids)",
        {Role::kLanguageModel,
         {{{"vocab_size", 64},
           {"emb_features", 32},
           {"num_layers", 2},
           {"num_heads", 4},
           {"num_kv_heads", 2},
           {"max_seq_len", 32}},
          {2, 12}},
         [](const json& c) { return to_json(nn::options_from_hf_config(c)); }},
        [](const json& fields, const io::WeightSource&) {
          return nn::hf_decoder_key_map(from_json<nn::CausalTransformerOptions>(fields));
        });
    return r;
  }();
  return *r;
}

nn::CausalTransformer build_language_model(const json& record) {
  DEW_CHECK(record.is_object() && record.contains("architecture") && record["architecture"].is_string(),
            "model record: expected {\"architecture\": NAME, \"fields\": {...}}, got ", record.dump());
  const json fields = record.value("fields", json::object());
  return nn::CausalTransformer(
      language_models().build(record["architecture"].get<std::string>(), fields.is_null() ? json::object() : fields));
}

namespace {

template <class Base, class Options, class Module>
void add_token_family(Registry<Base>& r, const std::string& name, const std::string& doc, Family family) {
  r.template add<Options>(name, doc, [name](const Options& o) -> std::shared_ptr<Base> {
    check_model_sizes(name, to_json(o));
    auto m = Module(o).ptr();
    m->set_config({{"architecture", name}, {"fields", to_json(o)}});
    return m;
  });
  family.build = [&r, name](const json& fields) { return r.build(name, fields); };
  add_family_info(name, std::move(family));
}

template <class Base>
std::shared_ptr<Base> build_record(Registry<Base>& r, const json& record) {
  DEW_CHECK(record.is_object() && record.contains("architecture") && record["architecture"].is_string(),
            "model record: expected {\"architecture\": NAME, \"fields\": {...}}, got ", record.dump());
  const json fields = record.value("fields", json::object());
  return r.build(record["architecture"].get<std::string>(), fields.is_null() ? json::object() : fields);
}

}  // namespace

Registry<TokenEncoderImpl>& token_encoders() {
  static auto* r = [] {
    auto* r = new Registry<TokenEncoderImpl>("encoder");
    const json tiny = {{"image_size", 8},    {"patch_size", 2}, {"in_channels", 1},
                       {"emb_features", 16}, {"num_layers", 2}, {"num_heads", 2}};
    add_token_family<TokenEncoderImpl, nn::JepaEncoderOptions, nn::JepaEncoder>(
        *r, "jepa_encoder",
        "I-JEPA ViT encoder: patches + fixed 2D sin-cos positions, pre-norm blocks, final LayerNorm",
        {Role::kTokenEncoder, {tiny, {2, 1, 8, 8}}});
    add_token_family<TokenEncoderImpl, nn::JepaVideoEncoderOptions, nn::JepaEncoder>(
        *r, "jepa_video_encoder", "V-JEPA ViT encoder: tubelets (frames x patch x patch) + fixed 3D sin-cos positions",
        {Role::kTokenEncoder, {with(tiny, {{"frames", 4}, {"emb_features", 32}}), {2, 1, 4, 8, 8}}});
    return r;
  }();
  return *r;
}

Registry<TokenPredictorImpl>& token_predictors() {
  static auto* r = [] {
    auto* r = new Registry<TokenPredictorImpl>("predictor");
    add_token_family<TokenPredictorImpl, nn::JepaPredictorOptions, nn::JepaPredictor>(
        *r, "jepa_predictor",
        "JEPA predictor: context features + mask tokens at the target positions -> target features",
        {Role::kTokenPredictor,
         {{{"image_size", 8},
           {"patch_size", 2},
           {"encoder_features", 16},
           {"emb_features", 8},
           {"num_layers", 2},
           {"num_heads", 2}},
          {2, 2, 5, 3}}});
    return r;
  }();
  return *r;
}

Registry<AutoencoderImpl>& autoencoders() {
  static auto* r = [] {
    auto* r = new Registry<AutoencoderImpl>("autoencoder");
    // Imported: built from diffusers' config.json, loading diffusers' names (and LDM's) through its key map.
    Family kl{Role::kAutoencoder,
              {{{"block_out_channels", {8, 16}},
                {"layers_per_block", 1},
                {"latent_channels", 2},
                {"norm_groups", 4},
                {"sample_size", 8}},
               {2, 3, 8, 8}},
              [](const json& c) { return nn::autoencoder_kl_fields_from_diffusers(c); }};
    kl.reference_key_map = [](const json& fields, const io::WeightSource& source) {
      return nn::autoencoder_kl_key_map(from_json<nn::AutoencoderKLOptions>(fields), source);
    };
    kl.reference_classes = {"AutoencoderKL"};
    kl.reference_methods = autoencoder_kl_methods();
    add_token_family<AutoencoderImpl, nn::AutoencoderKLOptions, nn::AutoencoderKL>(
        *r, "autoencoder_kl",
        "diffusers' AutoencoderKL (the SD / SDXL / SD3 / Flux VAE): encode to a diagonal Gaussian, decode, tiled "
        "decode",
        std::move(kl));
    // Imported: diffusers' AutoencoderKLQwenImage21 (Qwen-Image 2.1's VAE) from its config.json, its names as they
    // are. The tiny one has a temporal level and a spatial-only one, so both shortcut layouts run.
    Family qwen{Role::kAutoencoder,
                {{{"base_dim", 4},
                  {"decoder_base_dim", 6},
                  {"z_dim", 2},
                  {"dim_mult", {1, 2, 2}},
                  {"num_res_blocks", 1},
                  {"temperal_downsample", {true, false}},
                  {"latents_mean", {0.5, -1.0}},
                  {"latents_std", {2.0, 0.5}}},
                 {2, 4, 8, 8}},
                [](const json& c) { return nn::qwen_image_vae_fields_from_diffusers(c); }};
    qwen.reference_key_map = [](const json&, const io::WeightSource&) { return io::KeyMap(); };
    qwen.reference_classes = {"AutoencoderKLQwenImage21"};
    qwen.reference_methods = nn::qwen_image_vae_methods();
    add_token_family<AutoencoderImpl, nn::QwenImageVaeOptions, nn::QwenImageVae>(
        *r, "autoencoder_kl_qwen_image",
        "diffusers' AutoencoderKLQwenImage21 (the Qwen-Image 2.1 VAE): RMS-normed residual levels with "
        "pixel-folding shortcuts, 16x, per-channel latent statistics",
        std::move(qwen));
    return r;
  }();
  return *r;
}

std::shared_ptr<AutoencoderImpl> build_autoencoder(const json& record) { return build_record(autoencoders(), record); }

std::shared_ptr<TokenEncoderImpl> build_token_encoder(const json& record) {
  return build_record(token_encoders(), record);
}
std::shared_ptr<TokenPredictorImpl> build_token_predictor(const json& record) {
  return build_record(token_predictors(), record);
}

namespace {

// Every registry records its families when it is first built.
void fill_registries() {
  registry();
  language_models();
  token_encoders();
  token_predictors();
  autoencoders();
  text_encoders::registry();
}

}  // namespace

const Family& family(const std::string& name) {
  fill_registries();
  const Family* f = find_family_info(name);
  DEW_CHECK(f, "model \"", name, "\": not a registered family");
  return *f;
}

std::vector<std::string> family_names() {
  fill_registries();
  return recorded_family_names();
}

std::shared_ptr<torch::nn::Module> build_module(const std::string& name, const json& fields) {
  const Family& f = family(name);
  DEW_CHECK(f.build, "model \"", name, "\": the family records no builder");
  DEW_CHECK(fields.is_null() || fields.is_object(), "model \"", name, "\": fields must be an object, got ",
            fields.dump());
  return f.build(fields.is_null() ? json::object() : fields);
}

ReferenceMethod denoiser_forward(const DenoiserInputs& in) {
  ReferenceMethod m;
  m.name = "forward";
  m.required = {in.x, in.time};
  if (!in.context.empty()) (in.context_required ? m.required : m.optional).push_back(in.context);
  for (const std::string* o : {&in.context_mask, &in.pooled, &in.labels})
    if (!o->empty()) m.optional.push_back(*o);
  for (const auto& e : in.extra) m.optional.push_back(e);
  m.outputs = {in.output};
  m.run = [in](torch::nn::Module& module, const std::map<std::string, at::Tensor>& inputs, const std::string& where) {
    auto* model = dynamic_cast<BackboneImpl*>(&module);
    DEW_CHECK(model, where, ": the model is not a denoiser");
    auto get = [&](const std::string& name) {
      const auto it = name.empty() ? inputs.end() : inputs.find(name);
      return it == inputs.end() ? at::Tensor() : it->second;
    };
    auto floating = [&](const std::string& name) {
      const at::Tensor t = get(name);
      DEW_CHECK(!t.defined() || at::isFloatingType(t.scalar_type()), where, ": input \"", name,
                "\" must be floating point");
      return t;
    };
    const at::Tensor x = floating(in.x);
    DEW_CHECK(x.dim() >= 1, where, ": ", in.x, " must be [B, C, H, W], got ", x.sizes());
    at::Tensor t = get(in.time);
    DEW_CHECK(t.dim() == 0 || (t.dim() == 1 && (t.size(0) == x.size(0) || t.size(0) == 1)), where, ": ", in.time,
              " must be a scalar or [", x.size(0), "], got ", t.sizes());
    t = t.to(x.scalar_type()).reshape({-1}).expand({x.size(0)}).contiguous();  // a scalar for every row
    Conditioning cond;
    cond.context = floating(in.context);
    if (get(in.context_mask).defined()) cond.context_mask = get(in.context_mask).to(at::kBool);
    cond.pooled = floating(in.pooled);
    if (get(in.labels).defined()) cond.labels = get(in.labels).to(at::kLong);
    for (const auto& e : in.extra)
      if (get(e).defined()) cond.extra[e] = floating(e);
    return std::map<std::string, at::Tensor>{{in.output, model->forward(x, t, cond)}};
  };
  return m;
}

json fields_from_reference_config(const std::string& name, const json& config) {
  const Family& f = family(name);
  DEW_CHECK(f.from_reference_config, "model \"", name,
            "\": a dew family, built from its own fields (no reference config.json)");
  DEW_CHECK(config.is_object(), "model \"", name, "\": config.json must be an object, got ", config.dump());
  json c = json::object();
  for (auto it = config.begin(); it != config.end(); ++it)
    if (it.key().rfind('_', 0) != 0) c[it.key()] = it.value();
  return f.from_reference_config(c);
}

io::LoadReport load_reference_weights(torch::nn::Module& module, const std::string& name, const json& fields,
                                      const std::string& path) {
  const Family& f = family(name);
  DEW_CHECK(f.reference_key_map, "model \"", name, "\": a dew family, with no reference checkpoint layout");
  const auto source = io::WeightSource::open(path);
  io::LoadOptions o;
  o.require_buffers = false;
  return io::load_weights(module, source, f.reference_key_map(fields, source), o);
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

// The config.json translations of the imported families (the family table's "reference class and config
// translation", dew/nn/backbones/backbone.cpp): a diffusers or transformers config.json -> the family's fields or
// options, each declared in its family's header. They are kept apart from the modules so that the fuzz target
// fuzz/model_config_fuzz.cpp links them and options.cpp alone, not the model layer. A setting dew does not build is
// refused by name (dew::Error), never ignored.
#include <algorithm>
#include <cmath>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "dew/core/error.h"
#include "dew/core/options.h"
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
#include "dew/nn/family.h"
#include "dew/nn/t5_encoder.h"

namespace dew::nn {

namespace {

// Refuses every key of `c` outside `known`, naming it and the accepted keys.
void check_known(const json& c, const std::set<std::string>& known, const std::string& where) {
  for (auto it = c.begin(); it != c.end(); ++it) {
    if (known.count(it.key())) continue;
    std::string list;
    for (const auto& k : known) list += (list.empty() ? "" : ", ") + k;
    fail(where, "unknown setting \"", it.key(), "\" = ", it.value().dump(), " (accepted keys: ", list, ")");
  }
}

// c[key], or `fallback` when the key is absent or null (diffusers and transformers write null for "the default");
// its type is checked where the fields are read into options.
json value_or(const json& c, const char* key, const json& fallback) {
  const auto it = c.find(key);
  return it == c.end() || it->is_null() ? fallback : *it;
}

// c[key] read as T, or `fallback` when absent or null; a value of another type is refused naming `where` and key.
template <class T>
T field(const json& c, const char* key, T fallback, const std::string& where) {
  const auto it = c.find(key);
  if (it == c.end() || it->is_null()) return fallback;
  T out{};
  options_detail::from_value(*it, out, where + key);
  return out;
}

// A config value that diffusers allows as one value or one per level, as one per level.
template <class T>
std::vector<T> per_level(const json& c, const char* key, size_t levels, T fallback, const std::string& where) {
  const auto it = c.find(key);
  if (it == c.end() || it->is_null()) return std::vector<T>(levels, fallback);
  const json& v = *it;
  if (!v.is_array()) return std::vector<T>(levels, field<T>(c, key, fallback, where));
  DEW_CHECK(v.size() == levels, where, key, " needs one value per level (", levels, "), got ", v.dump());
  std::vector<T> out;
  for (size_t i = 0; i < levels; ++i) {
    DEW_CHECK(!v[i].is_array(), where, key, " as nested lists (asymmetric UNets) is not supported");
    T e{};
    options_detail::from_value(v[i], e, where + key + "[" + std::to_string(i) + "]");
    out.push_back(e);
  }
  return out;
}

}  // namespace

// ---- diffusers: UNet2DConditionModel ----

json unet_2d_condition_fields_from_diffusers(const json& c) {
  const std::string w = "UNet2DConditionModel config: ";
  // Keys whose value must be the default to be supported, with that default.
  const std::vector<std::pair<std::string, json>> fixed = {{"center_input_sample", false},
                                                           {"time_embedding_type", "positional"},
                                                           {"class_embed_type", nullptr},
                                                           {"encoder_hid_dim", nullptr},
                                                           {"encoder_hid_dim_type", nullptr},
                                                           {"resnet_time_scale_shift", "default"},
                                                           {"resnet_skip_time_act", false},
                                                           {"resnet_out_scale_factor", 1.0},
                                                           {"conv_in_kernel", 3},
                                                           {"conv_out_kernel", 3},
                                                           {"time_embedding_dim", nullptr},
                                                           {"time_embedding_act_fn", nullptr},
                                                           {"timestep_post_act", nullptr},
                                                           {"time_cond_proj_dim", nullptr},
                                                           {"dual_cross_attention", false},
                                                           {"class_embeddings_concat", false},
                                                           {"mid_block_only_cross_attention", nullptr},
                                                           {"cross_attention_norm", nullptr},
                                                           {"attention_type", "default"},
                                                           {"mid_block_scale_factor", 1.0},
                                                           {"downsample_padding", 1},
                                                           {"act_fn", "silu"},
                                                           {"num_attention_heads", nullptr},
                                                           {"reverse_transformer_layers_per_block", nullptr}};
  const std::set<std::string> known = {"in_channels",
                                       "out_channels",
                                       "down_block_types",
                                       "up_block_types",
                                       "mid_block_type",
                                       "block_out_channels",
                                       "layers_per_block",
                                       "cross_attention_dim",
                                       "attention_head_dim",
                                       "transformer_layers_per_block",
                                       "use_linear_projection",
                                       "upcast_attention",
                                       "flip_sin_to_cos",
                                       "freq_shift",
                                       "norm_num_groups",
                                       "norm_eps",
                                       "dropout",
                                       "only_cross_attention",
                                       "num_class_embeds",
                                       "addition_embed_type",
                                       "addition_time_embed_dim",
                                       "projection_class_embeddings_input_dim",
                                       "addition_embed_type_num_heads",
                                       "sample_size"};
  for (auto it = c.begin(); it != c.end(); ++it) {
    const std::string& key = it.key();
    const json& value = it.value();
    auto f = std::find_if(fixed.begin(), fixed.end(), [&](const auto& p) { return p.first == key; });
    if (f != fixed.end()) {
      const bool same =
          value == f->second ||
          (value.is_number() && f->second.is_number() && value.get<double>() == f->second.get<double>()) ||
          (f->first == "mid_block_only_cross_attention" && value == false);
      DEW_CHECK(same, w, key, " = ", value.dump(), " is not supported (accepted: ", f->second.dump(), ")");
      continue;
    }
    check_known(json{{key, value}}, known, w);
  }
  DEW_CHECK(c.contains("down_block_types") && c["down_block_types"].is_array() && c.contains("block_out_channels") &&
                c["block_out_channels"].is_array() && c["down_block_types"].size() == c["block_out_channels"].size(),
            w, "down_block_types and block_out_channels must be lists of one entry per level");
  const auto& downs = c["down_block_types"];
  const size_t L = downs.size();
  std::vector<bool> cross(L);
  for (size_t i = 0; i < L; ++i) {
    DEW_CHECK(downs[i] == "CrossAttnDownBlock2D" || downs[i] == "DownBlock2D", w, "down_block_types[", i,
              "] = ", downs[i].dump(), " is not supported (accepted: CrossAttnDownBlock2D, DownBlock2D)");
    cross[i] = downs[i] == "CrossAttnDownBlock2D";
  }
  if (c.contains("up_block_types")) {
    const auto& ups = c["up_block_types"];
    DEW_CHECK(ups.is_array() && ups.size() == L, w, "up_block_types must have one entry per level (", L, ")");
    for (size_t i = 0; i < L; ++i) {
      const std::string expect = cross[L - 1 - i] ? "CrossAttnUpBlock2D" : "UpBlock2D";
      DEW_CHECK(ups[i] == expect, w, "up_block_types[", i, "] = ", ups[i].dump(),
                " must mirror down_block_types (expected \"", expect, "\")");
    }
  }
  const std::string mid_type = !c.contains("mid_block_type")   ? "UNetMidBlock2DCrossAttn"
                               : c["mid_block_type"].is_null() ? "none"
                                                               : field<std::string>(c, "mid_block_type", "", w);
  DEW_CHECK(mid_type == "UNetMidBlock2DCrossAttn" || mid_type == "UNetMidBlock2D", w, "mid_block_type = \"", mid_type,
            "\" is not supported (accepted: UNetMidBlock2DCrossAttn, UNetMidBlock2D)");
  const auto layers = per_level<int64_t>(c, "layers_per_block", L, 2, w);
  DEW_CHECK(std::all_of(layers.begin(), layers.end(), [&](int64_t v) { return v == layers[0]; }), w,
            "layers_per_block differing per level is not supported, got ", c["layers_per_block"].dump());
  const auto heads = per_level<int64_t>(c, "attention_head_dim", L, 8, w);
  const auto depth = per_level<int64_t>(c, "transformer_layers_per_block", L, 1, w);
  const auto cross_dims = per_level<int64_t>(c, "cross_attention_dim", L, 1280, w);
  DEW_CHECK(std::all_of(cross_dims.begin(), cross_dims.end(), [&](int64_t v) { return v == cross_dims[0]; }), w,
            "cross_attention_dim differing per level is not supported");
  const auto only_cross = per_level<bool>(c, "only_cross_attention", L, false, w);
  json stages = json::array();
  for (size_t i = 0; i < L; ++i)
    stages.push_back({{"features", c["block_out_channels"][i]},
                      {"heads", heads[i]},
                      {"depth", depth[i]},
                      {"cross_attention", bool(cross[i])},
                      {"cross_only", bool(only_cross[i])}});
  json f = {{"in_channels", field<int64_t>(c, "in_channels", 4, w)},
            {"output_channels", field<int64_t>(c, "out_channels", 4, w)},
            {"stages", stages},
            {"blocks_per_level", layers[0]},
            {"context_features", cross_dims[0]},
            {"linear_projection", field<bool>(c, "use_linear_projection", false, w)},
            {"middle_attention", mid_type == "UNetMidBlock2DCrossAttn"},
            {"frequency_shift", field<double>(c, "freq_shift", 0.0, w)},
            {"cosine_first", field<bool>(c, "flip_sin_to_cos", true, w)},
            {"dropout", field<double>(c, "dropout", 0.0, w)},
            {"norm_groups", field<int64_t>(c, "norm_num_groups", 32, w)},
            {"norm_epsilon", field<double>(c, "norm_eps", 1e-5, w)},
            {"upcast_attention", field<bool>(c, "upcast_attention", false, w)}};
  if (!value_or(c, "num_class_embeds", nullptr).is_null()) {
    const int64_t classes = field<int64_t>(c, "num_class_embeds", 0, w);
    DEW_CHECK(classes >= 2, w, "num_class_embeds must be >= 2, got ", classes);
    f["num_classes"] = classes - 1;  // the table's last row serves as dew's null class
  }
  const json& add = c.contains("addition_embed_type") ? c["addition_embed_type"] : json(nullptr);
  if (!add.is_null()) {
    DEW_CHECK(add == "text_time", w, "addition_embed_type = ", add.dump(),
              " is not supported (accepted: \"text_time\")");
    for (const char* key : {"addition_time_embed_dim", "projection_class_embeddings_input_dim"})
      DEW_CHECK(!value_or(c, key, nullptr).is_null(), w, "addition_embed_type \"text_time\" needs ", key);
    f["additional_time_features"] = c["addition_time_embed_dim"];
    f["additional_embedding_features"] = c["projection_class_embeddings_input_dim"];
  }
  return f;
}

// ---- diffusers: AutoencoderKL ----

json autoencoder_kl_fields_from_diffusers(const json& c) {
  const std::string w = "AutoencoderKL config.json";
  static const std::set<std::string> known = {"in_channels",    "out_channels",        "down_block_types",
                                              "up_block_types", "block_out_channels",  "layers_per_block",
                                              "act_fn",         "latent_channels",     "norm_num_groups",
                                              "sample_size",    "scaling_factor",      "shift_factor",
                                              "latents_mean",   "latents_std",         "force_upcast",
                                              "use_quant_conv", "use_post_quant_conv", "mid_block_add_attention"};
  DEW_CHECK(c.is_object(), w, ": expected an object, got ", c.dump());
  check_known(c, known, w + ": ");
  // diffusers' AutoencoderKL defaults for what the file leaves out
  const json channels = value_or(c, "block_out_channels", json::array({64}));
  DEW_CHECK(channels.is_array() && !channels.empty(), w, ": block_out_channels must be a non-empty list, got ",
            channels.dump());
  auto check_types = [&](const char* key, const char* type) {
    const json types = value_or(c, key, json::array({type}));
    DEW_CHECK(types.is_array() && types.size() == channels.size(), w, ": ", key, " needs one entry per level (",
              channels.size(), "), got ", types.dump());
    for (const auto& t : types)
      DEW_CHECK(t == type, w, ": ", key, " entry ", t.dump(), " is not supported (only ", type, ")");
  };
  check_types("down_block_types", "DownEncoderBlock2D");
  check_types("up_block_types", "UpDecoderBlock2D");
  const json act = value_or(c, "act_fn", json("silu"));
  DEW_CHECK(act == "silu" || act == "swish", w, ": act_fn ", act.dump(), " is not supported (only silu)");
  json sample = value_or(c, "sample_size", json(32));
  if (sample.is_array()) {  // diffusers tiles by its first entry
    DEW_CHECK(!sample.empty(), w, ": sample_size must be a number or a non-empty list");
    sample = sample[0];
  }
  json f = {{"in_channels", value_or(c, "in_channels", json(3))},
            {"out_channels", value_or(c, "out_channels", json(3))},
            {"block_out_channels", channels},
            {"layers_per_block", value_or(c, "layers_per_block", json(1))},
            {"latent_channels", value_or(c, "latent_channels", json(4))},
            {"norm_groups", value_or(c, "norm_num_groups", json(32))},
            {"sample_size", sample},
            {"scaling_factor", value_or(c, "scaling_factor", json(0.18215))},
            {"shift_factor", value_or(c, "shift_factor", json(nullptr))},
            {"latents_mean", value_or(c, "latents_mean", json(nullptr))},
            {"latents_std", value_or(c, "latents_std", json(nullptr))},
            {"force_upcast", value_or(c, "force_upcast", json(true))},
            {"use_quant_conv", value_or(c, "use_quant_conv", json(true))},
            {"use_post_quant_conv", value_or(c, "use_post_quant_conv", json(true))},
            {"mid_block_attention", value_or(c, "mid_block_add_attention", json(true))}};
  // diffusers writes force_upcast as a float in some configs (its signature says float)
  if (f["force_upcast"].is_number()) f["force_upcast"] = f["force_upcast"].get<double>() != 0;
  // ... and sample_size as a float (512.0); a whole number within a model's sizes is read as the integer.
  if (f["sample_size"].is_number_float()) {
    const double v = f["sample_size"].get<double>();
    if (v >= 0 && v <= double(models::kMaxModelSize) && v == std::floor(v)) f["sample_size"] = int64_t(v);
  }
  return to_json(from_json<AutoencoderKLOptions>(f, w));
}

// ---- diffusers: AutoencoderKLQwenImage21 ----

namespace {

// diffusers' AutoencoderKLQwenImage21 defaults: the release's latent statistics, per channel of z_dim 64.
const std::vector<double> kLatentsMean = {
    0.5126,  0.7721,  -0.0631, 1.3506,  -0.7855, -2.1025, -0.3458, 1.3722,  1.8873,  -1.7177, -0.651,  0.2732,  0.7562,
    -0.6163, -1.0277, 3.8363,  2.021,   0.0472,  0.932,   2.0087,  2.4954,  -0.1391, -1.4249, 1.8464,  -0.5236, 1.2826,
    3.7046,  -1.3035, 2.7286,  -1.4518, -1.9036, -1.9955, -0.0342, -1.0265, -0.7636, 3.0555,  0.0746,  -3.0751, -0.1076,
    1.7376,  -1.0914, -1.9435, -0.2784, -1.368,  0.4809,  -0.4433, 0.3764,  0.5729,  -2.0595, 1.096,   -1.326,  -2.0211,
    -5.0179, 0.5275,  4.0162,  1.8505,  0.3026,  1.9373,  1.4937,  0.2632,  0.5547,  -1.7121, -0.1562, 0.0304};
const std::vector<double> kLatentsStd = {
    3.2001, 3.2936, 3.4321, 3.0091, 3.1061, 4.0379, 4.0705, 3.791,  3.0785, 3.65,   3.9308, 3.0904, 2.8778,
    3.7675, 3.732,  5.0756, 3.2864, 4.0397, 3.1317, 4.0443, 2.9249, 3.9454, 3.0988, 4.2489, 3.4896, 3.8513,
    3.9323, 3.4719, 3.7498, 4.283,  3.5694, 4.2467, 3.9037, 3.2947, 5.077,  3.5075, 3.27,   3.4767, 2.8063,
    5.1125, 3.5327, 4.7833, 3.1286, 4.1819, 3.8527, 3.8312, 3.5605, 4.3875, 3.9624, 4.0168, 3.5643, 4.055,
    5.5614, 4.2963, 4.408,  3.4959, 3.8747, 3.7608, 3.5735, 3.149,  3.7662, 3.6746, 3.4563, 3.8161};

}  // namespace

json qwen_image_vae_fields_from_diffusers(const json& c) {
  const std::string w = "AutoencoderKLQwenImage21 config: ";
  const std::set<std::string> known = {"base_dim",
                                       "decoder_base_dim",
                                       "z_dim",
                                       "dim_mult",
                                       "num_res_blocks",
                                       "attn_scales",
                                       "temperal_downsample",
                                       "dropout",
                                       "latents_mean",
                                       "latents_std",
                                       "is_residual",
                                       "in_channels",
                                       "out_channels",
                                       "patch_size",
                                       "scale_factor_temporal",
                                       "scale_factor_spatial"};
  check_known(c, known, w);
  DEW_CHECK(value_or(c, "is_residual", true) == true, w, "is_residual = ", value_or(c, "is_residual", true).dump(),
            " is not supported (accepted: true, the layout of Qwen-Image 2.1's VAE)");
  const json patch = value_or(c, "patch_size", 1);
  DEW_CHECK(patch == 1, w, "patch_size = ", patch.dump(),
            " is not supported (accepted: null or 1; Qwen-Image 2.1's VAE does not patchify)");
  DEW_CHECK(value_or(c, "attn_scales", json::array()).is_array(), w, "attn_scales must be a list, got ",
            c["attn_scales"].dump());
  const json z = value_or(c, "z_dim", 64);
  json fields = {{"in_channels", value_or(c, "in_channels", 4)},
                 {"out_channels", value_or(c, "out_channels", 4)},
                 {"base_dim", value_or(c, "base_dim", 96)},
                 {"decoder_base_dim", value_or(c, "decoder_base_dim", value_or(c, "base_dim", 96))},
                 {"z_dim", z},
                 {"dim_mult", value_or(c, "dim_mult", json::array({1, 2, 4, 8, 8}))},
                 {"num_res_blocks", value_or(c, "num_res_blocks", 2)},
                 {"temperal_downsample", value_or(c, "temperal_downsample", json::array({false, true, true, true}))},
                 {"dropout", value_or(c, "dropout", 0.0)}};
  // diffusers' defaults when the config has none: the release's statistics, 64 channels.
  for (const auto& [key, fallback] : {std::pair<const char*, const std::vector<double>*>{"latents_mean", &kLatentsMean},
                                      {"latents_std", &kLatentsStd}}) {
    if (c.contains(key) && !c[key].is_null()) {
      fields[key] = c[key];
      continue;
    }
    DEW_CHECK(z == 64, w, key, " is absent and z_dim is ", z.dump(),
              ": diffusers' default statistics have 64 values; give the config its own ", key);
    fields[key] = *fallback;
  }
  return fields;
}

// ---- diffusers: SD3Transformer2DModel ----

json sd3_transformer_fields_from_diffusers(const json& c) {
  const std::string w = "SD3Transformer2DModel config: ";
  const std::set<std::string> known = {"sample_size",
                                       "patch_size",
                                       "in_channels",
                                       "num_layers",
                                       "attention_head_dim",
                                       "num_attention_heads",
                                       "joint_attention_dim",
                                       "caption_projection_dim",
                                       "pooled_projection_dim",
                                       "out_channels",
                                       "pos_embed_max_size",
                                       "dual_attention_layers",
                                       "qk_norm"};
  check_known(c, known, w);
  // c[key] as a positive integer within a model's sizes (so that heads x head_dim below cannot overflow), 0 for
  // null where null_ok, or `fallback` (diffusers' default) when absent.
  auto integer = [&](const char* key, int64_t fallback, bool null_ok = false) -> int64_t {
    if (!c.contains(key)) return fallback;
    const json& v = c[key];
    if (null_ok && v.is_null()) return 0;
    DEW_CHECK(v.is_number_integer() && v.get<int64_t>() > 0 && v.get<int64_t>() <= models::kMaxModelSize, w, key, " = ",
              v.dump(), " is not supported (accepted: a positive integer up to 2^24", null_ok ? ", or null" : "", ")");
    return v.get<int64_t>();
  };
  const int64_t heads = integer("num_attention_heads", 18), head_dim = integer("attention_head_dim", 64);
  const int64_t in = integer("in_channels", 16);
  json f = {{"sample_size", integer("sample_size", 128)},
            {"patch_size", integer("patch_size", 2)},
            {"in_channels", in},
            {"num_layers", integer("num_layers", 18)},
            {"attention_head_dim", head_dim},
            {"num_attention_heads", heads},
            {"context_features", integer("joint_attention_dim", 4096)},
            {"pooled_projection_dim", integer("pooled_projection_dim", 2048)},
            {"pos_embed_max_size", integer("pos_embed_max_size", 96, /*null_ok=*/true)}};
  // out_channels null means in_channels, as diffusers reads it.
  f["output_channels"] = c.contains("out_channels") && c["out_channels"].is_null() ? in : integer("out_channels", 16);
  // The text stream has the image stream's width: diffusers' blocks need caption_projection_dim = heads x head_dim.
  const int64_t caption = integer("caption_projection_dim", 1152);
  DEW_CHECK(caption == heads * head_dim, w, "caption_projection_dim = ", caption,
            " is not supported (accepted: num_attention_heads x attention_head_dim = ", heads * head_dim, ")");
  if (c.contains("dual_attention_layers") && !c["dual_attention_layers"].is_null()) {
    const json& d = c["dual_attention_layers"];
    DEW_CHECK(d.is_array() && std::all_of(d.begin(), d.end(), [](const json& e) { return e.is_number_integer(); }), w,
              "dual_attention_layers = ", d.dump(), " is not supported (accepted: a list of block indices)");
    f["dual_attention_layers"] = d;
  }
  if (c.contains("qk_norm") && !c["qk_norm"].is_null()) {
    const json& q = c["qk_norm"];
    DEW_CHECK(q == "rms_norm" || q == "layer_norm", w, "qk_norm = ", q.dump(),
              " is not supported (accepted: null, \"rms_norm\", \"layer_norm\")");
    f["qk_norm"] = q;
  }
  return f;
}

// ---- diffusers: FluxTransformer2DModel ----

json flux_transformer_fields_from_diffusers(const json& c) {
  const std::string w = "FluxTransformer2DModel config: ";
  const std::set<std::string> known = {"patch_size",          "in_channels",         "out_channels",
                                       "num_layers",          "num_single_layers",   "attention_head_dim",
                                       "num_attention_heads", "joint_attention_dim", "pooled_projection_dim",
                                       "guidance_embeds",     "axes_dims_rope"};
  check_known(c, known, w);
  const json patch = value_or(c, "patch_size", 1);
  DEW_CHECK(patch == 1, w, "patch_size = ", patch.dump(),
            " is not supported (accepted: 1; FluxPipeline packs 2 x 2 latent patches itself)");
  const json in = value_or(c, "in_channels", 64);
  DEW_CHECK(in.is_number_integer() && in.get<int64_t>() > 0 && in.get<int64_t>() % 4 == 0, w,
            "in_channels = ", in.dump(), " must be a positive multiple of 4 (the packed 2 x 2 latent channels)");
  const json out = value_or(c, "out_channels", in);
  DEW_CHECK(out.is_number_integer() && out.get<int64_t>() > 0 && out.get<int64_t>() % 4 == 0, w,
            "out_channels = ", out.dump(), " must be a positive multiple of 4 (the packed 2 x 2 latent channels)");
  json f = {{"in_channels", in.get<int64_t>() / 4},
            {"output_channels", out.get<int64_t>() / 4},
            {"context_features", value_or(c, "joint_attention_dim", 4096)},
            {"pooled_projection_dim", value_or(c, "pooled_projection_dim", 768)},
            {"num_layers", value_or(c, "num_layers", 19)},
            {"num_single_layers", value_or(c, "num_single_layers", 38)},
            {"num_attention_heads", value_or(c, "num_attention_heads", 24)},
            {"attention_head_dim", value_or(c, "attention_head_dim", 128)},
            {"guidance_embeds", value_or(c, "guidance_embeds", false)},
            {"axes_dims_rope", value_or(c, "axes_dims_rope", json::array({16, 56, 56}))}};
  return f;
}

// ---- diffusers: QwenImage21Transformer2DModel ----

json qwen_image_transformer_fields_from_diffusers(const json& c) {
  const std::string w = "QwenImage21Transformer2DModel config: ";
  const std::set<std::string> known = {
      "patch_size",     "in_channels", "out_channels",   "num_layers", "attention_head_dim", "num_attention_heads",
      "context_in_dim", "mlp_ratio",   "axes_dims_rope", "eps",        "causal_condition"};
  check_known(c, known, w);
  const json patch = value_or(c, "patch_size", 1);
  DEW_CHECK(patch == 1, w, "patch_size = ", patch.dump(),
            " is not supported (accepted: 1; Qwen-Image 2.1 consumes its latents unpatched)");
  const json in = value_or(c, "in_channels", 64);
  return {{"in_channels", in},
          {"output_channels", value_or(c, "out_channels", in)},
          {"context_features", value_or(c, "context_in_dim", 4096)},
          {"num_layers", value_or(c, "num_layers", 32)},
          {"num_attention_heads", value_or(c, "num_attention_heads", 32)},
          {"attention_head_dim", value_or(c, "attention_head_dim", 128)},
          {"mlp_ratio", value_or(c, "mlp_ratio", 3)},
          {"axes_dims_rope", value_or(c, "axes_dims_rope", json::array({16, 56, 56}))},
          {"eps", value_or(c, "eps", 1e-6)},
          {"causal_condition", value_or(c, "causal_condition", true)}};
}

// ---- diffusers: QwenImageTransformer2DModel ----

namespace {

// The packed 2 x 2 latent patches of each token.
constexpr int64_t kQwen1PatchFeatures = 4;

}  // namespace

json qwen_image1_transformer_fields_from_diffusers(const json& c) {
  const std::string w = "QwenImageTransformer2DModel config: ";
  const std::set<std::string> known = {"patch_size",          "in_channels",           "out_channels",
                                       "num_layers",          "attention_head_dim",    "num_attention_heads",
                                       "joint_attention_dim", "guidance_embeds",       "axes_dims_rope",
                                       "zero_cond_t",         "use_additional_t_cond", "use_layer3d_rope"};
  check_known(c, known, w);
  const json patch = value_or(c, "patch_size", 2);
  DEW_CHECK(patch == 2, w, "patch_size = ", patch.dump(),
            " is not supported (accepted: 2; QwenImagePipeline packs 2 x 2 latent patches)");
  for (const char* flag : {"guidance_embeds", "zero_cond_t", "use_additional_t_cond", "use_layer3d_rope"})
    DEW_CHECK(value_or(c, flag, false) == false, w, flag, " = ", value_or(c, flag, false).dump(),
              " is not supported (accepted: false; the edit-plus and layered variants' options)");
  const json in = value_or(c, "in_channels", 64);
  DEW_CHECK(in.is_number_integer() && in.get<int64_t>() > 0 && in.get<int64_t>() % kQwen1PatchFeatures == 0, w,
            "in_channels = ", in.dump(), " must be 4 x the latent channels (the packed 2 x 2 patches)");
  return {{"in_channels", in.get<int64_t>() / kQwen1PatchFeatures},
          {"output_channels", value_or(c, "out_channels", in.get<int64_t>() / kQwen1PatchFeatures)},
          {"context_features", value_or(c, "joint_attention_dim", 3584)},
          {"num_layers", value_or(c, "num_layers", 60)},
          {"num_attention_heads", value_or(c, "num_attention_heads", 24)},
          {"attention_head_dim", value_or(c, "attention_head_dim", 128)},
          {"axes_dims_rope", value_or(c, "axes_dims_rope", json::array({16, 56, 56}))}};
}

// ---- transformers: Llama, Qwen3, Gemma 3 (causal_transformer) ----

CausalTransformerOptions options_from_hf_config(const json& c) {
  const std::string kHf = "config.json ";
  std::string type = field<std::string>(c, "model_type", "", kHf);
  DEW_CHECK(type == "llama" || type == "qwen3" || type == "gemma3_text" || type == "qwen3_vl_text",
            "import: config.json model_type \"", type,
            "\" is not supported; accepted: llama, qwen3, gemma3_text, qwen3_vl_text (Qwen3-VL's text_config)");
  auto refuse = [&](const std::string& what) { fail("import: ", type, " config.json: ", what, " is not supported"); };
  // Qwen3-VL's language model is Qwen3's decoder with M-RoPE; on text, whose position is the same on its three
  // axes, M-RoPE's interleaved sections give every frequency that position: plain RoPE.
  const bool vl = type == "qwen3_vl_text";
  if (vl) type = "qwen3";
  if (c.contains("rope_scaling") && !c["rope_scaling"].is_null()) refuse("rope_scaling " + c["rope_scaling"].dump());
  // transformers 5 writes rope_parameters ({rope_type, rope_theta}; Gemma 3: one per layer kind) instead of rope_theta.
  std::map<std::string, double> thetas;
  if (c.contains("rope_parameters") && c["rope_parameters"].is_object()) {
    auto theta_of = [&](const json& p, const std::string& where) {
      DEW_CHECK(p.is_object(), "import: config.json ", where, ": expected an object, got ", p.dump());
      for (const auto& [k, v] : p.items()) {
        const bool known =
            k == "rope_type" || k == "rope_theta" || (vl && (k == "mrope_section" || k == "mrope_interleaved"));
        if (!known) refuse(where + "." + k + " " + v.dump());
      }
      const std::string kind = field<std::string>(p, "rope_type", "default", "config.json " + where + ".");
      if (kind != "default") refuse(where + ".rope_type \"" + kind + "\"");
      return field<double>(p, "rope_theta", 0.0, "config.json " + where + ".");
    };
    const json& rp = c["rope_parameters"];
    if (rp.contains("full_attention") || rp.contains("sliding_attention")) {
      for (const auto& [k, v] : rp.items()) thetas[k] = theta_of(v, "rope_parameters." + k);
    } else {
      thetas["full_attention"] = theta_of(rp, "rope_parameters");
    }
  }
  if (field<double>(c, "partial_rotary_factor", 1.0, kHf) != 1.0) refuse("partial_rotary_factor != 1");
  if (field<bool>(c, "mlp_bias", false, kHf)) refuse("mlp_bias = true");
  bool gemma = type == "gemma3_text";
  CausalTransformerOptions o;
  o.vocab_size(field<int64_t>(c, "vocab_size", 0, kHf));
  o.emb_features(field<int64_t>(c, "hidden_size", 0, kHf));
  o.num_layers(field<int64_t>(c, "num_hidden_layers", 0, kHf));
  o.num_heads(field<int64_t>(c, "num_attention_heads", 0, kHf));
  DEW_CHECK(o.vocab_size() > 0 && o.emb_features() > 0 && o.num_layers() > 0 && o.num_heads() > 0,
            "import: config.json needs positive vocab_size, hidden_size, num_hidden_layers and num_attention_heads");
  o.num_kv_heads(field<int64_t>(c, "num_key_value_heads", o.num_heads(), kHf));
  int64_t default_head = type == "qwen3" ? 128 : gemma ? 256 : o.emb_features() / o.num_heads();
  o.head_dim(field<int64_t>(c, "head_dim", default_head, kHf));
  o.mlp_features(field<int64_t>(c, "intermediate_size", 0, kHf));
  o.max_seq_len(field<int64_t>(c, "max_position_embeddings", gemma ? 131072 : type == "qwen3" ? 32768 : 2048, kHf));
  o.rope_theta(field<double>(c, "rope_theta", gemma ? 1e6 : 1e4, kHf));
  if (thetas.count("full_attention") && thetas["full_attention"] > 0) o.rope_theta(thetas["full_attention"]);
  o.norm_eps(field<double>(c, "rms_norm_eps", 1e-6, kHf));
  o.attention_bias(field<bool>(c, "attention_bias", false, kHf));
  o.tie_embeddings(field<bool>(c, "tie_word_embeddings", gemma, kHf));
  o.init_std(field<double>(c, "initializer_range", 0.02, kHf));
  std::string act =
      field<std::string>(c, gemma ? "hidden_activation" : "hidden_act", gemma ? "gelu_pytorch_tanh" : "silu", kHf);
  if (act == "silu") o.mlp("swiglu");
  else if (act == "gelu_pytorch_tanh" || act == "gelu_new") o.mlp("geglu");
  else refuse(str(gemma ? "hidden_activation" : "hidden_act", " \"", act, "\" (accepted: silu, gelu_pytorch_tanh)"));
  if (!gemma) {
    o.qk_norm(type == "qwen3");
    if (field<bool>(c, "use_sliding_window", false, kHf)) refuse("use_sliding_window = true");
    return o;
  }
  o.qk_norm(true).sandwich_norms(true).scale_offset(1.0);
  o.embedding_scale(std::sqrt(static_cast<double>(o.emb_features())));
  int64_t scalar = field<int64_t>(c, "query_pre_attn_scalar", 256, kHf);
  if (scalar != o.head_size()) refuse(str("query_pre_attn_scalar ", scalar, " != head_dim ", o.head_size()));
  if (c.contains("attn_logit_softcapping") && !c["attn_logit_softcapping"].is_null()) refuse("attn_logit_softcapping");
  o.final_logit_softcap(field<double>(c, "final_logit_softcapping", 0.0, kHf));
  o.sliding_window(field<int64_t>(c, "sliding_window", 4096, kHf));
  o.sliding_rope_theta(field<double>(c, "rope_local_base_freq", 1e4, kHf));
  if (thetas.count("sliding_attention") && thetas["sliding_attention"] > 0)
    o.sliding_rope_theta(thetas["sliding_attention"]);
  auto types = field<std::vector<std::string>>(c, "layer_types", std::vector<std::string>(), kHf);
  if (types.empty()) {
    int64_t period = field<int64_t>(c, "sliding_window_pattern", 6, kHf);
    DEW_CHECK(period > 0, "import: config.json sliding_window_pattern must be > 0, got ", period);
    // The layer kinds are listed one per layer: an absurd layer count is refused before the list is built.
    DEW_CHECK(o.num_layers() <= models::kMaxModelCount, "import: config.json num_hidden_layers ", o.num_layers(),
              " is beyond what any model needs; accepted: at most ", models::kMaxModelCount);
    for (int64_t i = 0; i < o.num_layers(); ++i)
      types.push_back((i + 1) % period == 0 ? "full_attention" : "sliding_attention");
  }
  DEW_CHECK(static_cast<int64_t>(types.size()) == o.num_layers(), "import: config.json layer_types has ", types.size(),
            " entries for ", o.num_layers(), " layers");
  o.layer_types(types);
  return o;
}

// ---- transformers: CLIPTextModel, CLIPVisionModel, T5EncoderModel ----

ClipTextOptions clip_text_options_from_hf(const json& config_in) {
  const json& c = config_in.contains("text_config") ? config_in["text_config"] : config_in;
  DEW_CHECK(c.is_object(), "clip_text config.json: expected an object, got ", c.dump());
  const std::string type = field<std::string>(c, "model_type", "clip_text_model", "clip_text config.json: ");
  DEW_CHECK(type == "clip_text_model", "clip_text config.json: model_type \"", type,
            "\" is not a CLIP text model (accepted: clip_text_model, or a CLIPConfig with text_config)");
  json fields = json::object();
  if (c.contains("architectures") && c["architectures"].is_array())
    for (const auto& a : c["architectures"])
      if (a == "CLIPTextModelWithProjection") fields["projection_dim"] = value_or(c, "projection_dim", 512);
  for (const char* k :
       {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "max_position_embeddings", "hidden_act", "layer_norm_eps", "bos_token_id", "eos_token_id", "pad_token_id"})
    if (c.contains(k) && !c[k].is_null()) fields[k] = c[k];
  return from_json<ClipTextOptions>(fields, "clip_text config.json");
}

ClipVisionOptions clip_vision_options_from_hf(const json& config) {
  DEW_CHECK(config.is_object(), "clip_vision config.json: expected an object, got ", config.dump());
  const bool whole = config.contains("text_config") || config.contains("vision_config");
  if (whole)
    DEW_CHECK(config.contains("vision_config") && config["vision_config"].is_object(),
              "clip_vision config.json: a CLIPConfig without \"vision_config\" (a text-only CLIP folder); CLIP score "
              "needs a CLIPModel with both towers");
  const json& c = whole ? config["vision_config"] : config;
  const std::string type = field<std::string>(c, "model_type", "clip_vision_model", "clip_vision config.json: ");
  DEW_CHECK(type == "clip_vision_model", "clip_vision config.json: model_type \"", type,
            "\" is not a CLIP vision model (accepted: clip_vision_model, or a CLIPConfig with vision_config)");
  json fields = json::object();
  if (whole) {
    fields["projection_dim"] = value_or(config, "projection_dim", 512);
  } else if (c.contains("architectures") && c["architectures"].is_array()) {
    for (const auto& a : c["architectures"])
      if (a == "CLIPVisionModelWithProjection") fields["projection_dim"] = value_or(c, "projection_dim", 512);
  }
  for (const char* k : {"hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_channels",
                        "image_size", "patch_size", "hidden_act", "layer_norm_eps"})
    if (c.contains(k) && !c[k].is_null()) fields[k] = c[k];
  return from_json<ClipVisionOptions>(fields, "clip_vision config.json");
}

T5EncoderOptions t5_encoder_options_from_hf(const json& c) {
  DEW_CHECK(c.is_object(), "t5_encoder config.json: expected an object, got ", c.dump());
  const std::string type = field<std::string>(c, "model_type", "t5", "t5_encoder config.json: ");
  DEW_CHECK(type == "t5", "t5_encoder config.json: model_type \"", type,
            "\" is not supported (accepted: t5; umt5 keeps a position bias in every block)");
  DEW_CHECK(!field<bool>(c, "is_decoder", false, "t5_encoder config.json: "),
            "t5_encoder config.json: is_decoder is true, but t5_encoder is T5's ",
            "bidirectional encoder (accepted: false)");
  json fields = json::object();
  for (const char* k :
       {"vocab_size", "d_model", "d_kv", "d_ff", "num_layers", "num_heads", "relative_attention_num_buckets",
        "relative_attention_max_distance", "layer_norm_epsilon", "feed_forward_proj", "pad_token_id", "eos_token_id"})
    if (c.contains(k) && !c[k].is_null()) fields[k] = c[k];
  // A list of eos ids (some generation configs) cannot be appended by tokenize(): the first one is.
  if (fields.contains("eos_token_id") && fields["eos_token_id"].is_array() && !fields["eos_token_id"].empty())
    fields["eos_token_id"] = fields["eos_token_id"][0];
  return from_json<T5EncoderOptions>(fields, "t5_encoder config.json");
}

}  // namespace dew::nn

#include "dew/bench/cases.h"

#include <algorithm>

#include "dew/core/rng.h"
#include "dew/metrics/inception.h"
#include "dew/nn/backbones/backbone.h"
#include "dew/nn/backbones/causal_transformer.h"
#include "dew/nn/roles.h"
#include "dew/runs/jepa_run.h"

namespace dew::bench {

namespace {

// A case beyond the diffusion table: the table's fields, then its kind.
BenchCase case_of_kind(BenchCase c, CaseKind kind) {
  c.kind = kind;
  return c;
}

const char* kPostTrainingSize =
    "byte vocab 257, width 128, 4 layers, 4 heads of 32, SwiGLU 384, qk-norm, tied head, context 64";

// An SD case's size column: "key value" of the config entries that shape the work.
std::string sd_case_size(const std::string& inputs, const json& config, const std::vector<std::string>& keys) {
  std::string s = inputs;
  for (const auto& k : keys) s += ", " + k + " " + config.at(k).dump();
  return s;
}

// A flow transformer's case: its config's family fields, latents kFlowChannels x side^2, kFlowContextLen text
// tokens (of joint_attention_dim, or Qwen-Image's context_in_dim), the pooled text where the model takes one.
BenchCase flow_case(const std::string& name, const std::string& arch, const json& config,
                    const std::vector<std::string>& keys, CaseKind kind, int64_t latent = kFlowLatent) {
  const std::string side = std::to_string(latent);
  std::string in = "latents " + std::to_string(kFlowChannels) + "x" + side + "x" + side + ", text " +
                   std::to_string(kFlowContextLen) + " x " + flow_text_width(config).dump();
  if (config.contains("pooled_projection_dim")) in += ", pooled " + config.at("pooled_projection_dim").dump();
  return case_of_kind({name,
                       arch,
                       sd_case_size(in, config, keys),
                       models::fields_from_reference_config(arch, config),
                       {kFlowChannels, latent, latent},
                       kFlowContextLen,
                       true},
                      kind);
}

}  // namespace

const std::vector<BenchCase>& bench_cases() {
  // Fashion-MNIST-shaped inputs (1 x 28 x 28, 10 classes; 32 x 32 where a model needs a power of two,
  // Moving Fashion-MNIST's 8 x 32 x 32 for video); unet is the `dew train diffusion` demo model. The
  // transformers share one size: width 128, 4 layers, 4 heads, patch 4 (49 or 64 tokens per frame).
  static const std::vector<BenchCase> cases = [] {
    const json unet = {
        {"in_channels", 1},           {"output_channels", 1},       {"num_classes", 10},
        {"emb_features", 64},         {"feature_depths", {32, 64}}, {"num_res_blocks", 1},
        {"num_middle_res_blocks", 1}, {"norm_groups", 8},           {"attention_configs", {nullptr, nullptr}}};
    json unet_attn = unet;
    unet_attn["attention_configs"] = {nullptr, 4};
    const json dit = {{"in_channels", 1},    {"output_channels", 1}, {"num_classes", 10}, {"patch_size", 4},
                      {"emb_features", 128}, {"num_layers", 4},      {"num_heads", 4}};
    auto with = [](json base, const json& extra) {
      base.update(extra);
      return base;
    };
    const std::string dit_size = "1x28x28, patch 4 (49 tokens), width 128, 4 layers, 4 heads";
    const std::vector<int64_t> video = {1, 8, 32, 32};
    json unet_3d = unet;
    unet_3d["temporal_heads"] = 4;
    return std::vector<BenchCase>{
        {"simple_dit", "simple_dit", dit_size, dit},
        {"unet", "unet", "1x28x28, depths [32,64], 1 res block, no attention", unet},
        {"unet_attn", "unet", "1x28x28, depths [32,64], 1 res block, 4-head attention at 14x14", unet_attn},
        {"simple_udit", "simple_udit", dit_size + ", skips 2 -> 2", dit, {1, kImage, kImage}, 0, false},
        {"uvit",
         "uvit",
         dit_size + ", time + label tokens, position table for 28 px",
         with(dit, {{"image_size", kImage}}),
         {1, kImage, kImage},
         0,
         false},
        {"simple_mmdit",
         "simple_mmdit",
         dit_size + ", text 16 tokens x 64",
         with(dit, {{"context_features", 64}}),
         {1, kImage, kImage},
         16,
         true},
        {"hierarchical_mmdit",
         "hierarchical_mmdit",
         "1x32x32, base patch 2, widths [64,128,256], layers [2,2,4], heads [2,4,8], text 16 tokens x 64",
         {{"in_channels", 1},
          {"output_channels", 1},
          {"num_classes", 10},
          {"base_patch_size", 2},
          {"emb_features", {64, 128, 256}},
          {"num_layers", {2, 2, 4}},
          {"num_heads", {2, 4, 8}},
          {"context_features", 64}},
         {1, 32, 32},
         16,
         false},
        {"hybrid_dit",
         "hybrid_dit",
         dit_size + ", S5 state 64, 3 SSM : 1 attention, bidirectional",
         with(dit, {{"ssm_state_dim", 64}}),
         {1, kImage, kImage},
         0,
         true},
        {"video_dit", "video_dit", "1x8x32x32, patch 4 (8 x 64 tokens), width 128, 4 layers, 4 heads", dit, video, 0,
         false},
        {"unet_3d", "unet_3d", "1x8x32x32, the unet above per frame + 4-head temporal attention per level", unet_3d,
         video, 0, false},
    };
  }();
  return cases;
}

// The language model: a byte-level causal_transformer (256 bytes + EOS) at a small CPU size; the other
// fields keep their defaults (SwiGLU MLP of width 704, qk-norm, RoPE on the whole head, tied head).
const BenchCase& lm_case() {
  static const BenchCase c =
      case_of_kind({"lm",
                    "causal_transformer",
                    "byte vocab 257, width 256, 4 layers, 4 heads of 64, SwiGLU 704, qk-norm, tied head",
                    {{"vocab_size", 257}, {"emb_features", 256}, {"num_layers", 4}, {"num_heads", 4}}},
                   CaseKind::lm);
  return c;
}

json lm_fields(int64_t seq_len) {
  json f = lm_case().fields;
  f["max_seq_len"] = std::max<int64_t>({2048, seq_len, kLmPrompt + kLmNewTokens});
  return f;
}

// The recipe (runs::default_recipe("jepa")) is completed by runs::build_jepa_models, as `dew train jepa` completes
// it, so the bench and the recipe cannot drift apart. The models built here are dropped; their own generator keeps
// the caller's draws where they were.
const json& jepa_recipe() {
  static const json r = [] {
    json c = runs::default_recipe("jepa");
    auto model = from_json<runs::ModelSpec>(c["model"], "model");
    auto predictor = from_json<runs::ModelSpec>(c["predictor"], "predictor");
    rng::DefaultGeneratorScope scope(0, 0, "bench");
    runs::build_jepa_models(model, predictor, {1, 1, kImage, kImage}, "bench");
    c["model"] = to_json(model);
    c["predictor"] = to_json(predictor);
    return c;
  }();
  return r;
}

const BenchCase& jepa_case() {
  static const BenchCase c = [] {
    const json &e = jepa_recipe()["model"], &f = e["fields"], &p = jepa_recipe()["predictor"]["fields"];
    const int64_t g = kImage / f["patch_size"].get<int64_t>();
    const std::string size = "1x28x28, patch " + f["patch_size"].dump() + " (" + std::to_string(g * g) +
                             " tokens); encoder width " + f["emb_features"].dump() + ", " + f["num_layers"].dump() +
                             " layers, " + f["num_heads"].dump() + " heads; predictor " + p["emb_features"].dump() +
                             ", " + p["num_layers"].dump() + " layers, " + p["num_heads"].dump() + " heads";
    return case_of_kind({"jepa", e["architecture"].get<std::string>(), size, f}, CaseKind::jepa);
  }();
  return c;
}

JEPAObjectiveOptions jepa_objective_options() {
  return from_json<JEPAObjectiveOptions>(jepa_recipe()["objective"], "objective");
}

// post_training_defaults: the byte tokenizer's 257 ids, width 128, 4 layers, 4 heads, context 64; the other fields
// their defaults.
const json& post_training_fields() {
  static const json f = {
      {"vocab_size", 257}, {"emb_features", 128}, {"num_layers", 4}, {"num_heads", 4}, {"max_seq_len", 64}};
  return f;
}

const BenchCase& dpo_case() {
  static const BenchCase c =
      case_of_kind({"dpo", "causal_transformer", kPostTrainingSize, post_training_fields()}, CaseKind::dpo);
  return c;
}

const BenchCase& grpo_rollout_case() {
  static const BenchCase c = case_of_kind(
      {"grpo_rollout", "causal_transformer", kPostTrainingSize, post_training_fields()}, CaseKind::grpo_rollout);
  return c;
}

// Stable Diffusion components, each written once as its diffusers config.json dict: the C++ model is built
// from it (models::fields_from_reference_config, as `dew forward` loads a diffusers folder) and
// bench/sd_peer.py gives the same dict to the diffusers class, so the two cannot drift apart.

// sd_unet: SD 1.x's UNet2DConditionModel layout (conv proj_in / proj_out, attention_head_dim = heads, a
// cross-attention mid-block) at two levels of widths 64 and 128, attention at the first.
const json& sd_unet_config() {
  static const json config = {{"_class_name", "UNet2DConditionModel"},
                              {"sample_size", kSdLatent},
                              {"in_channels", 4},
                              {"out_channels", 4},
                              {"down_block_types", {"CrossAttnDownBlock2D", "DownBlock2D"}},
                              {"up_block_types", {"UpBlock2D", "CrossAttnUpBlock2D"}},
                              {"block_out_channels", {64, 128}},
                              {"layers_per_block", 2},
                              {"norm_num_groups", 32},
                              {"cross_attention_dim", 64},
                              {"attention_head_dim", 8}};
  return config;
}

nn::LoraOptions sd_unet_lora_options() {
  return nn::LoraOptions().rank(4).alpha(4.0).target_modules({"to_k", "to_q", "to_v", "to_out.0"});
}

// sd_vae: AutoencoderKL with SD's 4 latent channels at three levels (images downsampled 4x).
const json& sd_vae_config() {
  static const json config = {{"_class_name", "AutoencoderKL"},
                              {"in_channels", 3},
                              {"out_channels", 3},
                              {"down_block_types", {"DownEncoderBlock2D", "DownEncoderBlock2D", "DownEncoderBlock2D"}},
                              {"up_block_types", {"UpDecoderBlock2D", "UpDecoderBlock2D", "UpDecoderBlock2D"}},
                              {"block_out_channels", {64, 128, 128}},
                              {"layers_per_block", 2},
                              {"latent_channels", 4},
                              {"norm_num_groups", 32},
                              {"sample_size", kSdImage},
                              {"scaling_factor", 0.18215}};
  return config;
}

namespace {
BenchCase sd_unet_like(const std::string& name, CaseKind kind) {
  const json& config = sd_unet_config();
  const std::string in = "latents 4x" + std::to_string(kSdLatent) + "x" + std::to_string(kSdLatent) + ", text " +
                         std::to_string(kSdContextLen) + " x " + config.at("cross_attention_dim").dump();
  return case_of_kind(
      {name,
       "unet_2d_condition",
       sd_case_size(in, config, {"down_block_types", "block_out_channels", "layers_per_block", "attention_head_dim"}),
       models::fields_from_reference_config("unet_2d_condition", config),
       {4, kSdLatent, kSdLatent},
       kSdContextLen,
       true},
      kind);
}
}  // namespace

const BenchCase& sd_unet_case() {
  static const BenchCase c = sd_unet_like("sd_unet", CaseKind::sd_unet);
  return c;
}

// The same model and batch with LoRA adapters on its attention projections (train_text_to_image_lora.py).
const BenchCase& sd_unet_lora_case() {
  static const BenchCase c = sd_unet_like("sd_unet_lora", CaseKind::sd_unet_lora);
  return c;
}

const BenchCase& sd_vae_case() {
  static const BenchCase c = [] {
    const json& config = sd_vae_config();
    const std::string in = "images 3x" + std::to_string(kSdImage) + "x" + std::to_string(kSdImage);
    return case_of_kind({"sd_vae",
                         "autoencoder_kl",
                         sd_case_size(in, config, {"block_out_channels", "layers_per_block", "latent_channels"}),
                         models::fields_from_reference_config("autoencoder_kl", config),
                         {3, kSdImage, kSdImage},
                         0,
                         true},
                        CaseKind::sd_vae);
  }();
  return c;
}

// The flow-matching transformers, each written once as its diffusers config.json dict like the SD components: a
// few M parameters on 16 x 32 x 32 latents (16 x 16 = 256 image tokens), width 4 heads x 32, a 64-wide text
// context and pooled vector. sd3: SD3 (medium)'s layout (no qk norm, no dual attention), 4 joint blocks, the last
// one's text stream pre-only; the position table cropped from 32 x 32. flux: FLUX.1 dev's layout (guidance
// embedding), 2 double-stream and 4 single-stream blocks, RoPE axes 8 + 12 + 12 = the head width.
const json& sd3_config() {
  static const json config = {{"_class_name", "SD3Transformer2DModel"},
                              {"sample_size", kFlowLatent},
                              {"patch_size", 2},
                              {"in_channels", kFlowChannels},
                              {"out_channels", kFlowChannels},
                              {"num_layers", 4},
                              {"attention_head_dim", 32},
                              {"num_attention_heads", 4},
                              {"joint_attention_dim", 64},
                              {"caption_projection_dim", 128},
                              {"pooled_projection_dim", 64},
                              {"pos_embed_max_size", kFlowLatent}};
  return config;
}

// diffusers' in_channels counts the packed 2 x 2 tokens' features: 4 x the latent channels.
const json& flux_config() {
  static const json config = {{"_class_name", "FluxTransformer2DModel"},
                              {"patch_size", 1},
                              {"in_channels", 4 * kFlowChannels},
                              {"num_layers", 2},
                              {"num_single_layers", 4},
                              {"attention_head_dim", 32},
                              {"num_attention_heads", 4},
                              {"joint_attention_dim", 64},
                              {"pooled_projection_dim", 64},
                              {"guidance_embeds", true},
                              {"axes_dims_rope", {8, 12, 12}}};
  return config;
}

// qwen_image: Qwen-Image 2.1's layout (single-stream block-causal blocks, shared modulation, causal_condition)
// at the sd3 / flux size: 4 blocks of 4 heads x 32, SwiGLU 3 x 128, RoPE axes 8 + 12 + 12, a 64-wide text context.
const json& qwen_image_config() {
  static const json config = {{"_class_name", "QwenImage21Transformer2DModel"},
                              {"patch_size", 1},
                              {"in_channels", kFlowChannels},
                              {"out_channels", kFlowChannels},
                              {"num_layers", 4},
                              {"attention_head_dim", 32},
                              {"num_attention_heads", 4},
                              {"context_in_dim", 64},
                              {"mlp_ratio", 3},
                              {"axes_dims_rope", {8, 12, 12}},
                              {"causal_condition", true}};
  return config;
}

const BenchCase& sd3_case() {
  static const BenchCase c =
      flow_case("sd3", "sd3_transformer", sd3_config(),
                {"patch_size", "num_layers", "num_attention_heads", "attention_head_dim"}, CaseKind::sd3);
  return c;
}

const BenchCase& flux_case() {
  static const BenchCase c =
      flow_case("flux", "flux_transformer", flux_config(),
                {"num_layers", "num_single_layers", "num_attention_heads", "attention_head_dim", "guidance_embeds"},
                CaseKind::flux);
  return c;
}

const BenchCase& qwen_image_case() {
  static const BenchCase c = flow_case("qwen_image", "qwen_image_transformer", qwen_image_config(),
                                       {"num_layers", "num_attention_heads", "attention_head_dim", "causal_condition"},
                                       CaseKind::qwen_image, kQwenLatent);
  return c;
}

// `dew train`'s throughput: the default recipe (runs::default_recipe("diffusion"), what `dew train diffusion`
// and scripts/demo run with no flags) with its real data loader; its fields are the recipe's.
const BenchCase& train_case() {
  static const BenchCase c =
      case_of_kind({"train", "unet",
                    "`dew train diffusion`'s default recipe: unet 1x28x28, depths [32,64], 1 res block, flow "
                    "preset, Fashion-MNIST's 60000 training images through the DataLoader",
                    runs::default_recipe("diffusion")["model"]["fields"]},
                   CaseKind::train);
  return c;
}

// Data-parallel `dew train`: the train case's recipe and loader, one rank against several (dew launch, torchrun).
const BenchCase& ddp_case() {
  static const BenchCase c = case_of_kind(
      {"ddp", "unet", train_case().size, runs::default_recipe("diffusion")["model"]["fields"]}, CaseKind::ddp);
  return c;
}

// `dew sample RUN` on the model of the default recipe (the fields the train case trains; completed by runs::prepare
// from the data: 1 channel in and out, 10 classes).
const BenchCase& sample_case() {
  static const BenchCase c =
      case_of_kind({"sample", "unet",
                    "`dew train diffusion`'s default recipe model (unet 1x28x28, depths [32,64], 1 res block, "
                    "flow preset), freshly initialised",
                    runs::default_recipe("diffusion")["model"]["fields"]},
                   CaseKind::sample);
  return c;
}

const BenchCase& fid_case() {
  static const BenchCase c =
      case_of_kind({"fid",
                    "inception_v3",
                    "pytorch-fid's InceptionV3 to pool3 (2048-d), images 3x" + std::to_string(kFidImage) + "x" +
                        std::to_string(kFidImage) + " resized to 299x299",
                    json::object(),
                    {3, kFidImage, kFidImage}},
                   CaseKind::fid);
  return c;
}

bool is_sd(const BenchCase& c) {
  return c.kind == CaseKind::sd_unet || c.kind == CaseKind::sd_unet_lora || c.kind == CaseKind::sd_vae ||
         is_flow_transformer(c);
}

bool is_flow_transformer(const BenchCase& c) {
  return c.kind == CaseKind::sd3 || c.kind == CaseKind::flux || c.kind == CaseKind::qwen_image;
}

json flow_text_width(const json& config) {
  return config.contains("joint_attention_dim") ? config.at("joint_attention_dim") : config.at("context_in_dim");
}

const json& reference_config(const BenchCase& c) {
  switch (c.kind) {
    case CaseKind::sd_unet:
    case CaseKind::sd_unet_lora: return sd_unet_config();
    case CaseKind::sd_vae: return sd_vae_config();
    case CaseKind::sd3: return sd3_config();
    case CaseKind::flux: return flux_config();
    case CaseKind::qwen_image: return qwen_image_config();
    default: fail("bench: case \"", c.name, "\" is not built from a diffusers config.json");
  }
}

const std::vector<const BenchCase*>& other_cases() {
  static const std::vector<const BenchCase*> v = {
      &lm_case(),           &jepa_case(),   &dpo_case(), &grpo_rollout_case(), &sd_unet_case(),
      &sd_unet_lora_case(), &sd_vae_case(), &sd3_case(), &flux_case(),         &qwen_image_case(),
      &train_case(),        &sample_case(), &fid_case()};
  return v;
}

const BenchCase& find_case(const std::string& name) {
  std::string names;
  for (const auto& c : bench_cases()) {
    if (c.name == name) return c;
    names += (names.empty() ? "" : ", ") + c.name;
  }
  for (const BenchCase* c : other_cases()) {
    if (c->name == name) return *c;
    names += ", " + c->name;
  }
  if (ddp_case().name == name) return ddp_case();  // selected by name only: --all leaves it out
  names += ", " + ddp_case().name;
  fail("bench: unknown model \"", name, "\"; accepted: ", names);
}

std::string all_case_names() {
  std::string names;
  for (const auto& c : bench_cases()) names += (names.empty() ? "" : ",") + c.name;
  for (const BenchCase* c : other_cases()) names += "," + c->name;
  return names;
}

std::vector<const BenchCase*> select_cases(const std::string& models) {
  std::vector<const BenchCase*> cases;
  for (const auto& name : split_list(models, "models")) {
    const BenchCase* c = &find_case(name);
    DEW_CHECK(std::find(cases.begin(), cases.end(), c) == cases.end(), "--models: \"", name, "\" is listed twice");
    cases.push_back(c);
  }
  return cases;
}

bool any_of_kind(const std::vector<const BenchCase*>& cases, CaseKind k) {
  return std::any_of(cases.begin(), cases.end(), [k](const BenchCase* c) { return c->kind == k; });
}

std::vector<std::string> split_list(const std::string& s, const std::string& flag) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= s.size()) {
    size_t comma = s.find(',', start);
    if (comma == std::string::npos) comma = s.size();
    std::string item = s.substr(start, comma - start);
    DEW_CHECK(!item.empty(), "--", flag, ": expected a comma-separated list, got \"", s, "\"");
    out.push_back(item);
    start = comma + 1;
  }
  return out;
}

int64_t batch_of(const BenchCase& c, const Sizes& s) {
  switch (c.kind) {
    case CaseKind::lm: return s.batch.value_or(4);
    case CaseKind::sd_unet:
    case CaseKind::sd_unet_lora: return s.batch.value_or(kSdUnetBatch);
    case CaseKind::sd_vae: return s.batch.value_or(kSdVaeBatch);
    case CaseKind::fid: return s.batch.value_or(kFidBatch);
    case CaseKind::sd3:
    case CaseKind::flux:
    case CaseKind::qwen_image: return s.batch.value_or(kFlowBatch);
    case CaseKind::train:
    case CaseKind::ddp:
      return s.batch.value_or(runs::default_recipe("diffusion")["loader"]["batch_size"].get<int64_t>());
    default: return s.batch.value_or(32);
  }
}

int64_t steps_of(const BenchCase& c, const Sizes& s) {
  return s.steps.value_or(c.kind == CaseKind::sample ? kSampleRuns : 20);
}

int64_t warmup_of(const BenchCase& c, const Sizes& s) {
  return s.warmup.value_or(c.kind == CaseKind::sample ? kSampleWarmup : 5);
}

// The trainer's defaults (AdamW, weight decay 0.01 on matrices, global-norm clip 1.0 as every recipe keeps it,
// cosine decay to 0.1 lr); the peers apply the same schedule, clip and finite check.
training::OptimOptions bench_optim(int64_t warmup) {
  training::OptimOptions oo;
  oo.lr = kLr;
  oo.warmup_steps = warmup;
  return oo;
}

// For a count that is a multiple of the class count, cmd_sample's labels: the class list repeated; 1 = unguided
// when the run has no classes.
DiffusionSampleOptions sample_options(const std::vector<int64_t>& shape, int64_t num_classes, int64_t images,
                                      int64_t sample_steps) {
  DiffusionSampleOptions g;
  g.shape = shape;
  g.solver = "euler";
  g.steps = sample_steps;
  g.seed = 0;
  g.count = images;
  g.guidance.scale = num_classes > 0 ? kSampleGuidance : 1.0;
  if (num_classes > 0) g.labels = at::arange(images, at::kLong).remainder(num_classes);
  g.clamp = true;  // a pixel run
  return g;
}

runs::PreparedRun prepare_default_train(const std::string& dir, int64_t threads, int64_t batch,
                                        const c10::Device& device) {
  json recipe = runs::default_recipe("diffusion");
  recipe["run"] = dir;
  recipe["threads"] = threads;
  recipe["device"] = device.str();
  if (batch > 0) recipe["loader"]["batch_size"] = batch;
  return runs::prepare("diffusion", recipe);
}

CaseModel case_model(const BenchCase& c, int64_t seq_len, const json& train_fields) {
  std::shared_ptr<torch::nn::Module> model;
  json config;
  if (c.kind == CaseKind::lm || c.kind == CaseKind::dpo || c.kind == CaseKind::grpo_rollout) {
    auto lm = models::build_language_model(
        {{"architecture", c.arch}, {"fields", c.kind == CaseKind::lm ? lm_fields(seq_len) : c.fields}});
    config = lm->config();
    model = lm.ptr();
  } else if (c.kind == CaseKind::train || c.kind == CaseKind::ddp || c.kind == CaseKind::sample) {
    auto denoiser = models::build(c.arch, train_fields);
    config = denoiser->config();
    model = denoiser;
  } else if (c.kind == CaseKind::fid) {
    auto net = metrics::InceptionV3();
    config = {{"fields", json::object()}};
    model = net.ptr();
  } else if (c.kind == CaseKind::sd_vae) {
    auto vae = models::build_autoencoder({{"architecture", c.arch}, {"fields", c.fields}});
    config = vae->config();
    model = vae;
  } else if (c.kind == CaseKind::jepa) {
    auto enc = models::build_token_encoder(jepa_recipe()["model"]);
    auto pred = models::build_token_predictor(jepa_recipe()["predictor"]);
    model = std::make_shared<torch::nn::Module>();
    model->register_module("encoder", enc);
    model->register_module("predictor", pred);
    config = {{"fields",
               {{"encoder", enc->config()["fields"]},
                {"predictor", pred->config()["fields"]},
                {"masks", jepa_recipe()["objective"]["masks"]}}}};
  } else {
    auto denoiser = models::build(c.arch, c.fields);
    config = denoiser->config();
    if (c.kind == CaseKind::sd_unet_lora) nn::apply_lora(*denoiser, sd_unet_lora_options());  // counted with them
    model = denoiser;
  }
  CaseModel out{config.at("fields"), 0};
  for (const auto& p : model->parameters()) out.params += p.numel();
  return out;
}

}  // namespace dew::bench

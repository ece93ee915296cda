// autoencoder_kl against diffusers' AutoencoderKL (tests/golden/sd/vae, vae_sd3 from tests/golden/sd_reference.py):
// the checkpoint's names exactly, the config.json translation and what it refuses, the old checkpoint layouts.
// Encode, decode and tiled decode against the goldens, in float32 and float64, run in the reference-parity
// suite (tests/nn/test_reference_parity.cpp).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ATen/CPUGeneratorImpl.h>

#include <fstream>
#include <regex>
#include <set>

#include "dew/interop/diffusers_forward.h"
#include "dew/io/safetensors.h"
#include "dew/io/weights.h"
#include "dew/nn/attention.h"
#include "dew/nn/backbones/autoencoder_kl.h"
#include "dew/nn/backbones/backbone.h"
#include "tests/golden_util.h"
#include "tests/test_util.h"

namespace {

using dew::test::sd_golden;

using dew::json;
using dew::test::error_of;

std::shared_ptr<dew::nn::AutoencoderKLImpl> load(const std::string& name, at::ScalarType dtype = at::kFloat) {
  dew::interop::DiffusersLoadOptions o;
  o.dtype = dtype;
  auto m = dew::interop::load_diffusers_folder(sd_golden(name), o);
  EXPECT_EQ(m.family, "autoencoder_kl");
  auto vae = std::dynamic_pointer_cast<dew::nn::AutoencoderKLImpl>(m.module);
  EXPECT_TRUE(vae);
  return vae;
}

class AutoencoderKLGolden : public ::testing::TestWithParam<std::string> {};

TEST_P(AutoencoderKLGolden, ParameterNamesAreTheCheckpointsExactly) {
  const std::string name = GetParam();
  const auto source = dew::io::WeightSource::open(sd_golden(name));
  auto m = dew::interop::load_diffusers_folder(sd_golden(name));
  std::set<std::string> ours, theirs;
  for (const auto& kv : m.module->named_parameters()) ours.insert(kv.key());
  for (const auto& n : source.names()) theirs.insert(n);
  EXPECT_EQ(ours, theirs);
  EXPECT_EQ(m.report.loaded.size(), theirs.size());
  EXPECT_TRUE(m.report.unexpected.empty());
  EXPECT_TRUE(m.report.kept.empty());
  EXPECT_TRUE(m.module->named_buffers().is_empty());
}

TEST_P(AutoencoderKLGolden, TheConfigTranslatesBothWays) {
  const std::string name = GetParam();
  std::ifstream in(sd_golden(name) + "/config.json");
  const json config = json::parse(in);
  const json fields = dew::models::fields_from_reference_config("autoencoder_kl", config);
  const auto options = dew::from_json<dew::nn::AutoencoderKLOptions>(fields);
  EXPECT_EQ(fields["sample_size"], config["sample_size"]);
  EXPECT_EQ(fields["norm_groups"], config["norm_num_groups"]);
  // back to a diffusers config: every key of the file with its value
  const json back = dew::nn::autoencoder_kl_diffusers_config(options);
  for (auto it = config.begin(); it != config.end(); ++it) {
    if (it.key() == "_diffusers_version") continue;
    ASSERT_TRUE(back.contains(it.key())) << it.key();
    EXPECT_EQ(back[it.key()], it.value()) << it.key();
  }
  EXPECT_EQ(dew::models::fields_from_reference_config("autoencoder_kl", back), fields);
}

INSTANTIATE_TEST_SUITE_P(SD, AutoencoderKLGolden, ::testing::Values("vae", "vae_sd3"));

TEST(AutoencoderKL, TheSD3LatentSpaceIsScaledAndShifted) {
  auto vae = load("vae_sd3");
  EXPECT_EQ(vae->quant_conv.is_empty(), true);
  EXPECT_EQ(vae->post_quant_conv.is_empty(), true);
  EXPECT_DOUBLE_EQ(vae->scaling_factor(), 1.5305);
  EXPECT_DOUBLE_EQ(vae->shift_factor(), 0.0609);
  const at::Tensor z = torch::randn({1, 16, 2, 2}, at::kDouble);
  EXPECT_TRUE(vae->to_latent(z).allclose((z - 0.0609) * 1.5305, 1e-15, 1e-15));
  EXPECT_TRUE(vae->from_latent(vae->to_latent(z)).allclose(z, 1e-14, 1e-14));
  // SD's VAE: no shift
  auto sd = load("vae");
  EXPECT_TRUE(sd->to_latent(z.narrow(1, 0, 4)).allclose(z.narrow(1, 0, 4) * 0.18215, 1e-15, 1e-15));
  // per-channel statistics (diffusers' SDXL pipeline): (z - mean) * scaling_factor / std
  auto o = dew::nn::AutoencoderKLOptions()
               .block_out_channels({8})
               .norm_groups(4)
               .latent_channels(2)
               .latents_mean(std::vector<double>{0.5, -1.0})
               .latents_std(std::vector<double>{2.0, 4.0});
  dew::nn::AutoencoderKL stats(o);
  const at::Tensor w = torch::randn({1, 2, 3, 3}, at::kDouble);
  const at::Tensor mean = torch::tensor({0.5, -1.0}, at::kDouble).view({1, 2, 1, 1});
  const at::Tensor std = torch::tensor({2.0, 4.0}, at::kDouble).view({1, 2, 1, 1});
  EXPECT_TRUE(stats->to_latent(w).allclose((w - mean) * 0.18215 / std, 1e-15, 1e-15));
  EXPECT_TRUE(stats->from_latent(stats->to_latent(w)).allclose(w, 1e-14, 1e-14));
  EXPECT_NE(error_of([] {
              dew::nn::AutoencoderKL(dew::nn::AutoencoderKLOptions().latents_mean(std::vector<double>{0, 0, 0, 0}));
            }).find("latents_mean and latents_std go together"),
            std::string::npos);
}

TEST(AutoencoderKL, PosteriorSamplesComeFromTheGeneratorGiven) {
  auto vae = load("vae");
  const auto io = dew::test::golden("sd/vae/io.safetensors");
  torch::NoGradGuard ng;
  const auto q = vae->encode(io.at("sample"));
  auto g1 = at::detail::createCPUGenerator(5), g2 = at::detail::createCPUGenerator(5);
  const at::Tensor a = q.sample(g1), b = q.sample(g2);
  EXPECT_TRUE(a.equal(b));
  const at::Tensor eps = (a - q.mean) / q.std();
  EXPECT_NEAR(eps.mean().item<double>(), 0.0, 0.2);
  EXPECT_NEAR(eps.std().item<double>(), 1.0, 0.2);
  // reconstruct = decode(mean) = diffusers' forward(sample_posterior=False)
  EXPECT_TRUE(vae->reconstruct(io.at("sample")).equal(vae->decode(q.mean)));
}

TEST(AutoencoderKL, ATileAsLargeAsTheInputIsThePlainPath) {
  // One tile, nothing to blend: tiled decoding and encoding are decode() and encode() exactly.
  auto vae = load("vae");
  const auto io = dew::test::golden("sd/vae/io.safetensors");
  torch::NoGradGuard ng;
  EXPECT_TRUE(vae->tiled_decode(io.at("z")).equal(vae->decode(io.at("z"))));  // 8 latents < 16 per tile
  const auto q = vae->encode(io.at("sample")), t = vae->tiled_encode(io.at("sample"));
  EXPECT_TRUE(t.mean.equal(q.mean));
  EXPECT_TRUE(t.logvar.equal(q.logvar));
  // Smaller tiles: the output keeps its size, and blending changes it only near the seams.
  const at::Tensor tiled = vae->tiled_decode(io.at("z"), dew::nn::VaeTileOptions().sample_size(8));
  EXPECT_EQ(tiled.sizes(), vae->decode(io.at("z")).sizes());
  const auto te = vae->tiled_encode(io.at("sample"), dew::nn::VaeTileOptions().sample_size(8));
  EXPECT_EQ(te.mean.sizes(), q.mean.sizes());
  EXPECT_NE(error_of([&] {
              vae->tiled_decode(io.at("z"), dew::nn::VaeTileOptions().sample_size(1));
            }).find("under one latent"),
            std::string::npos);
}

TEST(AutoencoderKL, UnsupportedConfigSettingsAreRefusedByName) {
  std::ifstream in(sd_golden("vae") + "/config.json");
  const json config = json::parse(in);
  auto refusal = [&](const std::string& key, const json& value) {
    json c = config;
    c[key] = value;
    return error_of([&] { dew::models::fields_from_reference_config("autoencoder_kl", c); });
  };
  EXPECT_NE(refusal("norm_type", "spatial").find("unknown setting \"norm_type\""), std::string::npos);
  EXPECT_NE(refusal("act_fn", "gelu").find("act_fn \"gelu\""), std::string::npos);
  EXPECT_NE(refusal("down_block_types", json::array({"DownEncoderBlock2D", "AttnDownEncoderBlock2D"}))
                .find("AttnDownEncoderBlock2D"),
            std::string::npos);
  EXPECT_NE(refusal("up_block_types", json::array({"UpDecoderBlock2D"})).find("one entry per level (2)"),
            std::string::npos);
  EXPECT_NE(refusal("layers_per_block", "two").find("layers_per_block"), std::string::npos);
  // bookkeeping keys are dropped; diffusers' defaults fill what a hand-written config leaves out
  const json minimal = {{"_class_name", "AutoencoderKL"}, {"_name_or_path", "x"}};
  const json fields = dew::models::fields_from_reference_config("autoencoder_kl", minimal);
  EXPECT_EQ(fields["block_out_channels"], json::array({64}));
  EXPECT_EQ(fields["layers_per_block"], 1);
  EXPECT_EQ(fields["sample_size"], 32);
  EXPECT_TRUE(fields["shift_factor"].is_null());
  // a VAE without its mid-block attention has no attentions.0
  json no_attn = config;
  no_attn["mid_block_add_attention"] = false;
  dew::nn::AutoencoderKL m(dew::from_json<dew::nn::AutoencoderKLOptions>(
      dew::models::fields_from_reference_config("autoencoder_kl", no_attn)));
  for (const auto& kv : m->named_parameters()) EXPECT_EQ(kv.key().find("attentions"), std::string::npos) << kv.key();
}

// The golden checkpoint under the original LDM / CompVis names, inside a whole SD checkpoint.
std::map<std::string, at::Tensor> as_ldm_checkpoint(const std::string& folder, int64_t levels) {
  const auto src = dew::io::WeightSource::open(folder);
  std::map<std::string, at::Tensor> out;
  const std::vector<std::pair<std::string, std::string>> rules = {
      {"^encoder\\.down_blocks\\.(\\d+)\\.resnets\\.(\\d+)\\.", "encoder.down.$1.block.$2."},
      {"^encoder\\.down_blocks\\.(\\d+)\\.downsamplers\\.0\\.conv\\.", "encoder.down.$1.downsample.conv."},
      {"\\.mid_block\\.resnets\\.0\\.", ".mid.block_1."},
      {"\\.mid_block\\.resnets\\.1\\.", ".mid.block_2."},
      {"\\.mid_block\\.attentions\\.0\\.group_norm\\.", ".mid.attn_1.norm."},
      {"\\.mid_block\\.attentions\\.0\\.to_q\\.", ".mid.attn_1.q."},
      {"\\.mid_block\\.attentions\\.0\\.to_k\\.", ".mid.attn_1.k."},
      {"\\.mid_block\\.attentions\\.0\\.to_v\\.", ".mid.attn_1.v."},
      {"\\.mid_block\\.attentions\\.0\\.to_out\\.0\\.", ".mid.attn_1.proj_out."},
      {"\\.conv_shortcut\\.", ".nin_shortcut."},
      {"\\.conv_norm_out\\.", ".norm_out."}};
  for (const auto& name : src.names()) {
    std::string n = name;
    for (const auto& [from, to] : rules) n = std::regex_replace(n, std::regex(from), to);
    std::smatch m;
    static const std::regex up("^decoder\\.up_blocks\\.(\\d+)\\.(resnets|upsamplers\\.0)\\.(.*)$");
    if (std::regex_match(n, m, up)) {
      const int64_t i = levels - 1 - std::stoll(m[1]);
      n = "decoder.up." + std::to_string(i) + (m[2] == "resnets" ? ".block." : ".upsample.") + m[3].str();
    }
    at::Tensor t = src.tensor(name).clone();
    if (n.find(".attn_1.") != std::string::npos && n.find(".norm.") == std::string::npos && t.dim() == 2)
      t = t.view({t.size(0), t.size(1), 1, 1});  // LDM's 1x1 convs
    out["first_stage_model." + n] = t;
  }
  out["model.diffusion_model.input_blocks.0.0.weight"] = torch::zeros({2});  // the rest of an SD checkpoint
  out["cond_stage_model.transformer.text_model.embeddings.position_ids"] = torch::zeros({2});
  return out;
}

TEST(AutoencoderKL, OldCheckpointLayoutsLoadThroughTheKeyMap) {
  dew::test::TempDir dir("vae_ldm");
  const std::string folder = sd_golden("vae");
  auto reference = load("vae");
  const json fields =
      dew::models::fields_from_reference_config("autoencoder_kl", json::parse(std::ifstream(folder + "/config.json")));
  // the original LDM layout inside a whole SD checkpoint (first_stage_model.*, 1x1-conv attention weights)
  const auto ldm = as_ldm_checkpoint(folder, 2);
  EXPECT_TRUE(ldm.count("first_stage_model.decoder.up.1.block.0.conv1.weight"));
  EXPECT_TRUE(ldm.count("first_stage_model.encoder.mid.attn_1.q.weight"));
  EXPECT_EQ(ldm.at("first_stage_model.encoder.mid.attn_1.q.weight").dim(), 4);
  dew::io::save_safetensors(dir.file("sd.safetensors"), ldm);
  auto m = dew::models::build_autoencoder({{"architecture", "autoencoder_kl"}, {"fields", fields}});
  const auto report = dew::models::load_reference_weights(*m, "autoencoder_kl", fields, dir.file("sd.safetensors"));
  EXPECT_EQ(report.skipped.size(), 2u);
  auto ref_params = reference->named_parameters();
  for (const auto& kv : m->named_parameters()) EXPECT_TRUE(kv.value().equal(ref_params[kv.key()])) << kv.key();
  // diffusers' deprecated attention names (query, key, value, proj_attn)
  std::map<std::string, at::Tensor> old;
  const auto src = dew::io::WeightSource::open(folder);
  for (const auto& name : src.names()) {
    std::string n = name;
    for (const auto& [from, to] : std::vector<std::pair<std::string, std::string>>{
             {".to_q.", ".query."}, {".to_k.", ".key."}, {".to_v.", ".value."}, {".to_out.0.", ".proj_attn."}}) {
      const auto at = n.find(from);
      if (at != std::string::npos) n.replace(at, from.size(), to);
    }
    old[n] = src.tensor(name).clone();
  }
  EXPECT_TRUE(old.count("encoder.mid_block.attentions.0.proj_attn.weight"));
  dew::io::save_safetensors(dir.file("old.safetensors"), old);
  auto m2 = dew::models::build_autoencoder({{"architecture", "autoencoder_kl"}, {"fields", fields}});
  dew::models::load_reference_weights(*m2, "autoencoder_kl", fields, dir.file("old.safetensors"));
  for (const auto& kv : m2->named_parameters()) EXPECT_TRUE(kv.value().equal(ref_params[kv.key()])) << kv.key();
}

TEST(AutoencoderKL, DtypeAttentionImplAndRematKeepTheTreeAndTheFunction) {
  const json fields = dew::models::fields_from_reference_config(
      "autoencoder_kl", json::parse(std::ifstream(sd_golden("vae") + "/config.json")));
  const auto io = dew::test::golden("sd/vae/io.safetensors");
  auto reference = load("vae");
  torch::NoGradGuard ng;
  const at::Tensor mean = reference->encode(io.at("sample")).mean, x = reference->decode(io.at("z"));
  dew::nn::AttentionChunkRowsScope small_blocks(5);  // 64 positions in the mid-blocks: "chunked" really splits
  for (const json& change : {json{{"attention_impl", "reference"}}, json{{"attention_impl", "chunked"}},
                             json{{"remat", true}}, json{{"dtype", "bfloat16"}}}) {
    SCOPED_TRACE(change.dump());
    json f = fields;
    f.update(change);
    auto m = dew::models::build_autoencoder({{"architecture", "autoencoder_kl"}, {"fields", f}});
    dew::models::load_reference_weights(*m, "autoencoder_kl", f, sd_golden("vae"));
    const double tol = change.contains("dtype") ? 0.1 : 1e-5;  // bf16 compute: 8 mantissa bits
    const at::Tensor mean2 = m->encode(io.at("sample")).mean, x2 = m->decode(io.at("z"));
    EXPECT_EQ(mean2.scalar_type(), at::kFloat);
    EXPECT_LT((mean2 - mean).abs().max().item<double>(), tol * (1 + mean.abs().max().item<double>()));
    EXPECT_LT((x2 - x).abs().max().item<double>(), tol * (1 + x.abs().max().item<double>()));
  }
}

TEST(AutoencoderKL, TheDefaultsAreSDsVAE) {
  dew::nn::AutoencoderKL vae;
  EXPECT_EQ(vae->downsampling(), 8);
  int64_t n = 0;
  for (const auto& p : vae->parameters()) n += p.numel();
  EXPECT_EQ(n, 83653863);  // diffusers' AutoencoderKL of SD 1.5's vae/config.json
  EXPECT_EQ(vae->decoder->up_blocks.size(), 4u);
  EXPECT_EQ(vae->decoder->up_blocks[0]->resnets.size(), 3u);
  EXPECT_TRUE(vae->named_parameters().contains("decoder.up_blocks.3.resnets.2.conv2.weight"));
  EXPECT_FALSE(vae->named_parameters().contains("decoder.up_blocks.3.upsamplers.0.conv.weight"));
  EXPECT_TRUE(vae->named_parameters().contains("encoder.down_blocks.2.downsamplers.0.conv.weight"));
  EXPECT_TRUE(vae->named_parameters().contains("encoder.mid_block.attentions.0.to_out.0.bias"));
}

}  // namespace

// `dew forward DIR --inputs IN --out OUT` on the diffusers golden folders (tests/golden/sd/): the VAE's encode
// and decode written to a file and compared with diffusers' outputs by the golden rule (float32) and against
// its float64 run (--dtype float64); the UNets' forward; transformers' text encoder folders (T5, CLIP-G) found by
// their "architectures"; missing / extra inputs and unknown classes exit 2 with one line naming them.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>

#include "dew/io/safetensors.h"
#include "dew/nn/backbones/backbone.h"
#include "tests/golden_util.h"
#include "tests/test_util.h"

namespace {

using dew::test::sd_golden;

using dew::test::run_dew;

// Writes `inputs` to DIR/in.safetensors, runs `dew forward FOLDER ... FLAGS`, returns the written outputs.
std::map<std::string, at::Tensor> forward(const dew::test::TempDir& dir, const std::string& folder,
                                          const std::map<std::string, at::Tensor>& inputs, const std::string& flags) {
  dew::io::save_safetensors(dir.file("in.safetensors"), inputs);
  const auto r = run_dew("forward " + sd_golden(folder) + " --inputs " + dir.file("in.safetensors") + " --out " +
                         dir.file("out.safetensors") + " " + flags);
  EXPECT_EQ(r.code, 0) << r.output;
  if (r.code != 0) return {};
  EXPECT_NE(r.output.find("wrote"), std::string::npos) << r.output;
  return dew::io::load_safetensors(dir.file("out.safetensors"));
}

TEST(ForwardCli, EncodesAndDecodesAVaeFolderLikeDiffusers) {
  dew::test::TempDir dir("forward_vae");
  for (const std::string name : {"vae", "vae_sd3"}) {
    SCOPED_TRACE(name);
    const auto io = dew::test::golden("sd/" + name + "/io.safetensors");
    std::printf("dew forward %s:\n", name.c_str());
    auto out = forward(dir, name, {{"sample", io.at("sample")}}, "--method encode");
    ASSERT_EQ(out.size(), 2u);
    dew::test::expect_golden(name + " latent_mean", out.at("latent_mean"), io.at("latent_mean_f32"),
                             io.at("latent_mean_f64"));
    dew::test::expect_golden(name + " latent_logvar", out.at("latent_logvar"), io.at("latent_logvar_f32"),
                             io.at("latent_logvar_f64"));
    out = forward(dir, name, {{"z", io.at("z")}}, "--method decode");
    ASSERT_EQ(out.size(), 1u);
    EXPECT_EQ(out.at("sample").scalar_type(), at::kFloat);
    dew::test::expect_golden(name + " decoded", out.at("sample"), io.at("decoded_f32"), io.at("decoded_f64"));
    out = forward(dir, name, {{"z", io.at("z_tiled")}}, "--method tiled_decode");
    dew::test::expect_golden(name + " tiled_decoded", out.at("sample"), io.at("tiled_decoded_f32"),
                             io.at("tiled_decoded_f64"));
    // --dtype float64: the whole model in float64, against diffusers' float64 run (float64 throughout on
    // torch 2: SDPA, no upcast_softmax; measured ~1e-15); the bound is that of the torch 1.13 goldens
    out = forward(dir, name, {{"sample", io.at("sample")}}, "--method encode --dtype float64");
    EXPECT_EQ(out.at("latent_mean").scalar_type(), at::kDouble);
    dew::test::expect_close_f64(name + " latent_mean", out.at("latent_mean"), io.at("latent_mean_f64"), 2e-7);
    dew::test::expect_close_f64(name + " latent_logvar", out.at("latent_logvar"), io.at("latent_logvar_f64"), 2e-7);
    out = forward(dir, name, {{"z", io.at("z")}}, "--method decode --dtype float64");
    dew::test::expect_close_f64(name + " decoded", out.at("sample"), io.at("decoded_f64"), 2e-7);
  }
}

TEST(ForwardCli, RunsTheUNetFoldersOnDiffusersArguments) {
  dew::test::TempDir dir("forward_unet");
  for (const std::string name : {"unet_sd", "unet_sdxl"}) {
    SCOPED_TRACE(name);
    const auto io = dew::test::golden("sd/" + name + "/io.safetensors");
    std::map<std::string, at::Tensor> inputs;
    for (const char* k : {"sample", "timestep", "encoder_hidden_states", "text_embeds", "time_ids"})
      if (io.count(k)) inputs[k] = io.at(k);
    std::printf("dew forward %s:\n", name.c_str());
    auto out = forward(dir, name, inputs, "");
    ASSERT_EQ(out.count("sample"), 1u);
    dew::test::expect_golden(name + " sample", out.at("sample"), io.at("out_f32"), io.at("out_f64"));
    out = forward(dir, name, inputs, "--dtype float64");
    ASSERT_EQ(out.count("sample"), 1u);
    dew::test::expect_close_f64(name + " sample", out.at("sample"), io.at("out_f64"), dew::test::kUnetFloat64Rel);
  }
}

TEST(ForwardCli, RunsTransformersTextEncoderFoldersByTheirArchitectures) {
  // config.json has transformers' "architectures" instead of "_class_name": T5EncoderModel, and CLIP-G as
  // CLIPTextModelWithProjection.
  dew::test::TempDir dir("forward_text_encoders");
  for (const std::string name : {"t5_v1_1", "clip_g"}) {
    SCOPED_TRACE(name);
    const std::string folder = std::string(DEW_SOURCE_DIR) + "/tests/golden/text_encoders/" + name;
    const auto io = dew::io::load_safetensors(folder + "/io.safetensors");
    dew::io::save_safetensors(dir.file("in.safetensors"),
                              {{"input_ids", io.at("input_ids")}, {"attention_mask", io.at("attention_mask")}});
    const auto r = run_dew("forward " + folder + " --inputs " + dir.file("in.safetensors") + " --out " +
                           dir.file("out.safetensors"));
    ASSERT_EQ(r.code, 0) << r.output;
    const auto out = dew::io::load_safetensors(dir.file("out.safetensors"));
    dew::test::expect_golden(name + " last_hidden_state", out.at("last_hidden_state"), io.at("last_hidden_state_f32"),
                             io.at("last_hidden_state_f64"));
    if (name == "clip_g")
      dew::test::expect_golden(name + " text_embeds", out.at("text_embeds"), io.at("text_embeds_f32"),
                               io.at("text_embeds_f64"));
  }
}

TEST(ForwardCli, MissingAndExtraInputsAreOneLineNamingThem) {
  dew::test::TempDir dir("forward_errors");
  const auto io = dew::test::golden("sd/vae/io.safetensors");
  dew::io::save_safetensors(dir.file("in.safetensors"), {{"sample", io.at("sample")}, {"noise", io.at("z")}});
  const std::string base = "forward " + sd_golden("vae") + " --inputs " + dir.file("in.safetensors") + " --out " +
                           dir.file("out.safetensors");
  auto r = run_dew(base + " --method decode");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_EQ(dew::test::count_lines(r.output), 1u) << r.output;
  EXPECT_NE(r.output.find("missing input z"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("unexpected inputs noise, sample"), std::string::npos) << r.output;
  r = run_dew(base + " --method encode");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_EQ(dew::test::count_lines(r.output), 1u) << r.output;
  EXPECT_NE(r.output.find("unexpected input noise"), std::string::npos) << r.output;
  r = run_dew(base + " --method sample");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.output.find("accepted: encode, decode, forward, tiled_encode, tiled_decode"), std::string::npos)
      << r.output;
  r = run_dew(base + " --class StableCascadeUNet");
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(dew::test::count_lines(r.output), 1u) << r.output;
  // Every class of the family table is listed (sorted), transformers' text encoders among them.
  EXPECT_NE(
      r.output.find("accepted: AutoencoderKL, AutoencoderKLQwenImage21, CLIPTextModel, CLIPTextModelWithProjection, "),
      std::string::npos)
      << r.output;
  for (const char* cls : {"FluxTransformer2DModel", "QwenImage21Transformer2DModel", "QwenImageTransformer2DModel",
                          "SD3Transformer2DModel", "T5EncoderModel", "UNet2DConditionModel"})
    EXPECT_NE(r.output.find(cls), std::string::npos) << cls << ": " << r.output;
  r = run_dew(base + " --dtype float16");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.output.find("accepted: float32, float64"), std::string::npos) << r.output;
  r = run_dew("forward " + dir.path.string() + " --inputs " + dir.file("in.safetensors") + " --out " + dir.file("o"));
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.output.find("config.json: missing"), std::string::npos) << r.output;
  EXPECT_FALSE(std::filesystem::exists(dir.file("out.safetensors")));
  r = run_dew("forward --help");
  EXPECT_EQ(r.code, 0);
  EXPECT_NE(r.output.find("usage: dew forward DIR"), std::string::npos);
  // every class of the family table with its methods
  for (const char* line :
       {"UNet2DConditionModel (unet_2d_condition)",
        "forward: sample, timestep, encoder_hidden_states [, encoder_attention_mask, text_embeds, "
        "class_labels, time_ids] -> sample",
        "SD3Transformer2DModel (sd3_transformer)",
        "forward: hidden_states, timestep, encoder_hidden_states [, pooled_projections] -> sample",
        "AutoencoderKL (autoencoder_kl)", "encode: sample -> latent_mean, latent_logvar", "tiled_decode: z -> sample",
        "FluxTransformer2DModel (flux_transformer)",
        "forward: hidden_states, encoder_hidden_states, pooled_projections, timestep, img_ids, txt_ids [, guidance] "
        "-> sample",
        "CLIPTextModelWithProjection (clip_text)",
        "forward: input_ids [, attention_mask] -> last_hidden_state, pooler_output, text_embeds, "
        "penultimate_hidden_state",
        "T5EncoderModel (t5_encoder)", "forward: input_ids [, attention_mask] -> last_hidden_state"})
    EXPECT_NE(r.output.find(line), std::string::npos) << line << "\n" << r.output;
}

}  // namespace

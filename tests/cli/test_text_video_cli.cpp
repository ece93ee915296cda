// The dew program on text-conditioned and video runs: captions through a trained byte-level encoder,
// Moving Fashion-MNIST with the video backbones, and a unet run inflated into unet_3d.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "dew/core/options.h"
#include "dew/io/safetensors.h"
#include "tests/test_util.h"

namespace fs = std::filesystem;

namespace {

using dew::test::run_dew;

std::string tv_tmp(const std::string& name) {
  auto d = fs::path(::testing::TempDir()) / ("dew_cli_tv_" + name);
  fs::remove_all(d);
  return d.string();
}

const std::string kVideoData =
    " --data "
    "'{\"name\":\"moving_fashion_mnist\",\"count\":32,\"frames\":4,\"size\":16,\"item_size\":8,\"split\":\"test\"}'"
    " --loader.batch_size 4 --trainer.log_every 2 --trainer.checkpoint_every 2 --objective.steps 2"
    " --objective.preview_per_class 1";

}  // namespace

TEST(CliText, TrainsOnCaptionsAndSamplesFromAPrompt) {
  auto dir = tv_tmp("text");
  auto r = run_dew("train diffusion --run " + dir +
                   " --trainer.steps 3 --trainer.checkpoint_every 3"
                   " --data '{\"name\":\"gaussian_blobs\",\"count\":32,\"size\":8,\"classes\":3}'"
                   " --model.architecture simple_dit"
                   " --model.fields '{\"patch_size\":2,\"emb_features\":32,\"num_layers\":1,\"num_heads\":2}'"
                   " --text_encoder.architecture byte_text_encoder"
                   " --text_encoder.fields '{\"features\":16,\"num_layers\":1,\"num_heads\":2,\"max_length\":24}'"
                   " --loader.batch_size 8 --objective.steps 2");
  ASSERT_EQ(r.code, 0) << r.output;
  auto record = dew::json::parse(std::ifstream(fs::path(dir) / "run.json"));
  // the model takes the encoder's context instead of labels
  EXPECT_EQ(record["model"]["fields"]["num_classes"], 0);
  EXPECT_EQ(record["model"]["fields"]["context_features"], 16);
  EXPECT_EQ(record["derived"]["class_names"].size(), 3u);
  // one checkpoint holds the backbone and the jointly trained encoder
  auto ck = dew::io::SafetensorsFile::open((fs::path(dir) / "checkpoints" / "step_3" / "model.safetensors").string());
  bool has_encoder = false;
  for (const auto& name : ck.names()) has_encoder |= name.rfind("text_encoder.token_embedding", 0) == 0;
  EXPECT_TRUE(has_encoder);
  auto out = (fs::path(dir) / "prompt.png").string();
  r = run_dew("sample " + dir + " --steps 2 --prompt 'a photo of a blob_1' --count 3 --out " + out);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_TRUE(fs::exists(out));
  // labels become captions; a prompt on a label-conditioned run is refused
  r = run_dew("sample " + dir + " --steps 2 --labels 0,2 --count 2 --out " + out);
  EXPECT_EQ(r.code, 0) << r.output;
  r = run_dew("sample " + dir + " --steps 2 --prompt x --labels 1");
  EXPECT_EQ(r.code, 2) << r.output;
}

TEST(CliVideo, VideoDiTTrainsOnMovingFashionMnistAndWritesStripAndGif) {
  auto dir = tv_tmp("video_dit");
  auto r = run_dew("train diffusion --run " + dir + " --trainer.steps 2" + kVideoData +
                   " --model.architecture video_dit"
                   " --model.fields '{\"patch_size\":4,\"emb_features\":32,\"num_layers\":1,\"num_heads\":2}'");
  ASSERT_EQ(r.code, 0) << r.output;
  auto record = dew::json::parse(std::ifstream(fs::path(dir) / "run.json"));
  EXPECT_EQ(record["derived"]["sample_shape"], dew::json({1, 4, 16, 16}));
  EXPECT_TRUE(fs::exists(fs::path(dir) / "samples" / "step_2.gif"));
  auto out = (fs::path(dir) / "v.png").string();
  r = run_dew("sample " + dir + " --steps 2 --labels 7 --count 2 --out " + out);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_TRUE(fs::exists(out));
  EXPECT_TRUE(fs::exists((fs::path(dir) / "v.gif").string()));
}

TEST(CliVideo, UnetRunInflatesIntoUnet3D) {
  auto dir2d = tv_tmp("unet2d"), dir3d = tv_tmp("unet3d");
  const std::string unet_fields =
      " --model.fields '{\"emb_features\":16,\"feature_depths\":[8,16],\"attention_configs\":[null,null],"
      "\"num_res_blocks\":1,\"norm_groups\":4}'";
  auto r = run_dew("train diffusion --run " + dir2d +
                   " --trainer.steps 2 --trainer.checkpoint_every 2"
                   " --data '{\"name\":\"gaussian_blobs\",\"count\":16,\"size\":16,\"classes\":10}'"
                   " --model.architecture unet --loader.batch_size 4 --objective.steps 2" +
                   unet_fields);
  ASSERT_EQ(r.code, 0) << r.output;
  r = run_dew("train diffusion --run " + dir3d + " --trainer.steps 2 --init_from " + dir2d + kVideoData +
              " --model.architecture unet_3d" + unet_fields);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("inflated"), std::string::npos) << r.output;
  // a 2D checkpoint of another shape is refused with the offending name
  r = run_dew("train diffusion --run " + tv_tmp("unet3d_bad") + " --trainer.steps 1 --init_from " + dir2d + kVideoData +
              " --model.architecture unet_3d --model.fields '{\"emb_features\":16,\"feature_depths\":[8,8],"
              "\"attention_configs\":[null,null],\"num_res_blocks\":1,\"norm_groups\":4}'");
  EXPECT_EQ(r.code, 2) << r.output;
}

TEST(CliText, AModelThatNeedsTextIsRefusedBeforeTraining) {
  auto dir = tv_tmp("mmdit_no_text");
  auto r = run_dew("train diffusion --run " + dir +
                   " --trainer.steps 1"
                   " --data '{\"name\":\"gaussian_blobs\",\"count\":8,\"size\":8,\"classes\":2}'"
                   " --model.architecture simple_mmdit"
                   " --model.fields '{\"patch_size\":2,\"emb_features\":32,\"num_layers\":2,\"num_heads\":2}'");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("needs a text context: add --text_encoder.architecture"), std::string::npos) << r.output;
  // the same directory then trains once the encoder is given (nothing was recorded for the refused run)
  r = run_dew("train diffusion --run " + dir +
              " --trainer.steps 1 --trainer.checkpoint_every 1 --objective.steps 1"
              " --data '{\"name\":\"gaussian_blobs\",\"count\":8,\"size\":8,\"classes\":2}' --loader.batch_size 4"
              " --model.architecture simple_mmdit"
              " --model.fields '{\"patch_size\":2,\"emb_features\":32,\"num_layers\":2,\"num_heads\":2}'"
              " --text_encoder.architecture byte_text_encoder"
              " --text_encoder.fields '{\"features\":16,\"num_layers\":1,\"num_heads\":2,\"max_length\":16}'");
  EXPECT_EQ(r.code, 0) << r.output;
}

TEST(CliText, QwenImageTransformerTrainsWithTheFlowPresetAndSamples) {
  // Qwen-Image 2.1's transformer over Dew's interface: the caption encoder's right-padded states and mask make
  // its joint [text; image] sequence; 8 x 8 images give whole 2 x 2 slots.
  auto dir = tv_tmp("qwen_image");
  auto r = run_dew("train diffusion --run " + dir +
                   " --trainer.steps 2 --trainer.checkpoint_every 2 --preset.name flow"
                   " --data '{\"name\":\"gaussian_blobs\",\"count\":16,\"size\":8,\"classes\":2}'"
                   " --model.architecture qwen_image_transformer"
                   " --model.fields '{\"num_layers\":2,\"num_attention_heads\":2,\"attention_head_dim\":8,"
                   "\"axes_dims_rope\":[2,2,4],\"mlp_ratio\":2}'"
                   " --text_encoder.architecture byte_text_encoder"
                   " --text_encoder.fields '{\"features\":16,\"num_layers\":1,\"num_heads\":2,\"max_length\":24}'"
                   " --loader.batch_size 8 --objective.steps 2");
  ASSERT_EQ(r.code, 0) << r.output;
  auto record = dew::json::parse(std::ifstream(fs::path(dir) / "run.json"));
  EXPECT_EQ(record["model"]["architecture"], "qwen_image_transformer");
  EXPECT_EQ(record["model"]["fields"]["context_features"], 16);
  auto out = (fs::path(dir) / "prompt.png").string();
  r = run_dew("sample " + dir + " --steps 2 --prompt 'a photo of a blob_1' --count 2 --out " + out);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_TRUE(fs::exists(out));
}

// `dew sample --pipeline DIR` on the tiny diffusers pipeline folder (tests/golden/sd/pipeline/): given the
// reference's initial latents (--latents), the PNG it writes is diffusers' image quantised as
// numpy_to_pil does (round(x * 255)); bad flags and broken folders exit 2 with one line.
#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>

#include "dew/io/image.h"
#include "dew/io/safetensors.h"
#include "dew/metrics/clip_score.h"
#include "tests/golden_util.h"
#include "tests/test_util.h"

namespace {

using dew::test::run_dew;

const std::string kPipe = std::string(DEW_SOURCE_DIR) + "/tests/golden/sd/pipeline";
const std::string kPrompt = "--prompt 'a photo of a cat on the moon' --negative-prompt 'blurry, low quality'";

}  // namespace

TEST(PipelineCli, WritesDiffusersImageForTheSameLatents) {
  dew::test::TempDir dir("pipeline_cli");
  const auto io = dew::test::golden("sd/pipeline/pipeline_io.safetensors");
  dew::io::save_safetensors(dir.file("latents.safetensors"), {{"latents", io.at("latents")}});
  for (const std::string sched : {"DDIMScheduler", "EulerDiscreteScheduler"}) {
    SCOPED_TRACE(sched);
    const std::string png = dir.file(sched + ".png");
    const auto r =
        run_dew("sample --pipeline " + kPipe + " " + kPrompt + " --steps 5 --guidance 7.5 --size 32x32 --latents " +
                dir.file("latents.safetensors") + " --scheduler " + sched + " --out " + png);
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_NE(r.output.find(sched), std::string::npos) << r.output;
    const at::Tensor ours = dew::io::load_image(png, 3).to(at::kInt);  // [3, 32, 32]
    const std::string key = sched == "DDIMScheduler" ? "ddim_image_f64" : "euler_image_f64";
    const at::Tensor ref = (io.at(key)[0] * 255).round().clamp(0, 255).to(at::kInt);
    // Pixels may differ by one level where the float64 value sits on a rounding boundary.
    const int64_t off = (ours - ref).abs().gt(1).sum().item<int64_t>();
    const double same = (ours == ref).to(at::kDouble).mean().item<double>();
    std::printf("  %s: %.4f of the bytes equal diffusers' float64 image, %lld off by more than one\n", sched.c_str(),
                same, static_cast<long long>(off));
    EXPECT_EQ(off, 0);
    EXPECT_GE(same, 0.99);
  }
}

TEST(PipelineCli, BadInputExitsTwoWithOneLine) {
  dew::test::TempDir dir("pipeline_cli_bad");
  const std::string out = " --out " + dir.file("x.png");
  for (const std::string& args :
       {"sample --pipeline " + dir.file("nowhere") + " --prompt cat" + out,
        "sample --pipeline " + kPipe + " --prompt cat --size 15x16" + out,
        "sample --pipeline " + kPipe + " --prompt cat --scheduler NoSuchScheduler" + out,
        "sample --pipeline " + kPipe + " --prompt cat --steps 0" + out,
        "sample --pipeline " + kPipe + " --prompt cat --out " + dir.file("x.jpg"),
        "sample --pipeline " + kPipe + " --prompt cat --weights-dtype int8" + out,
        "sample --pipeline " + kPipe + " --prompt cat --prompt-3 dog" + out, "sample --pipeline " + kPipe + out}) {
    SCOPED_TRACE(args);
    const auto r = run_dew(args);
    EXPECT_EQ(r.code, 2) << r.output;
    EXPECT_EQ(dew::test::count_lines(r.output), 1u) << r.output;
  }
  EXPECT_FALSE(std::filesystem::exists(dir.file("x.png")));
}

// StableDiffusion3Pipeline and FluxPipeline folders (tests/golden/sd3/pipeline, flux/pipeline_{schnell,dev}) replay
// diffusers' latents; Flux's --latents are FluxPipeline's packed draw.
TEST(PipelineCli, SD3AndFluxWriteDiffusersImageForTheSameLatents) {
  dew::test::TempDir dir("pipeline_cli_flow");
  struct Case {
    std::string folder, flags;
  };
  const std::string golden = std::string(DEW_SOURCE_DIR) + "/tests/golden/";
  for (const Case& c : {Case{"sd3/pipeline", kPrompt + " --guidance 5"},
                        Case{"flux/pipeline_schnell", "--prompt 'a photo of a cat on the moon'"},
                        Case{"flux/pipeline_dev", "--prompt 'a photo of a cat on the moon' --guidance 3.5"}}) {
    SCOPED_TRACE(c.folder);
    const auto io = dew::test::golden(c.folder + "/pipeline_io.safetensors");
    const std::string latents = dir.file("latents.safetensors"), png = dir.file("out.png");
    dew::io::save_safetensors(latents, {{"latents", io.at("latents")}});
    const auto r = run_dew("sample --pipeline " + golden + c.folder + " " + c.flags +
                           " --steps 4 --size 16x16 --max-sequence-length 16 --latents " + latents + " --out " + png);
    ASSERT_EQ(r.code, 0) << r.output;
    const at::Tensor ours = dew::io::load_image(png, 3).to(at::kInt);  // [3, 16, 16]
    const at::Tensor ref = (io.at("image_f64")[0] * 255).round().clamp(0, 255).to(at::kInt);
    const int64_t off = (ours - ref).abs().gt(1).sum().item<int64_t>();
    const double same = (ours == ref).to(at::kDouble).mean().item<double>();
    std::printf("  %s: %.4f of the bytes equal diffusers' float64 image, %lld off by more than one\n", c.folder.c_str(),
                same, static_cast<long long>(off));
    EXPECT_EQ(off, 0);
    EXPECT_GE(same, 0.99);
  }
  // schnell has no guidance embedding; sizes must be multiples of the VAE's factor x 2
  const std::string schnell = golden + "flux/pipeline_schnell";
  for (const std::string& args : {"sample --pipeline " + schnell + " --prompt cat --guidance 3.5",
                                  "sample --pipeline " + schnell + " --prompt cat --size 18x16",
                                  "sample --pipeline " + schnell + " --prompt cat --negative-prompt x",
                                  "sample --pipeline " + schnell + " --prompt cat --prompt-3 x",
                                  "sample --pipeline " + schnell + " --prompt cat --negative-prompt-2 x",
                                  "sample --pipeline " + schnell + " --prompt cat --scheduler DDIMScheduler"}) {
    SCOPED_TRACE(args);
    const auto r = run_dew(args + " --out " + dir.file("x.png"));
    EXPECT_EQ(r.code, 2) << r.output;
    EXPECT_EQ(dew::test::count_lines(r.output), 1u) << r.output;
  }
}

// --weights-dtype bfloat16 through the CLI: the bytes held are reported and the image stays within bf16's reach of
// diffusers' float64 image (tests/interop/test_flow_pipeline.cpp holds it to diffusers' own bf16 error).
TEST(PipelineCli, WeightsDtypeBFloat16) {
  dew::test::TempDir dir("pipeline_cli_bf16");
  const std::string folder = std::string(DEW_SOURCE_DIR) + "/tests/golden/sd3/pipeline";
  const auto io = dew::test::golden("sd3/pipeline/pipeline_io.safetensors");
  const std::string latents = dir.file("latents.safetensors"), png = dir.file("out.png");
  dew::io::save_safetensors(latents, {{"latents", io.at("latents")}});
  const auto r = run_dew("sample --pipeline " + folder + " " + kPrompt +
                         " --guidance 5 --steps 4 --size 16x16 --max-sequence-length 16 --weights-dtype bfloat16 "
                         "--latents " +
                         latents + " --out " + png);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("weights held in bfloat16"), std::string::npos) << r.output;
  const at::Tensor ours = dew::io::load_image(png, 3).to(at::kDouble) / 255;
  const double rms = (ours - io.at("image_f64")[0]).pow(2).mean().sqrt().item<double>();
  std::printf("  sd3 --weights-dtype bfloat16: image rms against diffusers' float64 %.4f\n", rms);
  EXPECT_LT(rms, 0.06);  // diffusers' own bf16 pipeline: 0.028 (tests/golden/pipeline_bf16_reference.py)
}

// A QwenImage21Pipeline folder (tests/golden/qwen_image/pipeline): the golden's first prompt alone with its row of
// latents replayed gives diffusers' RGBA image of that call; the same command gives the same bytes; bad flags exit 2
// with one line before the models load.
TEST(PipelineCli, QwenImageWritesDiffusersImageForTheSameLatents) {
  dew::test::TempDir dir("pipeline_cli_qwen");
  const std::string folder = std::string(DEW_SOURCE_DIR) + "/tests/golden/qwen_image/pipeline";
  const auto io = dew::test::golden("qwen_image/pipeline/pipeline_io.safetensors");
  dew::io::save_safetensors(dir.file("latents.safetensors"), {{"latents", io.at("latents").narrow(0, 0, 1)}});
  const std::string args = "sample --pipeline " + folder +
                           " --prompt 'a cat' --negative-prompt blurry --guidance 4 --steps 3 --size 64x32 --latents " +
                           dir.file("latents.safetensors");
  const auto r = run_dew(args + " --out " + dir.file("a.png"));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("QwenImage21Pipeline"), std::string::npos) << r.output;
  const at::Tensor ours = dew::io::load_image(dir.file("a.png"), 4).to(at::kInt);  // [4, 64, 32]
  const at::Tensor ref = (io.at("image_first_prompt_f64")[0] * 255).round().clamp(0, 255).to(at::kInt);
  const int64_t off = (ours - ref).abs().gt(1).sum().item<int64_t>();
  const double same = (ours == ref).to(at::kDouble).mean().item<double>();
  std::printf("  qwen: %.4f of the bytes equal diffusers' float64 image, %lld off by more than one\n", same,
              static_cast<long long>(off));
  EXPECT_EQ(off, 0);
  EXPECT_GE(same, 0.99);
  const auto again = run_dew(args + " --out " + dir.file("b.png"));
  ASSERT_EQ(again.code, 0) << again.output;
  EXPECT_TRUE(dew::io::load_image(dir.file("b.png"), 4).equal(dew::io::load_image(dir.file("a.png"), 4)));

  const std::string out = " --out " + dir.file("x.png");
  const std::string base = "sample --pipeline " + folder + " --prompt cat";
  for (const std::string& bad :
       {base + " --size 48x32" + out, base + " --negative-prompt blurry" + out,
        base + " --lora " + dir.file("nowhere.safetensors") + out, base + " --scheduler DDIMScheduler" + out,
        base + " --prompt-2 dog" + out, "sample --pipeline " + folder + " --prompt '<|image_pad|> a cat'" + out,
        base + " --size 32x32 --latents " + dir.file("latents.safetensors") + out}) {
    SCOPED_TRACE(bad);
    const auto b = run_dew(bad);
    EXPECT_EQ(b.code, 2) << b.output;
    EXPECT_EQ(dew::test::count_lines(b.output), 1u) << b.output;
  }
  EXPECT_FALSE(std::filesystem::exists(dir.file("x.png")));
}

// `dew eval --pipeline` on a QwenImage21Pipeline folder: the CLIP score it prints for a prompt is the CLIP score of the
// PNG `dew sample --pipeline` writes with the same seed, steps and guidance (its colour channels: the images are RGBA;
// the scorer quantises to the PNG's bytes), through the tiny CLIP folder of the CLIP-score goldens.
TEST(PipelineCli, QwenImageEvalScoresTheImagesSampleWrites) {
  dew::test::TempDir dir("pipeline_cli_qwen_eval");
  const std::string folder = std::string(DEW_SOURCE_DIR) + "/tests/golden/qwen_image/pipeline";
  const std::string clip = std::string(DEW_SOURCE_DIR) + "/tests/golden/clip_score";
  std::ofstream(dir.file("prompts.txt")) << "a cat\n";
  const auto e = run_dew("eval --pipeline " + folder + " --prompts " + dir.file("prompts.txt") + " --clip " + clip +
                         " --steps 2 --guidance 2 --seed 3");
  ASSERT_EQ(e.code, 0) << e.output;
  const auto at = e.output.find("| a cat | ");
  ASSERT_NE(at, std::string::npos) << e.output;
  const double printed = std::stod(e.output.substr(at + 10));
  const auto s = run_dew("sample --pipeline " + folder + " --prompt 'a cat' --steps 2 --guidance 2 --seed 3 --out " +
                         dir.file("a.png"));
  ASSERT_EQ(s.code, 0) << s.output;
  const at::Tensor png = dew::io::load_image(dir.file("a.png"), 3).to(at::kFloat).unsqueeze(0) / 255 * 2 - 1;
  dew::metrics::ClipScorer scorer(clip);
  const double expected = scorer.scores(png, {"a cat"})[0].item<double>();
  std::printf("  qwen eval --pipeline: %.6f, the sampled PNG's CLIP score %.6f\n", printed, expected);
  EXPECT_NEAR(printed, expected, 1e-4);
}

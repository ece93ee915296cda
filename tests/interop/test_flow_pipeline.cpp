// dew::interop::FlowPipeline against diffusers' StableDiffusion3Pipeline and FluxPipeline: tests/golden/sd3/pipeline,
// tests/golden/flux/pipeline_schnell and flux/pipeline_dev are tiny pipeline folders saved by the real diffusers /
// transformers code (tests/golden/sd3_flux_pipeline_reference.py), pipeline_io.safetensors their outputs for the
// same initial latents in float32 and float64.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "dew/interop/flow_pipeline.h"
#include "dew/io/safetensors.h"
#include "tests/golden_util.h"
#include "tests/test_util.h"

using dew::json;
using dew::test::error_of;
using dew::test::expect_golden;

namespace {

const std::string kFlowGolden = std::string(DEW_SOURCE_DIR) + "/tests/golden/";
const std::string kSD3 = kFlowGolden + "sd3/pipeline", kFlux = kFlowGolden + "flux/pipeline_schnell",
                  kFluxDev = kFlowGolden + "flux/pipeline_dev";
constexpr int64_t kMaxSeq = 16;  // the golden's max_sequence_length

std::map<std::string, at::Tensor> flow_io(const std::string& folder) {
  return dew::io::load_safetensors(folder + "/pipeline_io.safetensors");
}

dew::interop::PipelineRequest flow_request(const std::map<std::string, at::Tensor>& io, bool flux) {
  dew::interop::PipelineRequest r;
  r.prompt = "a photo of a cat on the moon";
  if (!flux) r.negative_prompt = "blurry, low quality";
  r.steps = 4;
  r.guidance = flux ? 0.0 : 5.0;
  r.latents = io.at("latents");
  r.height = r.width = 16;  // latents 8 x 8, the tiny VAE's factor 2
  return r;
}

void expect_all_in(const std::string& m, std::initializer_list<const char*> parts) {
  EXPECT_FALSE(m.empty());
  for (const char* p : parts) EXPECT_NE(m.find(p), std::string::npos) << "\"" << p << "\" not in: " << m;
}

}  // namespace

TEST(FlowPipeline, SD3TokensAndPromptEmbeddingsMatchDiffusers) {
  auto io = flow_io(kSD3);
  auto pipe = dew::interop::FlowPipeline::load(kSD3);
  EXPECT_EQ(pipe.class_name(), "StableDiffusion3Pipeline");
  const auto r = flow_request(io, false);
  EXPECT_TRUE(pipe.tokenize({r.prompt}, 0, kMaxSeq).equal(io.at("prompt_ids")));
  EXPECT_TRUE(pipe.tokenize({r.negative_prompt}, 0, kMaxSeq).equal(io.at("negative_prompt_ids")));
  EXPECT_TRUE(pipe.tokenize({r.prompt}, 1, kMaxSeq).equal(io.at("prompt_2_ids")));
  EXPECT_TRUE(pipe.tokenize({r.negative_prompt}, 1, kMaxSeq).equal(io.at("negative_prompt_2_ids")));
  EXPECT_TRUE(pipe.tokenize({r.prompt}, 2, kMaxSeq).equal(io.at("prompt_3_ids")))
      << pipe.tokenize({r.prompt}, 2, kMaxSeq) << io.at("prompt_3_ids");
  EXPECT_TRUE(pipe.tokenize({r.negative_prompt}, 2, kMaxSeq).equal(io.at("negative_prompt_3_ids")));
  const auto e = pipe.encode(r, kMaxSeq);
  expect_golden("sd3 prompt_embeds", e.positive, io.at("prompt_embeds_f32"), io.at("prompt_embeds_f64"));
  expect_golden("sd3 negative_prompt_embeds", e.negative, io.at("negative_prompt_embeds_f32"),
                io.at("negative_prompt_embeds_f64"));
  expect_golden("sd3 pooled", e.pooled_positive, io.at("pooled_prompt_embeds_f32"), io.at("pooled_prompt_embeds_f64"));
  expect_golden("sd3 negative pooled", e.pooled_negative, io.at("negative_pooled_prompt_embeds_f32"),
                io.at("negative_pooled_prompt_embeds_f64"));
  // prompt_2 (CLIP-G) and prompt_3 (T5) given apart, with their negatives
  auto r23 = r;
  r23.prompt_2 = "the moon, a photo";
  r23.prompt_3 = "a cat, on the moon, photographed";
  r23.negative_prompt_2 = "low quality";
  r23.negative_prompt_3 = "blurry";
  const auto e23 = pipe.encode(r23, kMaxSeq);
  expect_golden("sd3 prompt_embeds (2, 3)", e23.positive, io.at("prompt_embeds_23_f32"), io.at("prompt_embeds_23_f64"));
  expect_golden("sd3 negative_prompt_embeds (2, 3)", e23.negative, io.at("negative_prompt_embeds_23_f32"),
                io.at("negative_prompt_embeds_23_f64"));
  // The pooled vectors are CLIP-L's projection (12, from the prompt: the same bits as above) then CLIP-G's (20, from
  // prompt_2). The golden rule on CLIP-G's halves, what prompt_2 changes, positive and negative together (40 values:
  // on 20 the rule's yardstick is a few ulps of a few values).
  const int64_t l = 12, g = e23.pooled_positive.size(-1) - l;
  EXPECT_TRUE(e23.pooled_positive.narrow(-1, 0, l).equal(e.pooled_positive.narrow(-1, 0, l)));
  EXPECT_TRUE(e23.pooled_negative.narrow(-1, 0, l).equal(e.pooled_negative.narrow(-1, 0, l)));
  auto clip_g = [&](const at::Tensor& pos, const at::Tensor& neg) {
    return at::cat({pos.narrow(-1, l, g), neg.narrow(-1, l, g)});
  };
  expect_golden("sd3 pooled (2, 3), CLIP-G halves", clip_g(e23.pooled_positive, e23.pooled_negative),
                clip_g(io.at("pooled_prompt_embeds_23_f32"), io.at("negative_pooled_prompt_embeds_23_f32")),
                clip_g(io.at("pooled_prompt_embeds_23_f64"), io.at("negative_pooled_prompt_embeds_23_f64")));
  EXPECT_FALSE(e23.positive.equal(e.positive));
}

TEST(FlowPipeline, SD3MatchesDiffusers) {
  auto io = flow_io(kSD3);
  auto pipe = dew::interop::FlowPipeline::load(kSD3);
  const auto r = flow_request(io, false);
  const auto res = pipe.run(r, kMaxSeq);
  dew::test::expect_close_f64("sd3 sigmas", pipe.scheduler().sigmas(), io.at("sigmas_f64"), 1e-12);
  expect_golden("sd3 final latents", res.latents, io.at("final_latents_f32"), io.at("final_latents_f64"));
  expect_golden("sd3 image", res.images, io.at("image_f32"), io.at("image_f64"));
}

// --weights-dtype bfloat16 against diffusers' own bf16 pipeline (tests/golden/pipeline_bf16_reference.py:
// from_pretrained(torch_dtype=bfloat16)): the matrix weights held in bf16, about half the bytes, and dew's error
// against the float64 pipeline at most twice diffusers' bf16 error.
TEST(FlowPipeline, BFloat16WeightsAgainstDiffusersBFloat16) {
  for (bool flux : {false, true}) {
    const std::string dir = flux ? kFlux : kSD3, tag = flux ? "flux bf16 " : "sd3 bf16 ";
    const auto io = flow_io(dir), bf16 = dew::io::load_safetensors(dir + "/pipeline_bf16.safetensors");
    auto pipe = dew::interop::FlowPipeline::load(dir);
    const int64_t f32_bytes = pipe.hold_weights_in(at::kFloat), bytes = pipe.hold_weights_in(at::kBFloat16);
    std::printf("  %sweights: %lld bytes (float32 %lld)\n", tag.c_str(), (long long)bytes, (long long)f32_bytes);
    EXPECT_LT(double(bytes), 0.6 * double(f32_bytes));
    const auto res = pipe.run(flow_request(io, flux), kMaxSeq);
    expect_golden(tag + "final latents", res.latents, bf16.at("final_latents_bf16"), io.at("final_latents_f64"));
    expect_golden(tag + "image", res.images, bf16.at("image_bf16"), io.at("image_f64"));
  }
}

TEST(FlowPipeline, FluxSchnellTokensAndPromptEmbeddingsMatchDiffusers) {
  auto io = flow_io(kFlux);
  auto pipe = dew::interop::FlowPipeline::load(kFlux);
  EXPECT_EQ(pipe.class_name(), "FluxPipeline");
  EXPECT_FALSE(pipe.guidance_embeds());
  const auto r = flow_request(io, true);
  EXPECT_TRUE(pipe.tokenize({r.prompt}, 0, kMaxSeq).equal(io.at("prompt_ids")));
  EXPECT_TRUE(pipe.tokenize({r.prompt}, 1, kMaxSeq).equal(io.at("prompt_2_ids")));
  const auto e = pipe.encode(r, kMaxSeq);
  expect_golden("flux prompt_embeds", e.positive, io.at("prompt_embeds_f32"), io.at("prompt_embeds_f64"));
  expect_golden("flux pooled", e.pooled_positive, io.at("pooled_prompt_embeds_f32"), io.at("pooled_prompt_embeds_f64"));
}

TEST(FlowPipeline, FluxSchnellMatchesDiffusers) {
  auto io = flow_io(kFlux);
  auto pipe = dew::interop::FlowPipeline::load(kFlux);
  auto r = flow_request(io, true);
  const auto res = pipe.run(r, kMaxSeq);
  dew::test::expect_close_f64("flux sigmas", pipe.scheduler().sigmas(), io.at("sigmas_f64"), 1e-12);
  expect_golden("flux final latents (packed)", res.latents, io.at("final_latents_f32"), io.at("final_latents_f64"));
  expect_golden("flux image", res.images, io.at("image_f32"), io.at("image_f64"));
  // the unpacked draw gives the same run
  r.latents = io.at("latents_unpacked");
  EXPECT_TRUE(pipe.run(r, kMaxSeq).latents.equal(res.latents));
}

// FLUX.1 dev: the guidance embedding (guidance 3.5) and dynamic shifting with mu of the packed sequence length.
TEST(FlowPipeline, FluxDevMatchesDiffusers) {
  auto io = flow_io(kFluxDev);
  auto pipe = dew::interop::FlowPipeline::load(kFluxDev);
  EXPECT_TRUE(pipe.guidance_embeds());
  auto r = flow_request(io, true);
  r.guidance = 3.5;
  const auto e = pipe.encode(r, kMaxSeq);
  expect_golden("flux dev prompt_embeds", e.positive, io.at("prompt_embeds_f32"), io.at("prompt_embeds_f64"));
  const auto res = pipe.run(r, kMaxSeq);
  dew::test::expect_close_f64("flux dev sigmas", pipe.scheduler().sigmas(), io.at("sigmas_f64"), 1e-12);
  expect_golden("flux dev final latents (packed)", res.latents, io.at("final_latents_f32"), io.at("final_latents_f64"));
  expect_golden("flux dev image", res.images, io.at("image_f32"), io.at("image_f64"));
}

TEST(FlowPipeline, BadRequestsAndFoldersAreRefusedBeforeCompute) {
  auto pipe = dew::interop::FlowPipeline::load(kSD3);
  dew::interop::PipelineRequest r;
  r.prompt = "a cat";
  r.steps = 2;
  r.height = r.width = 18;  // not a multiple of the VAE's 2 x patch 2
  expect_all_in(error_of([&] { pipe.check(r); }), {"--size", "18x18", "4"});
  r.height = r.width = 16;
  r.latents = at::zeros({1, 16, 4, 4});
  expect_all_in(error_of([&] { pipe.check(r); }), {"--latents", "[1, 16, 8, 8]"});

  dew::test::TempDir dir("flow_pipeline_broken");
  namespace fs = std::filesystem;
  auto fresh = [&](const std::string& name, const std::string& src) {
    const auto p = dir.path / name;
    fs::copy(src, p, fs::copy_options::recursive);
    return p;
  };
  // a missing component folder
  auto p = fresh("missing_component", kSD3);
  fs::remove_all(p / "text_encoder_3");
  expect_all_in(error_of([&] { dew::interop::FlowPipeline::load(p.string()); }),
                {"text_encoder_3: missing", "T5EncoderModel"});
  // an unknown scheduler class
  p = fresh("bad_scheduler", kFlux);
  {
    std::ifstream in(p / "model_index.json");
    json index = json::parse(in);
    index["scheduler"] = json::array({"diffusers", "DPMSolverMultistepScheduler"});
    std::ofstream(p / "model_index.json") << index.dump(2);
  }
  expect_all_in(error_of([&] { dew::interop::FlowPipeline::load(p.string()); }),
                {"model_index.json", "scheduler", "DPMSolverMultistepScheduler", "FlowMatchEulerDiscreteScheduler"});
  // a T5 tokenizer without its SentencePiece model
  p = fresh("no_spiece", kFlux);
  fs::remove(p / "tokenizer_2" / "spiece.model");
  expect_all_in(error_of([&] { dew::interop::FlowPipeline::load(p.string()); }), {"tokenizer_2", "spiece.model"});
  EXPECT_TRUE(dew::interop::is_flow_pipeline_folder(kFlux));
  EXPECT_FALSE(dew::interop::is_flow_pipeline_folder(kFlowGolden + "sd/pipeline"));
}

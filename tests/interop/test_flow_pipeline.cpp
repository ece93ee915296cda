// dew::interop::FlowPipeline against diffusers' StableDiffusion3Pipeline and FluxPipeline: tests/golden/sd3/pipeline,
// tests/golden/flux/pipeline_schnell and flux/pipeline_dev are tiny pipeline folders saved by the real diffusers /
// transformers code (tests/golden/sd3_flux_pipeline_reference.py), pipeline_io.safetensors their outputs for the
// same initial latents in float32 and float64.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <functional>

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
    // Built in bf16 from the start (no float32 copy of a component): the same weights, the same images.
    auto direct = dew::interop::FlowPipeline::load(dir, at::kBFloat16);
    EXPECT_EQ(direct.hold_weights_in(at::kBFloat16), bytes);
    const auto again = direct.run(flow_request(io, flux), kMaxSeq);
    EXPECT_TRUE(again.latents.equal(res.latents)) << tag << dew::test::max_diff(again.latents, res.latents);
    EXPECT_TRUE(again.images.equal(res.images)) << tag;
    EXPECT_NE(dew::test::error_of([&] { direct.add_lora(dir + "/missing.safetensors", 1.0); }).find("BFloat16"),
              std::string::npos);
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

// dew::interop::QwenImagePipeline against diffusers' QwenImage21Pipeline: tests/golden/qwen_image/pipeline is a tiny
// folder saved by the real diffusers / transformers code (tests/golden/qwen_image_pipeline_reference.py), its
// pipeline_io.safetensors the outputs of two prompts with a negative prompt and true CFG 4, 3 steps.
namespace {

const std::string kQwenPipe = kFlowGolden + "qwen_image/pipeline";
const std::vector<std::string> kQwenPrompts = {"a cat",
                                               "A photo of a small red fox sitting in fresh snow, golden hour."};

dew::interop::PipelineRequest qwen_request(const std::map<std::string, at::Tensor>& io) {
  dew::interop::PipelineRequest r;
  r.count = 2;
  r.steps = 3;
  r.guidance = 4.0;
  r.height = 64;
  r.width = 32;
  r.latents = io.at("latents");  // packed [2, 8, 4], as the pipeline draws them
  return r;
}

}  // namespace

TEST(QwenImagePipeline, MatchesDiffusersFromPromptsToImage) {
  const auto io = flow_io(kQwenPipe);
  auto pipe = dew::interop::QwenImagePipeline::load(kQwenPipe);
  EXPECT_TRUE(pipe.causal_condition());
  EXPECT_TRUE(pipe.sample_sigmas().empty());
  // the text path: each prompt's states right-padded, the mask of its real tokens
  dew::interop::QwenImagePipeline::Prompts p;
  p.positive = pipe.encode_prompts(kQwenPrompts);
  p.negative = pipe.encode_prompts({"blurry", "blurry"});
  EXPECT_TRUE(p.positive.mask.equal(io.at("prompt_embeds_mask"))) << p.positive.mask.sum(1);
  expect_golden("qwen prompt_embeds", p.positive.states, io.at("prompt_embeds_f32"), io.at("prompt_embeds_f64"));
  expect_golden("qwen negative_prompt_embeds", p.negative.states, io.at("negative_prompt_embeds_f32"),
                io.at("negative_prompt_embeds_f64"));
  // the whole run on dew's own prompt states, with the prefix KV cache (the pipeline's default)
  const auto r = qwen_request(io);
  const auto res = pipe.run(r, p);
  dew::test::expect_close_f64("qwen sigmas", pipe.scheduler().sigmas(), io.at("sigmas_f64"), 1e-12);
  expect_golden("qwen final latents", res.latents, io.at("final_latents_f32"), io.at("final_latents_f64"));
  expect_golden("qwen image", res.images, io.at("image_f32"), io.at("image_f64"));
  ASSERT_EQ(res.images.sizes(), at::IntArrayRef({2, 4, 64, 32}));  // RGBA, as the VAE's 4 channels
  // without the cache: what diffusers' use_kv_cache=False gives, and the cached run's output to float tolerance
  const auto plain = pipe.run(r, p, {}, /*use_kv_cache=*/false);
  expect_golden("qwen final latents, no cache", plain.latents, io.at("final_latents_no_cache_f32"),
                io.at("final_latents_f64"));
  std::printf("  cache vs no cache: final latents max |diff| %.3e\n", dew::test::max_diff(plain.latents, res.latents));
  EXPECT_LE(dew::test::max_diff(plain.latents, res.latents), 1e-5);
  // the same request with the reference's prompt states: the denoising loop alone
  dew::interop::QwenImagePipeline::Prompts ref;
  ref.positive = {io.at("prompt_embeds_f32"), io.at("prompt_embeds_mask")};
  ref.negative = {io.at("negative_prompt_embeds_f32"),
                  at::ones({2, io.at("negative_prompt_embeds_f32").size(1)}, at::kLong)};
  expect_golden("qwen final latents (reference states)", pipe.run(r, ref).latents, io.at("final_latents_f32"),
                io.at("final_latents_f64"));
}

// --weights-dtype bfloat16 on a Qwen-Image 2.1 folder: built in bf16 (the Qwen3-VL text model, the transformer,
// the VAE) gives the weights and images of a float32 load held in bf16, bit for bit, and about half the bytes.
TEST(QwenImagePipeline, BuiltInBFloat16EqualsHeldInBFloat16) {
  const auto io = flow_io(kQwenPipe);
  auto held = dew::interop::QwenImagePipeline::load(kQwenPipe);
  const int64_t f32_bytes = held.hold_weights_in(at::kFloat), bytes = held.hold_weights_in(at::kBFloat16);
  auto built = dew::interop::QwenImagePipeline::load(kQwenPipe, at::kBFloat16);
  EXPECT_EQ(built.hold_weights_in(at::kBFloat16), bytes);
  EXPECT_LT(double(bytes), 0.6 * double(f32_bytes));
  const auto r = qwen_request(io);
  auto run = [&](dew::interop::QwenImagePipeline& pipe) {
    dew::interop::QwenImagePipeline::Prompts p;
    p.positive = pipe.encode_prompts(kQwenPrompts);
    p.negative = pipe.encode_prompts({"blurry", "blurry"});
    return pipe.run(r, p);
  };
  const auto a = run(held), b = run(built);
  EXPECT_TRUE(a.latents.equal(b.latents)) << dew::test::max_diff(a.latents, b.latents);
  EXPECT_TRUE(a.images.equal(b.images));
  // within bf16's reach of the float64 pipeline
  std::printf("  qwen bf16 image rms against float64 %.4f\n", dew::test::rms(a.images - io.at("image_f64")));
  EXPECT_LT(dew::test::rms(a.images - io.at("image_f64")), 0.05);
}

TEST(QwenImagePipeline, SampleSigmasAndBadInputAreReadAndRefusedBeforeCompute) {
  namespace fs = std::filesystem;
  dew::test::TempDir dir("qwen_pipeline");
  auto fresh = [&](const std::string& name) {
    const auto p = dir.path / name;
    fs::copy(kQwenPipe, p, fs::copy_options::recursive);
    return p;
  };
  auto edit_index = [](const fs::path& p, const std::function<void(json&)>& fn) {
    std::ifstream in(p / "model_index.json");
    json index = json::parse(in);
    fn(index);
    std::ofstream(p / "model_index.json") << index.dump(2);
  };
  // the index's sample_sigmas are the grid unless sigmas are given
  auto p = fresh("sigmas");
  edit_index(p, [](json& j) { j["sample_sigmas"] = {1.0, 0.5}; });
  auto pipe = dew::interop::QwenImagePipeline::load(p.string());
  ASSERT_EQ(pipe.sample_sigmas(), (std::vector<double>{1.0, 0.5}));
  dew::interop::PipelineRequest r;
  r.prompt = "a cat";
  r.height = 32;
  r.width = 32;
  r.steps = 7;  // ignored: the folder's grid
  pipe.run(r);
  EXPECT_EQ(pipe.scheduler().num_steps(), 2);
  pipe.run(r, dew::interop::QwenImagePipeline::linspace_sigmas(3));
  EXPECT_EQ(pipe.scheduler().num_steps(), 3);
  // bad requests
  r.height = 48;
  expect_all_in(error_of([&] { pipe.check(r); }), {"--size", "48x32", "32"});
  r.height = 32;
  r.latents = at::zeros({1, 4, 4, 4});
  expect_all_in(error_of([&] { pipe.check(r); }), {"--latents", "[1, 4, 2, 2]", "[1, 4, 4]"});
  r.latents = at::Tensor();
  r.prompt_2 = "x";
  expect_all_in(error_of([&] { pipe.check(r); }), {"--prompt-2", "one text encoder"});
  // broken folders
  p = fresh("bad_sigmas");
  edit_index(p, [](json& j) { j["sample_sigmas"] = {1.0, 2.0}; });
  expect_all_in(error_of([&] { dew::interop::QwenImagePipeline::load(p.string()); }),
                {"model_index.json", "sample_sigmas", "2", "(0, 1]"});
  p = fresh("no_tokenizer");
  fs::remove(p / "processor" / "tokenizer.json");
  expect_all_in(error_of([&] { dew::interop::QwenImagePipeline::load(p.string()); }), {"processor", "tokenizer.json"});
  p = fresh("other_vae");
  edit_index(p, [](json& j) { j["vae"] = json::array({"diffusers", "AutoencoderKL"}); });
  expect_all_in(error_of([&] { dew::interop::QwenImagePipeline::load(p.string()); }),
                {"model_index.json", "vae", "AutoencoderKL", "AutoencoderKLQwenImage21"});
  p = fresh("narrow_text");
  {
    std::ifstream in(p / "transformer" / "config.json");
    json c = json::parse(in);
    c["context_in_dim"] = 16;
    std::ofstream(p / "transformer" / "config.json") << c.dump(2);
  }
  expect_all_in(error_of([&] { dew::interop::QwenImagePipeline::load(p.string()); }),
                {"context_in_dim 16", "hidden_size 32"});
  EXPECT_TRUE(dew::interop::is_qwen_image_pipeline_folder(kQwenPipe));
  EXPECT_FALSE(dew::interop::is_qwen_image_pipeline_folder(kFlux));
  EXPECT_FALSE(dew::interop::is_flow_pipeline_folder(kQwenPipe));
}

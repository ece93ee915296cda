// `dew bench --models lm`: argument validation (one-line errors, exit 2) and the measured child's result
// line; `--models jepa`, `dpo` and `grpo_rollout`: the children and, for the post-training two, a whole run
// against the Python peer; `sd_unet` and `sd_vae`: the children, a C++-only run, the "peer: unavailable" line
// without diffusers and, where a diffusers checkout is present, a run against it; `sd3` and `flux`: the children and
// a run against diffusers' SD3Transformer2DModel. No timing is asserted: the machine is shared.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>
#include <utility>

#include "dew/core/options.h"
#include "tests/test_util.h"

namespace {

using dew::test::run_dew;

void one_line_error(const dew::test::CliResult& r, const std::string& needle) {
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << r.output;
  EXPECT_NE(r.output.find(needle), std::string::npos) << r.output;
}

// The result line (the last line of stdout) of a `dew bench --one` child.
dew::json result_line(const dew::test::CliResult& r) {
  std::string line = r.output.substr(0, r.output.find_last_not_of('\n') + 1);
  line = line.substr(line.rfind('\n') == std::string::npos ? 0 : line.rfind('\n') + 1);
  return dew::json::parse(line);
}

bool have_python_torch() { return std::system(DEW_PYTHON " -c 'import torch' >/dev/null 2>&1") == 0; }

// The post-training model (`dew train dpo`'s byte causal_transformer: vocab 257, width 128, 4 layers, 4 heads
// of 32, SwiGLU 384, qk-norm, tied head), counted by hand: embedding 257*128 + 4 * (attention 4*128*128 +
// MLP 3*128*384 + norms 2*128 + 2*32) + final norm 128.
// The Stable Diffusion components' parameter counts as diffusers v0.34.0 counts them for the bench's configs
// (UNet2DConditionModel: block_out_channels (64, 128), CrossAttnDownBlock2D + DownBlock2D, layers_per_block 2,
// cross_attention_dim 64, 8 heads, 32 groups; AutoencoderKL: block_out_channels (64, 128, 128), layers_per_block
// 2, 4 latent channels), printed by `sum(p.numel() for p in Model(**config).parameters())`.
constexpr int64_t kSdUnetParams = 4399684;
constexpr int64_t kSdVaeParams = 5120039;
// sd_unet_lora's adapters: rank 4 on the 4 projections of the UNet's 12 attention layers (self and cross attention
// of 5 transformer blocks at width 64 and the mid-block's at 128), r (in + out) each: 5 x 4096 + 4096 + 3584. peft's
// add_adapter on the same UNet counts 4,427,844 parameters in all (bench/sd_peer.py checks it against C++).
constexpr int64_t kSdUnetLoraAdapters = 28160;
// The flow transformers' (dew/bench/cases.cpp: width 4 heads x 32, text 64, pooled 64, 16 latent channels):
// FluxTransformer2DModel's count as diffusers 0.42.1 prints it (2 double + 4 single blocks, guidance embedding);
// SD3Transformer2DModel's (4 joint blocks) is diffusers' 2,292,544 less the last block's attn.add_q_proj
// (128 x 128 + 128), which feeds only the discarded text output and which dew does not build.
constexpr int64_t kSd3Params = 2292544 - (128 * 128 + 128);
constexpr int64_t kFluxParams = 2358080;
// diffusers' QwenImage21Transformer2DModel of qwen_image_config() counts these too (bench/sd_peer.py refuses to run
// otherwise: QwenImageRunsBothSidesWithItsCacheTable).
constexpr int64_t kQwenImageParams = 1012032;

// The diffusers the SD peer imports (the environment's pinned package, or $DEW_DIFFUSERS_SRC's checkout), asked
// of the peer itself (`sd_peer.py --probe`), so an environment whose imports fail here skips too.
bool have_diffusers() {
  return have_python_torch() &&
         std::system(DEW_PYTHON " " DEW_SOURCE_DIR "/bench/sd_peer.py --probe >/dev/null 2>&1") == 0;
}

constexpr int64_t kPostTrainingParams = 257 * 128 + 4 * (4 * 128 * 128 + 3 * 128 * 384 + 2 * 128 + 2 * 32) + 128;

}  // namespace

TEST(BenchCli, LmArgumentsAreValidated) {
  one_line_error(run_dew("bench --seq-len 64"), "--seq-len: only the language model uses it");
  one_line_error(run_dew("bench --models lm --seq-len 0"), "--seq-len: must be >= 1, got 0");
  one_line_error(run_dew("bench --models lm,unet,lm"), "--models: \"lm\" is listed twice");
  one_line_error(run_dew("bench --models lm --lm-peer /nonexistent/lm_peer.py"), "--lm-peer: no such file");
}

TEST(BenchCli, LmChildPrintsOneResultLine) {
  // The child a `dew bench --models lm` run starts per configuration, at its smallest.
  auto r = run_dew("bench --one lm --threads 1 --steps 1 --warmup 0 --batch 1 --seq-len 8");
  ASSERT_EQ(r.code, 0) << r.output;
  auto j = result_line(r);
  // byte vocab 257, width 256, 4 layers, 4 heads, SwiGLU 704, qk-norm, tied head, counted by hand:
  // embedding 257*256 + 4 * (attention 4*256*256 + MLP 3*256*704 + norms 2*256 + 2*64) + final norm 256.
  EXPECT_EQ(j.at("params").get<int64_t>(), 257 * 256 + 4 * (4 * 256 * 256 + 3 * 256 * 704 + 2 * 256 + 2 * 64) + 256);
  for (const char* key : {"ms_per_step", "tokens_per_s", "gen_ms_per_token", "prefill_ms", "peak_rss_mb"})
    EXPECT_GT(j.at(key).get<double>(), 0.0) << key;
  // 8 tokens per step: tokens/s = 8 / (ms/step / 1000).
  EXPECT_NEAR(j.at("tokens_per_s").get<double>() * j.at("ms_per_step").get<double>(), 8000.0, 1e-6 * 8000.0);
  EXPECT_TRUE(std::isfinite(j.at("loss").get<double>()));
}

TEST(BenchCli, JepaChildMatchesThePythonPeersModel) {
  // The child of `dew bench --models jepa`, at its smallest, and bench/jepa_peer.py on the same fields: the
  // two count the same parameters (the peer refuses to run otherwise), computed by hand here for `dew train
  // jepa`'s models: encoder = patch conv (7*7)*128 + 128, 6 blocks of (2 LayerNorms 4*128, qkv 128*384 + 384,
  // proj 128*128 + 128, MLP 128*512 + 512 + 512*128 + 128), final norm 2*128; predictor = embed 128*64 + 64,
  // mask token 64, 6 blocks at width 64, norm 2*64, projection 64*128 + 128.
  auto r = run_dew("bench --one jepa --threads 1 --steps 1 --warmup 0 --batch 2");
  ASSERT_EQ(r.code, 0) << r.output;
  auto j = result_line(r);
  auto block = [](int64_t d) { return 4 * d + d * 3 * d + 3 * d + d * d + d + d * 4 * d + 4 * d + 4 * d * d + d; };
  const int64_t encoder = 49 * 128 + 128 + 6 * block(128) + 2 * 128;
  const int64_t predictor = 128 * 64 + 64 + 64 + 6 * block(64) + 2 * 64 + 64 * 128 + 128;
  EXPECT_EQ(j.at("params").get<int64_t>(), encoder + predictor);
  EXPECT_GT(j.at("ms_per_step").get<double>(), 0.0);
  EXPECT_TRUE(std::isfinite(j.at("loss").get<double>()));
}

TEST(BenchCli, DpoRunsBothSidesAndPrintsTheRatio) {
  // The child (DPOObjective's step on the post-training model) at its smallest, then one whole run against
  // bench/dpo_peer.py, which refuses to run unless it builds a model of the same parameter count.
  auto r = run_dew("bench --one dpo --threads 1 --steps 1 --warmup 0 --batch 2");
  ASSERT_EQ(r.code, 0) << r.output;
  auto j = result_line(r);
  EXPECT_EQ(j.at("params").get<int64_t>(), kPostTrainingParams);
  // 2 pairs of 48 tokens: 192 policy tokens per step.
  EXPECT_NEAR(j.at("tokens_per_s").get<double>() * j.at("ms_per_step").get<double>(), 192000.0, 1e-6 * 192000.0);
  EXPECT_TRUE(std::isfinite(j.at("loss").get<double>()));
  if (!have_python_torch()) GTEST_SKIP() << DEW_PYTHON " with torch is not available";
  // The whole run also times the peer under torch.compile (this test is the one that compiles: the DPO model is
  // the bench's smallest training step) and opens with the summary's two ratios.
  r = run_dew("bench --models dpo --steps 1 --warmup 0 --batch 2 --threads 1 --blas-threads 1 --rounds 1");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("## dew bench: a DPO training step"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("Speed-up (Python ms/step / C++ ms/step): "), std::string::npos) << r.output;
  ASSERT_EQ(r.output.find("## dew bench: summary"), r.output.find("## dew bench")) << r.output;
  EXPECT_NE(
      r.output.find("| case | unit | C++ | Python eager | Python compiled | vs eager | vs compiled | compile s |"),
      std::string::npos)
      << r.output;
  // The dpo row: C++, eager and compiled times, both ratios and a compile time, none of them missing.
  const auto row = r.output.find("| dpo | ms/step | ");
  ASSERT_NE(row, std::string::npos) << r.output;
  const std::string line = r.output.substr(row, r.output.find('\n', row) - row);
  EXPECT_EQ(line.find(" - "), std::string::npos) << line;
  EXPECT_EQ(std::count(line.begin(), line.end(), 'x'), 2) << line;
  // --no-compile leaves the compiled column empty.
  r = run_dew("bench --models dpo --steps 1 --warmup 0 --batch 2 --threads 1 --blas-threads 1 --rounds 1 --no-compile");
  ASSERT_EQ(r.code, 0) << r.output;
  const auto row2 = r.output.find("| dpo | ms/step | ");
  ASSERT_NE(row2, std::string::npos) << r.output;
  const std::string line2 = r.output.substr(row2, r.output.find('\n', row2) - row2);
  EXPECT_NE(line2.find("x | - | - |"), std::string::npos) << line2;
}

TEST(BenchCli, GrpoRolloutRunsBothSidesAndPrintsTheRatio) {
  // One rollout (128 rows x 16 sampled tokens) per side: the child's numbers, then the whole run against
  // bench/grpo_rollout_peer.py.
  auto r = run_dew("bench --one grpo_rollout --threads 1 --steps 1 --warmup 0");
  ASSERT_EQ(r.code, 0) << r.output;
  auto j = result_line(r);
  EXPECT_EQ(j.at("params").get<int64_t>(), kPostTrainingParams);
  // 16 prompts x group 8 = 128 rows, 16 new tokens each: 2048 generated tokens per rollout.
  EXPECT_NEAR(j.at("tokens_per_s").get<double>() * j.at("ms_per_step").get<double>(), 2048000.0, 1e-6 * 2048000.0);
  EXPECT_GT(j.at("prefill_ms").get<double>(), 0.0);
  if (!have_python_torch()) GTEST_SKIP() << DEW_PYTHON " with torch is not available";
  r = run_dew("bench --models grpo_rollout --steps 1 --warmup 0 --threads 1 --blas-threads 1 --rounds 1");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("## dew bench: a GRPO rollout"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("Speed-up (C++ tokens/s / Python tokens/s, higher is better for C++): "), std::string::npos)
      << r.output;
}

TEST(BenchCli, SdChildrenBuildTheDiffusersConfigs) {
  // The children of `dew bench --models sd_unet,sd_vae` at their smallest: each builds its model from the
  // diffusers config.json dict and counts diffusers' parameters.
  auto r = run_dew("bench --one sd_unet --threads 1 --steps 1 --warmup 0 --batch 1");
  ASSERT_EQ(r.code, 0) << r.output;
  auto j = result_line(r);
  EXPECT_EQ(j.at("params").get<int64_t>(), kSdUnetParams);
  EXPECT_GT(j.at("ms_per_step").get<double>(), 0.0);
  EXPECT_TRUE(std::isfinite(j.at("loss").get<double>()));
  // The LoRA step: the same UNet with its adapters, only they train (the optimizer holds them alone).
  r = run_dew("bench --one sd_unet_lora --threads 1 --steps 2 --warmup 0 --batch 1");
  ASSERT_EQ(r.code, 0) << r.output;
  j = result_line(r);
  EXPECT_EQ(j.at("params").get<int64_t>(), kSdUnetParams + kSdUnetLoraAdapters);
  EXPECT_EQ(j.at("trainable").get<int64_t>(), kSdUnetLoraAdapters);
  EXPECT_TRUE(std::isfinite(j.at("loss").get<double>()));
  r = run_dew("bench --one sd_vae --threads 1 --steps 1 --warmup 0 --batch 1");
  ASSERT_EQ(r.code, 0) << r.output;
  j = result_line(r);
  EXPECT_EQ(j.at("params").get<int64_t>(), kSdVaeParams);
  // encode + decode, no optimizer.
  EXPECT_GT(j.at("phases_ms").at("forward").get<double>(), 0.0);
  EXPECT_GT(j.at("phases_ms").at("backward").get<double>(), 0.0);
  EXPECT_EQ(j.at("phases_ms").at("optimizer").get<double>(), 0.0);
}

TEST(BenchCli, SdRunsWithoutThePeer) {
  // C++ only (--no-peer), then with a diffusers checkout that does not exist: one "peer: unavailable" line and
  // the C++ numbers all the same.
  const std::string tiny = " --steps 1 --warmup 0 --batch 1 --threads 1 --blas-threads 1 --rounds 1";
  auto r = run_dew("bench --models sd_unet,sd_vae --no-peer" + tiny);
  ASSERT_EQ(r.code, 0) << r.output;
  for (const char* needle :
       {"## dew bench: Stable Diffusion components", "### sd_unet: a UNet2DConditionModel training step",
        "### sd_vae: AutoencoderKL encode + decode", "\"_class_name\":\"UNet2DConditionModel\""})
    EXPECT_NE(r.output.find(needle), std::string::npos) << needle << "\n" << r.output;
  EXPECT_EQ(r.output.find("Speed-up"), std::string::npos) << r.output;
  if (!have_python_torch()) GTEST_SKIP() << DEW_PYTHON " with torch is not available";
  r = run_dew("bench --models sd_vae --diffusers-src /nonexistent/diffusers/src" + tiny);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("peer: unavailable (diffusers cannot be imported from /nonexistent/diffusers/src"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("| C++ | intra 1, blas 1 |"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("Speed-up"), std::string::npos) << r.output;
}

TEST(BenchCli, SdRunsBothSidesWithDiffusers) {
  // Against the real diffusers classes (bench/sd_peer.py refuses to run unless its model has the C++ model's
  // parameter count), from the environment's pinned diffusers (scripts/setup installs it).
  if (!have_diffusers()) GTEST_SKIP() << "bench/sd_peer.py --probe cannot import diffusers";
  auto r = run_dew(
      "bench --models sd_unet,sd_unet_lora,sd_vae --steps 1 --warmup 0 --batch 1 --threads 1 --blas-threads 1 "
      "--rounds 1 --no-compile");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(r.output.find("peer: unavailable"), std::string::npos) << r.output;
  // Three step rows in the summary, sd_unet_lora's with the eager ratio; its section.
  for (const char* needle : {"| sd_unet | ms/step | ", "| sd_unet_lora | ms/step | ",
                             "### sd_unet_lora: a LoRA training step of the same UNet"})
    EXPECT_NE(r.output.find(needle), std::string::npos) << needle << "\n" << r.output;
  EXPECT_NE(r.output.find("Speed-up (Python ms/step / C++ ms/step): "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("Speed-up (Python ms/pass / C++ ms/pass): "), std::string::npos) << r.output;
}

TEST(BenchCli, FlowTransformerChildrenBuildTheDiffusersConfigs) {
  // The children of `dew bench --models sd3,flux` at their smallest: each builds its transformer from the
  // diffusers config.json dict and takes the flow-matching step (forward, loss, backward, clip, AdamW).
  for (const auto& [name, params] : {std::pair<std::string, int64_t>{"sd3", kSd3Params}, {"flux", kFluxParams}}) {
    auto r = run_dew("bench --one " + name + " --threads 1 --steps 1 --warmup 0 --batch 1");
    ASSERT_EQ(r.code, 0) << name << "\n" << r.output;
    auto j = result_line(r);
    EXPECT_EQ(j.at("params").get<int64_t>(), params) << name;
    for (const char* phase : {"forward", "backward", "optimizer"})
      EXPECT_GT(j.at("phases_ms").at(phase).get<double>(), 0.0) << name << " " << phase;
    EXPECT_GT(j.at("peak_rss_mb").get<double>(), 0.0) << name;
    EXPECT_TRUE(std::isfinite(j.at("loss").get<double>())) << name;
  }
}

TEST(BenchCli, QwenImageChildTrainsAndSamplesWithAndWithoutTheCache) {
  // `dew bench --one qwen_image` at its smallest: the flow step, then the sampling runs with and without the prefix
  // KV cache, which end on the same latents.
  auto r = run_dew("bench --one qwen_image --threads 1 --steps 1 --warmup 0 --batch 1");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(dew::test::count_lines(r.output), 1u) << r.output;  // the result line alone
  auto j = result_line(r);
  EXPECT_EQ(j.at("params").get<int64_t>(), kQwenImageParams);
  EXPECT_TRUE(std::isfinite(j.at("loss").get<double>()));
  EXPECT_GT(j.at("sample_ms").get<double>(), 0.0);
  EXPECT_GT(j.at("sample_cached_ms").get<double>(), 0.0);
  EXPECT_LE(j.at("sample_cache_max_diff").get<double>(), 1e-5);
}

TEST(BenchCli, QwenImageRunsBothSidesWithItsCacheTable) {
  if (!have_diffusers()) GTEST_SKIP() << "bench/sd_peer.py --probe cannot import diffusers";
  auto r = run_dew(
      "bench --models qwen_image --steps 2 --warmup 0 --batch 1 --threads 1 --blas-threads 1 --rounds 1 --no-compile");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(r.output.find("peer: unavailable"), std::string::npos) << r.output;
  for (const char* needle :
       {"## dew bench: Qwen-Image 2.1 transformer on the CPU", "### qwen_image: a QwenImage21Transformer2DModel",
        "### qwen_image: sampling with and without the prefix KV cache", "| C++ | intra 1, blas 1 |",
        "| Python | intra 1, blas 1 |", "Sampling speed-up with the cache (Python ms/step / C++ ms/step): ",
        "| qwen_image sampling, KV cache | ms/step | "})
    EXPECT_NE(r.output.find(needle), std::string::npos) << needle << "\n" << r.output;
}

TEST(BenchCli, Sd3RunsBothSidesAndPrintsTheRatio) {
  // Against diffusers' own SD3Transformer2DModel (bench/sd_peer.py refuses to run unless its model has the C++
  // model's parameter count): both sides' rows, the ratio and the summary's line; eager only, so it stays short.
  if (!have_diffusers()) GTEST_SKIP() << "bench/sd_peer.py --probe cannot import diffusers";
  auto r =
      run_dew("bench --models sd3 --steps 2 --warmup 0 --batch 1 --threads 1 --blas-threads 1 --rounds 1 --no-compile");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(r.output.find("peer: unavailable"), std::string::npos) << r.output;
  for (const char* needle :
       {"## dew bench: SD3 and Flux transformers", "### sd3: an SD3Transformer2DModel training step",
        "\"_class_name\":\"SD3Transformer2DModel\"", "| C++ | intra 1, blas 1 |", "| Python | intra 1, blas 1 |",
        "Speed-up (Python ms/step / C++ ms/step): "})
    EXPECT_NE(r.output.find(needle), std::string::npos) << needle << "\n" << r.output;
  EXPECT_EQ(r.output.find("### flux"), std::string::npos) << r.output;
  // The summary's sd3 row: C++ and eager times and their ratio; no compiled run.
  ASSERT_EQ(r.output.find("## dew bench: summary"), r.output.find("## dew bench")) << r.output;
  const auto row = r.output.find("| sd3 | ms/step | ");
  ASSERT_NE(row, std::string::npos) << r.output;
  const std::string line = r.output.substr(row, r.output.find('\n', row) - row);
  EXPECT_NE(line.find("x | - | - |"), std::string::npos) << line;
}

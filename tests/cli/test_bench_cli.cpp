// `dew bench --models lm`: argument validation (one-line errors, exit 2) and the measured child's result
// line. No timing is asserted: the machine is shared.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "dew/core/options.h"
#include "tests/test_util.h"

namespace {

constexpr auto& run = dew::test::run_dew;

void one_line_error(const dew::test::CliResult& r, const std::string& needle) {
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << r.output;
  EXPECT_NE(r.output.find(needle), std::string::npos) << r.output;
}

}  // namespace

TEST(BenchCli, LmArgumentsAreValidated) {
  one_line_error(run("bench --seq-len 64"), "--seq-len: only the language model uses it");
  one_line_error(run("bench --models lm --seq-len 0"), "--seq-len: must be >= 1, got 0");
  one_line_error(run("bench --models lm,unet,lm"), "--models: \"lm\" is listed twice");
  one_line_error(run("bench --models lm --lm-peer /nonexistent/lm_peer.py"), "--lm-peer: no such file");
}

TEST(BenchCli, LmChildPrintsOneResultLine) {
  // The child a `dew bench --models lm` run starts per configuration, at its smallest.
  auto r = run("bench --one lm --threads 1 --steps 1 --warmup 0 --batch 1 --seq-len 8");
  ASSERT_EQ(r.code, 0) << r.output;
  std::string line = r.output.substr(0, r.output.find_last_not_of('\n') + 1);  // the result is the last line
  line = line.substr(line.rfind('\n') == std::string::npos ? 0 : line.rfind('\n') + 1);
  auto j = dew::json::parse(line);
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
  // two count the same parameters (the peer refuses to run otherwise), computed by hand here:
  // encoder = patch conv 16*128 + 128, 4 blocks of (2 LayerNorms 4*128, qkv 128*384 + 384, proj 128*128 + 128,
  // MLP 128*512 + 512 + 512*128 + 128), final norm 2*128; predictor = embed 128*64 + 64, mask token 64,
  // 4 blocks at width 64, norm 2*64, projection 64*128 + 128.
  auto r = run("bench --one jepa --threads 1 --steps 1 --warmup 0 --batch 2");
  ASSERT_EQ(r.code, 0) << r.output;
  std::string line = r.output.substr(0, r.output.find_last_not_of('\n') + 1);
  line = line.substr(line.rfind('\n') == std::string::npos ? 0 : line.rfind('\n') + 1);
  auto j = dew::json::parse(line);
  auto block = [](int64_t d) { return 4 * d + d * 3 * d + 3 * d + d * d + d + d * 4 * d + 4 * d + 4 * d * d + d; };
  const int64_t encoder = 16 * 128 + 128 + 4 * block(128) + 2 * 128;
  const int64_t predictor = 128 * 64 + 64 + 64 + 4 * block(64) + 2 * 64 + 64 * 128 + 128;
  EXPECT_EQ(j.at("params").get<int64_t>(), encoder + predictor);
  EXPECT_GT(j.at("ms_per_step").get<double>(), 0.0);
  EXPECT_TRUE(std::isfinite(j.at("loss").get<double>()));
}

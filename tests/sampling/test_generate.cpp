// KV-cache generation: logit filters against hand-computed distributions, greedy determinism, padded
// batches equal single prompts (left and right padding), seeds, EOS and stop strings, log-probs.
#include <gtest/gtest.h>

#include <cmath>

#include "dew/sampling/generate.h"
#include "tests/test_util.h"

using dew::sampling::GenerationOptions;

namespace {

at::Tensor probs_after(const std::vector<double>& p, const GenerationOptions& o, const at::Tensor& seen = {}) {
  at::Tensor logits = torch::tensor(p, torch::kDouble).log().to(torch::kFloat).view({1, -1});
  return at::softmax(dew::sampling::process_logits(logits, seen, o), -1).view({-1});
}

void expect_probs(const at::Tensor& got, const std::vector<double>& want) {
  ASSERT_EQ(got.numel(), int64_t(want.size()));
  for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(got[int64_t(i)].item<double>(), want[i], 1e-6) << i;
}

dew::nn::CausalTransformer tiny_lm() {
  torch::manual_seed(5);
  dew::nn::CausalTransformer m(dew::nn::CausalTransformerOptions()
                                   .vocab_size(17)
                                   .emb_features(32)
                                   .num_layers(2)
                                   .num_heads(4)
                                   .num_kv_heads(2)
                                   .layer_types({"sliding_attention", "full_attention"})
                                   .sliding_window(4)
                                   .max_seq_len(64));
  torch::NoGradGuard ng;
  for (auto& p : m->parameters()) p.add_(torch::randn_like(p) * 0.3);  // peaked, varied distributions
  return m;
}

}  // namespace

TEST(Generate, FiltersMatchHandComputedDistributions) {
  const std::vector<double> p{0.1, 0.2, 0.3, 0.25, 0.15};
  GenerationOptions o;
  expect_probs(probs_after(p, o), p);
  o.top_k = 2;  // {0.3, 0.25} renormalised
  expect_probs(probs_after(p, o), {0, 0, 0.3 / 0.55, 0.25 / 0.55, 0});
  o = {};
  o.top_p = 0.6;  // sorted 0.3, 0.25, 0.2 (mass before it 0.55 < 0.6), then 0.15 (0.75): keep three
  expect_probs(probs_after(p, o), {0, 0.2 / 0.75, 0.3 / 0.75, 0.25 / 0.75, 0});
  o.top_p = 0.29;  // the top token alone reaches it
  expect_probs(probs_after(p, o), {0, 0, 1, 0, 0});
  o = {};
  o.min_p = 0.7;  // threshold 0.21: keep 0.3 and 0.25
  expect_probs(probs_after(p, o), {0, 0, 0.3 / 0.55, 0.25 / 0.55, 0});
  o = {};
  o.temperature = 0.5;  // p^2 renormalised
  double z = 0;
  for (double x : p) z += x * x;
  expect_probs(probs_after(p, o), {0.01 / z, 0.04 / z, 0.09 / z, 0.0625 / z, 0.0225 / z});
  // repetition penalty 2 on tokens 0 and 1: positive logits halve, negative ones double
  o = {};
  o.repetition_penalty = 2.0;
  at::Tensor logits = torch::tensor({2.0f, -1.0f, 0.5f}).view({1, 3});
  at::Tensor seen = torch::tensor({true, true, false}).view({1, 3});
  at::Tensor out = dew::sampling::process_logits(logits, seen, o);
  EXPECT_TRUE(out.equal(torch::tensor({1.0f, -2.0f, 0.5f}).view({1, 3})));
}

TEST(Generate, GreedyIsDeterministicAndPaddingDoesNotChangeRows) {
  auto m = tiny_lm();
  GenerationOptions o;
  o.temperature = 0;
  o.max_new_tokens = 8;
  std::vector<std::vector<int64_t>> prompts{{1, 2, 3, 4, 5, 6}, {7}, {8, 9, 10}};
  auto a = dew::sampling::generate_tokens(*m, prompts, o);
  auto b = dew::sampling::generate_tokens(*m, prompts, o);
  EXPECT_EQ(a.tokens, b.tokens);
  o.padding = "right";
  auto r = dew::sampling::generate_tokens(*m, prompts, o);
  EXPECT_EQ(r.tokens, a.tokens);
  for (size_t i = 0; i < prompts.size(); ++i) {
    o.padding = "left";
    auto alone = dew::sampling::generate_tokens(*m, {prompts[i]}, o);
    EXPECT_EQ(alone.tokens[0], a.tokens[i]) << "prompt " << i;
    for (size_t t = 0; t < alone.raw_logprobs[0].size(); ++t)
      EXPECT_NEAR(alone.raw_logprobs[0][t], a.raw_logprobs[i][t], 1e-4);
  }
  // Greedy picks the argmax of the model's own distribution: its log-prob is the largest.
  at::NoGradGuard ng;
  at::Tensor full = m->forward_tokens(torch::tensor(prompts[1], torch::kLong).view({1, -1}));
  at::Tensor lp = at::log_softmax(full[0][-1], -1);
  EXPECT_EQ(a.tokens[1][0], lp.argmax().item<int64_t>());
  EXPECT_NEAR(a.raw_logprobs[1][0], lp.max().item<double>(), 1e-5);
  EXPECT_EQ(a.lengths, (std::vector<int64_t>{8, 8, 8}));
}

TEST(Generate, SamplingFollowsTheSeedAndReportsBothLogProbs) {
  auto m = tiny_lm();
  GenerationOptions o;
  o.temperature = 0.7;
  o.top_k = 5;
  o.max_new_tokens = 12;
  o.seed = 11;
  auto a = dew::sampling::generate_tokens(*m, {{1, 2}, {3}}, o);
  auto b = dew::sampling::generate_tokens(*m, {{1, 2}, {3}}, o);
  EXPECT_EQ(a.tokens, b.tokens);
  bool differs = false;
  for (uint64_t s = 12; s < 16 && !differs; ++s) {
    o.seed = s;
    differs = dew::sampling::generate_tokens(*m, {{1, 2}, {3}}, o).tokens != a.tokens;
  }
  EXPECT_TRUE(differs);
  // Sampled distribution: tempered and top-k'd, so its log-probs differ from the model's own.
  for (size_t t = 0; t < a.logprobs[0].size(); ++t) {
    EXPECT_LE(a.logprobs[0][t], 0.0);
    EXPECT_LE(a.raw_logprobs[0][t], 0.0);
  }
  EXPECT_NE(a.logprobs[0], a.raw_logprobs[0]);
}

// Each row samples from its own stream: a row's tokens do not depend on the rows beside it, so a batch split in
// two (first_row naming where the second part starts) samples what the whole batch samples.
TEST(Generate, ARowsTokensDoNotDependOnTheRowsBesideIt) {
  auto m = tiny_lm();
  GenerationOptions o;
  o.max_new_tokens = 10;
  o.seed = 3;
  const std::vector<std::vector<int64_t>> prompts = {{1, 2}, {3}, {4, 5, 6}, {7}};
  const auto whole = dew::sampling::generate_tokens(*m, prompts, o);
  const auto head = dew::sampling::generate_tokens(*m, {prompts[0], prompts[1]}, o);
  o.first_row = 2;
  const auto tail = dew::sampling::generate_tokens(*m, {prompts[2], prompts[3]}, o);
  EXPECT_EQ(head.tokens[0], whole.tokens[0]);
  EXPECT_EQ(head.tokens[1], whole.tokens[1]);
  EXPECT_EQ(tail.tokens[0], whole.tokens[2]);
  EXPECT_EQ(tail.tokens[1], whole.tokens[3]);
  EXPECT_NE(tail.tokens[0], head.tokens[0]);
}

// The draws follow the processed distribution: 4000 rows of one prompt, one token each, against the model's own
// softmax of its top-5 logits at temperature 0.8 (Pearson's chi-square, 4 degrees of freedom; 18.5 is its
// 0.999 quantile).
TEST(Generate, SampledTokensFollowTheProcessedDistribution) {
  auto m = tiny_lm();
  const std::vector<int64_t> prompt = {1, 2, 3};
  at::Tensor logits;
  {
    torch::NoGradGuard ng;
    m->eval();
    logits = m->forward_tokens(torch::tensor(prompt).view({1, -1}), {}, {}, {}, nullptr).select(1, 2);  // [1, V]
  }
  auto [top, ids] = (logits.to(at::kDouble) / 0.8).topk(5, -1);
  const at::Tensor want = at::softmax(top, -1).view({-1});
  GenerationOptions o;
  o.max_new_tokens = 1;
  o.temperature = 0.8;
  o.top_k = 5;
  o.seed = 21;
  const int64_t n = 4000;
  const auto out = dew::sampling::generate_tokens(*m, std::vector<std::vector<int64_t>>(size_t(n), prompt), o);
  std::vector<double> count(5, 0.0);
  for (const auto& t : out.tokens) {
    ASSERT_EQ(t.size(), 1u);
    int64_t k = 0;
    while (k < 5 && ids[0][k].item<int64_t>() != t[0]) ++k;
    ASSERT_LT(k, 5) << "token " << t[0] << " is outside the top 5";
    count[size_t(k)] += 1;
  }
  double chi2 = 0;
  for (int64_t k = 0; k < 5; ++k) {
    const double e = double(n) * want[k].item<double>();
    chi2 += (count[size_t(k)] - e) * (count[size_t(k)] - e) / e;
  }
  std::printf("chi-square over the top 5: %.2f (counts %.0f %.0f %.0f %.0f %.0f)\n", chi2, count[0], count[1], count[2],
              count[3], count[4]);
  EXPECT_LT(chi2, 18.5);
}

TEST(Generate, StopsAtEosAndStopStrings) {
  auto m = tiny_lm();
  GenerationOptions o;
  o.temperature = 0;
  o.max_new_tokens = 10;
  auto free_run = dew::sampling::generate_tokens(*m, {{1, 2, 3}}, o);
  ASSERT_EQ(free_run.tokens[0].size(), 10u);
  o.eos_id = free_run.tokens[0][3];
  auto e = dew::sampling::generate_tokens(*m, {{1, 2, 3}}, o);
  size_t first = 0;
  while (free_run.tokens[0][first] != o.eos_id) ++first;
  EXPECT_EQ(e.tokens[0], std::vector<int64_t>(free_run.tokens[0].begin(), free_run.tokens[0].begin() + first + 1));
  EXPECT_EQ(e.finish_reason[0], "eos");
  // stop strings over a decode that writes each id as a letter
  o.eos_id = -1;
  o.decode = [](const std::vector<int64_t>& ids) {
    std::string s;
    for (auto i : ids) s += char('a' + i);
    return s;
  };
  std::string text = o.decode(free_run.tokens[0]);
  o.stop = {text.substr(4, 2)};
  auto s = dew::sampling::generate_tokens(*m, {{1, 2, 3}}, o);
  EXPECT_EQ(s.finish_reason[0], "stop");
  EXPECT_NE(o.decode(s.tokens[0]).find(o.stop[0]), std::string::npos);
  EXPECT_LE(s.tokens[0].size(), 6u);
}

TEST(Generate, BadOptionsNameTheField) {
  auto m = tiny_lm();
  using dew::test::error_of;
  GenerationOptions o;
  o.top_p = 0;
  EXPECT_NE(error_of([&] { dew::sampling::generate_tokens(*m, {{1}}, o); }).find("top_p"), std::string::npos);
  o = {};
  o.padding = "middle";
  EXPECT_NE(error_of([&] { dew::sampling::generate_tokens(*m, {{1}}, o); }).find("left, right"), std::string::npos);
  o = {};
  EXPECT_NE(error_of([&] { dew::sampling::generate_tokens(*m, {{}}, o); }).find("empty"), std::string::npos);
  EXPECT_NE(error_of([&] { dew::sampling::generate_tokens(*m, {{99}}, o); }).find("99"), std::string::npos);
  o.max_new_tokens = 100;
  EXPECT_NE(error_of([&] { dew::sampling::generate_tokens(*m, {{1}}, o); }).find("max_seq_len"), std::string::npos);
}

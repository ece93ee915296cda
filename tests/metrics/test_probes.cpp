// Probes and collapse statistics: separable data is classified perfectly, random labels at chance, the kNN
// vote equals DINO's weighted kNN (golden from tests/golden/knn_reference.py) and hand-computed votes, and the
// statistics equal their hand-computed values.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>

#include "dew/metrics/probes.h"
#include "tests/golden_util.h"
#include "tests/test_util.h"

namespace {

// Four well separated Gaussian clusters in 8 dimensions (class k centred at 6 e_k).
std::pair<at::Tensor, at::Tensor> clusters(int64_t n, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  at::Tensor y = at::randint(0, 4, {n}, gen, at::kLong);
  at::Tensor x = at::randn({n, 8}, gen, at::kFloat);
  x.scatter_add_(1, y.unsqueeze(1), at::full({n, 1}, 6.0f));
  return {x, y};
}

TEST(Probes, SeparableClassesAreClassifiedPerfectly) {
  auto [xtr, ytr] = clusters(400, 1);
  auto [xte, yte] = clusters(200, 2);
  EXPECT_EQ(dew::metrics::linear_probe_accuracy(xtr, ytr, xte, yte, 4), 1.0);
  EXPECT_EQ(dew::metrics::knn_accuracy(xtr, ytr, xte, yte, 4, {20}), 1.0);
}

TEST(Probes, RandomLabelsScoreAtChance) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
  at::Tensor xtr = at::randn({2000, 16}, gen), xte = at::randn({2000, 16}, gen);
  at::Tensor ytr = at::randint(0, 4, {2000}, gen, at::kLong), yte = at::randint(0, 4, {2000}, gen, at::kLong);
  // chance is 0.25; 2000 test rows give a standard error of about 0.01
  EXPECT_NEAR(dew::metrics::linear_probe_accuracy(xtr, ytr, xte, yte, 4), 0.25, 0.04);
  EXPECT_NEAR(dew::metrics::knn_accuracy(xtr, ytr, xte, yte, 4, {20}), 0.25, 0.04);
}

TEST(Probes, KnnVotesByCosineSimilarity) {
  // Scale does not matter under cosine similarity: the query 100 (1, 0.1) is nearest in angle to the two
  // class-1 rows along (1, 0), though the class-0 rows are nearer in Euclidean distance.
  at::Tensor xtr = torch::tensor({{10.f, 0.f}, {20.f, 0.5f}, {90.f, 60.f}, {100.f, 80.f}});
  at::Tensor ytr = torch::tensor({1, 1, 0, 0}, at::kLong);
  at::Tensor xte = torch::tensor({{100.f, 10.f}});
  EXPECT_EQ(dew::metrics::knn_accuracy(xtr, ytr, xte, torch::tensor({1}, at::kLong), 2, {2}), 1.0);
  EXPECT_EQ(dew::metrics::knn_accuracy(xtr, ytr, xte, torch::tensor({0}, at::kLong), 2, {2}), 0.0);
}

TEST(Probes, KnnWeightedVoteEqualsDinosKnnClassifier) {
  // DINO's eval_knn.py knn_classifier on 400 training / 200 test rows of 16 dimensions, 5 overlapping classes;
  // its per-item top-1 classes and hit counts (tests/golden/knn/dino_knn.safetensors).
  const auto g = dew::test::golden("knn/dino_knn.safetensors");
  struct Case {
    const char* name;
    int64_t k;
    double temperature;
  };
  for (const Case c : {Case{"k20_t0.07", 20, 0.07}, Case{"k50_t0.02", 50, 0.02}}) {
    SCOPED_TRACE(c.name);
    dew::metrics::KnnOptions o;
    o.k = c.k;
    o.temperature = c.temperature;
    ASSERT_EQ(o.vote, "weighted");  // the default
    const at::Tensor pred = dew::metrics::knn_predict(g.at("train_x"), g.at("train_y"), g.at("test_x"), 5, o);
    const at::Tensor want = g.at(std::string(c.name) + ".pred");
    EXPECT_TRUE(pred.equal(want)) << "items that differ: " << pred.ne(want).sum().item<int64_t>();
    const int64_t correct = g.at(std::string(c.name) + ".correct").item<int64_t>();
    EXPECT_EQ(dew::metrics::knn_accuracy(g.at("train_x"), g.at("train_y"), g.at("test_x"), g.at("test_y"), 5, o),
              double(correct) / 200.0);
    // The problem tells the votes apart: a count gives other classes on some items.
    o.vote = "majority";
    EXPECT_GT(dew::metrics::knn_predict(g.at("train_x"), g.at("train_y"), g.at("test_x"), 5, o)
                  .ne(want)
                  .sum()
                  .item<int64_t>(),
              0);
  }
}

TEST(Probes, KnnWeightedAndMajorityVotesDisagreeWhereTheyShould) {
  // The query (1, 0) has cosine 1 with the class-0 row (2, 0), 0.8 with the two class-1 rows (0.8, +-0.6) and
  // -1 with the class-0 row (-1, 0), so its k = 3 neighbours are one class-0 and two class-1 rows.
  //   majority: 1 vote against 2, class 1.
  //   weighted: exp(1 / T) against 2 exp(0.8 / T): class 0 for T < 0.2 / ln 2 = 0.289, class 1 above.
  //   T = 0.07: e^14.29 = 1.6e6 against 2 e^11.43 = 1.8e5, class 0; T = 1: 2.72 against 4.45, class 1.
  const at::Tensor xtr = torch::tensor({{2.f, 0.f}, {0.8f, 0.6f}, {0.8f, -0.6f}, {-1.f, 0.f}});
  const at::Tensor ytr = torch::tensor({0, 1, 1, 0}, at::kLong);
  const at::Tensor xte = torch::tensor({{1.f, 0.f}});
  const auto pred = [&](const std::string& vote, double t) {
    return dew::metrics::knn_predict(xtr, ytr, xte, 2, {3, "none", vote, t}).item<int64_t>();
  };
  EXPECT_EQ(pred("majority", 0.07), 1);
  EXPECT_EQ(pred("weighted", 0.07), 0);
  EXPECT_EQ(pred("weighted", 0.28), 0);
  EXPECT_EQ(pred("weighted", 0.30), 1);
  EXPECT_EQ(pred("weighted", 1.0), 1);
  EXPECT_EQ(pred("weighted", 1e-4), 0);  // exp(-0.2 / 1e-4) underflows; the nearest neighbour still counts
  // The default options are DINO's: k 20, weighted, T 0.07.
  const dew::metrics::KnnOptions d;
  EXPECT_EQ(d.k, 20);
  EXPECT_EQ(d.vote, "weighted");
  EXPECT_EQ(d.temperature, 0.07);
  EXPECT_EQ(d.prep, "none");
}

TEST(Probes, KnnMajorityTieGoesToTheLargerSummedSimilarity) {
  // k = 4: two class-0 rows at cosines 0.6 and 0.6, two class-1 rows at 1.0 and 0.0 (summed 1.2 against 1.0);
  // a 2-2 count, won by class 0. Weighted, class 1 wins: e^(1/T) + 1 > 2 e^(0.6/T) for T = 0.07.
  const at::Tensor xtr = torch::tensor({{0.6f, 0.8f}, {0.6f, -0.8f}, {1.f, 0.f}, {0.f, 1.f}, {-1.f, 0.f}});
  const at::Tensor ytr = torch::tensor({0, 0, 1, 1, 0}, at::kLong);
  const at::Tensor xte = torch::tensor({{1.f, 0.f}});
  EXPECT_EQ(dew::metrics::knn_predict(xtr, ytr, xte, 2, {4, "none", "majority"}).item<int64_t>(), 0);
  EXPECT_EQ(dew::metrics::knn_predict(xtr, ytr, xte, 2, {4, "none", "weighted"}).item<int64_t>(), 1);
}

TEST(Probes, KnnCentringMovesTheOriginToTheTrainingMean) {
  // The rows of KnnVotesByCosineSimilarity less their mean (55, 35.125): the query becomes (45, -25.125),
  // whose cosines with the class-0 rows (35, 24.875) and (45, 44.875) are 0.43 and 0.27, while both class-1
  // rows point away from it (-0.49 and -0.16). Standardising (column stds 46.55 and 41.09) keeps that order.
  at::Tensor xtr = torch::tensor({{10.f, 0.f}, {20.f, 0.5f}, {90.f, 60.f}, {100.f, 80.f}});
  at::Tensor ytr = torch::tensor({1, 1, 0, 0}, at::kLong);
  at::Tensor xte = torch::tensor({{100.f, 10.f}});
  const at::Tensor zero = torch::tensor({0}, at::kLong);
  EXPECT_EQ(dew::metrics::knn_accuracy(xtr, ytr, xte, zero, 2, {2, "none"}), 0.0);
  EXPECT_EQ(dew::metrics::knn_accuracy(xtr, ytr, xte, zero, 2, {2, "center"}), 1.0);
  EXPECT_EQ(dew::metrics::knn_accuracy(xtr, ytr, xte, zero, 2, {2, "standardize"}), 1.0);
  EXPECT_NE(dew::test::error_of([&] {
              dew::metrics::knn_accuracy(xtr, ytr, xte, zero, 2, {2, "whiten"});
            }).find("prep must be none, center or standardize, got \"whiten\""),
            std::string::npos);
}

TEST(Probes, RepresentationStatisticsOfKnownMatrices) {
  // Columns (1, -1, 1, -1) and (2, 2, -2, -2): stds 2/sqrt(3) * (1, 2), covariance 0 between them.
  at::Tensor f = torch::tensor({{1., 2.}, {-1., 2.}, {1., -2.}, {-1., -2.}});
  auto s = dew::metrics::representation_stats(f);
  EXPECT_NEAR(s.std, (std::sqrt(4.0 / 3.0) + std::sqrt(16.0 / 3.0)) / 2.0, 1e-12);
  EXPECT_NEAR(s.cov_offdiag, 0.0, 1e-12);
  // Perfectly correlated columns x and 3x, x = (0, 1, 2): var(x) = 1, cov = 3; off-diagonal sum 2 * 9 over D = 2.
  at::Tensor g = torch::tensor({{0., 0.}, {1., 3.}, {2., 6.}});
  s = dew::metrics::representation_stats(g);
  EXPECT_NEAR(s.std, (1.0 + 3.0) / 2.0, 1e-12);
  EXPECT_NEAR(s.cov_offdiag, 9.0, 1e-12);
  // A collapsed representation: every row the same.
  s = dew::metrics::representation_stats(torch::ones({10, 5}));
  EXPECT_EQ(s.std, 0.0);
  EXPECT_EQ(s.cov_offdiag, 0.0);
}

TEST(Probes, BadInputsAreRefused) {
  at::Tensor x = torch::randn({10, 3});
  at::Tensor y = torch::zeros({10}, at::kLong);
  EXPECT_NE(dew::test::error_of([&] { dew::metrics::knn_accuracy(x, y, x, y, 2, {11}); }).find("k must be in [1, 10]"),
            std::string::npos);
  EXPECT_NE(dew::test::error_of([&] {
              dew::metrics::linear_probe_accuracy(x, y + 5, x, y, 2);
            }).find("labels must be in [0, 2)"),
            std::string::npos);
  EXPECT_NE(dew::test::error_of([&] {
              dew::metrics::knn_accuracy(x, y, torch::randn({4, 2}), y.slice(0, 0, 4), 2, {3});
            }).find("differ in width"),
            std::string::npos);
  EXPECT_NE(dew::test::error_of([&] {
              dew::metrics::knn_accuracy(x, y, x, y, 2, {3, "none", "vote"});
            }).find("vote must be weighted or majority, got \"vote\""),
            std::string::npos);
  EXPECT_NE(dew::test::error_of([&] {
              dew::metrics::knn_accuracy(x, y, x, y, 2, {3, "none", "weighted", 0.0});
            }).find("temperature must be finite and > 0, got 0"),
            std::string::npos);
}

}  // namespace

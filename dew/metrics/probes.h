// Probes of frozen features (docs/jepa.md, docs/evaluation.md): a linear probe (softmax regression on standardised
// features) and a cosine kNN classifier (DINO's weighted vote by default), and the collapse statistics of
// a representation.
//
//   double lin = dew::metrics::linear_probe_accuracy(train_f, train_y, test_f, test_y, 10);  // f: [N, D]
//   double knn = dew::metrics::knn_accuracy(train_f, train_y, test_f, test_y, 10, {20});      // k = 20
//   auto s = dew::metrics::representation_stats(features);   // s.std -> 0 when the features collapse
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

namespace dew::metrics {

struct LinearProbeOptions {
  double lr = 1e-2;            // AdamW learning rate (constant)
  double weight_decay = 1e-4;  // AdamW decoupled weight decay on the weight matrix
  int64_t epochs = 30;         // passes over the training features
  int64_t batch_size = 256;    // mini-batch rows
  uint64_t seed = 0;           // the shuffles derive from it
};

/// Accuracy on (test_x, test_y) of a softmax regression fitted to (train_x, train_y): features [N, D]
/// standardised by the training mean and std, labels int64 [N] in [0, classes), zero-initialised weights,
/// AdamW with cross entropy over shuffled mini-batches. dew::Error on mismatched shapes or labels.
double linear_probe_accuracy(const at::Tensor& train_x, const at::Tensor& train_y, const at::Tensor& test_x,
                             const at::Tensor& test_y, int64_t classes, const LinearProbeOptions& o = {});

struct KnnOptions {
  int64_t k = 20;                 // neighbours, the most similar training rows under cosine similarity
  std::string prep = "none";      // none | center | standardize (knn_preps)
  std::string vote = "weighted";  // weighted | majority (knn_votes)
  double temperature = 0.07;      // weighted: a neighbour of similarity s votes exp(s / temperature)
};
/// Accepted KnnOptions::prep values: none, center, standardize.
const std::vector<std::string>& knn_preps();
/// Accepted KnnOptions::vote values: weighted, majority.
const std::vector<std::string>& knn_votes();

/// The k-nearest-neighbour class of each test row [M, D] (int64 [M]) under cosine similarity to the training
/// rows [N, D]. Each of the k most similar training rows votes for its class:
///   weighted  with exp(similarity / temperature), summed per class (DINO's eval_knn.py knn_classifier,
///             T = 0.07);
///   majority  with 1 (a count).
/// The class with the largest vote wins; a tie goes to the tied class with the larger summed similarity.
/// `prep` first shifts both sets by the training mean ("center") and also divides by the training std
/// ("standardize"), or leaves them ("none"). dew::Error on bad shapes, labels or options.
at::Tensor knn_predict(const at::Tensor& train_x, const at::Tensor& train_y, const at::Tensor& test_x, int64_t classes,
                       const KnnOptions& o = {});
/// The fraction of test rows whose knn_predict class is test_y.
double knn_accuracy(const at::Tensor& train_x, const at::Tensor& train_y, const at::Tensor& test_x,
                    const at::Tensor& test_y, int64_t classes, const KnnOptions& o = {});

/// Collapse statistics of features [N, D] (N >= 2), float64 with unbiased (N - 1) moments:
///   std         = mean over dimensions of the standard deviation over rows (0 for a collapsed representation)
///   cov_offdiag = sum of the squared off-diagonal covariances / D (VICReg's covariance term)
struct ReprStats {
  double std = 0;
  double cov_offdiag = 0;
};
ReprStats representation_stats(const at::Tensor& features);

}  // namespace dew::metrics

#include "dew/metrics/probes.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "dew/core/error.h"
#include "dew/core/rng.h"
#include "dew/io/stops.h"
#include "dew/training/optim.h"

namespace dew::metrics {

namespace {

void check_set(const at::Tensor& x, const at::Tensor& y, int64_t classes, const char* what) {
  DEW_CHECK(x.defined() && x.dim() == 2 && x.size(0) >= 1, what, " features must be [N, D] with N >= 1, got ",
            x.defined() ? x.sizes() : at::IntArrayRef{});
  DEW_CHECK(y.defined() && y.dim() == 1 && y.size(0) == x.size(0) && y.scalar_type() == at::kLong, what,
            " labels must be int64 [", x.size(0), "], got ", y.defined() ? y.sizes() : at::IntArrayRef{});
  DEW_CHECK(classes >= 2, "probe: classes must be >= 2, got ", classes);
  const auto lo = y.min().item<int64_t>(), hi = y.max().item<int64_t>();
  DEW_CHECK(lo >= 0 && hi < classes, what, " labels must be in [0, ", classes, "), got [", lo, ", ", hi, "]");
}

void check_pair(const at::Tensor& train_x, const at::Tensor& train_y, const at::Tensor& test_x,
                const at::Tensor& test_y, int64_t classes) {
  check_set(train_x, train_y, classes, "probe: training");
  check_set(test_x, test_y, classes, "probe: test");
  DEW_CHECK(train_x.size(1) == test_x.size(1), "probe: training and test features differ in width: ", train_x.size(1),
            " vs ", test_x.size(1));
}

}  // namespace

double linear_probe_accuracy(const at::Tensor& train_x, const at::Tensor& train_y, const at::Tensor& test_x,
                             const at::Tensor& test_y, int64_t classes, const LinearProbeOptions& o) {
  check_pair(train_x, train_y, test_x, test_y, classes);
  DEW_CHECK(o.epochs >= 1 && o.batch_size >= 1 && o.lr > 0 && o.weight_decay >= 0,
            "linear probe: needs epochs >= 1, batch_size >= 1, lr > 0, weight_decay >= 0; got ", o.epochs, ", ",
            o.batch_size, ", ", o.lr, ", ", o.weight_decay);
  at::AutoGradMode grad(true);  // also under a caller's no-grad guard (validation)
  at::Tensor xtr = train_x.to(at::kFloat).cpu().detach(), xte = test_x.to(at::kFloat).cpu().detach();
  const at::Tensor mean = xtr.mean(0, true), std = xtr.std(0, /*unbiased=*/true, true).clamp_min(1e-6);
  xtr = (xtr - mean) / std;
  xte = (xte - mean) / std;
  const int64_t n = xtr.size(0), d = xtr.size(1);
  at::Tensor w = at::zeros({classes, d}).set_requires_grad(true), b = at::zeros({classes}).set_requires_grad(true);
  training::OptimOptions oo;
  oo.name = "adamw";
  oo.lr = o.lr;
  oo.weight_decay = o.weight_decay;
  training::Optimizer opt({{"weight", w}, {"bias", b}}, oo);
  const at::Tensor ytr = train_y.cpu();
  for (int64_t epoch = 0; epoch < o.epochs; ++epoch) {
    io::check_stop();  // `dew eval` stopped by a signal (a no-op during training)
    auto gen = rng::generator(o.seed, uint64_t(epoch), "linear_probe");
    const at::Tensor order = at::randperm(n, gen, at::kLong);
    for (int64_t s = 0; s < n; s += o.batch_size) {
      const at::Tensor idx = order.slice(0, s, std::min(n, s + o.batch_size));
      opt.zero_grad();
      at::cross_entropy_loss(at::linear(xtr.index_select(0, idx), w, b), ytr.index_select(0, idx)).backward();
      opt.step(o.lr);
    }
  }
  at::NoGradGuard ng;
  const at::Tensor pred = at::linear(xte, w, b).argmax(1);
  return pred.eq(test_y.cpu()).to(at::kDouble).mean().item<double>();
}

const std::vector<std::string>& knn_preps() {
  static const std::vector<std::string> v{"none", "center", "standardize"};
  return v;
}

const std::vector<std::string>& knn_votes() {
  static const std::vector<std::string> v{"weighted", "majority"};
  return v;
}

at::Tensor knn_predict(const at::Tensor& train_x, const at::Tensor& train_y, const at::Tensor& test_x, int64_t classes,
                       const KnnOptions& o) {
  check_set(train_x, train_y, classes, "probe: training");
  DEW_CHECK(test_x.defined() && test_x.dim() == 2 && test_x.size(0) >= 1,
            "probe: test features must be [N, D] with N >= 1, got ",
            test_x.defined() ? test_x.sizes() : at::IntArrayRef{});
  DEW_CHECK(train_x.size(1) == test_x.size(1), "probe: training and test features differ in width: ", train_x.size(1),
            " vs ", test_x.size(1));
  DEW_CHECK(o.k >= 1 && o.k <= train_x.size(0), "knn: k must be in [1, ", train_x.size(0),
            "] (the training rows), got ", o.k);
  const auto accepted = [](const std::vector<std::string>& ok, const std::string& v) {
    return std::find(ok.begin(), ok.end(), v) != ok.end();
  };
  DEW_CHECK(accepted(knn_preps(), o.prep), "knn: prep must be none, center or standardize, got \"", o.prep, "\"");
  DEW_CHECK(accepted(knn_votes(), o.vote), "knn: vote must be weighted or majority, got \"", o.vote, "\"");
  DEW_CHECK(std::isfinite(o.temperature) && o.temperature > 0, "knn: temperature must be finite and > 0, got ",
            o.temperature);
  at::NoGradGuard ng;
  at::Tensor xtr = train_x.to(at::kFloat).cpu(), xte = test_x.to(at::kFloat).cpu();
  if (o.prep != "none") {
    at::Tensor mean = xtr.mean(0, true), scale = at::ones_like(mean);
    if (o.prep == "standardize") scale = xtr.std(0, /*unbiased=*/true, true).clamp_min(1e-6);
    xtr = (xtr - mean) / scale;
    xte = (xte - mean) / scale;
  }
  const auto unit = [](const at::Tensor& f) { return f / f.norm(2, 1, true).clamp_min(1e-12); };
  const at::Tensor a = unit(xtr), q = unit(xte), ytr = train_y.cpu();
  std::vector<at::Tensor> out;
  for (int64_t s = 0; s < q.size(0); s += 1024) {  // blocks of queries bound the similarity matrix
    const at::Tensor sim = at::matmul(q.slice(0, s, std::min(q.size(0), s + 1024)), a.t());  // [b, N]
    const auto top = sim.topk(o.k, 1);                                                       // sorted, largest first
    const at::Tensor near = std::get<0>(top).to(at::kDouble), labels = ytr.index({std::get<1>(top)});  // [b, k]
    // The weights exp(s / T) less the common factor exp(s_1 / T) of the nearest neighbour, which orders the
    // classes as they are and cannot underflow to 0 for a small T.
    const at::Tensor weight =
        o.vote == "weighted" ? ((near - near.narrow(1, 0, 1)) / o.temperature).exp() : at::ones_like(near);
    const at::Tensor votes = at::zeros({labels.size(0), classes}, at::kDouble).scatter_add_(1, labels, weight);
    const at::Tensor summed = at::zeros({labels.size(0), classes}, at::kDouble).scatter_add_(1, labels, near);
    // Among the classes with the largest vote (>= the nearest neighbour's weight 1 > 0, so only voted-for
    // classes), the one with the larger summed similarity.
    const at::Tensor best = votes.eq(std::get<0>(votes.max(1, true)));
    out.push_back(summed.masked_fill(best.logical_not(), -std::numeric_limits<double>::infinity()).argmax(1));
  }
  return at::cat(out);
}

double knn_accuracy(const at::Tensor& train_x, const at::Tensor& train_y, const at::Tensor& test_x,
                    const at::Tensor& test_y, int64_t classes, const KnnOptions& o) {
  check_pair(train_x, train_y, test_x, test_y, classes);
  const at::Tensor pred = knn_predict(train_x, train_y, test_x, classes, o);
  return double(pred.eq(test_y.cpu()).sum().item<int64_t>()) / double(test_x.size(0));
}

ReprStats representation_stats(const at::Tensor& features) {
  DEW_CHECK(features.defined() && features.dim() == 2 && features.size(0) >= 2,
            "representation_stats: features must be [N, D] with N >= 2, got ",
            features.defined() ? features.sizes() : at::IntArrayRef{});
  at::NoGradGuard ng;
  const at::Tensor f = features.to(at::kDouble);
  const int64_t n = f.size(0), d = f.size(1);
  const at::Tensor c = f - f.mean(0, true);
  const at::Tensor cov = at::matmul(c.t(), c) / double(n - 1);  // [D, D]
  ReprStats s;
  s.std = cov.diagonal().clamp_min(0).sqrt().mean().item<double>();
  s.cov_offdiag = ((cov.pow(2).sum() - cov.diagonal().pow(2).sum()) / double(d)).item<double>();
  return s;
}

}  // namespace dew::metrics

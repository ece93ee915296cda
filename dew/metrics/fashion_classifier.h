// The Fashion-MNIST classifier behind `dew eval` (docs/evaluation.md): a small CNN trained once on the
// training split (deterministically) and cached as safetensors. Its 128-d penultimate features give a
// domain Frechet distance; its predictions give the accuracy of class-conditional samples.
#pragma once
#include <torch/nn/module.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>

#include "dew/data/dataset.h"

namespace dew::metrics {

/// conv(1->32, 3) ReLU pool, conv(32->64, 3) ReLU pool, linear(3136 -> 128) ReLU = features, linear(128 -> 10).
class FashionClassifierImpl : public torch::nn::Module {
 public:
  FashionClassifierImpl();
  /// x: [B, 1, 28, 28] in [-1, 1] -> features [B, 128].
  at::Tensor features(const at::Tensor& x);
  /// x -> logits [B, 10].
  at::Tensor forward(const at::Tensor& x);
  /// features [B, 128] -> logits [B, 10].
  at::Tensor head(const at::Tensor& features);

 private:
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(FashionClassifier);

/// Where the classifier is cached: $DEW_CACHE, else $XDG_CACHE_HOME/dew, else ~/.cache/dew.
std::string cache_dir();

struct ClassifierInfo {
  FashionClassifier model{nullptr};
  double test_accuracy = 0;  // on the 10000 test images
  bool trained_now = false;
};

/// Loads the cached classifier, or trains it (3 epochs, Adam, seed 0, about a minute on 2 cores) and
/// caches it; returns it in eval mode with its test accuracy.
ClassifierInfo fashion_classifier(bool verbose = true);

/// Features [N, 128] and predicted labels [N] of images in [-1, 1], in batches.
std::pair<at::Tensor, at::Tensor> classify(FashionClassifier& model, const at::Tensor& images, int64_t batch = 500);

}  // namespace dew::metrics

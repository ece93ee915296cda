#include "dew/metrics/fashion_classifier.h"

#include <cstdlib>
#include <filesystem>

#include "dew/core/log.h"
#include "dew/core/rng.h"
#include "dew/io/safetensors.h"
#include "dew/io/stops.h"

namespace fs = std::filesystem;

namespace dew::metrics {

FashionClassifierImpl::FashionClassifierImpl() {
  conv1 = register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 32, 3).padding(1)));
  conv2 = register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(32, 64, 3).padding(1)));
  fc1 = register_module("fc1", torch::nn::Linear(64 * 7 * 7, 128));
  fc2 = register_module("fc2", torch::nn::Linear(128, 10));
}

at::Tensor FashionClassifierImpl::features(const at::Tensor& x) {
  auto h = at::max_pool2d(at::relu(conv1->forward(x)), 2);  // [B, 32, 14, 14]
  h = at::max_pool2d(at::relu(conv2->forward(h)), 2);       // [B, 64, 7, 7]
  return at::relu(fc1->forward(h.flatten(1)));              // [B, 128]
}

at::Tensor FashionClassifierImpl::head(const at::Tensor& f) { return fc2->forward(f); }
at::Tensor FashionClassifierImpl::forward(const at::Tensor& x) { return head(features(x)); }

std::string cache_dir() {
  if (const char* d = std::getenv("DEW_CACHE")) return d;
  if (const char* x = std::getenv("XDG_CACHE_HOME")) return (fs::path(x) / "dew").string();
  const char* home = std::getenv("HOME");
  return (fs::path(home ? home : ".") / ".cache" / "dew").string();
}

std::pair<at::Tensor, at::Tensor> classify(FashionClassifier& model, const at::Tensor& images, int64_t batch) {
  torch::NoGradGuard ng;
  model->eval();
  std::vector<at::Tensor> feats, preds;
  for (int64_t i = 0; i < images.size(0); i += batch) {
    io::check_stop();
    auto x = images.slice(0, i, std::min(i + batch, images.size(0))).to(at::kFloat);
    auto f = model->features(x);
    feats.push_back(f);
    preds.push_back(model->head(f).argmax(1));
  }
  return {at::cat(feats), at::cat(preds)};
}

namespace {

double accuracy_on_test(FashionClassifier& model) {
  auto test = data::load_fashion_mnist("test");
  auto [f, pred] = classify(model, data::to_model_range(test.field("image")));
  return (pred == test.field("label")).to(at::kDouble).mean().item<double>();
}

}  // namespace

ClassifierInfo fashion_classifier(bool verbose) {
  ClassifierInfo info;
  info.model = FashionClassifier();
  const fs::path path = fs::path(cache_dir()) / "fashion_classifier_v1.safetensors";
  if (fs::exists(path)) {
    io::SafetensorsFile f = io::SafetensorsFile::open(path.string());
    torch::NoGradGuard ng;
    for (auto& kv : info.model->named_parameters()) {
      DEW_CHECK(f.contains(kv.key()), path.string(), ": missing \"", kv.key(), "\" (delete the file to retrain)");
      kv.value().copy_(f.tensor(kv.key()));
    }
    auto meta = f.metadata();
    info.test_accuracy =
        meta.count("test_accuracy") ? std::stod(meta.at("test_accuracy")) : accuracy_on_test(info.model);
    info.model->eval();
    return info;
  }
  if (verbose) log::info("training the Fashion-MNIST classifier for dew eval (once; cached in ", path.string(), ")");
  torch::manual_seed(0);
  info.model = FashionClassifier();
  auto train = std::make_shared<data::TensorDataset>(data::load_fashion_mnist("train"));
  data::LoaderOptions lo;
  lo.batch_size = 128;
  lo.num_workers = 1;
  lo.seed = 0;
  lo.hflip = true;
  data::DataLoader loader(train, lo);
  torch::optim::Adam opt(info.model->parameters(), torch::optim::AdamOptions(2e-3));
  const int64_t steps = 3 * loader.batches_per_epoch();
  info.model->train();
  for (int64_t s = 0; s < steps; ++s) {
    auto b = loader.next();
    auto logits = info.model->forward(data::to_model_range(b.at("image")));
    auto loss = at::cross_entropy_loss(logits, b.at("label"));
    opt.zero_grad();
    loss.backward();
    opt.step();
    if (verbose && (s + 1) % 200 == 0) log::info("classifier step ", s + 1, "/", steps, " loss ", loss.item<double>());
  }
  info.test_accuracy = accuracy_on_test(info.model);
  info.trained_now = true;
  fs::create_directories(path.parent_path());
  std::map<std::string, at::Tensor> tensors;
  for (auto& kv : info.model->named_parameters()) tensors[kv.key()] = kv.value().detach();
  io::save_safetensors(path.string(), tensors, {{"test_accuracy", std::to_string(info.test_accuracy)}});
  info.model->eval();
  return info;
}

}  // namespace dew::metrics

#include "dew/metrics/lpips.h"

#include <algorithm>
#include <cmath>
#include <set>

#include "dew/core/error.h"

namespace dew::metrics {

using at::Tensor;

namespace {
// One torchvision feature layer: a convolution (in, out, kernel, stride, padding) at `index`; the ReLU follows
// at index + 1.
struct LpipsConvSpec {
  int64_t index, in, out, kernel, stride, padding;
};
const std::vector<LpipsConvSpec>& lpips_convs(const std::string& net) {
  // torchvision.models.alexnet().features and vgg16().features (configuration "D")
  static const std::vector<LpipsConvSpec> alex = {{0, 3, 64, 11, 4, 2},
                                                  {3, 64, 192, 5, 1, 2},
                                                  {6, 192, 384, 3, 1, 1},
                                                  {8, 384, 256, 3, 1, 1},
                                                  {10, 256, 256, 3, 1, 1}};
  static const std::vector<LpipsConvSpec> vgg = {
      {0, 3, 64, 3, 1, 1},     {2, 64, 64, 3, 1, 1},    {5, 64, 128, 3, 1, 1},   {7, 128, 128, 3, 1, 1},
      {10, 128, 256, 3, 1, 1}, {12, 256, 256, 3, 1, 1}, {14, 256, 256, 3, 1, 1}, {17, 256, 512, 3, 1, 1},
      {19, 512, 512, 3, 1, 1}, {21, 512, 512, 3, 1, 1}, {24, 512, 512, 3, 1, 1}, {26, 512, 512, 3, 1, 1},
      {28, 512, 512, 3, 1, 1}};
  return net == "alex" ? alex : vgg;
}
}  // namespace

LpipsImpl::LpipsImpl(LpipsOptions options_) : options(std::move(options_)) {
  const std::string& net = options.net();
  DEW_CHECK(net == "alex" || net == "vgg", "lpips.net: got \"", net, "\", accepted: alex, vgg");
  const bool alex = net == "alex";
  // lpips.pretrained_networks: the slices end at these ReLUs; the max pools sit between them.
  slice_ends_ = alex ? std::vector<int64_t>{1, 4, 7, 9, 11} : std::vector<int64_t>{3, 8, 15, 22, 29};
  pools_ = alex ? std::vector<int64_t>{2, 5} : std::vector<int64_t>{4, 9, 16, 23};
  scaling_layer = register_module("scaling_layer", std::make_shared<torch::nn::Module>());
  shift = scaling_layer->register_buffer("shift", torch::tensor({-.030, -.088, -.188}).view({1, 3, 1, 1}));
  scale = scaling_layer->register_buffer("scale", torch::tensor({.458, .448, .450}).view({1, 3, 1, 1}));
  features = register_module("features", std::make_shared<torch::nn::Module>());
  std::vector<int64_t> chns;
  for (const auto& c : lpips_convs(net)) {
    auto conv = features->register_module(
        std::to_string(c.index),
        torch::nn::Conv2d(torch::nn::Conv2dOptions(c.in, c.out, c.kernel).stride(c.stride).padding(c.padding)));
    convs.emplace_back(c.index, conv);
    for (int64_t end : slice_ends_)
      if (end == c.index + 1) chns.push_back(c.out);
  }
  for (size_t k = 0; k < chns.size(); ++k) {
    auto lin = register_module("lin" + std::to_string(k), std::make_shared<torch::nn::Module>());
    auto model = lin->register_module("model", std::make_shared<torch::nn::Module>());
    lins.push_back(model->register_module("1", torch::nn::Conv2d(torch::nn::Conv2dOptions(chns[k], 1, 1).bias(false))));
  }
  lpips_closed_form_init(*this);
  std::set<std::string> loaded;
  for (const std::string& f : {options.backbone(), options.weights()}) {
    if (f.empty()) continue;
    for (auto& n : load_lpips_file(*this, f)) loaded.insert(n);
  }
  if (!options.weights().empty() || !options.backbone().empty()) {
    std::vector<std::string> missing;
    for (const auto& p : named_parameters())
      if (!loaded.count(p.key())) missing.push_back(p.key());
    if (!missing.empty()) {
      std::string list;
      for (size_t i = 0; i < missing.size() && i < 6; ++i) list += (i ? ", " : "") + missing[i];
      fail("lpips (net ", net, "): ", missing.size(), " parameters are in neither weights \"", options.weights(),
           "\" nor backbone \"", options.backbone(), "\": ", list, missing.size() > 6 ? ", ..." : "",
           " (expected torchvision's features.N.* and lpips' linK.model.1.weight)");
    }
  }
}

std::vector<Tensor> LpipsImpl::features_of(const Tensor& x) {
  Tensor h = (x - shift) / scale;
  std::vector<Tensor> out;
  const bool alex = options.net() == "alex";
  size_t conv_i = 0, slice = 0;
  for (int64_t i = 0; i <= slice_ends_.back(); ++i) {
    if (conv_i < convs.size() && convs[conv_i].first == i) {
      h = convs[conv_i].second->forward(h);
      ++conv_i;
    } else if (std::find(pools_.begin(), pools_.end(), i) != pools_.end()) {
      h = alex ? at::max_pool2d(h, {3, 3}, {2, 2}) : at::max_pool2d(h, {2, 2}, {2, 2});
    } else {
      h = at::relu(h);
    }
    if (i == slice_ends_[slice]) {
      out.push_back(h);
      ++slice;
    }
  }
  return out;
}

Tensor LpipsImpl::forward(const Tensor& in0_, const Tensor& in1_) {
  const auto check = [](const Tensor& t, const char* name) {
    DEW_CHECK(t.defined() && t.dim() == 4 && (t.size(1) == 3 || t.size(1) == 1), "lpips: ", name,
              " must be [N, 3, H, W] (or [N, 1, H, W] grayscale) in [-1, 1], got ",
              t.defined() ? t.sizes() : at::IntArrayRef{});
  };
  check(in0_, "in0");
  check(in1_, "in1");
  DEW_CHECK(in0_.sizes() == in1_.sizes(), "lpips: in0 ", in0_.sizes(), " and in1 ", in1_.sizes(),
            " must have the same shape");
  const int64_t min_hw = min_image_size();
  DEW_CHECK(in0_.size(2) >= min_hw && in0_.size(3) >= min_hw, "lpips (net ", options.net(), "): images of ",
            in0_.size(2), " x ", in0_.size(3), " are too small (at least ", min_hw, " x ", min_hw, ")");
  const auto& w = lins[0]->weight;
  const auto prep = [&](const Tensor& t) {
    Tensor x = t.to(w.device(), w.scalar_type());
    return x.size(1) == 1 ? x.expand({x.size(0), 3, x.size(2), x.size(3)}) : x;
  };
  const auto f0 = features_of(prep(in0_)), f1 = features_of(prep(in1_));
  Tensor total;
  for (size_t k = 0; k < f0.size(); ++k) {
    // lpips.normalize_tensor: x / (sqrt(sum_c x^2) + 1e-10)
    const Tensor a = f0[k] / (f0[k].pow(2).sum(1, true).sqrt() + 1e-10);
    const Tensor b = f1[k] / (f1[k].pow(2).sum(1, true).sqrt() + 1e-10);
    const Tensor d = lins[k]->forward((a - b).pow(2)).mean({2, 3});  // [N, 1]
    total = total.defined() ? total + d : d;
  }
  return total.view({-1});
}

void lpips_closed_form_init(LpipsImpl& model) {
  torch::NoGradGuard no_grad;
  int64_t k = 0;
  for (auto& p : model.named_parameters()) {
    Tensor t = p.value();
    const int64_t n = t.numel();
    const Tensor i = at::arange(n, at::kLong);
    // exact in int64: i < 2^31 and 2654435761 < 2^32, so i * 2654435761 < 2^63
    const Tensor u = (i * int64_t(2654435761) + (k + 1) * int64_t(40503)).remainder(int64_t(1) << 32).to(at::kDouble) /
                     double(int64_t(1) << 32);
    int64_t fan_in = 1;
    for (int64_t d = 1; d < t.dim(); ++d) fan_in *= t.size(d);
    const std::string& name = p.key();
    Tensor v;
    if (name.rfind("lin", 0) == 0) v = u * 0.1;
    else if (name.size() >= 4 && name.compare(name.size() - 4, 4, "bias") == 0) v = (2 * u - 1) * 0.1;
    else v = (2 * u - 1) * std::sqrt(6.0 / static_cast<double>(fan_in));
    t.copy_(v.view(t.sizes()).to(t.scalar_type()));
    ++k;
  }
}

io::KeyMap lpips_key_map() {
  io::KeyMap map;
  map.regex(R"(^net\.slice[0-9]+\.([0-9]+)\.(weight|bias)$)", "features.$1.$2");  // a whole lpips.LPIPS state
  map.skip(R"(classifier\..*)");  // a whole torchvision alexnet / vgg16 state: its classifier head is unused
  map.allow_missing(".*");        // each file holds a part; the constructor checks that together they hold everything
  return map;
}

std::vector<std::string> load_lpips_file(LpipsImpl& model, const std::string& path) {
  const auto source = io::WeightSource::open(path);
  io::LoadOptions o;
  o.require_buffers = false;
  return io::load_weights(model, source, lpips_key_map(), o).loaded;
}

}  // namespace dew::metrics

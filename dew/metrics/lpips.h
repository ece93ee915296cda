// LPIPS as the lpips 0.1.4 package computes it (lpips.LPIPS, version 0.1, spatial=False): the scaling layer
// ((x - shift) / scale), the torchvision AlexNet or VGG16 feature slices (the ReLU outputs ending each of the 5
// slices), each feature map divided by its channel L2 norm + 1e-10, squared differences, the linear layers lin0..4
// (1 x 1 convolutions without bias, one output channel), spatial mean, sum over the 5 layers.
// docs/evaluation.md#clip-score-and-lpips.
//
//   auto lp = dew::metrics::Lpips(dew::metrics::LpipsOptions().net("alex").weights("lpips_alex.safetensors")
//                                     .backbone("alexnet.safetensors"));
//   at::Tensor d = lp->forward(a, b);   // a, b: [N, 3, H, W] in [-1, 1] -> [N]
#pragma once
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/pimpl.h>

#include <string>
#include <vector>

#include "dew/core/options.h"
#include "dew/io/weights.h"

namespace dew::metrics {

struct LpipsOptions {
#define DEW_LPIPS_FIELDS(F, C)                                                                                    \
  C(net, "alex", ({"alex", "vgg"}), "backbone: alex (torchvision alexnet features) or vgg (vgg16 features)")      \
  F(std::string, weights, "",                                                                                     \
    "safetensors with lpips' linear layers lin0..lin4.model.1.weight (the package's weights/v0.1/NET.pth "        \
    "converted), optionally also the backbone; \"\" = closed-form init (tests)")                                  \
  F(std::string, backbone, "",                                                                                    \
    "safetensors with the torchvision backbone (features.N.weight / .bias; an lpips state's net.sliceK.N.* also " \
    "accepted); \"\" = taken from `weights`")
  DEW_OPTIONS(DEW_LPIPS_FIELDS)
#undef DEW_LPIPS_FIELDS
};

/// Parameters: features.N.{weight,bias} at torchvision's indices (alex: 0, 3, 6, 8, 10; vgg: 0, 2, 5, 7, 10, 12,
/// 14, 17, 19, 21, 24, 26, 28) and linK.model.1.weight [1, C_K, 1, 1] (alex C = 64, 192, 384, 256, 256; vgg 64,
/// 128, 256, 512, 512); buffers scaling_layer.{shift,scale} [1, 3, 1, 1] (lpips' constants; a file may hold them).
/// Without files every parameter is set by the closed-form rule of tests/golden/clip_lpips_reference.py
/// (lpips_closed_form_init), so the goldens need no committed weights.
class LpipsImpl : public torch::nn::Module {
 public:
  /// Builds, then loads `weights` / `backbone` when set: every parameter must come from one of them with its exact
  /// shape (errors name the file and the tensor), before any forward.
  explicit LpipsImpl(LpipsOptions options = {});
  /// in0, in1: [N, 3, H, W] (or [N, 1, H, W], repeated to 3 channels) in [-1, 1] -> distances [N] in the
  /// parameters' dtype. H, W must survive the backbone's strides (alex: >= 31 px, vgg: >= 16 px).
  at::Tensor forward(const at::Tensor& in0, const at::Tensor& in1);
  /// The smallest height and width the backbone takes (alex 31, vgg 16).
  int64_t min_image_size() const { return options.net() == "alex" ? 31 : 16; }
  /// The 5 feature maps (after the scaling layer) of x.
  std::vector<at::Tensor> features_of(const at::Tensor& x);

  LpipsOptions options;
  std::shared_ptr<torch::nn::Module> features, scaling_layer;
  std::vector<std::pair<int64_t, torch::nn::Conv2d>> convs;  // (torchvision index, conv)
  std::vector<torch::nn::Conv2d> lins;
  at::Tensor shift, scale;

 private:
  std::vector<int64_t> slice_ends_;  // index of the last layer of each slice (its ReLU)
  std::vector<int64_t> pools_;       // indices of the max pools
};
TORCH_MODULE(Lpips);

/// The key map of lpips files onto LpipsImpl: net.sliceK.N.* -> features.N.*; `allow_missing` lets the other
/// part (backbone or lin layers) be absent from this one file.
io::KeyMap lpips_key_map();
/// Parameter k (registration order, as lpips.LPIPS.named_parameters()), flat index i, fan_in f:
/// u = ((i * 2654435761 + (k + 1) * 40503) mod 2^32) / 2^32; conv weights (2u - 1) sqrt(6 / f), conv biases
/// (2u - 1) 0.1, lin weights 0.1 u; in float64, cast to the parameter's dtype.
void lpips_closed_form_init(LpipsImpl& model);
/// Loads one file's tensors into `model` (the ones it has); returns the module names loaded.
std::vector<std::string> load_lpips_file(LpipsImpl& model, const std::string& path);

}  // namespace dew::metrics

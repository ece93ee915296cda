// FID's InceptionV3 (docs/evaluation.md#fid): pytorch-fid 0.3.0's `InceptionV3([3])` — torchvision's
// Inception3 with pytorch-fid's patched blocks FIDInceptionA / C / E_1 / E_2 (TensorFlow's average pool
// without the padded zeros; max pool in the last block) — up to pool3, the 2048-d features FID is
// computed on. Submodules carry the names of pytorch-fid's weights file pt_inception-2015-12-05-6726825d.pth
// (Conv2d_1a_3x3.conv.weight, Mixed_5b.branch1x1.bn.running_var, ...), so that file loads by name; the
// names of pytorch-fid's wrapper (blocks.0.0.conv.weight, ...) are accepted too.
//
//   auto net = dew::metrics::load_inception(dew::metrics::find_inception(flag));   // refuses before use
//   auto f = dew::metrics::inception_features(net, images01, dew::metrics::FidMode::pytorch_fid);  // [N, 2048]
#pragma once
#include <torch/nn/module.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/conv.h>

#include <string>
#include <vector>

namespace dew::metrics {

/// Conv (no bias) -> BatchNorm (eps 0.001) -> ReLU: torchvision's BasicConv2d (`NAME.conv`, `NAME.bn`).
/// In eval mode without gradients the BatchNorm is folded into the convolution (W gamma / sqrt(var + eps), bias
/// beta - mean gamma / sqrt(var + eps)), computed once and kept until a parameter or statistic changes.
class InceptionConvImpl : public torch::nn::Module {
 public:
  InceptionConvImpl(int64_t in, int64_t out, int64_t kh, int64_t kw, int64_t stride = 1, int64_t ph = 0,
                    int64_t pw = 0);
  at::Tensor forward(const at::Tensor& x);

 private:
  torch::nn::Conv2d conv{nullptr};
  torch::nn::BatchNorm2d bn{nullptr};
  at::Tensor folded_weight_, folded_bias_;
  std::vector<int64_t> folded_from_;  // the versions (and data pointers) the folded pair was made from
};
TORCH_MODULE(InceptionConv);

/// The whole network. Fixed architecture (pytorch-fid has no options that change the pool3 features).
class InceptionV3Impl : public torch::nn::Module {
 public:
  InceptionV3Impl();
  /// x: [B, 3, 299, 299] in [-1, 1] (any H, W >= 75 runs: the network is convolutional) -> pool3 [B, 2048].
  at::Tensor pool3(const at::Tensor& x);
  /// pytorch-fid's forward: images [B, 3, H, W] in [0, 1] -> bilinear resize to 299 x 299
  /// (align_corners=False, no antialias) -> 2x - 1 -> pool3 [B, 2048].
  at::Tensor forward(const at::Tensor& images01);

 private:
  struct Blocks;
  std::shared_ptr<Blocks> b_;
};
TORCH_MODULE(InceptionV3);

/// How images reach 299 x 299: pytorch_fid (bilinear on the float images, inside the network) or clean
/// (clean-fid 0.1.35's "clean" mode: images quantised to uint8, then PIL's antialiased bicubic resize per
/// channel on float32 values, clipped to [0, 255]).
enum class FidMode { pytorch_fid, clean };
/// "pytorch-fid" | "clean" -> FidMode; anything else is a dew::Error naming `field`.
FidMode fid_mode_from_string(const std::string& s, const std::string& field = "--fid-mode");
const char* to_string(FidMode m);

/// PIL's Image.resize(size, BICUBIC) of a mode "F" (float32) image, as clean-fid calls it: separable,
/// horizontal pass then vertical, Keys' cubic with a = -0.5 whose support widens by the downscale factor
/// (antialiasing), coefficients normalised per output pixel, accumulated in double, float32 between passes.
/// x: [C, H, W] float (0..255) -> [C, out_h, out_w] float32, not clipped.
at::Tensor pil_bicubic_resize(const at::Tensor& x, int64_t out_h, int64_t out_w);

/// The Inception weights file: `flag` when given (it must exist), else the first of
/// CACHE/pt_inception-2015-12-05.safetensors and CACHE/pt_inception-2015-12-05-6726825d.pth where CACHE is
/// dew's cache directory ($DEW_CACHE, else $XDG_CACHE_HOME/dew, else ~/.cache/dew); "" when neither exists.
/// Nothing is downloaded.
std::string find_inception(const std::string& flag);

/// The network with the weights at `path` (a .safetensors with pytorch-fid's names, or a torch.save'd
/// state dict .pth in the zip format), in eval mode. Every name and shape is checked before any weight is
/// used: a missing, extra or misshapen tensor is a dew::Error naming it. A legacy (pre-zip) .pth — the
/// published pt_inception-2015-12-05-6726825d.pth is one — is refused with the one-line python conversion.
InceptionV3 load_inception(const std::string& path);

/// Images [N, C, H, W] (C = 1 or 3; 1 is repeated to 3 as PIL's convert("RGB") does) in [0, 1] -> pool3
/// features [N, 2048] float64, in batches of `batch`, on the network's device. A wrong channel count is a
/// dew::Error before any image is processed.
at::Tensor inception_features(InceptionV3& net, const at::Tensor& images01, FidMode mode, int64_t batch = 50);

/// A feature set's Gaussian: mean [D] and unbiased covariance [D, D] (float64), as pytorch-fid's
/// calculate_activation_statistics, and how many images made it (0 when a file does not say).
struct FidStats {
  at::Tensor mu, sigma;
  int64_t count = 0;
};
/// gaussian_fit of features [N, D].
FidStats fid_stats(const at::Tensor& features);
/// pytorch-fid's statistics file: an .npz with `mu` [D] and `sigma` [D, D] (other members ignored; dew adds
/// `count`). A missing member or mismatched shapes is a dew::Error naming the file and the member.
FidStats read_fid_stats(const std::string& path, int64_t dims = 2048);
/// Writes mu, sigma and count as np.savez_compressed would (pytorch-fid's --save-stats reads the same).
void write_fid_stats(const std::string& path, const FidStats& stats);
/// The image files of a folder (png, jpg, jpeg, bmp, any case), sorted by name; a path that is not a folder is a
/// dew::Error naming --fid-ref.
std::vector<std::string> fid_image_files(const std::string& dir);
/// The images of a folder (fid_image_files; converted to RGB as pytorch-fid's loader
/// does), their Inception statistics computed once and cached under CACHE/fid_ref/ keyed by the folder's
/// path, file names, sizes and times, and the mode. Refuses a folder of at most `kInceptionDims` images
/// before extracting anything.
FidStats folder_fid_stats(InceptionV3& net, const std::string& dir, FidMode mode, bool verbose = true);

/// pytorch-fid's name for the feature width FID needs more than this many images for (2048): with N <= D
/// images the covariance is singular.
constexpr int64_t kInceptionDims = 2048;

}  // namespace dew::metrics

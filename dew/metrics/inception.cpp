#include "dew/metrics/inception.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <functional>
#include <iostream>

#include "dew/core/error.h"
#include "dew/io/files.h"
#include "dew/io/image.h"
#include "dew/io/npz.h"
#include "dew/io/stops.h"
#include "dew/io/weights.h"
#include "dew/metrics/fashion_classifier.h"
#include "dew/metrics/metrics.h"

namespace fs = std::filesystem;

namespace dew::metrics {

InceptionConvImpl::InceptionConvImpl(int64_t in, int64_t out, int64_t kh, int64_t kw, int64_t stride, int64_t ph,
                                     int64_t pw) {
  conv = register_module(
      "conv",
      torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, {kh, kw}).stride(stride).padding({ph, pw}).bias(false)));
  bn = register_module("bn", torch::nn::BatchNorm2d(torch::nn::BatchNorm2dOptions(out).eps(0.001)));
}

at::Tensor InceptionConvImpl::forward(const at::Tensor& x) {
  if (is_training() || at::GradMode::is_enabled()) return at::relu(bn->forward(conv->forward(x)));
  // Inference: one convolution with the BatchNorm folded in saves BatchNorm's pass over the activations.
  std::vector<int64_t> from;
  for (const at::Tensor& t : {conv->weight, bn->weight, bn->bias, bn->running_mean, bn->running_var}) {
    from.push_back(int64_t(t._version()));
    from.push_back(reinterpret_cast<int64_t>(t.data_ptr()));
    from.push_back(int64_t(t.scalar_type()));
  }
  if (from != folded_from_ || !folded_weight_.defined() || folded_weight_.device() != x.device()) {
    const at::Tensor scale = bn->weight * at::rsqrt(bn->running_var + bn->options.eps());
    folded_weight_ = (conv->weight * scale.view({-1, 1, 1, 1})).contiguous(at::MemoryFormat::ChannelsLast);
    folded_bias_ = bn->bias - bn->running_mean * scale;
    folded_from_ = std::move(from);
  }
  const auto& o = conv->options;
  const auto& pad = std::get<torch::ExpandingArray<2>>(o.padding());
  at::Tensor y = at::conv2d(x, folded_weight_, folded_bias_, *o.stride(), *pad, *o.dilation(), o.groups());
  return y.relu_();
}

namespace inception_detail {

using at::Tensor;

// TensorFlow's 3x3 average pool: padded zeros are not counted (pytorch-fid's patch in A, C and E_1).
Tensor tf_avg_pool(const Tensor& x) { return at::avg_pool2d(x, {3, 3}, {1, 1}, {1, 1}, false, false); }

// FIDInceptionA (Mixed_5b/c/d).
struct BlockA : torch::nn::Module {
  InceptionConv branch1x1{nullptr}, branch5x5_1{nullptr}, branch5x5_2{nullptr}, branch3x3dbl_1{nullptr},
      branch3x3dbl_2{nullptr}, branch3x3dbl_3{nullptr}, branch_pool{nullptr};
  BlockA(int64_t in, int64_t pool_features) {
    branch1x1 = register_module("branch1x1", InceptionConv(in, 64, 1, 1));
    branch5x5_1 = register_module("branch5x5_1", InceptionConv(in, 48, 1, 1));
    branch5x5_2 = register_module("branch5x5_2", InceptionConv(48, 64, 5, 5, 1, 2, 2));
    branch3x3dbl_1 = register_module("branch3x3dbl_1", InceptionConv(in, 64, 1, 1));
    branch3x3dbl_2 = register_module("branch3x3dbl_2", InceptionConv(64, 96, 3, 3, 1, 1, 1));
    branch3x3dbl_3 = register_module("branch3x3dbl_3", InceptionConv(96, 96, 3, 3, 1, 1, 1));
    branch_pool = register_module("branch_pool", InceptionConv(in, pool_features, 1, 1));
  }
  Tensor forward(const Tensor& x) {
    auto b5 = branch5x5_2(branch5x5_1(x));
    auto b3 = branch3x3dbl_3(branch3x3dbl_2(branch3x3dbl_1(x)));
    return at::cat({branch1x1(x), b5, b3, branch_pool(tf_avg_pool(x))}, 1);
  }
};

// torchvision's InceptionB (Mixed_6a), unpatched.
struct BlockB : torch::nn::Module {
  InceptionConv branch3x3{nullptr}, branch3x3dbl_1{nullptr}, branch3x3dbl_2{nullptr}, branch3x3dbl_3{nullptr};
  explicit BlockB(int64_t in) {
    branch3x3 = register_module("branch3x3", InceptionConv(in, 384, 3, 3, 2));
    branch3x3dbl_1 = register_module("branch3x3dbl_1", InceptionConv(in, 64, 1, 1));
    branch3x3dbl_2 = register_module("branch3x3dbl_2", InceptionConv(64, 96, 3, 3, 1, 1, 1));
    branch3x3dbl_3 = register_module("branch3x3dbl_3", InceptionConv(96, 96, 3, 3, 2));
  }
  Tensor forward(const Tensor& x) {
    auto b3 = branch3x3dbl_3(branch3x3dbl_2(branch3x3dbl_1(x)));
    return at::cat({branch3x3(x), b3, at::max_pool2d(x, {3, 3}, {2, 2})}, 1);
  }
};

// FIDInceptionC (Mixed_6b..e).
struct BlockC : torch::nn::Module {
  InceptionConv branch1x1{nullptr}, branch7x7_1{nullptr}, branch7x7_2{nullptr}, branch7x7_3{nullptr},
      branch7x7dbl_1{nullptr}, branch7x7dbl_2{nullptr}, branch7x7dbl_3{nullptr}, branch7x7dbl_4{nullptr},
      branch7x7dbl_5{nullptr}, branch_pool{nullptr};
  BlockC(int64_t in, int64_t c7) {
    branch1x1 = register_module("branch1x1", InceptionConv(in, 192, 1, 1));
    branch7x7_1 = register_module("branch7x7_1", InceptionConv(in, c7, 1, 1));
    branch7x7_2 = register_module("branch7x7_2", InceptionConv(c7, c7, 1, 7, 1, 0, 3));
    branch7x7_3 = register_module("branch7x7_3", InceptionConv(c7, 192, 7, 1, 1, 3, 0));
    branch7x7dbl_1 = register_module("branch7x7dbl_1", InceptionConv(in, c7, 1, 1));
    branch7x7dbl_2 = register_module("branch7x7dbl_2", InceptionConv(c7, c7, 7, 1, 1, 3, 0));
    branch7x7dbl_3 = register_module("branch7x7dbl_3", InceptionConv(c7, c7, 1, 7, 1, 0, 3));
    branch7x7dbl_4 = register_module("branch7x7dbl_4", InceptionConv(c7, c7, 7, 1, 1, 3, 0));
    branch7x7dbl_5 = register_module("branch7x7dbl_5", InceptionConv(c7, 192, 1, 7, 1, 0, 3));
    branch_pool = register_module("branch_pool", InceptionConv(in, 192, 1, 1));
  }
  Tensor forward(const Tensor& x) {
    auto b7 = branch7x7_3(branch7x7_2(branch7x7_1(x)));
    auto bd = branch7x7dbl_5(branch7x7dbl_4(branch7x7dbl_3(branch7x7dbl_2(branch7x7dbl_1(x)))));
    return at::cat({branch1x1(x), b7, bd, branch_pool(tf_avg_pool(x))}, 1);
  }
};

// torchvision's InceptionD (Mixed_7a), unpatched.
struct BlockD : torch::nn::Module {
  InceptionConv branch3x3_1{nullptr}, branch3x3_2{nullptr}, branch7x7x3_1{nullptr}, branch7x7x3_2{nullptr},
      branch7x7x3_3{nullptr}, branch7x7x3_4{nullptr};
  explicit BlockD(int64_t in) {
    branch3x3_1 = register_module("branch3x3_1", InceptionConv(in, 192, 1, 1));
    branch3x3_2 = register_module("branch3x3_2", InceptionConv(192, 320, 3, 3, 2));
    branch7x7x3_1 = register_module("branch7x7x3_1", InceptionConv(in, 192, 1, 1));
    branch7x7x3_2 = register_module("branch7x7x3_2", InceptionConv(192, 192, 1, 7, 1, 0, 3));
    branch7x7x3_3 = register_module("branch7x7x3_3", InceptionConv(192, 192, 7, 1, 1, 3, 0));
    branch7x7x3_4 = register_module("branch7x7x3_4", InceptionConv(192, 192, 3, 3, 2));
  }
  Tensor forward(const Tensor& x) {
    auto b3 = branch3x3_2(branch3x3_1(x));
    auto b7 = branch7x7x3_4(branch7x7x3_3(branch7x7x3_2(branch7x7x3_1(x))));
    return at::cat({b3, b7, at::max_pool2d(x, {3, 3}, {2, 2})}, 1);
  }
};

// FIDInceptionE_1 (Mixed_7b: TF average pool) and FIDInceptionE_2 (Mixed_7c: max pool, as the FID graph has).
struct BlockE : torch::nn::Module {
  InceptionConv branch1x1{nullptr}, branch3x3_1{nullptr}, branch3x3_2a{nullptr}, branch3x3_2b{nullptr},
      branch3x3dbl_1{nullptr}, branch3x3dbl_2{nullptr}, branch3x3dbl_3a{nullptr}, branch3x3dbl_3b{nullptr},
      branch_pool{nullptr};
  bool max_pool;
  BlockE(int64_t in, bool max_pool) : max_pool(max_pool) {
    branch1x1 = register_module("branch1x1", InceptionConv(in, 320, 1, 1));
    branch3x3_1 = register_module("branch3x3_1", InceptionConv(in, 384, 1, 1));
    branch3x3_2a = register_module("branch3x3_2a", InceptionConv(384, 384, 1, 3, 1, 0, 1));
    branch3x3_2b = register_module("branch3x3_2b", InceptionConv(384, 384, 3, 1, 1, 1, 0));
    branch3x3dbl_1 = register_module("branch3x3dbl_1", InceptionConv(in, 448, 1, 1));
    branch3x3dbl_2 = register_module("branch3x3dbl_2", InceptionConv(448, 384, 3, 3, 1, 1, 1));
    branch3x3dbl_3a = register_module("branch3x3dbl_3a", InceptionConv(384, 384, 1, 3, 1, 0, 1));
    branch3x3dbl_3b = register_module("branch3x3dbl_3b", InceptionConv(384, 384, 3, 1, 1, 1, 0));
    branch_pool = register_module("branch_pool", InceptionConv(in, 192, 1, 1));
  }
  Tensor forward(const Tensor& x) {
    auto h3 = branch3x3_1(x);
    auto b3 = at::cat({branch3x3_2a(h3), branch3x3_2b(h3)}, 1);
    auto hd = branch3x3dbl_2(branch3x3dbl_1(x));
    auto bd = at::cat({branch3x3dbl_3a(hd), branch3x3dbl_3b(hd)}, 1);
    auto pooled = max_pool ? at::max_pool2d(x, {3, 3}, {1, 1}, {1, 1}) : tf_avg_pool(x);
    return at::cat({branch1x1(x), b3, bd, branch_pool(pooled)}, 1);
  }
};

}  // namespace inception_detail

struct InceptionV3Impl::Blocks {
  InceptionConv Conv2d_1a_3x3{nullptr}, Conv2d_2a_3x3{nullptr}, Conv2d_2b_3x3{nullptr}, Conv2d_3b_1x1{nullptr},
      Conv2d_4a_3x3{nullptr};
  std::shared_ptr<inception_detail::BlockA> Mixed_5b, Mixed_5c, Mixed_5d;
  std::shared_ptr<inception_detail::BlockB> Mixed_6a;
  std::shared_ptr<inception_detail::BlockC> Mixed_6b, Mixed_6c, Mixed_6d, Mixed_6e;
  std::shared_ptr<inception_detail::BlockD> Mixed_7a;
  std::shared_ptr<inception_detail::BlockE> Mixed_7b, Mixed_7c;
};

InceptionV3Impl::InceptionV3Impl() : b_(std::make_shared<Blocks>()) {
  using namespace inception_detail;
  auto& b = *b_;
  b.Conv2d_1a_3x3 = register_module("Conv2d_1a_3x3", InceptionConv(3, 32, 3, 3, 2));
  b.Conv2d_2a_3x3 = register_module("Conv2d_2a_3x3", InceptionConv(32, 32, 3, 3));
  b.Conv2d_2b_3x3 = register_module("Conv2d_2b_3x3", InceptionConv(32, 64, 3, 3, 1, 1, 1));
  b.Conv2d_3b_1x1 = register_module("Conv2d_3b_1x1", InceptionConv(64, 80, 1, 1));
  b.Conv2d_4a_3x3 = register_module("Conv2d_4a_3x3", InceptionConv(80, 192, 3, 3));
  b.Mixed_5b = register_module("Mixed_5b", std::make_shared<BlockA>(192, 32));
  b.Mixed_5c = register_module("Mixed_5c", std::make_shared<BlockA>(256, 64));
  b.Mixed_5d = register_module("Mixed_5d", std::make_shared<BlockA>(288, 64));
  b.Mixed_6a = register_module("Mixed_6a", std::make_shared<BlockB>(288));
  b.Mixed_6b = register_module("Mixed_6b", std::make_shared<BlockC>(768, 128));
  b.Mixed_6c = register_module("Mixed_6c", std::make_shared<BlockC>(768, 160));
  b.Mixed_6d = register_module("Mixed_6d", std::make_shared<BlockC>(768, 160));
  b.Mixed_6e = register_module("Mixed_6e", std::make_shared<BlockC>(768, 192));
  b.Mixed_7a = register_module("Mixed_7a", std::make_shared<BlockD>(768));
  b.Mixed_7b = register_module("Mixed_7b", std::make_shared<BlockE>(1280, false));
  b.Mixed_7c = register_module("Mixed_7c", std::make_shared<BlockE>(2048, true));
}

at::Tensor InceptionV3Impl::pool3(const at::Tensor& x) {
  auto& b = *b_;
  auto h = b.Conv2d_2b_3x3(b.Conv2d_2a_3x3(b.Conv2d_1a_3x3(x.contiguous(at::MemoryFormat::ChannelsLast))));
  h = at::max_pool2d(h, {3, 3}, {2, 2});
  h = at::max_pool2d(b.Conv2d_4a_3x3(b.Conv2d_3b_1x1(h)), {3, 3}, {2, 2});
  h = b.Mixed_5d->forward(b.Mixed_5c->forward(b.Mixed_5b->forward(h)));
  h = b.Mixed_6a->forward(h);
  h = b.Mixed_6e->forward(b.Mixed_6d->forward(b.Mixed_6c->forward(b.Mixed_6b->forward(h))));
  h = b.Mixed_7c->forward(b.Mixed_7b->forward(b.Mixed_7a->forward(h)));
  return h.mean({2, 3});  // AdaptiveAvgPool2d(1) + flatten
}

at::Tensor InceptionV3Impl::forward(const at::Tensor& images01) {
  auto x = at::upsample_bilinear2d(images01, at::IntArrayRef{299, 299}, false, std::nullopt, std::nullopt);
  return pool3(2 * x - 1);
}

FidMode fid_mode_from_string(const std::string& s, const std::string& field) {
  if (s == "pytorch-fid" || s == "pytorch_fid" || s == "legacy") return FidMode::pytorch_fid;
  if (s == "clean") return FidMode::clean;
  fail(field, ": unknown FID mode '", s, "' (accepted: pytorch-fid, clean)");
}

const char* to_string(FidMode m) { return m == FidMode::clean ? "clean" : "pytorch-fid"; }

namespace inception_detail {

// PIL's bicubic kernel (Keys, a = -0.5), libImaging/Resample.c.
double pil_cubic(double x) {
  constexpr double a = -0.5;
  if (x < 0) x = -x;
  if (x < 1) return ((a + 2) * x - (a + 3)) * x * x + 1;
  if (x < 2) return (((x - 5) * x + 8) * x - 4) * a;
  return 0;
}

// PIL's precompute_coeffs: per output pixel the first input index and its normalised weights.
struct Coeffs {
  std::vector<int64_t> start, count;
  std::vector<double> w;  // out * ksize
  int64_t ksize = 0;
};

Coeffs pil_coeffs(int64_t in, int64_t out) {
  const double scale = double(in) / double(out);
  const double filterscale = std::max(scale, 1.0);
  const double support = 2.0 * filterscale;
  Coeffs c;
  c.ksize = int64_t(std::ceil(support)) * 2 + 1;
  c.start.resize(out);
  c.count.resize(out);
  c.w.assign(size_t(out * c.ksize), 0.0);
  for (int64_t xx = 0; xx < out; ++xx) {
    const double center = (double(xx) + 0.5) * scale;
    const double ss = 1.0 / filterscale;
    int64_t xmin = int64_t(center - support + 0.5);  // C's truncating cast, as PIL
    if (xmin < 0) xmin = 0;
    int64_t xmax = int64_t(center + support + 0.5);
    if (xmax > in) xmax = in;
    xmax -= xmin;
    double ww = 0;
    double* k = &c.w[size_t(xx * c.ksize)];
    for (int64_t x = 0; x < xmax; ++x) {
      k[x] = pil_cubic((double(x + xmin) - center + 0.5) * ss);
      ww += k[x];
    }
    for (int64_t x = 0; x < xmax; ++x)
      if (ww != 0) k[x] /= ww;
    c.start[xx] = xmin;
    c.count[xx] = xmax;
  }
  return c;
}

}  // namespace inception_detail

at::Tensor pil_bicubic_resize(const at::Tensor& x, int64_t out_h, int64_t out_w) {
  using namespace inception_detail;
  DEW_CHECK(x.dim() == 3 && x.size(1) > 0 && x.size(2) > 0, "pil_bicubic_resize: expected [C, H, W], got ", x.sizes());
  DEW_CHECK(out_h > 0 && out_w > 0, "pil_bicubic_resize: output size must be positive, got ", out_h, "x", out_w);
  const int64_t C = x.size(0), H = x.size(1), W = x.size(2);
  auto src = x.to(at::kFloat).contiguous();
  // Horizontal pass (skipped when the width is unchanged, as PIL skips it), float32 between passes.
  at::Tensor mid = src;
  if (out_w != W) {
    const Coeffs cw = pil_coeffs(W, out_w);
    mid = at::empty({C, H, out_w}, at::kFloat);
    auto s = src.accessor<float, 3>();
    auto m = mid.accessor<float, 3>();
    for (int64_t c = 0; c < C; ++c)
      for (int64_t y = 0; y < H; ++y)
        for (int64_t xx = 0; xx < out_w; ++xx) {
          double acc = 0;
          const double* k = &cw.w[size_t(xx * cw.ksize)];
          for (int64_t i = 0; i < cw.count[xx]; ++i) acc += double(s[c][y][cw.start[xx] + i]) * k[i];
          m[c][y][xx] = float(acc);
        }
  }
  if (out_h == H) return mid.clone();
  const Coeffs ch = pil_coeffs(H, out_h);
  auto out = at::empty({C, out_h, out_w}, at::kFloat);
  auto m = mid.accessor<float, 3>();
  auto o = out.accessor<float, 3>();
  for (int64_t c = 0; c < C; ++c)
    for (int64_t yy = 0; yy < out_h; ++yy) {
      const double* k = &ch.w[size_t(yy * ch.ksize)];
      for (int64_t xx = 0; xx < out_w; ++xx) {
        double acc = 0;
        for (int64_t i = 0; i < ch.count[yy]; ++i) acc += double(m[c][ch.start[yy] + i][xx]) * k[i];
        o[c][yy][xx] = float(acc);
      }
    }
  return out;
}

std::string find_inception(const std::string& flag) {
  if (!flag.empty()) {
    DEW_CHECK(fs::is_regular_file(flag), "--inception: no file at '", flag,
              "' (give pytorch-fid's weights as .safetensors or .pth; docs/evaluation.md#fid says how to get them)");
    return flag;
  }
  for (const char* name : {"pt_inception-2015-12-05.safetensors", "pt_inception-2015-12-05-6726825d.pth"}) {
    const fs::path p = fs::path(cache_dir()) / name;
    if (fs::is_regular_file(p)) return p.string();
  }
  return "";
}

namespace inception_detail {

const char* kConvert =
    "python -c \"import torch, safetensors.torch as st; st.save_file({k: v.contiguous() for k, v in "
    "torch.load('pt_inception-2015-12-05-6726825d.pth', map_location='cpu').items()}, "
    "'pt_inception-2015-12-05.safetensors')\"";

std::map<std::string, at::Tensor> read_pth(const std::string& path) {
  const std::string bytes = io::read_file(path, "--inception");
  // torch.save's zip format starts with a local zip header; older files start with pickle protocol 2.
  if (bytes.size() < 4 || bytes.compare(0, 4, "PK\x03\x04") != 0)
    fail("--inception: ", path,
         " is a legacy (pre-zip) torch.save file, which LibTorch cannot read; convert it once: ", kConvert);
  c10::IValue v;
  try {
    v = torch::jit::pickle_load(std::vector<char>(bytes.begin(), bytes.end()));
  } catch (const std::exception& e) {
    fail("--inception: cannot read ", path, " as a torch.save'd state dict (", e.what(), "); convert it: ", kConvert);
  }
  DEW_CHECK(v.isGenericDict(), "--inception: ", path, " does not hold a state dict (a dict of tensors)");
  std::map<std::string, at::Tensor> out;
  for (const auto& item : v.toGenericDict()) {
    DEW_CHECK(item.key().isString() && item.value().isTensor(), "--inception: ", path,
              " holds a non-tensor entry; expected a state dict");
    out[item.key().toStringRef()] = item.value().toTensor();
  }
  return out;
}

}  // namespace inception_detail

InceptionV3 load_inception(const std::string& path) {
  DEW_CHECK(!path.empty(),
            "FID needs pytorch-fid's Inception weights: pass --inception FILE or put "
            "pt_inception-2015-12-05.safetensors in ",
            cache_dir(), " (docs/evaluation.md#fid)");
  InceptionV3 net;
  const bool pth = fs::path(path).extension() == ".pth" || fs::path(path).extension() == ".pt";
  auto source =
      pth ? io::WeightSource::of_tensors(inception_detail::read_pth(path), path) : io::WeightSource::open(path);
  io::KeyMap map;
  // pytorch-fid's wrapper InceptionV3 names its blocks by position; its weights file (Inception3) by name.
  const char* wrapper[][2] = {
      {"blocks.0.0.", "Conv2d_1a_3x3."}, {"blocks.0.1.", "Conv2d_2a_3x3."}, {"blocks.0.2.", "Conv2d_2b_3x3."},
      {"blocks.1.0.", "Conv2d_3b_1x1."}, {"blocks.1.1.", "Conv2d_4a_3x3."}, {"blocks.2.0.", "Mixed_5b."},
      {"blocks.2.1.", "Mixed_5c."},      {"blocks.2.2.", "Mixed_5d."},      {"blocks.2.3.", "Mixed_6a."},
      {"blocks.2.4.", "Mixed_6b."},      {"blocks.2.5.", "Mixed_6c."},      {"blocks.2.6.", "Mixed_6d."},
      {"blocks.2.7.", "Mixed_6e."},      {"blocks.3.0.", "Mixed_7a."},      {"blocks.3.1.", "Mixed_7b."},
      {"blocks.3.2.", "Mixed_7c."}};
  for (const auto& r : wrapper) map.prefix(r[0], r[1]);
  // The 1008-way classifier is not part of the pool3 features; BatchNorm's step counter is unused in eval.
  map.skip(R"(fc\.(weight|bias))").skip(R"(.*\.num_batches_tracked)").allow_missing(R"(.*\.num_batches_tracked)");
  try {
    io::load_weights(*net, source, map);
  } catch (const Error& e) {
    fail("--inception: ", path, " is not pytorch-fid's InceptionV3 (pt_inception-2015-12-05 layout): ", e.what());
  }
  net->eval();
  return net;
}

at::Tensor inception_features(InceptionV3& net, const at::Tensor& images01, FidMode mode, int64_t batch) {
  DEW_CHECK(images01.dim() == 4 && (images01.size(1) == 1 || images01.size(1) == 3),
            "FID: images must be [N, C, H, W] with C = 1 (grayscale, repeated to RGB) or 3, got ", images01.sizes());
  DEW_CHECK(batch > 0, "FID: batch must be positive, got ", batch);
  torch::NoGradGuard ng;
  net->eval();
  const auto p = net->parameters().front();
  std::vector<at::Tensor> out;
  for (int64_t i = 0; i < images01.size(0); i += batch) {
    io::check_stop();  // `dew eval` stopped by a signal
    auto x = images01.slice(0, i, std::min(i + batch, images01.size(0)));
    if (x.size(1) == 1) x = x.expand({-1, 3, -1, -1});
    if (mode == FidMode::clean) {
      // clean-fid: uint8 pixels (as saved images hold them), PIL bicubic per channel, clip, back to [0, 1].
      auto u8 = (x.to(at::kDouble).clamp(0, 1) * 255).round().to(at::kFloat).cpu();
      std::vector<at::Tensor> resized;
      for (int64_t j = 0; j < u8.size(0); ++j) resized.push_back(pil_bicubic_resize(u8[j], 299, 299).clamp(0, 255));
      x = at::stack(resized) / 255;
    }
    out.push_back(net->forward(x.to(p.device(), p.scalar_type())).to(at::kDouble).cpu());
  }
  return at::cat(out);
}

FidStats fid_stats(const at::Tensor& features) {
  auto [mu, sigma] = gaussian_fit(features);
  return {mu, sigma, features.size(0)};
}

FidStats read_fid_stats(const std::string& path, int64_t dims) {
  auto a = io::read_npz(path);
  for (const char* k : {"mu", "sigma"})
    DEW_CHECK(a.count(k), "--fid-ref: ", path, " has no '", k,
              "' array (pytorch-fid's statistics files hold mu and sigma)");
  FidStats s{a.at("mu").to(at::kDouble), a.at("sigma").to(at::kDouble), 0};
  DEW_CHECK(s.mu.dim() == 1 && s.mu.size(0) == dims, "--fid-ref: ", path, ": mu must be [", dims, "], got ",
            s.mu.sizes());
  DEW_CHECK(s.sigma.dim() == 2 && s.sigma.size(0) == dims && s.sigma.size(1) == dims, "--fid-ref: ", path,
            ": sigma must be [", dims, ", ", dims, "], got ", s.sigma.sizes());
  if (a.count("count") && a.at("count").numel() == 1) s.count = a.at("count").to(at::kLong).item<int64_t>();
  return s;
}

void write_fid_stats(const std::string& path, const FidStats& s) {
  fs::create_directories(fs::absolute(path).parent_path());
  io::write_npz(path, {{"mu", s.mu}, {"sigma", s.sigma}, {"count", at::scalar_tensor(s.count, at::kLong)}}, true);
}

std::vector<std::string> fid_image_files(const std::string& dir) {
  DEW_CHECK(fs::is_directory(dir), "--fid-ref: '", dir, "' is neither a folder of images nor an .npz file");
  std::vector<std::string> files;
  for (const auto& e : fs::directory_iterator(dir)) {
    std::string ext = e.path().extension().string();
    std::transform(ext.begin(), ext.end(), ext.begin(), [](unsigned char c) { return char(std::tolower(c)); });
    if (e.is_regular_file() && (ext == ".png" || ext == ".jpg" || ext == ".jpeg" || ext == ".bmp"))
      files.push_back(e.path().string());
  }
  std::sort(files.begin(), files.end());
  return files;
}

FidStats folder_fid_stats(InceptionV3& net, const std::string& dir, FidMode mode, bool verbose) {
  std::vector<fs::path> files;
  for (const auto& f : fid_image_files(dir)) files.push_back(f);
  check_fid_count(int64_t(files.size()), kInceptionDims, "--fid-ref " + dir);
  std::string key = fs::absolute(dir).lexically_normal().string() + "|" + to_string(mode);
  for (const auto& p : files)
    key += "|" + p.filename().string() + ":" + std::to_string(fs::file_size(p)) + ":" +
           std::to_string(fs::last_write_time(p).time_since_epoch().count());
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016zx", std::hash<std::string>{}(key));
  const fs::path cached = fs::path(cache_dir()) / "fid_ref" /
                          (fs::absolute(dir).lexically_normal().filename().string() + "-" + hex + ".npz");
  if (fs::is_regular_file(cached)) {
    if (verbose) std::cout << "FID reference statistics of " << dir << " (cached: " << cached.string() << ")\n";
    return read_fid_stats(cached.string());
  }
  if (verbose) std::cout << "computing the Inception statistics of " << files.size() << " images in " << dir << "\n";
  std::vector<at::Tensor> feats;
  for (const auto& p : files)  // any sizes: one image at a time, RGB as pytorch-fid's loader converts it
    feats.push_back(inception_features(net, (io::load_image(p.string(), 3).to(at::kFloat) / 255).unsqueeze(0), mode));
  auto s = fid_stats(at::cat(feats));
  write_fid_stats(cached.string(), s);
  if (verbose) std::cout << "cached as " << cached.string() << "\n";
  return s;
}

}  // namespace dew::metrics

#include "dew/data/dataset.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstring>
#include <filesystem>

#include "dew/core/rng.h"
#include "dew/data/dataset_detail.h"
#include "dew/data/idx.h"
#include "dew/io/image.h"

namespace dew {
namespace data {

namespace fs = std::filesystem;

// ---------------------------------------------------------------------------------------------------
// TensorDataset

TensorDataset::TensorDataset(Batch fields, std::string name) : fields_(std::move(fields)), name_(std::move(name)) {
  DEW_CHECK(!fields_.empty(), name_, ": a dataset needs at least one field");
  bool first = true;
  for (auto& kv : fields_) {
    const auto& t = kv.second;
    DEW_CHECK(t.defined(), name_, ": field \"", kv.first, "\" is an undefined tensor");
    DEW_CHECK(t.dim() >= 1, name_, ": field \"", kv.first, "\" must have an item dimension, got a scalar");
    DEW_CHECK(t.device().is_cpu(), name_, ": field \"", kv.first, "\" must live on the CPU, got ", t.device());
    if (first) {
      size_ = t.size(0);
      first = false;
    }
    DEW_CHECK(t.size(0) == size_, name_, ": field \"", kv.first, "\" has ", t.size(0), " items, but \"",
              fields_.begin()->first, "\" has ", size_, "; every field's first dimension must agree");
    kv.second = t.contiguous();  // gather() reads rows; contiguous rows keep it a memcpy
  }
}

const at::Tensor& TensorDataset::field(const std::string& field) const {
  auto it = fields_.find(field);
  if (it == fields_.end()) fail(name_, ": no field \"", field, "\"; fields: ", detail::field_list(fields_));
  return it->second;
}

Batch TensorDataset::gather(const at::Tensor& indices) const {
  DEW_CHECK(indices.dim() == 1 && indices.scalar_type() == at::kLong, name_, ": gather expects int64 indices [B], got ",
            detail::shape_of(indices), " ", indices.scalar_type());
  Batch out;
  for (const auto& kv : fields_) out[kv.first] = kv.second.index_select(0, indices);
  return out;
}

at::Tensor to_model_range(const at::Tensor& x) {
  DEW_CHECK(x.defined() && x.scalar_type() == at::kByte, "to_model_range: expected uint8 data in [0, 255], got ",
            x.defined() ? std::string(c10::toString(x.scalar_type())) : std::string("an undefined tensor"));
  return x.to(at::kFloat).div_(127.5).sub_(1.0);
}

// ---------------------------------------------------------------------------------------------------
// IDX files

at::Tensor read_idx(const std::string& path, int32_t magic) {
  IdxBytes idx = read_idx_bytes(path, magic);
  auto out = at::empty(idx.dims, at::TensorOptions().dtype(at::kByte));
  std::memcpy(out.data_ptr<uint8_t>(), idx.data.data(), idx.data.size());
  return out;
}

TensorDataset load_fashion_mnist(const std::string& split, const std::string& dir) {
  DEW_CHECK(split == "train" || split == "test", "fashion_mnist.split: got \"", split, "\", accepted: train, test");
  const std::string prefix = (fs::path(dir) / (split == "train" ? "train" : "t10k")).string();
  const std::string images_path = prefix + "-images-idx3-ubyte.gz", labels_path = prefix + "-labels-idx1-ubyte.gz";
  for (const auto& p : {images_path, labels_path}) {
    DEW_CHECK(fs::exists(p), p,
              ": no such file (Fashion-MNIST comes from Debian's dataset-fashion-mnist package, "
              "or set fashion_mnist.dir)");
  }
  auto images = read_idx(images_path, 2051);
  DEW_CHECK(images.size(1) == 28 && images.size(2) == 28, images_path, ": images are ", images.size(1), "x",
            images.size(2), ", Fashion-MNIST's are 28x28");
  auto labels = read_idx(labels_path, 2049);
  DEW_CHECK(labels.size(0) == images.size(0), labels_path, ": holds ", labels.size(0), " labels but ", images_path,
            " holds ", images.size(0), " images; the counts must match");
  const int64_t max_label = labels.max().item<int64_t>();
  DEW_CHECK(max_label < 10, labels_path, ": label ", max_label, " is out of range; accepted: 0..9");
  TensorDataset ds({{"image", images.unsqueeze(1)}, {"label", labels.to(at::kLong)}}, "fashion_mnist");
  ds.set_class_names(
      {"T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"});
  return ds;
}

TensorDataset pad_images(TensorDataset ds, int64_t pad, const std::string& field) {
  DEW_CHECK(pad >= 0 && pad <= 1024, ds.name(), ".pad: must be in [0, 1024], got ", pad);
  if (pad == 0) return ds;
  Batch fields = ds.fields();
  const at::Tensor& x = ds.field(field);
  DEW_CHECK(x.dim() >= 3, ds.name(), ".pad: field \"", field, "\" is not images [N, ..., H, W], got ",
            detail::shape_of(x));
  fields[field] = at::constant_pad_nd(x, {pad, pad, pad, pad}, 0).contiguous();
  TensorDataset out(std::move(fields), ds.name());
  out.set_class_names(ds.class_names());
  out.set_spec(ds.spec());
  return out;
}

TensorDataset select_classes(TensorDataset ds, const std::vector<int64_t>& classes, const std::string& field) {
  if (classes.empty()) return ds;
  const int64_t known = int64_t(ds.class_names().size());
  const at::Tensor labels = ds.field(field);
  DEW_CHECK(labels.dim() == 1 && labels.scalar_type() == at::kLong, ds.name(), ".classes: field \"", field,
            "\" is not int64 labels [N], got ", detail::shape_of(labels));
  for (size_t i = 0; i < classes.size(); ++i) {
    const int64_t c = classes[i];
    DEW_CHECK(c >= 0 && (known == 0 || c < known), ds.name(), ".classes: label ", c, " is not a class; accepted: 0 .. ",
              known - 1);
    DEW_CHECK(std::find(classes.begin(), classes.begin() + i, c) == classes.begin() + i, ds.name(), ".classes: label ",
              c, " is listed twice");
  }
  const at::Tensor keep =
      at::isin(labels, at::tensor(classes, at::TensorOptions().dtype(at::kLong))).nonzero().flatten();  // [M]
  DEW_CHECK(keep.numel() > 0, ds.name(), ".classes: no item has any of the labels ", json(classes).dump());
  TensorDataset out(ds.gather(keep), ds.name());
  out.set_class_names(ds.class_names());
  out.set_spec(ds.spec());
  return out;
}

// ---------------------------------------------------------------------------------------------------
// Image folders

namespace {

bool hidden(const fs::path& p) { return !p.filename().empty() && p.filename().string()[0] == '.'; }

bool is_image_file(const fs::path& p) {
  std::string ext = p.extension().string();
  std::transform(ext.begin(), ext.end(), ext.begin(), [](unsigned char c) { return char(std::tolower(c)); });
  return ext == ".png" || ext == ".jpg" || ext == ".jpeg";
}

// Image files under `root`, recursively, sorted so the item order does not depend on the file system.
std::vector<fs::path> image_files(const fs::path& root, bool recursive) {
  std::vector<fs::path> out;
  auto consider = [&](const fs::directory_entry& e) {
    if (e.is_regular_file() && !hidden(e.path()) && is_image_file(e.path())) out.push_back(e.path());
  };
  if (recursive) {
    for (auto it = fs::recursive_directory_iterator(root); it != fs::recursive_directory_iterator(); ++it) {
      if (it->is_directory() && hidden(it->path())) {
        it.disable_recursion_pending();
        continue;
      }
      consider(*it);
    }
  } else {
    for (const auto& e : fs::directory_iterator(root)) consider(e);
  }
  std::sort(out.begin(), out.end());
  return out;
}

// The centred largest square of an image [C, H, W].
at::Tensor centre_square(const at::Tensor& img) {
  const int64_t h = img.size(1), w = img.size(2), s = std::min(h, w);
  return img.narrow(1, (h - s) / 2, s).narrow(2, (w - s) / 2, s);
}

}  // namespace

TensorDataset load_image_folder(const std::string& dir, int64_t size, int64_t channels) {
  DEW_CHECK(size >= 1 && size <= 4096, "image_folder.size: must be in [1, 4096], got ", size);
  DEW_CHECK(channels == 1 || channels == 3, "image_folder.channels: must be 1 or 3, got ", channels);
  DEW_CHECK(!dir.empty(), "image_folder.dir: required, got an empty string");
  DEW_CHECK(fs::is_directory(dir), "image_folder.dir: \"", dir, "\" is not a directory");

  std::vector<std::string> classes;
  for (const auto& e : fs::directory_iterator(dir)) {
    if (e.is_directory() && !hidden(e.path())) classes.push_back(e.path().filename().string());
  }
  std::sort(classes.begin(), classes.end());

  std::vector<std::pair<fs::path, int64_t>> files;  // (path, label)
  if (classes.empty()) {
    for (auto& p : image_files(dir, false)) files.emplace_back(p, 0);
    const fs::path root = fs::absolute(dir).lexically_normal();  // "a/b/" names its class "b", not ""
    classes.push_back((root.has_filename() ? root : root.parent_path()).filename().string());
  } else {
    for (size_t k = 0; k < classes.size(); ++k) {
      for (auto& p : image_files(fs::path(dir) / classes[k], true)) files.emplace_back(p, int64_t(k));
    }
  }
  DEW_CHECK(!files.empty(), "image_folder.dir: no .png/.jpg/.jpeg files under \"", dir,
            "\"; expected DIR/CLASS/*.png (one sub-folder per class)");

  const int64_t n = int64_t(files.size());
  auto images = at::empty({n, channels, size, size}, at::TensorOptions().dtype(at::kByte));
  auto labels = at::empty({n}, at::TensorOptions().dtype(at::kLong));
  auto* lab = labels.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    auto img = io::load_image(files[size_t(i)].first.string(), channels);
    images[i].copy_(io::resize(centre_square(img).contiguous(), size, size));
    lab[i] = files[size_t(i)].second;
  }
  TensorDataset ds({{"image", images}, {"label", labels}}, "image_folder");
  ds.set_class_names(classes);
  return ds;
}

// ---------------------------------------------------------------------------------------------------
// Gaussian blobs

TensorDataset gaussian_blobs(const GaussianBlobsOptions& o) {
  DEW_CHECK(o.count >= 1, "gaussian_blobs.count: must be >= 1, got ", o.count);
  DEW_CHECK(o.size >= 4 && o.size <= 1024, "gaussian_blobs.size: must be in [4, 1024], got ", o.size);
  DEW_CHECK(o.channels == 1 || o.channels == 3, "gaussian_blobs.channels: must be 1 or 3, got ", o.channels);
  DEW_CHECK(o.classes >= 1 && o.classes <= 65536, "gaussian_blobs.classes: must be in [1, 65536], got ", o.classes);
  // The set is drawn whole, through float64 intermediates of count x size x size: at most 2^26 pixels
  // (512 MiB each), so an absurd count is refused instead of allocating until memory runs out.
  const int64_t max_count = (int64_t(1) << 26) / (o.size * o.size);
  DEW_CHECK(o.count <= max_count, "gaussian_blobs.count: ", o.count, " images of ", o.size, " x ", o.size,
            " exceed the 2^26 pixels a generated set may hold; accepted: at most ", max_count, " at this size");
  auto gen = rng::generator(uint64_t(o.seed), 0, "data/gaussian_blobs");
  const auto f64 = at::TensorOptions().dtype(at::kDouble);
  const double s = double(o.size), mid = (s - 1) / 2;
  auto labels = at::randint(0, o.classes, {o.count}, gen, at::TensorOptions().dtype(at::kLong));
  auto angle = labels.to(at::kDouble) * (2 * M_PI / double(o.classes));
  auto jitter = at::randn({o.count, 2}, gen, f64) * (s / 16);
  auto width = at::rand({o.count}, gen, f64) * (0.06 * s) + 0.08 * s;  // sigma in [0.08, 0.14] size
  auto cy = (mid + (s / 4) * angle.sin() + jitter.select(1, 0)).view({-1, 1, 1});
  auto cx = (mid + (s / 4) * angle.cos() + jitter.select(1, 1)).view({-1, 1, 1});
  auto coord = at::arange(o.size, f64);
  auto r2 = (coord.view({1, -1, 1}) - cy).square() + (coord.view({1, 1, -1}) - cx).square();
  auto bump = (-r2 / (2 * width.view({-1, 1, 1}).square())).exp();  // [count, size, size] in (0, 1]
  auto images = (bump * 255).round().clamp(0, 255).to(at::kByte).unsqueeze(1).expand({-1, o.channels, -1, -1});
  TensorDataset ds({{"image", images.contiguous()}, {"label", labels}}, "gaussian_blobs");
  std::vector<std::string> names;
  for (int64_t k = 0; k < o.classes; ++k) names.push_back("blob_" + std::to_string(k));
  ds.set_class_names(names);
  return ds;
}

// ---------------------------------------------------------------------------------------------------
// Registry

Registry<TensorDataset>& datasets() {
  static Registry<TensorDataset>* r = [] {
    auto* r = new Registry<TensorDataset>("dataset");
    auto tag = [](TensorDataset ds, const std::string& name, const json& fields) {
      json spec = fields;
      spec["name"] = name;
      ds.set_spec(spec);
      return std::make_shared<TensorDataset>(std::move(ds));
    };
    r->add<FashionMnistOptions>("fashion_mnist", "Fashion-MNIST IDX files: uint8 [N, 1, 28, 28] images, 10 labels",
                                [=](const FashionMnistOptions& o) {
                                  return tag(
                                      pad_images(select_classes(load_fashion_mnist(o.split, o.dir), o.classes), o.pad),
                                      "fashion_mnist", to_json(o));
                                });
    r->add<ImageFolderOptions>("image_folder", "png/jpg images, class = sub-folder, centre-cropped and resized",
                               [=](const ImageFolderOptions& o) {
                                 return tag(load_image_folder(o.dir, o.size, o.channels), "image_folder", to_json(o));
                               });
    r->add<GaussianBlobsOptions>(
        "gaussian_blobs", "synthetic test images: one Gaussian bump per image, class = position",
        [=](const GaussianBlobsOptions& o) { return tag(gaussian_blobs(o), "gaussian_blobs", to_json(o)); });
    r->add<MovingFashionMnistOptions>(
        "moving_fashion_mnist", "synthetic video: Fashion-MNIST items drifting and bouncing, uint8 [N, 1, T, S, S]",
        [=](const MovingFashionMnistOptions& o) {
          return tag(moving_fashion_mnist(o), "moving_fashion_mnist", to_json(o));
        });
    return r;
  }();
  return *r;
}

}  // namespace data
}  // namespace dew

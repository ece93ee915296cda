// The data layer (docs/training.md#data-dewdata): in-memory datasets of named tensors, their sources (Fashion-MNIST IDX
// files, image folders, synthetic Gaussian blobs), and a DataLoader that yields dict batches that are
// deterministic for a (seed, epoch) at any number of worker threads, resumable from a saved position and
// prefetched on background threads. Data stays uint8 until the batch boundary (to_model_range).
//
// Example:
//   auto ds = dew::data::datasets().build({{"name", "fashion_mnist"}, {"split", "train"}});
//   dew::data::LoaderOptions lo;
//   lo.batch_size = 128;
//   lo.hflip = true;
//   dew::data::DataLoader loader(ds, lo);
//   dew::data::Batch b = loader.next();                         // {"image": uint8 [128,1,28,28], "label": int64 [128]}
//   at::Tensor x = dew::data::to_model_range(b["image"]);       // float32 in [-1, 1]
//   dew::json pos = loader.state();                             // saved in the checkpoint's state.json
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dew/core/registry.h"

namespace dew {
namespace data {

/// A batch (or a whole dataset): field name -> tensor whose first dimension indexes items.
using Batch = std::map<std::string, at::Tensor>;

/// Where Debian's dataset-fashion-mnist package installs the IDX files.
inline constexpr const char* kFashionMnistDir = "/usr/share/datasets/fashion-mnist";

/// An in-memory dataset: named CPU tensors sharing their first dimension, e.g.
/// {"image": uint8 [N, C, H, W], "label": int64 [N]}.
class TensorDataset {
 public:
  /// Validates that `fields` is non-empty, on the CPU and agrees on the item count; `name` is used in
  /// error messages.
  explicit TensorDataset(Batch fields, std::string name = "tensors");

  /// The name given at construction ("fashion_mnist", "image_folder", ...).
  const std::string& name() const { return name_; }

  /// Number of items N.
  int64_t size() const { return size_; }

  /// All fields.
  const Batch& fields() const { return fields_; }

  /// Whether the dataset has a field called `field`.
  bool contains(const std::string& field) const { return fields_.count(field) > 0; }

  /// The whole tensor of one field; an unknown name is a dew::Error listing the fields.
  const at::Tensor& field(const std::string& field) const;

  /// Items `indices` (int64 [B], each in [0, N)) of every field: a batch that owns its memory.
  Batch gather(const at::Tensor& indices) const;

  /// Names of the label ids, when the source has classes (index = label id); empty otherwise.
  const std::vector<std::string>& class_names() const { return class_names_; }
  void set_class_names(std::vector<std::string> names) { class_names_ = std::move(names); }

  /// The {name, fields} record this dataset was built from (for run.json); null when built directly.
  const json& spec() const { return spec_; }
  void set_spec(json spec) { spec_ = std::move(spec); }

 private:
  Batch fields_;
  std::string name_;
  int64_t size_ = 0;
  std::vector<std::string> class_names_;
  json spec_;
};
using DatasetPtr = std::shared_ptr<TensorDataset>;

/// uint8 [...] in [0, 255] -> float32 [...] in [-1, 1] (x / 127.5 - 1); other dtypes are a dew::Error.
at::Tensor to_model_range(const at::Tensor& x);

// ---- sources ----

/// Reads an IDX file of unsigned bytes, gzipped or plain (zlib reads both), whose 32-bit big-endian
/// magic must equal `magic` (2051: [N, rows, cols] images, 2049: [N] labels). Returns uint8 with the
/// file's dimensions. Missing, truncated, trailing-garbage or bad-magic files are a dew::Error naming it.
at::Tensor read_idx(const std::string& path, int32_t magic);

/// Fashion-MNIST from `dir` ({train,t10k}-{images-idx3,labels-idx1}-ubyte.gz): split "train" (60000
/// items) or "test" (10000). Fields "image" uint8 [N, 1, 28, 28] and "label" int64 [N] in [0, 10).
TensorDataset load_fashion_mnist(const std::string& split = "train", const std::string& dir = kFashionMnistDir);

/// An image folder: DIR/CLASS/**.{png,jpg,jpeg}, classes = sorted sub-folder names -> ids 0.. (when DIR
/// has no sub-folders, its own images form class 0). Each image is centre-cropped to a square, resized
/// to size x size and converted to `channels` (1 or 3). Hidden files and folders are skipped. Fields
/// "image" uint8 [N, channels, size, size] and "label" int64 [N].
TensorDataset load_image_folder(const std::string& dir, int64_t size, int64_t channels = 3);

/// Options of the synthetic Gaussian-blob images.
struct GaussianBlobsOptions {
  int64_t count = 256;
  int64_t size = 16;
  int64_t channels = 1;
  int64_t classes = 4;
  int64_t seed = 0;
  template <class V>
  void visit(V& v) {
    v("count", count, "number of images");
    v("size", size, "image side in pixels (>= 4)");
    v("channels", channels, "1 or 3 (the same blob in every channel)");
    v("classes", classes, "number of classes; class k's blob sits at angle 2 pi k / classes");
    v("seed", seed, "seed of the draws (the set is a pure function of its options)");
  }
};

/// Synthetic test set: each image is one Gaussian bump, centred near its class's point on a circle of
/// radius size/4 around the image centre, with a random width. Fields "image" uint8 [count, channels,
/// size, size] and "label" int64 [count].
TensorDataset gaussian_blobs(const GaussianBlobsOptions& o = {});

/// Options of Moving Fashion-MNIST: synthetic videos of Fashion-MNIST items drifting and bouncing.
struct MovingFashionMnistOptions {
  int64_t count = 10000;
  int64_t frames = 8;
  int64_t size = 32;
  int64_t item_size = 28;
  int64_t items = 1;
  double min_speed = 1.0;
  double max_speed = 3.0;
  std::string split = "train";
  std::string dir = kFashionMnistDir;
  int64_t seed = 0;
  template <class V>
  void visit(V& v) {
    v("count", count, "number of videos");
    v("frames", frames, "frames per video (T)");
    v("size", size, "frame side in pixels, item_size..64");
    v("item_size", item_size, "side the 28x28 items are resized to, by area (<= size)");
    v("items", items, "items per video (the label is the first item's class)");
    v("min_speed", min_speed, "smallest speed, pixels per frame");
    v("max_speed", max_speed, "largest speed, pixels per frame");
    v.choice("split", split, {"train", "test"}, "Fashion-MNIST split the items come from");
    v("dir", dir, "folder holding the Fashion-MNIST files");
    v("seed", seed, "seed of the draws (the set is a pure function of its options)");
  }
};

/// Moving Fashion-MNIST: each video places `items` Fashion-MNIST images at random positions with random
/// velocities (speed uniform in [min_speed, max_speed], direction uniform); each frame moves them by their
/// velocity and reflects them off the frame's edges (bouncing); overlapping items combine by maximum, as
/// in Moving MNIST. Fields "image" uint8 [count, 1, frames, size, size] and "label" int64 [count] (the
/// first item's class); class names are Fashion-MNIST's.
TensorDataset moving_fashion_mnist(const MovingFashionMnistOptions& o = {});
/// The same from already-loaded Fashion-MNIST images (uint8 [N, 1, 28, 28]) and labels.
TensorDataset moving_fashion_mnist(const MovingFashionMnistOptions& o, const TensorDataset& source);

// ---- registry ----

struct FashionMnistOptions {
  std::string split = "train";
  std::string dir = kFashionMnistDir;
  int64_t pad = 0;
  std::vector<int64_t> classes;  // empty: all ten
  template <class V>
  void visit(V& v) {
    v.choice("split", split, {"train", "test"}, "train (60000 items) or test (10000)");
    v("dir", dir, "folder holding the {train,t10k}-*-ubyte.gz files");
    v("pad", pad, "zero pixels added on every side (2: 32 x 32 images, the size a VAE's 2x downsamplings divide)");
    v("classes", classes,
      "keep only the items of these labels, e.g. [0,1,2] (labels and the 10 class names unchanged; [] = all)");
  }
};

/// The items of `ds` whose `field` (int64 [N]) is one of `classes`, in their order; the class names and spec
/// unchanged, so a subset keeps the source's label ids and class count. Empty `classes` returns ds as it is.
/// dew::Error naming `<name>.classes` for a label outside the class names (or < 0 without names), a label listed
/// twice, and a selection that keeps no item.
TensorDataset select_classes(TensorDataset ds, const std::vector<int64_t>& classes, const std::string& field = "label");

/// `ds` with `field` ([N, ..., H, W]) zero-padded by `pad` pixels on every side (H + 2 pad, W + 2 pad); the
/// other fields, class names and spec unchanged. pad 0 returns it as it is; pad outside [0, 1024] is a dew::Error.
TensorDataset pad_images(TensorDataset ds, int64_t pad, const std::string& field = "image");

struct ImageFolderOptions {
  std::string dir;
  int64_t size = 64;
  int64_t channels = 3;
  template <class V>
  void visit(V& v) {
    v("dir", dir, "root folder, e.g. data/flowers; one sub-folder per class (required)");
    v("size", size, "images are centre-cropped and resized to size x size");
    v("channels", channels, "1 (grey) or 3 (RGB)");
  }
};

/// The registry of datasets: fashion_mnist, image_folder, gaussian_blobs, moving_fashion_mnist. Each builds an in-memory
/// TensorDataset whose spec() is its {name, fields} record.
Registry<TensorDataset>& datasets();

// ---- loading batches ----

/// Options of a DataLoader.
struct LoaderOptions {
  int64_t batch_size = 32;
  bool shuffle = true;
  bool drop_last = false;
  int64_t num_workers = 2;
  int64_t prefetch = 4;
  int64_t seed = 0;
  bool hflip = false;
  int64_t crop_padding = 0;
  std::pair<double, double> crop_scale{1.0, 1.0};
  std::pair<double, double> crop_ratio{0.75, 4.0 / 3};
  std::string image_field = "image";
  template <class V>
  void visit(V& v) {
    v("batch_size", batch_size, "items per batch");
    v("shuffle", shuffle, "draw a new item order each epoch");
    v("drop_last", drop_last, "drop each epoch's final partial batch");
    v("num_workers", num_workers, "background threads preparing batches (0: on the caller's thread)");
    v("prefetch", prefetch, "batches prepared ahead of the consumer");
    v("seed", seed, "seed of shuffling and augmentation");
    v("hflip", hflip, "random horizontal flip, p = 0.5");
    v("crop_padding", crop_padding, "random crop back to H x W after zero padding by this many pixels (0: off)");
    v("crop_scale", crop_scale, "random resized crop (torchvision's): [min, max] area fraction ([1, 1]: off)");
    v("crop_ratio", crop_ratio, "random resized crop: [min, max] aspect ratio, width / height");
    v("image_field", image_field, "field the augmentations apply to ([N, ..., H, W])");
  }
  bool resized_crop_on() const;  // crop_scale is not [1, 1]
  bool augments() const;         // any augmentation is on: hflip, crop_padding or the resized crop
};

/// A box of an H x W image: rows [top, top + height), columns [left, left + width).
struct CropBox {
  int64_t top = 0, left = 0, height = 0, width = 0;
};

/// The box torchvision's RandomResizedCrop.get_params draws: up to 10 tries of an area fraction uniform in
/// `scale` and a log-uniform aspect (width / height) in `ratio`, sides rounded, a uniform corner; when no
/// try fits, the centred crop of the image clamped to `ratio`. `draw` gives uniform 32-bit integers: two
/// per try, two more for the corner of the try that fits.
CropBox random_resized_crop_box(int64_t height, int64_t width, std::pair<double, double> scale,
                                std::pair<double, double> ratio, const std::function<uint32_t()>& draw);

/// `box` of `image` ([..., H, W]) resized back to H x W as torchvision's resized_crop does on tensors:
/// bilinear, align_corners false, antialiased (torchvision's default since 0.17), in float64 for float64 images and float32 otherwise; uint8
/// results are rounded half to even. Every leading slice (channel, frame) gets the same box.
at::Tensor resized_crop(const at::Tensor& image, const CropBox& box);

/// Yields batches of an in-memory dataset forever, epoch after epoch.
///
/// Determinism: epoch e's order is randperm(N) drawn from dew::rng::generator(seed, e, "data/shuffle")
/// (identity without shuffle). The item at position p of epoch e (p counts items from the start of the
/// epoch's order) is augmented with dew::rng::generator(seed, (e << 32) | p, "data/augment"), whose
/// first three 32-bit draws give flip (bit 0 of the first), crop dy and crop dx (the others, modulo
/// 2 * crop_padding + 1); the draws after them give the resized crop's box. The resized crop comes first
/// (the box, bilinearly resized back to H x W, every frame of a clip alike), then the padded crop, then
/// the flip. Batches are delivered in order whatever thread built them, so the stream is
/// identical for any num_workers. Batch k of an epoch holds positions [k B, min((k + 1) B, N)).
/// One consumer thread calls next(); the workers are internal.
class DataLoader {
 public:
  /// Runs on the worker after augmentation, e.g. to convert fields; must not depend on thread or time.
  using BatchTransform = std::function<void(Batch& batch)>;

  /// Validates the options against the dataset (dew::Error naming the field); threads start on the
  /// first next().
  DataLoader(std::shared_ptr<const TensorDataset> dataset, LoaderOptions options = {}, BatchTransform transform = {});

  /// Stops and joins the workers; batches prepared but not taken are dropped.
  ~DataLoader();
  DataLoader(const DataLoader&) = delete;
  DataLoader& operator=(const DataLoader&) = delete;

  /// The next batch, crossing into the next epoch (and its new order) automatically. An exception
  /// raised while building a batch is re-thrown here, in stream order, and by every later call until
  /// load_state().
  Batch next();

  /// The position of the next batch next() returns: {"epoch", "index" (item position in the epoch's
  /// order), "dataset_size"}.
  json state() const;

  /// Continues from a state() record: the following batches equal those the saving loader would have
  /// produced. Drops prefetched batches; the dataset size, when recorded, must match.
  void load_state(const json& state);

  /// The epoch the next batch belongs to.
  int64_t epoch() const;

  /// Batches in one epoch: floor(N / B) with drop_last, ceil(N / B) without.
  int64_t batches_per_epoch() const;

  const LoaderOptions& options() const;
  const TensorDataset& dataset() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace data
}  // namespace dew

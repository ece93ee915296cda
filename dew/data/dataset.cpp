#include "dew/data/dataset.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <zlib.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <filesystem>
#include <mutex>
#include <sstream>
#include <thread>

#include "dew/core/rng.h"
#include "dew/io/image.h"

namespace dew {
namespace data {

namespace fs = std::filesystem;

namespace {

std::string shape_of(const at::Tensor& t) {
  std::ostringstream s;
  s << t.sizes();
  return s.str();
}

std::string field_list(const Batch& b) {
  std::string out;
  for (const auto& kv : b) out += (out.empty() ? "" : ", ") + kv.first;
  return out;
}

}  // namespace

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
  if (it == fields_.end()) fail(name_, ": no field \"", field, "\"; fields: ", field_list(fields_));
  return it->second;
}

Batch TensorDataset::gather(const at::Tensor& indices) const {
  DEW_CHECK(indices.dim() == 1 && indices.scalar_type() == at::kLong, name_,
            ": gather expects int64 indices [B], got ", shape_of(indices), " ", indices.scalar_type());
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

namespace {

struct GzClose {
  void operator()(gzFile_s* f) const { gzclose(f); }
};
using GzFile = std::unique_ptr<gzFile_s, GzClose>;

std::string gz_reason(gzFile f) {
  int code = 0;
  const char* msg = gzerror(f, &code);
  if (code == Z_ERRNO) return std::strerror(errno);
  return msg && *msg ? msg : "unexpected end of data";
}

// Reads exactly n bytes or throws naming the file and how far it got.
void read_exact(gzFile f, const std::string& path, void* dst, int64_t n, const char* what) {
  auto* p = static_cast<unsigned char*>(dst);
  int64_t done = 0;
  while (done < n) {
    const unsigned chunk = unsigned(std::min<int64_t>(n - done, int64_t(1) << 30));  // gzread takes an unsigned
    const int r = gzread(f, p + done, chunk);
    if (r < 0) fail(path, ": corrupt gzip data while reading the ", what, ": ", gz_reason(f));
    if (r == 0) {
      fail(path, ": truncated: the ", what, " needs ", n, " bytes, the file holds only ", done,
           (gzeof(f) ? "" : std::string(" (") + gz_reason(f) + ")"));
    }
    done += r;
  }
}

uint32_t big_endian(const unsigned char* b) {
  return (uint32_t(b[0]) << 24) | (uint32_t(b[1]) << 16) | (uint32_t(b[2]) << 8) | uint32_t(b[3]);
}

}  // namespace

at::Tensor read_idx(const std::string& path, int32_t magic) {
  // IDX magic: two zero bytes, the element type (0x08 = unsigned byte) and the number of dimensions.
  const int32_t expected_type = (magic >> 8) & 0xff, ndim = magic & 0xff;
  DEW_CHECK((magic >> 16) == 0 && expected_type == 0x08 && ndim >= 1 && ndim <= 4,
            "read_idx(\"", path, "\"): expected magic must describe unsigned bytes with 1-4 dimensions "
            "(0x0801-0x0804), got ", magic);
  errno = 0;
  GzFile f(gzopen(path.c_str(), "rb"));
  if (!f) fail(path, ": cannot open: ", errno ? std::strerror(errno) : "out of memory");
  gzbuffer(f.get(), 1 << 18);  // fewer, larger reads of the compressed file

  unsigned char head[4];
  read_exact(f.get(), path, head, 4, "magic number");
  const uint32_t got = big_endian(head);
  if (got != uint32_t(magic)) {
    fail(path, ": bad magic number ", got, ", expected ", magic, " (IDX unsigned bytes, ", ndim,
         ndim == 1 ? " dimension" : " dimensions", "); not an IDX file of this kind, or corrupt");
  }
  std::vector<int64_t> dims(size_t(ndim), 0);
  int64_t total = 1;
  for (int32_t d = 0; d < ndim; ++d) {
    unsigned char b[4];
    read_exact(f.get(), path, b, 4, "header");
    dims[d] = int64_t(big_endian(b));
    DEW_CHECK(dims[d] > 0, path, ": dimension ", d, " is 0; an IDX file must hold at least one item");
    total *= dims[d];
    // 16 GiB is far above any real IDX file; larger sizes mean a corrupt header, not data to allocate.
    DEW_CHECK(total <= (int64_t(1) << 34), path, ": header declares ", total,
              "+ bytes of data, more than the 16 GiB accepted; the header is corrupt");
  }
  auto out = at::empty(dims, at::TensorOptions().dtype(at::kByte));
  read_exact(f.get(), path, out.data_ptr<uint8_t>(), total, "data");
  unsigned char extra;
  const int r = gzread(f.get(), &extra, 1);
  if (r < 0) fail(path, ": corrupt gzip data after the items: ", gz_reason(f.get()));
  DEW_CHECK(r == 0, path, ": trailing bytes after the ", dims[0], " items the header declares; the file is corrupt");
  return out;
}

TensorDataset load_fashion_mnist(const std::string& split, const std::string& dir) {
  DEW_CHECK(split == "train" || split == "test", "fashion_mnist.split: got \"", split, "\", accepted: train, test");
  const std::string prefix = (fs::path(dir) / (split == "train" ? "train" : "t10k")).string();
  const std::string images_path = prefix + "-images-idx3-ubyte.gz", labels_path = prefix + "-labels-idx1-ubyte.gz";
  for (const auto& p : {images_path, labels_path}) {
    DEW_CHECK(fs::exists(p), p, ": no such file (Fashion-MNIST comes from Debian's dataset-fashion-mnist package, "
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
  ds.set_class_names({"T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag",
                      "Ankle boot"});
  return ds;
}

TensorDataset pad_images(TensorDataset ds, int64_t pad, const std::string& field) {
  DEW_CHECK(pad >= 0 && pad <= 1024, ds.name(), ".pad: must be in [0, 1024], got ", pad);
  if (pad == 0) return ds;
  Batch fields = ds.fields();
  const at::Tensor& x = ds.field(field);
  DEW_CHECK(x.dim() >= 3, ds.name(), ".pad: field \"", field, "\" is not images [N, ..., H, W], got ", shape_of(x));
  fields[field] = at::constant_pad_nd(x, {pad, pad, pad, pad}, 0).contiguous();
  TensorDataset out(std::move(fields), ds.name());
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
  DEW_CHECK(o.classes >= 1, "gaussian_blobs.classes: must be >= 1, got ", o.classes);
  auto gen = rng::generator(uint64_t(o.seed), 0, "data/gaussian_blobs");
  const auto f64 = at::TensorOptions().dtype(at::kDouble);
  const double s = double(o.size), mid = (s - 1) / 2;
  auto labels = at::randint(0, o.classes, {o.count}, gen, at::TensorOptions().dtype(at::kLong));
  auto angle = labels.to(at::kDouble) * (2 * M_PI / double(o.classes));
  auto jitter = at::randn({o.count, 2}, gen, f64) * (s / 16);
  auto width = at::rand({o.count}, gen, f64) * (0.06 * s) + 0.08 * s;   // sigma in [0.08, 0.14] size
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
                                  return tag(pad_images(load_fashion_mnist(o.split, o.dir), o.pad), "fashion_mnist", to_json(o));
                                });
    r->add<ImageFolderOptions>("image_folder", "png/jpg images, class = sub-folder, centre-cropped and resized",
                               [=](const ImageFolderOptions& o) {
                                 return tag(load_image_folder(o.dir, o.size, o.channels), "image_folder", to_json(o));
                               });
    r->add<GaussianBlobsOptions>("gaussian_blobs", "synthetic test images: one Gaussian bump per image, class = position",
                                 [=](const GaussianBlobsOptions& o) {
                                   return tag(gaussian_blobs(o), "gaussian_blobs", to_json(o));
                                 });
    r->add<MovingFashionMnistOptions>(
        "moving_fashion_mnist", "synthetic video: Fashion-MNIST items drifting and bouncing, uint8 [N, 1, T, S, S]",
        [=](const MovingFashionMnistOptions& o) {
          return tag(moving_fashion_mnist(o), "moving_fashion_mnist", to_json(o));
        });
    return r;
  }();
  return *r;
}

// ---------------------------------------------------------------------------------------------------
// DataLoader
//
// Batches are numbered by a sequence number in stream order. Workers claim the next number (and its
// epoch position) under the lock, build the batch without it, and file the result under its number;
// next() hands results out strictly in number order. So which thread built a batch never matters, and
// the content of a batch depends only on (seed, epoch, positions).

namespace {

struct Pos {
  int64_t epoch = 0;
  int64_t index = 0;  // position of the next item in the epoch's order
};

struct Ticket {
  int64_t seq = 0;
  Pos at;           // the batch covers positions [at.index, end) of epoch at.epoch
  int64_t end = 0;
  Pos next;         // where the stream continues after this batch
  std::shared_ptr<const at::Tensor> order;  // the epoch's item order, int64 [N]
};

struct Slot {
  Batch batch;
  Pos next;
  std::exception_ptr error;
};

}  // namespace

bool LoaderOptions::resized_crop_on() const { return crop_scale != std::pair<double, double>{1.0, 1.0}; }

bool LoaderOptions::augments() const { return hflip || crop_padding > 0 || resized_crop_on(); }

CropBox random_resized_crop_box(int64_t height, int64_t width, std::pair<double, double> scale,
                                std::pair<double, double> ratio, const std::function<uint32_t()>& draw) {
  auto uniform = [&](double lo, double hi) { return lo + (hi - lo) * (double(draw()) / 4294967296.0); };
  // std::nearbyint rounds half to even, as Python's round() does in torchvision.
  auto round_int = [](double v) { return int64_t(std::nearbyint(v)); };
  const double area = double(height) * double(width);
  const double log_lo = std::log(ratio.first), log_hi = std::log(ratio.second);
  for (int attempt = 0; attempt < 10; ++attempt) {
    const double target_area = area * uniform(scale.first, scale.second);
    const double aspect = std::exp(uniform(log_lo, log_hi));
    const int64_t w = round_int(std::sqrt(target_area * aspect));
    const int64_t h = round_int(std::sqrt(target_area / aspect));
    if (w > 0 && w <= width && h > 0 && h <= height) {
      const int64_t top = int64_t(draw() % uint32_t(height - h + 1));
      const int64_t left = int64_t(draw() % uint32_t(width - w + 1));
      return {top, left, h, w};
    }
  }
  const double in_ratio = double(width) / double(height);
  int64_t w = width, h = height;
  if (in_ratio < ratio.first) {
    h = round_int(double(w) / ratio.first);
  } else if (in_ratio > ratio.second) {
    w = round_int(double(h) * ratio.second);
  }
  return {(height - h) / 2, (width - w) / 2, h, w};
}

at::Tensor resized_crop(const at::Tensor& image, const CropBox& box) {
  const int64_t h = image.size(-2), w = image.size(-1);
  auto crop = image.narrow(-2, box.top, box.height).narrow(-1, box.left, box.width);
  if (box.height == h && box.width == w) return crop.clone();
  const auto work = image.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  // Antialiased bilinear, as torchvision's resize defaults to since 0.17 (its filter weights, also when
  // enlarging, differ in the last bits from plain bilinear's, which moves uint8 rounding).
  auto out = at::_upsample_bilinear2d_aa(crop.reshape({1, -1, box.height, box.width}).to(work), {h, w},
                                         /*align_corners=*/false);
  if (!at::isFloatingType(image.scalar_type())) out.round_();  // torchvision rounds before casting back
  return out.reshape(image.sizes()).to(image.scalar_type());
}

struct DataLoader::Impl {
  std::shared_ptr<const TensorDataset> ds;
  LoaderOptions o;
  BatchTransform transform;
  int64_t n = 0;

  mutable std::mutex mu;
  std::condition_variable space_cv;  // workers wait for room ahead of the consumer
  std::condition_variable ready_cv;  // the consumer waits for its next batch
  std::vector<std::thread> workers;
  bool stop = false;
  bool failed = false;       // a worker's batch threw: claim nothing more
  std::exception_ptr error;  // sticky once next() has met it
  Pos claim_pos, delivered_pos;
  int64_t claim_seq = 0, deliver_seq = 0;
  std::map<int64_t, Slot> ready;
  int64_t order_epoch = -1;
  std::shared_ptr<const at::Tensor> order;

  bool epoch_done(int64_t index) const { return o.drop_last ? index + o.batch_size > n : index >= n; }
  Pos normalise(Pos p) const { return epoch_done(p.index) ? Pos{p.epoch + 1, 0} : p; }
  int64_t capacity() const { return std::max(o.prefetch, o.num_workers); }

  std::shared_ptr<const at::Tensor> order_of(int64_t epoch) {
    if (epoch != order_epoch) {
      auto idx = o.shuffle
                     ? at::randperm(n, rng::generator(uint64_t(o.seed), uint64_t(epoch), "data/shuffle"),
                                    at::TensorOptions().dtype(at::kLong))
                     : at::arange(n, at::TensorOptions().dtype(at::kLong));
      order = std::make_shared<const at::Tensor>(idx);
      order_epoch = epoch;
    }
    return order;
  }

  Ticket claim_locked() {
    Ticket t;
    t.seq = claim_seq++;
    t.at = claim_pos;
    t.end = std::min(t.at.index + o.batch_size, n);
    t.next = normalise(Pos{t.at.epoch, t.end});
    t.order = order_of(t.at.epoch);
    claim_pos = t.next;
    return t;
  }

  void augment(Batch& b, const Ticket& t) const {
    if (!o.augments()) return;
    auto& img = b.at(o.image_field);
    const int64_t p = o.crop_padding, h = img.size(-2), w = img.size(-1);
    for (int64_t i = 0; i < img.size(0); ++i) {
      const uint64_t step = (uint64_t(t.at.epoch) << 32) | uint64_t(t.at.index + i);
      auto gen = rng::generator(uint64_t(o.seed), step, "data/augment");
      auto* g = gen.get<at::CPUGeneratorImpl>();
      // Always three draws in this order, so enabling one augmentation never changes the other's; the
      // resized crop's draws come after them for the same reason.
      const bool flip = (g->random() & 1u) != 0;
      const int64_t dy = int64_t(g->random() % uint32_t(2 * p + 1));
      const int64_t dx = int64_t(g->random() % uint32_t(2 * p + 1));
      auto item = img[i];
      if (o.resized_crop_on()) {
        const auto box = random_resized_crop_box(h, w, o.crop_scale, o.crop_ratio, [g] { return g->random(); });
        if (box.height != h || box.width != w) item.copy_(resized_crop(item, box));
      }
      if (p > 0 && (dy != p || dx != p)) {
        auto padded = at::constant_pad_nd(item, {p, p, p, p}, 0);
        item.copy_(padded.narrow(-2, dy, h).narrow(-1, dx, w));
      }
      if (o.hflip && flip) item.copy_(item.flip({-1}));
    }
  }

  Batch build(const Ticket& t) const {
    Batch b = ds->gather(t.order->narrow(0, t.at.index, t.end - t.at.index));
    augment(b, t);
    if (transform) transform(b);
    return b;
  }

  void worker_loop() {
    for (;;) {
      Ticket t;
      {
        std::unique_lock<std::mutex> lk(mu);
        space_cv.wait(lk, [&] { return stop || failed || claim_seq < deliver_seq + capacity(); });
        if (stop || failed) return;
        t = claim_locked();
      }
      Slot s;
      s.next = t.next;
      try {
        s.batch = build(t);
      } catch (...) {
        s.error = std::current_exception();
      }
      const bool threw = s.error != nullptr;
      {
        std::lock_guard<std::mutex> lk(mu);
        if (threw) failed = true;
        ready.emplace(t.seq, std::move(s));
      }
      ready_cv.notify_all();
      if (threw) space_cv.notify_all();  // wake idle workers so they exit
    }
  }

  void start_locked() {
    if (!workers.empty() || o.num_workers == 0) return;
    for (int64_t i = 0; i < o.num_workers; ++i) workers.emplace_back([this] { worker_loop(); });
  }

  void stop_workers() {
    {
      std::lock_guard<std::mutex> lk(mu);
      stop = true;
    }
    space_cv.notify_all();
    for (auto& th : workers) th.join();
    workers.clear();
    stop = false;
  }
};

DataLoader::DataLoader(std::shared_ptr<const TensorDataset> dataset, LoaderOptions options, BatchTransform transform)
    : impl_(std::make_unique<Impl>()) {
  DEW_CHECK(dataset != nullptr, "DataLoader: the dataset is null");
  auto& o = options;
  const int64_t n = dataset->size();
  const std::string& name = dataset->name();
  DEW_CHECK(n >= 1, "DataLoader: dataset \"", name, "\" is empty");
  DEW_CHECK(n < (int64_t(1) << 32), "DataLoader: dataset \"", name, "\" has ", n,
            " items; the augmentation stream (epoch << 32 | position) accepts fewer than 2^32");
  DEW_CHECK(o.batch_size >= 1, "loader.batch_size: must be >= 1, got ", o.batch_size);
  DEW_CHECK(!o.drop_last || o.batch_size <= n, "loader.batch_size: ", o.batch_size, " is larger than dataset \"",
            name, "\" (", n, " items) with drop_last = true, which would give no batches");
  DEW_CHECK(o.num_workers >= 0 && o.num_workers <= 64, "loader.num_workers: must be in [0, 64], got ", o.num_workers);
  DEW_CHECK(o.prefetch >= 1, "loader.prefetch: must be >= 1, got ", o.prefetch);
  DEW_CHECK(o.crop_padding >= 0 && o.crop_padding <= 1024, "loader.crop_padding: must be in [0, 1024], got ",
            o.crop_padding);
  const auto [s0, s1] = o.crop_scale;
  DEW_CHECK(s0 > 0 && s0 <= s1 && s1 <= 1, "loader.crop_scale: must be [min, max] with 0 < min <= max <= 1, got [",
            s0, ", ", s1, "]");
  const auto [r0, r1] = o.crop_ratio;
  DEW_CHECK(r0 > 0 && r0 <= r1 && std::isfinite(r1), "loader.crop_ratio: must be [min, max] with 0 < min <= max, got [",
            r0, ", ", r1, "]");
  if (o.augments()) {
    DEW_CHECK(dataset->contains(o.image_field), "loader.image_field: dataset \"", name, "\" has no field \"",
              o.image_field, "\"; fields: ", field_list(dataset->fields()));
    const auto& img = dataset->field(o.image_field);
    DEW_CHECK(img.dim() >= 3, "loader.image_field: field \"", o.image_field, "\" must be [N, ..., H, W], got shape ",
              shape_of(img));
    DEW_CHECK(!o.resized_crop_on() || img.scalar_type() == at::kByte || at::isFloatingType(img.scalar_type()),
              "loader.crop_scale: the resized crop needs uint8 or floating-point images; field \"", o.image_field,
              "\" is ", img.scalar_type());
  }
  impl_->ds = std::move(dataset);
  impl_->o = o;
  impl_->transform = std::move(transform);
  impl_->n = n;
}

DataLoader::~DataLoader() { impl_->stop_workers(); }

Batch DataLoader::next() {
  auto& m = *impl_;
  if (m.o.num_workers == 0) {
    Ticket t;
    {
      std::lock_guard<std::mutex> lk(m.mu);
      if (m.error) std::rethrow_exception(m.error);
      t = m.claim_locked();
    }
    Batch b;
    try {
      b = m.build(t);
    } catch (...) {
      std::lock_guard<std::mutex> lk(m.mu);
      m.error = std::current_exception();
      throw;
    }
    std::lock_guard<std::mutex> lk(m.mu);
    m.deliver_seq++;
    m.delivered_pos = t.next;
    return b;
  }
  std::unique_lock<std::mutex> lk(m.mu);
  if (m.error) std::rethrow_exception(m.error);
  m.start_locked();
  m.ready_cv.wait(lk, [&] { return m.ready.count(m.deliver_seq) > 0; });
  auto node = m.ready.extract(m.deliver_seq);
  Slot s = std::move(node.mapped());
  if (s.error) {
    m.error = s.error;
    std::rethrow_exception(s.error);
  }
  m.deliver_seq++;
  m.delivered_pos = s.next;
  lk.unlock();
  m.space_cv.notify_all();
  return std::move(s.batch);
}

json DataLoader::state() const {
  std::lock_guard<std::mutex> lk(impl_->mu);
  return json{{"epoch", impl_->delivered_pos.epoch},
              {"index", impl_->delivered_pos.index},
              {"dataset_size", impl_->n}};
}

void DataLoader::load_state(const json& state) {
  auto& m = *impl_;
  auto integer = [&](const char* key) -> int64_t {
    DEW_CHECK(state.is_object() && state.contains(key) && state[key].is_number_integer(), "loader state: field \"",
              key, "\" must be an integer, got ", state.is_object() && state.contains(key) ? state[key].dump() : "nothing",
              " (expected {\"epoch\": E, \"index\": I} from DataLoader::state())");
    return state[key].get<int64_t>();
  };
  const int64_t epoch = integer("epoch"), index = integer("index");
  DEW_CHECK(epoch >= 0 && epoch < (int64_t(1) << 31), "loader state: epoch must be in [0, 2^31), got ", epoch);
  DEW_CHECK(index >= 0 && index <= m.n, "loader state: index must be in [0, ", m.n, "] (the dataset size), got ",
            index);
  if (state.contains("dataset_size")) {
    const int64_t saved = integer("dataset_size");
    DEW_CHECK(saved == m.n, "loader state: saved for a dataset of ", saved, " items, but dataset \"", m.ds->name(),
              "\" has ", m.n, "; resuming would visit different items");
  }
  m.stop_workers();  // in-flight batches belong to the old position
  std::lock_guard<std::mutex> lk(m.mu);
  m.ready.clear();
  m.failed = false;
  m.error = nullptr;
  m.claim_seq = m.deliver_seq = 0;
  m.claim_pos = m.delivered_pos = m.normalise(Pos{epoch, index});
}

int64_t DataLoader::epoch() const {
  std::lock_guard<std::mutex> lk(impl_->mu);
  return impl_->delivered_pos.epoch;
}

int64_t DataLoader::batches_per_epoch() const {
  const int64_t n = impl_->n, b = impl_->o.batch_size;
  return impl_->o.drop_last ? n / b : (n + b - 1) / b;
}

const LoaderOptions& DataLoader::options() const { return impl_->o; }

const TensorDataset& DataLoader::dataset() const { return *impl_->ds; }

}  // namespace data
}  // namespace dew

#include "dew/data/dataset.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <exception>
#include <map>
#include <mutex>
#include <thread>

#include "dew/core/rng.h"
#include "dew/data/dataset_detail.h"

namespace dew {
namespace data {

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
  Pos at;  // the batch covers positions [at.index, end) of epoch at.epoch
  int64_t end = 0;
  Pos next;                                 // where the stream continues after this batch
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
      auto idx = o.shuffle ? at::randperm(n, rng::generator(uint64_t(o.seed), uint64_t(epoch), "data/shuffle"),
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
  DEW_CHECK(!o.drop_last || o.batch_size <= n, "loader.batch_size: ", o.batch_size, " is larger than dataset \"", name,
            "\" (", n, " items) with drop_last = true, which would give no batches");
  DEW_CHECK(o.num_workers >= 0 && o.num_workers <= 64, "loader.num_workers: must be in [0, 64], got ", o.num_workers);
  // Bounded: the workers keep up to this many batches ready, so an absurd value would grow memory without end.
  DEW_CHECK(o.prefetch >= 1 && o.prefetch <= 1024, "loader.prefetch: must be in [1, 1024], got ", o.prefetch);
  DEW_CHECK(o.crop_padding >= 0 && o.crop_padding <= 1024, "loader.crop_padding: must be in [0, 1024], got ",
            o.crop_padding);
  const auto [s0, s1] = o.crop_scale;
  DEW_CHECK(s0 > 0 && s0 <= s1 && s1 <= 1, "loader.crop_scale: must be [min, max] with 0 < min <= max <= 1, got [", s0,
            ", ", s1, "]");
  const auto [r0, r1] = o.crop_ratio;
  DEW_CHECK(r0 > 0 && r0 <= r1 && std::isfinite(r1), "loader.crop_ratio: must be [min, max] with 0 < min <= max, got [",
            r0, ", ", r1, "]");
  if (o.augments()) {
    DEW_CHECK(dataset->contains(o.image_field), "loader.image_field: dataset \"", name, "\" has no field \"",
              o.image_field, "\"; fields: ", detail::field_list(dataset->fields()));
    const auto& img = dataset->field(o.image_field);
    DEW_CHECK(img.dim() >= 3, "loader.image_field: field \"", o.image_field, "\" must be [N, ..., H, W], got shape ",
              detail::shape_of(img));
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
  return json{{"epoch", impl_->delivered_pos.epoch}, {"index", impl_->delivered_pos.index}, {"dataset_size", impl_->n}};
}

void DataLoader::load_state(const json& state) {
  auto& m = *impl_;
  auto integer = [&](const char* key) -> int64_t {
    DEW_CHECK(state.is_object() && state.contains(key) && state[key].is_number_integer(), "loader state: field \"", key,
              "\" must be an integer, got ", state.is_object() && state.contains(key) ? state[key].dump() : "nothing",
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

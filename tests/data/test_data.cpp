#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <future>

#include "tests/test_util.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <zlib.h>

#include <unistd.h>
#include <algorithm>
#include <atomic>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <set>

#include "dew/core/error.h"
#include "dew/core/rng.h"
#include "dew/data/dataset.h"
#include "dew/io/image.h"
#include "dew/io/safetensors.h"

namespace fs = std::filesystem;
using dew::data::Batch;
using dew::data::DataLoader;
using dew::data::LoaderOptions;
using dew::data::TensorDataset;

namespace {

using dew::test::TempDir;

using dew::test::error_of;

void put_be32(std::string& s, uint32_t v) {
  for (int shift : {24, 16, 8, 0}) s.push_back(char((v >> shift) & 0xff));
}

// An IDX file body: magic, dimensions, then `payload` bytes (possibly fewer than the dimensions say).
std::string idx_bytes(uint32_t magic, const std::vector<uint32_t>& dims, size_t payload) {
  std::string s;
  put_be32(s, magic);
  for (auto d : dims) put_be32(s, d);
  for (size_t i = 0; i < payload; ++i) s.push_back(char(i % 7));
  return s;
}

void write_gz(const std::string& path, const std::string& bytes) {
  gzFile f = gzopen(path.c_str(), "wb");
  ASSERT_NE(f, nullptr) << path;
  ASSERT_EQ(gzwrite(f, bytes.data(), unsigned(bytes.size())), int(bytes.size()));
  ASSERT_EQ(gzclose(f), Z_OK);
}

// A small dataset whose "id" field is each item's index, so batches reveal which items they hold.
std::shared_ptr<TensorDataset> id_dataset(int64_t n) {
  dew::data::GaussianBlobsOptions o;
  o.count = n;
  o.size = 8;
  auto blobs = dew::data::gaussian_blobs(o);
  auto fields = blobs.fields();
  fields["id"] = at::arange(n, at::kLong);
  return std::make_shared<TensorDataset>(fields, "ids");
}

std::vector<Batch> take(DataLoader& loader, int64_t k) {
  std::vector<Batch> out;
  for (int64_t i = 0; i < k; ++i) out.push_back(loader.next());
  return out;
}

void expect_same_batches(const std::vector<Batch>& a, const std::vector<Batch>& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(a[i].size(), b[i].size()) << what << " batch " << i;
    for (const auto& kv : a[i]) {
      ASSERT_TRUE(b[i].count(kv.first)) << what << " batch " << i << " field " << kv.first;
      EXPECT_TRUE(at::equal(kv.second, b[i].at(kv.first))) << what << " batch " << i << " field " << kv.first;
    }
  }
}

}  // namespace

// ---- Fashion-MNIST ----

// Reference sums computed independently with Debian's Python:
//   /usr/bin/python3 -c "import gzip; d='/usr/share/datasets/fashion-mnist/';
//     im=gzip.open(d+'train-images-idx3-ubyte.gz').read(); lb=gzip.open(d+'train-labels-idx1-ubyte.gz').read();
//     print(sum(im[16:]), sum(lb[8:]), sum(i*b for i,b in enumerate(lb[8:])), sum(im[16:16+784]), list(lb[8:13]))"
// (and the same for t10k).
TEST(FashionMnist, TrainAndTestMatchReferenceChecksums) {
  struct Ref {
    const char* split;
    int64_t n, pixel_sum, label_sum, weighted_label_sum, first_image_sum;
    std::vector<int64_t> first_labels;
  };
  for (const Ref& r : {Ref{"train", 60000, 3431114169LL, 270000, 8087216427LL, 76247, {9, 0, 0, 3, 0}},
                       Ref{"test", 10000, 573469082LL, 45000, 225732341LL, 33456, {9, 2, 1, 1, 6}}}) {
    auto ds = dew::data::load_fashion_mnist(r.split);
    ASSERT_EQ(ds.size(), r.n) << r.split;
    const auto& img = ds.field("image");
    const auto& lab = ds.field("label");
    EXPECT_EQ(img.sizes(), (std::vector<int64_t>{r.n, 1, 28, 28}));
    EXPECT_EQ(img.scalar_type(), at::kByte);
    EXPECT_EQ(lab.sizes(), (std::vector<int64_t>{r.n}));
    EXPECT_EQ(lab.scalar_type(), at::kLong);
    EXPECT_EQ(img.sum(at::kLong).item<int64_t>(), r.pixel_sum) << r.split;
    EXPECT_EQ(img[0].sum(at::kLong).item<int64_t>(), r.first_image_sum) << r.split;
    EXPECT_EQ(lab.sum().item<int64_t>(), r.label_sum) << r.split;
    EXPECT_EQ((lab * at::arange(r.n, at::kLong)).sum().item<int64_t>(), r.weighted_label_sum) << r.split;
    for (size_t i = 0; i < r.first_labels.size(); ++i) EXPECT_EQ(lab[int64_t(i)].item<int64_t>(), r.first_labels[i]);
    EXPECT_GE(lab.min().item<int64_t>(), 0);
    EXPECT_LT(lab.max().item<int64_t>(), 10);
    EXPECT_EQ(ds.class_names().size(), 10u);
  }
}

TEST(FashionMnist, CorruptFilesAreErrorsNamingTheFile) {
  TempDir dir("idx");
  const std::string d = dir.path.string();
  const auto images = dir.file("t10k-images-idx3-ubyte.gz"), labels = dir.file("t10k-labels-idx1-ubyte.gz");

  // Missing files.
  auto missing = error_of([&] { dew::data::load_fashion_mnist("test", d); });
  EXPECT_NE(missing.find(images), std::string::npos) << missing;
  EXPECT_NE(missing.find("no such file"), std::string::npos) << missing;

  // Bad magic (a labels file where images are expected).
  write_gz(images, idx_bytes(2049, {3}, 3));
  write_gz(labels, idx_bytes(2049, {3}, 3));
  auto magic = error_of([&] { dew::data::load_fashion_mnist("test", d); });
  EXPECT_NE(magic.find(images + ": bad magic number 2049, expected 2051"), std::string::npos) << magic;

  // Truncated data: the header declares 3 images, the file holds 2.5.
  write_gz(images, idx_bytes(2051, {3, 28, 28}, 784 * 5 / 2));
  auto truncated = error_of([&] { dew::data::load_fashion_mnist("test", d); });
  EXPECT_NE(truncated.find(images + ": truncated: the data needs 2352 bytes, the file holds only 1960"),
            std::string::npos)
      << truncated;

  // Trailing bytes after the declared items.
  write_gz(images, idx_bytes(2051, {3, 28, 28}, 784 * 3 + 5));
  auto trailing = error_of([&] { dew::data::load_fashion_mnist("test", d); });
  EXPECT_NE(trailing.find(images + ": trailing bytes"), std::string::npos) << trailing;

  // Wrong image size.
  write_gz(images, idx_bytes(2051, {3, 27, 28}, 27 * 28 * 3));
  auto dims = error_of([&] { dew::data::load_fashion_mnist("test", d); });
  EXPECT_NE(dims.find(images + ": images are 27x28, Fashion-MNIST's are 28x28"), std::string::npos) << dims;

  // Count mismatch between the two files.
  write_gz(images, idx_bytes(2051, {3, 28, 28}, 784 * 3));
  write_gz(labels, idx_bytes(2049, {4}, 4));
  auto count = error_of([&] { dew::data::load_fashion_mnist("test", d); });
  EXPECT_NE(count.find(labels + ": holds 4 labels but " + images + " holds 3 images"), std::string::npos) << count;

  // Label out of range.
  std::string lab = idx_bytes(2049, {3}, 0) + std::string("\x01\x0a\x02", 3);
  write_gz(labels, lab);
  auto range = error_of([&] { dew::data::load_fashion_mnist("test", d); });
  EXPECT_NE(range.find(labels + ": label 10 is out of range"), std::string::npos) << range;

  // A gzip stream cut short: the first 2000 bytes of the real labels file.
  std::ifstream in(std::string(dew::data::kFashionMnistDir) + "/t10k-labels-idx1-ubyte.gz", std::ios::binary);
  std::string real((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ASSERT_GT(real.size(), 2000u);
  std::ofstream(labels, std::ios::binary) << real.substr(0, 2000);
  auto cut = error_of([&] { dew::data::load_fashion_mnist("test", d); });
  EXPECT_NE(cut.find(labels), std::string::npos) << cut;
  EXPECT_NE(cut.find("truncated"), std::string::npos) << cut;

  // The valid pieces load.
  write_gz(labels, idx_bytes(2049, {3}, 0) + std::string("\x01\x09\x02", 3));
  auto ok = dew::data::load_fashion_mnist("test", d);
  EXPECT_EQ(ok.size(), 3);
  EXPECT_EQ(ok.field("label")[1].item<int64_t>(), 9);

  auto split = error_of([&] { dew::data::load_fashion_mnist("valid", d); });
  EXPECT_NE(split.find("fashion_mnist.split: got \"valid\", accepted: train, test"), std::string::npos) << split;
}

// ---- other sources and the registry ----

TEST(Datasets, RegistryBuildsEverySource) {
  auto& reg = dew::data::datasets();
  EXPECT_EQ(reg.names(),
            (std::vector<std::string>{"fashion_mnist", "gaussian_blobs", "image_folder", "moving_fashion_mnist"}));
  auto blobs = reg.build(dew::json{{"name", "gaussian_blobs"}, {"count", 20}, {"size", 12}, {"channels", 3}});
  EXPECT_EQ(blobs->field("image").sizes(), (std::vector<int64_t>{20, 3, 12, 12}));
  EXPECT_EQ(blobs->spec()["name"], "gaussian_blobs");
  EXPECT_EQ(blobs->spec()["count"], 20);
  auto again = reg.build(dew::json{{"name", "gaussian_blobs"}, {"count", 20}, {"size", 12}, {"channels", 3}});
  EXPECT_TRUE(at::equal(blobs->field("image"), again->field("image")));  // a pure function of its options
  const auto& lab = blobs->field("label");
  EXPECT_GE(lab.min().item<int64_t>(), 0);
  EXPECT_LT(lab.max().item<int64_t>(), 4);
  EXPECT_GT(blobs->field("image").max().item<int64_t>(), 200);  // every blob peaks near 255

  auto test = reg.build(dew::json{{"name", "fashion_mnist"}, {"split", "test"}});
  EXPECT_EQ(test->size(), 10000);
  auto unknown = error_of([&] { reg.build(dew::json{{"name", "fashion_mnist"}, {"splt", "test"}}); });
  EXPECT_NE(unknown.find("unknown field \"splt\"; valid fields: classes, dir, pad, split"), std::string::npos)
      << unknown;
  auto choice = error_of([&] { reg.build(dew::json{{"name", "fashion_mnist"}, {"split", "val"}}); });
  EXPECT_NE(choice.find("accepted: train, test"), std::string::npos) << choice;
  auto folder = error_of([&] { reg.build(dew::json{{"name", "image_folder"}}); });
  EXPECT_NE(folder.find("image_folder.dir: required"), std::string::npos) << folder;
}

TEST(Datasets, FashionMnistClassesKeepsThoseLabelsInOrder) {
  // Fashion-MNIST's test split holds 1000 items of each class; its first labels are 9, 2, 1, 1, 6.
  auto& reg = dew::data::datasets();
  auto all = reg.build(dew::json{{"name", "fashion_mnist"}, {"split", "test"}});
  auto two = reg.build(dew::json{{"name", "fashion_mnist"}, {"split", "test"}, {"classes", {9, 2}}, {"pad", 2}});
  ASSERT_EQ(two->size(), 2000);
  const auto& lab = two->field("label");
  EXPECT_EQ(lab.eq(9).sum().item<int64_t>(), 1000);
  EXPECT_EQ(lab.eq(2).sum().item<int64_t>(), 1000);
  EXPECT_EQ(lab[0].item<int64_t>(), 9);
  EXPECT_EQ(lab[1].item<int64_t>(), 2);
  EXPECT_EQ(two->field("image").sizes(), (std::vector<int64_t>{2000, 1, 32, 32}));
  // Item 1 of the subset is item 1 of the split (its first 2), padded by 2 pixels on every side.
  EXPECT_TRUE(at::equal(two->field("image")[1].narrow(1, 2, 28).narrow(2, 2, 28), all->field("image")[1]));
  EXPECT_EQ(two->class_names(), all->class_names());  // 10 names: the label ids keep their meaning
  EXPECT_EQ(two->spec()["classes"], dew::json({9, 2}));
  for (const auto& [classes, needle] : std::vector<std::pair<dew::json, std::string>>{
           {{10}, "fashion_mnist.classes: label 10 is not a class; accepted: 0 .. 9"},
           {{-1}, "fashion_mnist.classes: label -1 is not a class"},
           {{3, 3}, "fashion_mnist.classes: label 3 is listed twice"}}) {
    auto e = error_of([&] {
      reg.build(dew::json{{"name", "fashion_mnist"}, {"split", "test"}, {"classes", classes}});
    });
    EXPECT_NE(e.find(needle), std::string::npos) << e;
  }
}

TEST(Datasets, ImageFolderUsesSortedSubfoldersAsClasses) {
  TempDir dir("folder");
  fs::create_directories(dir.path / "b_cat" / "nested");
  fs::create_directories(dir.path / "a_dog");
  fs::create_directories(dir.path / ".hidden");
  auto img = [](int64_t h, int64_t w, int v) { return at::full({3, h, w}, v, at::TensorOptions().dtype(at::kByte)); };
  dew::io::save_png((dir.path / "b_cat" / "1.png").string(), img(20, 30, 10));
  dew::io::save_png((dir.path / "b_cat" / "nested" / "2.PNG").string(), img(8, 8, 20));
  dew::io::save_png((dir.path / "a_dog" / "x.png").string(), img(16, 12, 30));
  dew::io::save_png((dir.path / ".hidden" / "y.png").string(), img(16, 12, 40));
  std::ofstream((dir.path / "a_dog" / "notes.txt").string()) << "not an image";

  auto ds = dew::data::load_image_folder(dir.path.string(), 10, 1);
  ASSERT_EQ(ds.size(), 3);
  EXPECT_EQ(ds.class_names(), (std::vector<std::string>{"a_dog", "b_cat"}));
  EXPECT_EQ(ds.field("image").sizes(), (std::vector<int64_t>{3, 1, 10, 10}));
  EXPECT_TRUE(at::equal(ds.field("label"), at::tensor({0, 1, 1}, at::kLong)));
  // Constant images stay constant through crop and resize; grey = the RGB value here.
  EXPECT_EQ(ds.field("image")[0].min().item<int64_t>(), 30);
  EXPECT_EQ(ds.field("image")[2].max().item<int64_t>(), 20);

  std::ofstream((dir.path / "a_dog" / "broken.jpg").string()) << "garbage";
  auto broken = error_of([&] { dew::data::load_image_folder(dir.path.string(), 10, 3); });
  EXPECT_NE(broken.find("broken.jpg"), std::string::npos) << broken;

  TempDir empty("folder_empty");
  auto none = error_of([&] { dew::data::load_image_folder(empty.path.string(), 10, 3); });
  EXPECT_NE(none.find("no .png/.jpg/.jpeg files"), std::string::npos) << none;
  auto bad = error_of([&] { dew::data::load_image_folder(dir.file("nope"), 10, 3); });
  EXPECT_NE(bad.find("is not a directory"), std::string::npos) << bad;
}

TEST(Datasets, TensorDatasetValidatesFields) {
  auto mismatch = error_of([] {
    TensorDataset({{"image", at::zeros({4, 1, 2, 2}, at::kByte)}, {"label", at::zeros({5}, at::kLong)}}, "mine");
  });
  EXPECT_NE(mismatch.find("mine: field \"label\" has 5 items, but \"image\" has 4"), std::string::npos) << mismatch;
  TensorDataset ds({{"x", at::arange(6).view({3, 2})}});
  auto unknown = error_of([&] { ds.field("y"); });
  EXPECT_NE(unknown.find("no field \"y\"; fields: x"), std::string::npos) << unknown;
  auto b = ds.gather(at::tensor({2, 0}, at::kLong));
  EXPECT_TRUE(at::equal(b["x"], at::tensor({4, 5, 0, 1}, at::kLong).view({2, 2})));
}

TEST(Datasets, ToModelRangeMapsBytesToMinusOneOne) {
  auto x = dew::data::to_model_range(at::tensor({0, 255, 128}, at::kByte));
  EXPECT_EQ(x.scalar_type(), at::kFloat);
  EXPECT_FLOAT_EQ(x[0].item<float>(), -1.0f);
  EXPECT_FLOAT_EQ(x[1].item<float>(), 1.0f);
  EXPECT_NEAR(x[2].item<float>(), 0.5f / 127.5f, 1e-6);
  auto bad = error_of([] { dew::data::to_model_range(at::zeros({2})); });
  EXPECT_NE(bad.find("expected uint8 data"), std::string::npos) << bad;
}

// ---- the loader ----

TEST(DataLoader, SameSeedAndEpochGiveSameBatchesAtAnyWorkerCount) {
  auto ds = id_dataset(50);
  LoaderOptions o;
  o.batch_size = 8;
  o.seed = 3;
  o.hflip = true;
  o.crop_padding = 2;
  std::vector<std::vector<Batch>> runs;
  for (int64_t workers : {0, 1, 2}) {
    o.num_workers = workers;
    o.prefetch = 3;
    DataLoader loader(ds, o);
    runs.push_back(take(loader, 20));  // almost three epochs of 7 batches
  }
  expect_same_batches(runs[0], runs[1], "0 vs 1 workers");
  expect_same_batches(runs[0], runs[2], "0 vs 2 workers");

  // Another seed gives another order.
  o.seed = 4;
  DataLoader other(ds, o);
  EXPECT_FALSE(at::equal(other.next()["id"], runs[0][0]["id"]));
}

TEST(DataLoader, EveryItemOncePerEpochAndEpochsDiffer) {
  auto ds = id_dataset(50);
  LoaderOptions o;
  o.batch_size = 8;
  o.drop_last = false;
  o.num_workers = 2;
  DataLoader loader(ds, o);
  EXPECT_EQ(loader.batches_per_epoch(), 7);
  std::vector<at::Tensor> orders;
  for (int64_t e = 0; e < 3; ++e) {
    EXPECT_EQ(loader.epoch(), e);
    std::vector<at::Tensor> ids;
    for (int64_t b = 0; b < 7; ++b) {
      auto batch = loader.next();
      EXPECT_EQ(batch["id"].size(0), b < 6 ? 8 : 2);  // the last batch holds the remaining 50 - 48
      EXPECT_EQ(batch["image"].size(0), batch["id"].size(0));
      ids.push_back(batch["id"]);
    }
    auto all = at::cat(ids);
    EXPECT_TRUE(at::equal(std::get<0>(all.sort()), at::arange(50, at::kLong))) << "epoch " << e;
    orders.push_back(all);
  }
  EXPECT_FALSE(at::equal(orders[0], orders[1]));
  EXPECT_FALSE(at::equal(orders[1], orders[2]));
  EXPECT_FALSE(at::equal(orders[0], at::arange(50, at::kLong)));  // shuffled

  // drop_last: 6 full batches per epoch, then epoch 1 starts.
  o.drop_last = true;
  DataLoader dropping(ds, o);
  EXPECT_EQ(dropping.batches_per_epoch(), 6);
  auto batches = take(dropping, 7);
  for (const auto& b : batches) EXPECT_EQ(b.at("id").size(0), 8);
  EXPECT_TRUE(at::equal(batches[0]["id"], orders[0].narrow(0, 0, 8)));  // same order as without drop_last
  EXPECT_TRUE(at::equal(batches[6]["id"], orders[1].narrow(0, 0, 8)));
  EXPECT_EQ(dropping.epoch(), 1);

  // Without shuffling the order is the identity.
  o.shuffle = false;
  DataLoader ordered(ds, o);
  EXPECT_TRUE(at::equal(ordered.next()["id"], at::arange(8, at::kLong)));
}

TEST(DataLoader, ResumeContinuesExactly) {
  auto ds = id_dataset(30);
  LoaderOptions o;
  o.batch_size = 7;
  o.num_workers = 2;
  o.hflip = true;
  o.crop_padding = 1;
  o.seed = 11;
  for (int64_t k : {0, 3, 4, 9}) {  // 5 batches per epoch: resume mid-epoch, at an epoch's end, in epoch 1
    DataLoader a(ds, o);
    take(a, k);
    const auto saved = dew::json::parse(a.state().dump());  // through text, as in state.json
    auto rest = take(a, 8);
    o.num_workers = k % 2;  // the resumed loader may use another thread count
    DataLoader b(ds, o);
    b.next();  // the position it had is overwritten by load_state
    b.load_state(saved);
    expect_same_batches(rest, take(b, 8), "resume after " + std::to_string(k));
    o.num_workers = 2;
  }
  DataLoader a(ds, o);
  take(a, 4);
  EXPECT_EQ(a.state(), (dew::json{{"epoch", 0}, {"index", 28}, {"dataset_size", 30}}));
  a.next();
  EXPECT_EQ(a.state(), (dew::json{{"epoch", 1}, {"index", 0}, {"dataset_size", 30}}));

  auto other = error_of([&] { a.load_state(dew::json{{"epoch", 0}, {"index", 0}, {"dataset_size", 31}}); });
  EXPECT_NE(other.find("saved for a dataset of 31 items"), std::string::npos) << other;
  auto index = error_of([&] { a.load_state(dew::json{{"epoch", 0}, {"index", 99}}); });
  EXPECT_NE(index.find("index must be in [0, 30]"), std::string::npos) << index;
  auto shape = error_of([&] { a.load_state(dew::json{{"epoch", "one"}, {"index", 0}}); });
  EXPECT_NE(shape.find("field \"epoch\" must be an integer"), std::string::npos) << shape;
}

TEST(DataLoader, AugmentationsFlipAndShiftItems) {
  auto ds = id_dataset(40);
  LoaderOptions o;
  o.batch_size = 40;
  o.num_workers = 0;
  o.shuffle = false;
  auto plain = DataLoader(ds, o).next()["image"];
  EXPECT_TRUE(at::equal(plain, ds->field("image")));  // no augmentation: the items as stored

  o.hflip = true;
  auto flipped = DataLoader(ds, o).next()["image"];
  int64_t n_flipped = 0;
  for (int64_t i = 0; i < 40; ++i) {
    const bool same = at::equal(flipped[i], plain[i]);
    const bool mirrored = at::equal(flipped[i], plain[i].flip({-1}));
    EXPECT_TRUE(same || mirrored) << i;
    n_flipped += (mirrored && !same);
  }
  EXPECT_GT(n_flipped, 5);  // p = 0.5 over 40 items (the blobs are not symmetric)
  EXPECT_LT(n_flipped, 35);

  o.hflip = false;
  o.crop_padding = 2;
  auto cropped = DataLoader(ds, o).next()["image"];
  EXPECT_EQ(cropped.sizes(), plain.sizes());
  int64_t n_moved = 0;
  for (int64_t i = 0; i < 40; ++i) {
    // Each item is the zero-padded original at some offset in [0, 4]^2.
    auto padded = at::constant_pad_nd(plain[i], {2, 2, 2, 2}, 0);
    bool found = false;
    for (int64_t dy = 0; dy <= 4 && !found; ++dy)
      for (int64_t dx = 0; dx <= 4 && !found; ++dx)
        found = at::equal(cropped[i], padded.narrow(1, dy, 8).narrow(2, dx, 8));
    EXPECT_TRUE(found) << i;
    n_moved += !at::equal(cropped[i], plain[i]);
  }
  EXPECT_GT(n_moved, 20);
}

// torchvision's RandomResizedCrop.get_params on scripted draws: hand-worked boxes, Python's round-half-even,
// and both fallbacks once 10 tries miss.
TEST(DataLoader, ResizedCropBoxFollowsTorchvision) {
  using dew::data::CropBox;
  auto box_of = [](int64_t h, int64_t w, std::pair<double, double> scale, std::pair<double, double> ratio,
                   std::vector<uint32_t> draws, size_t* used = nullptr) {
    size_t k = 0;
    auto b = dew::data::random_resized_crop_box(h, w, scale, ratio, [&] { return draws.at(k++); });
    if (used) *used = k;
    return b;
  };
  auto expect_box = [](const CropBox& b, CropBox want, const char* what) {
    EXPECT_EQ(std::vector<int64_t>({b.top, b.left, b.height, b.width}),
              std::vector<int64_t>({want.top, want.left, want.height, want.width}))
        << what;
  };
  // Area 0.25 * 400 = 100 at aspect 1: a 10 x 10 box; its corner is draw % 11.
  size_t used = 0;
  expect_box(box_of(20, 20, {0.25, 0.25}, {1, 1}, {123, 456, 7, 25}, &used), {7, 3, 10, 10}, "10 x 10");
  EXPECT_EQ(used, 4u);
  // sqrt(0.0625 * 100) = 2.5 rounds to 2, as round(2.5) does in Python.
  expect_box(box_of(10, 10, {0.0625, 0.0625}, {1, 1}, {0, 0, 0, 0}), {0, 0, 2, 2}, "half to even");
  // A wide image whose boxes are all too tall: 10 misses (20 draws), then the centred crop at the largest
  // ratio, 10 x round(10 * 1.0).
  expect_box(box_of(10, 40, {0.9, 1.0}, {0.5, 1.0}, std::vector<uint32_t>(20, 99), &used), {0, 15, 10, 10}, "wide");
  EXPECT_EQ(used, 20u);
  // A tall image whose boxes are all too wide: the full width, height round(10 / 2).
  expect_box(box_of(40, 10, {0.9, 1.0}, {2.0, 3.0}, std::vector<uint32_t>(20, 5)), {17, 0, 5, 10}, "tall");
  // Random draws: every box lies in the image, its rounded sides bracket the area and aspect ranges, and the
  // corners reach both edges.
  std::mt19937 mt(7);
  int64_t top_zero = 0, top_last = 0;
  for (int i = 0; i < 4000; ++i) {
    auto b = dew::data::random_resized_crop_box(28, 28, {0.3, 1.0}, {0.75, 4.0 / 3}, [&] { return uint32_t(mt()); });
    ASSERT_TRUE(b.height >= 1 && b.width >= 1 && b.top >= 0 && b.left >= 0 && b.top + b.height <= 28 &&
                b.left + b.width <= 28)
        << i;
    const double h = double(b.height), w = double(b.width);
    EXPECT_GE((h + 0.5) * (w + 0.5), 0.3 * 784) << i;
    EXPECT_GE((w + 0.5) / (h - 0.5), 0.75) << i;
    EXPECT_LE((w - 0.5) / (h + 0.5), 4.0 / 3) << i;
    top_zero += b.top == 0;
    top_last += b.top == 28 - b.height;
  }
  EXPECT_GT(top_zero, 100);
  EXPECT_GT(top_last, 100);
}

// The loader resizes each item's box back to H x W bilinearly (align_corners false, as torchvision). On a
// linear ramp that has a closed form: the ramp at the box coordinate each output pixel samples, clamped to
// the box. Every frame of a clip gets the same box.
TEST(DataLoader, ResizedCropResizesTheBoxBilinearly) {
  const int64_t n = 24, frames = 2, side = 28;
  auto ramp = [](double y, double x, int64_t t) { return 3.0 * y + 5.0 * x + 10.0 + 20.0 * double(t); };
  auto clip = at::empty({n, 1, frames, side, side}, at::kByte);
  auto a = clip.accessor<uint8_t, 5>();
  for (int64_t i = 0; i < n; ++i)
    for (int64_t t = 0; t < frames; ++t)
      for (int64_t y = 0; y < side; ++y)
        for (int64_t x = 0; x < side; ++x) a[i][0][t][y][x] = uint8_t(ramp(double(y), double(x), t));
  auto ds =
      std::make_shared<TensorDataset>(dew::data::Batch{{"image", clip}, {"id", at::arange(n, at::kLong)}}, "ramps");
  LoaderOptions o;
  o.batch_size = n;
  o.shuffle = false;
  o.num_workers = 0;
  o.seed = 5;
  o.crop_scale = {0.3, 1.0};
  auto out = DataLoader(ds, o).next()["image"];
  ASSERT_EQ(out.sizes(), clip.sizes());
  auto got = out.accessor<uint8_t, 5>();
  int64_t resized = 0;
  for (int64_t i = 0; i < n; ++i) {
    // The item's stream: three draws (flip, dy, dx), then the box's.
    auto gen = dew::rng::generator(5, uint64_t(i), "data/augment");
    auto* g = gen.get<at::CPUGeneratorImpl>();
    for (int k = 0; k < 3; ++k) g->random();
    auto b = dew::data::random_resized_crop_box(side, side, o.crop_scale, o.crop_ratio, [g] { return g->random(); });
    resized += b.height != side || b.width != side;
    double worst = 0;
    for (int64_t t = 0; t < frames; ++t)
      for (int64_t y = 0; y < side; ++y)
        for (int64_t x = 0; x < side; ++x) {
          const double sy = std::clamp((y + 0.5) * double(b.height) / side - 0.5, 0.0, double(b.height - 1));
          const double sx = std::clamp((x + 0.5) * double(b.width) / side - 0.5, 0.0, double(b.width - 1));
          const double want = ramp(double(b.top) + sy, double(b.left) + sx, t);
          worst = std::max(worst, std::abs(double(got[i][0][t][y][x]) - want));
        }
    EXPECT_LE(worst, 0.5 + 1e-3) << "item " << i << " box " << b.top << "," << b.left << " " << b.height << "x"
                                 << b.width;
  }
  EXPECT_GT(resized, n / 2);

  // [1, 1] is off: the items as stored.
  o.crop_scale = {1.0, 1.0};
  EXPECT_TRUE(at::equal(DataLoader(ds, o).next()["image"], clip));
}

// torchvision's own RandomResizedCrop (tests/golden/crop_reference.py) on the same scripted draws: the same
// box after the same number of draws, and the same resized image, uint8 exactly and float to rounding (a
// float64 image stays float64).
TEST(DataLoader, ResizedCropMatchesTorchvision) {
  const auto file =
      dew::io::SafetensorsFile::open(std::string(DEW_SOURCE_DIR) + "/tests/golden/crop/torchvision_crop.safetensors");
  const auto cases = nlohmann::json::parse(file.metadata().at("cases"));
  ASSERT_EQ(cases.size(), 7u);
  for (const auto& c : cases) {
    const std::string name = c["name"];
    SCOPED_TRACE(name);
    const auto draws = file.tensor(name + ".draws");
    const auto image = file.tensor(name + ".image"), want = file.tensor(name + ".out");
    const int64_t h = image.size(-2), w = image.size(-1);
    int64_t k = 0;
    const auto box =
        dew::data::random_resized_crop_box(h, w, {c["scale"][0], c["scale"][1]}, {c["ratio"][0], c["ratio"][1]},
                                           [&] { return uint32_t(draws[k++].item<int64_t>()); });
    EXPECT_EQ(k, file.tensor(name + ".used").item<int64_t>());
    const auto want_box = file.tensor(name + ".box");
    ASSERT_EQ(std::vector<int64_t>({box.top, box.left, box.height, box.width}),
              std::vector<int64_t>(want_box.data_ptr<int64_t>(), want_box.data_ptr<int64_t>() + 4));
    const auto got = dew::data::resized_crop(image, box);
    ASSERT_EQ(got.scalar_type(), want.scalar_type());
    ASSERT_EQ(got.sizes(), want.sizes());
    const double diff = (got.to(at::kDouble) - want.to(at::kDouble)).abs().max().item<double>();
    std::printf("  %-16s box %2ld,%2ld %2ldx%2ld  max |diff| %.3e\n", name.c_str(), long(box.top), long(box.left),
                long(box.height), long(box.width), diff);
    const double tol = want.scalar_type() == at::kByte ? 0.0 : want.scalar_type() == at::kDouble ? 1e-12 : 1e-5;
    EXPECT_LE(diff, tol);
  }
}

TEST(DataLoader, WorkerErrorsAreRethrownInOrder) {
  auto ds = id_dataset(40);
  LoaderOptions o;
  o.batch_size = 4;
  o.shuffle = false;
  for (int64_t workers : {0, 2}) {
    o.num_workers = workers;
    DataLoader loader(ds, o, [](Batch& b) {
      if (b["id"][0].item<int64_t>() == 12) dew::fail("bad item 12");
      b["image"] = dew::data::to_model_range(b["image"]);
    });
    for (int64_t k = 0; k < 3; ++k) {
      auto b = loader.next();
      EXPECT_EQ(b["image"].scalar_type(), at::kFloat);  // the transform ran on the worker
      EXPECT_EQ(b["id"][0].item<int64_t>(), 4 * k);
    }
    auto first = error_of([&] { loader.next(); });
    EXPECT_EQ(first, "bad item 12") << workers << " workers";
    EXPECT_EQ(error_of([&] { loader.next(); }), "bad item 12");  // sticky until load_state
    EXPECT_EQ(loader.state()["index"], 12);
    loader.load_state(dew::json{{"epoch", 0}, {"index", 16}});
    EXPECT_EQ(loader.next()["id"][0].item<int64_t>(), 16);
  }
}

TEST(DataLoader, DestructorStopsBusyWorkers) {
  auto ds = id_dataset(64);
  LoaderOptions o;
  o.batch_size = 2;
  o.num_workers = 2;
  o.prefetch = 2;
  auto done = std::async(std::launch::async, [&] {
    for (int i = 0; i < 5; ++i) {
      DataLoader loader(ds, o);
      loader.next();  // the workers are now blocked on a full queue
    }
    DataLoader never_started(ds, o);
  });
  // A destructor that fails to wake its workers hangs: fail within seconds, not at CTest's timeout.
  if (done.wait_for(std::chrono::seconds(30)) != std::future_status::ready) {
    std::fprintf(stderr, "DataLoader.DestructorStopsBusyWorkers: destroying loaders hung for 30 s\n");
    std::fflush(stderr);
    std::_Exit(1);  // the hung workers cannot be joined: end the test binary so the failure shows now
  }
  done.get();
}

TEST(DataLoader, OptionsAreValidated) {
  auto ds = id_dataset(10);
  auto make = [&](std::function<void(LoaderOptions&)> edit) {
    return error_of([&] {
      LoaderOptions o;
      edit(o);
      DataLoader loader(ds, o);
    });
  };
  auto m1 = make([](LoaderOptions& o) { o.batch_size = 0; });
  EXPECT_NE(m1.find("loader.batch_size: must be >= 1, got 0"), std::string::npos) << m1;
  auto m2 = make([](LoaderOptions& o) {
    o.batch_size = 11;
    o.drop_last = true;
  });
  EXPECT_NE(m2.find("11 is larger than dataset \"ids\" (10 items) with drop_last = true"), std::string::npos) << m2;
  auto m3 = make([](LoaderOptions& o) {
    o.hflip = true;
    o.image_field = "img";
  });
  EXPECT_NE(m3.find("has no field \"img\"; fields: id, image, label"), std::string::npos) << m3;
  auto m4 = make([](LoaderOptions& o) {
    o.crop_padding = 1;
    o.image_field = "label";
  });
  EXPECT_NE(m4.find("must be [N, ..., H, W]"), std::string::npos) << m4;
  auto m5 = make([](LoaderOptions& o) { o.crop_scale = {0.5, 1.2}; });
  EXPECT_NE(m5.find("loader.crop_scale: must be [min, max] with 0 < min <= max <= 1, got [0.5, 1.2]"),
            std::string::npos)
      << m5;
  auto m6 = make([](LoaderOptions& o) { o.crop_ratio = {1.5, 0.5}; });
  EXPECT_NE(m6.find("loader.crop_ratio: must be [min, max] with 0 < min <= max, got [1.5, 0.5]"), std::string::npos)
      << m6;
  auto parsed = dew::from_json<LoaderOptions>(dew::json{{"batch_size", 5}, {"hflip", true}}, "loader");
  EXPECT_EQ(parsed.batch_size, 5);
  EXPECT_TRUE(parsed.hflip);
  auto unknown = error_of([] { dew::from_json<LoaderOptions>(dew::json{{"batchsize", 5}}, "loader"); });
  EXPECT_NE(unknown.find("unknown field \"batchsize\""), std::string::npos) << unknown;
}

// ---- Moving Fashion-MNIST ----

namespace {

// A source of one 4 x 4 white square, so each frame's item position can be read back exactly.
dew::data::TensorDataset square_source() {
  auto img = at::full({1, 1, 4, 4}, 255, at::TensorOptions().dtype(at::kByte));
  dew::data::TensorDataset ds(
      {{"image", img}, {"label", at::tensor({int64_t(3)}, at::TensorOptions().dtype(at::kLong))}}, "square");
  ds.set_class_names({"a", "b", "c", "d"});
  return ds;
}

}  // namespace

TEST(MovingFashionMnist, ItemsStayWholeInsideTheFrameAndBounce) {
  dew::data::MovingFashionMnistOptions o;
  o.count = 6;
  o.frames = 20;
  o.size = 12;
  o.item_size = 4;
  o.min_speed = o.max_speed = 2.0;
  auto ds = dew::data::moving_fashion_mnist(o, square_source());
  auto v = ds.field("image");
  ASSERT_EQ(v.sizes(), (std::vector<int64_t>{6, 1, 20, 12, 12}));
  EXPECT_TRUE(ds.field("label").eq(3).all().item<bool>());
  for (int64_t n = 0; n < 6; ++n) {
    int64_t py = -1, px = -1;
    bool touched_edge = false;
    int64_t moves = 0;
    for (int64_t t = 0; t < 20; ++t) {
      auto f = v[n][0][t];
      ASSERT_EQ(f.gt(0).sum().item<int64_t>(), 16) << "video " << n << " frame " << t << ": the item is cut or smeared";
      auto nz = f.nonzero();
      const int64_t y = nz.select(1, 0).min().item<int64_t>(), x = nz.select(1, 1).min().item<int64_t>();
      ASSERT_TRUE(f.slice(0, y, y + 4).slice(1, x, x + 4).eq(255).all().item<bool>());
      touched_edge |= y == 0 || x == 0 || y == 8 || x == 8;
      if (t > 0) {
        // speed 2 per frame; rounding moves each coordinate by at most one more pixel
        EXPECT_LE(std::abs(y - py), 3);
        EXPECT_LE(std::abs(x - px), 3);
        moves += std::abs(y - py) + std::abs(x - px) > 0;
      }
      py = y;
      px = x;
    }
    // 40 pixels of travel in a span of 8: some coordinate must reach an edge and turn back. The item moves
    // every frame except where a reflection rounds back onto the previous pixel.
    EXPECT_TRUE(touched_edge) << "video " << n;
    EXPECT_GE(moves, 15) << "video " << n;
  }
}

TEST(MovingFashionMnist, IsAPureFunctionOfItsOptions) {
  dew::data::MovingFashionMnistOptions o;
  o.count = 4;
  o.frames = 5;
  o.size = 16;
  o.item_size = 8;
  o.items = 2;
  auto a = dew::data::moving_fashion_mnist(o, square_source()).field("image");
  auto b = dew::data::moving_fashion_mnist(o, square_source()).field("image");
  EXPECT_TRUE(a.equal(b));
  o.seed = 1;
  EXPECT_FALSE(a.equal(dew::data::moving_fashion_mnist(o, square_source()).field("image")));
  o.size = 100;
  EXPECT_NE(dew::test::error_of([&] {
              dew::data::moving_fashion_mnist(o, square_source());
            }).find("moving_fashion_mnist.size"),
            std::string::npos);
}

TEST(MovingFashionMnist, RegisteredOnFashionMnistItems) {
  auto ds = dew::data::datasets().build(
      {{"name", "moving_fashion_mnist"}, {"count", 16}, {"frames", 4}, {"size", 32}, {"split", "test"}});
  EXPECT_EQ(ds->field("image").sizes(), (std::vector<int64_t>{16, 1, 4, 32, 32}));
  EXPECT_EQ(ds->class_names().size(), 10u);
  // every frame holds one whole item: the same mass in each frame of a video (no clipping at the edges)
  auto mass = ds->field("image").to(at::kLong).sum({3, 4}).squeeze(1);  // [16, 4]
  EXPECT_TRUE(mass.eq(mass.select(1, 0).unsqueeze(1)).all().item<bool>());
}

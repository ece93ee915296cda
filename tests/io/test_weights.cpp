// The one weight loader: sources (file, sharded index, folder, memory), key maps, checking before copying.
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>

#include <fstream>

#include "dew/core/options.h"
#include "dew/io/safetensors.h"
#include "dew/io/weights.h"
#include "tests/test_util.h"

using dew::json;
using dew::test::error_of;
namespace io = dew::io;

namespace {

// A module with the names a small attention block has: a q/k/v projection each and an output.
struct Block : torch::nn::Module {
  torch::nn::Linear q{nullptr}, k{nullptr}, v{nullptr}, out{nullptr};
  at::Tensor steps;
  Block() {
    q = register_module("q", torch::nn::Linear(4, 4));
    k = register_module("k", torch::nn::Linear(4, 4));
    v = register_module("v", torch::nn::Linear(4, 4));
    out = register_module("out", torch::nn::Linear(4, 2));
    steps = register_buffer("steps", at::zeros({1}, at::kLong));
  }
};

at::Tensor arange(std::vector<int64_t> shape, double offset) {
  int64_t n = 1;
  for (auto s : shape) n *= s;
  return (at::arange(n, at::kFloat) + offset).reshape(shape);
}

}  // namespace

TEST(Weights, KeyMapRenamesSplitsAndTransposes) {
  Block m;
  // A checkpoint in another layout: "attn." prefix, one fused qkv, the output stored transposed, fp16.
  std::map<std::string, at::Tensor> file = {{"attn.qkv.weight", arange({12, 4}, 0)},
                                            {"attn.qkv.bias", arange({12}, 100)},
                                            {"attn.out_t.weight", arange({4, 2}, 200).to(at::kHalf)},
                                            {"attn.out.bias", arange({2}, 300)},
                                            {"attn.steps", at::full({1}, 7, at::kLong)},
                                            {"attn.rotary.inv_freq", at::ones({2})}};
  io::KeyMap map;
  map.prefix("attn.", "")
      .skip(R"(.*inv_freq)")
      .regex(R"(out_t\.weight)", "out.weight")
      .split(R"(qkv\.(weight|bias))", {"q.$1", "k.$1", "v.$1"}, 0)
      .transpose(R"(out\.weight)");
  auto report = io::load_weights(m, io::WeightSource::of_tensors(file, "file"), map);
  EXPECT_EQ(report.loaded.size(), 9u);
  EXPECT_EQ(report.skipped, std::vector<std::string>({"attn.rotary.inv_freq"}));
  // Rows 0-3 of the fused weight are q, 4-7 k, 8-11 v (hand-derived from the arange layout).
  EXPECT_TRUE(m.q->weight.equal(arange({4, 4}, 0)));
  EXPECT_TRUE(m.k->weight.equal(arange({4, 4}, 16)));
  EXPECT_TRUE(m.v->weight.equal(arange({4, 4}, 32)));
  EXPECT_TRUE(m.v->bias.equal(arange({4}, 108)));
  EXPECT_TRUE(m.out->weight.equal(arange({4, 2}, 200).t()));  // fp16 integers widen exactly
  EXPECT_EQ(m.out->weight.scalar_type(), at::kFloat);
  EXPECT_EQ(m.steps.item<int64_t>(), 7);
}

TEST(Weights, EverythingIsCheckedBeforeTheFirstCopy) {
  Block m;
  const at::Tensor q_before = m.q->weight.detach().clone();
  std::map<std::string, at::Tensor> good;
  for (const auto& kv : m.named_parameters()) good[kv.key()] = kv.value().detach() + 1;
  good["steps"] = at::ones({1}, at::kLong);
  auto src = [](std::map<std::string, at::Tensor> t) { return io::WeightSource::of_tensors(std::move(t), "ckpt"); };

  auto bad_shape = good;
  bad_shape["v.weight"] = at::zeros({4, 3});  // sorted after q.*: a copy-as-you-go loader would have started
  std::string e = error_of([&] { io::load_weights(m, src(bad_shape)); });
  EXPECT_NE(e.find("ckpt: tensor \"v.weight\" has shape [4, 3], the model expects [4, 4]"), std::string::npos) << e;
  EXPECT_TRUE(m.q->weight.equal(q_before));

  auto missing = good;
  missing.erase("k.bias");
  auto extra = good;
  extra["z.weight"] = at::zeros({1});
  e = error_of([&] { io::load_weights(m, src(missing)); });
  EXPECT_NE(e.find("lacks 1 tensor(s) the model needs: \"k.bias\""), std::string::npos) << e;
  e = error_of([&] { io::load_weights(m, src(extra)); });
  EXPECT_NE(e.find("holds 1 tensor(s) the model does not have: \"z.weight\""), std::string::npos) << e;
  auto ints = good;
  ints["q.weight"] = at::zeros({4, 4}, at::kInt);
  e = error_of([&] { io::load_weights(m, src(ints)); });
  EXPECT_NE(e.find("dtype"), std::string::npos) << e;
  e = error_of([&] { io::load_weights(m, src(good), io::KeyMap().regex("k\\.(.*)", "q.$1")); });
  EXPECT_NE(e.find("both map to"), std::string::npos) << e;
  e = error_of([&] { io::load_weights(m, src(good), io::KeyMap().refuse("steps", "no counters here")); });
  EXPECT_NE(e.find("\"steps\" is not accepted here: no counters here"), std::string::npos) << e;
  EXPECT_TRUE(m.q->weight.equal(q_before));

  // Not strict: extra tensors are reported; allowed-missing names keep their values.
  io::LoadOptions lax;
  lax.strict = false;
  auto report = io::load_weights(m, src(extra), {}, lax);
  EXPECT_EQ(report.unexpected, std::vector<std::string>({"z.weight"}));
  auto no_k = good;
  no_k.erase("k.weight");
  no_k.erase("k.bias");
  const at::Tensor k_before = m.k->weight.detach().clone();
  report = io::load_weights(m, src(no_k), io::KeyMap().allow_missing(R"(k\..*)"));
  EXPECT_EQ(report.kept, std::vector<std::string>({"k.bias", "k.weight"}));
  EXPECT_TRUE(m.k->weight.equal(k_before));
  EXPECT_TRUE(m.q->weight.equal(good["q.weight"]));
}

TEST(Weights, ShardedIndexFoldersAndKeptDtypes) {
  dew::test::TempDir dir("weights_shards");
  Block m;
  std::map<std::string, at::Tensor> a, b;
  json weight_map = json::object();
  int i = 0;
  for (const auto& kv : m.named_parameters()) {
    auto t = (kv.value().detach() * 0 + double(i++)).to(at::kBFloat16);
    (i % 2 ? a : b)[kv.key()] = t;
    weight_map[kv.key()] = i % 2 ? "part-1.safetensors" : "part-2.safetensors";
  }
  a["steps"] = at::full({1}, 3, at::kLong);
  weight_map["steps"] = "part-1.safetensors";
  io::save_safetensors(dir.file("part-1.safetensors"), a);
  io::save_safetensors(dir.file("part-2.safetensors"), b);
  std::ofstream(dir.file("diffusion_pytorch_model.safetensors.index.json")) << json{{"weight_map", weight_map}}.dump();
  auto src = io::WeightSource::open(dir.path.string());  // the folder: finds the diffusers index
  EXPECT_EQ(src.dtype("q.weight"), at::kBFloat16);
  EXPECT_EQ(src.shape("out.weight"), std::vector<int64_t>({2, 4}));
  io::load_weights(m, src);
  EXPECT_TRUE(m.out->bias.equal(at::full({2}, 7.0)));  // the 8th parameter, bf16 7 widened exactly
  EXPECT_EQ(m.steps.item<int64_t>(), 3);
  io::LoadOptions keep;
  keep.keep_dtype = true;  // inference in the file's dtype
  io::load_weights(m, src, {}, keep);
  EXPECT_EQ(m.q->weight.scalar_type(), at::kBFloat16);
  EXPECT_EQ(m.steps.scalar_type(), at::kLong);

  // A weight_map naming a file outside the folder, or a shard that lacks its tensor, is refused by name.
  std::ofstream(dir.file("bad.safetensors.index.json"))
      << json{{"weight_map", {{"q.weight", "../x.safetensors"}}}}.dump();
  EXPECT_NE(
      error_of([&] { io::WeightSource::open(dir.file("bad.safetensors.index.json")); }).find("not a file beside it"),
      std::string::npos);
  std::ofstream(dir.file("bad2.safetensors.index.json"))
      << json{{"weight_map", {{"q.weight", "part-2.safetensors"}}}}.dump();
  EXPECT_NE(error_of([&] {
              io::WeightSource::open(dir.file("bad2.safetensors.index.json"));
            }).find("puts \"q.weight\" in \"part-2.safetensors\", which does not hold it"),
            std::string::npos);
  dew::test::TempDir empty("weights_empty");
  EXPECT_NE(
      error_of([&] { io::WeightSource::open(empty.path.string()); }).find("holds none of model.safetensors.index.json"),
      std::string::npos);
}

namespace weights_rss {

struct Big : torch::nn::Module {
  explicit Big(int n) {
    for (int i = 0; i < n; ++i) register_parameter("w" + std::to_string(i), at::zeros({1024, 1024}));
  }
};

}  // namespace weights_rss

// issue 39 item 5: loading a sharded folder through the memory map keeps about one model resident, not
// the model plus the mapped files: each tensor's file pages are let go once copied. 256 MiB in 4 shards.
TEST(Weights, LoadingAShardedFolderPeaksNearTheResidentWeights) {
  using namespace weights_rss;
  dew::test::TempDir dir("weights_rss");
  constexpr int kTensors = 64, kShards = 4;
  json weight_map = json::object();
  {
    std::vector<std::map<std::string, at::Tensor>> shards(kShards);
    for (int i = 0; i < kTensors; ++i) {
      const std::string name = "w" + std::to_string(i), file = "shard-" + std::to_string(i % kShards) + ".safetensors";
      shards[i % kShards][name] = at::full({1024, 1024}, float(i) + 0.5f);
      weight_map[name] = file;
    }
    for (int s = 0; s < kShards; ++s)
      io::save_safetensors(dir.file("shard-" + std::to_string(s) + ".safetensors"), shards[s]);
  }
  std::ofstream(dir.file("model.safetensors.index.json")) << json{{"weight_map", weight_map}}.dump();
  Big m(kTensors);  // resident: zeros are written
  const double weights = double(kTensors) * 1024 * 1024 * sizeof(float);
  if (!dew::test::reset_peak_rss()) GTEST_SKIP() << "/proc/self/clear_refs cannot reset the peak RSS on this kernel";
  const int64_t start = dew::test::status_bytes("VmRSS");
  io::load_weights(m, io::WeightSource::open(dir.path.string()));
  // Peak RSS during the load over the resident weights: 1 + what the load added at its worst.
  const double ratio = 1.0 + double(dew::test::status_bytes("VmHWM") - start) / weights;
  std::printf("peak RSS while loading %.0f MiB of weights from %d shards: %.3fx the weights\n", weights / (1 << 20),
              kShards, ratio);
  EXPECT_LE(ratio, 1.1);
  for (int i : {0, 37, 63})
    EXPECT_EQ(m.named_parameters()["w" + std::to_string(i)][5][7].item<float>(), float(i) + 0.5f) << i;
}

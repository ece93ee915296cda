// Reduced-precision weights built in their dtype (nn::build_weights_in): the layout nn::hold_weights_in gives a
// float32 model, for every family of the table, and a bf16 folder loaded without a float32 copy of the model.
#include <c10/core/DefaultDtype.h>
#include <gtest/gtest.h>
#include <malloc.h>
#include <torch/torch.h>

#include <cstdio>
#include <fstream>
#include <map>
#include <string>

#include "dew/interop/diffusers_forward.h"
#include "dew/io/safetensors.h"
#include "dew/nn/backbones/backbone.h"
#include "dew/nn/weights_dtype.h"
#include "tests/test_util.h"

namespace {

using dew::json;

// Every parameter and buffer of a module by name.
std::map<std::string, at::Tensor> tensors_of(const torch::nn::Module& m) {
  std::map<std::string, at::Tensor> out;
  for (const auto& kv : m.named_parameters()) out[kv.key()] = kv.value();
  for (const auto& kv : m.named_buffers()) out["buffer " + kv.key()] = kv.value();
  return out;
}

}  // namespace

// Built in bfloat16, every family's tiny configuration has what hold_weights_in makes of its float32 build: the
// same tensors, matrices in bf16, vectors and buffers in float32, and the buffers a constructor computes (RoPE
// tables, position ids, masks) equal bit for bit, none of them computed in bf16.
TEST(WeightsDtype, BuildingInBFloat16GivesHoldWeightsInsLayoutForEveryFamily) {
  int64_t families = 0, buffers = 0;
  for (const auto& name : dew::models::family_names()) {
    SCOPED_TRACE(name);
    const json& fields = dew::models::family(name).tiny.fields;
    torch::manual_seed(0);
    auto a = dew::models::build_module(name, fields);
    dew::nn::hold_weights_in(*a, at::kBFloat16);
    torch::manual_seed(0);
    auto b = dew::nn::build_weights_in(at::kBFloat16, [&] { return dew::models::build_module(name, fields); });
    ASSERT_EQ(c10::get_default_dtype_as_scalartype(), at::kFloat);  // restored
    const auto ta = tensors_of(*a), tb = tensors_of(*b);
    ASSERT_EQ(ta.size(), tb.size());
    int64_t bf16 = 0;
    for (const auto& [key, x] : ta) {
      ASSERT_TRUE(tb.count(key)) << key;
      const at::Tensor& y = tb.at(key);
      EXPECT_EQ(x.scalar_type(), y.scalar_type()) << key;
      EXPECT_EQ(x.sizes(), y.sizes()) << key;
      bf16 += y.scalar_type() == at::kBFloat16;
      if (key.rfind("buffer ", 0) == 0 && x.scalar_type() == y.scalar_type()) {
        EXPECT_TRUE(x.equal(y)) << key << " differs from the float32 build's";
        ++buffers;
      }
    }
    EXPECT_GT(bf16, 0) << "no matrix weight in bf16";
    ++families;
  }
  std::printf("%lld families, %lld buffers compared\n", (long long)families, (long long)buffers);
  EXPECT_GE(families, 20);
  // A build that fails leaves the default dtype as it was.
  EXPECT_THROW(dew::nn::build_weights_in(at::kBFloat16,
                                         []() -> std::shared_ptr<torch::nn::Module> { throw dew::Error("refused"); }),
               dew::Error);
  EXPECT_EQ(c10::get_default_dtype_as_scalartype(), at::kFloat);
  EXPECT_NE(dew::test::error_of([] {
              dew::nn::build_weights_in(at::kInt, [] { return std::make_shared<torch::nn::Module>(); });
            }).find("bfloat16"),
            std::string::npos);
}

// issue 39 item 5 for reduced precision: a FluxTransformer2DModel folder of about 200 MB of bf16 weights in two
// shards, built and loaded with weights_dtype bfloat16, adds at its peak at most 1.1x its resident weights (the
// matrices in bf16, vectors and buffers in float32) to the process; built in float32 and then converted (what
// --weights-dtype did before) it adds about twice that, printed for comparison.
TEST(WeightsDtype, LoadingABFloat16FolderPeaksNearItsBFloat16Weights) {
  dew::test::TempDir dir("weights_dtype_rss");
  const json config = {{"_class_name", "FluxTransformer2DModel"},
                       {"attention_head_dim", 128},
                       {"num_attention_heads", 8},
                       {"axes_dims_rope", {16, 56, 56}},
                       {"guidance_embeds", false},
                       {"in_channels", 64},
                       {"joint_attention_dim", 1024},
                       {"num_layers", 2},
                       {"num_single_layers", 2},
                       {"patch_size", 1},
                       {"pooled_projection_dim", 256}};
  std::ofstream(dir.file("config.json")) << config.dump(2);
  {
    // The folder: every tensor in bf16, the blocks in one shard and the rest in another, with diffusers' index.
    const auto spec = dew::interop::diffusers_model_spec(dir.path.string());
    auto m =
        dew::nn::build_weights_in(at::kBFloat16, [&] { return dew::models::build_module(spec.family, spec.fields); });
    std::map<std::string, at::Tensor> shard[2];
    json weight_map = json::object();
    for (const auto& kv : m->named_parameters()) {
      const int s = kv.key().find("blocks.") != std::string::npos ? 0 : 1;
      shard[s][kv.key()] = kv.value().detach().to(at::kBFloat16);
      weight_map[kv.key()] = "diffusion_pytorch_model-0000" + std::to_string(s + 1) + "-of-00002.safetensors";
    }
    for (int s = 0; s < 2; ++s)
      dew::io::save_safetensors(
          dir.file("diffusion_pytorch_model-0000" + std::to_string(s + 1) + "-of-00002.safetensors"), shard[s]);
    std::ofstream(dir.file("diffusion_pytorch_model.safetensors.index.json"))
        << json{{"weight_map", weight_map}}.dump();
  }
  auto resident = [](const torch::nn::Module& m) {
    double bytes = 0;
    for (const auto& [key, t] : tensors_of(m)) bytes += double(t.numel()) * double(t.element_size());
    return bytes;
  };
  if (!dew::test::reset_peak_rss()) GTEST_SKIP() << "/proc/self/clear_refs cannot reset the peak RSS on this kernel";
  // The resident set before a load, with the heap memory earlier steps freed handed back first (glibc keeps it,
  // and a load would reuse it unseen); the peak is counted from here, so it holds the model the load builds.
  auto fresh_start = [] {
    ::malloc_trim(0);
    dew::test::reset_peak_rss();
    return dew::test::status_bytes("VmRSS");
  };
  // Built in bf16 and loaded into it.
  double weights = 0, ratio = 0;
  {
    const int64_t start = fresh_start();
    dew::interop::DiffusersLoadOptions o;
    o.weights_dtype = at::kBFloat16;
    const auto loaded = dew::interop::load_diffusers_folder(dir.path.string(), o);
    weights = resident(*loaded.module);
    ratio = double(dew::test::status_bytes("VmHWM") - start) / weights;
    int64_t params = 0;
    for (const auto& p : loaded.module->parameters()) params += p.numel();
    std::printf("FluxTransformer2DModel, %lld parameters, %.0f MiB resident in bf16 (vectors and buffers float32)\n",
                (long long)params, weights / (1 << 20));
    // The values are the file's.
    EXPECT_TRUE(loaded.module->named_parameters()["proj_out.weight"].equal(
        dew::io::load_safetensors(dir.file("diffusion_pytorch_model-00002-of-00002.safetensors"))
            .at("proj_out.weight")));
  }
  // Built in float32, loaded, then converted.
  const int64_t start = fresh_start();
  {
    auto loaded = dew::interop::load_diffusers_folder(dir.path.string());
    dew::nn::hold_weights_in(*loaded.module, at::kBFloat16);
  }
  const double before = double(dew::test::status_bytes("VmHWM") - start) / weights;
  std::printf("peak RSS while loading: built in bf16 %.3fx the bf16 weights; built in float32 then converted %.3fx\n",
              ratio, before);
  EXPECT_LE(ratio, 1.1);
}

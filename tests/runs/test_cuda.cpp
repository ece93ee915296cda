// CUDA runs (skipped where LibTorch sees no CUDA device; scripts/gpu-check runs them on a GPU machine): a run
// trains on the GPU with bf16 autocast, its checkpoint opens on the CPU and the GPU, and both give the same
// denoiser output; a language model trains and generates on the GPU.
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <ATen/Context.h>

#include "dew/runs/diffusion_run.h"
#include "dew/runs/lm_run.h"
#include "dew/sampling/generate.h"
#include "tests/data/tiny_tokens.h"
#include "tests/test_util.h"

using dew::json;

namespace {

bool have_cuda() { return torch::cuda::is_available(); }

}  // namespace

TEST(Cuda, DiffusionRunTrainsOnTheGpuAndOpensOnEitherDevice) {
  if (!have_cuda()) GTEST_SKIP() << "no CUDA device";
  at::globalContext().setAllowTF32CuDNN(false);  // compare in full fp32
  at::globalContext().setAllowTF32CuBLAS(false);
  dew::test::TempDir tmp("cuda_diffusion");
  json recipe = dew::runs::default_recipe("diffusion");
  recipe["run"] = tmp.file("run");
  recipe["device"] = "cuda";
  recipe["data"] = {{"name", "gaussian_blobs"}, {"count", 64}, {"size", 16}, {"classes", 3}};
  recipe["model"] = {{"architecture", "unet"},
                     {"fields",
                      {{"emb_features", 32},
                       {"feature_depths", {16, 32}},
                       {"attention_configs", {nullptr, 2}},
                       {"num_res_blocks", 1},
                       {"num_middle_res_blocks", 1},
                       {"norm_groups", 4}}}};
  recipe["loader"]["batch_size"] = 8;
  recipe["trainer"]["steps"] = 6;
  recipe["trainer"]["checkpoint_every"] = 3;
  recipe["objective"]["steps"] = 3;
  auto run = dew::runs::prepare("diffusion", recipe);
  ASSERT_TRUE(run.device.is_cuda());
  auto res = dew::runs::train(run);
  EXPECT_EQ(res.step, 6);
  ASSERT_TRUE(std::isfinite(res.last_metrics.at("train/loss")));

  dew::runs::OpenOptions on_cpu, on_gpu;
  on_cpu.device = "cpu";
  on_gpu.device = "cuda";
  auto cpu = dew::runs::open_diffusion_run(tmp.file("run"), on_cpu);
  auto gpu = dew::runs::open_diffusion_run(tmp.file("run"), on_gpu);
  ASSERT_TRUE(gpu.model->parameters().front().is_cuda());
  auto gen = at::detail::createCPUGenerator(3);
  const at::Tensor x = at::randn({4, 1, 16, 16}, gen), t = at::rand({4}, gen);
  dew::Conditioning c;
  c.labels = at::tensor({0, 1, 2, 3}, at::kLong);  // 3 = the null class
  at::NoGradGuard ng;
  const at::Tensor a = cpu.model->forward(x, t, c);
  dew::Conditioning cg;
  cg.labels = c.labels.cuda();
  const at::Tensor b = gpu.model->forward(x.cuda(), t.cuda(), cg).cpu();
  const double scale = a.abs().max().item<double>();
  const double diff = (a - b).abs().max().item<double>();
  std::printf("cpu vs cuda forward: max |diff| %.3g (max |out| %.3g)\n", diff, scale);
  EXPECT_LT(diff, 1e-4 * std::max(1.0, scale));

  dew::DiffusionSampleOptions g;
  g.shape = gpu.shape;
  g.count = 6;
  g.labels = at::arange(3).repeat({2});
  g.steps = 4;
  g.solver = "euler";
  const at::Tensor images = dew::sample_diffusion(*gpu.model, *gpu.process, g);
  EXPECT_TRUE(at::isfinite(images).all().item<bool>());
}

TEST(Cuda, LanguageModelTrainsAndGeneratesOnTheGpu) {
  if (!have_cuda()) GTEST_SKIP() << "no CUDA device";
  dew::test::TempDir tmp("cuda_lm");
  dew::test::write_tiny_tokens(tmp.file("tokens"));
  json recipe = dew::runs::default_recipe("lm");
  recipe["run"] = tmp.file("run");
  recipe["device"] = "cuda";
  recipe["data"] = {{"name", "tokens"}, {"dir", tmp.file("tokens")}};
  recipe["model"]["fields"] = {{"emb_features", 32}, {"num_layers", 1}, {"num_heads", 2}, {"max_seq_len", 64}};
  recipe["objective"]["seq_len"] = 16;
  recipe["objective"]["sample_tokens"] = 4;
  recipe["loader"]["batch_size"] = 4;
  recipe["trainer"]["steps"] = 20;
  recipe["trainer"]["val_every"] = 0;
  recipe["trainer"]["time_limit_minutes"] = 0;
  auto run = dew::runs::prepare("lm", recipe);
  auto res = dew::runs::train(run);
  EXPECT_EQ(res.step, 20);
  dew::runs::OpenOptions o;
  o.device = "cuda";
  auto lm = dew::runs::open_lm_run(tmp.file("run"), o);
  dew::sampling::GenerationOptions go;
  go.max_new_tokens = 8;
  go.temperature = 0;
  auto out = dew::sampling::generate_tokens(*lm.model, {{116, 104, 101}}, go);
  EXPECT_EQ(out.lengths.at(0), 8);
}

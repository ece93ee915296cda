// Trainer: exact resume, torn checkpoints, accumulation, the non-finite guard.
#include <gtest/gtest.h>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/autocast_mode.h>
#include <torch/version.h>

#include <cmath>
#include <csignal>
#include <filesystem>
#include <fstream>

#include "dew/training/trainer.h"

using namespace dew;
using namespace dew::training;
namespace fs = std::filesystem;

namespace {

// A small regression y = W x + noise with a random draw in the loss, so the objective's generator matters.
struct Regression : torch::nn::Module {
  torch::nn::Linear lin{nullptr};
  Regression() { lin = register_module("lin", torch::nn::Linear(4, 3)); }
};

class RegressionObjective : public Objective {
 public:
  explicit RegressionObjective(int64_t nan_at = -1, bool noisy = true, int64_t interrupt_at = -1)
      : nan_at_(nan_at), noisy_(noisy), interrupt_at_(interrupt_at) {
    torch::manual_seed(0);
    m_ = std::make_shared<Regression>();
  }
  std::string name() const override { return "regression"; }
  torch::nn::Module& module() override { return *m_; }
  LossOutput loss(const data::Batch& b, int64_t step, at::Generator gen) override {
    auto x = b.at("x");
    auto y = b.at("y");
    if (noisy_) y = y + 0.01 * at::randn(y.sizes(), gen);
    auto out = m_->lin->forward(x);
    forward_dtype = out.scalar_type();
    auto l = (out.to(at::kFloat) - y).square().mean();
    if (step == nan_at_) l = l * std::numeric_limits<double>::quiet_NaN();
    if (step == interrupt_at_) std::raise(SIGINT);  // as a user's Ctrl-C during this step
    return {l, {{"abs", l.item<double>()}}};
  }
  training::EmaSpec ema() const override { return {0.9}; }
  std::vector<std::string> batch_fields() const override { return {"x", "y"}; }
  std::shared_ptr<Regression> m_;
  at::ScalarType forward_dtype = at::kDouble;  // of the last forward's linear output

 private:
  int64_t nan_at_;
  bool noisy_;
  int64_t interrupt_at_;
};

std::shared_ptr<data::TensorDataset> regression_data() {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
  auto x = at::randn({40, 4}, gen);
  auto w = at::randn({3, 4}, gen);
  return std::make_shared<data::TensorDataset>(data::Batch{{"x", x}, {"y", at::matmul(x, w.t())}}, "regression");
}

std::shared_ptr<data::DataLoader> loader(int64_t batch, bool shuffle = true) {
  data::LoaderOptions o;
  o.batch_size = batch;
  o.num_workers = 1;
  o.shuffle = shuffle;
  o.seed = 3;
  return std::make_shared<data::DataLoader>(regression_data(), o);
}

std::string fresh_dir(const std::string& name) {
  auto d = fs::path(::testing::TempDir()) / ("dew_trainer_" + name);
  fs::remove_all(d);
  fs::create_directories(d);
  return d.string();
}

TrainerOptions topts(int64_t steps) {
  TrainerOptions t;
  t.steps = steps;
  t.log_every = 5;
  t.checkpoint_every = 4;
  return t;
}

// SGD at a constant 0.1 without momentum or clipping: one step is the gradient times 0.1.
OptimOptions plain_sgd() {
  OptimOptions oo;
  oo.name = "sgd";
  oo.momentum = 0;
  oo.lr = 0.1;
  oo.warmup_steps = 0;
  oo.schedule = "constant";
  oo.grad_clip = 0;
  return oo;
}

void expect_bitwise(const TensorMap& a, const TensorMap& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (const auto& [k, v] : a) {
    ASSERT_TRUE(b.count(k)) << what << " " << k;
    EXPECT_TRUE(at::equal(v, b.at(k))) << what << " " << k;
  }
}

}  // namespace

TEST(Trainer, InterruptedAndResumedRunMatchesAnUninterruptedOneBitForBit) {
  OptimOptions oo;
  oo.lr = 1e-2;
  oo.warmup_steps = 3;
  const int64_t N = 7;  // an odd step count: the resume lands mid-epoch and between checkpoint cadences
  auto full_dir = fresh_dir("full");
  auto obj_a = std::make_shared<RegressionObjective>();
  Trainer a(obj_a, loader(6), oo, topts(2 * N), full_dir, 11);
  a.fit();

  auto half_dir = fresh_dir("half");
  {
    // SIGINT during step N - 1: the step completes, a checkpoint is written and fit() returns.
    auto obj_b = std::make_shared<RegressionObjective>(-1, true, /*interrupt_at=*/N - 1);
    Trainer b(obj_b, loader(6), oo, topts(2 * N), half_dir, 11);
    auto r = b.fit();
    EXPECT_EQ(r.step, N);
    EXPECT_TRUE(r.interrupted);
    EXPECT_EQ(list_checkpoints(half_dir).back(), N);
  }
  auto obj_c = std::make_shared<RegressionObjective>();
  Trainer c(obj_c, loader(6), oo, topts(2 * N), half_dir, 11);
  auto res = c.fit();  // resumes from step N
  EXPECT_EQ(res.step, 2 * N);
  expect_bitwise(module_state(*obj_a->m_), module_state(*obj_c->m_), "parameters");
  expect_bitwise(a.ema().averages(), c.ema().averages(), "ema");
  expect_bitwise(a.optimizer().state_dict(), c.optimizer().state_dict(), "optimizer");
  // and training did something
  auto ck = load_checkpoint(full_dir, 2 * N);
  EXPECT_FALSE(at::equal(ck.model.at("lin.weight"), ck.ema.at("lin.weight")));
}

TEST(Trainer, TornCheckpointLeavesThePreviousOneLoadable) {
  auto dir = fresh_dir("torn");
  auto obj = std::make_shared<RegressionObjective>();
  Trainer t(obj, loader(6), OptimOptions{}, topts(4), dir, 1);
  t.fit();
  ASSERT_EQ(list_checkpoints(dir), std::vector<int64_t>{4});
  // A crash mid-write leaves the temporary directory (with a truncated file) and never a step_N.
  auto tmp = fs::path(dir) / "checkpoints" / ".tmp_step_8";
  fs::create_directories(tmp);
  {
    std::ofstream f(tmp / "model.safetensors", std::ios::binary);
    f << "\x10\x00\x00";
  }
  // A half-copied directory without its state.json is not a checkpoint either.
  fs::create_directories(fs::path(dir) / "checkpoints" / "step_9");
  EXPECT_EQ(latest_checkpoint(dir), 4);
  auto c = load_checkpoint(dir, 4);
  EXPECT_EQ(c.state["step"], 4);
  // Resuming ignores the debris and continues from step 4.
  auto obj2 = std::make_shared<RegressionObjective>();
  Trainer t2(obj2, loader(6), OptimOptions{}, topts(6), dir, 1);
  EXPECT_EQ(t2.fit().step, 6);
  // A corrupt model file in a complete-looking checkpoint is a clear error, not a crash.
  auto bad = fs::path(dir) / "checkpoints" / "step_6" / "model.safetensors";
  {
    std::ofstream f(bad, std::ios::binary | std::ios::trunc);
    f << "garbage";
  }
  EXPECT_THROW(load_checkpoint(dir, 6), dew::Error);
}

TEST(Trainer, AccumulationEqualsOneLargeBatch) {
  const OptimOptions oo = plain_sgd();
  auto obj_a = std::make_shared<RegressionObjective>(-1, /*noisy=*/false);
  auto ta = topts(1);
  ta.accumulation = 4;
  Trainer a(obj_a, loader(5, false), oo, ta, fresh_dir("acc_a"), 0);
  a.fit();
  auto obj_b = std::make_shared<RegressionObjective>(-1, false);
  Trainer b(obj_b, loader(20, false), oo, topts(1), fresh_dir("acc_b"), 0);
  b.fit();
  auto wa = obj_a->m_->lin->weight, wb = obj_b->m_->lin->weight;
  EXPECT_LT((wa - wb).abs().max().item<double>(), 1e-6);
  auto w0 = RegressionObjective(-1, false).m_->lin->weight;
  EXPECT_GT((wa - w0).abs().max().item<double>(), 1e-3);  // it moved
}

TEST(Trainer, CpuBfloat16AutocastRunsTheForwardInBfloat16AndKeepsFloat32Parameters) {
  const OptimOptions oo = plain_sgd();
  auto run = [&](const std::string& mode, const std::string& dir) {
    auto obj = std::make_shared<RegressionObjective>(-1, /*noisy=*/false);
    auto t = topts(1);
    t.autocast = mode;
    Trainer tr(obj, loader(20, false), oo, t, fresh_dir(dir), 0);
    tr.fit();
    return obj;
  };
  auto off = run("off", "ac_off");
  auto bf = run("bfloat16", "ac_bf16");
  auto fp = run("auto", "ac_auto");  // auto is fp32 on the CPU
  EXPECT_EQ(off->forward_dtype, at::kFloat);
  EXPECT_EQ(fp->forward_dtype, at::kFloat);
  EXPECT_EQ(bf->forward_dtype, at::kBFloat16);
  EXPECT_FALSE(at::autocast::is_autocast_enabled(at::kCPU));  // restored after the step
  const auto wb = bf->m_->lin->weight, wo = off->m_->lin->weight, w0 = RegressionObjective(-1, false).m_->lin->weight;
  EXPECT_EQ(wb.scalar_type(), at::kFloat);
  EXPECT_TRUE(at::equal(wo, fp->m_->lin->weight));
  // One SGD step of 0.1: bf16's 8-bit mantissa moves the update by about 2^-8 of it, not more.
  const double step = (wo - w0).abs().max().item<double>(), diff = (wb - wo).abs().max().item<double>();
  EXPECT_GT(step, 1e-2);
  EXPECT_GT(diff, 0.0) << "autocast did not change the forward";
  EXPECT_LT(diff, 0.05 * step);
  printf("bf16 autocast: update %.4g, max |bf16 - fp32| %.3g\n", step, diff);
}

TEST(Trainer, Float16AutocastOnTheCpuIsRefusedByName) {
  auto t = topts(1);
  t.autocast = "float16";
  try {
    Trainer tr(std::make_shared<RegressionObjective>(), loader(5), OptimOptions{}, t, fresh_dir("ac_f16"), 0);
    FAIL() << "no error";
  } catch (const dew::Error& e) {
    EXPECT_NE(std::string(e.what()).find("trainer.autocast: float16 runs on CUDA only"), std::string::npos) << e.what();
  }
}

TEST(Trainer, NonFiniteLossIsSkippedAndCounted) {
  auto dir = fresh_dir("nan");
  auto obj = std::make_shared<RegressionObjective>(/*nan_at=*/2);
  Trainer t(obj, loader(6), OptimOptions{}, topts(5), dir, 0);
  auto res = t.fit();
  EXPECT_EQ(res.step, 5);
  EXPECT_EQ(res.bad_loss_steps, 1);
  EXPECT_EQ(t.optimizer().steps_taken(), 4);  // the bad step made no update
  for (const auto& [k, v] : module_state(*obj->m_)) EXPECT_TRUE(v.isfinite().all().item<bool>()) << k;
  // metrics.jsonl records the count
  std::ifstream f(fs::path(dir) / "metrics.jsonl");
  std::string line, last;
  while (std::getline(f, line))
    if (line.find("train/loss") != std::string::npos) last = line;
  EXPECT_EQ(json::parse(last)["train/bad_loss_steps"], 1);
}

TEST(Trainer, StopsAfterTooManyNonFiniteLosses) {
  struct AlwaysNaN : RegressionObjective {
    LossOutput loss(const data::Batch& b, int64_t step, at::Generator gen) override {
      auto out = RegressionObjective::loss(b, step, gen);
      out.loss = out.loss * std::numeric_limits<double>::infinity() * 0;
      return out;
    }
  };
  auto t = topts(50);
  t.max_bad_loss_steps = 3;
  Trainer tr(std::make_shared<AlwaysNaN>(), loader(6), OptimOptions{}, t, fresh_dir("nan_stop"), 0);
  try {
    tr.fit();
    FAIL() << "expected dew::Error";
  } catch (const dew::Error& e) {
    EXPECT_NE(std::string(e.what()).find("3 consecutive non-finite losses"), std::string::npos) << e.what();
  }
}

TEST(Trainer, TrainStepCalledNTimesEqualsFitToStepNBitForBit) {
  // fit() takes its steps through train_step(): a second trainer stepped by hand from the same seed and
  // data ends with the same bits. Accumulation, clipping, warm-up into the cosine decay and a skipped
  // non-finite step are all on the path.
  OptimOptions oo;
  oo.lr = 5e-2;
  oo.warmup_steps = 2;
  oo.grad_clip = 0.05;  // small enough to clip
  auto to = topts(6);
  to.accumulation = 2;
  auto obj_fit = std::make_shared<RegressionObjective>(/*nan_at=*/3);
  Trainer a(obj_fit, loader(6), oo, to, fresh_dir("step_fit"), 7);
  EXPECT_EQ(a.fit().bad_loss_steps, 1);

  auto obj_step = std::make_shared<RegressionObjective>(/*nan_at=*/3);
  Trainer b(obj_step, loader(6), oo, to, fresh_dir("step_by_hand"), 7);
  bool clipped = false;
  for (int64_t i = 0; i < to.steps; ++i) {
    const StepOutcome out = b.train_step();
    EXPECT_EQ(b.step(), i + 1);
    EXPECT_EQ(out.finite, i != 3) << "step " << i;
    EXPECT_DOUBLE_EQ(out.lr, learning_rate(oo, i, to.steps));
    if (out.finite) {
      EXPECT_EQ(out.samples, 12);
      EXPECT_TRUE(std::isfinite(out.loss));
      clipped = clipped || out.grad_norm > oo.grad_clip;
    }
  }
  EXPECT_TRUE(clipped);
  EXPECT_EQ(a.step(), b.step());
  expect_bitwise(module_state(*obj_fit->m_), module_state(*obj_step->m_), "parameters");
  expect_bitwise(a.ema().averages(), b.ema().averages(), "ema");
  expect_bitwise(a.optimizer().state_dict(), b.optimizer().state_dict(), "optimizer");
  EXPECT_EQ(b.optimizer().steps_taken(), to.steps - 1);  // the non-finite step made no update
}

TEST(Optim, LearningRateScheduleShape) {
  OptimOptions o;
  o.lr = 1.0;
  o.warmup_steps = 10;
  o.min_lr_ratio = 0.1;
  EXPECT_NEAR(learning_rate(o, 0, 110), 1.0 / 11, 1e-12);
  EXPECT_NEAR(learning_rate(o, 10, 110), 1.0, 1e-12);
  EXPECT_NEAR(learning_rate(o, 60, 110), 0.1 + 0.9 * 0.5, 1e-12);  // half-way down the cosine
  EXPECT_NEAR(learning_rate(o, 110, 110), 0.1, 1e-12);
  o.schedule = "linear";
  EXPECT_NEAR(learning_rate(o, 60, 110), 0.55, 1e-12);
  o.schedule = "constant";
  EXPECT_NEAR(learning_rate(o, 100, 110), 1.0, 1e-12);
}

TEST(Optim, AdamWStepMatchesTheFormula) {
  auto p = at::tensor({1.0, -2.0}).view({1, 2}).requires_grad_(true);
  p.mutable_grad() = at::tensor({0.5, 0.25}).view({1, 2});
  OptimOptions o;
  o.weight_decay = 0.1;
  Optimizer opt({{"p", p}}, o);
  opt.step(0.01);
  // t = 1: m_hat = g, v_hat = g^2, update = g/(|g| + eps) = sign(g); decoupled decay first
  for (int i = 0; i < 2; ++i) {
    double p0 = i == 0 ? 1.0 : -2.0, g = i == 0 ? 0.5 : 0.25;
    double expect = p0 * (1 - 0.01 * 0.1) - 0.01 * g / (std::abs(g) + 1e-8);
    EXPECT_NEAR(p[0][i].item<double>(), expect, 1e-6);
  }
}

TEST(Optim, Float32OnePassUpdatesMatchTheFloat64AtenPath) {
  // float32 parameters take the one-pass kernels (Adam(W), EMA, gradient norm); float64 twins take the ATen
  // ops. Five steps with the same gradients must agree to float precision, with and without weight decay
  // (a matrix and a bias) and with sizes that leave vector tails.
  for (const std::string name : {"adamw", "adam"}) {
    torch::manual_seed(3);
    const std::vector<std::vector<int64_t>> shapes{{37, 5}, {19}};
    NamedTensors p32, p64;
    for (size_t i = 0; i < shapes.size(); ++i) {
      auto init = torch::randn(shapes[i]);
      p32.emplace_back("p" + std::to_string(i), init.clone().requires_grad_(true));
      p64.emplace_back("p" + std::to_string(i), init.to(at::kDouble).requires_grad_(true));
    }
    OptimOptions o;
    o.name = name;
    o.weight_decay = 0.1;
    Optimizer opt32(p32, o), opt64(p64, o);
    EMA ema32(p32, EmaSpec{0.9}), ema64(p64, EmaSpec{0.9});
    for (int step = 0; step < 5; ++step) {
      for (size_t i = 0; i < shapes.size(); ++i) {
        auto g = torch::randn(shapes[i]);
        p32[i].second.mutable_grad() = g.clone();
        p64[i].second.mutable_grad() = g.to(at::kDouble);
      }
      const double n32 = clip_grad_norm(p32, 0), n64 = clip_grad_norm(p64, 0);
      EXPECT_NEAR(n32, n64, 1e-6 * n64) << name;
      opt32.step(0.01);
      opt64.step(0.01);
      ema32.update(p32, step);
      ema64.update(p64, step);
    }
    for (size_t i = 0; i < shapes.size(); ++i) {
      const auto& a = p32[i].second;
      const auto& b = p64[i].second;
      EXPECT_LT((a.detach().to(at::kDouble) - b.detach()).abs().max().item<double>(), 2e-6) << name << " p" << i;
      const auto e32 = opt32.state_dict(), e64 = opt64.state_dict();
      for (const char* key : {"exp_avg/", "exp_avg_sq/"}) {
        const auto k = key + p32[i].first;
        EXPECT_LT((e32.at(k).to(at::kDouble) - e64.at(k)).abs().max().item<double>(), 2e-6) << name << " " << k;
      }
    }
    ema32.swap_into(p32);
    ema64.swap_into(p64);
    for (size_t i = 0; i < shapes.size(); ++i)
      EXPECT_LT((p32[i].second.detach().to(at::kDouble) - p64[i].second.detach()).abs().max().item<double>(), 2e-6)
          << name << " ema p" << i;
  }
}

TEST(Optim, ZeroGradDropsGradientsAndStepSkipsParametersWithout) {
  auto a = torch::ones({2, 2}).requires_grad_(true), b = torch::ones({3}).requires_grad_(true);
  a.mutable_grad() = torch::ones({2, 2});
  b.mutable_grad() = torch::ones({3});
  Optimizer opt({{"a", a}, {"b", b}}, OptimOptions{});
  opt.zero_grad();
  EXPECT_FALSE(a.grad().defined());
  EXPECT_FALSE(b.grad().defined());
  a.mutable_grad() = torch::full({2, 2}, 0.5);
  opt.step(0.1);
  EXPECT_LT(a[0][0].item<double>(), 1.0);  // updated
  EXPECT_EQ(b[0].item<double>(), 1.0);     // no gradient: untouched, as are its moments
  EXPECT_EQ(opt.state_dict().at("exp_avg/b").abs().sum().item<double>(), 0.0);
}

// Schedules, transforms, weightings and presets against closed forms computed here by hand.
#include <gtest/gtest.h>

#include "tests/test_util.h"

#include <cmath>

#include "dew/core/rng.h"
#include "dew/diffusion/process.h"
#include "tests/golden_util.h"

using namespace dew;
using namespace dew::diffusion;

namespace {

using dew::test::kF64;

std::vector<std::string> all_schedules() {
  return {"linear", "cosine", "exp", "sqrt", "cosine_continuous", "karras_ve", "edm", "flow"};
}

// Interior times of a schedule (endpoints excluded where alpha or sigma vanish).
Tensor interior_times(const Schedule& s, int64_t n = 200) {
  if (s.discrete()) return at::arange(1, int64_t(s.t_max()), kF64);
  double lo = s.t_min(), hi = s.t_max();
  if (s.name() == "sqrt") hi = 0.999;  // alpha^2 is clipped to 0 past t = 1 - 1e-4 (approximately)
  return at::linspace(lo + (hi - lo) * 1e-3, hi - (hi - lo) * 1e-3, n, kF64);
}

using dew::test::error_of;

}  // namespace

TEST(Schedules, SnrIsStrictlyDecreasingInTime) {
  for (const auto& name : all_schedules()) {
    auto s = schedules().build(name, json::object());
    auto snr = s->snr(interior_times(*s));
    auto diff = snr.slice(0, 1) - snr.slice(0, 0, -1);
    EXPECT_LT(diff.max().item<double>(), 0.0) << name;
  }
  FlowOptions shifted;
  shifted.shift = 3.0;
  auto f = make_flow(shifted);
  auto snr = f->snr(interior_times(*f));
  EXPECT_LT((snr.slice(0, 1) - snr.slice(0, 0, -1)).max().item<double>(), 0.0);
}

TEST(Schedules, VariancePreservingSchedulesKeepUnitVariance) {
  for (const auto& name : {"linear", "cosine", "exp", "sqrt", "cosine_continuous"}) {
    auto s = schedules().build(name, json::object());
    EXPECT_EQ(s->kind(), ScheduleKind::variance_preserving) << name;
    auto r = s->rates(interior_times(*s));
    EXPECT_LT((r.alpha.square() + r.sigma.square() - 1).abs().max().item<double>(), 1e-12) << name;
  }
  // Empirically: x0 with unit variance stays unit variance at every t.
  auto s = make_cosine();
  auto gen = rng::generator(0, 0, "test");
  auto x0 = at::randn({20000}, gen, kF64), eps = at::randn({20000}, gen, kF64);
  for (double t : {100.0, 500.0, 900.0}) {
    auto [a, sg] = s->rates_at(t);
    EXPECT_NEAR((a * x0 + sg * eps).var().item<double>(), 1.0, 0.03) << t;
  }
}

TEST(Schedules, DiscreteTablesMatchHandDerivations) {
  // linear: beta_i = 1e-4 + i (0.02 - 1e-4)/(T - 1), alphabar = prod (1 - beta)
  auto lin = alphas_cumprod(*make_linear());
  double prod = 1;
  for (int i = 0; i < 1000; ++i) {
    prod *= 1 - (1e-4 + i * (0.02 - 1e-4) / 999);
    if (i == 0 || i == 499 || i == 999) {
      EXPECT_NEAR(lin[i].item<double>(), prod, 1e-12) << i;
    }
  }
  // cosine: the product telescopes to f((i+1)/T)/f(0) wherever no beta is clipped.
  auto f = [](double u) { return std::pow(std::cos((u + 0.008) / 1.008 * M_PI / 2), 2); };
  auto cos = alphas_cumprod(*make_cosine());
  for (int i : {0, 10, 500, 900, 990}) EXPECT_NEAR(cos[i].item<double>(), f((i + 1) / 1000.0) / f(0), 1e-9) << i;
  // the last beta is clipped at beta_end: 0.999 keeps a tiny alphabar, 1.0 gives zero terminal SNR.
  EXPECT_NEAR(cos[999].item<double>(), cos[998].item<double>() * 0.001, 1e-15);
  DiscreteOptions zt;
  zt.beta_end = 1.0;
  auto zero_terminal = make_cosine(zt);
  EXPECT_EQ(zero_terminal->rates_at(999).first, 0.0);
  EXPECT_EQ(zero_terminal->rates_at(999).second, 1.0);
  // exp: alphabar_i = exp(-12 (i + 1)/T)
  auto ex = alphas_cumprod(*make_exp());
  for (int i : {0, 100, 999}) EXPECT_NEAR(ex[i].item<double>(), std::exp(-12.0 * (i + 1) / 1000), 1e-12) << i;
  // a discrete schedule's model time is the index and its training draw is an integer in [0, T)
  auto t = make_linear()->draw_t(1000, rng::generator(1, 0, "t"));
  EXPECT_TRUE(at::equal(t, t.round()));
  EXPECT_GE(t.min().item<double>(), 0);
  EXPECT_LE(t.max().item<double>(), 999);
  EXPECT_EQ(make_linear()->model_time(at::full({1}, 417.0, kF64)).item<float>(), 417.0f);
}

TEST(Schedules, ContinuousClosedForms) {
  auto sq = make_sqrt();
  auto [a, s] = sq->rates_at(0.25);
  double a2 = (1 - std::sqrt(0.25 + 1e-4)) / (1 - std::sqrt(1e-4));
  EXPECT_NEAR(a * a, a2, 1e-12);
  EXPECT_NEAR(s * s, 1 - a2, 1e-12);
  EXPECT_NEAR(sq->rates_at(0).first, 1.0, 1e-12);
  auto cc = make_cosine_continuous();
  EXPECT_NEAR(cc->rates_at(1.0 / 3).first, std::cos(M_PI / 6), 1e-12);
  // weight 1/(1 + SNR) = sigma^2 on a VP schedule
  EXPECT_NEAR(cc->weight(at::full({1}, 0.4, kF64)).item<double>(), std::pow(std::sin(0.2 * M_PI), 2), 1e-12);
}

TEST(Schedules, KarrasGridEndpointsAndInverse) {
  auto k = make_karras_ve();
  EXPECT_NEAR(k->rates_at(1.0).second, 80.0, 1e-9);
  EXPECT_NEAR(k->rates_at(0.0).second, 0.002, 1e-12);
  EXPECT_EQ(k->rates_at(0.3).first, 1.0);
  // the uniform grid in t is the Karras rho-grid
  const int n = 18;
  auto sig = k->rates(k->grid(n)).sigma;
  for (int i = 0; i < n; ++i) {
    double expect = std::pow(
        std::pow(80.0, 1 / 7.0) + i / double(n - 1) * (std::pow(0.002, 1 / 7.0) - std::pow(80.0, 1 / 7.0)), 7.0);
    EXPECT_NEAR(sig[i].item<double>(), expect, 1e-9 * expect) << i;
  }
  auto t = at::linspace(0, 1, 101, kF64);
  EXPECT_LT((k->t_of_sigma(k->rates(t).sigma) - t).abs().max().item<double>(), 1e-12);
  // EDM weight lambda(sigma) = (sigma^2 + sd^2)/(sigma sd)^2 and c_noise = ln(sigma)/4
  double sigma = k->rates_at(0.6).second;
  EXPECT_NEAR(k->weight(at::full({1}, 0.6, kF64)).item<double>(), (sigma * sigma + 0.25) / (sigma * sigma * 0.25),
              1e-9);
  EXPECT_NEAR(k->model_time(at::full({1}, 0.6, kF64)).item<float>(), std::log(sigma) / 4, 1e-6);
  EXPECT_NE(error_of([] { make_linear()->t_of_sigma(at::ones({1})); }).find("variance-exploding"), std::string::npos);
}

TEST(Schedules, EdmTrainingDensity) {
  for (auto [regime, mean, std] :
       {std::tuple<const char*, double, double>{"pixel", -1.2, 1.2}, {"latent", -0.4, 1.0}}) {
    EDMOptions o;
    o.regime = regime;
    auto s = make_edm(o);
    auto logs = s->draw_t(40000, rng::generator(3, 0, "t")).log();
    EXPECT_NEAR(logs.mean().item<double>(), mean, 0.03) << regime;
    EXPECT_NEAR(logs.std().item<double>(), std, 0.03) << regime;
    EXPECT_EQ(s->rates_at(1.7).second, 1.7);  // t is sigma
  }
  EDMOptions explicit_;
  explicit_.p_mean = 0.5;
  explicit_.p_std = 0.1;
  auto logs = make_edm(explicit_)->draw_t(40000, rng::generator(3, 0, "t")).log();
  EXPECT_NEAR(logs.mean().item<double>(), 0.5, 0.01);
  EXPECT_NEAR(logs.std().item<double>(), 0.1, 0.01);
}

TEST(Schedules, FlowShiftIdentities) {
  auto t = at::linspace(0, 1, 11, kF64);
  auto plain = make_flow();
  EXPECT_LT((plain->rates(t).sigma - t).abs().max().item<double>(), 1e-15);
  EXPECT_LT((plain->rates(t).alpha + plain->rates(t).sigma - 1).abs().max().item<double>(), 1e-15);
  FlowOptions o;
  o.shift = 3.0;
  auto sh = make_flow(o);
  EXPECT_NEAR(sh->rates_at(0.5).second, 3.0 / 4.0, 1e-15);  // s/(1 + s) at t = 1/2
  EXPECT_NEAR(sh->rates_at(0.0).second, 0.0, 1e-15);
  EXPECT_NEAR(sh->rates_at(1.0).second, 1.0, 1e-15);
  // shifting multiplies the odds t/(1 - t) by the shift, so shift a then b equals shift a*b
  FlowOptions o2;
  o2.shift = 2.0;
  o.shift = 6.0;
  auto by2 = make_flow(o2), by6 = make_flow(o);
  auto twice = by2->rates(by2->rates(t).sigma).sigma;  // shift 2 applied to t' of shift 2 = shift 4
  FlowOptions o4;
  o4.shift = 4.0;
  EXPECT_LT((twice - make_flow(o4)->rates(t).sigma).abs().max().item<double>(), 1e-12);
  EXPECT_NEAR(by6->model_time(at::full({1}, 0.5, kF64)).item<float>(), 1000 * 6.0 / 7.0, 1e-3);
  // resolution shift: 256 tokens (256x256 px) -> exp(0.5), 4096 tokens (1024 px) -> exp(1.15)
  EXPECT_NEAR(flow_resolution_shift(256, 256), std::exp(0.5), 1e-12);
  EXPECT_NEAR(flow_resolution_shift(1024, 1024), std::exp(1.15), 1e-12);
  // every density is symmetric about 1/2 and lies in [0, 1]
  for (auto d : {"logit_normal", "mode", "cosmap", "uniform"}) {
    FlowOptions fo;
    fo.density = d;
    auto draw = make_flow(fo)->draw_t(40000, rng::generator(5, 0, "t"));
    EXPECT_NEAR(draw.mean().item<double>(), 0.5, 0.01) << d;
    EXPECT_GE(draw.min().item<double>(), 0.0) << d;
    EXPECT_LE(draw.max().item<double>(), 1.0) << d;
  }
  // logit_normal(0, 1): logit(t) ~ N(0, 1)
  auto ln = make_flow()->draw_t(40000, rng::generator(6, 0, "t"));
  EXPECT_NEAR(at::logit(ln).std().item<double>(), 1.0, 0.02);
}

TEST(Transforms, ForwardThenInverseRecoversX0AndEps) {
  auto gen = rng::generator(0, 0, "test");
  for (const auto& sname : all_schedules()) {
    auto s = schedules().build(sname, json::object());
    auto t = interior_times(*s, 16);
    if (t.size(0) > 16) t = t.index_select(0, at::linspace(0, t.size(0) - 1, 16, kF64).to(at::kLong));
    const int64_t B = t.size(0);
    auto x0 = at::randn({B, 3, 4, 4}, gen, kF64), eps = at::randn({B, 3, 4, 4}, gen, kF64);
    auto b = broadcast_rates(s->rates(t), x0);
    auto xt = b.alpha * x0 + b.sigma * eps;
    for (const auto& tname : {"epsilon", "x0", "v", "flow", "karras"}) {
      auto tr = make_transform(tname);
      // the raw output that the target implies (karras: F such that D = x0)
      auto F = std::string(tname) == "karras" ? tr->raw_output(x0, xt, b) : tr->target(x0, eps, b);
      auto p = tr->to_x0_eps(F, xt, b);
      double scale = 1 + b.alpha.abs().max().item<double>() / b.sigma.abs().min().item<double>();
      EXPECT_LT((p.x0 - x0).abs().max().item<double>(), 1e-9 * scale) << sname << "/" << tname;
      EXPECT_LT((p.eps - eps).abs().max().item<double>(), 1e-9 * scale) << sname << "/" << tname;
      // raw_output inverts to_x0_eps for every transform
      EXPECT_LT((tr->raw_output(p.x0, xt, b) - F).abs().max().item<double>(), 1e-8 * scale) << sname << "/" << tname;
    }
  }
}

TEST(Transforms, KarrasPreconditioningValues) {
  auto tr = make_transform("karras");
  Rates r{at::ones({1}, kF64), at::full({1}, 2.0, kF64)};
  EXPECT_NEAR(tr->c_in(r).item<double>(), 1 / std::sqrt(4.25), 1e-15);
  // D = c_skip x + c_out F with c_skip = 0.25/4.25, c_out = 2 * 0.5/sqrt(4.25)
  auto x = at::full({1, 1}, 3.0, kF64), F = at::full({1, 1}, -1.0, kF64);
  auto b = broadcast_rates(r, x);
  EXPECT_NEAR(tr->prediction(F, x, b).item<double>(), 0.25 / 4.25 * 3 - 1.0 / std::sqrt(4.25), 1e-15);
}

TEST(Weightings, MinSnrByHand) {
  auto snr = at::tensor({10.0, 2.0, 0.0}, kF64);
  auto check = [&](const char* tr, std::vector<double> expect) {
    auto w = min_snr_weight(snr, 5.0, *make_transform(tr));
    for (int i = 0; i < 3; ++i) EXPECT_NEAR(w[i].item<double>(), expect[i], 1e-12) << tr << " " << i;
  };
  check("epsilon", {0.5, 1.0, 1.0});
  check("v", {5.0 / 11, 2.0 / 3, 1.0});
  check("x0", {5.0, 2.0, 1.0});
  check("karras", {5.0, 2.0, 1.0});
  check("flow", {5.0 / std::pow(1 + std::sqrt(10.0), 2), 2.0 / std::pow(1 + std::sqrt(2.0), 2), 1.0});
  // P2 (k = gamma = 1) of the cosine schedule: 1/(1 + SNR)
  auto s = make_cosine();
  auto t = at::full({1}, 300.0, kF64);
  EXPECT_NEAR(s->weight(t).item<double>(), 1 / (1 + s->snr(t).item<double>()), 1e-12);
}

TEST(Presets, TableMatchesSpec) {
  struct Row {
    const char* name;
    const char* train;
    const char* sample;
    const char* transform;
  };
  for (auto row : {Row{"edm", "edm", "karras_ve", "karras"}, Row{"karras", "karras_ve", "karras_ve", "karras"},
                   Row{"cosine", "cosine", "cosine", "v"}, Row{"flow", "flow", "flow", "flow"},
                   Row{"sqrt", "sqrt", "sqrt", "x0"}}) {
    PresetOptions o;
    if (std::string(row.name) == "edm") o.regime = "pixel";
    auto p = preset(row.name, o);
    EXPECT_EQ(p.train->name(), row.train) << row.name;
    EXPECT_EQ(p.sample->name(), row.sample) << row.name;
    EXPECT_EQ(p.transform->name(), row.transform) << row.name;
    EXPECT_EQ(p.weighting->name(), "schedule") << row.name;
    o.min_snr_gamma = 5.0;
    EXPECT_EQ(preset(row.name, o).weighting->name(), "min_snr") << row.name;
  }
  // cosine preset: zero terminal SNR
  auto c = preset("cosine");
  EXPECT_EQ(c.train->rates_at(999).first, 0.0);
  EXPECT_EQ(c.train->prior_std(), 1.0);
  // flow preset: logit_normal(0, 1), shift 1
  EXPECT_NEAR(preset("flow").train->rates_at(0.3).second, 0.3, 1e-15);
  auto msg = error_of([] { preset("edm"); });
  EXPECT_NE(msg.find("regime is required"), std::string::npos) << msg;
  EXPECT_NE(error_of([] {
              presets().build(json{{"name", "flow"}, {"shiftt", 2}});
            }).find("valid fields"),
            std::string::npos);
  EXPECT_NE(error_of([] { presets().build(json{{"name", "cosin"}}); }).find("registered: cosine"), std::string::npos);
  EXPECT_NEAR(preset("karras").sample->prior_std(), std::sqrt(1 + 80.0 * 80.0), 1e-9);
}

TEST(Process, EdmLossEqualsPreconditionedRegression) {
  // EDM: 0.5 lambda (D - x0)^2 equals 0.5 (F - (x0 - c_skip x_t)/c_out)^2 since lambda c_out^2 = 1.
  PresetOptions o;
  o.regime = "pixel";
  DiffusionProcess proc(preset("edm", o));
  auto gen = rng::generator(0, 0, "test");
  auto x0 = at::randn({8, 2, 3, 3}, gen, kF64);
  auto in = proc.training_inputs(x0, gen);
  auto F = at::randn(x0.sizes(), gen, kF64);
  auto sigma = bcast(in.t, x0);
  auto c_skip = 0.25 / (sigma.square() + 0.25), c_out = sigma * 0.5 / (sigma.square() + 0.25).sqrt();
  auto expect = 0.5 * (F - (x0 - c_skip * in.x_t) / c_out).square().flatten(1).mean(1);
  EXPECT_LT((proc.loss_per_row(F, in).to(at::kDouble) - expect).abs().max().item<double>(),
            1e-4 * expect.max().item<double>());
  // the inputs are what the forward process says
  EXPECT_LT((in.x_t - (x0 + sigma * in.eps)).abs().max().item<double>(), 1e-12);
  EXPECT_LT((in.net_input - in.x_t / (sigma.square() + 0.25).sqrt()).abs().max().item<double>(), 1e-12);
  EXPECT_LT((in.model_time.to(at::kDouble) - in.t.log() / 4).abs().max().item<double>(), 1e-6);
}

TEST(Process, EpsilonLossIsZeroForTheTrueNoise) {
  Preset p{
      "custom", make_cosine(), make_cosine(), make_transform("epsilon"), weightings().build("schedule", json::object()),
      {}};
  DiffusionProcess proc(p);
  auto gen = rng::generator(1, 0, "test");
  auto x0 = at::randn({4, 3, 2, 2}, gen);
  auto in = proc.training_inputs(x0, gen);
  EXPECT_EQ(proc.loss(in.eps, in).item<float>(), 0.0f);
  // and 0.5 w mean(1) for a unit error
  auto l = proc.loss_per_row(in.eps + 1, in);
  EXPECT_LT((l - 0.5 * in.weight).abs().max().item<float>(), 1e-6);
}

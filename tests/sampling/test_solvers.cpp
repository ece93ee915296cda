// Solvers driven by the Gaussian oracle: x0 ~ N(0, 0.3^2) per element, so
// E[x0 | x_t] = alpha 0.09/(alpha^2 0.09 + sigma^2) x_t exactly, and on a VE schedule the
// probability-flow ODE has the solution x(s) = x_T sqrt(0.09 + s^2)/sqrt(0.09 + sigma_T^2).
#include <gtest/gtest.h>

#include "tests/test_util.h"

#include <cmath>

#include "dew/core/rng.h"
#include "dew/sampling/sample.h"
#include "tests/golden_util.h"

using namespace dew;
using namespace dew::diffusion;
using namespace dew::sampling;

namespace {

using dew::test::kF64;

// The exact raw network output of a transform for the Gaussian data, at schedule time t.
RawFn gaussian_oracle(SchedulePtr s, TransformPtr tr) {
  return [s, tr](const Tensor& x, const Tensor& t) {
    auto b = broadcast_rates(s->rates(t), x);
    auto x0 = b.alpha * 0.09 / (b.alpha.square() * 0.09 + b.sigma.square()) * x;
    return tr->raw_output(x0, x, b);
  };
}

struct Setup {
  std::shared_ptr<DiffusionProcess> process;
  Denoiser denoiser;
};

Setup setup(SchedulePtr s, const std::string& transform) {
  Preset p{"test", s, s, make_transform(transform), weightings().build("schedule", json::object()), {}};
  auto proc = std::make_shared<DiffusionProcess>(p);
  return {proc, proc->denoiser(gaussian_oracle(s, p.transform))};
}

SchedulePtr vp_cosine() { return make_cosine(); }  // beta_end 0.999: alpha_T small but non-zero
SchedulePtr karras() { return make_karras_ve(); }

using dew::test::error_of;

void expect_converges(SchedulePtr s, const std::string& transform, const std::string& solver, const json& fields) {
  auto st = setup(s, transform);
  auto xT = st.process->prior({256, 3, 8, 8}, 11);
  auto solv = make_solver(solver, fields);
  auto x = sample(st.denoiser, *s, xT, 100, *solv, seeded_noise(12));
  double mean = x.mean().item<double>(), std = x.std().item<double>();
  EXPECT_LT(std::abs(mean), 0.05) << solver << fields.dump() << " on " << s->name();
  EXPECT_LT(std::abs(std - 0.3), 0.05) << solver << fields.dump() << " on " << s->name() << " std " << std;
  EXPECT_TRUE(x.isfinite().all().item<bool>());
}

}  // namespace

TEST(Solvers, EverySolverConvergesOnTheVPCosineSchedule) {
  for (auto [name, fields] : std::vector<std::pair<std::string, json>>{{"ddpm", {{"variance", "small"}}},
                                                                       {"ddpm", {{"variance", "large"}}},
                                                                       {"ddim", {{"eta", 0.0}}},
                                                                       {"ddim", {{"eta", 1.0}}},
                                                                       {"euler", json::object()},
                                                                       {"dpmsolver++", json::object()},
                                                                       {"pndm", json::object()},
                                                                       {"plms", json::object()}}) {
    expect_converges(vp_cosine(), "epsilon", name, fields);
  }
}

TEST(Solvers, EverySolverConvergesOnKarrasVE) {
  for (auto [name, fields] :
       std::vector<std::pair<std::string, json>>{{"ddpm", json::object()},
                                                 {"ddim", json::object()},
                                                 {"euler", json::object()},
                                                 {"euler_ancestral", json::object()},
                                                 {"heun", json::object()},
                                                 {"heun", {{"s_churn", 40.0}, {"s_tmin", 0.05}, {"s_tmax", 50.0}}},
                                                 {"rk4", json::object()},
                                                 {"multistep_dpm", json::object()},
                                                 {"dpmsolver++", json::object()},
                                                 {"pndm", json::object()}}) {
    expect_converges(karras(), "karras", name, fields);
  }
}

TEST(Solvers, OrderOfAccuracyOnTheVEProbabilityFlowODE) {
  auto s = karras();
  auto st = setup(s, "karras");
  auto xT = at::randn({4, 1, 4, 4}, rng::generator(0, 0, "xT"), kF64) * 80.0;
  const double smin = s->rates_at(0).second;
  auto exact = xT * std::sqrt(0.09 + smin * smin) / std::sqrt(0.09 + 80.0 * 80.0);
  auto error = [&](const std::string& solver) {
    auto solv = make_solver(solver);
    auto x = sample(st.denoiser, *s, xT, 20, *solv, seeded_noise(0), /*final_denoise=*/false);
    return ((x - exact).abs().max() / exact.abs().max()).item<double>();
  };
  double rk4 = error("rk4"), heun = error("heun"), euler = error("euler");
  RecordProperty("rk4", std::to_string(rk4));
  EXPECT_LT(rk4, 2e-3);
  EXPECT_GT(heun, 2e-3);
  EXPECT_LT(heun, 8e-2);
  EXPECT_GT(euler, 8e-2);
  EXPECT_LT(euler, 2e-1);
  EXPECT_LT(error("multistep_dpm"), euler);
  EXPECT_LT(error("dpmsolver++"), euler);
  std::cout << "relative error, 20 rho-spaced steps: rk4 " << rk4 << " heun " << heun << " euler " << euler
            << " multistep_dpm " << error("multistep_dpm") << " dpmsolver++ " << error("dpmsolver++") << "\n";
}

TEST(Solvers, OneDDPMStepIsTheGaussianPosterior) {
  // Posterior q(x_s | x_t, x0) from the linear betas, recomputed here: mean = c0 x0 + ct x_t,
  // var = (1 - abar_t/abar_s)(1 - abar_s)/(1 - abar_t).
  auto s = make_linear();
  auto st = setup(s, "epsilon");
  const int t = 600, sidx = 570;
  double abar_t = 1, abar_s = 1;
  for (int i = 0; i <= t; ++i) {
    double beta = 1e-4 + i * (0.02 - 1e-4) / 999;
    abar_t *= 1 - beta;
    if (i <= sidx) abar_s *= 1 - beta;
  }
  auto x = at::randn({3, 2, 4, 4}, rng::generator(1, 0, "x"), kF64);
  auto z = at::randn({3, 2, 4, 4}, rng::generator(2, 0, "z"), kF64);
  NoiseSource fixed = [z](int64_t, const Tensor&) { return z; };
  auto x0 = denoise_at(st.denoiser, x, t).x0;
  double c0 = std::sqrt(abar_s) * (1 - abar_t / abar_s) / (1 - abar_t);
  double ct = std::sqrt(abar_t / abar_s) * (1 - abar_s) / (1 - abar_t);
  double var = (1 - abar_t / abar_s) * (1 - abar_s) / (1 - abar_t);
  auto expect = c0 * x0 + ct * x + std::sqrt(var) * z;
  auto solv = make_solver("ddpm");
  StepContext c{*s, st.denoiser, fixed, 0, 100};
  EXPECT_LT((solv->step(x, t, sidx, c) - expect).abs().max().item<double>(), 1e-5);
  // ddim with eta = 1 is the same posterior
  auto ddim = make_solver("ddim", {{"eta", 1.0}});
  EXPECT_LT((ddim->step(x, t, sidx, c) - expect).abs().max().item<double>(), 1e-5);
}

TEST(Solvers, OneEulerAncestralStepByHand) {
  auto s = karras();
  auto st = setup(s, "karras");
  auto x = at::randn({2, 1, 3, 3}, rng::generator(3, 0, "x"), kF64) * 10;
  auto z = at::randn({2, 1, 3, 3}, rng::generator(4, 0, "z"), kF64);
  NoiseSource fixed = [z](int64_t, const Tensor&) { return z; };
  const double t = 0.8, sn = 0.7;
  auto sig = [](double u) {
    return std::pow(std::pow(80.0, 1 / 7.0) + (1 - u) * (std::pow(0.002, 1 / 7.0) - std::pow(80.0, 1 / 7.0)), 7.0);
  };
  double st_ = sig(t), ss = sig(sn);
  double up = std::sqrt(ss * ss * (st_ * st_ - ss * ss) / (st_ * st_));
  double down = std::sqrt(ss * ss - up * up);
  auto D = 0.09 / (0.09 + st_ * st_) * x;  // the oracle's x0
  auto expect = x + (x - D) / st_ * (down - st_) + up * z;
  StepContext c{*s, st.denoiser, fixed, 0, 10};
  EXPECT_LT((make_solver("euler_ancestral")->step(x, t, sn, c) - expect).abs().max().item<double>(), 1e-9);
}

TEST(Solvers, HeunEqualsEulerOnAStepToSigmaZero) {
  EDMOptions o;
  auto s = make_edm(o);  // t = sigma, so s = 0 is sigma 0
  auto st = setup(s, "karras");
  auto x = at::randn({2, 1, 3, 3}, rng::generator(5, 0, "x"), kF64);
  StepContext c{*s, st.denoiser, seeded_noise(0), 0, 10};
  auto heun = make_solver("heun")->step(x, 1.5, 0.0, c);
  auto euler = make_solver("euler")->step(x, 1.5, 0.0, c);
  EXPECT_LT((heun - euler).abs().max().item<double>(), 1e-12);
  // and both land on the denoised estimate
  EXPECT_LT((heun - 0.09 / (0.09 + 2.25) * x).abs().max().item<double>(), 1e-12);
}

TEST(Solvers, SigmaSpaceSolversRefuseVPSchedules) {
  auto s = vp_cosine();
  auto st = setup(s, "epsilon");
  auto x = at::randn({1, 1, 2, 2});
  for (auto name : {"euler_ancestral", "heun", "rk4", "multistep_dpm"}) {
    auto msg = error_of([&] { sample(st.denoiser, *s, x, 5, *make_solver(name), seeded_noise(0)); });
    EXPECT_NE(msg.find("needs a variance-exploding schedule"), std::string::npos) << name << ": " << msg;
    EXPECT_NE(msg.find("cosine is variance-preserving"), std::string::npos) << msg;
  }
  auto k = karras();
  auto sk = setup(k, "karras");
  auto msg = error_of([&] {
    sample(sk.denoiser, *k, x, 5, *make_solver("ddpm", {{"variance", "large"}}), seeded_noise(0));
  });
  EXPECT_NE(msg.find("needs a variance-preserving schedule"), std::string::npos) << msg;
  EXPECT_NE(error_of([] {
              make_solver("ddpm", {{"variance", "huge"}});
            }).find("accepted: small, large"),
            std::string::npos);
  EXPECT_NE(error_of([] { make_solver("eulr"); }).find("registered:"), std::string::npos);
}

TEST(Solvers, SeededNoiseMakesSamplingReproducible) {
  auto s = karras();
  auto st = setup(s, "karras");
  auto xT = st.process->prior({4, 1, 4, 4}, 3);
  auto run = [&](uint64_t seed) {
    return sample(st.denoiser, *s, xT, 10, *make_solver("euler_ancestral"), seeded_noise(seed));
  };
  EXPECT_TRUE(at::equal(run(1), run(1)));
  EXPECT_FALSE(at::equal(run(1), run(2)));
  EXPECT_TRUE(at::equal(st.process->prior({4, 1, 4, 4}, 3), xT));
  EXPECT_NEAR(xT.std().item<double>(), std::sqrt(1 + 6400.0), 30.0);
}

TEST(Guidance, GuidedMinusUnguidedIsScaleMinusOneTimesOffset) {
  const double offset = 0.25;
  // conditional rows = unconditional + offset
  RawFn doubled = [&](const Tensor& x, const Tensor&) {
    auto out = x * 0.5;
    auto half = x.size(0) / 2;
    return at::cat({out.slice(0, 0, half) + offset, out.slice(0, half)});
  };
  CFG cfg;
  cfg.scale = 3.0;
  cfg.start = 0.2;
  cfg.stop = 0.6;
  auto g = guided(doubled, cfg, 1.0);
  auto x = at::randn({2, 1, 2, 2}, kF64);
  auto unguided = x * 0.5 + offset;  // scale 1 = the conditional output
  for (auto [t, inside] : {std::pair<double, bool>{0.5, true}, {0.1, false}, {0.9, false}, {0.6, true}}) {
    auto diff = g(x, at::full({2}, t, kF64)) - unguided;
    double want = inside ? (cfg.scale - 1) * offset : 0.0;
    EXPECT_LT((diff - want).abs().max().item<double>(), 1e-12) << "t " << t;
  }
}

TEST(Guidance, RescaleMatchesHandComputation) {
  auto c = at::tensor({1.0, 2.0, 4.0, 7.0}, kF64).view({1, 4});
  auto u = at::tensor({0.5, 0.0, 1.0, 2.0}, kF64).view({1, 4});
  CFG cfg;
  cfg.scale = 2.0;
  cfg.rescale = 0.7;
  // out = u + 2 (c - u) = 2c - u = (1.5, 4, 7, 12); unbiased stds
  std::vector<double> o = {1.5, 4, 7, 12}, cv = {1, 2, 4, 7};
  auto sd = [](const std::vector<double>& v) {
    double m = 0;
    for (double e : v) m += e / v.size();
    double ss = 0;
    for (double e : v) ss += (e - m) * (e - m);
    return std::sqrt(ss / (v.size() - 1));
  };
  double ratio = sd(cv) / sd(o);
  auto out = apply_cfg(c, u, at::zeros({1}, kF64), cfg);
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(out[0][i].item<double>(), 0.7 * o[i] * ratio + 0.3 * o[i], 1e-12) << i;
  CFG bad;
  bad.start = 0.8;
  bad.stop = 0.2;
  EXPECT_NE(error_of([&] { validate(bad); }).find("start <= stop"), std::string::npos);
}

TEST(Guidance, GuidedDenoiserShiftsTheEpsilonReadBack) {
  // Through the process: for epsilon prediction, x0 = (x - sigma F)/alpha, so guidance that adds
  // (s - 1) * offset to F moves x0 by -(sigma/alpha) (s - 1) offset.
  auto s = vp_cosine();
  Preset p{"test", s, s, make_transform("epsilon"), weightings().build("schedule", json::object()), {}};
  DiffusionProcess proc(p);
  RawFn doubled = [](const Tensor& x, const Tensor&) {
    auto half = x.size(0) / 2;
    return at::cat({x.slice(0, 0, half) * 0 + 0.1, x.slice(0, half) * 0});
  };
  CFG cfg;
  cfg.scale = 4.0;
  auto den = proc.denoiser(guided(doubled, cfg, s->t_max()));
  auto x = at::randn({2, 1, 2, 2}, kF64);
  const double t = 500;
  auto [a, sg] = s->rates_at(t);
  auto x0 = denoise_at(den, x, t).x0;
  EXPECT_LT((x0 - (x - sg * 4.0 * 0.1) / a).abs().max().item<double>(), 1e-9);
}

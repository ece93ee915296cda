// diffusers schedulers (dew/sampling/schedulers.h) against the real diffusers classes (0.42.1, requirements.txt)
// (tests/golden/schedulers_reference.py), and the beta schedules SD needs (dew/diffusion/schedules.h).
#include <gtest/gtest.h>

#include <cmath>
#include <optional>
#include <vector>

#include "dew/sampling/schedulers.h"
#include "tests/golden_util.h"
#include "tests/test_util.h"

using namespace dew;
using namespace dew::sampling;
using dew::diffusion::DiscreteOptions;
using dew::test::error_of;

namespace {

using dew::test::kF64;

std::string golden_dir() { return std::string(DEW_SOURCE_DIR) + "/tests/golden/schedulers/"; }

// The stand-in model of the golden script: 0.3 x + 0.1 sin(t/100) in float64, cast to x's dtype.
Tensor model(const Tensor& x, double t) {
  return (0.3 * x.to(at::kDouble) + 0.1 * std::sin(t / 100)).to(x.scalar_type());
}

// diffusers' StableDiffusionPipeline loop without guidance; returns x after every step [N, ...].
Tensor trajectory(Scheduler& s, int64_t n, const Tensor& z, const Tensor& noise, at::ScalarType dtype) {
  s.set_timesteps(n);
  NoiseSource replay = [&](int64_t i, const Tensor& like) { return noise[i].to(like.scalar_type()); };
  Tensor x = z.to(dtype) * s.init_noise_sigma();
  std::vector<Tensor> xs;
  for (int64_t i = 0; i < s.num_steps(); ++i) {
    auto in = s.scale_model_input(x, i);
    x = s.step(model(in, s.timestep(i)), i, x, replay);
    EXPECT_EQ(x.scalar_type(), dtype);
    xs.push_back(x);
  }
  return at::stack(xs);
}

struct Case {
  std::string name;
  double eta = 0;
};

std::vector<Case> cases() {
  return {{"ddim_sd15"},
          {"ddim_eta_clip", 1.0},
          {"ddim_zsnr_v"},
          {"ddim_sample_linear"},
          {"pndm_sd15"},
          {"pndm_prk_v"},
          {"euler_sdxl"},
          {"euler_karras"},
          {"euler_zsnr_v_trailing"},
          {"euler_log_linear_sigma_min"},
          {"euler_continuous_v"},
          {"euler_a_sd"},
          {"euler_a_v_linear"},
          {"lms_sd"},
          {"lms_karras"},
          {"dpmpp_2m"},
          {"dpmpp_2m_karras"},
          {"dpmpp_2m_sde_karras"},
          {"dpmpp_3m_heun_v_leading"},
          {"dpmpp_2m_zsnr_trailing_sample"}};
}

class MatchesDiffusers : public ::testing::TestWithParam<Case> {};

SchedulerPtr from_json(const json& j) { return Scheduler::from_config(j, "scheduler_config.json"); }

}  // namespace

// Timesteps, init_noise_sigma and a whole trajectory (recorded noise) for 5 and 10 steps.
TEST_P(MatchesDiffusers, Golden) {
  const auto& c = GetParam();
  auto g = test::golden("schedulers/" + c.name + ".safetensors");
  auto s = Scheduler::from_file(golden_dir() + c.name + ".json");
  s->set_eta(c.eta);
  for (int64_t n : {5, 10}) {
    const std::string p = "n" + std::to_string(n) + ".";
    s->set_timesteps(n);
    const auto ts = s->timesteps();
    const auto& t32 = g.at(p + "timesteps_f32");
    const auto& t64 = g.at(p + "timesteps_f64");
    ASSERT_EQ(ts.sizes(), t64.sizes()) << c.name << " n " << n;
    if (at::equal(t64, t64.round())) {  // integer timesteps: exactly diffusers'
      EXPECT_TRUE(at::equal(ts, t64)) << c.name << " n " << n << ": " << ts << " vs " << t64;
      EXPECT_TRUE(at::equal(ts.to(at::kFloat).to(at::kDouble), t32)) << c.name << " n " << n;
    } else {  // Karras sigmas / continuous time: interpolated, float64 against float64
      const double d64 = (ts - t64).abs().max().item<double>(), d32 = (ts - t32).abs().max().item<double>();
      std::printf("  %-40s fractional timesteps: max |diff| %.3e (f64), %.3e (diffusers f32)\n",
                  (c.name + " n" + std::to_string(n)).c_str(), d64, d32);
      EXPECT_LE(d64, 1e-9 * std::max(1.0, t64.abs().max().item<double>())) << c.name;
      EXPECT_LE(d32, 1e-3 * std::max(1.0, t64.abs().max().item<double>())) << c.name;
    }
    const double sig64 = g.at(p + "init_noise_sigma_f64").item<double>();
    EXPECT_NEAR(s->init_noise_sigma(), sig64, 1e-12 * std::max(1.0, sig64)) << c.name;

    const auto& noise = g.at(p + "noise");
    auto ours32 = trajectory(*s, n, g.at("z"), noise, at::kFloat);
    auto ours64 = trajectory(*s, n, g.at("z"), noise, at::kDouble);
    const auto &x32 = g.at(p + "x_f32"), &x64 = g.at(p + "x_f64");
    test::expect_golden(c.name + " n" + std::to_string(n) + " trajectory", ours32, x32, x64);
    test::expect_golden(c.name + " n" + std::to_string(n) + " x_0", ours32[-1], x32[-1], x64[-1]);
    test::expect_close_f64(c.name + " n" + std::to_string(n) + " trajectory", ours64, x64, 1e-10);
  }
}

INSTANTIATE_TEST_SUITE_P(Schedulers, MatchesDiffusers, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<Case>& i) { return i.param.name; });

// ---- FlowMatchEulerDiscreteScheduler (tests/golden/flow_scheduler_reference.py) ----

namespace {

// The loop of StableDiffusion3Pipeline / FluxPipeline without guidance, from z; x after every step [N, ...].
Tensor flow_trajectory(FlowMatchEulerScheduler& s, const Tensor& z, at::ScalarType dtype) {
  Tensor x = z.to(dtype);
  std::vector<Tensor> xs;
  for (int64_t i = 0; i < s.num_steps(); ++i) {
    x = s.step(model(x, s.timestep(i)), i, x, {});
    EXPECT_EQ(x.scalar_type(), dtype);
    xs.push_back(x);
  }
  return at::stack(xs);
}

class FlowMatchesDiffusers : public ::testing::TestWithParam<std::string> {};

}  // namespace

// Sigmas, timesteps, mu (the pipelines' calculate_shift) and a trajectory for 4 and 9 steps, with the sigmas and
// mu the pipelines pass.
TEST_P(FlowMatchesDiffusers, Golden) {
  const std::string name = "flow_" + GetParam();
  auto g = test::golden("schedulers/" + name + ".safetensors");
  auto base = Scheduler::from_file(golden_dir() + name + ".json");
  auto* s = dynamic_cast<FlowMatchEulerScheduler*>(base.get());
  ASSERT_NE(s, nullptr) << name;
  EXPECT_EQ(s->class_name(), "FlowMatchEulerDiscreteScheduler");
  for (int64_t n : {4, 9}) {
    const std::string p = "n" + std::to_string(n) + ".", what = name + " n" + std::to_string(n);
    const double mu_ref = g.at(p + "mu").item<double>();
    std::optional<double> mu;
    if (!std::isnan(mu_ref)) {
      mu = s->mu_for(1024);  // the golden's image sequence length
      EXPECT_EQ(*mu, mu_ref) << what << ": calculate_shift";
    }
    std::vector<double> sigmas_in;
    const auto si = g.at(p + "sigmas_in");
    for (int64_t i = 0; i < si.size(0); ++i) sigmas_in.push_back(si[i].item<double>());
    s->set_timesteps(n, sigmas_in, mu);
    ASSERT_EQ(s->num_steps(), n) << what;
    // float64 against diffusers' float64 run; diffusers' float32 values within float32 rounding
    test::expect_close_f64(what + " sigmas", s->sigmas(), g.at(p + "sigmas_f64"), 1e-14);
    test::expect_close_f64(what + " timesteps", s->timesteps(), g.at(p + "timesteps_f64"), 1e-14);
    EXPECT_LE(test::max_diff(s->sigmas(), g.at(p + "sigmas_f32")), 1e-6) << what;
    EXPECT_EQ(s->init_noise_sigma(), 1.0);

    auto ours32 = flow_trajectory(*s, g.at("z"), at::kFloat);
    auto ours64 = flow_trajectory(*s, g.at("z"), at::kDouble);
    const auto &x32 = g.at(p + "x_f32"), &x64 = g.at(p + "x_f64");
    test::expect_golden(what + " trajectory", ours32, x32, x64);
    test::expect_golden(what + " x_0", ours32[-1], x32[-1], x64[-1]);
    test::expect_close_f64(what + " trajectory", ours64, x64, 1e-12);
  }
}

INSTANTIATE_TEST_SUITE_P(Schedulers, FlowMatchesDiffusers,
                         ::testing::Values("sd3", "sd3_dynamic", "flux_schnell", "flux_dev", "linear_terminal"));

TEST(Schedulers, FlowMatchRefusesUnsupportedSettingsByName) {
  auto msg = [](json j) {
    j["_class_name"] = "FlowMatchEulerDiscreteScheduler";
    return error_of([&] { from_json(j); });
  };
  auto expect_names = [](const std::string& m, std::initializer_list<const char*> parts) {
    EXPECT_FALSE(m.empty());
    for (const char* p : parts) EXPECT_NE(m.find(p), std::string::npos) << "\"" << p << "\" not in: " << m;
  };
  expect_names(msg({{"use_karras_sigmas", true}}), {"scheduler_config.json", "use_karras_sigmas"});
  expect_names(msg({{"invert_sigmas", true}}), {"invert_sigmas"});
  expect_names(msg({{"stochastic_sampling", true}}), {"stochastic_sampling"});
  expect_names(msg({{"time_shift_type", "cosine"}}), {"time_shift_type", "cosine", "exponential, linear"});
  expect_names(msg({{"shift_terminal", 1.5}}), {"shift_terminal", "1.5"});
  expect_names(msg({{"shift", -1.0}}), {"shift", "-1"});
  // dynamic shifting needs mu; sigmas must be one per step
  auto dyn = from_json({{"_class_name", "FlowMatchEulerDiscreteScheduler"}, {"use_dynamic_shifting", true}});
  expect_names(error_of([&] { dyn->set_timesteps(4); }), {"use_dynamic_shifting", "mu"});
  auto* flow = dynamic_cast<FlowMatchEulerScheduler*>(dyn.get());
  ASSERT_NE(flow, nullptr);
  expect_names(error_of([&] { flow->set_timesteps(4, {1.0, 0.5}, 0.5); }), {"2 sigmas", "4 steps"});
  // shift_terminal with one step from sigma 1: nothing to stretch (diffusers gives NaN sigmas; fuzz finding 25)
  auto terminal = from_json({{"_class_name", "FlowMatchEulerDiscreteScheduler"}, {"shift_terminal", 0.02}});
  expect_names(error_of([&] { terminal->set_timesteps(1); }), {"shift_terminal", "0.02", "1 step", "at least 2"});
  terminal->set_timesteps(2);
  auto* t = dynamic_cast<FlowMatchEulerScheduler*>(terminal.get());
  EXPECT_NEAR(t->sigma(1), 0.02, 1e-12);  // two steps stretch as diffusers does: the last sigma is shift_terminal
  // SD3's pipeline falls back to max_shift 1.16 when the config has none, Flux's to 1.15
  auto bare = from_json({{"_class_name", "FlowMatchEulerDiscreteScheduler"}});
  auto* b = dynamic_cast<FlowMatchEulerScheduler*>(bare.get());
  EXPECT_NEAR(b->mu_for(4096, 1.16), 1.16, 1e-12);
  EXPECT_NEAR(b->mu_for(256), 0.5, 1e-12);
  EXPECT_NEAR(calculate_shift(4096, 256, 4096, 0.5, 1.15), 1.15, 1e-12);
}

// ---- the beta schedules ----

TEST(Schedules, ScaledLinearBetasClosedForm) {
  auto s = diffusion::make_scaled_linear();
  auto ab = diffusion::alphas_cumprod(*s);
  ASSERT_EQ(ab.size(0), 1000);
  // beta_i = (sqrt(0.00085) + i (sqrt(0.012) - sqrt(0.00085))/999)^2, recovered from alphabar.
  auto beta = 1.0 - ab / at::cat({at::ones({1}, kF64), ab.slice(0, 0, -1)});
  double worst = 0;
  for (int64_t i = 0; i < 1000; ++i) {
    const double r = std::sqrt(0.00085) + double(i) * (std::sqrt(0.012) - std::sqrt(0.00085)) / 999;
    worst = std::max(worst, std::abs(beta[i].item<double>() - r * r) / (r * r));
  }
  std::printf("  scaled_linear betas: max relative |diff| from the closed form %.3e\n", worst);
  EXPECT_LT(worst, 1e-10);
  EXPECT_NEAR(beta[0].item<double>(), 0.00085, 1e-15);
  EXPECT_NEAR(beta[-1].item<double>(), 0.012, 1e-15);

  auto g = test::golden("schedulers/betas.safetensors");
  test::expect_close_f64("scaled_linear alphas_cumprod", ab, g.at("scaled_linear_f64"), 1e-13);
  test::expect_golden("scaled_linear alphas_cumprod", ab, g.at("scaled_linear_f32"), g.at("scaled_linear_f64"));
  DiscreteOptions lin;
  lin.beta_range = std::make_pair(1e-4, 0.02);
  test::expect_close_f64("linear (1e-4, 0.02) alphas_cumprod", diffusion::alphas_cumprod(*diffusion::make_linear(lin)),
                         g.at("linear_f64"), 1e-13);
  // dew's default linear is diffusers' linear at T = 1000
  test::expect_close_f64("linear default alphas_cumprod", diffusion::alphas_cumprod(*diffusion::make_linear()),
                         g.at("linear_f64"), 1e-13);
  test::expect_close_f64("squaredcos_cap_v2 = dew cosine", diffusion::alphas_cumprod(*diffusion::make_cosine()),
                         g.at("squaredcos_cap_v2_f64"), 1e-12);
}

TEST(Schedules, ZeroTerminalSnrRescale) {
  DiscreteOptions o;
  o.rescale_zero_snr = true;
  auto plain = diffusion::alphas_cumprod(*diffusion::make_scaled_linear());
  auto ab = diffusion::alphas_cumprod(*diffusion::make_scaled_linear(o));
  EXPECT_EQ(ab[-1].item<double>(), 0.0);
  EXPECT_NEAR(ab[0].item<double>(), plain[0].item<double>(), 1e-15);
  EXPECT_LT((ab.slice(0, 1) - ab.slice(0, 0, -1)).max().item<double>(), 0.0);  // still decreasing
  auto g = test::golden("schedulers/betas.safetensors");
  test::expect_close_f64("zero-SNR scaled_linear alphas_cumprod", ab, g.at("scaled_linear_zsnr_f64"), 1e-12);
  // sqrt(alphabar) is an affine map of the original's
  auto a = plain.sqrt(), b = ab.sqrt();
  const double a0 = a[0].item<double>(), aT = a[-1].item<double>();
  EXPECT_LT(((a - aT) * (a0 / (a0 - aT)) - b).abs().max().item<double>(), 1e-14);

  // registered like the other schedules
  auto r = diffusion::schedules().build("scaled_linear", json{{"rescale_zero_snr", true}});
  EXPECT_EQ(diffusion::alphas_cumprod(*r)[-1].item<double>(), 0.0);
  EXPECT_EQ(r->spec()["name"], "scaled_linear");
  auto c = diffusion::schedules().build("cosine", json{{"rescale_zero_snr", true}});
  EXPECT_EQ(diffusion::alphas_cumprod(*c)[-1].item<double>(), 0.0);
  EXPECT_NE(error_of([] {
              diffusion::schedules().build("cosine", json{{"beta_range", {1e-4, 0.02}}});
            }).find("beta_range"),
            std::string::npos);
  EXPECT_NE(error_of([] {
              diffusion::schedules().build("linear", json{{"beta_range", {0.02, 1e-4}}});
            }).find("beta_start <= beta_end"),
            std::string::npos);

  // The schedulers: DDIM keeps alphabar_T = 0; Euler, Euler ancestral and DPM-Solver use 2^-24, as diffusers.
  for (const char* cls :
       {"DDIMScheduler", "EulerDiscreteScheduler", "EulerAncestralDiscreteScheduler", "DPMSolverMultistepScheduler"}) {
    auto s = from_json({{"_class_name", cls},
                        {"beta_schedule", "scaled_linear"},
                        {"beta_start", 0.00085},
                        {"beta_end", 0.012},
                        {"rescale_betas_zero_snr", true}});
    const double last = s->alphas_cumprod()[-1].item<double>();
    EXPECT_EQ(last, std::string(cls) == "DDIMScheduler" ? 0.0 : std::ldexp(1.0, -24)) << cls;
    EXPECT_EQ(diffusion::alphas_cumprod(*s->schedule())[-1].item<double>(), 0.0) << cls;
  }
}

// ---- configs ----

TEST(Schedulers, RefusesUnsupportedSettingsByName) {
  auto msg = [](json j) { return error_of([&] { from_json(j); }); };
  auto expect_names = [](const std::string& m, std::initializer_list<const char*> parts) {
    EXPECT_FALSE(m.empty());
    for (const char* p : parts) EXPECT_NE(m.find(p), std::string::npos) << "\"" << p << "\" not in: " << m;
  };
  expect_names(msg({{"_class_name", "HeunDiscreteScheduler"}}),
               {"scheduler_config.json", "_class_name", "HeunDiscreteScheduler", "EulerDiscreteScheduler"});
  expect_names(msg({{"beta_start", 0.1}}), {"scheduler_config.json", "_class_name is missing", "DDIMScheduler"});
  expect_names(msg({{"_class_name", "DDIMScheduler"}, {"beta_schedule", "sigmoid"}}),
               {"scheduler_config.json", "beta_schedule", "sigmoid", "scaled_linear", "squaredcos_cap_v2"});
  expect_names(msg({{"_class_name", "EulerDiscreteScheduler"}, {"prediction_type", "flow_prediction"}}),
               {"prediction_type", "flow_prediction", "v_prediction"});
  expect_names(msg({{"_class_name", "EulerAncestralDiscreteScheduler"}, {"prediction_type", "sample"}}),
               {"prediction_type", "sample", "EulerAncestralDiscreteScheduler", "epsilon, v_prediction"});
  expect_names(msg({{"_class_name", "PNDMScheduler"}, {"timestep_spacing", "karras"}}),
               {"timestep_spacing", "karras", "leading, trailing, linspace"});
  expect_names(msg({{"_class_name", "DDIMScheduler"}, {"thresholding", true}}), {"thresholding", "true", "false"});
  expect_names(msg({{"_class_name", "DPMSolverMultistepScheduler"}, {"thresholding", true}}), {"thresholding"});
  expect_names(msg({{"_class_name", "DPMSolverMultistepScheduler"}, {"algorithm_type", "dpmsolver"}}),
               {"algorithm_type", "dpmsolver", "dpmsolver++, sde-dpmsolver++"});
  expect_names(msg({{"_class_name", "DPMSolverMultistepScheduler"}, {"solver_order", 4}}), {"solver_order", "4"});
  expect_names(msg({{"_class_name", "DPMSolverMultistepScheduler"}, {"variance_type", "learned_range"}}),
               {"variance_type", "learned_range"});
  expect_names(msg({{"_class_name", "EulerDiscreteScheduler"}, {"use_exponential_sigmas", true}}),
               {"use_exponential_sigmas", "use_karras_sigmas"});
  expect_names(msg({{"_class_name", "EulerDiscreteScheduler"}, {"final_sigmas_type", "one"}}),
               {"final_sigmas_type", "zero, sigma_min"});
  expect_names(msg({{"_class_name", "DDIMScheduler"}, {"trained_betas", {0.1, 0.2}}}), {"trained_betas", "1000"});
  expect_names(msg({{"_class_name", "DDIMScheduler"}, {"steps_offset", "one"}}), {"steps_offset", "integer"});
  expect_names(msg({{"_class_name", "DDIMScheduler"}, {"beta_start", 0.5}, {"beta_end", 0.1}}),
               {"beta_start", "beta_end"});
  expect_names(error_of([] { Scheduler::from_file("/nonexistent/scheduler_config.json"); }),
               {"/nonexistent/scheduler_config.json"});
  // steps beyond the training steps, steps out of order, eta outside DDIM
  auto ddim = from_json({{"_class_name", "DDIMScheduler"}, {"steps_offset", 1}});
  expect_names(error_of([&] { ddim->set_timesteps(1001); }), {"1001", "num_train_timesteps"});
  expect_names(error_of([&] { ddim->set_timesteps(1000); }), {"steps_offset", "outside"});
  // zero terminal SNR with an epsilon prediction: no sample at alphabar 0 (diffusers divides by zero; finding 26)
  auto zsnr = from_json({{"_class_name", "DDIMScheduler"},
                         {"rescale_betas_zero_snr", true},
                         {"timestep_spacing", "trailing"},
                         {"prediction_type", "epsilon"}});
  expect_names(error_of([&] { zsnr->set_timesteps(10); }), {"timestep 999", "alphas_cumprod 0", "epsilon"});
  auto zsnr_v = from_json({{"_class_name", "DDIMScheduler"},
                           {"rescale_betas_zero_snr", true},
                           {"timestep_spacing", "trailing"},
                           {"prediction_type", "v_prediction"}});
  // betas whose product underflows: an infinite sigma for the k-diffusion family (finding 27)
  auto underflow = from_json({{"_class_name", "EulerDiscreteScheduler"},
                              {"beta_end", 0.812},
                              {"num_train_timesteps", 2000},
                              {"interpolation_type", "log_linear"}});
  expect_names(error_of([&] { underflow->set_timesteps(4); }), {"sigma", "inf", "alphas_cumprod reach 0", "beta_end"});
  // more steps than the train steps' spacing holds: a repeated timestep (the multistep update divides by zero)
  auto few = from_json({{"_class_name", "DPMSolverMultistepScheduler"},
                        {"num_train_timesteps", 2},
                        {"timestep_spacing", "leading"},
                        {"steps_offset", 1}});
  expect_names(error_of([&] { few->set_timesteps(2); }), {"timestep 1 twice", "fewer steps"});
  zsnr_v->set_timesteps(10);  // the v prediction is defined there
  EXPECT_TRUE(
      zsnr_v->step(at::zeros({1, 1, 2, 2}), 0, at::ones({1, 1, 2, 2}), seeded_noise(0)).isfinite().all().item<bool>());
  auto dpm = from_json({{"_class_name", "DPMSolverMultistepScheduler"}});
  dpm->set_timesteps(5);
  auto x = at::zeros({1, 4, 2, 2});
  expect_names(error_of([&] { dpm->step(x, 1, x, seeded_noise(0)); }), {"in order", "expected step 0"});
  expect_names(error_of([&] { dpm->set_eta(0.5); }), {"eta", "DDIMScheduler"});
  expect_names(error_of([&] { dpm->step(x, 5, x, seeded_noise(0)); }), {"step index 5"});
}

TEST(Schedulers, IgnoresKeysTheClassDoesNotTake) {
  // SD 1.5's scheduler_config.json (PNDM) carries DDIM's clip_sample; diffusers ignores keys a class does not
  // take, and so does dew (here even a setting that would change the maths of another class).
  json sd15 = {{"_class_name", "PNDMScheduler"},   {"_diffusers_version", "0.6.0"}, {"beta_end", 0.012},
               {"beta_schedule", "scaled_linear"}, {"beta_start", 0.00085},         {"num_train_timesteps", 1000},
               {"set_alpha_to_one", false},        {"skip_prk_steps", true},        {"steps_offset", 1},
               {"trained_betas", nullptr},         {"clip_sample", false}};
  json extra = sd15;
  extra["rescale_betas_zero_snr"] = true;
  extra["use_karras_sigmas"] = true;
  auto a = from_json(sd15), b = from_json(extra);
  a->set_timesteps(10);
  b->set_timesteps(10);
  EXPECT_TRUE(at::equal(a->timesteps(), b->timesteps()));
  EXPECT_TRUE(at::equal(a->alphas_cumprod(), b->alphas_cumprod()));
  EXPECT_EQ(a->num_steps(), 11);  // PLMS without warm-up repeats the second timestep
  EXPECT_EQ(a->timestep(0), 901);
  EXPECT_EQ(a->timestep(1), 801);
  EXPECT_EQ(a->timestep(2), 801);
  EXPECT_EQ(a->schedule()->spec()["name"], "scaled_linear");
}

TEST(Schedulers, TrainedBetasEqualTheNamedSchedule) {
  auto named = from_json({{"_class_name", "EulerDiscreteScheduler"},
                          {"beta_schedule", "scaled_linear"},
                          {"beta_start", 0.00085},
                          {"beta_end", 0.012}});
  auto ab = named->alphas_cumprod();
  auto beta = 1.0 - ab / at::cat({at::ones({1}, kF64), ab.slice(0, 0, -1)});
  std::vector<double> list(beta.data_ptr<double>(), beta.data_ptr<double>() + beta.numel());
  auto trained = from_json({{"_class_name", "EulerDiscreteScheduler"}, {"trained_betas", list}});
  EXPECT_LT((trained->alphas_cumprod() - ab).abs().max().item<double>(), 1e-15);
  named->set_timesteps(7);
  trained->set_timesteps(7);
  EXPECT_TRUE(at::equal(named->timesteps(), trained->timesteps()));
  EXPECT_NEAR(named->init_noise_sigma(), trained->init_noise_sigma(), 1e-12);
}

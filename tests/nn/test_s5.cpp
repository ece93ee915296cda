// The S5 mixer: the parallel scan against the step-by-step recurrence and against complex arithmetic
// done by hand, the HiPPO initialisation, the bidirectional composition and the 2D state fusion.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <complex>
#include <map>

#include "dew/nn/s5.h"
#include "dew/nn/scan.h"
#include "tests/nn/backbone_checks.h"
#include "tests/test_util.h"

namespace {

using at::Tensor;
using dew::test::error_of;
using dew::test::max_diff;
using cd = std::complex<double>;

// Random stable log a = A dt (negative real part) and inputs b, in `dtype`.
struct ScanCase {
  Tensor lr, li, br, bi;
};
ScanCase scan_case(int64_t B, int64_t L, int64_t N, at::ScalarType dtype, uint64_t seed) {
  torch::manual_seed(seed);
  auto o = at::TensorOptions(dtype);
  return {-torch::rand({N}, o) * 0.5 - 0.01, torch::randn({N}, o), torch::randn({B, L, N}, o),
          torch::randn({B, L, N}, o)};
}

TEST(S5, ParallelScanEqualsTheRecurrenceForAnyLength) {
  for (int64_t L : {1, 2, 5, 13, 16, 33, 100}) {
    auto c = scan_case(2, L, 6, at::kDouble, 10 + L);
    auto [pr, pi] = dew::nn::s5_scan(c.lr, c.li, c.br, c.bi);
    auto [rr, ri] = dew::nn::s5_scan_reference(c.lr, c.li, c.br, c.bi);
    ASSERT_EQ(pr.sizes(), c.br.sizes());
    EXPECT_LT(max_diff(pr, rr), 1e-10) << "L = " << L;
    EXPECT_LT(max_diff(pi, ri), 1e-10) << "L = " << L;
  }
}

TEST(S5, ScanMatchesComplexArithmeticByHand) {
  // x_k = sum_j a^j b_{k-j} with std::complex, written out independently of both scans.
  auto c = scan_case(1, 7, 3, at::kDouble, 3);
  auto [pr, pi] = dew::nn::s5_scan(c.lr, c.li, c.br, c.bi);
  for (int64_t n = 0; n < 3; ++n) {
    const cd a = std::exp(cd(c.lr[n].item<double>(), c.li[n].item<double>()));
    for (int64_t k = 0; k < 7; ++k) {
      cd x = 0;
      for (int64_t j = 0; j <= k; ++j)
        x += std::pow(a, static_cast<double>(j)) *
             cd(c.br[0][k - j][n].item<double>(), c.bi[0][k - j][n].item<double>());
      EXPECT_NEAR(pr[0][k][n].item<double>(), x.real(), 1e-12);
      EXPECT_NEAR(pi[0][k][n].item<double>(), x.imag(), 1e-12);
    }
  }
}

// The fused float32 recurrence (forward and hand-written backward) against float64 truth: the step-by-step
// recurrence of ATen ops in double, differentiated by autograd. The float32 composite's own error is the
// yardstick (the golden rule: rms(fused - truth) <= 2 rms(composite_f32 - truth)), per output and gradient.
TEST(S5, FusedRecurrenceAndItsGradientsAgainstFloat64) {
  auto c = scan_case(3, 49, 64, at::kDouble, 21);
  const Tensor wr = torch::randn({3, 49, 64}, at::kDouble), wi = torch::randn({3, 49, 64}, at::kDouble);
  // Outputs and the gradients of sum(w_re x_re + w_im x_im) with respect to log_a and b.
  auto run = [&](bool fused, at::ScalarType dt) {
    std::vector<Tensor> in;  // fresh leaves in dt
    for (const auto& t : {c.lr, c.li, c.br, c.bi}) in.push_back(t.to(dt).detach().clone().requires_grad_());
    auto [xr, xi] =
        fused ? dew::nn::s5_scan(in[0], in[1], in[2], in[3]) : dew::nn::s5_scan_reference(in[0], in[1], in[2], in[3]);
    (xr * wr.to(dt) + xi * wi.to(dt)).sum().backward();
    std::vector<Tensor> out{xr.detach().to(at::kDouble), xi.detach().to(at::kDouble)};
    for (auto& t : in) out.push_back(t.grad().to(at::kDouble));
    return out;
  };
  const auto truth = run(false, at::kDouble), composite = run(false, at::kFloat), fused = run(true, at::kFloat);
  const char* names[] = {"x_re", "x_im", "d log_a_re", "d log_a_im", "d b_re", "d b_im"};
  auto rms = [](const Tensor& t) { return t.pow(2).mean().sqrt().item<double>(); };
  for (size_t i = 0; i < truth.size(); ++i) {
    const double e_fused = rms(fused[i] - truth[i]), e_comp = rms(composite[i] - truth[i]);
    std::cout << "[ S5 fused " << names[i] << " ] rms error " << e_fused << " (float32 composite " << e_comp
              << "), max |fused - truth| " << max_diff(fused[i], truth[i]) << "\n";
    EXPECT_LE(e_fused, 2 * e_comp + 1e-12 * rms(truth[i])) << names[i];
    EXPECT_LT(max_diff(fused[i], truth[i]), 1e-3 * (1 + truth[i].abs().max().item<double>())) << names[i];
  }
}

TEST(S5, FusedRecurrenceHasTheSameBitsAtAnyThreadCountAndSupportsDoubleBackward) {
  auto c = scan_case(5, 17, 8, at::kFloat, 22);
  const int threads = at::get_num_threads();
  std::vector<std::vector<Tensor>> runs;
  for (int t : {1, 2, 3}) {
    at::set_num_threads(t);
    std::vector<Tensor> in{c.lr.clone(), c.li.clone(), c.br.clone(), c.bi.clone()};
    for (auto& x : in) x.requires_grad_();
    auto [xr, xi] = dew::nn::s5_scan(in[0], in[1], in[2], in[3]);
    (xr * xr + 3 * xi).sum().backward();
    runs.push_back({xr.detach(), xi.detach(), in[0].grad(), in[1].grad(), in[2].grad(), in[3].grad()});
  }
  at::set_num_threads(threads);
  for (size_t r = 1; r < runs.size(); ++r)
    for (size_t i = 0; i < runs[0].size(); ++i) EXPECT_TRUE(torch::equal(runs[0][i], runs[r][i])) << r << " " << i;

  // A create_graph backward differentiates again: d/d b_re of (d loss / d log_a_re) . v against double.
  auto second = [&](bool fused, at::ScalarType dt) {
    Tensor lr = c.lr.to(dt).detach().clone().requires_grad_(), br = c.br.to(dt).detach().clone().requires_grad_();
    auto [xr, xi] = fused ? dew::nn::s5_scan(lr, c.li.to(dt), br, c.bi.to(dt))
                          : dew::nn::s5_scan_reference(lr, c.li.to(dt), br, c.bi.to(dt));
    const Tensor g = torch::autograd::grad({(xr * xr + xi).sum()}, {lr}, {}, true, true)[0];
    return torch::autograd::grad({g.sum()}, {br})[0].to(at::kDouble);
  };
  const Tensor truth = second(false, at::kDouble);
  EXPECT_LT(max_diff(second(true, at::kFloat), truth), 1e-4 * (1 + truth.abs().max().item<double>()));
}

// A layer whose steps dt are large enough that the state decays and rotates visibly over the sequence.
dew::nn::S5Layer make_layer(int64_t D, int64_t N, uint64_t seed) {
  torch::manual_seed(seed);
  dew::nn::S5Layer layer(dew::nn::S5Options(D, N).dt_min(0.01).dt_max(0.5));
  return layer;
}

TEST(S5, LayerParallelScanEqualsStepByStepRecurrenceWithGradients) {
  for (int64_t L : {13, 16}) {  // not a power of two, and one
    auto layer = make_layer(8, 6, 1);
    torch::manual_seed(2);
    Tensor u = torch::randn({2, L, 8}), w = torch::randn({2, L, 8});
    Tensor u1 = u.clone().requires_grad_(), u2 = u.clone().requires_grad_();
    Tensor y1 = layer->forward(u1);
    (y1 * w).sum().backward();
    std::vector<Tensor> g1{u1.grad().clone()};
    for (const auto& p : layer->parameters()) g1.push_back(p.grad().clone());
    layer->zero_grad();
    Tensor y2 = layer->forward_reference(u2);
    (y2 * w).sum().backward();
    std::vector<Tensor> g2{u2.grad().clone()};
    for (const auto& p : layer->parameters()) g2.push_back(p.grad().clone());

    const double scale = 1 + y2.abs().max().item<double>();
    std::cout << "[ S5 L=" << L << " ] max |parallel - recurrence| = " << max_diff(y1, y2) << " (scale " << scale
              << ")\n";
    EXPECT_LT(max_diff(y1, y2), 1e-5 * scale) << "L = " << L;
    for (size_t i = 0; i < g1.size(); ++i)
      EXPECT_LT(max_diff(g1[i], g2[i]), 1e-5 * (1 + g2[i].abs().max().item<double>())) << "gradient " << i;
  }
}

TEST(S5, LayerMatchesContinuousSystemComputedWithStdComplex) {
  // From the raw parameters: A = -exp(log_A_real) + i A_imag, dt = exp(log_dt), Abar = exp(A dt),
  // Bbar = (Abar - 1)/A B, x_k = Abar x_{k-1} + Bbar u_k, y_k = Re(C x_k) + D u_k; all in double.
  const int64_t D = 3, N = 4, L = 6;
  auto layer = make_layer(D, N, 4);
  torch::manual_seed(5);
  Tensor u = torch::randn({1, L, D});
  Tensor y = layer->forward(u);
  auto P = [](const Tensor& t) { return t.to(at::kDouble).contiguous(); };
  Tensor lar = P(layer->log_A_real), ai = P(layer->A_imag), ldt = P(layer->log_dt), Br = P(layer->B_re),
         Bi = P(layer->B_im), Cr = P(layer->C_re), Ci = P(layer->C_im), Dd = P(layer->D), ud = P(u);
  std::vector<cd> x(N, 0.0);
  for (int64_t k = 0; k < L; ++k) {
    for (int64_t n = 0; n < N; ++n) {
      const cd A(-std::exp(lar[n].item<double>()), ai[n].item<double>());
      const cd Abar = std::exp(A * std::exp(ldt[n].item<double>()));
      cd bu = 0;
      for (int64_t d = 0; d < D; ++d)
        bu += (Abar - 1.0) / A * cd(Br[n][d].item<double>(), Bi[n][d].item<double>()) * ud[0][k][d].item<double>();
      x[n] = Abar * x[n] + bu;
    }
    for (int64_t d = 0; d < D; ++d) {
      cd s = 0;
      for (int64_t n = 0; n < N; ++n) s += cd(Cr[d][n].item<double>(), Ci[d][n].item<double>()) * x[n];
      const double expect = s.real() + Dd[d].item<double>() * ud[0][k][d].item<double>();
      EXPECT_NEAR(y[0][k][d].item<double>(), expect, 1e-5 * (1 + std::abs(expect))) << "k " << k << " d " << d;
    }
  }
}

TEST(S5, HippoAndParameterInitialisation) {
  torch::manual_seed(0);
  const int64_t D = 512, N = 64;
  dew::nn::S5Layer layer(dew::nn::S5Options(D, N));
  for (int64_t n = 0; n < N; ++n) {
    EXPECT_NEAR(layer->log_A_real[n].item<double>(), std::log(n + 0.5), 1e-6);
    EXPECT_NEAR(layer->A_imag[n].item<double>(), M_PI * n, 1e-4);
  }
  // A = -(n + 1/2) + i pi n
  EXPECT_NEAR(-std::exp(layer->log_A_real[3].item<double>()), -3.5, 1e-5);
  EXPECT_GE(layer->log_dt.min().item<double>(), std::log(1e-3) - 1e-6);
  EXPECT_LE(layer->log_dt.max().item<double>(), std::log(1e-1) + 1e-6);
  EXPECT_GT(layer->log_dt.max().item<double>() - layer->log_dt.min().item<double>(), 2.0);  // spread over the range
  // lecun normal: std 1/sqrt(fan_in) (N for B, D for C), truncated at 2 of the pre-truncation std.
  for (const Tensor& b : {layer->B_re, layer->B_im}) {
    EXPECT_NEAR(b.std().item<double>(), 1 / std::sqrt(double(N)), 0.05 / std::sqrt(double(N)));
    EXPECT_LE(b.abs().max().item<double>(), 2 / std::sqrt(double(N)) / 0.87962566103423978 + 1e-6);
  }
  for (const Tensor& c : {layer->C_re, layer->C_im})
    EXPECT_NEAR(c.std().item<double>(), 1 / std::sqrt(double(D)), 0.05 / std::sqrt(double(D)));
  EXPECT_NEAR(layer->D.std().item<double>(), 1.0, 0.15);  // N(0, 1)
  EXPECT_NEAR(layer->D.mean().item<double>(), 0.0, 0.15);
  for (const auto& kv : layer->named_parameters()) EXPECT_EQ(kv.value().scalar_type(), at::kFloat) << kv.key();
}

TEST(S5, BidirectionalIsForwardAndReversedBackwardThenProjection) {
  torch::manual_seed(6);
  dew::nn::S5 bi(dew::nn::S5Options(6, 4).dt_min(0.05).dt_max(0.5));
  EXPECT_EQ(bi->named_parameters().size(), 2 * 8 + 2u);
  torch::manual_seed(7);
  const int64_t L = 9;
  Tensor u = torch::randn({2, L, 6});
  Tensor y = bi(u);
  ASSERT_EQ(y.sizes(), u.sizes());
  // The backward layer by its own step-by-step recurrence on the reversed sequence (index reversal).
  Tensor rev = torch::arange(L - 1, -1, -1, at::kLong);
  Tensor f = bi->s5_forward->forward_reference(u);
  Tensor b = bi->s5_backward->forward_reference(u.index_select(1, rev)).index_select(1, rev);
  Tensor expect = torch::matmul(torch::cat({f, b}, -1), bi->out_proj->weight.t()) + bi->out_proj->bias;
  EXPECT_LT(max_diff(y, expect), 1e-5);

  // Causality of each half: the forward half at k sees u_{<=k}, the backward half u_{>=k}.
  torch::NoGradGuard no_grad;
  Tensor u2 = u.clone();
  u2.select(1, 4).add_(1.0);
  Tensor df = (bi->s5_forward(u2) - bi->s5_forward(u)).abs().amax({0, 2});  // [L]
  Tensor db = (bi->s5_backward(u2.flip({1})).flip({1}) - bi->s5_backward(u.flip({1})).flip({1})).abs().amax({0, 2});
  for (int64_t k = 0; k < L; ++k) {
    if (k < 4) EXPECT_EQ(df[k].item<double>(), 0.0) << k;
    else EXPECT_GT(df[k].item<double>(), 0.0) << k;
    if (k > 4) EXPECT_EQ(db[k].item<double>(), 0.0) << k;
    else EXPECT_GT(db[k].item<double>(), 0.0) << k;
  }
}

TEST(S5, UnidirectionalHasOnlyTheForwardLayerAndGradientsReachEveryParameter) {
  dew::nn::S5 uni(dew::nn::S5Options(5, 3).bidirectional(false));
  EXPECT_EQ(uni->named_parameters().size(), 8u);
  Tensor u = torch::randn({2, 7, 5});
  EXPECT_LT(max_diff(uni(u), uni->s5_forward->forward_reference(u)), 1e-5);

  dew::nn::S5 bi(dew::nn::S5Options(5, 3));
  Tensor ug = u.clone().requires_grad_();
  Tensor y = bi(ug.to(at::kBFloat16));
  EXPECT_EQ(y.scalar_type(), at::kBFloat16);  // returns the compute dtype, computed in fp32
  (y.to(at::kFloat) * torch::randn({2, 7, 5})).sum().backward();
  for (const auto& kv : bi->named_parameters()) {
    ASSERT_TRUE(kv.value().grad().defined()) << kv.key();
    EXPECT_GT(kv.value().grad().abs().max().item<double>(), 0.0) << kv.key();
  }
}

TEST(S5, SpatialFusionStartsAsIdentityAndConvolvesOnTheTrueGrid) {
  const int64_t h = 4, w = 4, D = 3;
  dew::nn::SpatialFusion fusion(D);
  std::vector<std::string> names;
  for (const auto& kv : fusion->named_parameters()) names.push_back(kv.key());
  EXPECT_EQ(names, (std::vector<std::string>{"dwconv_dil1.weight", "dwconv_dil2.weight", "dwconv_dil3.weight"}));
  auto scan = dew::nn::make_scan("hilbert", h, w);
  Tensor y = torch::randn({2, h * w, D});
  EXPECT_EQ(max_diff(fusion(y, h, w, scan.perm, scan.inverse), y), 0.0);

  // dil1 takes the right neighbour, dil2 the token two rows down: out(r, c) = y(r, c) + y(r, c+1) + y(r+2, c).
  {
    torch::NoGradGuard no_grad;
    fusion->convs[0]->weight.select(2, 1).select(2, 2).fill_(1.0);  // kernel [1][2]: (r, c + 1)
    fusion->convs[1]->weight.select(2, 2).select(2, 1).fill_(1.0);  // kernel [2][1] at dilation 2: (r + 2, c)
  }
  Tensor out = fusion(y, h, w, scan.perm, scan.inverse);
  auto cells = dew::nn::scan_cells("hilbert", h, w);
  std::map<std::pair<int64_t, int64_t>, int64_t> at_cell;
  for (size_t n = 0; n < cells.size(); ++n) at_cell[cells[n]] = static_cast<int64_t>(n);
  for (size_t n = 0; n < cells.size(); ++n) {
    auto [r, c] = cells[n];
    Tensor expect = y.select(1, n).clone();
    if (c + 1 < w) expect += y.select(1, at_cell[{r, c + 1}]);
    if (r + 2 < h) expect += y.select(1, at_cell[{r + 2, c}]);
    EXPECT_LT(max_diff(out.select(1, n), expect), 1e-6) << "token " << n;
  }
  // Raster order needs no permutation.
  Tensor yr = torch::randn({1, h * w, D});
  Tensor outr = fusion(yr, h, w);
  EXPECT_LT(max_diff(outr.select(1, 5), yr.select(1, 5) + yr.select(1, 6) + yr.select(1, 13)), 1e-6);  // (1,1)
}

TEST(S5, BadOptionsAndInputsAreErrors) {
  EXPECT_NE(error_of([] { dew::nn::S5(dew::nn::S5Options(0, 4)); }).find("dim must be > 0"), std::string::npos);
  EXPECT_NE(error_of([] { dew::nn::S5(dew::nn::S5Options(4, 0)); }).find("state_dim must be > 0"), std::string::npos);
  EXPECT_NE(error_of([] { dew::nn::S5(dew::nn::S5Options(4, 2).dt_min(0.2).dt_max(0.1)); }).find("dt_min"),
            std::string::npos);
  dew::nn::S5 s(dew::nn::S5Options(4, 2));
  EXPECT_NE(error_of([&] { s(torch::randn({2, 3, 5})); }).find("u must be [B, L, 4]"), std::string::npos);
  dew::nn::SpatialFusion f(4);
  EXPECT_NE(error_of([&] { f(torch::randn({1, 10, 4}), 3, 3); }).find("3 x 3 grid"), std::string::npos);
}

}  // namespace

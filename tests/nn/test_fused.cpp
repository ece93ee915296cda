// The fused CPU kernels against ATen's own implementations (at::gelu "tanh", at::group_norm + at::silu)
// and hand-derived values, for every instruction-set variant this CPU can run, every layout and the
// awkward sizes (vector tails, one-element spans, a large mean).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <string>
#include <vector>

#include "dew/nn/attention.h"
#include "dew/nn/fused.h"
#include "tests/nn/backbone_checks.h"
#include "tests/nn/isa_util.h"
#include "tests/test_util.h"

namespace {

using at::Tensor;
using dew::test::error_of;
using dew::test::IsaGuard;
using dew::test::max_diff;
using dew::test::runnable_isas;

TEST(Fused, GeluTanhHandValues) {
  // 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) evaluated in double by hand.
  auto ref = [](double x) { return 0.5 * x * (1 + std::tanh(std::sqrt(2 / M_PI) * (x + 0.044715 * x * x * x))); };
  Tensor x = torch::tensor({-30.0f, -5.0f, -1.0f, -1e-3f, 0.0f, 1e-3f, 1.0f, 2.5f, 30.0f});
  Tensor y = dew::nn::gelu_tanh(x);
  for (int64_t i = 0; i < x.numel(); ++i) {
    const double xi = x[i].item<double>();
    EXPECT_NEAR(y[i].item<double>(), ref(xi), 1e-6 * std::max(1.0, std::abs(xi))) << "x = " << xi;
  }
  EXPECT_NEAR(dew::nn::gelu_tanh(torch::ones({1})).item<double>(), 0.8411919906082768, 1e-6);
}

TEST(Fused, GeluTanhMatchesATenForwardAndBackwardOnEveryIsa) {
  IsaGuard guard;
  const auto isas = runnable_isas();
  ASSERT_FALSE(isas.empty());
  for (const auto& isa : isas) {
    dew::nn::set_fused_kernel_isa(isa);
    for (int64_t n : {1, 15, 16, 17, 1000, 70001}) {
      torch::manual_seed(n);
      Tensor x = (torch::randn({n}) * 4).requires_grad_();
      Tensor y = dew::nn::gelu_tanh(x);
      // The oracle: ATen's GELU in float64. Float32 rounding allows a few ulp of the larger of |y|, 1.
      Tensor xr = x.detach().to(at::kDouble).requires_grad_();
      Tensor yr = at::gelu(xr, "tanh");
      EXPECT_LT(max_diff(y.to(at::kDouble), yr), 1e-6 * (1 + yr.abs().max().item<double>())) << isa << " n = " << n;
      Tensor g = torch::randn({n});
      y.backward(g);
      yr.backward(g.to(at::kDouble));
      const double gmax = 1 + xr.grad().abs().max().item<double>();
      EXPECT_LT(max_diff(x.grad().to(at::kDouble), xr.grad()), 2e-6 * gmax) << isa << " n = " << n;
    }
  }
}

TEST(Fused, GeluTanhKeepsLayoutAndFallsBackOffTheFastPath) {
  // A transposed (dense, non-contiguous) input keeps its strides; a strided view is made contiguous.
  torch::manual_seed(3);
  Tensor x = torch::randn({6, 40}).t();
  Tensor y = dew::nn::gelu_tanh(x);
  EXPECT_EQ(y.strides(), x.strides());
  EXPECT_LT(max_diff(y, at::gelu(x, "tanh")), 2e-6);
  Tensor v = torch::randn({8, 40}).slice(1, 0, 40, 3);
  EXPECT_LT(max_diff(dew::nn::gelu_tanh(v), at::gelu(v, "tanh")), 2e-6);
  // float64 is not the kernel's: exactly ATen's result.
  Tensor d = torch::randn({33}, at::kDouble);
  EXPECT_TRUE(torch::equal(dew::nn::gelu_tanh(d), at::gelu(d, "tanh")));
  EXPECT_FALSE(dew::nn::fused_kernels_apply(d));
}

TEST(Fused, GeluTanhSecondOrderGradientIsATens) {
  Tensor x = torch::randn({37}).requires_grad_();
  Tensor xr = x.detach().clone().requires_grad_();
  auto second = [](const Tensor& in, const Tensor& out) {
    Tensor g = torch::autograd::grad({out.sum()}, {in}, {}, true, true)[0];
    return torch::autograd::grad({g.sum()}, {in})[0];
  };
  EXPECT_LT(max_diff(second(x, dew::nn::gelu_tanh(x)), second(xr, at::gelu(xr, "tanh"))), 1e-5);
}

// silu(group_norm(x [+ shift])) and its gradients for x, weight, bias [and shift], against ATen's
// group_norm of the explicit sum.
void expect_group_norm_silu_matches(const Tensor& x0, int64_t groups, const std::string& what, double tol = 2e-5,
                                    bool with_shift = false) {
  const int64_t B = x0.size(0), C = x0.size(1);
  torch::manual_seed(C + groups);
  Tensor w0 = torch::randn({C}) * 0.5 + 1, b0 = torch::randn({C}) * 0.3, s0 = torch::randn({B, C}) * 2;
  Tensor x = x0.detach().clone().requires_grad_(), w = w0.clone().requires_grad_(), b = b0.clone().requires_grad_();
  Tensor xr = x0.detach().clone().requires_grad_(), wr = w0.clone().requires_grad_(), br = b0.clone().requires_grad_();
  Tensor sh = s0.clone().requires_grad_(), shr = s0.clone().requires_grad_();
  Tensor y = dew::nn::group_norm_silu(x, groups, w, b, 1e-5, with_shift ? sh : Tensor());
  std::vector<int64_t> view(static_cast<size_t>(x0.dim()), 1);
  view[0] = B;
  view[1] = C;
  Tensor yr = at::silu(at::group_norm(with_shift ? xr + shr.view(view) : xr, groups, wr, br, 1e-5));
  EXPECT_EQ(y.sizes(), yr.sizes()) << what;
  EXPECT_EQ(y.is_contiguous(at::MemoryFormat::ChannelsLast), x0.is_contiguous(at::MemoryFormat::ChannelsLast)) << what;
  EXPECT_LT(max_diff(y, yr), tol) << what;
  Tensor g = torch::randn(x0.sizes());
  y.backward(g);
  yr.backward(g);
  auto rel = [](const Tensor& a, const Tensor& r) { return max_diff(a, r) / (1.0 + r.abs().max().item<double>()); };
  EXPECT_LT(rel(x.grad(), xr.grad()), tol) << what << ": dx";
  EXPECT_LT(rel(w.grad(), wr.grad()), tol) << what << ": dweight";
  EXPECT_LT(rel(b.grad(), br.grad()), tol) << what << ": dbias";
  if (with_shift) {
    ASSERT_TRUE(sh.grad().defined()) << what;
    EXPECT_LT(rel(sh.grad(), shr.grad()), tol) << what << ": dshift";
  }
}

TEST(Fused, GroupNormSiluMatchesATenOnEveryIsaAndLayout) {
  IsaGuard guard;
  for (const auto& isa : runnable_isas()) {
    dew::nn::set_fused_kernel_isa(isa);
    torch::manual_seed(7);
    // NCHW with spans shorter than, equal to and longer than a vector (with tails).
    expect_group_norm_silu_matches(torch::randn({3, 32, 28, 28}), 8, isa + " NCHW 32ch");
    expect_group_norm_silu_matches(torch::randn({2, 12, 7, 5}), 3, isa + " NCHW odd");
    expect_group_norm_silu_matches(torch::randn({2, 6, 1, 1}), 2, isa + " NCHW 1x1");
    expect_group_norm_silu_matches(torch::randn({2, 8, 16}), 4, isa + " [B, C, L]");
    // Channels last, 4-D and 5-D, with channel counts that are not multiples of 16.
    expect_group_norm_silu_matches(torch::randn({3, 64, 14, 14}).contiguous(at::MemoryFormat::ChannelsLast), 8,
                                   isa + " NHWC 64ch");
    expect_group_norm_silu_matches(torch::randn({2, 24, 5, 3}).contiguous(at::MemoryFormat::ChannelsLast), 6,
                                   isa + " NHWC 24ch");
    expect_group_norm_silu_matches(torch::randn({2, 20, 3, 4, 5}).contiguous(at::MemoryFormat::ChannelsLast3d), 4,
                                   isa + " NDHWC");
    // A non-contiguous input (a channel slice) goes through a contiguous copy.
    expect_group_norm_silu_matches(torch::randn({2, 16, 6, 6}).slice(1, 0, 8), 2, isa + " sliced");
    // With a per-(sample, channel) shift (a ResBlock's time embedding), both layouts, tails included.
    expect_group_norm_silu_matches(torch::randn({3, 32, 28, 28}), 8, isa + " NCHW shift", 2e-5, true);
    expect_group_norm_silu_matches(torch::randn({2, 12, 7, 5}), 3, isa + " NCHW odd shift", 2e-5, true);
    expect_group_norm_silu_matches(torch::randn({3, 64, 14, 14}).contiguous(at::MemoryFormat::ChannelsLast), 8,
                                   isa + " NHWC shift", 2e-5, true);
    expect_group_norm_silu_matches(torch::randn({2, 24, 5, 3}).contiguous(at::MemoryFormat::ChannelsLast), 6,
                                   isa + " NHWC 24ch shift", 2e-5, true);
    // More than one tile of channels (8 vectors = 128) with a tail.
    expect_group_norm_silu_matches(torch::randn({2, 144, 3, 3}).contiguous(at::MemoryFormat::ChannelsLast), 8,
                                   isa + " NHWC 144ch shift", 2e-5, true);
  }
}

TEST(Fused, GroupNormSiluAndInputAddsTheSkipGradientIntoDx) {
  // A residual block's use: y = silu(gn(x + shift)) feeds the branch, the second output feeds the skip
  // path. dx must be the branch's gradient plus the skip path's, for every ISA and layout, also when the
  // skip gradient arrives in the other layout and when only one of the outputs is used.
  IsaGuard guard;
  for (const auto& isa : runnable_isas()) {
    dew::nn::set_fused_kernel_isa(isa);
    for (bool nhwc : {false, true}) {
      for (int use : {0, 1, 2}) {  // 0: both outputs, 1: only y, 2: only the skip output
        torch::manual_seed(17 + use);
        Tensor x0 = torch::randn({2, 24, 5, 7}), w = torch::randn({24}), b = torch::randn({24});
        Tensor s0 = torch::randn({2, 24});
        if (nhwc) x0 = x0.contiguous(at::MemoryFormat::ChannelsLast);
        Tensor gy = torch::randn({2, 24, 5, 7}), gs = torch::randn({2, 24, 5, 7});  // NCHW gradients
        Tensor x = x0.clone().requires_grad_(), sh = s0.clone().requires_grad_();
        auto out = dew::nn::group_norm_silu_and_input(x, 6, w, b, 1e-5, sh);
        EXPECT_TRUE(torch::equal(out[1], x0)) << isa;
        Tensor loss = use == 2   ? (out[1] * gs).sum()
                      : use == 1 ? (out[0] * gy).sum()
                                 : (out[0] * gy + out[1] * gs).sum();
        loss.backward();
        Tensor xr = x0.clone().requires_grad_(), shr = s0.clone().requires_grad_();
        Tensor yr = at::silu(at::group_norm(xr + shr.view({2, 24, 1, 1}), 6, w, b, 1e-5));
        Tensor lr = use == 2 ? (xr * gs).sum() + 0 * yr.sum() : use == 1 ? (yr * gy).sum() : (yr * gy + xr * gs).sum();
        lr.backward();
        const std::string what = isa + (nhwc ? " NHWC" : " NCHW") + " use " + std::to_string(use);
        EXPECT_LT(max_diff(x.grad(), xr.grad()) / (1 + xr.grad().abs().max().item<double>()), 2e-5) << what;
        if (use != 2) {
          EXPECT_LT(max_diff(sh.grad(), shr.grad()), 2e-4) << what;
        }
      }
    }
  }
}

TEST(Fused, GroupNormSiluShiftCancelsALargeMean) {
  // x = 1000 + N(0, 0.01) with shift -1000 + c/100: z = x + shift has mean c/100 and the variance of the
  // noise, which the kernel must find without forming z in float first (float spacing at 1000 is 6e-5).
  torch::manual_seed(13);
  Tensor x = 1000 + torch::randn({2, 8, 10, 10}) * 0.01;
  Tensor shift = -1000 + torch::arange(8, at::kFloat).div(100).unsqueeze(0).repeat({2, 1});
  Tensor w = torch::ones({8}), b = torch::zeros({8});
  for (bool nhwc : {false, true}) {
    Tensor xin = nhwc ? x.contiguous(at::MemoryFormat::ChannelsLast) : x;
    Tensor y = dew::nn::group_norm_silu(xin, 2, w, b, 1e-5, shift);
    Tensor zd = (x.to(at::kDouble) + shift.to(at::kDouble).view({2, 8, 1, 1})).view({2, 2, -1});
    Tensor zhat = ((zd - zd.mean(-1, true)) / (zd.var(-1, false, true) + 1e-5).sqrt()).view({2, 8, 10, 10});
    EXPECT_LT(max_diff(y.to(at::kDouble), zhat * torch::sigmoid(zhat)), 2e-2) << (nhwc ? "NHWC" : "NCHW");
  }
}

TEST(Fused, GroupNormSiluStatisticsSurviveALargeMean) {
  // Data 1000 + N(0, 0.01): a naive one-pass E[x^2] - E[x]^2 in float would lose the variance entirely.
  torch::manual_seed(11);
  Tensor x = 1000 + torch::randn({2, 8, 10, 10}) * 0.01;
  Tensor w = torch::ones({8}), b = torch::zeros({8});
  Tensor y = dew::nn::group_norm_silu(x, 2, w, b, 1e-5);
  // The reference in float64 from the definition.
  Tensor xd = x.to(at::kDouble).view({2, 2, -1});
  Tensor xhat = ((xd - xd.mean(-1, true)) / (xd.var(-1, false, true) + 1e-5).sqrt()).view({2, 8, 10, 10});
  EXPECT_LT(max_diff(y.to(at::kDouble), xhat * torch::sigmoid(xhat)), 1e-3);
}

TEST(Fused, GroupNormSiluFallsBackAndRefusesBadGroups) {
  Tensor xd = torch::randn({2, 4, 3, 3}, at::kDouble);
  Tensor wd = torch::ones({4}, at::kDouble), bd = torch::zeros({4}, at::kDouble);
  EXPECT_TRUE(
      torch::equal(dew::nn::group_norm_silu(xd, 2, wd, bd, 1e-5), at::silu(at::group_norm(xd, 2, wd, bd, 1e-5))));
  const std::string e = error_of([] { dew::nn::group_norm_silu(torch::randn({2, 6, 3, 3}), 4, {}, {}, 1e-5); });
  EXPECT_NE(e.find("groups must divide the channels (6), got 4"), std::string::npos) << e;
  const std::string es = error_of([] {
    dew::nn::group_norm_silu(torch::randn({2, 6, 3, 3}), 3, torch::ones({6}), torch::zeros({6}), 1e-5,
                             torch::zeros({6}));
  });
  EXPECT_NE(es.find("shift must be [2, 6] (batch, channels), got [6]"), std::string::npos) << es;
  // A float64 shift takes the composite too: exactly silu(group_norm(x + shift)).
  Tensor sd = torch::randn({2, 4}, at::kDouble);
  EXPECT_TRUE(torch::equal(dew::nn::group_norm_silu(xd, 2, wd, bd, 1e-5, sd),
                           at::silu(at::group_norm(xd + sd.view({2, 4, 1, 1}), 2, wd, bd, 1e-5))));
  EXPECT_NE(error_of([] { dew::nn::set_fused_kernel_isa("neon"); }).find("accepted: avx512, avx2, base"),
            std::string::npos);
}

TEST(Fused, GroupNormSiluSecondOrderGradientIsATens) {
  torch::manual_seed(5);
  Tensor x0 = torch::randn({2, 4, 3, 3});
  Tensor w = torch::randn({4}), b = torch::randn({4});
  Tensor s0 = torch::randn({2, 4});
  auto second = [&](bool fused) {
    Tensor x = x0.clone().requires_grad_(), sh = s0.clone().requires_grad_();
    Tensor y = fused ? dew::nn::group_norm_silu(x, 2, w, b, 1e-5, sh)
                     : at::silu(at::group_norm(x + sh.view({2, 4, 1, 1}), 2, w, b, 1e-5));
    auto g = torch::autograd::grad({(y * y).sum()}, {x, sh}, {}, true, true);
    return torch::autograd::grad({g[0].pow(2).sum() + g[1].pow(2).sum()}, {x, sh});
  };
  const auto fused = second(true), composite = second(false);
  EXPECT_LT(max_diff(fused[0], composite[0]), 1e-4);
  EXPECT_LT(max_diff(fused[1], composite[1]), 1e-4);
}

// softmax(q k^T / sqrt(D)) v and its gradients in float64 from the definition: the oracle.
std::vector<Tensor> attention_oracle(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g) {
  Tensor qd = q.detach().to(at::kDouble).requires_grad_(), kd = k.detach().to(at::kDouble).requires_grad_(),
         vd = v.detach().to(at::kDouble).requires_grad_();
  Tensor o = at::matmul(at::softmax(at::matmul(qd, kd.transpose(-2, -1)) / std::sqrt(double(q.size(3))), -1), vd);
  o.backward(g.to(at::kDouble));
  return {o, qd.grad(), kd.grad(), vd.grad()};
}

TEST(Fused, AttentionMatchesTheFloat64DefinitionOnEveryIsa) {
  IsaGuard guard;
  struct Case {
    int64_t B, H, Sq, Sk, D;
  };
  // simple_dit's shape (49 tokens, head 32), unet_attn's (196 tokens, head 16), cross-attention shapes
  // with Sq != Sk, a head size that is not a whole vector, and a single key.
  const std::vector<Case> cases{{2, 4, 49, 49, 32}, {1, 2, 100, 128, 16}, {1, 2, 60, 196, 16},
                                {2, 3, 5, 17, 64},  {1, 2, 7, 3, 24},     {1, 1, 4, 1, 8}};
  for (const auto& isa : runnable_isas()) {
    dew::nn::set_fused_kernel_isa(isa);
    for (const auto& c : cases) {
      torch::manual_seed(c.Sq * 7 + c.D);
      // q and k from one [B, S, 2, H, D] projection, as split_heads leaves them: strided rows.
      Tensor qk = torch::randn({c.B, c.Sq, 2, c.H, c.D}) * 1.5;
      Tensor q = qk.select(2, 0).permute({0, 2, 1, 3}).detach().requires_grad_();
      Tensor k = torch::randn({c.B, c.H, c.Sk, c.D}).requires_grad_();
      Tensor v = torch::randn({c.B, c.H, c.Sk, c.D}).requires_grad_();
      const std::string what = isa + " B" + std::to_string(c.B) + " H" + std::to_string(c.H) + " Sq" +
                               std::to_string(c.Sq) + " Sk" + std::to_string(c.Sk) + " D" + std::to_string(c.D);
      ASSERT_TRUE(dew::nn::fused_attention_applies(q, k, v)) << what;
      Tensor o = dew::nn::fused_attention(q, k, v);
      Tensor g = torch::randn(o.sizes());
      o.backward(g);
      auto ref = attention_oracle(q, k, v, g);
      EXPECT_LT(max_diff(o.to(at::kDouble), ref[0]), 2e-6) << what;
      EXPECT_LT(max_diff(q.grad().to(at::kDouble), ref[1]), 1e-5) << what << ": dq";
      EXPECT_LT(max_diff(k.grad().to(at::kDouble), ref[2]), 1e-5) << what << ": dk";
      EXPECT_LT(max_diff(v.grad().to(at::kDouble), ref[3]), 1e-5) << what << ": dv";
    }
  }
}

TEST(Fused, AttentionAutoUsesItOnlyWhereItApplies) {
  torch::manual_seed(2);
  Tensor q = torch::randn({2, 2, 9, 16}), k = torch::randn({2, 2, 9, 16}), v = torch::randn({2, 2, 9, 16});
  // "auto" without a mask is the fused kernel; "reference" is the composite; they agree.
  EXPECT_LT(max_diff(dew::nn::attention(q, k, v, {}, "auto"), dew::nn::attention(q, k, v, {}, "reference")), 2e-6);
  // A key mask, float64 or too many keys take at::scaled_dot_product_attention ("sdpa").
  Tensor mask = torch::rand({2, 9}) > 0.3;
  EXPECT_TRUE(torch::equal(dew::nn::attention(q, k, v, mask, "auto"), dew::nn::attention(q, k, v, mask, "sdpa")));
  EXPECT_FALSE(dew::nn::fused_attention_applies(q.to(at::kDouble), k.to(at::kDouble), v.to(at::kDouble)));
  EXPECT_FALSE(dew::nn::fused_attention_preferred(dew::nn::kFusedAttentionMaxKeys + 1));
  Tensor kl = torch::randn({1, 1, dew::nn::kFusedAttentionMaxKeys + 1, 4}), ql = torch::randn({1, 1, 2, 4});
  EXPECT_TRUE(torch::equal(dew::nn::attention(ql, kl, kl, {}, "auto"), dew::nn::attention(ql, kl, kl, {}, "sdpa")));
  EXPECT_NE(error_of([&] { dew::nn::fused_attention(q.to(at::kDouble), k, v); }).find("needs float32 CPU"),
            std::string::npos);
}

TEST(Fused, AttentionSecondOrderGradientIsTheComposites) {
  torch::manual_seed(4);
  Tensor q0 = torch::randn({1, 2, 5, 8}), k = torch::randn({1, 2, 6, 8}), v = torch::randn({1, 2, 6, 8});
  auto second = [&](bool fused) {
    Tensor q = q0.clone().requires_grad_();
    Tensor o = fused ? dew::nn::fused_attention(q, k, v) : dew::nn::attention(q, k, v, {}, "reference");
    Tensor g = torch::autograd::grad({(o * o).sum()}, {q}, {}, true, true)[0];
    return torch::autograd::grad({g.pow(2).sum()}, {q})[0];
  };
  EXPECT_LT(max_diff(second(true), second(false)), 1e-4);
}

}  // namespace

namespace {

double rms_of(const Tensor& t) { return t.to(at::kDouble).pow(2).mean().sqrt().item<double>(); }

// The project's rule against a float64 truth: rms(ours - truth) <= 2 rms(ATen float32 - truth) (plus a
// floor of 1e-7 rms(truth), for a composite that happens to round exactly); prints the max difference.
void expect_rule(const Tensor& ours, const Tensor& aten32, const Tensor& truth, const std::string& what) {
  const double e_ours = rms_of(ours.to(at::kDouble) - truth), e_ref = rms_of(aten32.to(at::kDouble) - truth);
  EXPECT_LE(e_ours, 2 * e_ref + 1e-7 * rms_of(truth))
      << what << ": rms error " << e_ours << " vs ATen float32 " << e_ref << ", max diff "
      << max_diff(ours.to(at::kDouble), truth);
}

// ATen's RMSNorm composite, x rsqrt(mean(x^2) + eps) (w + offset), in x's dtype.
Tensor rms_composite(const Tensor& x, const Tensor& w, double eps, double offset) {
  return x * at::rsqrt(x.pow(2).mean(-1, true) + eps) * (w + offset);
}

}  // namespace

TEST(Fused, RmsNormMatchesTheFloat64CompositeOnEveryIsa) {
  IsaGuard guard;
  struct Case {
    std::vector<int64_t> shape;
    double offset;
  };
  // Rows not a multiple of the 64-row block, widths that are and are not whole vectors, Gemma's offset.
  const std::vector<Case> cases{{{3, 50, 256}, 0.0}, {{2, 37, 4, 24}, 1.0}, {{129, 37}, 0.0}, {{1, 1, 5}, 0.5}};
  for (const auto& isa : runnable_isas()) {
    dew::nn::set_fused_kernel_isa(isa);
    for (const auto& c : cases) {
      const int64_t D = c.shape.back();
      torch::manual_seed(D + c.shape[0]);
      Tensor x0 = torch::randn(c.shape) * 3 + 0.5, w0 = torch::randn({D}) * 0.5 + 1, g = torch::randn(c.shape);
      const std::string what = isa + " D" + std::to_string(D) + " rows " + std::to_string(x0.numel() / D);
      Tensor x = x0.clone().requires_grad_(), w = w0.clone().requires_grad_();
      Tensor y = dew::nn::rms_norm(x, w, 1e-6, c.offset);
      y.backward(g);
      Tensor xa = x0.clone().requires_grad_(), wa = w0.clone().requires_grad_();
      Tensor ya = rms_composite(xa, wa, 1e-6, c.offset);
      ya.backward(g);
      Tensor xd = x0.to(at::kDouble).requires_grad_(), wd = w0.to(at::kDouble).requires_grad_();
      Tensor yd = rms_composite(xd, wd, 1e-6, c.offset);
      yd.backward(g.to(at::kDouble));
      EXPECT_EQ(y.sizes(), yd.sizes()) << what;
      expect_rule(y, ya, yd, what + ": y");
      expect_rule(x.grad(), xa.grad(), xd.grad(), what + ": dx");
      expect_rule(w.grad(), wa.grad(), wd.grad(), what + ": dweight");
    }
  }
}

TEST(Fused, RmsNormHandValuesFallbackAndSecondOrder) {
  // Row [3, 4]: mean of squares 12.5, so y = x / sqrt(12.5 + eps) * w.
  Tensor x = torch::tensor({3.0f, 4.0f}).view({1, 2}), w = torch::tensor({1.0f, 2.0f});
  Tensor y = dew::nn::rms_norm(x, w, 0.0);
  EXPECT_NEAR(y[0][0].item<double>(), 3 / std::sqrt(12.5), 1e-6);
  EXPECT_NEAR(y[0][1].item<double>(), 8 / std::sqrt(12.5), 1e-6);
  // float64 takes ATen's composite; a weight of the wrong size names it.
  Tensor xd = torch::randn({4, 6}, at::kDouble), wd = torch::randn({6}, at::kDouble);
  EXPECT_TRUE(torch::allclose(dew::nn::rms_norm(xd, wd, 1e-5, 1.0), rms_composite(xd, wd, 1e-5, 1.0)));
  EXPECT_NE(error_of([&] {
              dew::nn::rms_norm(torch::randn({2, 6}), torch::ones({5}), 1e-5);
            }).find("weight must be [6]"),
            std::string::npos);
  // A create_graph backward is the composite's, so second-order gradients agree.
  torch::manual_seed(5);
  Tensor x0 = torch::randn({3, 16}), w0 = torch::randn({16});
  auto second = [&](bool fused) {
    Tensor xi = x0.clone().requires_grad_();
    Tensor out = fused ? dew::nn::rms_norm(xi, w0, 1e-5) : rms_composite(xi, w0, 1e-5, 0.0);
    Tensor gx = torch::autograd::grad({(out * out).sum()}, {xi}, {}, true, true)[0];
    return torch::autograd::grad({gx.pow(2).sum()}, {xi})[0];
  };
  EXPECT_LT(max_diff(second(true), second(false)), 1e-4);
}

namespace {

// ATen's rotate-half RoPE, x cos + rotate_half(x) sin.
Tensor rope_composite_ref(const Tensor& x, const Tensor& cos, const Tensor& sin) {
  const int64_t h = x.size(-1) / 2;
  return x * cos + at::cat({-x.narrow(-1, h, h), x.narrow(-1, 0, h)}, -1) * sin;
}

}  // namespace

TEST(Fused, RopeMatchesTheFloat64CompositeOnEveryIsa) {
  IsaGuard guard;
  struct Case {
    int64_t B, H, S, D;
    bool per_row;  // [B, 1, S, D] tables (positions per row) instead of [S, D]
  };
  const std::vector<Case> cases{{2, 4, 9, 64, false}, {3, 2, 5, 24, true}, {1, 3, 7, 6, false}, {2, 1, 1, 40, true}};
  for (const auto& isa : runnable_isas()) {
    dew::nn::set_fused_kernel_isa(isa);
    for (const auto& c : cases) {
      torch::manual_seed(c.D * 3 + c.S);
      const std::string what = isa + " D" + std::to_string(c.D) + (c.per_row ? " per-row tables" : "");
      // x as a projection leaves it: [B, S, H, D] memory seen as [B, H, S, D].
      Tensor x0 = torch::randn({c.B, c.S, c.H, c.D}).transpose(1, 2);
      Tensor pos = c.per_row ? torch::randint(0, 50, {c.B, c.S}, torch::kLong) : torch::arange(c.S) + 3;
      auto rope = dew::nn::rope_1d(pos, c.D, 500.0);
      Tensor g = torch::randn({c.B, c.H, c.S, c.D});
      Tensor x = x0.detach().requires_grad_();
      Tensor y = dew::nn::rope_rotate(x, rope.cos, rope.sin);
      y.backward(g);
      EXPECT_EQ(y.strides(), x0.strides()) << what << ": the output keeps x's layout";
      Tensor xa = x0.detach().requires_grad_();
      Tensor ya = rope_composite_ref(xa, rope.cos, rope.sin);
      ya.backward(g);
      Tensor xd = x0.detach().to(at::kDouble).requires_grad_();
      Tensor yd = rope_composite_ref(xd, rope.cos.to(at::kDouble), rope.sin.to(at::kDouble));
      yd.backward(g.to(at::kDouble));
      expect_rule(y, ya, yd, what + ": y");
      expect_rule(x.grad(), xa.grad(), xd.grad(), what + ": dx");
    }
  }
}

TEST(Fused, RopeFallsBackAndHasTheCompositesSecondOrder) {
  torch::manual_seed(6);
  auto rope = dew::nn::rope_1d(torch::arange(5), 8);
  // float64 and tables that need a gradient take the composite.
  Tensor xd = torch::randn({1, 2, 5, 8}, at::kDouble);
  EXPECT_TRUE(torch::allclose(dew::nn::rope_rotate(xd, rope.cos.to(at::kDouble), rope.sin.to(at::kDouble)),
                              rope_composite_ref(xd, rope.cos.to(at::kDouble), rope.sin.to(at::kDouble))));
  Tensor c = rope.cos.clone().requires_grad_();
  Tensor x = torch::randn({1, 2, 5, 8});
  Tensor y = dew::nn::rope_rotate(x, c, rope.sin);
  y.sum().backward();
  ASSERT_TRUE(c.grad().defined());
  EXPECT_LT(max_diff(c.grad(), x.sum(std::vector<int64_t>{0, 1})),
            1e-5);  // d/dcos of sum(x cos + ...) = x summed over B, H
  // The rotation is linear: a create_graph backward gives the composite's gradient of a gradient.
  auto second = [&](bool fused) {
    Tensor xi = x.clone().requires_grad_();
    Tensor out = fused ? dew::nn::rope_rotate(xi, rope.cos, rope.sin) : rope_composite_ref(xi, rope.cos, rope.sin);
    Tensor gx = torch::autograd::grad({(out * out * out).sum()}, {xi}, {}, true, true)[0];
    return torch::autograd::grad({gx.pow(2).sum()}, {xi})[0];
  };
  EXPECT_LT(max_diff(second(true), second(false)), 1e-3);
}

TEST(Fused, FewRowsLinearIsGemvAndMatchesFloat64) {
  torch::manual_seed(8);
  Tensor w = torch::randn({96, 64}) * 0.2, b = torch::randn({96});
  for (int64_t rows : {1, 3, 4, 5}) {
    for (bool with_bias : {true, false}) {
      torch::NoGradGuard ng;
      Tensor x = torch::randn({rows, 1, 64});
      Tensor y = dew::nn::row_parallel_linear(x, w, with_bias ? b : Tensor());
      Tensor ya = at::linear(x, w, with_bias ? b : Tensor());
      Tensor yd = at::linear(x.to(at::kDouble), w.to(at::kDouble), with_bias ? b.to(at::kDouble) : Tensor());
      EXPECT_EQ(y.sizes(), yd.sizes());
      expect_rule(y, ya, yd, "rows " + std::to_string(rows) + (with_bias ? " with bias" : ""));
    }
  }
  // Under autograd: the same bits as without (remat recomputes a no-grad forward), and ATen's gradients.
  Tensor x0 = torch::randn({2, 64});
  Tensor x = x0.clone().requires_grad_(), wg = w.clone().requires_grad_(), bg = b.clone().requires_grad_();
  Tensor y = dew::nn::row_parallel_linear(x, wg, bg);
  {
    torch::NoGradGuard ng;
    EXPECT_TRUE(torch::equal(y.detach(), dew::nn::row_parallel_linear(x0, w, b)));
  }
  Tensor g = torch::randn({2, 96});
  y.backward(g);
  Tensor xd = x0.to(at::kDouble).requires_grad_(), wd = w.to(at::kDouble).requires_grad_(),
         bd = b.to(at::kDouble).requires_grad_();
  at::linear(xd, wd, bd).backward(g.to(at::kDouble));
  EXPECT_LT(max_diff(x.grad().to(at::kDouble), xd.grad()), 1e-5);
  EXPECT_LT(max_diff(wg.grad().to(at::kDouble), wd.grad()), 1e-5);
  EXPECT_LT(max_diff(bg.grad().to(at::kDouble), bd.grad()), 1e-5);
}

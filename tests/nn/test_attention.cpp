// Attention implementations against the reference path, the attention modules, and the embeddings.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "dew/core/error.h"
#include "dew/nn/attention.h"
#include "dew/nn/embeddings.h"
#include "tests/golden_util.h"

namespace {

using at::Tensor;
using dew::nn::attention;

using dew::test::max_diff;

struct QKV {
  Tensor q, k, v;
};
QKV random_qkv(int64_t B, int64_t H, int64_t Sq, int64_t Sk, int64_t D, uint64_t seed) {
  torch::manual_seed(seed);
  return {torch::randn({B, H, Sq, D}), torch::randn({B, H, Sk, D}), torch::randn({B, H, Sk, D})};
}

// softmax(q k^T / sqrt(D)) v in float64, the independent check of the reference path.
Tensor naive(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask4) {
  Tensor s = at::matmul(q.to(at::kDouble), k.to(at::kDouble).transpose(-2, -1)) / std::sqrt(double(q.size(-1)));
  if (mask4.defined()) s = s.masked_fill(mask4.logical_not(), -1e300);
  return at::matmul(at::softmax(s, -1), v.to(at::kDouble));
}

TEST(Attention, ReferenceMatchesFloat64Math) {
  auto [q, k, v] = random_qkv(2, 3, 37, 29, 16, 1);
  EXPECT_LT(max_diff(attention(q, k, v, {}, "reference"), naive(q, k, v, {})), 1e-5);
}

TEST(Attention, ChunkedAndAutoAgreeWithReferenceWithAndWithoutMasks) {
  auto [q, k, v] = random_qkv(2, 3, 300, 70, 16, 2);  // 300 query rows: two default chunks of 256
  Tensor key_mask = torch::rand({2, 70}) > 0.3;       // [B, Sk]
  Tensor causal = torch::ones({300, 70}, at::kBool).tril().view({1, 1, 300, 70});  // per-query 4-D mask
  for (const Tensor& mask : {Tensor(), key_mask, causal}) {
    Tensor ref = attention(q, k, v, mask, "reference");
    Tensor m4 = mask.defined() && mask.dim() == 2 ? mask.view({2, 1, 1, 70}) : mask;
    EXPECT_LT(max_diff(ref, naive(q, k, v, m4)), 1e-5);
    EXPECT_LT(max_diff(attention(q, k, v, mask, "chunked"), ref), 1e-5);
    EXPECT_LT(max_diff(attention(q, k, v, mask, "auto"), ref), 1e-5);
    Tensor m4safe = m4.defined() ? m4 : Tensor();
    EXPECT_LT(max_diff(dew::nn::attention_chunked(q, k, v, m4safe, true, 64), ref), 1e-5);  // 5 uneven chunks
    EXPECT_LT(max_diff(attention(q, k, v, mask, "sdpa"), ref), 1e-5);
  }
}

TEST(Attention, ChunkedGradientsMatchReference) {
  auto [q0, k0, v0] = random_qkv(1, 2, 90, 40, 8, 3);
  Tensor mask = torch::rand({1, 40}) > 0.2;
  Tensor w = torch::randn({1, 2, 90, 8});
  std::vector<Tensor> grads[2];
  int i = 0;
  for (const char* impl : {"reference", "chunked"}) {
    Tensor q = q0.clone().requires_grad_(), k = k0.clone().requires_grad_(), v = v0.clone().requires_grad_();
    Tensor out = impl == std::string("chunked")
                     ? dew::nn::attention_chunked(q, k, v, mask.view({1, 1, 1, 40}), true, 32)
                     : attention(q, k, v, mask, impl);
    (out * w).sum().backward();
    grads[i++] = {q.grad(), k.grad(), v.grad()};
  }
  for (int j = 0; j < 3; ++j) EXPECT_LT(max_diff(grads[0][j], grads[1][j]), 1e-5) << "grad " << j;
}

TEST(Attention, FullyMaskedRowGivesZerosAndFiniteGradients) {
  auto [q0, k, v] = random_qkv(2, 2, 5, 6, 8, 4);
  Tensor q = q0.clone().requires_grad_();
  Tensor mask = torch::ones({2, 6}, at::kBool);
  mask[1].fill_(false);  // the second row has no context at all
  for (const char* impl : {"reference", "chunked", "auto"}) {
    Tensor out = attention(q, k, v, mask, impl);
    EXPECT_EQ(out[1].abs().max().item<double>(), 0.0) << impl;
    EXPECT_TRUE(torch::isfinite(out).all().item<bool>()) << impl;
    Tensor g = torch::autograd::grad({out.sum()}, {q})[0];
    EXPECT_TRUE(torch::isfinite(g).all().item<bool>()) << impl;
  }
}

TEST(Attention, UnknownImplIsAnError) {
  auto [q, k, v] = random_qkv(1, 1, 4, 4, 8, 5);
  EXPECT_THROW(attention(q, k, v, {}, "flash"), dew::Error);
  EXPECT_THROW(dew::nn::SelfAttention(dew::nn::SelfAttentionOptions(16, 2).impl("flash")), dew::Error);
}

TEST(Attention, Fp32SoftmaxUnderBfloat16StaysClose) {
  auto [q, k, v] = random_qkv(1, 2, 64, 64, 16, 6);
  Tensor ref = attention(q, k, v, {}, "reference");
  Tensor lo = attention(q.to(at::kBFloat16), k.to(at::kBFloat16), v.to(at::kBFloat16), {}, "chunked", true);
  EXPECT_EQ(lo.scalar_type(), at::kBFloat16);
  EXPECT_LT(max_diff(lo, ref), 0.05);
}

TEST(AttentionModules, SelfAttentionShapesNamesAndQkNorm) {
  dew::nn::SelfAttention attn(dew::nn::SelfAttentionOptions(32, 4).qk_norm("rms"));
  std::vector<std::string> names;
  for (const auto& kv : attn->named_parameters()) names.push_back(kv.key());
  EXPECT_EQ(names, (std::vector<std::string>{"qkv.weight", "qkv.bias", "proj.weight", "proj.bias", "q_norm.weight",
                                             "k_norm.weight"}));
  Tensor x = torch::randn({2, 10, 32});
  auto rope = dew::nn::rope_1d(torch::arange(10), 8);
  Tensor y = attn(x, rope);
  EXPECT_EQ(y.sizes(), x.sizes());
  // Implementations agree inside the module too.
  dew::nn::SelfAttention chunked(dew::nn::SelfAttentionOptions(32, 4).qk_norm("rms").impl("chunked"));
  torch::NoGradGuard no_grad;
  for (auto& kv : chunked->named_parameters()) kv.value().copy_(attn->named_parameters()[kv.key()]);
  EXPECT_LT(max_diff(chunked(x, rope), y), 1e-5);
  EXPECT_THROW(dew::nn::SelfAttention(dew::nn::SelfAttentionOptions(30, 4)), dew::Error);
}

TEST(AttentionModules, CrossAttentionIgnoresMaskedContext) {
  dew::nn::CrossAttention attn(dew::nn::CrossAttentionOptions(32, 24, 4));
  Tensor x = torch::randn({2, 6, 32});
  Tensor ctx = torch::randn({2, 5, 24});
  Tensor mask = torch::tensor({1, 1, 1, 0, 0, 1, 0, 1, 1, 0}, at::kLong).view({2, 5}).to(at::kBool);
  Tensor y = attn(x, ctx, mask);
  Tensor ctx2 = ctx.clone();
  ctx2.masked_fill_(mask.logical_not().unsqueeze(-1), 100.0);  // change only masked-out tokens
  EXPECT_LT(max_diff(attn(x, ctx2, mask), y), 1e-6);
  EXPECT_GT(max_diff(attn(x, ctx2), y), 1e-3);  // without the mask they matter
}

// ---- embeddings ----

TEST(Rope, ScoresDependOnlyOnRelativePosition) {
  torch::manual_seed(7);
  const int64_t S = 16, D = 32, c = 11;
  Tensor q = torch::randn({1, 2, S, D}), k = torch::randn({1, 2, S, D});
  auto scores = [&](int64_t offset) {
    auto r = dew::nn::rope_1d(torch::arange(S) + offset, D);
    return at::matmul(dew::nn::apply_rope(q, r), dew::nn::apply_rope(k, r).transpose(-2, -1));  // [1, 2, S, S]
  };
  Tensor s0 = scores(0), sc = scores(c);
  EXPECT_LT(max_diff(s0, sc), 1e-4);
  // ... and do depend on position: rotating q and k by different offsets changes the scores.
  auto r0 = dew::nn::rope_1d(torch::arange(S), D), r1 = dew::nn::rope_1d(torch::arange(S) + c, D);
  Tensor mixed = at::matmul(dew::nn::apply_rope(q, r0), dew::nn::apply_rope(k, r1).transpose(-2, -1));
  EXPECT_GT(max_diff(mixed, s0), 1e-2);
}

TEST(Rope, UndefinedPositionsAreTheIdentityAndNormsArePreserved) {
  Tensor x = torch::randn({2, 3, 5, 8});
  auto none = dew::nn::rope_1d(Tensor(), 8);
  EXPECT_FALSE(none.defined());
  EXPECT_TRUE(torch::equal(dew::nn::apply_rope(x, none), x));
  auto r = dew::nn::rope_1d(torch::arange(5), 8);
  EXPECT_LT(max_diff(dew::nn::apply_rope(x, r).norm(2, -1), x.norm(2, -1)), 1e-5);  // a rotation
  // Position 0 is no rotation; batched positions [B, S] broadcast over heads.
  EXPECT_LT(max_diff(dew::nn::apply_rope(x, r).select(2, 0), x.select(2, 0)), 1e-7);
  auto rb = dew::nn::rope_1d(torch::arange(5).repeat({2, 1}), 8);
  EXPECT_LT(max_diff(dew::nn::apply_rope(x, rb), dew::nn::apply_rope(x, r)), 1e-7);
  EXPECT_THROW(dew::nn::rope_1d(torch::arange(5), 7), dew::Error);
}

TEST(Embeddings, FourierFeaturesAreFixedSeededAndUnitNorm) {
  dew::nn::FourierFeatures a(512), b(512);
  EXPECT_TRUE(torch::equal(a->freqs, b->freqs));  // same frequencies in every build
  EXPECT_EQ(a->named_buffers().size(), 1u);
  EXPECT_EQ(a->parameters().size(), 0u);
  const double std = a->freqs.std().item<double>();
  EXPECT_NEAR(std, 16.0, 2.0);
  Tensor f = a(torch::tensor({0.0, 0.25, 1.0}));
  ASSERT_EQ(f.sizes(), (std::vector<int64_t>{3, 512}));
  Tensor s = f.narrow(1, 0, 256), c = f.narrow(1, 256, 256);
  EXPECT_LT(max_diff(s * s + c * c, torch::ones_like(s)), 1e-5);
  EXPECT_LT(max_diff(f[0], torch::cat({torch::zeros(256), torch::ones(256)})), 1e-7);  // t = 0
  EXPECT_THROW(dew::nn::FourierFeatures(7), dew::Error);
}

TEST(Embeddings, TimestepEmbeddingMatchesFormula) {
  Tensor e = dew::nn::timestep_embedding(torch::tensor({3.0}), 8, 10000.0);
  for (int i = 0; i < 4; ++i) {
    const double f = std::exp(-std::log(10000.0) * i / 4.0);
    EXPECT_NEAR(e[0][i].item<double>(), std::cos(3.0 * f), 1e-6);
    EXPECT_NEAR(e[0][4 + i].item<double>(), std::sin(3.0 * f), 1e-6);
  }
}

TEST(Embeddings, SinCos2dTableMatchesMae) {
  const int64_t dim = 16, h = 3, w = 5;
  Tensor t = dew::nn::sincos_2d_table(dim, h, w);
  ASSERT_EQ(t.sizes(), (std::vector<int64_t>{h * w, dim}));
  // MAE: first half from the column (grid_w), second half from the row; each half [sin | cos].
  const int64_t r = 2, col = 3, idx = r * w + col, q = dim / 4;
  for (int64_t i = 0; i < q; ++i) {
    const double omega = 1.0 / std::pow(10000.0, double(i) / q);
    EXPECT_NEAR(t[idx][i].item<double>(), std::sin(col * omega), 1e-6);
    EXPECT_NEAR(t[idx][q + i].item<double>(), std::cos(col * omega), 1e-6);
    EXPECT_NEAR(t[idx][2 * q + i].item<double>(), std::sin(r * omega), 1e-6);
    EXPECT_NEAR(t[idx][3 * q + i].item<double>(), std::cos(r * omega), 1e-6);
  }
  EXPECT_THROW(dew::nn::sincos_2d_table(6, 2, 2), dew::Error);
}

}  // namespace

// simple_mmdit and hierarchical_mmdit: zero output at initialisation, finite outputs at two resolutions,
// gradients to every parameter, overfitting one batch, the joint block against a step-by-step computation,
// the text key mask, invariance to the order of the text tokens (neither model encodes text positions),
// 2x2 merging layout, refusals and the config round trip.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <cmath>

#include "dew/core/error.h"
#include "dew/core/options.h"
#include "dew/nn/attention.h"
#include "dew/nn/backbones/backbone.h"
#include "dew/nn/backbones/hierarchical_mmdit.h"
#include "dew/nn/backbones/mmdit.h"
#include "tests/nn/backbone_checks.h"
#include "tests/test_util.h"

namespace {

using at::Tensor;
using dew::json;
using dew::test::error_of;
using namespace dew::test;

json tiny_mm(json extra = json::object()) {
  json f = {{"patch_size", 2}, {"emb_features", 32}, {"num_layers", 2},
            {"num_heads", 4},  {"mlp_ratio", 2},     {"context_features", 8}};
  f.update(extra);
  return f;
}
// Three stages with an odd deepest stage (it is not split); grid sides must be multiples of 2 * 2^2 = 8.
json tiny_h(json extra = json::object()) {
  json f = {{"base_patch_size", 2}, {"emb_features", {16, 24, 32}}, {"num_layers", {2, 2, 1}}, {"num_heads", {2, 2, 4}},
            {"mlp_ratio", 2},       {"context_features", 8}};
  f.update(extra);
  return f;
}
json tiny(const std::string& arch, json extra = json::object()) {
  return arch == "simple_mmdit" ? tiny_mm(std::move(extra)) : tiny_h(std::move(extra));
}
const std::vector<std::string> kArchs{"simple_mmdit", "hierarchical_mmdit"};

// A text context [B, L, 8] whose mask keeps at least the first token of every row.
dew::Conditioning text_cond(int64_t B, int64_t L, uint64_t seed) {
  torch::manual_seed(seed);
  dew::Conditioning c;
  c.context = torch::randn({B, L, 8});
  c.context_mask = torch::rand({B, L}) > 0.4;
  c.context_mask.select(1, 0).fill_(true);
  return c;
}

// ---- shapes, zero at init, finite outputs ----

// Zero output at initialisation and finite outputs afterwards at two resolutions and scan orders, gradients
// reaching every parameter (the text stream's included) and remat run in the shared suite on the families'
// variants (tests/nn/test_all_backbones.cpp).

// ---- gradients and overfitting ----

TEST(MMDiT, OverfitsOneBatchWithText) {
  for (const auto& arch : kArchs) {
    auto start = std::chrono::steady_clock::now();
    torch::manual_seed(0);
    auto m = dew::models::build(arch, tiny(arch, {{"num_classes", 4}}));
    FixedBatch b = fixed_batch(4, 3, 8, 2);
    b.cond = text_cond(4, 5, 4);
    b.cond.labels = torch::tensor({0, 1, 2, 4}, at::kLong);
    auto [first, last] = overfit(*m, b, 150, 3e-3);
    double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::cout << "[ " << arch << " ] loss " << first << " -> " << last << " in 150 steps, " << secs << " s\n";
    EXPECT_LT(last, first / 10) << arch;
  }
}

TEST(MMDiT, Bfloat16ComputeRunsAndStaysClose) {
  for (const auto& arch : kArchs) {
    auto ref = dew::models::build(arch, tiny(arch));
    auto lo = dew::models::build(arch, tiny(arch, {{"dtype", "bfloat16"}}));
    randomize(*ref, 0.05);
    copy_parameters(*ref, *lo);
    Tensor x = torch::randn({2, 3, 8, 8}), t = torch::rand({2});
    dew::Conditioning cond = text_cond(2, 4, 12);
    Tensor a = ref->forward(x, t, cond), b = lo->forward(x, t, cond);
    EXPECT_EQ(b.scalar_type(), at::kFloat);
    EXPECT_LT(max_diff(a, b), 0.05 * (1 + a.abs().max().item<double>())) << arch;
    for (const auto& p : lo->parameters()) EXPECT_EQ(p.scalar_type(), at::kFloat);
  }
}

TEST(MMDiT, ChunkedAttentionGivesTheReferenceResult) {
  // 3 query rows per block: the joint sequences here (image tokens + 4 text tokens) are longer, so the
  // chunked path really splits instead of falling back to the reference below one block.
  dew::nn::AttentionChunkRowsScope small_blocks(3);
  for (const auto& arch : kArchs) {
    auto ref = dew::models::build(arch, tiny(arch, {{"attention_impl", "reference"}}));
    auto chunked = dew::models::build(arch, tiny(arch, {{"attention_impl", "chunked"}}));
    randomize(*ref, 0.05);
    copy_parameters(*ref, *chunked);
    Tensor x = torch::randn({2, 3, 16, 8}), t = torch::rand({2});
    dew::Conditioning cond = text_cond(2, 4, 13);
    EXPECT_LT(max_diff(ref->forward(x, t, cond), chunked->forward(x, t, cond)), 1e-5) << arch;
  }
}

// ---- the joint block against a step-by-step computation ----

// One stream's modulated input: LayerNorm (no affine) then x (1 + scale) + shift, in plain ops.
Tensor modulated(const Tensor& x, const Tensor& shift, const Tensor& scale) {
  Tensor mu = x.mean(-1, true), var = (x - mu).pow(2).mean(-1, true);
  return (x - mu) / (var + 1e-5).sqrt() * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1);
}
Tensor lin(const Tensor& x, const torch::nn::Linear& l) { return x.matmul(l->weight.t()) + l->bias; }

TEST(MMDiT, JointBlockMatchesAStepByStepComputation) {
  for (bool pre_only : {false, true}) {
    torch::manual_seed(11);
    const int64_t B = 2, N = 5, L = 3, D = 16, H = 2, dh = D / H;
    dew::nn::MMDiTBlock block(
        dew::nn::MMDiTBlockOptions(D, H).mlp_ratio(2).context_pre_only(pre_only).attention_impl("reference"));
    {
      torch::NoGradGuard g;
      for (auto& p : block->parameters()) p.add_(torch::randn_like(p) * 0.2);
    }
    Tensor x = torch::randn({B, N, D}), txt = torch::randn({B, L, D}), c = torch::randn({B, D});
    Tensor mask = torch::tensor({1, 0, 1, 0, 1, 1}, at::kLong).view({B, L}).to(at::kBool);
    auto [y, yt] = block->forward(x, txt, c, dew::nn::Rope(), mask);

    torch::NoGradGuard no_grad;
    auto& im = *block->image;
    auto& tx = *block->text;
    auto mi = lin(torch::silu(c), im.adaLN_modulation).chunk(6, 1);
    auto mt = lin(torch::silu(c), tx.adaLN_modulation).chunk(pre_only ? 2 : 6, 1);
    Tensor qkv_i = lin(modulated(x, mi[0], mi[1]), im.qkv).view({B, N, 3, H, dh});
    Tensor xt_mod = modulated(txt, mt[0], mt[1]);
    Tensor k_t, v_t, q_t;
    if (pre_only) {
      Tensor kv_t = lin(xt_mod, tx.kv).view({B, L, 2, H, dh});
      k_t = kv_t.select(2, 0), v_t = kv_t.select(2, 1);
    } else {
      Tensor qkv_t = lin(xt_mod, tx.qkv).view({B, L, 3, H, dh});
      q_t = qkv_t.select(2, 0), k_t = qkv_t.select(2, 1), v_t = qkv_t.select(2, 2);
    }
    Tensor o_i = torch::zeros({B, N, H, dh}), o_t = torch::zeros({B, L, H, dh});
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t h = 0; h < H; ++h) {
        Tensor K = torch::cat({k_t[b].select(1, h), qkv_i[b].select(1, 1).select(1, h)}, 0);  // [L + N, dh]
        Tensor V = torch::cat({v_t[b].select(1, h), qkv_i[b].select(1, 2).select(1, h)}, 0);
        Tensor keep = torch::cat({mask[b], torch::ones({N}, at::kBool)});
        auto attend = [&](const Tensor& Q) {
          Tensor s = Q.matmul(K.t()) / std::sqrt(static_cast<double>(dh));
          s = s.masked_fill(keep.logical_not(), -1e30);
          return torch::softmax(s, -1).matmul(V);
        };
        o_i[b].select(1, h).copy_(attend(qkv_i[b].select(1, 0).select(1, h)));
        if (!pre_only) o_t[b].select(1, h).copy_(attend(q_t[b].select(1, h)));
      }
    }
    auto finish = [&](const Tensor& xs, const Tensor& o, dew::nn::MMDiTStreamImpl& s, std::vector<Tensor> m) {
      Tensor hh = xs + m[2].unsqueeze(1) * lin(o.reshape({B, xs.size(1), D}), s.proj);
      Tensor mlp = lin(torch::gelu(lin(modulated(hh, m[3], m[4]), s.mlp->fc1), "tanh"), s.mlp->fc2);
      return hh + m[5].unsqueeze(1) * mlp;
    };
    EXPECT_LT(max_diff(y, finish(x, o_i, im, mi)), 1e-4) << "pre_only " << pre_only;
    if (pre_only) {
      EXPECT_FALSE(yt.defined());
    } else {
      EXPECT_LT(max_diff(yt, finish(txt, o_t, tx, mt)), 1e-4);
    }
  }
}

// ---- the text key mask and the order of text tokens ----

TEST(MMDiT, MaskedTextTokensDoNotChangeTheOutput) {
  for (const auto& arch : kArchs) {
    torch::manual_seed(7);
    auto m = dew::models::build(arch, tiny(arch));
    randomize(*m, 0.1);
    Tensor x = torch::randn({2, 3, 8, 8}), t = torch::rand({2});
    dew::Conditioning a = text_cond(2, 6, 8);
    a.context_mask = torch::tensor({1, 0, 1, 1, 0, 0, 0, 1, 1, 0, 1, 0}, at::kLong).view({2, 6}).to(at::kBool);
    dew::Conditioning b = a;
    Tensor masked = a.context_mask.logical_not().unsqueeze(-1);
    b.context = torch::where(masked, torch::randn_like(a.context) * 30 + 5, a.context);
    Tensor ya = m->forward(x, t, a), yb = m->forward(x, t, b);
    EXPECT_LT(max_diff(ya, yb), 1e-6) << arch;
    // The same change to real tokens does change the output (the check above can fail).
    dew::Conditioning c = a;
    c.context = torch::where(masked, a.context, torch::randn_like(a.context) * 30 + 5);
    EXPECT_GT(max_diff(ya, m->forward(x, t, c)), 1e-3) << arch;
  }
}

TEST(MMDiT, PermutingTextTokensWithTheirMaskLeavesTheImageOutputUnchanged) {
  // Neither model gives the text tokens a position (no table, identity rotation), so the joint attention and
  // the masked mean are invariant to their order.
  for (const auto& arch : kArchs) {
    torch::manual_seed(9);
    auto m = dew::models::build(arch, tiny(arch));
    randomize(*m, 0.1);
    Tensor x = torch::randn({2, 3, 8, 8}), t = torch::rand({2});
    dew::Conditioning a = text_cond(2, 5, 10);
    a.context_mask = torch::tensor({1, 0, 1, 1, 0, 0, 1, 1, 0, 1}, at::kLong).view({2, 5}).to(at::kBool);
    Tensor perm = torch::tensor({3, 0, 4, 2, 1}, at::kLong);
    dew::Conditioning b = a;
    b.context = a.context.index_select(1, perm);
    b.context_mask = a.context_mask.index_select(1, perm);
    Tensor ya = m->forward(x, t, a);
    EXPECT_LT(max_diff(ya, m->forward(x, t, b)), 1e-5) << arch;
    // Permuting the tokens without their mask changes which tokens are real, so the output changes.
    dew::Conditioning c = a;
    c.context = b.context;
    EXPECT_GT(max_diff(ya, m->forward(x, t, c)), 1e-4) << arch;
  }
}

// ---- 2x2 merging and expansion ----

TEST(MMDiT, MergeGroupsTwoByTwoNeighbourhoodsAndExpandInvertsIt) {
  // A 4 x 6 grid of tokens whose single feature is its raster index.
  Tensor x = torch::arange(24, at::kFloat).view({1, 24, 1});
  Tensor m = dew::nn::merge_2x2(x, 4, 6);
  ASSERT_EQ(m.sizes(), (std::vector<int64_t>{1, 6, 4}));
  // Token (r, c) of the 2 x 3 grid holds raster cells (2r, 2c), (2r, 2c+1), (2r+1, 2c), (2r+1, 2c+1).
  EXPECT_EQ(max_diff(m[0][0], torch::tensor({0, 1, 6, 7}, at::kFloat)), 0.0);
  EXPECT_EQ(max_diff(m[0][2], torch::tensor({4, 5, 10, 11}, at::kFloat)), 0.0);
  EXPECT_EQ(max_diff(m[0][4], torch::tensor({14, 15, 20, 21}, at::kFloat)), 0.0);
  EXPECT_EQ(max_diff(dew::nn::expand_2x2(m, 2, 3), x), 0.0);
  Tensor y = torch::randn({2, 16, 3});
  EXPECT_EQ(max_diff(dew::nn::expand_2x2(dew::nn::merge_2x2(y, 4, 4), 2, 2), y), 0.0);
}

// ---- parameter names, refusals, config ----

TEST(MMDiT, DocumentedParameterNamesAndShapes) {
  auto s = dew::models::build("simple_mmdit", tiny_mm());
  auto p = s->named_parameters();
  EXPECT_EQ(p["blocks.0.image.qkv.weight"].sizes(), (std::vector<int64_t>{96, 32}));
  EXPECT_EQ(p["blocks.0.text.qkv.weight"].sizes(), (std::vector<int64_t>{96, 32}));
  EXPECT_TRUE(dew::models::build("hierarchical_mmdit", tiny_h())
                  ->named_parameters()
                  .contains("down_blocks.0.0.text.kv.weight"));
  EXPECT_EQ(p["blocks.1.text.kv.weight"].sizes(), (std::vector<int64_t>{64, 32}));
  EXPECT_EQ(p["blocks.1.text.adaLN_modulation.weight"].sizes(), (std::vector<int64_t>{64, 32}));
  EXPECT_FALSE(p.contains("blocks.1.text.proj.weight"));
  EXPECT_EQ(p["context_embedder.weight"].sizes(), (std::vector<int64_t>{32, 8}));
  EXPECT_EQ(p["pooled_text_embedder.weight"].sizes(), (std::vector<int64_t>{32, 8}));
  // Counted by hand (D 32, p 2, text 8, MLP 64): x_embedder 416, context_embedder 288, t_embedder 2112,
  // pooled 288, full stream 14752 (adaLN 6336, qkv 3168, proj 1056, mlp 4192), pre-only text stream 4224
  // (adaLN 2112, kv 2112), final layer 2508: 416 + 288 + 2112 + 288 + 3 * 14752 + 4224 + 2508 = 54092.
  // bench/peer_simple_mmdit.py builds the same count in PyTorch; with qk_norm and 4 classes both add
  // 5 * 32 label rows and 7 head norms of 8 (54308).
  auto count = [](const dew::BackboneImpl& m) {
    int64_t n = 0;
    for (const auto& t : m.parameters()) n += t.numel();
    return n;
  };
  EXPECT_EQ(count(*s), 54092);
  EXPECT_EQ(count(*dew::models::build("simple_mmdit", tiny_mm({{"qk_norm", true}, {"num_classes", 4}}))), 54308);
  auto h = dew::models::build("hierarchical_mmdit", tiny_h());
  auto q = h->named_parameters();
  EXPECT_EQ(q["merges.0.weight"].sizes(), (std::vector<int64_t>{24, 64}));
  EXPECT_EQ(q["expands.1.weight"].sizes(), (std::vector<int64_t>{96, 32}));
  EXPECT_EQ(q["fusions.0.weight"].sizes(), (std::vector<int64_t>{16, 32}));
  EXPECT_EQ(q["cond_projections.0.weight"].sizes(), (std::vector<int64_t>{16, 32}));
  EXPECT_EQ(q["context_embedders.2.weight"].sizes(), (std::vector<int64_t>{32, 8}));
  EXPECT_TRUE(q.contains("down_blocks.1.0.image.qkv.weight"));
  EXPECT_TRUE(q.contains("up_blocks.0.0.text.kv.weight"));
  EXPECT_TRUE(q.contains("mid_blocks.0.text.kv.weight"));
  EXPECT_FALSE(q.contains("down_blocks.0.1.image.qkv.weight"));  // num_layers[0] = 2: one block down, one up
}

TEST(MMDiT, RefusesWhatItCannotRun) {
  auto has = [](const std::string& msg, const std::string& part) {
    EXPECT_NE(msg.find(part), std::string::npos) << "expected \"" << part << "\" in: " << msg;
  };
  for (const auto& arch : kArchs) {
    auto m = dew::models::build(arch, tiny(arch));
    has(error_of([&] { m->forward(torch::randn({1, 3, 8, 8}), torch::rand({1}), {}); }), "text context is required");
    dew::Conditioning wide;
    wide.context = torch::randn({1, 3, 9});
    has(error_of([&] {
          m->forward(torch::randn({1, 3, 8, 8}), torch::rand({1}), wide);
        }),
        "context must be [1, L >= 1, 8]");
    has(error_of([&] {
          dew::models::build(arch, tiny(arch, {{"context_features", 0}}));
        }),
        "context_features must be > 0");
  }
  has(error_of([] {
        dew::models::build("simple_mmdit", tiny_mm({{"scan_order", "zigzag"}}));
      }),
      "scan_order must be raster or hilbert");
  has(error_of([] {
        dew::models::build("hierarchical_mmdit", tiny_h({{"scan_order", "hilbert"}}));
      }),
      "scan_order must be raster");
  has(error_of([] {
        dew::models::build("hierarchical_mmdit", tiny_h({{"num_layers", {2, 3, 1}}}));
      }),
      "num_layers[1] must be even");
  has(error_of([] {
        dew::models::build("hierarchical_mmdit", tiny_h({{"num_heads", {2, 2}}}));
      }),
      "one entry per stage");
  has(error_of([] {
        dew::models::build("hierarchical_mmdit", tiny_h({{"num_heads", {2, 5, 4}}}));
      }),
      "emb_features[1] / num_heads[1]");
  auto h = dew::models::build("hierarchical_mmdit", tiny_h());
  has(error_of([&] {
        h->forward(torch::randn({1, 3, 12, 16}), torch::rand({1}), text_cond(1, 2, 0));
      }),
      "multiples of base_patch_size * 2^(stages - 1) = 2 * 4 = 8, got 12 x 16");
  auto s = dew::models::build("simple_mmdit", tiny_mm());
  has(error_of([&] {
        s->forward(torch::randn({1, 3, 7, 8}), torch::rand({1}), text_cond(1, 2, 0));
      }),
      "multiples of patch_size 2");
}

TEST(MMDiT, Defaults) {
  // The original's defaults, read from the options (building them would allocate a full-size model).
  json h = dew::to_json(dew::nn::HierarchicalMMDiTOptions());
  EXPECT_EQ(h["base_patch_size"], 8);
  EXPECT_EQ(h["emb_features"], json({512, 768, 1024}));
  EXPECT_EQ(h["num_layers"], json({4, 4, 14}));
  EXPECT_EQ(h["num_heads"], json({8, 12, 16}));
  json s = dew::to_json(dew::nn::SimpleMMDiTOptions());
  EXPECT_EQ(s["patch_size"], 16);
  EXPECT_EQ(s["emb_features"], 768);
  EXPECT_EQ(s["num_layers"], 12);
  EXPECT_EQ(s["num_heads"], 12);
}

}  // namespace

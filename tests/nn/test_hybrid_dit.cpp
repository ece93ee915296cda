// hybrid_dit (HybridSSMAttentionDiT): layer patterns, zero output at initialisation, gradients, overfitting,
// remat, equivalence with simple_dit when every layer is attention, the SSM block's wiring, errors and
// the config round trip.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <set>

#include "dew/nn/backbones/backbone.h"
#include "dew/nn/backbones/hybrid_dit.h"
#include "tests/nn/backbone_checks.h"
#include "tests/test_util.h"

namespace {

using at::Tensor;
using dew::json;
using dew::test::error_of;
using namespace dew::test;
using Batch = dew::test::FixedBatch;

json tiny_hybrid(json extra = json::object()) {
  json f = {{"patch_size", 2}, {"emb_features", 32}, {"num_layers", 4},
            {"num_heads", 4},  {"mlp_ratio", 2},     {"ssm_state_dim", 8}};
  f.update(extra);
  return f;
}

dew::nn::HybridDiTImpl* as_hybrid(const dew::BackbonePtr& m) {
  auto* h = dynamic_cast<dew::nn::HybridDiTImpl*>(m.get());
  EXPECT_NE(h, nullptr);
  return h;
}

std::set<std::string> param_names(const dew::BackboneImpl& m) {
  std::set<std::string> out;
  for (const auto& kv : m.named_parameters()) out.insert(kv.key());
  return out;
}

using P = std::vector<std::string>;

TEST(HybridDiT, LayerPatternsFromRatioOrExplicitList) {
  EXPECT_EQ(as_hybrid(dew::models::build("hybrid_dit", tiny_hybrid({{"num_layers", 6}})))->pattern(),
            (P{"ssm", "ssm", "ssm", "attn", "ssm", "ssm"}));
  EXPECT_EQ(
      as_hybrid(dew::models::build("hybrid_dit", tiny_hybrid({{"ssm_attention_ratio", "1:2"}, {"num_layers", 5}})))
          ->pattern(),
      (P{"ssm", "attn", "attn", "ssm", "attn"}));
  EXPECT_EQ(as_hybrid(dew::models::build("hybrid_dit", tiny_hybrid({{"ssm_attention_ratio", "all-ssm"}})))->pattern(),
            (P{"ssm", "ssm", "ssm", "ssm"}));
  EXPECT_EQ(as_hybrid(dew::models::build("hybrid_dit", tiny_hybrid({{"ssm_attention_ratio", "all-attn"}})))->pattern(),
            (P{"attn", "attn", "attn", "attn"}));
  auto m = dew::models::build("hybrid_dit", tiny_hybrid({{"block_pattern", {"attn", "ssm", "attn", "ssm"}}}));
  EXPECT_EQ(as_hybrid(m)->pattern(), (P{"attn", "ssm", "attn", "ssm"}));
  // Parameter names follow each layer's kind.
  auto names = param_names(*m);
  for (const char* n :
       {"blocks.0.attn.qkv.weight", "blocks.0.mlp.fc1.weight", "blocks.1.adaLN_modulation.weight",
        "blocks.1.ssm.s5_forward.log_A_real", "blocks.1.ssm.s5_forward.B_re", "blocks.1.ssm.s5_backward.C_im",
        "blocks.1.ssm.out_proj.weight", "blocks.3.ssm.s5_forward.log_dt", "x_embedder.weight",
        "t_embedder.linear_1.weight", "final_layer.linear.weight"})
    EXPECT_TRUE(names.count(n)) << n;
  EXPECT_FALSE(names.count("blocks.1.attn.qkv.weight"));
  EXPECT_FALSE(names.count("blocks.1.spatial_fusion.dwconv_dil1.weight"));
  auto fused = param_names(
      *dew::models::build("hybrid_dit", tiny_hybrid({{"use_2d_fusion", true}, {"bidirectional_ssm", false}})));
  EXPECT_TRUE(fused.count("blocks.0.spatial_fusion.dwconv_dil3.weight"));
  EXPECT_FALSE(fused.count("blocks.0.ssm.s5_backward.D"));
  EXPECT_FALSE(fused.count("blocks.0.ssm.out_proj.weight"));
  EXPECT_FALSE(fused.count("blocks.3.spatial_fusion.dwconv_dil1.weight"));  // attention layer
}

TEST(HybridDiT, ParameterCountMatchesTheFormulaAndThePythonPeer) {
  // Counted by hand from the layer shapes; bench/peer_hybrid_dit.py prints 64092 and 67036 for these two
  // configurations.
  const int64_t D = 32, N = 8, p = 2, C = 3, hidden = 2 * D;
  const int64_t stem = D * C * p * p + D + 2 * (D * D + D);
  const int64_t adaln = 6 * D * D + 6 * D, mlp = D * hidden + hidden + hidden * D + D;
  const int64_t s5 = 2 * (2 * N + 2 * N * D + 2 * D * N + D + N) + 2 * D * D + D;
  const int64_t attn = 3 * D * D + 3 * D + D * D + D;
  const int64_t final_layer = 2 * D * D + 2 * D + D * p * p * C + p * p * C;
  const int64_t expect = stem + 3 * (adaln + s5 + mlp) + (adaln + attn + mlp) + final_layer;
  auto count = [](const dew::BackbonePtr& m) {
    int64_t n = 0;
    for (const auto& t : m->parameters()) n += t.numel();
    return n;
  };
  EXPECT_EQ(count(dew::models::build("hybrid_dit", tiny_hybrid())), expect);
  EXPECT_EQ(expect, 64092);
  const int64_t fused = expect + 3 * 3 * 9 * D + 4 * D + (6 * D + D);  // fusion convs, labels, text
  EXPECT_EQ(count(dew::models::build(
                "hybrid_dit",
                tiny_hybrid(
                    {{"use_2d_fusion", true}, {"scan_order", "zigzag"}, {"num_classes", 3}, {"context_features", 6}}))),
            fused);
  EXPECT_EQ(fused, 67036);
}

// Zero output at initialisation for every scan order at two resolutions, finite outputs once randomized,
// gradients reaching every parameter (S5, fusion and text) and remat run in the shared suite on the
// family's variants (tests/nn/test_all_backbones.cpp); so does the record's round trip.

TEST(HybridDiT, TheS5AndFusionParametersHaveTheirNames) {
  auto m = dew::models::build("hybrid_dit", tiny_hybrid({{"scan_order", "zigzag"},
                                                         {"use_2d_fusion", true},
                                                         {"num_classes", 4},
                                                         {"context_features", 6},
                                                         {"qk_norm", true}}));
  auto names = param_names(*m);
  for (const char* n : {"blocks.0.ssm.s5_forward.A_imag", "blocks.2.ssm.s5_backward.log_dt",
                        "blocks.1.spatial_fusion.dwconv_dil2.weight", "blocks.0.ssm.out_proj.bias"})
    EXPECT_TRUE(names.count(n)) << n;
}

TEST(HybridDiT, OverfitsOneBatch) {
  auto start = std::chrono::steady_clock::now();
  torch::manual_seed(0);
  auto m = dew::models::build("hybrid_dit", tiny_hybrid({{"use_2d_fusion", true}, {"scan_order", "hilbert"}}));
  Batch b = fixed_batch(4, 3, 8, 1);
  auto [first, last] = overfit(*m, b, 100, 3e-3);
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::cout << "[ hybrid_dit 3:1 + 2D fusion ] loss " << first << " -> " << last << " in 100 steps, " << secs << " s\n";
  EXPECT_LT(last, first / 10);
}

TEST(HybridDiT, AllAttentionEqualsSimpleDiTWithTheSameWeights) {
  json f = tiny_hybrid({{"scan_order", "raster"}, {"num_classes", 2}});
  json fd = f;
  fd.erase("ssm_state_dim");
  auto dit = dew::models::build("simple_dit", fd);
  f["ssm_attention_ratio"] = "all-attn";
  auto hyb = dew::models::build("hybrid_dit", f);
  EXPECT_EQ(param_names(*dit), param_names(*hyb));
  randomize(*dit, 0.05);
  copy_parameters(*dit, *hyb);
  Tensor x = torch::randn({2, 3, 8, 8}), t = torch::rand({2});
  dew::Conditioning cond;
  cond.labels = torch::tensor({1, 2}, at::kLong);
  EXPECT_LT(max_diff(dit->forward(x, t, cond), hyb->forward(x, t, cond)), 1e-6);
}

TEST(HybridDiT, SSMBlockIsGatedResidualS5OfTheNormalisedTokens) {
  // With the adaLN linear reduced to its bias (shift 0, scale 0, gate_msa 1, gate_mlp 0) the block is
  // x + S5(LayerNorm(x)); the S5 part is recomputed from its step-by-step reference layers.
  torch::manual_seed(2);
  const int64_t D = 8;
  dew::nn::SSMDiTBlock block(dew::nn::SSMDiTBlockOptions(D, 4));
  {
    torch::NoGradGuard no_grad;
    block->adaLN_modulation->bias.narrow(0, 2 * D, D).fill_(1.0);  // gate_msa
  }
  Tensor x = torch::randn({2, 9, D}), c = torch::randn({2, D});
  Tensor y = block(x, c, 3, 3);
  Tensor n = torch::layer_norm(x, {D}, {}, {}, 1e-5);
  auto& s5 = block->ssm;
  Tensor f = s5->s5_forward->forward_reference(n);
  Tensor b = s5->s5_backward->forward_reference(n.flip({1})).flip({1});
  Tensor expect = x + torch::matmul(torch::cat({f, b}, -1), s5->out_proj->weight.t()) + s5->out_proj->bias;
  EXPECT_LT(max_diff(y, expect), 1e-5);
}

TEST(HybridDiT, Bfloat16ComputeRunsAndStaysClose) {
  json f = tiny_hybrid({{"use_2d_fusion", true}});
  auto ref = dew::models::build("hybrid_dit", f);
  f["dtype"] = "bfloat16";
  auto lo = dew::models::build("hybrid_dit", f);
  randomize(*ref, 0.05);
  copy_parameters(*ref, *lo);
  Tensor x = torch::randn({2, 3, 8, 8}), t = torch::rand({2});
  Tensor a = ref->forward(x, t, {}), b = lo->forward(x, t, {});
  EXPECT_EQ(b.scalar_type(), at::kFloat);
  EXPECT_LT(max_diff(a, b), 0.05 * (1 + a.abs().max().item<double>()));
}

TEST(HybridDiT, RefusesBadPatternsAndRatios) {
  auto msg = error_of([] {
    dew::models::build(
        "hybrid_dit", tiny_hybrid({{"block_pattern", {"ssm", "attn", "ssm", "attn"}}, {"ssm_attention_ratio", "1:1"}}));
  });
  EXPECT_NE(msg.find("set one, not both"), std::string::npos) << msg;
  msg = error_of([] { dew::models::build("hybrid_dit", tiny_hybrid({{"block_pattern", {"ssm", "attn"}}})); });
  EXPECT_NE(msg.find("block_pattern must name 4 layers"), std::string::npos) << msg;
  msg = error_of([] {
    dew::models::build("hybrid_dit", tiny_hybrid({{"block_pattern", {"ssm", "mamba", "ssm", "attn"}}}));
  });
  EXPECT_NE(msg.find("block_pattern[1]"), std::string::npos) << msg;
  for (const char* bad : {"3-1", "0:0", "a:1", "3:", "half"}) {
    msg = error_of([&] { dew::models::build("hybrid_dit", tiny_hybrid({{"ssm_attention_ratio", bad}})); });
    EXPECT_NE(msg.find("ssm_attention_ratio must be"), std::string::npos) << bad << ": " << msg;
  }
  msg = error_of([] { dew::models::build("hybrid_dit", tiny_hybrid({{"ssm_state_dim", 0}})); });
  EXPECT_NE(msg.find("ssm_state_dim must be > 0"), std::string::npos) << msg;
  msg = error_of([] { dew::models::build("hybrid_dit", tiny_hybrid({{"ssm_ratio", "3:1"}})); });
  EXPECT_NE(msg.find("ssm_attention_ratio"), std::string::npos) << msg;  // the valid fields are listed
  msg = error_of([] { dew::models::build("hybrid_dit", tiny_hybrid({{"num_heads", 3}})); });
  EXPECT_NE(msg.find("hybrid_dit"), std::string::npos) << msg;
  auto m = dew::models::build("hybrid_dit", tiny_hybrid());
  msg = error_of([&] { m->forward(torch::randn({1, 3, 7, 8}), torch::rand({1}), {}); });
  EXPECT_NE(msg.find("multiples of patch_size"), std::string::npos) << msg;
}

TEST(HybridDiT, TheRecordHoldsThePatternAndTheSSMDefaults) {
  auto m = dew::models::build("hybrid_dit", tiny_hybrid({{"block_pattern", {"attn", "ssm", "ssm", "ssm"}},
                                                         {"use_2d_fusion", true},
                                                         {"scan_order", "zigzag"}}));
  const json rec = m->config();
  EXPECT_EQ(rec["architecture"], "hybrid_dit");
  EXPECT_EQ(rec["fields"]["block_pattern"], json({"attn", "ssm", "ssm", "ssm"}));
  EXPECT_EQ(rec["fields"]["ssm_state_dim"], 8);
  EXPECT_EQ(rec["fields"]["bidirectional_ssm"], true);
}

}  // namespace

// simple_udit and uvit: output shapes at two resolutions, zero output at initialisation, gradients to every
// parameter, overfitting one batch, the skip fusion against SimpleDiT, each UViT block option against a
// step-by-step recomputation, the position table's rows, masking, refusals and the config round trip.
#include <gtest/gtest.h>

#include <torch/torch.h>
#include "dew/nn/attention.h"
#include "tests/nn/backbone_checks.h"
#include "tests/test_util.h"

#include <chrono>
#include <cmath>
#include <functional>
#include <iostream>
#include <map>

#include "dew/core/error.h"
#include "dew/nn/backbones/backbone.h"
#include "dew/nn/backbones/simple_dit.h"
#include "dew/nn/backbones/simple_udit.h"
#include "dew/nn/backbones/uvit.h"

namespace {

using at::Tensor;
using dew::json;
using dew::test::error_of;
using namespace dew::test;
using Batch = dew::test::FixedBatch;

json tiny_udit(json extra = json::object()) {
  json f = {{"patch_size", 2}, {"emb_features", 32}, {"num_layers", 2}, {"num_heads", 4}, {"mlp_ratio", 2}};
  f.update(extra);
  return f;
}
json tiny_uvit(json extra = json::object()) {
  json f = {{"patch_size", 2}, {"emb_features", 32}, {"num_layers", 2},
            {"num_heads", 4},  {"mlp_ratio", 2},     {"image_size", 16}};
  f.update(extra);
  return f;
}

dew::Conditioning labels_and_text(int64_t B, int64_t classes, int64_t features, uint64_t seed) {
  torch::manual_seed(seed);
  dew::Conditioning c;
  c.labels = torch::randint(0, classes + 1, {B}, at::kLong);
  c.context = torch::randn({B, 5, features});
  c.context_mask = torch::rand({B, 5}) > 0.3;
  c.context_mask.select(1, 0).fill_(true);
  return c;
}

// Copies parameters into `to` by name; rename maps a name of `to` to the name in `from`.
void copy_renamed(dew::BackboneImpl& from, dew::BackboneImpl& to,
                  const std::function<std::string(const std::string&)>& rename) {
  torch::NoGradGuard no_grad;
  auto src = from.named_parameters();
  for (auto& kv : to.named_parameters()) {
    const std::string n = rename(kv.key());
    ASSERT_TRUE(src.contains(n)) << kv.key() << " -> " << n;
    kv.value().copy_(src[n]);
  }
}

// ================================ simple_udit ================================

// Shapes at two resolutions, zero output at initialisation, gradients reaching every parameter (every UViT
// option) and remat run in the shared suite on the families' variants (tests/nn/test_all_backbones.cpp).

TEST(UDiTUViT, SimpleUDiTOverfitsOneBatch) {
  auto start = std::chrono::steady_clock::now();
  torch::manual_seed(0);
  auto m = dew::models::build("simple_udit", tiny_udit({{"num_classes", 4}, {"context_features", 8}}));
  Batch b = fixed_batch(4, 3, 8, 4);
  b.cond = labels_and_text(4, 4, 8, 5);
  auto [first, last] = overfit(*m, b, 150, 3e-3);
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::cout << "[ simple_udit ] loss " << first << " -> " << last << " in 150 steps, " << secs << " s\n";
  EXPECT_LT(last, first / 10);
}

// With every up_dense = [I | 0] the skips are ignored: the U-DiT is the plain DiT over down blocks, mid
// block and up blocks in sequence. With [0 | I] each up block reads only its mirror down block's output,
// so the output is that of a DiT over [down_0, up_{half-1}] alone, which fixes the pairing order.
TEST(UDiTUViT, SimpleUDiTSkipFusionAgainstSimpleDiT) {
  for (const char* order : {"raster", "zigzag"}) {
    json f = tiny_udit({{"num_layers", 4}, {"num_classes", 3}, {"context_features", 6}, {"scan_order", order}});
    auto u = dew::models::build("simple_udit", f);
    randomize(*u, 0.1);
    auto* ud = dynamic_cast<dew::nn::SimpleUDiTImpl*>(u.get());
    ASSERT_NE(ud, nullptr);
    const int64_t d = 32;
    Tensor eye = torch::eye(d), zero = torch::zeros({d, d});
    auto set_fusion = [&](const Tensor& w) {
      torch::NoGradGuard no_grad;
      for (auto& l : ud->up_dense_list) {
        l->weight.copy_(w);
        l->bias.zero_();
      }
    };
    Tensor x = torch::randn({2, 3, 8, 12}), t = torch::rand({2});
    dew::Conditioning cond = labels_and_text(2, 3, 6, 6);
    auto stem = [](const std::string& n) { return n.rfind("blocks.", 0) != 0; };

    set_fusion(torch::cat({eye, zero}, 1));
    json g = f;
    g["num_layers"] = 5;
    auto seq = dew::models::build("simple_dit", g);
    const std::map<std::string, std::string> five{{"blocks.0.", "down_blocks.0."},
                                                  {"blocks.1.", "down_blocks.1."},
                                                  {"blocks.2.", "mid_block."},
                                                  {"blocks.3.", "up_blocks.0."},
                                                  {"blocks.4.", "up_blocks.1."}};
    auto rename = [&](const std::map<std::string, std::string>& table) {
      return [&table, stem](const std::string& n) {
        if (stem(n)) return n;
        for (const auto& [a, b] : table)
          if (n.rfind(a, 0) == 0) return b + n.substr(a.size());
        return n;
      };
    };
    copy_renamed(*u, *seq, rename(five));
    Tensor a = u->forward(x, t, cond), b = seq->forward(x, t, cond);
    EXPECT_GT(a.abs().max().item<double>(), 1e-3);
    EXPECT_LT(max_diff(a, b), 1e-5) << order;

    set_fusion(torch::cat({zero, eye}, 1));
    g["num_layers"] = 2;
    auto pair = dew::models::build("simple_dit", g);
    const std::map<std::string, std::string> two{{"blocks.0.", "down_blocks.0."}, {"blocks.1.", "up_blocks.1."}};
    copy_renamed(*u, *pair, rename(two));
    Tensor c = u->forward(x, t, cond), e = pair->forward(x, t, cond);
    EXPECT_LT(max_diff(c, e), 1e-5) << order;
    EXPECT_GT(max_diff(a, c), 1e-3) << order;  // the skip does change the result
  }
}

TEST(UDiTUViT, SimpleUDiTRefusals) {
  auto m = dew::models::build("simple_udit", tiny_udit({{"num_layers", 2}}));
  auto msg = error_of([] { dew::models::build("simple_udit", tiny_udit({{"num_layers", 3}})); });
  EXPECT_NE(msg.find("simple_udit: num_layers must be even"), std::string::npos) << msg;
  EXPECT_NE(msg.find("got 3"), std::string::npos) << msg;
  msg = error_of([] { dew::models::build("simple_udit", tiny_udit({{"num_heads", 3}})); });
  EXPECT_NE(msg.find("simple_udit: emb_features / num_heads"), std::string::npos) << msg;
  msg = error_of([&] { m->forward(torch::randn({1, 3, 7, 8}), torch::rand({1}), {}); });
  EXPECT_NE(msg.find("simple_udit: H and W must be multiples of patch_size"), std::string::npos) << msg;
  dew::Conditioning lab;
  lab.labels = torch::tensor({0}, at::kLong);
  msg = error_of([&] { m->forward(torch::randn({1, 3, 8, 8}), torch::rand({1}), lab); });
  EXPECT_NE(msg.find("simple_udit: labels given but num_classes is 0"), std::string::npos) << msg;
}

// ================================ uvit ================================

// Every option, one at a time and all together.
std::vector<json> uvit_variants() {
  return {json::object(),
          {{"use_projection", true}},
          {{"use_self_and_cross", true}},
          {{"norm_inputs", true}},
          {{"explicitly_add_residual", false}},
          {{"add_residualblock_output", true}},
          {{"use_projection", true},
           {"use_self_and_cross", true},
           {"norm_inputs", true},
           {"explicitly_add_residual", false},
           {"add_residualblock_output", true},
           {"activation", "gelu"}}};
}

TEST(UDiTUViT, UViTOverfitsOneBatch) {
  const std::vector<json> configs{json::object(), uvit_variants().back()};
  for (const json& v : configs) {
    auto start = std::chrono::steady_clock::now();
    torch::manual_seed(0);
    json f = tiny_uvit({{"num_classes", 4}, {"context_features", 8}});
    f.update(v);
    auto m = dew::models::build("uvit", f);
    Batch b = fixed_batch(4, 3, 8, 11);
    b.cond = labels_and_text(4, 4, 8, 12);
    auto [first, last] = overfit(*m, b, 120, 3e-3);
    double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::cout << "[ uvit " << v.dump() << " ] loss " << first << " -> " << last << " in 120 steps, " << secs << " s\n";
    EXPECT_LT(last, first / 10) << v.dump();
  }
}

// ---- a block against a step-by-step recomputation from its weights ----

// The recomputation runs in float64 (weights widened as they are read), so the bound below is float32's own
// error of the block, not the difference of two float32 summation orders.
Tensor widened(const Tensor& w) { return w.to(torch::kDouble); }

Tensor rms(const Tensor& x, const Tensor& w, double eps) {
  return x * torch::rsqrt(x.pow(2).mean(-1, true) + eps) * widened(w);
}

Tensor mha(const Tensor& xq, const Tensor& xkv, const dew::nn::UViTAttention& a, int64_t heads) {
  const int64_t B = xq.size(0), S = xq.size(1), L = xkv.size(1), D = xq.size(2), hd = D / heads;
  Tensor q = torch::matmul(xq, widened(a->to_q->weight).t()).view({B, S, heads, hd}).permute({0, 2, 1, 3});
  Tensor k = torch::matmul(xkv, widened(a->to_k->weight).t()).view({B, L, heads, hd}).permute({0, 2, 1, 3});
  Tensor v = torch::matmul(xkv, widened(a->to_v->weight).t()).view({B, L, heads, hd}).permute({0, 2, 1, 3});
  Tensor p = torch::softmax(torch::matmul(q, k.transpose(-1, -2)) / std::sqrt(static_cast<double>(hd)), -1);
  Tensor o = torch::matmul(p, v).permute({0, 2, 1, 3}).reshape({B, S, D});
  return torch::matmul(o, widened(a->to_out->weight).t());
}

TEST(UDiTUViT, UViTBlockEqualsStepByStepRecurrenceForEveryOptionCombination) {
  for (int bits = 0; bits < 16; ++bits) {
    torch::manual_seed(bits);
    const bool proj = bits & 1, sc = bits & 2, norm_in = bits & 4, add = bits & 8;
    auto o = dew::nn::UViTOptions()
                 .emb_features(16)
                 .num_heads(2)
                 .mlp_ratio(2)
                 .norm_epsilon(1e-5)
                 .use_projection(proj)
                 .use_self_and_cross(sc)
                 .norm_inputs(norm_in)
                 .explicitly_add_residual(add)
                 .attention_impl("reference");
    dew::nn::UViTBlock block(o);
    {
      torch::NoGradGuard no_grad;
      for (auto& p : block->parameters()) p.add_(torch::randn_like(p) * 0.2);
    }
    Tensor x = torch::randn({2, 5, 16});
    const double eps = 1e-5;
    torch::NoGradGuard no_grad;
    Tensor xd = widened(x);
    Tensor x0 = norm_in ? rms(xd, block->norm_in->weight, eps) : xd;
    Tensor h = proj ? torch::matmul(x0, widened(block->project_in->weight).t()) : x0;
    Tensor ctx = h;
    if (sc) {
      Tensor n = rms(h, block->norm1->weight, eps);
      h = h + mha(n, n, block->attn1, 2);
    }
    h = h + mha(rms(h, block->norm2->weight, eps), ctx, block->attn2, 2);
    Tensor u = torch::matmul(rms(h, block->norm3->weight, eps), widened(block->ff->net_0->weight).t()) +
               widened(block->ff->net_0->bias);
    Tensor lin = u.narrow(-1, 0, 32), gate = u.narrow(-1, 32, 32);
    Tensor g = 0.5 * gate * (1 + torch::tanh(std::sqrt(2.0 / M_PI) * (gate + 0.044715 * gate.pow(3))));
    h = h + torch::matmul(lin * g, widened(block->ff->net_2->weight).t()) + widened(block->ff->net_2->bias);
    if (proj) h = torch::matmul(h, widened(block->project_out->weight).t());
    Tensor expected = add ? x0 + h : h;
    // float32 keeps about 7 digits: 4e-6 of the largest output, well above its rounding and far below any
    // wrong term (a missing residual or norm moves the output by its own size).
    const double scale = expected.abs().max().item<double>();
    const double diff = max_diff(block(x).to(torch::kDouble), expected);
    std::cout << "[ bits " << bits << " ] max |block - f64| " << diff << " of max |out| " << scale << "\n";
    EXPECT_LT(diff, 4e-6 * scale) << "bits " << bits;
  }
}

// ---- position table, label and text tokens ----

TEST(UDiTUViT, UViTSmallerImagesUseTheFirstRowsOfThePositionTable) {
  auto m = dew::models::build("uvit", tiny_uvit());
  auto* u = dynamic_cast<dew::nn::UViTImpl*>(m.get());
  ASSERT_NE(u, nullptr);
  EXPECT_EQ(u->pos_encoding.sizes(), (std::vector<int64_t>{64, 32}));  // (16 / 2)^2 rows
  randomize(*m, 0.1);
  Tensor x = torch::randn({2, 3, 4, 6}), t = torch::rand({2});  // a 2 x 3 grid: rows 0..5
  Tensor y = m->forward(x, t, {});
  torch::NoGradGuard no_grad;
  u->pos_encoding.narrow(0, 6, 58).add_(1.0);
  EXPECT_EQ(max_diff(m->forward(x, t, {}), y), 0.0);
  u->pos_encoding.narrow(0, 5, 1).add_(1.0);
  EXPECT_GT(max_diff(m->forward(x, t, {}), y), 1e-4);
  // 10 x 8 patches = 80 > 64 rows.
  auto msg = error_of([&] { m->forward(torch::randn({1, 3, 20, 16}), torch::rand({1}), {}); });
  EXPECT_NE(msg.find("raise image_size"), std::string::npos) << msg;
}

TEST(UDiTUViT, UViTMaskedTextTokensAreIgnoredAndLabelsMatter) {
  auto m = dew::models::build("uvit",
                              tiny_uvit({{"num_classes", 3}, {"context_features", 6}, {"use_self_and_cross", true}}));
  randomize(*m, 0.1);
  Tensor x = torch::randn({2, 3, 8, 8}), t = torch::rand({2});
  dew::Conditioning a = labels_and_text(2, 3, 6, 13);
  a.labels = torch::tensor({3, 1}, at::kLong);
  dew::Conditioning b = a;
  b.context = a.context.masked_fill(a.context_mask.logical_not().unsqueeze(-1), 50.0);
  b.labels = torch::tensor({3, 1}, at::kLong);
  Tensor ya = m->forward(x, t, a);
  EXPECT_LT(max_diff(ya, m->forward(x, t, b)), 1e-5);
  dew::Conditioning absent = a;
  absent.labels = Tensor();  // row 0's label is the null class already; row 1's differs
  Tensor yn = m->forward(x, t, absent);
  EXPECT_LT(max_diff(ya.select(0, 0), yn.select(0, 0)), 1e-5);
  EXPECT_GT(max_diff(ya.select(0, 1), yn.select(0, 1)), 1e-4);
  dew::Conditioning unmasked = b;
  unmasked.context_mask = Tensor();
  EXPECT_GT(max_diff(ya, m->forward(x, t, unmasked)), 1e-4);
}

TEST(UDiTUViT, UViTRefusals) {
  auto msg = error_of([] { dew::models::build("uvit", tiny_uvit({{"num_layers", 3}})); });
  EXPECT_NE(msg.find("uvit: num_layers must be even"), std::string::npos) << msg;
  msg = error_of([] { dew::models::build("uvit", tiny_uvit({{"num_heads", 5}})); });
  EXPECT_NE(msg.find("uvit: emb_features must be divisible by num_heads"), std::string::npos) << msg;
  msg = error_of([] { dew::models::build("uvit", tiny_uvit({{"activation", "tanh"}})); });
  EXPECT_NE(msg.find("activation"), std::string::npos) << msg;
  EXPECT_NE(msg.find("swish"), std::string::npos) << msg;
  msg = error_of([] { dew::models::build("uvit", tiny_uvit({{"image_size", 1}})); });
  EXPECT_NE(msg.find("uvit: image_size must be >= patch_size"), std::string::npos) << msg;
  msg = error_of([] { dew::models::build("uvit", tiny_uvit({{"use_projectoin", true}})); });
  EXPECT_NE(msg.find("use_projection"), std::string::npos) << msg;
  auto plain = dew::models::build("uvit", tiny_uvit());
  dew::Conditioning text;
  text.context = torch::randn({1, 4, 6});
  msg = error_of([&] { plain->forward(torch::randn({1, 3, 8, 8}), torch::rand({1}), text); });
  EXPECT_NE(msg.find("uvit: a text context was given but context_features is 0"), std::string::npos) << msg;
}

TEST(UDiTUViT, UViTRematAndBfloat16Agree) {
  dew::nn::AttentionChunkRowsScope small_blocks(5);  // the chunked model's attention splits into blocks
  json f = tiny_uvit({{"context_features", 6}, {"use_self_and_cross", true}});
  auto m = dew::models::build("uvit", f);
  json g = f;
  g["remat"] = true;
  g["attention_impl"] = "chunked";
  auto r = dew::models::build("uvit", g);
  randomize(*m, 0.1);
  copy_parameters(*m, *r);
  Batch b = fixed_batch(2, 3, 8, 14);
  b.cond = labels_and_text(2, 3, 6, 15);
  b.cond.labels = Tensor();
  for (auto* net : {m.get(), r.get()}) {
    net->zero_grad();
    torch::mse_loss(net->forward(b.x_t, b.t, b.cond), b.target).backward();
  }
  auto pm = m->named_parameters(), pr = r->named_parameters();
  for (const auto& kv : pm) EXPECT_LT(max_diff(kv.value().grad(), pr[kv.key()].grad()), 1e-5) << kv.key();
  g = f;
  g["dtype"] = "bfloat16";
  auto lo = dew::models::build("uvit", g);
  copy_parameters(*m, *lo);
  torch::NoGradGuard no_grad;
  Tensor ya = m->forward(b.x_t, b.t, b.cond), yb = lo->forward(b.x_t, b.t, b.cond);
  EXPECT_EQ(yb.scalar_type(), at::kFloat);
  EXPECT_LT(max_diff(ya, yb), 0.05 * (1 + ya.abs().max().item<double>()));
}

}  // namespace

// Text encoders: the byte-level encoder (tokenize = bytes + 1, padding invisible to real tokens, empty
// caption -> zeros, gradients, training, remat, errors, registry round trip) and clip_text (Hugging Face
// CLIPTextModel names, safetensors save/load, strict loading errors, causality, the pooling rule, an
// independent Python reference of the formulas, and CLIP's BPE tokenizer on a hand-written vocabulary).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdlib>
#include <fstream>
#include <iostream>
#include <set>

#include "dew/io/safetensors.h"
#include "dew/nn/clip_text.h"
#include "dew/nn/text_encoder.h"
#include "tests/nn/backbone_checks.h"
#include "tests/test_util.h"

using dew::json;
using dew::nn::ByteTextEncoder;
using dew::nn::ByteTextEncoderOptions;
using dew::nn::ClipText;
using dew::nn::ClipTextOptions;
using dew::test::error_of;
using dew::test::max_diff;

namespace {

ByteTextEncoderOptions tiny_byte() {
  return ByteTextEncoderOptions().features(32).num_layers(2).num_heads(4).max_length(16);
}

ClipTextOptions tiny_clip() {
  return ClipTextOptions()
      .vocab_size(100)
      .hidden_size(32)
      .intermediate_size(64)
      .num_hidden_layers(2)
      .num_attention_heads(4)
      .max_position_embeddings(16)
      .eos_token_id(99)
      .bos_token_id(98)
      .pad_token_id(0);
}

void perturb(torch::nn::Module& m, double std) {
  torch::NoGradGuard g;
  for (auto& p : m.parameters()) p.add_(torch::randn_like(p) * std);
}

std::vector<std::string> grad_missing(torch::nn::Module& m) {
  std::vector<std::string> out;
  for (const auto& kv : m.named_parameters()) {
    const auto& g = kv.value().grad();
    if (!g.defined() || g.abs().max().item<double>() == 0.0) out.push_back(kv.key());
  }
  return out;
}

/// The 16 parameter names of each CLIPEncoderLayer in transformers' CLIPTextModel.state_dict(), plus the
/// embeddings and the final norm (position_ids is a non-persistent buffer since transformers 4.31).
std::set<std::string> hf_clip_text_names(int layers) {
  std::set<std::string> s{"text_model.embeddings.token_embedding.weight",
                          "text_model.embeddings.position_embedding.weight", "text_model.final_layer_norm.weight",
                          "text_model.final_layer_norm.bias"};
  for (int i = 0; i < layers; ++i) {
    const std::string p = "text_model.encoder.layers." + std::to_string(i) + ".";
    for (const char* proj : {"k_proj", "v_proj", "q_proj", "out_proj"})
      for (const char* wb : {"weight", "bias"}) s.insert(p + "self_attn." + proj + "." + wb);
    for (const char* n : {"layer_norm1", "layer_norm2", "mlp.fc1", "mlp.fc2"})
      for (const char* wb : {"weight", "bias"}) s.insert(p + n + "." + wb);
  }
  return s;
}

template <class M>
std::set<std::string> names_of(const M& m) {
  std::set<std::string> s;
  for (const auto& kv : m->named_parameters()) s.insert(kv.key());
  return s;
}

}  // namespace

// ---------------------------------------------------------------------------------------------------------
// byte_text_encoder
// ---------------------------------------------------------------------------------------------------------

TEST(TextEncoders, ByteTokenizeIsBytesPlusOne) {
  ByteTextEncoder enc(tiny_byte().max_length(8));
  const std::string e_acute = "\xC3\xA9";
  auto [ids, mask] = enc->tokenize({"hi", "", "abcdefghij", e_acute});
  ASSERT_EQ(ids.sizes(), (std::vector<int64_t>{4, 8}));
  ASSERT_EQ(ids.scalar_type(), torch::kLong);
  ASSERT_EQ(mask.scalar_type(), torch::kBool);
  auto row = [&](int i) { return std::vector<int64_t>(ids[i].data_ptr<int64_t>(), ids[i].data_ptr<int64_t>() + 8); };
  EXPECT_EQ(row(0), (std::vector<int64_t>{'h' + 1, 'i' + 1, 0, 0, 0, 0, 0, 0}));
  EXPECT_EQ(row(1), (std::vector<int64_t>(8, 0)));
  EXPECT_EQ(row(2), (std::vector<int64_t>{'a' + 1, 'b' + 1, 'c' + 1, 'd' + 1, 'e' + 1, 'f' + 1, 'g' + 1, 'h' + 1}));
  EXPECT_EQ(row(3), (std::vector<int64_t>{0xC3 + 1, 0xA9 + 1, 0, 0, 0, 0, 0, 0}));
  EXPECT_EQ(row(0).size(), 8u);
  EXPECT_TRUE(torch::equal(mask.sum(1), torch::tensor({2, 0, 8, 2}, torch::kLong)));
}

TEST(TextEncoders, ByteTokenizeMaskAndRoundTrip) {
  ByteTextEncoder enc(tiny_byte().max_length(8));
  std::vector<std::string> texts{"hi", "", "abcdefghij", "\xC3\xA9!"};
  auto [ids, mask] = enc->tokenize(texts);
  std::vector<int64_t> counts{2, 0, 8, 3};
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(mask[i].sum().item<int64_t>(), counts[i]) << i;
    // The mask is exactly the non-padding ids, and the ids decode back to the (truncated) text.
    EXPECT_TRUE(torch::equal(mask[i], ids[i].ne(0))) << i;
    std::string back;
    for (int64_t j = 0; j < counts[i]; ++j) back += static_cast<char>(ids[i][j].item<int64_t>() - 1);
    EXPECT_EQ(back, texts[i].substr(0, 8)) << i;
  }
}

TEST(TextEncoders, ByteForwardShapesAndEmptyCaptionIsZero) {
  torch::manual_seed(0);
  ByteTextEncoder enc(tiny_byte());
  perturb(*enc, 0.1);
  dew::TextEncoding e = enc->encode({"a red square", "", "x"});
  ASSERT_EQ(e.context.sizes(), (std::vector<int64_t>{3, 16, 32}));
  ASSERT_EQ(e.pooled.sizes(), (std::vector<int64_t>{3, 32}));
  ASSERT_EQ(e.mask.sizes(), (std::vector<int64_t>{3, 16}));
  EXPECT_EQ(e.context.scalar_type(), torch::kFloat);
  EXPECT_EQ(e.pooled.scalar_type(), torch::kFloat);
  EXPECT_TRUE(torch::isfinite(e.context).all().item<bool>());
  EXPECT_TRUE(torch::isfinite(e.pooled).all().item<bool>());
  EXPECT_FALSE(e.mask[1].any().item<bool>());
  EXPECT_EQ(e.context[1].abs().max().item<double>(), 0.0);
  EXPECT_EQ(e.pooled[1].abs().max().item<double>(), 0.0);
  // Padding positions of the other rows are zero too; the real ones are not.
  EXPECT_EQ(e.context[0].narrow(0, 12, 4).abs().max().item<double>(), 0.0);
  EXPECT_GT(e.context[0].narrow(0, 0, 12).abs().min().item<double>(), 0.0);
  // pooled is the mean of the real final states.
  EXPECT_LT(max_diff(e.pooled[0], e.context[0].narrow(0, 0, 12).mean(0)), 1e-6);
  EXPECT_LT(max_diff(e.pooled[2], e.context[2][0]), 1e-6);
}

TEST(TextEncoders, BytePaddingDoesNotChangeRealTokens) {
  torch::manual_seed(1);
  ByteTextEncoder enc(tiny_byte());
  perturb(*enc, 0.2);
  enc->eval();
  auto [ids, mask] = enc->tokenize({"hello there", "cat"});
  torch::NoGradGuard g;
  auto a = enc->forward(ids, mask);
  // Junk ids under the mask: the real tokens' outputs must not move.
  auto junk = torch::where(mask, ids, torch::randint(1, 257, ids.sizes(), torch::kLong));
  auto b = enc->forward(junk, mask);
  EXPECT_LT(max_diff(a.context, b.context), 1e-6);
  EXPECT_LT(max_diff(a.pooled, b.pooled), 1e-6);
  // A shorter padded length gives the same real outputs.
  auto c = enc->forward(ids.narrow(1, 0, 11), mask.narrow(1, 0, 11));
  EXPECT_LT(max_diff(a.context.narrow(1, 0, 11), c.context), 1e-5);
  EXPECT_LT(max_diff(a.pooled, c.pooled), 1e-5);
  // And the second caption alone in a batch of one gives the same as inside the batch.
  auto d = enc->forward(ids.narrow(0, 1, 1).narrow(1, 0, 3), mask.narrow(0, 1, 1).narrow(1, 0, 3));
  EXPECT_LT(max_diff(a.context[1].narrow(0, 0, 3), d.context[0]), 1e-5);
}

TEST(TextEncoders, ByteGradientsReachEveryParameter) {
  torch::manual_seed(2);
  ByteTextEncoder enc(tiny_byte());
  perturb(*enc, 0.1);
  auto e = enc->encode({"gradient check", "ab"});
  ((e.context * torch::randn_like(e.context)).sum() + (e.pooled * torch::randn_like(e.pooled)).sum()).backward();
  EXPECT_EQ(grad_missing(*enc), std::vector<std::string>{});
}

TEST(TextEncoders, ByteEncoderTrains) {
  // Regress the pooled vector of four captions on fixed targets: the loss must fall at least 10x.
  torch::manual_seed(3);
  ByteTextEncoder enc(tiny_byte());
  std::vector<std::string> texts{"red", "green", "blue square", "a yellow circle"};
  auto [ids, mask] = enc->tokenize(texts);
  auto target = torch::randn({4, 32});
  torch::optim::Adam opt(enc->parameters(), torch::optim::AdamOptions(3e-3));
  double first = 0, last = 0;
  for (int s = 0; s < 150; ++s) {
    opt.zero_grad();
    auto loss = torch::mse_loss(enc->forward(ids, mask).pooled, target);
    loss.backward();
    opt.step();
    (s == 0 ? first : last) = loss.item<double>();
  }
  std::cout << "byte_text_encoder overfit: first loss " << first << ", last loss " << last << "\n";
  EXPECT_LT(last, first / 10);
}

TEST(TextEncoders, ByteRematMatches) {
  torch::manual_seed(4);
  // Both chunked (a's "auto" would be at::scaled_dot_product_attention, whose sums round differently): only
  // remat differs.
  ByteTextEncoder a(tiny_byte().attention_impl("chunked")), b(tiny_byte().remat(true).attention_impl("chunked"));
  perturb(*a, 0.1);
  {
    torch::NoGradGuard g;
    auto src = a->named_parameters();
    for (auto& kv : b->named_parameters()) kv.value().copy_(src[kv.key()]);
  }
  auto [ids, mask] = a->tokenize({"remat", "same values"});
  auto ea = a->forward(ids, mask), eb = b->forward(ids, mask);
  EXPECT_LT(max_diff(ea.context, eb.context), 1e-6);
  auto w = torch::randn_like(ea.context);
  (ea.context * w).sum().backward();
  (eb.context * w).sum().backward();
  auto pb = b->named_parameters();
  for (const auto& kv : a->named_parameters())
    EXPECT_LT(max_diff(kv.value().grad(), pb[kv.key()].grad()), 1e-5) << kv.key();
}

TEST(TextEncoders, ByteErrors) {
  EXPECT_NE(error_of([] { ByteTextEncoder(tiny_byte().num_heads(5)); }).find("num_heads"), std::string::npos);
  EXPECT_NE(error_of([] { ByteTextEncoder(tiny_byte().max_length(0)); }).find("max_length"), std::string::npos);
  EXPECT_NE(error_of([] { ByteTextEncoder(tiny_byte().dropout(1.0)); }).find("dropout"), std::string::npos);
  EXPECT_NE(error_of([] {
              dew::text_encoders::build("byte_text_encoder", {{"dtype", "int8"}});
            }).find("dtype"),
            std::string::npos);
  EXPECT_NE(error_of([] {
              dew::text_encoders::build("byte_text_encoder", {{"width", 3}});
            }).find("valid fields"),
            std::string::npos);
  EXPECT_NE(error_of([] { dew::text_encoders::build("t5", json::object()); }).find("byte_text_encoder"),
            std::string::npos);
  ByteTextEncoder enc(tiny_byte());
  EXPECT_NE(error_of([&] {
              enc->forward(torch::full({1, 4}, 300, torch::kLong), {});
            }).find("[0, 256]"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              enc->forward(torch::ones({1, 17}, torch::kLong), {});
            }).find("max_length"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              enc->forward(torch::ones({1, 4}, torch::kLong), torch::ones({1, 4}));
            }).find("mask"),
            std::string::npos);
}

TEST(TextEncoders, RegistryRoundTrip) {
  for (const auto& [name, fields] : std::vector<std::pair<std::string, json>>{
           {"byte_text_encoder", {{"features", 32}, {"num_layers", 1}, {"max_length", 16}}},
           {"clip_text", dew::to_json(tiny_clip())},
           {"t5_encoder", {{"vocab_size", 100}, {"d_model", 16}, {"d_kv", 8}, {"d_ff", 32}, {"num_layers", 2}}}}) {
    torch::manual_seed(5);
    auto a = dew::text_encoders::build(name, fields);
    const json record = a->config();
    EXPECT_EQ(record["architecture"], name);
    auto b = dew::text_encoders::build(json::parse(record.dump()));
    EXPECT_EQ(b->config(), record);
    EXPECT_EQ(a->features(), b->features());
    auto pa = a->named_parameters(), pb = b->named_parameters();
    ASSERT_EQ(pa.size(), pb.size()) << name;
    torch::NoGradGuard g;
    for (auto& kv : pb) {
      ASSERT_TRUE(pa.contains(kv.key())) << kv.key();
      ASSERT_EQ(kv.value().sizes(), pa[kv.key()].sizes()) << kv.key();
      kv.value().copy_(pa[kv.key()]);
    }
    auto ids = torch::randint(1, 99, {2, 9}, torch::kLong);
    EXPECT_TRUE(torch::equal(a->forward(ids, {}).context, b->forward(ids, {}).context)) << name;
  }
  EXPECT_NE(error_of([] {
              dew::text_encoders::build(json{{"architecture", "clip_text"}, {"extra", 1}});
            }).find("unknown key"),
            std::string::npos);
  auto names = dew::text_encoders::registry().names();
  EXPECT_EQ(names, (std::vector<std::string>{"byte_text_encoder", "clip_text", "t5_encoder"}));
}

// ---------------------------------------------------------------------------------------------------------
// clip_text
// ---------------------------------------------------------------------------------------------------------

TEST(ClipText, ParameterNamesAreHuggingFaces) {
  ClipText m(tiny_clip());
  EXPECT_EQ(names_of(m), hf_clip_text_names(2));
  auto p = m->named_parameters();
  EXPECT_EQ(p["text_model.embeddings.token_embedding.weight"].sizes(), (std::vector<int64_t>{100, 32}));
  EXPECT_EQ(p["text_model.embeddings.position_embedding.weight"].sizes(), (std::vector<int64_t>{16, 32}));
  EXPECT_EQ(p["text_model.encoder.layers.1.mlp.fc1.weight"].sizes(), (std::vector<int64_t>{64, 32}));
  EXPECT_EQ(p["text_model.encoder.layers.1.mlp.fc2.weight"].sizes(), (std::vector<int64_t>{32, 64}));
  // The tree does not depend on dtype, attention_impl or remat.
  ClipText other(tiny_clip().dtype("bfloat16").attention_impl("chunked").remat(true));
  EXPECT_EQ(names_of(other), hf_clip_text_names(2));
}

TEST(ClipText, SaveThenLoadIsIdentical) {
  dew::test::TempDir dir("clip_rt");
  torch::manual_seed(6);
  ClipText a(tiny_clip());
  perturb(*a, 0.1);
  dew::nn::save_clip_text_weights(*a, dir.file("model.safetensors"));
  auto file = dew::io::SafetensorsFile::open(dir.file("model.safetensors"));
  const auto names = file.names();
  EXPECT_EQ(std::set<std::string>(names.begin(), names.end()), hf_clip_text_names(2));
  auto b = dew::text_encoders::build("clip_text", dew::to_json(tiny_clip().weights(dir.file("model.safetensors"))));
  auto pb = b->named_parameters();
  for (const auto& kv : a->named_parameters()) EXPECT_TRUE(torch::equal(kv.value(), pb[kv.key()])) << kv.key();
  auto ids = torch::randint(0, 100, {2, 12}, torch::kLong);
  auto mask = torch::ones({2, 12}, torch::kBool);
  mask[1].narrow(0, 7, 5).fill_(false);
  torch::NoGradGuard g;
  auto ea = a->forward(ids, mask), eb = b->forward(ids, mask);
  EXPECT_TRUE(torch::equal(ea.context, eb.context));
  EXPECT_TRUE(torch::equal(ea.pooled, eb.pooled));

  // Files without the "text_model." prefix, with the old position_ids buffer, or fp16, load too.
  std::map<std::string, at::Tensor> bare;
  for (const auto& kv : a->named_parameters()) bare[kv.key().substr(11)] = kv.value().detach().to(torch::kHalf);
  bare["embeddings.position_ids"] = torch::arange(16, torch::kLong).view({1, 16});
  dew::io::save_safetensors(dir.file("bare.safetensors"), bare);
  ClipText c(tiny_clip());
  dew::nn::load_clip_text_weights(*c, dir.file("bare.safetensors"));
  auto pc = c->named_parameters();
  for (const auto& kv : a->named_parameters())
    EXPECT_TRUE(torch::equal(kv.value().to(torch::kHalf).to(torch::kFloat), pc[kv.key()])) << kv.key();
}

TEST(ClipText, LoadingErrorsNameTheProblem) {
  dew::test::TempDir dir("clip_err");
  ClipText a(tiny_clip());
  std::map<std::string, at::Tensor> good;
  for (const auto& kv : a->named_parameters()) good[kv.key()] = kv.value().detach();

  auto missing = good;
  missing.erase("text_model.encoder.layers.1.mlp.fc2.bias");
  dew::io::save_safetensors(dir.file("missing.safetensors"), missing);
  std::string e = error_of([&] { dew::nn::load_clip_text_weights(*a, dir.file("missing.safetensors")); });
  EXPECT_NE(e.find("lacks"), std::string::npos) << e;
  EXPECT_NE(e.find("text_model.encoder.layers.1.mlp.fc2.bias"), std::string::npos) << e;

  auto shape = good;
  shape["text_model.encoder.layers.0.self_attn.q_proj.weight"] = torch::zeros({32, 16});
  dew::io::save_safetensors(dir.file("shape.safetensors"), shape);
  e = error_of([&] { dew::nn::load_clip_text_weights(*a, dir.file("shape.safetensors")); });
  EXPECT_NE(e.find("text_model.encoder.layers.0.self_attn.q_proj.weight"), std::string::npos) << e;
  EXPECT_NE(e.find("[32, 16]"), std::string::npos) << e;
  EXPECT_NE(e.find("[32, 32]"), std::string::npos) << e;

  auto extra = good;
  extra["text_projection.weight"] = torch::zeros({32, 32});
  dew::io::save_safetensors(dir.file("extra.safetensors"), extra);
  e = error_of([&] { dew::nn::load_clip_text_weights(*a, dir.file("extra.safetensors")); });
  EXPECT_NE(e.find("text_projection.weight"), std::string::npos) << e;

  e = error_of([&] { ClipText(tiny_clip().weights(dir.file("nope.safetensors"))); });
  EXPECT_NE(e.find("nope.safetensors"), std::string::npos) << e;
  // A smaller config than the file: a shape error, not a crash.
  dew::nn::save_clip_text_weights(*a, dir.file("good.safetensors"));
  e = error_of([&] { ClipText(tiny_clip().hidden_size(16).weights(dir.file("good.safetensors"))); });
  EXPECT_NE(e.find("shape"), std::string::npos) << e;

  // A whole CLIPModel file: the text tower is taken, the rest ignored.
  auto whole = good;
  whole["vision_model.embeddings.class_embedding"] = torch::zeros({8});
  whole["text_projection.weight"] = torch::zeros({32, 32});
  whole["logit_scale"] = torch::zeros({});
  dew::io::save_safetensors(dir.file("whole.safetensors"), whole);
  EXPECT_EQ(error_of([&] { dew::nn::load_clip_text_weights(*a, dir.file("whole.safetensors")); }), "");
}

TEST(ClipText, FieldAndInputErrors) {
  EXPECT_NE(error_of([] { ClipText(tiny_clip().num_attention_heads(5)); }).find("num_attention_heads"),
            std::string::npos);
  EXPECT_NE(error_of([] {
              dew::text_encoders::build("clip_text", {{"hidden_act", "relu"}});
            }).find("quick_gelu"),
            std::string::npos);
  ClipText m(tiny_clip());
  std::string e = error_of([&] { m->tokenize({"a cat"}); });
  EXPECT_NE(e.find("tokenizer"), std::string::npos) << e;
  EXPECT_NE(error_of([&] {
              m->forward(torch::full({1, 3}, 100, torch::kLong), {});
            }).find("[0, 100)"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              m->forward(torch::ones({1, 17}, torch::kLong), {});
            }).find("max_position_embeddings"),
            std::string::npos);
}

TEST(ClipText, CausalAttention) {
  torch::manual_seed(7);
  ClipText m(tiny_clip());
  perturb(*m, 0.1);
  torch::NoGradGuard g;
  auto ids = torch::randint(0, 98, {1, 10}, torch::kLong);
  auto changed = ids.clone();
  changed[0][6] = (ids[0][6].item<int64_t>() + 1) % 98;
  auto a = m->forward(ids, {}).context, b = m->forward(changed, {}).context;
  EXPECT_LT(max_diff(a.narrow(1, 0, 6), b.narrow(1, 0, 6)), 1e-6);                    // earlier positions: unchanged
  for (int64_t p = 6; p < 10; ++p) EXPECT_GT(max_diff(a[0][p], b[0][p]), 1e-4) << p;  // the rest: changed
}

TEST(ClipText, PooledRule) {
  torch::manual_seed(8);
  ClipText m(tiny_clip());
  perturb(*m, 0.1);
  torch::NoGradGuard g;
  // Row 0: eos (99) at 3 and 6 -> the first, 3. Row 1: no eos -> position 0 (transformers' argmax of zeros).
  auto ids = torch::tensor({98, 5, 7, 99, 4, 8, 99, 1, 98, 5, 7, 9, 4, 8, 3, 1}, torch::kLong).view({2, 8});
  auto e = m->forward(ids, {});
  EXPECT_TRUE(torch::equal(e.pooled[0], e.context[0][3]));
  EXPECT_TRUE(torch::equal(e.pooled[1], e.context[1][0]));
  // eos_token_id 2 (OpenAI's old configs): pooled at argmax(ids): 70 at 2 in row 0, 88 at 5 in row 1.
  ClipText legacy(tiny_clip().eos_token_id(2));
  perturb(*legacy, 0.1);
  auto ids2 = torch::tensor({10, 5, 70, 3, 4, 1, 2, 3, 10, 5, 7, 9, 4, 88, 3, 1}, torch::kLong).view({2, 8});
  auto l = legacy->forward(ids2, {});
  EXPECT_TRUE(torch::equal(l.pooled[0], l.context[0][2]));
  EXPECT_TRUE(torch::equal(l.pooled[1], l.context[1][5]));
}

TEST(ClipText, GradientsReachEveryParameter) {
  torch::manual_seed(9);
  ClipText m(tiny_clip());
  perturb(*m, 0.1);
  auto ids = torch::randint(0, 100, {2, 9}, torch::kLong);
  ids.select(1, 0).fill_(1);  // token 1 and position 0 get gradient through every row
  auto e = m->forward(ids, {});
  ((e.context * torch::randn_like(e.context)).sum() + (e.pooled * torch::randn_like(e.pooled)).sum()).backward();
  EXPECT_EQ(grad_missing(*m), std::vector<std::string>{});
}

TEST(ClipText, MatchesAnIndependentPythonReference) {
  // Looked up without importing (the import alone takes seconds).
  if (std::system(DEW_PYTHON
                  " -c 'import importlib.util as u, sys; "
                  "sys.exit(any(u.find_spec(m) is None for m in (\"torch\", \"numpy\")))' >/dev/null 2>&1") != 0)
    GTEST_SKIP() << DEW_PYTHON " with torch is not available";
  dew::test::TempDir dir("clip_ref");
  // Two configurations, one Python process (torch's import dominates the time).
  struct Case {
    std::string act;
    int64_t eos;
    std::shared_ptr<dew::nn::ClipTextImpl> model;
    at::Tensor ids, mask;
  };
  std::vector<Case> cases{{"quick_gelu", 99, nullptr, {}, {}}, {"gelu", 2, nullptr, {}, {}}};
  std::string cmd = DEW_PYTHON " " + std::string(DEW_SOURCE_DIR) + "/tests/nn/clip_reference.py";
  for (size_t c = 0; c < cases.size(); ++c) {
    auto& k = cases[c];
    const std::string tag = std::to_string(c);
    torch::manual_seed(10);
    k.model = ClipText(tiny_clip().hidden_act(k.act).eos_token_id(k.eos)).ptr();
    perturb(*k.model, 0.1);
    dew::nn::save_clip_text_weights(*k.model, dir.file("w" + tag + ".safetensors"));
    // Row 0: full length; row 1: bos, 5 tokens, eos, then padding (mask false) of junk ids.
    k.ids = torch::randint(1, 98, {2, 12}, torch::kLong);
    k.ids[0][0] = 98, k.ids[0][11] = 99, k.ids[1][0] = 98, k.ids[1][6] = 99;
    k.mask = torch::ones({2, 12}, torch::kBool);
    k.mask[1].narrow(0, 7, 5).fill_(false);
    json jids = json::array(), jmask = json::array();
    for (int i = 0; i < 2; ++i) {
      json r = json::array(), m = json::array();
      for (int j = 0; j < 12; ++j) {
        r.push_back(k.ids[i][j].item<int64_t>());
        m.push_back(k.mask[i][j].item<bool>() ? 1 : 0);
      }
      jids.push_back(r);
      jmask.push_back(m);
    }
    std::ofstream(dir.file("ids" + tag + ".json")) << jids.dump();
    std::ofstream(dir.file("mask" + tag + ".json")) << jmask.dump();
    std::ofstream(dir.file("config" + tag + ".json")) << json{
        {"num_attention_heads", 4},
        {"hidden_act", k.act},
        {"layer_norm_eps", 1e-5},
        {"eos_token_id", k.eos}}.dump();
    for (const char* f : {"w", "config", "ids", "mask", "out"})
      cmd += " " + dir.file(f + tag +
                            (f == std::string("w")     ? ".safetensors"
                             : f == std::string("out") ? ".f32"
                                                       : ".json"));
  }
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  for (size_t c = 0; c < cases.size(); ++c) {
    auto& k = cases[c];
    std::ifstream f(dir.file("out" + std::to_string(c) + ".f32"), std::ios::binary);
    std::string raw((std::istreambuf_iterator<char>(f)), {});
    ASSERT_EQ(raw.size(), size_t((2 * 12 * 32 + 2 * 32) * 4));
    auto all = torch::from_blob(raw.data(), {2 * 12 * 32 + 2 * 32}, torch::kFloat).clone();
    auto ref_ctx = all.narrow(0, 0, 2 * 12 * 32).view({2, 12, 32});
    auto ref_pool = all.narrow(0, 2 * 12 * 32, 2 * 32).view({2, 32});
    torch::NoGradGuard g;
    auto e = k.model->forward(k.ids, k.mask);
    const double dc = max_diff(e.context, ref_ctx), dp = max_diff(e.pooled, ref_pool);
    std::cout << "clip_text " << k.act << " eos " << k.eos << ": max |dew - python| context " << dc << ", pooled " << dp
              << " (context std " << ref_ctx.std().item<double>() << ")\n";
    EXPECT_LT(dc, 1e-5);
    EXPECT_LT(dp, 1e-5);
  }
}

TEST(TextEncoders, ReducedPrecisionComputeIsClose) {
  // bfloat16 compute (parameters and outputs float32) stays close to float32 for both encoders.
  torch::manual_seed(11);
  ByteTextEncoder a(tiny_byte()), b(tiny_byte().dtype("bfloat16"));
  ClipText c(tiny_clip()), d(tiny_clip().dtype("bfloat16"));
  perturb(*a, 0.1);
  perturb(*c, 0.1);
  torch::NoGradGuard g;
  auto copy = [](torch::nn::Module& src, torch::nn::Module& dst) {
    auto sp = src.named_parameters();
    for (auto& kv : dst.named_parameters()) kv.value().copy_(sp[kv.key()]);
  };
  copy(*a, *b);
  copy(*c, *d);
  auto ids = torch::randint(1, 99, {2, 10}, torch::kLong);
  auto ea = a->forward(ids, {}), eb = b->forward(ids, {});
  auto ec = c->forward(ids, {}), ed = d->forward(ids, {});
  EXPECT_EQ(eb.context.scalar_type(), torch::kFloat);
  EXPECT_EQ(ed.pooled.scalar_type(), torch::kFloat);
  std::cout << "bf16 vs fp32: byte " << max_diff(ea.context, eb.context) << ", clip "
            << max_diff(ec.context, ed.context) << "\n";
  EXPECT_LT(max_diff(ea.context, eb.context), 0.1);
  EXPECT_LT(max_diff(ec.context, ed.context), 0.1);
}

// ---------------------------------------------------------------------------------------------------------
// CLIP tokenizer on a hand-written vocabulary
// ---------------------------------------------------------------------------------------------------------

namespace {

json tiny_vocab() {
  return json{{"h", 0},
              {"e", 1},
              {"l", 2},
              {"o", 3},
              {"w", 4},
              {"r", 5},
              {"d", 6},
              {"!", 7},
              {"4", 8},
              {"2", 9},
              {"o</w>", 10},
              {"d</w>", 11},
              {"!</w>", 12},
              {"4</w>", 13},
              {"2</w>", 14},
              {"he", 15},
              {"ll", 16},
              {"llo</w>", 17},
              {"hello</w>", 18},
              {"wor", 19},
              {"<|startoftext|>", 20},
              {"<|endoftext|>", 21},
              {"a</w>", 22},
              {"'", 23},
              {"s</w>", 24},
              {"'s</w>", 25},
              {"wo", 26}};
}
const std::vector<std::string> kClipMerges{"h e", "l l", "ll o</w>", "he llo</w>", "w o", "wo r", "' s</w>"};

std::vector<int64_t> row(const at::Tensor& t, int i) {
  auto r = t[i].to(torch::kLong).contiguous();
  return std::vector<int64_t>(r.data_ptr<int64_t>(), r.data_ptr<int64_t>() + r.numel());
}

}  // namespace

TEST(ClipTokenizer, HandWrittenVocabulary) {
  dew::test::TempDir dir("clip_tok");
  std::filesystem::create_directories(dir.path / "slow");
  std::filesystem::create_directories(dir.path / "fast");
  std::ofstream(dir.file("slow/vocab.json")) << tiny_vocab().dump();
  {
    std::ofstream m(dir.file("slow/merges.txt"));
    m << "#version: 0.2\n";
    for (const auto& s : kClipMerges) m << s << "\n";
  }
  json tj{{"model",
           {{"type", "BPE"},
            {"vocab", tiny_vocab()},
            {"merges", kClipMerges},
            {"end_of_word_suffix", "</w>"},
            {"unk_token", "<|endoftext|>"}}},
          {"added_tokens", json::array({json{{"id", 20}, {"content", "<|startoftext|>"}},
                                        json{{"id", 21}, {"content", "<|endoftext|>"}}})}};
  std::ofstream(dir.file("fast/tokenizer.json")) << tj.dump();

  for (const std::string& path :
       {dir.file("slow"), dir.file("slow/vocab.json"), dir.file("fast"), dir.file("fast/tokenizer.json")}) {
    dew::data::ClipTokenizer tok(path);
    EXPECT_EQ(tok.bos_id(), 20);
    EXPECT_EQ(tok.eos_id(), 21);
    EXPECT_EQ(tok.pad_id(), 21);
    // "Hello  World! 42": lowercased, whitespace folded; hello merges h+e, l+l, ll+o</w>, he+llo</w>;
    // world merges w+o, wo+r and stops at [wor, l, d</w>]; "!" and each digit are words of their own.
    EXPECT_EQ(tok.encode("Hello  World! 42"), (std::vector<int64_t>{18, 19, 2, 11, 12, 13, 14})) << path;
    // "A's" -> "a" and the contraction "'s" (merge ' + s</w>); surrounding whitespace is dropped.
    EXPECT_EQ(tok.encode("\tA's\n"), (std::vector<int64_t>{22, 25})) << path;
    // An unknown piece becomes the unk token (<|endoftext|>).
    EXPECT_EQ(tok.encode("z"), (std::vector<int64_t>{21})) << path;
    auto [ids, mask] = tok.batch({"Hello  World! 42", "A's", ""}, 12);
    EXPECT_EQ(row(ids, 0), (std::vector<int64_t>{20, 18, 19, 2, 11, 12, 13, 14, 21, 21, 21, 21}));
    EXPECT_EQ(row(ids, 1), (std::vector<int64_t>{20, 22, 25, 21, 21, 21, 21, 21, 21, 21, 21, 21}));
    EXPECT_EQ(row(ids, 2), (std::vector<int64_t>{20, 21, 21, 21, 21, 21, 21, 21, 21, 21, 21, 21}));
    EXPECT_EQ(row(mask, 0), (std::vector<int64_t>{1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0}));
    EXPECT_EQ(row(mask, 1), (std::vector<int64_t>{1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0}));
    EXPECT_EQ(row(mask, 2), (std::vector<int64_t>{1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}));
    // Truncation keeps bos, the first tokens and eos.
    auto [tids, tmask] = tok.batch({"Hello World! 42"}, 5);
    EXPECT_EQ(row(tids, 0), (std::vector<int64_t>{20, 18, 19, 2, 21}));
    EXPECT_TRUE(tmask.all().item<bool>());
  }

  // tokenizer_config.json's pad_token (SD 2 pads with "!").
  std::ofstream(dir.file("slow/tokenizer_config.json")) << json{{"pad_token", "!"}}.dump();
  dew::data::ClipTokenizer padded(dir.file("slow"));
  EXPECT_EQ(padded.pad_id(), 7);
  EXPECT_EQ(row(padded.batch({"A's"}, 6).first, 0), (std::vector<int64_t>{20, 22, 25, 21, 7, 7}));

  // The encoder with a tokenizer: tokenize() pads to max_position_embeddings; eos must agree.
  auto o = tiny_clip().vocab_size(27).eos_token_id(21).tokenizer(dir.file("fast"));
  ClipText m(o);
  auto [mids, mmask] = m->tokenize({"hello world"});
  EXPECT_EQ(row(mids, 0), (std::vector<int64_t>{20, 18, 19, 2, 11, 21, 21, 21, 21, 21, 21, 21, 21, 21, 21, 21}));
  auto e = m->encode({"hello world", ""});
  EXPECT_EQ(e.context.sizes(), (std::vector<int64_t>{2, 16, 32}));
  EXPECT_TRUE(torch::equal(e.pooled[0], e.context[0][5]));
  EXPECT_TRUE(torch::equal(e.pooled[1], e.context[1][1]));
  std::string err =
      error_of([&] { ClipText(tiny_clip().vocab_size(27).eos_token_id(26).tokenizer(dir.file("fast"))); });
  EXPECT_NE(err.find("eos_token_id"), std::string::npos) << err;
  err = error_of([&] { ClipText(tiny_clip().vocab_size(20).eos_token_id(21).tokenizer(dir.file("fast"))); });
  EXPECT_NE(err.find("vocab_size"), std::string::npos) << err;
  err = error_of([&] { dew::data::ClipTokenizer(dir.file("missing_dir")); });
  EXPECT_NE(err.find("missing_dir"), std::string::npos) << err;
  // A merge whose result is not in the vocabulary is refused with its rank.
  std::filesystem::create_directories(dir.path / "bad");
  std::ofstream(dir.file("bad/vocab.json")) << tiny_vocab().dump();
  std::ofstream(dir.file("bad/merges.txt")) << "#version: 0.2\nh e\nr d</w>\n";
  err = error_of([&] { dew::data::ClipTokenizer(dir.file("bad")); });
  EXPECT_NE(err.find("merge 1"), std::string::npos) << err;
}

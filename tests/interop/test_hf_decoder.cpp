// Hugging Face decoder interop: export -> import is bitwise identical for llama, qwen3 and gemma3_text;
// config.json carries the model's fields under the family's names; features a family cannot express are
// refused; sharded checkpoints (model.safetensors.index.json) and bf16 files load; bad folders are errors.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>

#include "dew/data/tokenizer.h"
#include "dew/interop/hf_decoder.h"
#include "dew/io/safetensors.h"
#include "tests/golden_util.h"
#include "tests/test_util.h"

namespace fs = std::filesystem;
using dew::json;
using dew::nn::CausalTransformer;
using dew::nn::CausalTransformerOptions;

namespace {

CausalTransformerOptions tiny() {
  return CausalTransformerOptions()
      .vocab_size(260)
      .emb_features(32)
      .num_layers(2)
      .num_heads(4)
      .num_kv_heads(2)
      .head_dim(8)
      .mlp_features(48)
      .max_seq_len(64)
      .qk_norm(false)
      .tie_embeddings(false);
}

CausalTransformerOptions tiny_for(const std::string& family) {
  auto o = tiny();
  if (family == "qwen3") o.qk_norm(true).attention_bias(true).rope_theta(1e6);
  if (family == "gemma3_text")
    o.qk_norm(true)
        .sandwich_norms(true)
        .scale_offset(1.0)
        .embedding_scale(std::sqrt(32.0))
        .mlp("geglu")
        .layer_types({"sliding_attention", "full_attention"})
        .sliding_window(4)
        .rope_theta(1e6)
        .sliding_rope_theta(1e4)
        .final_logit_softcap(30.0)
        .tie_embeddings(true)
        .norm_eps(1e-6);
  return o;
}

/// A model whose every parameter is random (norm weights too, so a swapped or dropped tensor shows).
CausalTransformer random_model(const CausalTransformerOptions& o, int seed) {
  torch::manual_seed(seed);
  CausalTransformer m(o);
  torch::NoGradGuard g;
  for (auto& p : m->parameters()) p.normal_(0, 0.5);
  m->eval();
  return m;
}

void expect_identical(CausalTransformer& a, CausalTransformer& b) {
  auto pa = a->named_parameters(), pb = b->named_parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (const auto& p : pa) {
    ASSERT_TRUE(pb.contains(p.key())) << p.key();
    EXPECT_TRUE(torch::equal(p.value(), pb[p.key()])) << p.key();
  }
  auto ids = torch::randint(0, a->options.vocab_size(), {2, 9}, torch::kLong);
  torch::NoGradGuard g;
  EXPECT_TRUE(torch::equal(a->forward_tokens(ids), b->forward_tokens(ids)));
}

using dew::test::read_json;

class HfDecoderFamilies : public ::testing::TestWithParam<std::string> {};

TEST_P(HfDecoderFamilies, ExportThenImportIsBitwiseIdentical) {
  std::string family = GetParam();
  dew::test::TempDir dir("hf_" + family);
  auto model = random_model(tiny_for(family), 3);
  auto tok = dew::data::load_tokenizer("byte");
  dew::interop::save_pretrained_decoder(model, dir.path.string(), tok.get(), family);
  for (const char* f :
       {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"})
    EXPECT_TRUE(fs::exists(dir.file(f))) << f;
  auto back = dew::interop::load_pretrained_decoder(dir.path.string());
  dew::json a = dew::to_json(model->options), b = dew::to_json(back->options);
  for (const char* k : {"init_std", "attention_impl", "dtype", "remat", "dropout", "force_fp32_for_softmax"}) {
    a.erase(k);
    b.erase(k);
  }
  if (family != "gemma3_text") {  // sliding fields are meaningless without sliding layers
    for (const char* k : {"sliding_window", "sliding_rope_theta", "layer_types"}) {
      a.erase(k);
      b.erase(k);
    }
  }
  EXPECT_EQ(a, b);
  expect_identical(model, back);
  auto gen = read_json(dir.file("generation_config.json"));
  EXPECT_EQ(gen["eos_token_id"], 256);
}

TEST_P(HfDecoderFamilies, ExportMatchesAnIndependentPythonReference) {
  // tests/interop/hf_reference.py computes logits from the exported folder with its own reading of
  // safetensors and the family's transformers maths; it needs /usr/bin/python3 with torch.
  if (std::system(DEW_PYTHON " -c 'import torch, numpy' >/dev/null 2>&1") != 0)
    GTEST_SKIP() << DEW_PYTHON " with torch is not available";
  std::string family = GetParam();
  dew::test::TempDir dir("hf_ref_" + family);
  auto model = random_model(tiny_for(family), 11);
  {
    // Keep activations in a sane range: random unit-scale weights everywhere would saturate softmax.
    torch::NoGradGuard g;
    for (auto& p : model->named_parameters())
      if (p.key().find("norm") == std::string::npos) p.value().mul_(0.2);
  }
  dew::interop::save_pretrained_decoder(model, dir.file("hf"), nullptr, family);
  auto ids = torch::randint(0, 260, {2, 7}, torch::kLong);
  json rows = json::array();
  for (const auto& row : ids.unbind(0)) {
    std::vector<int64_t> r(row.data_ptr<int64_t>(), row.data_ptr<int64_t>() + row.numel());
    rows.push_back(r);
  }
  std::ofstream(dir.file("ids.json")) << rows.dump();
  std::string cmd = DEW_PYTHON " " + std::string(DEW_SOURCE_DIR) + "/tests/interop/hf_reference.py " + dir.file("hf") +
                    " " + dir.file("ids.json") + " " + dir.file("logits.f32");
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  std::ifstream f(dir.file("logits.f32"), std::ios::binary);
  std::string raw((std::istreambuf_iterator<char>(f)), {});
  ASSERT_EQ(raw.size(), size_t(2 * 7 * 260 * 4));
  auto ref = torch::from_blob(raw.data(), {2, 7, 260}, torch::kFloat).clone();
  torch::NoGradGuard g;
  auto ours = model->forward_tokens(ids);
  double diff = (ours - ref).abs().max().item<double>();
  std::cout << family << ": max |dew - python reference| = " << diff << " (logit std " << ref.std().item<double>()
            << ")\n";
  EXPECT_LT(diff, 1e-4);
}

INSTANTIATE_TEST_SUITE_P(Families, HfDecoderFamilies, ::testing::Values("llama", "qwen3", "gemma3_text"));

TEST(HfDecoder, ConfigFieldsMatchTheModel) {
  dew::test::TempDir dir("hf_config");
  auto model = random_model(tiny_for("llama"), 1);
  dew::interop::save_pretrained_decoder(model, dir.path.string(), nullptr, "llama");
  auto c = read_json(dir.file("config.json"));
  EXPECT_EQ(c["architectures"], json::array({"LlamaForCausalLM"}));
  EXPECT_EQ(c["model_type"], "llama");
  EXPECT_EQ(c["vocab_size"], 260);
  EXPECT_EQ(c["hidden_size"], 32);
  EXPECT_EQ(c["intermediate_size"], 48);
  EXPECT_EQ(c["num_hidden_layers"], 2);
  EXPECT_EQ(c["num_attention_heads"], 4);
  EXPECT_EQ(c["num_key_value_heads"], 2);
  EXPECT_EQ(c["head_dim"], 8);
  EXPECT_EQ(c["max_position_embeddings"], 64);
  EXPECT_EQ(c["rms_norm_eps"], 1e-5);
  EXPECT_EQ(c["rope_theta"], 1e4);
  EXPECT_EQ(c["hidden_act"], "silu");
  EXPECT_EQ(c["tie_word_embeddings"], false);
  EXPECT_EQ(c["torch_dtype"], "float32");
  auto f = dew::io::SafetensorsFile::open(dir.file("model.safetensors"));
  EXPECT_TRUE(f.contains("model.embed_tokens.weight"));
  EXPECT_TRUE(f.contains("model.layers.1.self_attn.k_proj.weight"));
  EXPECT_EQ(f.tensor("model.layers.1.self_attn.k_proj.weight").sizes().vec(), (std::vector<int64_t>{16, 32}));
  EXPECT_TRUE(f.contains("model.layers.0.mlp.gate_proj.weight"));
  EXPECT_TRUE(f.contains("model.norm.weight"));
  EXPECT_TRUE(f.contains("lm_head.weight"));
  EXPECT_FALSE(f.contains("model.lm_head.weight"));
  EXPECT_EQ(f.names().size(), 1u + 2u * 9u + 1u + 1u);  // embed, 2 x (2 norms + 4 attn + 3 mlp), norm, head

  dew::test::TempDir gdir("hf_config_gemma");
  auto gemma = random_model(tiny_for("gemma3_text"), 2);
  dew::interop::save_pretrained_decoder(gemma, gdir.path.string(), nullptr, "auto");
  auto g = read_json(gdir.file("config.json"));
  EXPECT_EQ(g["model_type"], "gemma3_text");
  EXPECT_EQ(g["architectures"], json::array({"Gemma3ForCausalLM"}));
  EXPECT_EQ(g["hidden_activation"], "gelu_pytorch_tanh");
  EXPECT_EQ(g["query_pre_attn_scalar"], 8);
  EXPECT_EQ(g["sliding_window"], 4);
  EXPECT_EQ(g["layer_types"], json::array({"sliding_attention", "full_attention"}));
  EXPECT_EQ(g["sliding_window_pattern"], 2);
  EXPECT_EQ(g["rope_theta"], 1e6);
  EXPECT_EQ(g["rope_local_base_freq"], 1e4);
  EXPECT_EQ(g["final_logit_softcapping"], 30.0);
  EXPECT_EQ(g["tie_word_embeddings"], true);
  auto gf = dew::io::SafetensorsFile::open(gdir.file("model.safetensors"));
  EXPECT_FALSE(gf.contains("lm_head.weight"));
  EXPECT_TRUE(gf.contains("model.layers.0.pre_feedforward_layernorm.weight"));
  EXPECT_TRUE(gf.contains("model.layers.0.self_attn.q_norm.weight"));
}

TEST(HfDecoder, RefusesWhatTheFamilyCannotExpress) {
  dew::test::TempDir dir("hf_refuse");
  auto expect_refused = [&](CausalTransformerOptions o, const std::string& family, const std::string& feature) {
    auto m = random_model(o, 0);
    std::string msg =
        dew::test::error_of([&] { dew::interop::save_pretrained_decoder(m, dir.path.string(), nullptr, family); });
    EXPECT_NE(msg.find(family + " cannot express " + feature), std::string::npos) << msg;
    EXPECT_FALSE(fs::exists(dir.file("config.json"))) << "nothing written for a refused export";
  };
  expect_refused(tiny().qk_norm(true), "llama", "qk_norm");
  expect_refused(tiny().sandwich_norms(true), "llama", "sandwich_norms");
  expect_refused(tiny().sandwich_norms(true).qk_norm(true), "qwen3", "sandwich_norms");
  expect_refused(tiny().mlp("geglu"), "llama", "mlp \"geglu\"");
  expect_refused(tiny().qk_norm(true).scale_offset(1.0), "qwen3", "scale_offset 1");
  expect_refused(tiny().qk_norm(true), "gemma3_text", "sandwich_norms = false");
  expect_refused(tiny().final_logit_softcap(30.0), "llama", "final_logit_softcap 30");
  expect_refused(tiny().layer_types({"sliding_attention", "full_attention"}), "llama", "sliding_attention layers");
  expect_refused(tiny().partial_rotary_factor(0.5), "llama", "partial_rotary_factor 0.5");
  expect_refused(tiny_for("gemma3_text").embedding_scale(1.0), "gemma3_text", "embedding_scale 1");
  auto m = random_model(tiny(), 0);
  std::string msg =
      dew::test::error_of([&] { dew::interop::save_pretrained_decoder(m, dir.path.string(), nullptr, "gpt2"); });
  EXPECT_NE(msg.find("accepted: llama, qwen3, gemma3_text"), std::string::npos) << msg;
}

TEST(HfDecoder, LoadsShardedCheckpoints) {
  dew::test::TempDir dir("hf_shards");
  auto model = random_model(tiny_for("qwen3"), 5);
  dew::interop::save_pretrained_decoder(model, dir.path.string(), nullptr, "qwen3");
  auto all = dew::io::load_safetensors(dir.file("model.safetensors"));
  fs::remove(dir.file("model.safetensors"));
  std::map<std::string, at::Tensor> first, second;
  json map = json::object();
  for (const auto& [name, t] : all) {
    bool one = name.find("layers.1.") == std::string::npos;
    (one ? first : second)[name] = t;
    map[name] = one ? "model-00001-of-00002.safetensors" : "model-00002-of-00002.safetensors";
  }
  ASSERT_FALSE(first.empty());
  ASSERT_FALSE(second.empty());
  dew::io::save_safetensors(dir.file("model-00001-of-00002.safetensors"), first);
  dew::io::save_safetensors(dir.file("model-00002-of-00002.safetensors"), second);
  std::ofstream(dir.file("model.safetensors.index.json"))
      << json{{"metadata", json::object()}, {"weight_map", map}}.dump();
  auto back = dew::interop::load_pretrained_decoder(dir.path.string());
  expect_identical(model, back);

  // An index pointing at a shard that lacks the tensor, and a missing shard, are errors naming them.
  map["model.norm.weight"] = "model-00002-of-00002.safetensors";
  std::ofstream(dir.file("model.safetensors.index.json")) << json{{"weight_map", map}}.dump();
  std::string msg = dew::test::error_of([&] { dew::interop::load_pretrained_decoder(dir.path.string()); });
  EXPECT_NE(msg.find("model.norm.weight"), std::string::npos) << msg;
  fs::remove(dir.file("model-00002-of-00002.safetensors"));
  msg = dew::test::error_of([&] { dew::interop::load_pretrained_decoder(dir.path.string()); });
  EXPECT_NE(msg.find("model-00002-of-00002.safetensors"), std::string::npos) << msg;
}

TEST(HfDecoder, WidensBf16AndFp16) {
  dew::test::TempDir dir("hf_bf16");
  auto model = random_model(tiny_for("llama"), 7);
  dew::interop::save_pretrained_decoder(model, dir.path.string(), nullptr, "llama");
  auto all = dew::io::load_safetensors(dir.file("model.safetensors"));
  std::map<std::string, at::Tensor> low;
  bool half = false;
  for (const auto& [name, t] : all) {
    low[name] = t.to(half ? at::kHalf : at::kBFloat16);
    half = !half;
  }
  dew::io::save_safetensors(dir.file("model.safetensors"), low);
  auto back = dew::interop::load_pretrained_decoder(dir.path.string());
  auto params = back->named_parameters();
  for (const auto& [name, t] : low) {
    std::string key = name.rfind("model.", 0) == 0 ? name.substr(6) : name;
    ASSERT_TRUE(params.contains(key)) << key;
    EXPECT_EQ(params[key].scalar_type(), at::kFloat);
    EXPECT_TRUE(torch::equal(params[key], t.to(at::kFloat))) << key;
    // Widening is exact: rounding the loaded fp32 back gives the stored 16-bit values.
    EXPECT_TRUE(torch::equal(params[key].to(t.scalar_type()), t)) << key;
  }
}

TEST(HfDecoder, ReadsHandWrittenConfigsAndRefusesUnsupportedOnes) {
  // A Gemma 3 style config from an older transformers: no layer_types, a sliding_window_pattern instead.
  json g = {{"model_type", "gemma3_text"}, {"vocab_size", 100},      {"hidden_size", 16},
            {"intermediate_size", 32},     {"num_hidden_layers", 4}, {"num_attention_heads", 2},
            {"num_key_value_heads", 1},    {"head_dim", 8},          {"query_pre_attn_scalar", 8},
            {"sliding_window_pattern", 2}, {"sliding_window", 16},   {"rope_scaling", nullptr}};
  auto o = dew::nn::options_from_hf_config(g);
  EXPECT_EQ(o.layer_types(),
            (std::vector<std::string>{"sliding_attention", "full_attention", "sliding_attention", "full_attention"}));
  EXPECT_EQ(o.mlp(), "geglu");
  EXPECT_DOUBLE_EQ(o.embedding_scale(), 4.0);
  EXPECT_DOUBLE_EQ(o.rope_theta(), 1e6);
  EXPECT_EQ(o.sliding_rope_theta(), 1e4);
  EXPECT_TRUE(o.tie_embeddings());
  auto bad = [&](json c, const std::string& what) {
    std::string msg = dew::test::error_of([&] { dew::nn::options_from_hf_config(c); });
    EXPECT_NE(msg.find(what), std::string::npos) << msg;
  };
  bad(json{{"model_type", "mistral"}}, "model_type \"mistral\" is not supported");
  json s = g;
  s["query_pre_attn_scalar"] = 12;
  bad(s, "query_pre_attn_scalar 12");
  json r = g;
  r["rope_scaling"] = {{"rope_type", "linear"}, {"factor", 8.0}};
  bad(r, "rope_scaling");
  json l = {{"model_type", "llama"},  {"vocab_size", 10},         {"hidden_size", 8},
            {"num_hidden_layers", 1}, {"num_attention_heads", 2}, {"hidden_act", "relu"}};
  bad(l, "hidden_act \"relu\"");

  // transformers 5 writes rope_parameters instead of rope_theta (Gemma 3: one per layer kind); a theta other than
  // the default must be read from there (Qwen3 1e6, not 1e4), and a scaled rope refused.
  json q = {{"model_type", "qwen3"},
            {"vocab_size", 10},
            {"hidden_size", 8},
            {"num_hidden_layers", 1},
            {"num_attention_heads", 2},
            {"head_dim", 4},
            {"rope_parameters", {{"rope_type", "default"}, {"rope_theta", 1e6}}}};
  EXPECT_DOUBLE_EQ(dew::nn::options_from_hf_config(q).rope_theta(), 1e6);
  json g5 = g;
  g5["rope_parameters"] = {{"full_attention", {{"rope_type", "default"}, {"rope_theta", 5e5}}},
                           {"sliding_attention", {{"rope_type", "default"}, {"rope_theta", 2e4}}}};
  const auto o5 = dew::nn::options_from_hf_config(g5);
  EXPECT_DOUBLE_EQ(o5.rope_theta(), 5e5);
  EXPECT_DOUBLE_EQ(o5.sliding_rope_theta().value_or(0.0), 2e4);
  json qs = q;
  qs["rope_parameters"] = {{"rope_type", "yarn"}, {"rope_theta", 1e6}, {"factor", 4.0}};
  bad(qs, "rope_parameters.factor");
  qs["rope_parameters"].erase("factor");
  bad(qs, "rope_parameters.rope_type \"yarn\"");
  json vl = q;  // Qwen3-VL's text_config: M-RoPE sections are RoPE on text; a plain qwen3 config may not carry them
  vl["model_type"] = "qwen3_vl_text";
  vl["rope_parameters"]["mrope_section"] = {2, 1, 1};
  EXPECT_TRUE(dew::nn::options_from_hf_config(vl).qk_norm());
  json qm = q;
  qm["rope_parameters"]["mrope_section"] = {2, 1, 1};
  bad(qm, "rope_parameters.mrope_section");
}

// Qwen-Image 2.1's text path against diffusers' get_qwenimage21_prompt_embeds on a tiny Qwen3-VL and a Qwen-style
// byte-level BPE tokenizer (tests/golden/qwen3_vl_text_reference.py): three prompts of different lengths (one
// empty) batched with left padding, the last layer before the final norm, the system message's tokens dropped,
// right-padded; the states by the golden rule against float32 and float64, the mask exactly.
TEST(HfDecoder, QwenImageTextPathMatchesDiffusers) {
  const std::string dir = std::string(DEW_SOURCE_DIR) + "/tests/golden/qwen_image/text_path";
  const auto file = dew::io::SafetensorsFile::open(dir + "/io.safetensors");
  const auto io = dew::io::load_safetensors(dir + "/io.safetensors");
  const auto prompts = dew::json::parse(file.metadata().at("prompts")).get<std::vector<std::string>>();
  dew::interop::QwenImageTextEncoder te(dir + "/text_encoder", dir + "/tokenizer");
  EXPECT_EQ(te.system_tokens(), std::stoll(file.metadata().at("drop_idx")));
  const auto s = te.encode(prompts);
  ASSERT_TRUE(s.mask.equal(io.at("prompt_embeds_mask"))) << s.mask << io.at("prompt_embeds_mask");
  dew::test::expect_golden("prompt_embeds", s.states, io.at("prompt_embeds_f32"), io.at("prompt_embeds_f64"));
  // A prompt alone gives its rows of the batch (left padding neither moves positions nor is attended).
  const auto alone = te.encode({prompts[0]});
  const int64_t n = alone.mask.sum().item<int64_t>();
  EXPECT_LT((alone.states[0].narrow(0, 0, n) - s.states[0].narrow(0, 0, n)).abs().max().item<double>(), 1e-5);
  EXPECT_NE(dew::test::error_of([&] {
              dew::interop::QwenImageTextEncoder(dir + "/text_encoder", "byte");
            }).find("has no <|im_start|> token"),
            std::string::npos);
  // An edit prompt's image slots and a prompt beyond the positions the model has are refused by name.
  const std::string edit = dew::test::error_of([&] { te.encode({"a cat", "<|vision_start|><|image_pad|>a dog"}); });
  EXPECT_NE(edit.find("prompt 1 holds <|vision_start|>: image-conditioned (edit) prompts are not supported"),
            std::string::npos)
      << edit;
  std::string longer;
  for (int i = 0; i < 200; ++i) longer += "cat ";
  const std::string too_long = dew::test::error_of([&] { te.encode({longer}); });
  EXPECT_NE(too_long.find("exceeds the text encoder's max_position_embeddings 128"), std::string::npos) << too_long;
}

TEST(HfDecoder, DewLayoutAndBadFolders) {
  dew::test::TempDir dir("hf_layout");
  auto model = random_model(tiny(), 9);
  std::map<std::string, at::Tensor> params;
  for (const auto& p : model->named_parameters()) params[p.key()] = p.value().detach();
  dew::interop::save_hf_layout(
      params, {{"architecture", "causal_transformer"}, {"fields", dew::to_json(model->options)}}, dir.path.string());
  auto back = dew::interop::load_pretrained_decoder(dir.path.string());
  expect_identical(model, back);

  // Drop one tensor and add a stray one: both are named.
  params.erase("layers.0.mlp.up_proj.weight");
  params["layers.0.extra"] = torch::zeros({2});
  dew::interop::save_hf_layout(
      params, {{"architecture", "causal_transformer"}, {"fields", dew::to_json(model->options)}}, dir.path.string());
  std::string msg = dew::test::error_of([&] { dew::interop::load_pretrained_decoder(dir.path.string()); });
  EXPECT_NE(msg.find("layers.0.mlp.up_proj.weight"), std::string::npos) << msg;
  params["layers.0.mlp.up_proj.weight"] = model->named_parameters()["layers.0.mlp.up_proj.weight"].detach();
  dew::interop::save_hf_layout(
      params, {{"architecture", "causal_transformer"}, {"fields", dew::to_json(model->options)}}, dir.path.string());
  msg = dew::test::error_of([&] { dew::interop::load_pretrained_decoder(dir.path.string()); });
  EXPECT_NE(msg.find("layers.0.extra"), std::string::npos) << msg;
  msg = dew::test::error_of([&] { dew::interop::load_pretrained_decoder(dir.file("nowhere")); });
  EXPECT_NE(msg.find("config.json"), std::string::npos) << msg;
}

}  // namespace

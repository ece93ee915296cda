// Imported families are built from their reference config.json (transformers keys): bookkeeping keys
// starting with "_" are dropped, unsupported settings are refused by name, dew's own families import none.
#include <gtest/gtest.h>

#include "dew/io/safetensors.h"
#include "dew/nn/backbones/backbone.h"
#include "dew/nn/backbones/causal_transformer.h"
#include "dew/nn/text_encoder.h"
#include "tests/test_util.h"

using dew::json;
using dew::test::error_of;

TEST(ReferenceConfigs, ALlamaConfigBuildsTheCausalTransformer) {
  // The keys of a transformers LlamaConfig.save_pretrained (a small one), bookkeeping included.
  const json config = {{"_name_or_path", "tiny-llama"},
                       {"_attn_implementation_autoset", true},
                       {"architectures", {"LlamaForCausalLM"}},
                       {"model_type", "llama"},
                       {"vocab_size", 96},
                       {"hidden_size", 32},
                       {"intermediate_size", 64},
                       {"num_hidden_layers", 2},
                       {"num_attention_heads", 4},
                       {"num_key_value_heads", 2},
                       {"max_position_embeddings", 128},
                       {"rope_theta", 500000.0},
                       {"rms_norm_eps", 1e-5},
                       {"hidden_act", "silu"},
                       {"tie_word_embeddings", false},
                       {"torch_dtype", "bfloat16"},
                       {"transformers_version", "4.46.0"}};
  const json fields = dew::models::fields_from_reference_config("causal_transformer", config);
  EXPECT_EQ(fields["vocab_size"], 96);
  EXPECT_EQ(fields["emb_features"], 32);
  EXPECT_EQ(fields["num_kv_heads"], 2);
  EXPECT_EQ(fields["head_dim"], 8);
  EXPECT_EQ(fields["mlp"], "swiglu");
  EXPECT_EQ(fields["rope_theta"], 500000.0);
  EXPECT_EQ(fields["tie_embeddings"], false);
  EXPECT_EQ(fields["qk_norm"], false);
  auto lm = dew::models::build_language_model({{"architecture", "causal_transformer"}, {"fields", fields}});
  EXPECT_EQ(lm->options.mlp_features(), 64);
  json scaled = config;
  scaled["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 8.0}};
  EXPECT_NE(
      error_of([&] { dew::models::fields_from_reference_config("causal_transformer", scaled); }).find("rope_scaling"),
      std::string::npos);
}

TEST(ReferenceConfigs, ACLIPTextConfigBuildsClipText) {
  // openai/clip-vit-base-patch32's text_config values inside a CLIPConfig.
  const json config = {{"_name_or_path", "openai/clip-vit-base-patch32"},
                       {"model_type", "clip"},
                       {"projection_dim", 512},
                       {"text_config",
                        {{"model_type", "clip_text_model"},
                         {"vocab_size", 49408},
                         {"hidden_size", 512},
                         {"intermediate_size", 2048},
                         {"num_hidden_layers", 12},
                         {"num_attention_heads", 8},
                         {"max_position_embeddings", 77},
                         {"hidden_act", "quick_gelu"},
                         {"layer_norm_eps", 1e-5},
                         {"bos_token_id", 0},
                         {"eos_token_id", 2},
                         {"pad_token_id", 1},
                         {"dropout", 0.0},
                         {"initializer_factor", 1.0}}}};
  const json fields = dew::models::fields_from_reference_config("clip_text", config);
  EXPECT_EQ(fields["hidden_size"], 512);
  EXPECT_EQ(fields["eos_token_id"], 2);  // OpenAI's configs: pooled at argmax(ids)
  EXPECT_EQ(fields["hidden_act"], "quick_gelu");
  json relu = config;
  relu["text_config"]["hidden_act"] = "relu";
  EXPECT_NE(error_of([&] { dew::models::fields_from_reference_config("clip_text", relu); }).find("hidden_act"),
            std::string::npos);
  // SDXL's text_encoder_2: a CLIPTextModelWithProjection gets its bias-free text_projection.
  json projected = config["text_config"];
  projected["architectures"] = {"CLIPTextModelWithProjection"};
  projected["projection_dim"] = 1280;
  EXPECT_EQ(dew::models::fields_from_reference_config("clip_text", projected)["projection_dim"], 1280);
  EXPECT_EQ(fields["projection_dim"], 0);
  json vision = config["text_config"];
  vision["model_type"] = "clip_vision_model";
  EXPECT_NE(error_of([&] { dew::models::fields_from_reference_config("clip_text", vision); }).find("clip_vision_model"),
            std::string::npos);
}

TEST(ReferenceConfigs, ReferenceCheckpointsLoadThroughTheFamilyKeyMap) {
  dew::test::TempDir dir("reference_weights");
  // A transformers decoder checkpoint: "model." before every decoder name, lm_head at the top, plus an old
  // rotary buffer; loaded through causal_transformer's key map.
  const json fields = {{"vocab_size", 50}, {"emb_features", 16},      {"num_layers", 1},
                       {"num_heads", 2},   {"tie_embeddings", false}, {"max_seq_len", 16}};
  torch::manual_seed(21);
  auto source_model = dew::models::build_language_model({{"architecture", "causal_transformer"}, {"fields", fields}});
  std::map<std::string, at::Tensor> hf;
  for (const auto& kv : source_model->named_parameters())
    hf[kv.key().rfind("lm_head.", 0) == 0 ? kv.key() : "model." + kv.key()] = kv.value().detach().to(at::kBFloat16);
  hf["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch::ones({4});
  dew::io::save_safetensors(dir.file("model.safetensors"), hf);
  auto lm = dew::models::build_language_model({{"architecture", "causal_transformer"}, {"fields", fields}});
  auto report = dew::models::load_reference_weights(*lm, "causal_transformer", fields, dir.path.string());
  EXPECT_EQ(report.skipped, std::vector<std::string>({"model.layers.0.self_attn.rotary_emb.inv_freq"}));
  for (const auto& kv : source_model->named_parameters())
    EXPECT_TRUE(lm->named_parameters()[kv.key()].equal(kv.value().detach().to(at::kBFloat16).to(at::kFloat)))
        << kv.key();

  // A whole CLIPModel file: its text tower loads, the vision tower and projections are skipped.
  const json clip_fields = dew::models::family("clip_text").tiny.fields;
  auto clip_source = dew::text_encoders::build("clip_text", clip_fields);
  std::map<std::string, at::Tensor> whole;
  for (const auto& kv : clip_source->named_parameters()) whole[kv.key()] = kv.value().detach() + 0.5;
  whole["vision_model.embeddings.class_embedding"] = torch::zeros({8});
  whole["text_projection.weight"] = torch::zeros({16, 16});
  dew::io::save_safetensors(dir.file("clip.safetensors"), whole);
  auto clip = dew::text_encoders::build("clip_text", clip_fields);
  report = dew::models::load_reference_weights(*clip, "clip_text", clip_fields, dir.file("clip.safetensors"));
  EXPECT_EQ(report.skipped.size(), 2u);
  for (const auto& kv : clip_source->named_parameters())
    EXPECT_TRUE(clip->named_parameters()[kv.key()].equal(kv.value().detach() + 0.5)) << kv.key();
  EXPECT_NE(error_of([&] {
              dew::models::load_reference_weights(*clip, "unet", {}, dir.file("clip.safetensors"));
            }).find("no reference checkpoint layout"),
            std::string::npos);
}

TEST(ReferenceConfigs, DewFamiliesImportNoConfig) {
  EXPECT_NE(error_of([] { dew::models::fields_from_reference_config("unet", json::object()); }).find("a dew family"),
            std::string::npos);
  EXPECT_NE(error_of([] {
              dew::models::fields_from_reference_config("nonesuch", json::object());
            }).find("not a registered family"),
            std::string::npos);
}

// Replays the fuzzers' fixed findings (fuzz/regressions/<target>/, docs/reliability.md) through the
// library's own entry points: each input must be refused with a dew::Error, never crash or throw another
// type. New regression inputs committed there are picked up without editing this file.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "dew/cli/recipe_args.h"
#include "dew/core/options.h"
#include "dew/data/chat.h"
#include "dew/data/idx.h"
#include "dew/data/post_training_data.h"
#include "dew/data/tokenizer.h"
#include "dew/interop/model_index.h"
#include "dew/io/files.h"
#include "dew/io/image_decode.h"
#include "dew/nn/backbones/backbone.h"
#include "dew/nn/backbones/causal_transformer.h"
#include "dew/nn/clip_text.h"
#include "dew/nn/clip_vision.h"
#include "dew/nn/lora.h"
#include "dew/nn/t5_encoder.h"
#include "dew/sampling/schedulers.h"
#include "fuzz/lora_file_model.h"
#include "tests/test_util.h"

namespace {

namespace fs = std::filesystem;
using dew::json;
using dew::test::error_of;

// The committed inputs of one fuzz target, sorted (an absent folder: none).
std::vector<std::string> regressions(const std::string& target) {
  std::vector<std::string> out;
  const fs::path dir = fs::path(DEW_SOURCE_DIR) / "fuzz" / "regressions" / target;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec))
    if (e.is_regular_file()) out.push_back(e.path().string());
  std::sort(out.begin(), out.end());
  return out;
}

struct Numbers {
  int64_t steps = 10;
  int32_t heads = 4;
  uint64_t seed = 0;
  float scale = 1.0f;
  template <class V>
  void visit(V& v) {
    v("steps", steps, "int64");
    v("heads", heads, "int32");
    v("seed", seed, "uint64");
    v("scale", scale, "float");
  }
};

TEST(FuzzRegressions, OptionsRefuseNumbersTheFieldCannotHold) {
  for (const auto& path : regressions("options")) {
    const json j = json::parse(dew::io::read_file(path, "regression"), nullptr, false);
    if (j.is_discarded()) continue;  // the JSON layer refuses it already
    EXPECT_NE(error_of([&] { dew::from_json<Numbers>(j, "fuzz"); }), "") << path;
  }
  // The error quotes the number as written, not a wrapped or truncated one.
  const std::string big = error_of([] { dew::from_json<Numbers>(json::parse(R"({"steps": 1e30})"), "m"); });
  EXPECT_NE(big.find("m.steps"), std::string::npos) << big;
  EXPECT_NE(big.find("1e+30"), std::string::npos) << big;
  const std::string wrap =
      error_of([] { dew::from_json<Numbers>(json::parse(R"({"steps": 18446744073709551615})"), "m"); });
  EXPECT_NE(wrap.find("18446744073709551615"), std::string::npos) << wrap;
  EXPECT_NE(error_of([] { dew::from_json<Numbers>(json::parse(R"({"heads": 2147483648})"), ""); }), "");
  EXPECT_NE(error_of([] { dew::from_json<Numbers>(json::parse(R"({"seed": -1})"), ""); }), "");
  EXPECT_NE(error_of([] { dew::from_json<Numbers>(json::parse(R"({"scale": 1e39})"), ""); }), "");
  // The limits themselves are accepted.
  const auto ok = dew::from_json<Numbers>(
      json::parse(R"({"steps": -9223372036854775808, "heads": 2147483647, "seed": 18446744073709551615})"), "");
  EXPECT_EQ(ok.steps, std::numeric_limits<int64_t>::min());
  EXPECT_EQ(ok.heads, std::numeric_limits<int32_t>::max());
  EXPECT_EQ(ok.seed, std::numeric_limits<uint64_t>::max());
  EXPECT_EQ(dew::from_json<Numbers>(json::parse(R"({"steps": 3e3})"), "").steps, 3000);
}

TEST(FuzzRegressions, DeeplyNestedValueIsQuotedWithoutRecursingToTheEnd) {
  // 200000 nested lists: quoting the bad value in the error used to recurse once per level.
  std::string text(200000, '[');
  text += std::string(200000, ']');
  json holder = json::object();
  holder["steps"] = json::parse(text);  // moved in: a copy would itself recurse once per level
  const std::string e = error_of([&] { dew::from_json<Numbers>(holder, ""); });
  EXPECT_NE(e.find("steps"), std::string::npos) << e.substr(0, 200);
  EXPECT_LT(e.size(), 400u);
}

TEST(FuzzRegressions, DeeplyNestedPromptIsRefusedWithoutRecursingToTheEnd) {
  // A prompt list nested 200000 deep: it used to be copied and re-rendered as text (both recursive).
  dew::test::TempDir dir("fuzz_prompt");
  const std::string line =
      R"({"prompt": )" + std::string(200000, '[') + std::string(200000, ']') + R"(, "answer": "1"})";
  const std::string file = dir.write("p.jsonl", line + "\n");
  const dew::data::ChatFormat fmt{dew::data::load_tokenizer("byte"), dew::data::ChatTemplate::plain, {}};
  const std::string e = error_of([&] { dew::data::read_prompts(file, fmt, 100); });
  EXPECT_NE(e.find("p.jsonl:1"), std::string::npos) << e.substr(0, 300);
}

TEST(FuzzRegressions, HfBpeFilesAreRefusedWithAMessage) {
  dew::test::TempDir dir("fuzz_hf_bpe");
  for (const auto& path : regressions("hf_bpe")) {
    // Copied as tokenizer.json: the name the loader recognises.
    const std::string file = dir.write("tokenizer.json", dew::io::read_file(path, "regression"));
    EXPECT_NE(error_of([&] { dew::data::load_tokenizer(file); }), "") << path;
  }
}

TEST(FuzzRegressions, SentencePieceModelsAreRefusedWithAMessage) {
  dew::test::TempDir dir("fuzz_sentencepiece");
  for (const auto& path : regressions("sentencepiece")) {
    const std::string file = dir.write("tokenizer.model", dew::io::read_file(path, "regression"));
    const std::string e = error_of([&] { dew::data::load_tokenizer(file); });
    EXPECT_NE(e.find(file), std::string::npos) << path << ": " << e;
  }
}

TEST(FuzzRegressions, IdxFilesAreRefusedWithAMessage) {
  for (const auto& path : regressions("idx"))
    for (int32_t magic : {2051, 2049}) EXPECT_NE(error_of([&] { dew::data::read_idx_bytes(path, magic); }), "") << path;
}

TEST(FuzzRegressions, ImagesAreRefusedOrDecodedWhole) {
  // Most are refused; one (an empty IDAT chunk, a legal PNG) only tripped a sanitizer inside stb.
  for (const auto& path : regressions("image")) {
    const std::string bytes = dew::io::read_file(path, "regression");
    try {
      const auto img =
          dew::io::decode_image(reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size(), 3, path);
      EXPECT_TRUE(img.width > 0 && img.height > 0 && img.pixels) << path;
    } catch (const dew::Error&) {}
  }
  for (const char* name :
       {"jpeg_huffman_counts_over_256.jpg", "jpeg_fill_before_soi_huffman_over_256.jpg", "pnm_zero_width.ppm",
        "pnm_16bit_channel_conversion.pgm", "pnm_maxval_many_digits.pgm", "gif_254_megapixels.gif",
        "png_idat_declares_gigabytes.png", "tga_declares_59_megapixels_holds_57_bytes.tga",
        "jpeg_scan_before_its_huffman_table.jpg", "jpeg_776_bytes_declare_23302x768.jpg",
        "bmp_50_bytes_declare_18639x150.bmp", "tga_rle_41_bytes_declare_3855x3855.tga",
        "tga_rle_header_17_bytes_declares_2586x21254.tga"}) {
    const std::string path = std::string(DEW_SOURCE_DIR) + "/fuzz/regressions/image/" + name;
    const std::string bytes = dew::io::read_file(path, "regression");
    EXPECT_NE(error_of([&] {
                dew::io::decode_image(reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size(), 3, path);
              }),
              "")
        << path;
  }
}

// The seed images are real files (written by Pillow): none of decode_image's checks before stb (JPEG tables
// and scan length, PNG chunks, PNM and TGA headers, BMP rows) may refuse one.
TEST(FuzzRegressions, EverySeedImageDecodes) {
  size_t seen = 0;
  for (const auto& e : std::filesystem::directory_iterator(std::string(DEW_SOURCE_DIR) + "/fuzz/seed/image")) {
    const std::string path = e.path().string(), bytes = dew::io::read_file(path, "seed");
    EXPECT_EQ(error_of([&] {
                const auto img =
                    dew::io::decode_image(reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size(), 3, path);
                EXPECT_TRUE(img.width > 0 && img.height > 0 && img.pixels) << path;
              }),
              "")
        << path;
    ++seen;
  }
  EXPECT_GE(seen, 19u);
}

TEST(FuzzRegressions, ChatLinesAreRefusedWithAMessage) {
  for (const auto& path : regressions("chat")) {
    const std::string line = dew::io::read_file(path, "regression");
    EXPECT_NE(error_of([&] {
                const auto conv = dew::data::parse_chat_record(line, path);
                for (auto t : dew::data::chat_templates()) dew::data::render_chat(conv, t);
              }),
              "")
        << path;
  }
}

TEST(FuzzRegressions, SchedulerConfigsAreRefusedWhereTheyWouldRunOnNaN) {
  // Each reads; the step counts whose sigmas or steps would not be finite are refused by name.
  size_t refused = 0;
  for (const auto& path : regressions("scheduler_config")) {
    auto s = dew::sampling::Scheduler::from_file(path);
    auto* flow = dynamic_cast<dew::sampling::FlowMatchEulerScheduler*>(s.get());
    for (int64_t n : {1, 2, 25}) {
      const std::string e = error_of([&] {
        if (flow && flow->use_dynamic_shifting()) flow->set_timesteps(n, {}, flow->mu_for(256));
        else s->set_timesteps(n);
        at::Tensor x = at::ones({1, 1, 2, 2});
        for (int64_t i = 0; i < s->num_steps(); ++i)
          x = s->step(at::zeros_like(x), i, x, [](int64_t, const at::Tensor& l) { return at::zeros_like(l); });
        EXPECT_TRUE(x.isfinite().all().item<bool>()) << path << " " << n << " steps";
      });
      if (!e.empty()) {
        // the file, or (a step count the train steps cannot hold) the class
        EXPECT_TRUE(e.find(path) != std::string::npos || e.find(s->class_name()) != std::string::npos) << e;
        ++refused;
      }
    }
  }
  EXPECT_GE(refused, 2u);
}

// fuzz/recipe_fuzz.cpp's inputs: the default recipe, the open objects, a --config file, then the arguments.
TEST(FuzzRegressions, RecipeArgumentsAreRefusedByFlag) {
  dew::test::TempDir tmp("fuzz_regressions_recipe");
  const auto inputs = regressions("recipe");
  ASSERT_GE(inputs.size(), 2u);
  for (const auto& path : inputs) {
    std::vector<std::string> parts;
    const std::string bytes = dew::test::read_bytes(path);
    for (size_t start = 0; start <= bytes.size();) {
      const size_t end = std::min(bytes.find('\0', start), bytes.size());
      parts.push_back(bytes.substr(start, end - start));
      start = end + 1;
    }
    ASSERT_GE(parts.size(), 3u) << path;
    const json defaults = json::parse(parts[0]);
    std::vector<std::string> open;
    for (size_t start = 0; start <= parts[1].size();) {
      const size_t end = std::min(parts[1].find(',', start), parts[1].size());
      if (end > start) open.push_back(parts[1].substr(start, end - start));
      start = end + 1;
    }
    std::ofstream(tmp.file("config.json"), std::ios::binary) << parts[2];
    std::vector<std::string> args;
    for (size_t i = 3; i < parts.size(); ++i) {
      if (parts[i] == "@config") {
        args.push_back("--config");
        args.push_back(tmp.file("config.json"));
      } else {
        args.push_back(parts[i]);
      }
    }
    const std::string e = error_of([&] { dew::cli::parse_recipe_args(defaults, args, open); });
    EXPECT_TRUE(e.find("not valid UTF-8") != std::string::npos || e.find("unknown key") != std::string::npos)
        << path << ": " << e;
  }
}

TEST(FuzzRegressions, ModelIndexFilesAreRefusedWithAMessage) {
  dew::test::TempDir tmp("fuzz_regressions_model_index");
  const auto inputs = regressions("model_index");
  ASSERT_GE(inputs.size(), 1u);
  for (const auto& path : inputs) {
    fs::copy_file(path, tmp.path / "model_index.json", fs::copy_options::overwrite_existing);
    std::string class_name;
    const json index = dew::interop::detail::read_model_index(tmp.path.string(),
                                                              {"FluxPipeline", "StableDiffusionPipeline"}, class_name);
    size_t refused = 0;
    for (const char* name : {"unet", "vae", "transformer"}) {
      const std::string e =
          error_of([&] { dew::interop::detail::index_component(index, name, tmp.path / "model_index.json"); });
      refused += e.find("model_index.json") != std::string::npos;
    }
    EXPECT_EQ(refused, 3u) << path;
  }
}

// fuzz/model_config_fuzz.cpp's inputs, each a config.json, read through every translation of the family table
// (models::fields_from_reference_config, as a diffusers folder loads) and the transformers loaders'. Each was a
// nlohmann type error naming no field, undefined behaviour or a hang; none may throw anything but a dew::Error, and
// the translation each one broke refuses it naming the key.
TEST(FuzzRegressions, ModelConfigsAreRefusedNamingTheirKey) {
  std::map<std::string, std::function<void(const json&)>> translations;
  for (const char* family : {"unet_2d_condition", "autoencoder_kl", "autoencoder_kl_qwen_image", "sd3_transformer",
                             "flux_transformer", "qwen_image_transformer", "qwen_image1_transformer"})
    translations[family] = [family](const json& c) { dew::models::fields_from_reference_config(family, c); };
  translations["causal_lm"] = [](const json& c) { dew::nn::options_from_hf_config(c); };
  translations["clip_text"] = [](const json& c) { dew::nn::clip_text_options_from_hf(c); };
  translations["clip_vision"] = [](const json& c) { dew::nn::clip_vision_options_from_hf(c); };
  translations["t5_encoder"] = [](const json& c) { dew::nn::t5_encoder_options_from_hf(c); };
  // input -> the translation it broke and the key its refusal names
  const std::map<std::string, std::pair<std::string, std::string>> expected = {
      {"clip_model_type_not_string", {"clip_text", "model_type"}},
      {"clip_text_projection_dim_not_a_number", {"clip_text", "projection_dim"}},
      {"clip_vision_projection_dim_string", {"clip_vision", "projection_dim"}},
      {"gemma_layer_count_absurd", {"causal_lm", "num_hidden_layers"}},
      {"llama_rope_type_number", {"causal_lm", "rope_type"}},
      {"sd3_heads_times_head_dim_overflow", {"sd3_transformer", "num_attention_heads"}},
      {"t5_is_decoder_string", {"t5_encoder", "is_decoder"}},
      {"unet_block_type_not_string", {"unet_2d_condition", "down_block_types[0]"}},
      {"unet_layers_per_block_string", {"unet_2d_condition", "layers_per_block"}},
      {"unet_mid_block_type_number", {"unet_2d_condition", "mid_block_type"}},
      {"unet_num_class_embeds_string", {"unet_2d_condition", "num_class_embeds"}},
      {"unet_text_time_without_dims", {"unet_2d_condition", "addition_time_embed_dim"}},
      {"vae_sample_size_beyond_int64", {"autoencoder_kl", "sample_size"}}};
  const auto inputs = regressions("model_config");
  ASSERT_GE(inputs.size(), expected.size());
  size_t checked = 0;
  for (const auto& path : inputs) {
    const json config = dew::io::parse_json(dew::io::read_file(path, "regression"), path);
    std::map<std::string, std::string> errors;
    for (const auto& [name, translate] : translations) errors[name] = error_of([&] { translate(config); });
    const auto it = expected.find(fs::path(path).stem().string());
    if (it == expected.end()) continue;
    const std::string& e = errors[it->second.first];
    EXPECT_NE(e.find(it->second.second), std::string::npos) << path << ": " << it->second.first << ": " << e;
    ++checked;
  }
  EXPECT_EQ(checked, expected.size());
}

TEST(FuzzRegressions, LoraFilesAreRefusedAndLeaveTheModelAsItWas) {
  // Each input is an adapter_config.json, a NUL byte and an adapter file (fuzz/lora_file_fuzz.cpp), read onto the
  // fuzz target's tiny model by every loader: each refuses it, and the model is as it was (no adapter attached,
  // no weight written, nothing frozen).
  dew::test::TempDir tmp("fuzz_regressions_lora_file");
  const auto inputs = regressions("lora_file");
  ASSERT_GE(inputs.size(), 1u);
  const std::string dir = tmp.path.string(), file = tmp.file("adapter_model.safetensors");
  const std::vector<std::pair<std::string, std::function<void(torch::nn::Module&)>>> loads = {
      {"load_peft_adapter", [&](torch::nn::Module& m) { dew::nn::load_peft_adapter(m, dir); }},
      {"load_lora_file", [&](torch::nn::Module& m) { dew::nn::load_lora_file(m, file); }},
      {"load_diffusers_lora", [&](torch::nn::Module& m) { dew::nn::load_diffusers_lora(m, file); }},
      {"load_kohya_lora", [&](torch::nn::Module& m) { dew::nn::load_kohya_lora(m, file); }}};
  for (const auto& path : inputs) {
    const std::string in = dew::io::read_file(path, "regression");
    const auto parts = dew_fuzz::split_at_nul(reinterpret_cast<const uint8_t*>(in.data()), in.size());
    dew_fuzz::write_file(tmp.path / "adapter_config.json", parts.first);
    dew_fuzz::write_file(file, dew_fuzz::lora::safetensors_file(parts.second));
    for (const auto& load : loads) {
      const auto model = dew_fuzz::lora::tiny_model();
      std::vector<std::pair<at::Tensor, bool>> before;
      for (const auto& p : model->parameters()) before.emplace_back(p.detach().clone(), p.requires_grad());
      const size_t modules = model->modules().size();
      EXPECT_NE(error_of([&] { load.second(*model); }), "") << path << ": " << load.first;
      EXPECT_EQ(model->modules().size(), modules) << path << ": " << load.first;
      const auto now = model->parameters();
      ASSERT_EQ(now.size(), before.size()) << path << ": " << load.first;
      for (size_t i = 0; i < now.size(); ++i) {
        EXPECT_TRUE(torch::equal(now[i], before[i].first)) << path << ": " << load.first;
        EXPECT_EQ(now[i].requires_grad(), before[i].second) << path << ": " << load.first;
      }
    }
  }
}

}  // namespace

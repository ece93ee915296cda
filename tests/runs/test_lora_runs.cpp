// LoRA fine-tuning through the command line (docs/lora.md): `dew train sft|dpo|diffusion --lora.*` from a
// pretrained base trains only the adapters (the base's files unchanged), checkpoints hold the adapters and a
// reference to the base, a run stopped between checkpoints resumes bit for bit, the run opens to the base
// with scale * B @ A added (checked against that sum computed here from the files), `dew export --adapter`
// writes the PEFT / diffusers files, `dew generate --lora` equals generation from weights merged here by
// hand, `dew sample --pipeline --lora FILE:SCALE` with scale 0 equals no LoRA, and bad input is one line.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>

#include "dew/core/strings.h"
#include "dew/data/tokenizer.h"
#include "dew/interop/diffusers_forward.h"
#include "dew/io/image.h"
#include "dew/io/safetensors.h"
#include "dew/nn/lora.h"
#include "dew/runs/lm_run.h"
#include "dew/runs/run.h"
#include "dew/sampling/generate.h"
#include "dew/training/checkpoint.h"
#include "tests/test_util.h"

namespace fs = std::filesystem;

// Named, not anonymous: the tests share unity batches.
namespace lora_runs_test {

using dew::test::read_bytes;
using dew::test::run_dew;

// An untied model, so lm_head exists as a Linear (and is refused as a target).
const char* kTinyLm =
    " --model.fields '{\"emb_features\":32,\"num_layers\":1,\"num_heads\":2,\"max_seq_len\":64,"
    "\"tie_embeddings\":false}'";

// The bytes of every file of a checkpoint directory, by name.
std::map<std::string, std::string> checkpoint_bytes(const fs::path& dir) {
  std::map<std::string, std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out[e.path().filename().string()] = read_bytes(e.path());
  return out;
}

// Deletes the last checkpoint (a run stopped after step 2's checkpoint), reruns `cmd` and expects every file
// of step 4 to come back byte for byte.
void expect_resumes_bit_for_bit(const std::string& cmd, const std::string& run) {
  const fs::path step4 = fs::path(run) / "checkpoints" / "step_4";
  ASSERT_TRUE(fs::exists(fs::path(run) / "checkpoints" / "step_2"));
  const auto whole = checkpoint_bytes(step4);
  fs::remove_all(step4);
  const auto r = run_dew(cmd);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("from step 2"), std::string::npos) << r.output;
  const auto resumed = checkpoint_bytes(step4);
  ASSERT_EQ(resumed.size(), whole.size());
  for (const auto& [name, bytes] : whole) EXPECT_TRUE(resumed.at(name) == bytes) << name << " differs after resuming";
}

// The adapter tensors of a checkpoint: only "<module>.lora_A.weight" / ".lora_B.weight", `pairs` pairs.
std::map<std::string, at::Tensor> expect_adapters_only(const fs::path& model_file, size_t pairs) {
  auto t = dew::io::load_safetensors(model_file.string());
  EXPECT_EQ(t.size(), 2 * pairs);
  for (const auto& [k, v] : t)
    EXPECT_TRUE(dew::ends_with(k, ".lora_A.weight") || dew::ends_with(k, ".lora_B.weight")) << k;
  return t;
}

TEST(LoraRuns, SftFromAFolderTrainsOnlyAdaptersResumesExportsAndGenerates) {
  dew::test::TempDir tmp("lora_sft");
  const std::string sums = tmp.file("sums");
  auto r = run_dew("task sums --digits 1 --test 20 --out " + sums);
  ASSERT_EQ(r.code, 0) << r.output;
  // The base: a small SFT model exported as a transformers folder.
  r = run_dew("train sft --data " + sums + "/sft.jsonl" + kTinyLm +
              " --eval.prompts '' --trainer.steps 4 --loader.batch_size 8 --run " + tmp.file("base"));
  ASSERT_EQ(r.code, 0) << r.output;
  r = run_dew("export " + tmp.file("base") + " " + tmp.file("hf") + " --family qwen3");
  ASSERT_EQ(r.code, 0) << r.output;
  const std::string base_bytes = read_bytes(tmp.path / "hf/model.safetensors");

  const std::string lora = "train sft --init_from " + tmp.file("hf") + " --data " + sums +
                           "/sft.jsonl --eval.prompts '' --lora.targets q_proj,v_proj --lora.rank 2 --lora.alpha 4"
                           " --trainer.steps 4 --trainer.checkpoint_every 2 --trainer.log_every 1"
                           " --optim.lr 1e-2 --optim.warmup_steps 0 --loader.batch_size 8 --run " +
                           tmp.file("lora");
  r = run_dew(lora);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("LoRA on 2 modules"), std::string::npos) << r.output;
  EXPECT_TRUE(read_bytes(tmp.path / "hf/model.safetensors") == base_bytes) << "the base changed";

  // The checkpoint: the adapters (small next to the base) and, in state.json, the base they belong to.
  const fs::path ck = tmp.path / "lora/checkpoints/step_4";
  const auto adapters = expect_adapters_only(ck / "model.safetensors", 2);
  EXPECT_LT(fs::file_size(ck / "model.safetensors") * 20, fs::file_size(tmp.path / "hf/model.safetensors"));
  const auto state = dew::test::read_json((ck / "state.json").string());
  EXPECT_EQ(state["lora"]["base"]["path"], tmp.file("hf"));
  EXPECT_EQ(state["lora"]["base"]["kind"], "hf");
  const std::string q = "layers.0.self_attn.q_proj";
  EXPECT_GT(adapters.at(q + ".lora_B.weight").abs().max().item<double>(), 0) << "B did not move from zero";

  // Opened, the run is the base with (alpha / r) B @ A added to each adapted weight, the rest as it was.
  dew::runs::OpenOptions live;
  live.weights = "live";
  const auto merged = dew::runs::run_weights(tmp.file("lora"), live);
  const auto hf = dew::io::load_safetensors(tmp.file("hf/model.safetensors"));
  const at::Tensor expected = hf.at("model." + q + ".weight") +
                              2.0 * adapters.at(q + ".lora_B.weight").matmul(adapters.at(q + ".lora_A.weight"));
  EXPECT_TRUE(at::allclose(merged.at(q + ".weight"), expected, 1e-6, 1e-7));
  EXPECT_TRUE(merged.at("layers.0.mlp.up_proj.weight").equal(hf.at("model.layers.0.mlp.up_proj.weight")));
  EXPECT_EQ(merged.count(q + ".lora_A.weight"), 0u);

  // Stopped after step 2's checkpoint and rerun: the same bits at step 4.
  expect_resumes_bit_for_bit(lora, tmp.file("lora"));

  // The adapters as a PEFT folder, applied to the base run by `dew generate --lora` (unmerged: each layer adds
  // scale * B(A(x))), against greedy decoding of the base with the adapters merged by hand here.
  r = run_dew("export " + tmp.file("lora") + " " + tmp.file("peft") + " --adapter");
  ASSERT_EQ(r.code, 0) << r.output;
  const auto config = dew::test::read_json(tmp.file("peft/adapter_config.json"));
  EXPECT_EQ(config["r"], 2);
  EXPECT_EQ(config["lora_alpha"], 4.0);
  const auto peft = dew::io::load_safetensors(tmp.file("peft/adapter_model.safetensors"));
  EXPECT_TRUE(peft.at("base_model.model." + q + ".lora_A.weight").equal(adapters.at(q + ".lora_A.weight")));
  const std::string gen = " --weights live --lora " + tmp.file("peft") +
                          " --prompt '<|user|>3+4' --temperature 0 --max-new-tokens 6 --no-eos --json";
  r = run_dew("generate " + tmp.file("base") + gen);
  ASSERT_EQ(r.code, 0) << r.output;
  // The adapter names its base (the folder hf, exported from base but not recorded as its source): a warning
  // line ahead of the result; refused under --lora.strict (BadInputIsOneLineAndLeavesRunsAsTheyWere).
  EXPECT_EQ(r.output.find("generate: warning: --lora " + tmp.file("peft") +
                          ": the adapter was trained on base_model_name_or_path \"" + tmp.file("hf") + "\""),
            0u)
      << r.output;
  const size_t json_at = r.output.find('{');
  const auto line = dew::json::parse(r.output.substr(json_at, r.output.find('\n', json_at) - json_at));
  {
    auto run = dew::runs::open_lm_run(tmp.file("base"), live);
    at::NoGradGuard no_grad;
    auto params = run.model->named_parameters();
    for (const std::string& m : {q, std::string("layers.0.self_attn.v_proj")})
      params[m + ".weight"].add_(2.0 * peft.at("base_model.model." + m + ".lora_B.weight")
                                           .matmul(peft.at("base_model.model." + m + ".lora_A.weight")));
    auto tok = dew::data::load_tokenizer(run.tokenizer);
    dew::sampling::GenerationOptions g;
    g.max_new_tokens = 6;
    g.temperature = 0;
    const auto res = dew::sampling::generate_tokens(*run.model, {tok->encode("<|user|>3+4", true)}, g);
    EXPECT_EQ(line["tokens"].get<std::vector<int64_t>>(), res.tokens[0]);
    const auto lp = line["raw_logprobs"].get<std::vector<double>>();
    ASSERT_EQ(lp.size(), res.raw_logprobs[0].size());
    for (size_t i = 0; i < lp.size(); ++i) EXPECT_NEAR(lp[i], res.raw_logprobs[0][i], 1e-4) << i;
  }
  // A hub id whose last component is the run's folder name counts as that base: no warning, even strict.
  auto config_with_hub_base = config;
  config_with_hub_base["base_model_name_or_path"] = "some-org/base";
  std::ofstream(tmp.file("peft/adapter_config.json")) << config_with_hub_base.dump();
  r = run_dew("generate " + tmp.file("base") + gen + " --lora.strict");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(r.output.find("warning"), std::string::npos) << r.output;
  EXPECT_EQ(dew::json::parse(r.output.substr(0, r.output.find('\n')))["tokens"], line["tokens"]);
  // The run itself generates from its merged weights.
  r = run_dew("generate " + tmp.file("lora") + " --prompt 'x' --max-new-tokens 3");
  EXPECT_EQ(r.code, 0) << r.output;

  // DPO with adapters: its frozen reference is the base (the policy starts equal to it, so the first loss is
  // -log sigmoid(0) = log 2), and the run's "reference" weights open to the base's.
  std::ofstream pairs(tmp.file("pairs.jsonl"));
  for (int i = 0; i < 8; ++i)
    pairs << "{\"prompt\":\"" << i << "+1\",\"chosen\":\"" << i + 1 << "\",\"rejected\":\"" << i + 2 << "\"}\n";
  pairs.close();
  r = run_dew("train dpo --init_from " + tmp.file("hf") + " --data " + tmp.file("pairs.jsonl") +
              " --eval.prompts '' --lora.targets q_proj,v_proj --lora.rank 2 --trainer.steps 2 --trainer.log_every 1"
              " --optim.lr 1e-2 --optim.warmup_steps 0 --loader.batch_size 4 --run " +
              tmp.file("dpo"));
  ASSERT_EQ(r.code, 0) << r.output;
  std::ifstream m(tmp.path / "dpo/metrics.jsonl");
  std::string first;
  std::getline(m, first);
  EXPECT_NEAR(dew::json::parse(first)["train/loss"].get<double>(), std::log(2.0), 1e-5) << first;
  dew::runs::OpenOptions ref;
  ref.weights = "reference";
  const auto reference = dew::runs::run_weights(tmp.file("dpo"), ref);
  ASSERT_EQ(reference.size(), hf.size());
  for (const auto& [k, v] : reference) EXPECT_TRUE(v.equal(hf.at(k == "lm_head.weight" ? k : "model." + k))) << k;

  // GRPO takes the same section (its reference is the base too); its checkpoints hold the adapters alone.
  r = run_dew("train grpo --init_from " + tmp.file("hf") + " --prompts " + sums +
              "/train_prompts.jsonl --reward exact --eval.prompts '' --lora.targets q_proj --lora.rank 2"
              " --loader.batch_size 2 --objective.group_size 2 --objective.max_new_tokens 4 --trainer.steps 2"
              " --run " +
              tmp.file("grpo"));
  ASSERT_EQ(r.code, 0) << r.output;
  expect_adapters_only(tmp.path / "grpo/checkpoints/step_2/model.safetensors", 1);
}

TEST(LoraRuns, DiffusionFromARunTrainsOnlyAdaptersResumesAndSamples) {
  dew::test::TempDir tmp("lora_diffusion");
  const std::string tiny =
      " --data '{\"name\":\"gaussian_blobs\",\"count\":64,\"size\":8,\"classes\":3}'"
      " --model.architecture simple_dit"
      " --model.fields '{\"patch_size\":2,\"emb_features\":32,\"num_layers\":1,\"num_heads\":2}'"
      " --loader.batch_size 8 --trainer.log_every 2 --trainer.checkpoint_every 2 --objective.steps 2"
      " --objective.preview_per_class 1 --trainer.steps 4";
  auto r = run_dew("train diffusion" + tiny + " --run " + tmp.file("base"));
  ASSERT_EQ(r.code, 0) << r.output;
  const auto base_bytes = checkpoint_bytes(tmp.path / "base/checkpoints/step_4");
  const std::string cmd = "train diffusion" + tiny + " --init_from " + tmp.file("base") +
                          " --lora.targets fc1,fc2 --lora.rank 2 --lora.alpha 2 --optim.lr 1e-2 --run " +
                          tmp.file("lora");
  r = run_dew(cmd);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("LoRA on 2 modules"), std::string::npos) << r.output;
  EXPECT_TRUE(checkpoint_bytes(tmp.path / "base/checkpoints/step_4") == base_bytes) << "the base changed";
  const auto adapters = expect_adapters_only(tmp.path / "lora/checkpoints/step_4/model.safetensors", 2);

  dew::runs::OpenOptions live, base_ema;
  live.weights = "live";
  base_ema.step = 4;
  const auto merged = dew::runs::run_weights(tmp.file("lora"), live);
  const auto base = dew::runs::run_weights(tmp.file("base"), base_ema);
  const std::string fc1 = "blocks.0.mlp.fc1";
  const at::Tensor expected =
      base.at(fc1 + ".weight") + adapters.at(fc1 + ".lora_B.weight").matmul(adapters.at(fc1 + ".lora_A.weight"));
  EXPECT_TRUE(at::allclose(merged.at(fc1 + ".weight"), expected, 1e-6, 1e-7));
  EXPECT_FALSE(merged.at(fc1 + ".weight").equal(base.at(fc1 + ".weight")));
  EXPECT_TRUE(merged.at("blocks.0.attn.qkv.weight").equal(base.at("blocks.0.attn.qkv.weight")));

  expect_resumes_bit_for_bit(cmd, tmp.file("lora"));

  r = run_dew("sample " + tmp.file("lora") + " --steps 2 --count 3 --out " + tmp.file("s.png"));
  EXPECT_EQ(r.code, 0) << r.output;
  r = run_dew("export " + tmp.file("lora") + " " + tmp.file("lora.safetensors") + " --adapter --ema");
  ASSERT_EQ(r.code, 0) << r.output;
  const auto file = dew::io::load_safetensors(tmp.file("lora.safetensors"));
  EXPECT_EQ(file.size(), 4u);
  EXPECT_TRUE(file.count("transformer." + fc1 + ".lora_A.weight")) << "the diffusers key layout";
}

// init_from a diffusers UNet folder (the tiny SD pipeline's unet/, its vae/ for the latents, its CLIP text tower
// frozen as the text encoder): model.architecture and fields come from its config.json; a full fine-tune starts
// at the folder's weights exactly (one step at lr 1e-30 leaves them); a LoRA run trains only its adapters,
// reopens from them through the folder (and the text encoder's own weights), resumes bit for bit and samples.
TEST(LoraRuns, DiffusionFromADiffusersUNetFolderStartsAtItsWeights) {
  dew::test::TempDir tmp("lora_diffusers_unet");
  const std::string g = std::string(DEW_SOURCE_DIR) + "/tests/golden/sd/pipeline";
  const std::string train =
      "train diffusion --init_from " + g + "/unet --autoencoder.folder " + g +
      "/vae --data '{\"name\":\"gaussian_blobs\",\"count\":32,\"size\":16,\"channels\":3,\"classes\":3}'"
      " --text_encoder.architecture clip_text --text_encoder.trainable false --text_encoder.fields '{\"weights\":\"" +
      g + "/text_encoder/model.safetensors\",\"tokenizer\":\"" + g +
      "/tokenizer/tokenizer.json\",\"vocab_size\":537,\"hidden_size\":16,\"intermediate_size\":64,"
      "\"num_hidden_layers\":2,\"num_attention_heads\":4,\"bos_token_id\":535,\"eos_token_id\":536}'"
      " --loader.batch_size 4 --trainer.log_every 2 --trainer.val_every 0 --trainer.checkpoint_every 2"
      " --objective.steps 2 --objective.preview_per_class 1";
  const auto folder = dew::interop::load_diffusers_folder(g + "/unet");
  std::map<std::string, at::Tensor> unet;
  for (const auto& kv : folder.module->named_parameters()) unet[kv.key()] = kv.value().detach();
  dew::runs::OpenOptions live;
  live.weights = "live";

  auto r = run_dew(train + " --trainer.steps 1 --optim.lr 1e-30 --run " + tmp.file("full"));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("model unet_2d_condition from its config.json"), std::string::npos) << r.output;
  const auto full = dew::runs::run_weights(tmp.file("full"), live);
  for (const auto& [name, w] : unet) {
    ASSERT_TRUE(full.count(name)) << name;
    EXPECT_TRUE(at::allclose(full.at(name), w, 0, 1e-20)) << name << " is not the folder's";
  }

  const std::string lora =
      train + " --trainer.steps 4 --lora.targets to_q,to_v --lora.rank 2 --lora.alpha 2 --optim.lr 1e-2 --run " +
      tmp.file("lora");
  r = run_dew(lora);
  ASSERT_EQ(r.code, 0) << r.output;
  const auto adapters = expect_adapters_only(tmp.path / "lora/checkpoints/step_4/model.safetensors", 24);
  const auto merged = dew::runs::run_weights(tmp.file("lora"), live);
  size_t adapted = 0;
  for (const auto& [name, w] : unet) {
    const std::string module = name.substr(0, name.rfind('.'));
    if (adapters.count(module + ".lora_A.weight") && dew::ends_with(name, ".weight")) {
      ++adapted;
      const at::Tensor expected =
          w + adapters.at(module + ".lora_B.weight").matmul(adapters.at(module + ".lora_A.weight"));
      EXPECT_TRUE(at::allclose(merged.at(name), expected, 1e-6, 1e-7)) << name;
      EXPECT_FALSE(merged.at(name).equal(w)) << name;
    } else {
      EXPECT_TRUE(merged.at(name).equal(w)) << name;
    }
  }
  EXPECT_EQ(adapted, 24u);  // to_q and to_v of 12 attentions
  EXPECT_TRUE(merged.count("text_encoder.text_model.final_layer_norm.weight") ||
              std::any_of(merged.begin(), merged.end(),
                          [](const auto& kv) { return kv.first.rfind("text_encoder.", 0) == 0; }));
  expect_resumes_bit_for_bit(lora, tmp.file("lora"));
  r = run_dew("sample " + tmp.file("lora") + " --steps 2 --count 3 --out " + tmp.file("s.png"));
  EXPECT_EQ(r.code, 0) << r.output;

  // Adapters on this base need a text encoder that loads its own weights: one initialised at random is refused.
  r = run_dew("train diffusion --init_from " + g +
              "/unet --text_encoder.architecture byte_text_encoder --lora.targets to_q --run " + tmp.file("bad"));
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("text_encoder.fields.weights"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(tmp.path / "bad"));
}

TEST(LoraRuns, BadInputIsOneLineAndLeavesRunsAsTheyWere) {
  dew::test::TempDir tmp("lora_bad");
  const std::string sums = tmp.file("sums");
  auto r = run_dew("task sums --digits 1 --test 20 --out " + sums);
  ASSERT_EQ(r.code, 0) << r.output;
  const std::string data = " --data " + sums + "/sft.jsonl --eval.prompts '' --loader.batch_size 8";
  r = run_dew("train sft" + data + kTinyLm + " --trainer.steps 2 --run " + tmp.file("base"));
  ASSERT_EQ(r.code, 0) << r.output;
  r = run_dew("export " + tmp.file("base") + " " + tmp.file("hf") + " --family qwen3");
  ASSERT_EQ(r.code, 0) << r.output;
  const std::string lora = "train sft --init_from " + tmp.file("hf") + data + " --trainer.steps 2 --run ";
  r = run_dew(lora + tmp.file("lora") + " --lora.targets q_proj");
  ASSERT_EQ(r.code, 0) << r.output;
  r = run_dew("export " + tmp.file("lora") + " " + tmp.file("peft") + " --adapter");  // trained on hf, not base
  ASSERT_EQ(r.code, 0) << r.output;
  const std::string record = read_bytes(tmp.path / "lora/run.json");
  std::ofstream(tmp.file("pairs.jsonl")) << "{\"prompt\":\"1+1\",\"chosen\":\"2\",\"rejected\":\"3\"}\n";

  struct Case {
    std::string args, needle;
  };
  const std::vector<Case> cases = {
      {lora + tmp.file("x") + " --lora.targets q_prj",
       "target module \"q_prj\" matches no Linear or Conv2d module "
       "name; nearest names: layers.0.self_attn.q_proj"},
      {lora + tmp.file("x") + " --lora.targets q_proj --lora.rank 0", "lora.rank: must be > 0, got 0"},
      {lora + tmp.file("x") + " --lora.targets q_proj --lora.rank 40", "lora.rank 40 is larger than"},
      {lora + tmp.file("x") + " --lora.rank 4", "lora.rank: set to 4 but lora.targets is empty"},
      {lora + tmp.file("x") + " --lora.targets lm_head", "lm_head is read directly by the SFT loss"},
      {lora + tmp.file("x") + " --lora.target_regex '(q_proj'", "lora.target_regex: \"(q_proj\" is not a valid"},
      {"train sft" + data + kTinyLm + " --lora.targets q_proj --run " + tmp.file("x"), "init_from is empty"},
      {"train dpo --init_from " + tmp.file("hf") + " --data " + tmp.file("pairs.jsonl") + " --reference " +
           tmp.file("base") + " --lora.targets q_proj --run " + tmp.file("x"),
       "--reference is not taken with lora.targets"},
      // The run was trained with other adapters: resuming with these is refused.
      {lora + tmp.file("lora") + " --lora.targets v_proj", "was trained with lora"},
      {"generate " + tmp.file("base") + " --lora " + tmp.file("nowhere"), "nowhere/adapter_config.json"},
      {"generate " + tmp.file("base") + " --lora " + tmp.file("peft") + " --lora.strict",
       "--lora " + tmp.file("peft") + ": the adapter was trained on base_model_name_or_path \"" + tmp.file("hf") +
           "\" (adapter_config.json), and " + tmp.file("base") + " stands for " + tmp.file("base") +
           " (--lora.strict)"},
      {"generate " + tmp.file("base") + " --lora.strict", "--lora.strict: applies to --lora DIR, which is not given"},
      {"export " + tmp.file("base") + " " + tmp.file("x") + " --adapter", "trained no LoRA adapters"},
  };
  for (const auto& c : cases) {
    r = run_dew(c.args);
    EXPECT_EQ(r.code, 2) << c.args << "\n" << r.output;
    EXPECT_NE(r.output.find(c.needle), std::string::npos) << c.args << "\n" << r.output;
    EXPECT_LE(std::count(r.output.begin(), r.output.end(), '\n'), 1) << r.output;
  }
  EXPECT_FALSE(fs::exists(tmp.path / "x"));

  // A base that changed under the same path: resuming and opening the run are both refused, naming the file.
  std::ofstream(tmp.file("hf/config.json"), std::ios::app) << "\n";
  for (const std::string& args :
       {lora + tmp.file("lora") + " --lora.targets q_proj --trainer.steps 4", "generate " + tmp.file("lora")}) {
    r = run_dew(args);
    EXPECT_EQ(r.code, 2) << args << "\n" << r.output;
    EXPECT_NE(r.output.find("which has changed since (config.json was "), std::string::npos) << r.output;
    EXPECT_LE(std::count(r.output.begin(), r.output.end(), '\n'), 1) << r.output;
  }
  EXPECT_EQ(read_bytes(tmp.path / "lora/run.json"), record);
}

TEST(LoraPipelineCli, ScaleZeroIsTheBasePipelineAndFilesOfBothLayoutsAgree) {
  dew::test::TempDir tmp("lora_pipeline");
  const std::string pipe = std::string(DEW_SOURCE_DIR) + "/tests/golden/sd/pipeline";
  // Adapters on the pipeline's UNet with B moved off zero, written in diffusers' and kohya's layouts.
  const auto opts = dew::nn::LoraOptions().rank(2).alpha(4).target_modules({"to_q", "to_v", "conv1"});
  {
    auto unet = dew::interop::load_diffusers_folder(pipe + "/unet");
    dew::nn::apply_lora(*unet.module, opts);
    at::NoGradGuard no_grad;
    for (auto& [name, t] : dew::nn::lora_parameters(*unet.module))
      if (dew::ends_with(name, "lora_B.weight")) t.copy_(at::linspace(-0.2, 0.3, t.numel()).reshape(t.sizes()));
    dew::nn::save_diffusers_lora(tmp.file("lora.safetensors"), *unet.module, opts);
    dew::nn::save_kohya_lora(tmp.file("kohya.safetensors"), *unet.module);
  }
  const std::string cmd = "sample --pipeline " + pipe +
                          " --prompt 'a cat' --steps 3 --size 32x32 --seed 3 --threads 1 --scheduler DDIMScheduler";
  auto png = [&](const std::string& name, const std::string& flags) {
    const auto r = run_dew(cmd + flags + " --out " + tmp.file(name));
    EXPECT_EQ(r.code, 0) << r.output;
    return read_bytes(tmp.path / name);
  };
  const std::string plain = png("plain.png", "");
  EXPECT_EQ(png("zero.png", " --lora " + tmp.file("lora.safetensors") + ":0"), plain);
  const std::string one = png("one.png", " --lora " + tmp.file("lora.safetensors"));
  EXPECT_NE(one, plain);
  EXPECT_EQ(png("kohya.png", " --lora " + tmp.file("kohya.safetensors") + ":1"), one);
  EXPECT_NE(png("half.png", " --lora " + tmp.file("lora.safetensors") + ":0.5"), one);

  // What --lora FILE:0.5 leaves in a UNet (nn::load_lora_file + nn::fold_lora, as add_lora runs them):
  // W + 0.5 (alpha / r) B @ A from the file's own tensors, on every adapted layer and nowhere else.
  const auto file = dew::io::load_safetensors(tmp.file("lora.safetensors"));
  auto unet = dew::interop::load_diffusers_folder(pipe + "/unet");
  const auto before = unet.module->named_parameters();
  std::map<std::string, at::Tensor> base;
  for (const auto& kv : before) base[kv.key()] = kv.value().clone();
  const auto report = dew::nn::load_lora_file(*unet.module, tmp.file("lora.safetensors"), 0.5);
  EXPECT_EQ(report.targets.size() * 2, file.size());
  dew::nn::fold_lora(*unet.module);
  const auto after = unet.module->named_parameters();
  EXPECT_EQ(after.size(), base.size()) << "the adapters are gone after folding";
  for (const auto& kv : after) {
    const std::string& k = kv.key();
    const std::string module = k.substr(0, k.size() - std::string(".weight").size());
    if (dew::ends_with(k, ".weight") && file.count("unet." + module + ".lora_A.weight")) {
      const at::Tensor a = file.at("unet." + module + ".lora_A.weight"),
                       b = file.at("unet." + module + ".lora_B.weight");
      const at::Tensor delta = a.dim() == 2 ? b.matmul(a) : at::einsum("or,rikl->oikl", {b.flatten(1), a});
      EXPECT_TRUE(at::allclose(kv.value(), base.at(k) + 0.5 * 2.0 * delta, 1e-6, 1e-7)) << k;
    } else {
      EXPECT_TRUE(kv.value().equal(base.at(k))) << k;
    }
  }
  for (const std::string& bad :
       {" --lora " + tmp.file("none.safetensors"), " --lora " + tmp.file("lora.safetensors") + ":x"}) {
    const auto r = run_dew(cmd + bad + " --out " + tmp.file("bad.png"));
    EXPECT_EQ(r.code, 2) << r.output;
    EXPECT_EQ(dew::test::count_lines(r.output), 1u) << r.output;
    EXPECT_FALSE(fs::exists(tmp.path / "bad.png"));
  }
}

// `dew sample --pipeline tests/golden/FOLDER FLAGS --latents GOLDEN/io.safetensors`, without and with `--lora
// GOLDEN/FILE:0.5`, against diffusers' images of the same folder and latents (io.safetensors' image_base and
// image_lora): dew's PNG is the image quantised as numpy_to_pil does, no byte more than one level off.
void expect_diffusers_images(const std::string& folder, const std::string& golden, const std::string& file,
                             const std::string& flags, double min_same = 0.99, const std::string& image = "lora",
                             const std::string& scale = "0.5", int64_t channels = 3) {
  dew::test::TempDir tmp("lora_golden_images");
  const std::string root = std::string(DEW_SOURCE_DIR) + "/tests/golden/", dir = root + golden;
  const auto io = dew::io::load_safetensors(dir + "/io.safetensors");
  const std::string cmd =
      "sample --pipeline " + root + folder + flags + " --latents " + dir + "/io.safetensors --out " + tmp.file("x.png");
  for (const std::string which : {std::string("base"), image}) {
    SCOPED_TRACE(golden + " " + file + " " + which);
    const auto r = run_dew(cmd + (which != "base" ? " --lora " + dir + "/" + file + ":" + scale : ""));
    ASSERT_EQ(r.code, 0) << r.output;
    if (which != "base") {
      EXPECT_NE(r.output.find("layers adapted"), std::string::npos) << r.output;
    }
    const at::Tensor ours = dew::io::load_image(tmp.file("x.png"), channels).to(at::kInt);  // [channels, H, W]
    const at::Tensor ref = (io.at("image_" + which)[0] * 255).round().clamp(0, 255).to(at::kInt);
    const int64_t off = (ours - ref).abs().gt(1).sum().item<int64_t>();
    const double same = (ours == ref).to(at::kDouble).mean().item<double>();
    std::printf("  %s %s: %.4f of the bytes equal diffusers' image, %lld off by more than one\n", golden.c_str(),
                which.c_str(), same, static_cast<long long>(off));
    EXPECT_EQ(off, 0);
    EXPECT_GE(same, min_same);
  }
}

// diffusers' load_lora_weights + set_adapters(0.5) on the same folder and latents
// (tests/golden/lora_pipeline_reference.py).
TEST(LoraPipelineCli, MatchesDiffusersLoadLoraWeights) {
  expect_diffusers_images("sd/pipeline", "lora/pipeline_lora", "pytorch_lora_weights.safetensors",
                          " --prompt 'a cat' --steps 3 --guidance 7.5 --size 32x32");
}

// A kohya file of the SDXL UNet in the original (SGM) naming kohya trains SDXL with, on the tiny SDXL folder:
// diffusers' load_lora_weights of the same file + set_adapters(0.5) (tests/golden/lora_kohya_sgm_reference.py; 174
// modules of every kind: attention, feed-forward, resnet convs and time projections, shortcuts, samplers, conv_in /
// conv_out, the time and added-condition embeddings).
TEST(LoraPipelineCli, SdxlKohyaFileInTheOriginalUNetNamingMatchesDiffusers) {
  expect_diffusers_images("sd/pipeline_sdxl", "lora/kohya_sgm", "sdxl_kohya_sgm.safetensors",
                          " --prompt 'a cat' --steps 3 --guidance 7.5 --size 32x32");
}

// Files that adapt the text encoders as well as the UNet, as kohya trains by default (lora_te_, SDXL's lora_te1_ /
// lora_te2_, in transformers 4's text_model names) and as diffusers saves them (text_encoder. / text_encoder_2.,
// in transformers 5's names, without text_model): diffusers' pipeline with peft's LoRA layers on the same modules
// at weight 0.5 (tests/golden/lora_text_encoder_reference.py; diffusers' own converter reads the kohya names onto
// those modules there). A file of the text encoders alone changes the image too.
TEST(LoraPipelineCli, TextEncoderAdaptersMatchDiffusersWithPeft) {
  const std::string flags = " --prompt 'a cat' --steps 3 --guidance 7.5 --size 32x32";
  for (const auto& [folder, golden] : std::vector<std::pair<std::string, std::string>>{
           {"sd/pipeline", "lora/te_sd"}, {"sd/pipeline_sdxl", "lora/te_sdxl"}}) {
    expect_diffusers_images(folder, golden, "kohya_te.safetensors", flags);
    expect_diffusers_images(folder, golden, "diffusers_te.safetensors", flags);
    expect_diffusers_images(folder, golden, "kohya_te_only.safetensors", flags, 0.99, "te_only", "1");
  }
  // SD3's CLIP-L / CLIP-G and Flux's CLIP-L (diffusers' files; diffusers reads no T5 adapters): the same check.
  const std::string flow = " --prompt 'a photo of a cat on the moon' --steps 4 --size 16x16 --max-sequence-length 16";
  const std::string sd3 = flow + " --negative-prompt 'blurry, low quality' --guidance 5";
  expect_diffusers_images("sd3/pipeline", "lora/te_sd3", "diffusers_te.safetensors", sd3, 0.98);
  expect_diffusers_images("sd3/pipeline", "lora/te_sd3", "diffusers_te_only.safetensors", sd3, 0.98, "te_only", "1");
  expect_diffusers_images("flux/pipeline_schnell", "lora/te_flux", "diffusers_te.safetensors", flow, 0.98);
  expect_diffusers_images("flux/pipeline_schnell", "lora/te_flux", "diffusers_te_only.safetensors", flow, 0.98,
                          "te_only", "1");
}

// The same for SD3 and Flux (schnell) folders (tests/golden/lora_flow_pipeline_reference.py): diffusers'
// load_lora_weights + set_adapters(0.5) on the transformer, against `dew sample --pipeline --lora FILE:0.5`; a kohya
// file of SD3's original modules (lora_unet_joint_blocks_...) is refused in one line.
// A QwenImage21Pipeline folder (tests/golden/lora_qwen_image_reference.py): diffusers' QwenImageLoraLoaderMixin
// load_lora_weights + set_adapters(0.5) on the transformer (attention, feed-forward and text-input layers), its RGBA
// images against `dew sample --pipeline --lora FILE:0.5`.
TEST(LoraPipelineCli, QwenImageMatchesDiffusersLoadLoraWeights) {
  expect_diffusers_images("qwen_image/pipeline", "lora/qwen_image_lora", "pytorch_lora_weights.safetensors",
                          " --prompt 'a cat' --negative-prompt blurry --guidance 4 --steps 3 --size 64x32", 0.98,
                          "lora", "0.5", 4);
}

TEST(LoraPipelineCli, SD3AndFluxMatchDiffusersLoadLoraWeights) {
  const std::string flow = " --prompt 'a photo of a cat on the moon' --steps 4 --size 16x16 --max-sequence-length 16";
  expect_diffusers_images("sd3/pipeline", "lora/sd3_lora", "pytorch_lora_weights.safetensors",
                          flow + " --negative-prompt 'blurry, low quality' --guidance 5", 0.98);
  expect_diffusers_images("flux/pipeline_schnell", "lora/flux_lora", "pytorch_lora_weights.safetensors", flow, 0.98);

  dew::test::TempDir tmp("lora_flow_golden");
  const std::string golden = std::string(DEW_SOURCE_DIR) + "/tests/golden/";
  // A kohya file of SD3's original modules: refused before anything runs, naming the layout.
  dew::io::save_safetensors(tmp.file("kohya.safetensors"),
                            {{"lora_unet_joint_blocks_0_x_block_attn_qkv.lora_down.weight", at::zeros({2, 16})}});
  const auto r = run_dew("sample --pipeline " + golden + "sd3/pipeline --prompt cat --steps 1 --lora " +
                         tmp.file("kohya.safetensors") + " --out " + tmp.file("bad.png"));
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_EQ(dew::test::count_lines(r.output), 1u) << r.output;
  EXPECT_NE(r.output.find("kohya's layout"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(tmp.path / "bad.png"));
}

// A kohya file of FLUX.1 in the original module naming (fused q/k/v, the modulations, the embedders, the final
// layer with shift and scale in the original order), on the tiny schnell folder: diffusers' load_lora_weights of the
// same file + set_adapters(0.5) (tests/golden/lora_kohya_flux_reference.py).
TEST(LoraPipelineCli, FluxKohyaFileInTheOriginalNamingMatchesDiffusers) {
  expect_diffusers_images("flux/pipeline_schnell", "lora/kohya_flux", "flux_kohya_bfl.safetensors",
                          " --prompt 'a photo of a cat on the moon' --steps 4 --size 16x16 --max-sequence-length 16");
}

// What diffusers does not check (its reader splits a single block's linear1 at FLUX.1-dev's widths, and drops the
// embedders' and the final layer's adapters): linear1 is one Linear whose rows are to_q, to_k, to_v and proj_mlp
// stacked, so its update scale * B A lands on those modules by rows; the final layer's modulation rows are (shift,
// scale) where norm_out's are (scale, shift); img_in is the x_embedder.
// A file for another width is refused, naming the key and the rows.
TEST(LoraFiles, FluxOriginalFusedModulesLandOnTheirPartsByRows) {
  dew::test::TempDir tmp("lora_kohya_flux_rows");
  const std::string folder = std::string(DEW_SOURCE_DIR) + "/tests/golden/flux/pipeline_schnell/transformer";
  auto model = dew::interop::load_diffusers_folder(folder);
  std::map<std::string, at::Tensor> base;
  for (const auto& kv : model.module->named_parameters()) base[kv.key()] = kv.value().detach().clone();
  const int64_t d = base.at("single_transformer_blocks.0.attn.to_q.weight").size(0);  // 16
  at::manual_seed(3);
  const at::Tensor a1 = at::randn({2, d}), b1 = at::randn({7 * d, 2}), a2 = at::randn({2, d}),
                   b2 = at::randn({2 * d, 2});
  const at::Tensor a3 = at::randn({2, base.at("x_embedder.weight").size(1)}), b3 = at::randn({d, 2});
  dew::io::save_safetensors(tmp.file("k.safetensors"),
                            {{"lora_unet_single_blocks_0_linear1.lora_down.weight", a1},
                             {"lora_unet_single_blocks_0_linear1.lora_up.weight", b1},
                             {"lora_unet_single_blocks_0_linear1.alpha", at::tensor(4.0)},
                             {"lora_unet_final_layer_adaLN_modulation_1.lora_down.weight", a2},
                             {"lora_unet_final_layer_adaLN_modulation_1.lora_up.weight", b2},
                             {"lora_unet_img_in.lora_down.weight", a3},
                             {"lora_unet_img_in.lora_up.weight", b3}});
  const auto report = dew::nn::load_lora_file(*model.module, tmp.file("k.safetensors"), 0.5);
  EXPECT_EQ(report.targets.size(), 6u);
  dew::nn::fold_lora(*model.module);
  const auto after = model.module->named_parameters();
  const std::string s = "single_transformer_blocks.0.";
  const std::vector<std::pair<std::string, int64_t>> parts = {
      {s + "attn.to_q", 0}, {s + "attn.to_k", d}, {s + "attn.to_v", 2 * d}, {s + "proj_mlp", 3 * d}};
  for (const auto& [name, first] : parts) {
    const at::Tensor w = after[name + ".weight"], w0 = base.at(name + ".weight");
    // alpha 4 over rank 2, times the file's scale 0.5
    const at::Tensor expected = w0 + 1.0 * b1.narrow(0, first, w0.size(0)).matmul(a1);
    EXPECT_TRUE(at::allclose(w, expected, 1e-5, 1e-6)) << name << " max diff " << (w - expected).abs().max();
  }
  // no alpha: alpha = rank, scale 1 x 0.5
  const at::Tensor swapped = at::cat({b2.narrow(0, d, d), b2.narrow(0, 0, d)});
  const at::Tensor expected = base.at("norm_out.linear.weight") + 0.5 * swapped.matmul(a2);
  EXPECT_TRUE(at::allclose(after["norm_out.linear.weight"], expected, 1e-5, 1e-6));
  const at::Tensor embed = base.at("x_embedder.weight") + 0.5 * b3.matmul(a3);  // img_in is the x_embedder
  EXPECT_TRUE(at::allclose(after["x_embedder.weight"], embed, 1e-5, 1e-6));
  for (const auto& kv : after)
    if (kv.key().find("to_q") == std::string::npos && kv.key().find("to_k") == std::string::npos &&
        kv.key().find("to_v") == std::string::npos && kv.key().find("proj_mlp") == std::string::npos &&
        kv.key() != "norm_out.linear.weight" && kv.key() != "x_embedder.weight")
      EXPECT_TRUE(kv.value().equal(base.at(kv.key()))) << kv.key();

  // A linear1 of another width: refused before anything is attached.
  auto fresh = dew::interop::load_diffusers_folder(folder);
  dew::io::save_safetensors(tmp.file("wide.safetensors"),
                            {{"lora_unet_single_blocks_0_linear1.lora_down.weight", a1},
                             {"lora_unet_single_blocks_0_linear1.lora_up.weight", at::randn({7 * d + 8, 2})}});
  const std::string e =
      dew::test::error_of([&] { dew::nn::load_lora_file(*fresh.module, tmp.file("wide.safetensors")); });
  EXPECT_NE(e.find("lora_unet_single_blocks_0_linear1.lora_up.weight has shape [120, 2]"), std::string::npos) << e;
  EXPECT_NE(e.find("have 112 rows in all"), std::string::npos) << e;
  EXPECT_TRUE(dew::nn::lora_parameters(*fresh.module).empty());
}

}  // namespace lora_runs_test

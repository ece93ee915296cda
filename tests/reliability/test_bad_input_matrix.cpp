// The bad-input matrix (issue 44, item 8): bad inputs across every command — train flags and recipe JSON, data
// files, pipeline and model folders, run directories, post-training data, reward settings, forward inputs,
// eval flags, launch — each run through the `dew` program. Every one must be refused before any compute:
// exit 2, exactly one line on stderr that starts "dew: error: " and names the field or file (the case's
// needle), nothing on stdout, no abort, crash or backtrace, and the whole working tree (two trained runs, their
// data, the bad files) byte for byte as it was, with no file created. The cases run four at a time.
#include <gtest/gtest.h>
#include <spawn.h>
#include <sys/wait.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <thread>

#include "dew/io/safetensors.h"
#include "tests/data/tiny_tokens.h"
#include "tests/test_util.h"

extern char** environ;

namespace fs = std::filesystem;

namespace bad_input_matrix {

struct Outcome {
  int code = -1;  // exit status; 128 + N when ended by signal N (a timeout is SIGKILL: 137)
  std::string out, err;
  double seconds = 0;
};

// Runs `dew ARGS` (ARGS split as a shell would) with stdout and stderr in files under `logs`, killed after
// 60 s (a case that hangs fails instead of stalling the suite). Thread-safe: posix_spawn and waitpid.
Outcome run_dew(const std::string& args, const std::string& logs, size_t id) {
  const std::string out = logs + "/" + std::to_string(id) + ".out", err = logs + "/" + std::to_string(id) + ".err";
  // DEW_THREADS_CACHE=off: a thread split measured on this machine (dew tune threads) is announced by an info
  // line when a run sets its threads; the matrix is about the refusals.
  const std::string cmd = "exec env DEW_THREADS_CACHE=off timeout -s KILL 60 " + std::string(DEW_BINARY) + " " + args +
                          " </dev/null >" + out + " 2>" + err;
  const char* argv[] = {"/bin/sh", "-c", cmd.c_str(), nullptr};
  Outcome o;
  const auto t0 = std::chrono::steady_clock::now();
  pid_t pid = -1;
  int status = 0;
  if (posix_spawn(&pid, "/bin/sh", nullptr, nullptr, const_cast<char**>(argv), environ) == 0 &&
      waitpid(pid, &status, 0) == pid)
    o.code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  o.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  o.out = dew::test::read_bytes(out);
  o.err = dew::test::read_bytes(err);
  return o;
}

// Every entry under `root` by relative path: a file's bytes, "<dir>" for a directory.
std::map<std::string, std::string> snapshot(const fs::path& root) {
  std::map<std::string, std::string> out;
  for (const auto& e : fs::recursive_directory_iterator(root))
    out[fs::relative(e.path(), root).string()] =
        e.is_directory() ? std::string("<dir>") : dew::test::read_bytes(e.path());
  return out;
}

// What differs between two snapshots, one path a line.
std::string differences(const std::map<std::string, std::string>& a, const std::map<std::string, std::string>& b) {
  std::string out;
  for (const auto& [p, bytes] : a) {
    auto it = b.find(p);
    if (it == b.end()) out += "removed: " + p + "\n";
    else if (it->second != bytes) out += "changed: " + p + "\n";
  }
  for (const auto& [p, bytes] : b)
    if (!a.count(p)) out += "created: " + p + "\n";
  return out;
}

void write_file(const fs::path& p, const std::string& text) {
  fs::create_directories(p.parent_path());
  std::ofstream(p, std::ios::binary) << text;
}

std::string repeat(const std::string& s, int n) {
  std::string out;
  for (int i = 0; i < n; ++i) out += s;
  return out;
}

// A copy of the run `from` at `to` with the model file of each listed checkpoint cut to half its size.
void torn_copy(const fs::path& from, const fs::path& to, const std::vector<int>& steps) {
  fs::copy(from, to, fs::copy_options::recursive);
  for (int s : steps) {
    const fs::path m = to / "checkpoints" / ("step_" + std::to_string(s)) / "model.safetensors";
    fs::resize_file(m, fs::file_size(m) / 2);
  }
}

const std::string kDiffusion =
    "train diffusion --data '{\"name\":\"gaussian_blobs\",\"count\":64,\"size\":8,\"classes\":3}'"
    " --model.architecture simple_dit"
    " --model.fields '{\"patch_size\":2,\"emb_features\":16,\"num_layers\":1,\"num_heads\":2}'"
    " --loader.batch_size 8 --trainer.log_every 1 --trainer.val_every 0 --trainer.time_limit_minutes 0"
    " --trainer.checkpoint_every 2 --trainer.keep_checkpoints 3 --objective.steps 2 --objective.preview_per_class 1";
const std::string kTinyLm =
    " --model.fields '{\"emb_features\":32,\"num_layers\":1,\"num_heads\":2,\"max_seq_len\":64}'";

struct Case {
  std::string args;    // what follows `dew`
  std::string needle;  // the field or file the one line must name
};

TEST(BadInputMatrix, EveryBadInputIsRefusedBeforeComputeInOneLineWithTheTreeUnchanged) {
  dew::test::TempDir tmp("bad_input_matrix"), logs_dir("bad_input_matrix_logs");
  const fs::path T = tmp.path;
  const std::string t = T.string(), logs = logs_dir.path.string();
  const std::string golden = std::string(DEW_SOURCE_DIR) + "/tests/golden/sd";

  // Two trained runs (a diffusion run with checkpoints 2 and 4, an SFT run), the sums task's data.
  Outcome setup = run_dew("task sums --digits 1 --test 20 --out " + t + "/sums", logs, 9000);
  ASSERT_EQ(setup.code, 0) << setup.err;
  setup = run_dew(kDiffusion + " --trainer.steps 4 --run " + t + "/diff", logs, 9001);
  ASSERT_EQ(setup.code, 0) << setup.err;
  setup =
      run_dew("train sft --data " + t + "/sums/sft.jsonl --eval.prompts '' --trainer.steps 2 --loader.batch_size 8" +
                  kTinyLm + " --run " + t + "/sft",
              logs, 9002);
  ASSERT_EQ(setup.code, 0) << setup.err;
  const std::string D = t + "/diff", S = t + "/sft", sums = t + "/sums", N = t + "/new";
  const std::string grpo = "train grpo --init_from " + S + " --prompts " + sums + "/train_prompts.jsonl";

  // Damaged runs and bad files. Each deep document is deep enough to have crashed the program before these
  // checks (a segmentation fault, recursion after parsing): 10^6 levels in --config and config.json, 10^5 in
  // model_index.json and an SFT line.
  torn_copy(D, T / "torn", {4});        // the latest checkpoint torn
  torn_copy(D, T / "damaged", {2, 4});  // every checkpoint torn
  for (const char* copy : {"eval_1", "eval_2", "eval_3", "eval_4"}) torn_copy(D, T / copy, {});
  torn_copy(S, T / "eval_sft", {});
  torn_copy(S, T / "sft_torn", {2});  // a policy whose weights cannot load
  write_file(T / "broken/run.json", "{\"kind\": ");
  write_file(T / "bad/deep_config.json",
             "{\"model\": {\"fields\": {\"x\": " + repeat("[", 1000000) + repeat("]", 1000000) + "}}}");
  write_file(T / "bad/not_object.json", "[1, 2]");
  write_file(T / "bad/invalid.json", "{\"trainer\": ");
  write_file(T / "bad/unknown_key.json", "{\"bogus_key\": 1}");
  write_file(T / "bad/sft_not_json.jsonl", "this is not JSON\n");
  write_file(T / "bad/sft_no_messages.jsonl", "{\"conversation\": []}\n");
  write_file(T / "bad/empty.jsonl", "");
  write_file(T / "bad/sft_deep.jsonl", "{\"messages\": " + repeat("[", 100000) + repeat("]", 100000) + "}\n");
  write_file(T / "bad/dpo_no_rejected.jsonl", "{\"prompt\": \"1+1=\", \"chosen\": \"2\"}\n");
  write_file(T / "bad/prompts_no_prompt.jsonl", "{\"question\": \"1+1=\", \"answer\": \"2\"}\n");
  write_file(T / "bad/prompts.txt", "a cat\n");
  write_file(T / "bad/tokenizer_bad.json", "{\"model\": {\"type\": 7}}");
  write_file(T / "bad/garbage.safetensors", "not a safetensors file at all");
  dew::io::save_safetensors((T / "bad/wrong_names.safetensors").string(), {{"bogus_input", at::zeros({1, 3, 8, 8})}});
  write_file(T / "imgs/cls/bad.png", "\x89PNG\r\n\x1a\n this is no image");
  write_file(T / "idx_bad/train-images-idx3-ubyte.gz", "not gzip, not idx");
  write_file(T / "idx_bad/train-labels-idx1-ubyte.gz", "not gzip, not idx");
  write_file(T / "pipe_bad/model_index.json", "{\"_class_name\": ");
  write_file(T / "pipe_deep/model_index.json", "{\"_class_name\": \"StableDiffusionPipeline\", \"unet\": " +
                                                   repeat("[", 100000) + repeat("]", 100000) + "}");
  // A component's class that is not a string (fuzz finding 29).
  write_file(T / "pipe_class_number/model_index.json",
             "{\"_class_name\": \"StableDiffusionPipeline\", \"unet\": [\"diffusers\", 5]}");
  // A config.json value of the wrong type (fuzz finding 41: nlohmann's type error named no field).
  write_file(T / "unet_layers_string/config.json",
             "{\"_class_name\": \"UNet2DConditionModel\", \"down_block_types\": [\"DownBlock2D\"], "
             "\"block_out_channels\": [8], \"layers_per_block\": \"2\"}");
  write_file(T / "deep_model/config.json", "{\"_class_name\": \"AutoencoderKL\", \"block_out_channels\": " +
                                               repeat("[", 1000000) + repeat("]", 1000000) + "}");
  // Model folders with a link out of themselves (a pipeline's component folder, a model's weights file).
  fs::create_directories(T / "pipe_link");
  fs::copy_file(golden + "/pipeline/model_index.json", T / "pipe_link/model_index.json");
  fs::create_directory_symlink(golden + "/pipeline/unet", T / "pipe_link/unet");
  fs::create_directories(T / "model_link");
  fs::copy_file(golden + "/vae_sd3/config.json", T / "model_link/config.json");
  fs::create_symlink(golden + "/vae_sd3/diffusion_pytorch_model.safetensors",
                     T / "model_link/diffusion_pytorch_model.safetensors");
  dew::test::write_tiny_tokens((T / "tokens").string());
  dew::test::write_tiny_tokens((T / "tokens_bad").string());
  write_file(T / "tokens_bad/meta.json",
             "{\"tokenizer\": {\"name\": \"byte\"}, \"vocab_size\": 257, \"dtype\": \"uint16\", \"train_tokens\": "
             "999999999, \"val_tokens\": 96, \"eos_id\": 256, \"packed\": true}");
  const std::string deep_flag = repeat("[", 30000) + repeat("]", 30000);

  const std::vector<Case> cases = {
      // train: kinds, flags and values
      {"train", "expected a kind"},
      {"train bogus --run " + N, "\"bogus\""},
      {kDiffusion + " --bogus 1 --run " + N, "--bogus"},
      {kDiffusion + " --trainer.steps 0 --run " + N, "trainer.steps"},
      {kDiffusion + " --objective.preview_per_class -1 --run " + N, "objective.preview_per_class"},
      {kDiffusion + " --trainer.steps 1e30 --run " + N, "trainer.steps"},
      {kDiffusion + " --trainer.steps 18446744073709551615 --run " + N, "trainer.steps"},
      {kDiffusion + " --trainer.steps ten --run " + N, "trainer.steps"},
      // Arguments may hold any bytes; a recipe is JSON (UTF-8): a Latin-1 run name is refused, not written.
      {kDiffusion + " --run \"" + N + "$(printf '\\351t\\351')\"", "--run: not valid UTF-8"},
      {kDiffusion + " --model.fields.\"$(printf '\\351')\" 1 --run " + N, "not valid UTF-8"},
      {kDiffusion + " --trainer.keep_checkpoints 0 --run " + N, "trainer.keep_checkpoints"},
      {kDiffusion + " --trainer.time_limit_minutes -1 --run " + N, "trainer.time_limit_minutes"},
      {kDiffusion + " --trainer.autocast float16 --device cpu --run " + N, "trainer.autocast"},
      {kDiffusion + " --optim.lr -1 --run " + N, "optim.lr"},
      {kDiffusion + " --seed -1 --run " + N, "seed"},
      {kDiffusion + " --threads -1 --run " + N, "threads"},
      {kDiffusion + " --device tpu --run " + N, "device"},
      {kDiffusion + " --loader.batch_size 0 --run " + N, "loader.batch_size"},
      {kDiffusion + " --model.architecture nope --run " + N, "nope"},
      {kDiffusion + " --model.fields.num_layers 4294967296 --run " + N, "num_layers"},
      {kDiffusion + " --model.fields.emb_features 100000000 --run " + N, "emb_features"},
      {kDiffusion + " --model.fields.extra '" + deep_flag + "' --run " + N, "--model.fields.extra"},
      {kDiffusion + " --run " + sums + "/sft.jsonl", "exists and is not a directory"},
      // recipe JSON (--config)
      {kDiffusion + " --config " + t + "/bad/deep_config.json --run " + N, "deep_config.json"},
      {kDiffusion + " --config " + t + "/bad/not_object.json --run " + N, "not_object.json"},
      {kDiffusion + " --config " + t + "/bad/invalid.json --run " + N, "invalid.json"},
      {kDiffusion + " --config " + t + "/bad/unknown_key.json --run " + N, "bogus_key"},
      {kDiffusion + " --config " + t + "/missing.json --run " + N, "missing.json"},
      {kDiffusion + " --config " + t + "/broken/run.json --run " + N, "broken/run.json"},
      // data files and data sources
      {"train diffusion --data '{\"name\":\"gaussian_blobs\",\"count\":-5}' --run " + N, "count"},
      {"train diffusion --data nowhere_set --run " + N, "nowhere_set"},
      {"train diffusion --data '{\"name\":\"gaussian_blobs\",\"count\":1000000000000}' --run " + N,
       "gaussian_blobs.count"},
      {"train diffusion --data '{\"name\":\"gaussian_blobs\",\"classes\":4294967296}' --run " + N,
       "gaussian_blobs.classes"},
      {kDiffusion + " --loader.prefetch 1099511627776 --run " + N, "loader.prefetch"},
      {kDiffusion + " --loader.batch_size 1000 --loader.drop_last true --run " + N, "loader.batch_size"},
      {"train diffusion --data '{\"name\":\"image_folder\",\"dir\":\"" + t + "/imgs\",\"size\":8}' --run " + N,
       "bad.png"},
      {"train diffusion --data '{\"name\":\"image_folder\",\"dir\":\"" + t + "/no_imgs\"}' --run " + N, "no_imgs"},
      {"train diffusion --data '{\"name\":\"fashion_mnist\",\"dir\":\"" + t + "/idx_bad\"}' --run " + N, "idx_bad"},
      {"train lm --data.name tokens --data.dir " + t + "/nowhere_tokens" + kTinyLm + " --run " + N, "nowhere_tokens"},
      {"train lm --data.name tokens --data.dir " + t + "/tokens_bad" + kTinyLm + " --run " + N, "tokens_bad"},
      {"train lm --data.name tokens --data.dir " + t + "/tokens" + kTinyLm +
           " --model.fields.num_layers 4294967296 --run " + N,
       "num_layers"},
      // run directories: resuming another run, torn checkpoints, broken records
      {"train diffusion --data '{\"name\":\"gaussian_blobs\",\"count\":64,\"size\":8,\"classes\":3}'"
       " --model.architecture simple_dit --model.fields '{\"patch_size\":2,\"emb_features\":32,\"num_layers\":1,"
       "\"num_heads\":2}' --run " +
           D,
       "was trained with model"},
      {"train lm --data.name tokens --data.dir " + t + "/tokens" + kTinyLm +
           " --objective.seq_len 16 --loader.batch_size 4 --run " + D,
       "is a \"diffusion\" run"},
      {kDiffusion + " --trainer.steps 6 --strict-resume --run " + t + "/torn", "torn/checkpoints/step_4"},
      {kDiffusion + " --trainer.steps 6 --run " + t + "/damaged", "every checkpoint is damaged"},
      {kDiffusion + " --trainer.steps 6 --run " + t + "/broken", "broken/run.json"},
      {"sample " + t + "/nowhere --out " + t + "/grid.png", "nowhere"},
      {"sample " + t + "/broken --out " + t + "/grid.png", "broken/run.json"},
      {"sample " + S + " --out " + t + "/grid.png", "not a diffusion run"},
      {"sample " + D + " --step 99 --out " + t + "/grid.png", "step"},
      {"sample " + D + " --solver bogus --out " + t + "/grid.png", "bogus"},
      {"sample " + D + " --weights bogus --out " + t + "/grid.png", "--weights"},
      {"sample " + t + "/damaged --out " + t + "/grid.png", "damaged/checkpoints/step_4/model.safetensors"},
      // post-training data, rewards, policies
      {"train sft --data " + t + "/bad/sft_not_json.jsonl" + kTinyLm + " --run " + N, "sft_not_json.jsonl"},
      {"train sft --data " + t + "/bad/sft_no_messages.jsonl" + kTinyLm + " --run " + N, "sft_no_messages.jsonl"},
      {"train sft --data " + t + "/bad/empty.jsonl" + kTinyLm + " --run " + N, "empty.jsonl"},
      {"train sft --data " + t + "/bad/sft_deep.jsonl" + kTinyLm + " --run " + N, "sft_deep.jsonl"},
      {"train sft --data " + t + "/missing.jsonl" + kTinyLm + " --run " + N, "missing.jsonl"},
      {"train sft --data " + sums + "/sft.jsonl --chat_template chatml" + kTinyLm + " --run " + N, "chatml"},
      {"train sft --init_from " + t + "/nowhere --data " + sums + "/sft.jsonl --run " + N, "init_from"},
      {"train dpo --init_from " + S + " --data " + t + "/bad/dpo_no_rejected.jsonl --run " + N, "rejected"},
      {"train sft --init_from " + t + "/sft_torn --data " + sums + "/sft.jsonl --run " + N,
       "sft_torn/checkpoints/step_2/model.safetensors"},
      {grpo + " --reward exact --run " + S, "is a \"sft\" run"},
      {"train grpo --init_from " + S + " --prompts " + t + "/bad/prompts_no_prompt.jsonl --reward exact --run " + N,
       "prompts_no_prompt.jsonl"},
      {grpo + " --reward exact --objective.mini_batches 3 --loader.batch_size 4 --objective.group_size 2 --run " + N,
       "objective.mini_batches"},
      {grpo + " --reward exact --objective.mini_batches 0 --run " + N, "objective.mini_batches"},
      {grpo + " --reward exactly --run " + N, "exactly"},
      {grpo + " --reward-command '' --run " + N, "reward"},
      {grpo + " --reward-command '   ' --run " + N, "reward command"},
      {grpo + " --reward-command 'python3 score.py' --reward_options.timeout_s -1 --run " + N, "timeout_s"},
      {grpo + " --reward exact,exact --run " + N, "named twice"},
      {grpo + " --reward length --reward_options.length_target -5 --run " + N, "length_target"},
      {grpo + " --reward exact --objective.group_size 1 --run " + N, "objective.group_size"},
      // language-model run commands: generate, eval, pairs, export
      {"generate " + S + " --prompt hi --temperature -1", "temperature"},
      {"generate " + S + " --prompt hi --max-new-tokens 1e30", "--max-new-tokens"},
      {"generate " + S + " --prompt hi --bogus 1", "--bogus"},
      {"generate " + D + " --prompt hi", "language-model run"},
      {"eval " + t + "/eval_sft --prompts " + t + "/missing.jsonl", "missing.jsonl"},
      {"pairs " + S + " --prompts " + t + "/missing.jsonl --out " + t + "/pairs.jsonl", "missing.jsonl"},
      {"pairs " + S + " --prompts " + sums + "/train_prompts.jsonl --samples 0 --out " + t + "/pairs.jsonl",
       "--samples"},
      {"export " + D + " " + t + "/exported", "language-model run"},
      {"export " + S + " " + t + "/exported --family bogus", "--family"},
      // eval (each on its own copy of a run: eval takes the run's writer lock, and the cases run in parallel)
      {"eval " + t + "/eval_1 --bogus 1", "--bogus"},
      {"eval " + t + "/eval_2 --count 20", "Fashion-MNIST"},
      {"eval " + t + "/eval_3 --weights bogus", "--weights"},
      {"eval " + t + "/eval_4 --step 99", "step"},
      {"eval " + t + "/nowhere", "nowhere"},
      {"eval --pipeline " + golden + "/pipeline --prompts " + t + "/missing.txt --clip " + t + "/no_clip",
       "missing.txt"},
      {"eval --pipeline " + golden + "/pipeline --prompts " + t + "/bad/prompts.txt --clip " + t + "/no_clip",
       "no_clip"},
      // pipeline and model folders, forward inputs
      {"sample --pipeline " + t + "/nowhere --prompt x --out " + t + "/p.png", "nowhere"},
      {"sample --pipeline " + t + "/pipe_bad --prompt x --out " + t + "/p.png", "model_index.json"},
      {"sample --pipeline " + t + "/pipe_deep --prompt x --out " + t + "/p.png", "pipe_deep/model_index.json"},
      {"sample --pipeline " + t + "/pipe_class_number --prompt x --out " + t + "/p.png",
       "pipe_class_number/model_index.json: \"unet\" must be [library, class]"},
      {"sample --pipeline " + golden + "/pipeline --prompt x --out " + t + "/p.jpg", "--out"},
      {"sample --pipeline " + t + "/pipe_link --prompt x --out " + t + "/p.png", "pipe_link/unet\" is a symbolic link"},
      {"forward " + t + "/model_link --inputs " + t + "/bad/wrong_names.safetensors --out " + t + "/f.safetensors",
       "model_link/diffusion_pytorch_model.safetensors\" is a symbolic link"},
      {"sample --pipeline " + golden + "/pipeline --prompt x --size 0x0 --out " + t + "/p.png", "--size"},
      // one step under shift_terminal would run on NaN sigmas (fuzz finding 25)
      {"sample --pipeline " + golden + "/../qwen_image/pipeline --prompt x --steps 1 --size 32x32 --out " + t +
           "/p.png",
       "shift_terminal"},
      {"forward " + t + "/nowhere --inputs " + t + "/bad/wrong_names.safetensors --out " + t + "/f.safetensors",
       "nowhere"},
      {"forward " + t + "/unet_layers_string --inputs " + t + "/bad/wrong_names.safetensors --out " + t +
           "/f.safetensors",
       "layers_per_block"},
      {"forward " + t + "/deep_model --inputs " + t + "/bad/wrong_names.safetensors --out " + t + "/f.safetensors",
       "deep_model/config.json"},
      {"forward " + golden + "/vae_sd3 --inputs " + t + "/bad/garbage.safetensors --out " + t + "/f.safetensors",
       "garbage.safetensors"},
      {"forward " + golden + "/vae_sd3 --inputs " + t + "/bad/wrong_names.safetensors --out " + t + "/f.safetensors",
       "bogus_input"},
      {"forward " + golden + "/vae_sd3 --dtype float16 --inputs " + t + "/bad/wrong_names.safetensors --out " + t +
           "/f.safetensors",
       "--dtype"},
      // tokenize, task, launch, the command itself
      {"tokenize --input " + t + "/missing.txt --out " + t + "/tok", "missing.txt"},
      {"tokenize --input " + sums + "/sft.jsonl --out " + t + "/tok --val-fraction 2", "--val-fraction"},
      {"tokenize --input " + sums + "/sft.jsonl --out " + t + "/tok --tokenizer " + t + "/bad/tokenizer_bad.json",
       "tokenizer_bad.json"},
      {"task bogus --out " + t + "/task", "sums"},
      {"launch --nproc-per-node 0 -- train diffusion --run " + N, "--nproc-per-node"},
      {"launch --nproc-per-node 2", "--"},
      {"launch --nproc-per-node 2 --master-port 70000 -- train diffusion --run " + N, "--master-port"},
      {"frobnicate", "unknown command"},
      {"list bogus", "bogus"},
  };
  ASSERT_GE(cases.size(), 60u);

  const auto before = snapshot(T);
  std::vector<Outcome> outcomes(cases.size());
  std::atomic<size_t> next{0};
  std::vector<std::thread> workers;
  const auto t0 = std::chrono::steady_clock::now();
  for (int w = 0; w < 4; ++w)
    workers.emplace_back([&] {
      for (size_t i = next++; i < cases.size(); i = next++) outcomes[i] = run_dew(cases[i].args, logs, i);
    });
  for (auto& w : workers) w.join();
  const double total = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  for (size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    const Outcome& o = outcomes[i];
    const std::string what = "case " + std::to_string(i) + ": dew " + c.args.substr(0, 300) +
                             "\nstderr: " + o.err.substr(0, 2000) + "\nstdout: " + o.out.substr(0, 500);
    EXPECT_EQ(o.code, 2) << what;
    EXPECT_EQ(dew::test::count_lines(o.err), 1u) << what;
    EXPECT_EQ(o.err.rfind("dew: error: ", 0), 0u) << what;
    EXPECT_NE(o.err.find(c.needle), std::string::npos) << "needle \"" << c.needle << "\"\n" << what;
    EXPECT_EQ(o.out, "") << what;
    for (const char* crash : {"terminate called", "Aborted", "Segmentation fault", "Exception raised from", "frame #"})
      EXPECT_EQ(o.err.find(crash), std::string::npos) << what;
    EXPECT_LT(o.seconds, 20.0) << "refused after compute? " << what;
  }
  EXPECT_EQ(differences(before, snapshot(T)), "");
  std::printf("%zu bad inputs refused in %.1f s (4 at a time)\n", cases.size(), total);
}

}  // namespace bad_input_matrix

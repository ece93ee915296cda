// Data-parallel training through the CLI (docs/distributed.md): `dew launch --nproc-per-node 2 -- train ...`
// on 127.0.0.1 with Gloo equals a one-process run of the same global batch to float-sum tolerance, the same
// 2-rank command twice writes byte-identical checkpoints, a 2-rank checkpoint resumes with one rank, and a
// rank killed with SIGKILL ends the launch with one line naming it, no rank left running.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <torch/cuda.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "dew/training/checkpoint.h"
#include "tests/data/tiny_tokens.h"
#include "tests/runs/checkpoint_checks.h"
#include "tests/test_util.h"

extern char** environ;

namespace ddp_test {

namespace fs = std::filesystem;
using dew::test::run_dew;

// A port no process listens on now (the kernel's pick for a socket bound to port 0).
int free_port() {
  const int s = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  bind(s, reinterpret_cast<sockaddr*>(&a), sizeof a);
  socklen_t n = sizeof a;
  getsockname(s, reinterpret_cast<sockaddr*>(&a), &n);
  close(s);
  return ntohs(a.sin_port);
}

std::string launch(int ranks) {
  return "launch --nproc-per-node " + std::to_string(ranks) + " --threads 1 --master-port " +
         std::to_string(free_port()) + " -- ";
}

// The tiny diffusion run of the reproducibility tests, a global batch of 8 (4 rows per rank on 2 ranks).
const std::string kDiffusion =
    "train diffusion --data '{\"name\":\"gaussian_blobs\",\"count\":64,\"size\":8,\"classes\":3}'"
    " --model.architecture simple_dit"
    " --model.fields '{\"patch_size\":2,\"emb_features\":32,\"num_layers\":1,\"num_heads\":2}'"
    " --loader.batch_size 8 --trainer.log_every 5 --objective.steps 2 --objective.preview_per_class 1"
    " --dist.timeout 20 --threads 1";

// The largest |a - b| over the tensors of two runs' model.safetensors at `step`.
double max_weight_diff(const std::string& a, const std::string& b, int64_t step) {
  auto ca = dew::training::load_checkpoint(a, step, false), cb = dew::training::load_checkpoint(b, step, false);
  double worst = 0;
  EXPECT_EQ(ca.model.size(), cb.model.size());
  for (const auto& [name, t] : ca.model) {
    auto it = cb.model.find(name);
    if (it == cb.model.end()) {
      ADD_FAILURE() << name << " missing in " << b;
      continue;
    }
    worst = std::max(worst, (t.to(at::kDouble) - it->second.to(at::kDouble)).abs().max().item<double>());
  }
  return worst;
}

// Processes whose parent is `parent` (the ranks of a launch).
std::vector<pid_t> children_of(pid_t parent) {
  std::vector<pid_t> out;
  for (const auto& e : fs::directory_iterator("/proc")) {
    const std::string name = e.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream stat(e.path() / "stat");
    std::string line;
    std::getline(stat, line);
    const auto close_paren = line.rfind(')');
    if (close_paren == std::string::npos) continue;
    std::istringstream rest(line.substr(close_paren + 2));
    char state = 0;
    pid_t ppid = 0;
    rest >> state >> ppid;
    if (ppid == parent) out.push_back(pid_t(std::stol(name)));
  }
  return out;
}

bool alive(pid_t pid) { return kill(pid, 0) == 0; }

// `cmd` as one process into NAME_one and as 2 ranks into NAME_two; the largest weight difference at `step`.
double one_rank_against_two(const dew::test::TempDir& tmp, const std::string& cmd, const std::string& name,
                            int64_t step) {
  for (const bool two : {false, true}) {
    const auto r =
        run_dew((two ? launch(2) : std::string()) + cmd + " --run " + tmp.file(name + (two ? "_two" : "_one")));
    EXPECT_EQ(r.code, 0) << r.output;
  }
  const double diff = max_weight_diff(tmp.file(name + "_one"), tmp.file(name + "_two"), step);
  std::printf("%s, 2 ranks vs 1 rank, step %lld: max |weight difference| %.3g\n", name.c_str(),
              static_cast<long long>(step), diff);
  return diff;
}

// The first line of DIR/metrics.jsonl.
dew::json first_logged(const std::string& dir) {
  std::ifstream f(dir + "/metrics.jsonl");
  std::string line;
  std::getline(f, line);
  return dew::json::parse(line);
}

std::string ddp_file_text(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

}  // namespace ddp_test

TEST(Distributed, TwoRanksEqualOneRankAndRepeatBitwise) {
  using namespace ddp_test;
  dew::test::TempDir tmp("ddp_equal");
  const std::string steps = " --trainer.steps 20 --trainer.checkpoint_every 20";
  auto r = run_dew(kDiffusion + steps + " --run " + tmp.file("one"));
  ASSERT_EQ(r.code, 0) << r.output;
  for (const char* dir : {"two_a", "two_b"}) {
    r = run_dew(launch(2) + kDiffusion + steps + " --run " + tmp.file(dir));
    ASSERT_EQ(r.code, 0) << r.output;
  }
  const double diff = max_weight_diff(tmp.file("one"), tmp.file("two_a"), 20);
  std::printf("2 ranks vs 1 rank, step 20: max |weight difference| %.3g\n", diff);
  EXPECT_LT(diff, 1e-4);  // float sums in another order (two half-batch means), not other maths
  dew::test::expect_same_checkpoint(tmp.file("two_a"), tmp.file("two_b"), 20);
  // Rank 0 alone wrote the run: metrics carry the world size.
  std::ifstream metrics(tmp.file("two_a") + "/metrics.jsonl");
  std::string first;
  std::getline(metrics, first);
  EXPECT_NE(first.find("\"world_size\":2"), std::string::npos) << first;
}

// dist.overlap on starts each bucket's all-reduce during backward; with small buckets most start there, and the
// weights are byte for byte those of the all-reduce after the whole backward (off, what auto picks with Gloo).
TEST(Distributed, OverlappedAllReduceGivesTheSameBits) {
  using namespace ddp_test;
  dew::test::TempDir tmp("ddp_overlap");
  const std::string cmd = kDiffusion + " --trainer.steps 10 --trainer.checkpoint_every 10 --dist.bucket_mb 0.004";
  auto r = run_dew(launch(2) + cmd + " --dist.overlap on --run " + tmp.file("overlap"));
  ASSERT_EQ(r.code, 0) << r.output;
  r = run_dew(launch(2) + cmd + " --run " + tmp.file("after"));
  ASSERT_EQ(r.code, 0) << r.output;
  dew::test::expect_same_checkpoint(tmp.file("overlap"), tmp.file("after"), 10);
  auto overlapped = [](const std::string& dir) { return first_logged(dir).value("allreduce_overlapped", -1.0); };
  const double share = overlapped(tmp.file("overlap"));
  std::printf("buckets whose all-reduce started during backward: %.2f\n", share);
  EXPECT_GT(share, 0.5);
  EXPECT_EQ(overlapped(tmp.file("after")), 0.0);
}

TEST(Distributed, LanguageModelTwoRanksEqualOneRank) {
  using namespace ddp_test;
  dew::test::TempDir tmp("ddp_lm");
  const std::string data = dew::test::write_tiny_tokens(tmp.file("tokens"));
  const std::string cmd =
      "train lm --data.name tokens --data.dir " + data +
      " --model.fields '{\"emb_features\":32,\"num_layers\":1,\"num_heads\":2,\"max_seq_len\":64}'"
      " --objective.seq_len 16 --objective.sample_tokens 4 --loader.batch_size 4 --trainer.steps 8"
      " --trainer.log_every 4 --trainer.val_every 0 --trainer.time_limit_minutes 0 --dist.timeout 20 --threads 1";
  auto r = run_dew(cmd + " --run " + tmp.file("one"));
  ASSERT_EQ(r.code, 0) << r.output;
  r = run_dew(launch(2) + cmd + " --run " + tmp.file("two"));
  ASSERT_EQ(r.code, 0) << r.output;
  const double diff = max_weight_diff(tmp.file("one"), tmp.file("two"), 8);
  std::printf("lm, 2 ranks vs 1 rank, step 8: max |weight difference| %.3g\n", diff);
  EXPECT_LT(diff, 1e-4);
}

// SFT's loss is the mean over the assistant tokens of the whole batch; rows hold different numbers of them, so
// each rank's part is its summed CE over the batch's count (a per-rank mean weighted by rows differed by 2e-3
// at step 8 here). DPO's is a mean over pairs.
TEST(Distributed, SftAndDpoTwoRanksEqualOneRank) {
  using namespace ddp_test;
  dew::test::TempDir tmp("ddp_sft");
  auto r = run_dew("task sums --digits 1 --test 20 --out " + tmp.file("sums"));
  ASSERT_EQ(r.code, 0) << r.output;
  const std::string cmd = "train sft --data " + tmp.file("sums") +
                          "/sft.jsonl --model.fields '{\"emb_features\":32,\"num_layers\":1,\"num_heads\":2,"
                          "\"max_seq_len\":64}' --trainer.steps 8 --trainer.val_every 0 --loader.batch_size 8"
                          " --trainer.time_limit_minutes 0 --eval.prompts '' --optim.lr 1e-3 --optim.warmup_steps 0"
                          " --trainer.log_every 8 --threads 1 --dist.timeout 20";
  EXPECT_LT(one_rank_against_two(tmp, cmd, "sft", 8), 1e-5);
  const auto one = first_logged(tmp.file("sft_one")), two = first_logged(tmp.file("sft_two"));
  EXPECT_NEAR(one["train/ce"].get<double>(), two["train/ce"].get<double>(), 1e-6);
  EXPECT_NEAR(one["train/tokens"].get<double>(), two["train/tokens"].get<double>(), 1e-9);

  // DPO from it, on pairs sampled from it: means over pairs, so slicing the rows is exact.
  r = run_dew("pairs " + tmp.file("sft_one") + " --prompts " + tmp.file("sums") +
              "/train_prompts.jsonl --samples 2 --max-new-tokens 6 --out " + tmp.file("pairs.jsonl"));
  ASSERT_EQ(r.code, 0) << r.output;
  const std::string dpo =
      "train dpo --init_from " + tmp.file("sft_one") + " --data " + tmp.file("pairs.jsonl") +
      " --trainer.steps 6 --trainer.val_every 0 --loader.batch_size 8 --trainer.time_limit_minutes 0"
      " --eval.prompts '' --optim.lr 1e-3 --optim.warmup_steps 0 --trainer.log_every 6 --threads 1"
      " --dist.timeout 20";
  EXPECT_LT(one_rank_against_two(tmp, dpo, "dpo", 6), 1e-5);
  const auto d1 = first_logged(tmp.file("dpo_one")), d2 = first_logged(tmp.file("dpo_two"));
  EXPECT_LT(d1["train/loss"].get<double>(), 0.68) << "DPO did not move the policy off the reference (log 2)";
  EXPECT_NEAR(d1["train/rewards/accuracies"].get<double>(), d2["train/rewards/accuracies"].get<double>(), 1e-9);
  EXPECT_NEAR(d1["train/loss"].get<double>(), d2["train/loss"].get<double>(), 1e-6);
}

// The autoencoder's posterior noise and JEPA's masks are drawn for the whole batch and sliced per rank, so each
// row gets its one-process draw: 2 ranks equal 1 at float-sum tolerance; latent diffusion on that autoencoder too.
TEST(Distributed, AutoencoderLatentDiffusionAndJepaTwoRanksEqualOneRank) {
  using namespace ddp_test;
  dew::test::TempDir tmp("ddp_ae_jepa");
  const std::string common =
      " --loader.batch_size 8 --trainer.val_every 0 --trainer.steps 8 --trainer.checkpoint_every 8"
      " --trainer.time_limit_minutes 0 --threads 1 --dist.timeout 20";
  const std::string autoencoder =
      "train autoencoder --data '{\"name\":\"gaussian_blobs\",\"count\":64,\"size\":16,\"classes\":3}'"
      " --model.fields '{\"block_out_channels\":[8,16],\"layers_per_block\":1,\"latent_channels\":2,"
      "\"norm_groups\":4}' --objective.posterior sample" +
      common;
  const std::string jepa =
      "train jepa --data '{\"name\":\"gaussian_blobs\",\"count\":96,\"size\":16,\"classes\":4}'"
      " --model.fields '{\"patch_size\":2,\"emb_features\":16,\"num_layers\":1,\"num_heads\":2}'"
      " --predictor.fields '{\"emb_features\":8,\"num_layers\":1,\"num_heads\":2}'" +
      common;
  for (const auto& [name, cmd] :
       std::vector<std::pair<std::string, std::string>>{{"autoencoder", autoencoder}, {"jepa", jepa}}) {
    EXPECT_LT(one_rank_against_two(tmp, cmd, name, 8), 1e-5) << name;
  }
  // Latent diffusion on that autoencoder from cached latents (the default) and encoding on the fly, a posterior
  // sample each time (the whole batch encoded and drawn on every rank).
  const std::string latent =
      "train diffusion --autoencoder.run " + tmp.file("autoencoder_one") +
      " --data '{\"name\":\"gaussian_blobs\",\"count\":64,\"size\":16,\"classes\":3}'"
      " --model.architecture unet_2d_condition --model.fields '{\"stages\":[{\"features\":8,\"heads\":1,"
      "\"cross_attention\":false},{\"features\":16,\"heads\":1,\"cross_attention\":false}],"
      "\"blocks_per_level\":1,\"norm_groups\":4,\"context_features\":0}' --objective.preview_per_class 0" +
      common;
  EXPECT_LT(one_rank_against_two(tmp, latent, "latent_cached", 8), 1e-5);
  EXPECT_LT(one_rank_against_two(tmp, latent + " --latent.cache false --latent.sample posterior", "latent_encoded", 8),
            1e-5);
}

TEST(Distributed, TwoRankCheckpointResumesWithOneRank) {
  using namespace ddp_test;
  dew::test::TempDir tmp("ddp_resume");
  const std::string cmd = kDiffusion + " --trainer.steps 12 --trainer.checkpoint_every 6";
  auto r = run_dew(launch(2) + cmd + " --run " + tmp.file("whole"));
  ASSERT_EQ(r.code, 0) << r.output;
  // The 2-rank run as it stood at step 6, resumed to the end by one process.
  fs::copy(tmp.file("whole"), tmp.file("run"), fs::copy_options::recursive);
  fs::remove_all(tmp.file("run") + "/checkpoints/step_12");
  r = run_dew(cmd + " --run " + tmp.file("run"));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("resuming"), std::string::npos) << r.output;
  EXPECT_EQ(dew::training::latest_checkpoint(tmp.file("run")), 12);
  // The loader state is global: the resumed run read the same batches, only float sums differ.
  const double diff = max_weight_diff(tmp.file("run"), tmp.file("whole"), 12);
  std::printf("2 ranks to step 6 then 1 rank, vs 2 ranks throughout, step 12: max |weight difference| %.3g\n", diff);
  EXPECT_LT(diff, 1e-4);
}

// GRPO: each rank rolls out its prompts' groups and the ranks gather the rollout, so 2 ranks write the
// rollouts.jsonl one process writes (every row samples from its own stream) and train to the same weights at
// float-sum tolerance; the rollout buffer in a 2-rank checkpoint is the whole rollout's, so one process resumes
// it mid-rollout.
TEST(Distributed, GrpoTwoRanksRollOutWhatOneRankDoesAndResumeWithOne) {
  using namespace ddp_test;
  dew::test::TempDir tmp("ddp_grpo");
  const std::string sums = tmp.file("sums");
  auto r = run_dew("task sums --digits 1 --test 20 --out " + sums);
  ASSERT_EQ(r.code, 0) << r.output;
  r = run_dew("train sft --data " + sums +
              "/sft.jsonl --model.fields '{\"emb_features\":32,\"num_layers\":1,\"num_heads\":2,\"max_seq_len\":64}'"
              " --trainer.steps 6 --trainer.val_every 0 --loader.batch_size 8 --threads 1 --run " +
              tmp.file("sft"));
  ASSERT_EQ(r.code, 0) << r.output;
  // 4 prompts x 4 completions per rollout, 2 mini-batches of 8: a rollout feeds 2 steps. The reward (a digit in
  // the completion) splits most groups of this barely trained model, so the policy moves.
  const std::string grpo = "train grpo --init_from " + tmp.file("sft") + " --prompts " + sums +
                           "/train_prompts.jsonl --reward format --reward_options.format '[\\s\\S]*[0-9][\\s\\S]*'"
                           " --optim.lr 1e-3 --optim.warmup_steps 0 --loader.batch_size 4"
                           " --objective.group_size 4 --objective.max_new_tokens 4 --trainer.val_every 0"
                           " --trainer.time_limit_minutes 0 --dist.timeout 20 --threads 1";
  r = run_dew(grpo + " --trainer.steps 6 --run " + tmp.file("one"));
  ASSERT_EQ(r.code, 0) << r.output;
  r = run_dew(launch(2) + grpo + " --trainer.steps 6 --run " + tmp.file("two"));
  ASSERT_EQ(r.code, 0) << r.output;
  const std::string rollouts = ddp_file_text(tmp.file("one") + "/rollouts.jsonl");
  EXPECT_EQ(std::count(rollouts.begin(), rollouts.end(), '\n'), 48);  // 3 rollouts of 16 rows
  EXPECT_EQ(ddp_file_text(tmp.file("two") + "/rollouts.jsonl"), rollouts);
  const double moved = max_weight_diff(tmp.file("sft"), tmp.file("one"), 6);
  EXPECT_GT(moved, 1e-3) << "GRPO did not move the policy";
  double diff = max_weight_diff(tmp.file("one"), tmp.file("two"), 6);
  std::printf("grpo, 2 ranks vs 1 rank, step 6: max |weight difference| %.3g\n", diff);
  EXPECT_LT(diff, 1e-4);
  // The logged rollout statistics are those of the whole rollout on both.
  auto rewards = [](const std::string& dir) {
    std::vector<double> out;
    std::ifstream f(dir + "/metrics.jsonl");
    for (std::string line; std::getline(f, line);) {
      const auto j = dew::json::parse(line);
      if (j.contains("train/reward")) out.push_back(j["train/reward"].get<double>());
    }
    return out;
  };
  const auto one = rewards(tmp.file("one")), two = rewards(tmp.file("two"));
  ASSERT_EQ(one.size(), two.size());
  ASSERT_FALSE(one.empty());
  for (size_t i = 0; i < one.size(); ++i) EXPECT_NEAR(one[i], two[i], 1e-12) << i;
  // 2 ranks to step 3 (inside the second rollout), then one process to step 6.
  r = run_dew(launch(2) + grpo + " --trainer.steps 3 --run " + tmp.file("switch"));
  ASSERT_EQ(r.code, 0) << r.output;
  r = run_dew(grpo + " --trainer.steps 6 --run " + tmp.file("switch"));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("resuming"), std::string::npos) << r.output;
  EXPECT_EQ(ddp_file_text(tmp.file("switch") + "/rollouts.jsonl"), rollouts);
  diff = max_weight_diff(tmp.file("one"), tmp.file("switch"), 6);
  std::printf("grpo, 2 ranks to step 3 then 1 rank, vs 1 rank, step 6: max |weight difference| %.3g\n", diff);
  EXPECT_LT(diff, 1e-4);
  // A mini-batch smaller than the world is refused before the run is written.
  r = run_dew(launch(2) + grpo + " --trainer.steps 2 --objective.mini_batches 16 --run " + tmp.file("small"));
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.output.find("objective.mini_batches: a mini-batch of 1 completions"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(tmp.file("small") + "/run.json"));
}

TEST(Distributed, KilledRankEndsTheLaunchWithOneLine) {
  using namespace ddp_test;
  dew::test::TempDir tmp("ddp_kill");
  const std::string out = tmp.file("launch.txt");
  const std::string cmd = "exec " + std::string(DEW_BINARY) + " " + launch(2) + kDiffusion +
                          " --trainer.steps 100000 --run " + tmp.file("run") + " >" + out + " 2>&1";
  const char* argv[] = {"/bin/sh", "-c", cmd.c_str(), nullptr};
  pid_t pid = -1;
  ASSERT_EQ(posix_spawn(&pid, "/bin/sh", nullptr, nullptr, const_cast<char**>(argv), environ), 0);
  // Wait until both ranks train (rank 0 has logged a step).
  std::vector<pid_t> ranks;
  for (int i = 0; i < 600; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    ranks = children_of(pid);
    if (ranks.size() == 2 && fs::exists(tmp.file("run") + "/metrics.jsonl") &&
        fs::file_size(tmp.file("run") + "/metrics.jsonl") > 0)
      break;
  }
  ASSERT_EQ(ranks.size(), 2u);
  std::sort(ranks.begin(), ranks.end());  // forked in rank order
  kill(ranks[1], SIGKILL);
  int status = 0;
  waitpid(pid, &status, 0);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_NE(WEXITSTATUS(status), 0);
  std::ifstream f(out);
  const std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find("launch: rank 1 of 2 ended with killed by SIGKILL"), std::string::npos) << text;
  for (pid_t p : ranks) EXPECT_FALSE(alive(p)) << "rank pid " << p << " left behind";
}

TEST(Distributed, KilledAndRelaunchedEndsBitForBit) {
  using namespace ddp_test;
  dew::test::TempDir tmp("ddp_relaunch");
  const std::string cmd = kDiffusion + " --trainer.steps 30 --trainer.checkpoint_every 5";
  auto r = run_dew(launch(2) + cmd + " --run " + tmp.file("whole"));
  ASSERT_EQ(r.code, 0) << r.output;
  const std::string line =
      "exec " + std::string(DEW_BINARY) + " " + launch(2) + cmd + " --run " + tmp.file("run") + " >/dev/null 2>&1";
  const char* argv[] = {"/bin/sh", "-c", line.c_str(), nullptr};
  pid_t pid = -1;
  ASSERT_EQ(posix_spawn(&pid, "/bin/sh", nullptr, nullptr, const_cast<char**>(argv), environ), 0);
  std::vector<pid_t> ranks;
  for (int i = 0; i < 1200 && !fs::exists(tmp.file("run") + "/checkpoints/step_10"); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(25));
    ranks = children_of(pid);
  }
  ASSERT_EQ(ranks.size(), 2u);
  std::sort(ranks.begin(), ranks.end());
  kill(ranks[1], SIGKILL);  // rank 1, mid-run
  int status = 0;
  waitpid(pid, &status, 0);
  EXPECT_NE(status, 0);
  r = run_dew(launch(2) + cmd + " --run " + tmp.file("run"));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("resuming"), std::string::npos) << r.output;
  dew::test::expect_same_checkpoint(tmp.file("whole"), tmp.file("run"), 30);
}

TEST(Distributed, SetupFaultsAreOneLine) {
  using namespace ddp_test;
  dew::test::TempDir tmp("ddp_faults");
  // A global batch the world size does not divide.
  auto r = run_dew(launch(3) + kDiffusion + " --trainer.steps 2 --run " + tmp.file("odd"));
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.output.find("not divisible by the world size 3"), std::string::npos) << r.output;
  // torchrun's variables out of range.
  const std::string env_cmd = "env WORLD_SIZE=2 RANK=2 " + std::string(DEW_BINARY) + " " + kDiffusion +
                              " --trainer.steps 1 --run " + tmp.file("env") + " 2>&1";
  FILE* p = popen(env_cmd.c_str(), "r");
  std::string text;
  char buf[4096];
  while (fgets(buf, sizeof buf, p)) text += buf;
  EXPECT_NE(pclose(p), 0);
  EXPECT_NE(text.find("RANK=2 is out of range; accepted: 0..1"), std::string::npos) << text;
  // The rendezvous port already taken by another listener.
  const int s = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(s, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  listen(s, 1);
  socklen_t n = sizeof a;
  getsockname(s, reinterpret_cast<sockaddr*>(&a), &n);
  r = run_dew("launch --nproc-per-node 2 --threads 1 --master-port " + std::to_string(ntohs(a.sin_port)) + " -- " +
              kDiffusion + " --trainer.steps 2 --run " + tmp.file("port"));
  close(s);
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.output.find("cannot serve the rendezvous"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("launch: rank 0 of 2 ended with exit status 2"), std::string::npos) << r.output;
}

// The NCCL path: one process per GPU (cuda:LOCAL_RANK), the run on two GPUs equal to one GPU's to float-sum
// tolerance. Runs where two CUDA devices are present.
TEST(Distributed, NcclTwoGpusEqualOneGpu) {
  using namespace ddp_test;
  if (torch::cuda::device_count() < 2) GTEST_SKIP() << "fewer than 2 CUDA devices";
  dew::test::TempDir tmp("ddp_nccl");
  const std::string cmd = kDiffusion + " --device cuda --trainer.autocast off --trainer.steps 20";
  auto r = run_dew(cmd + " --run " + tmp.file("one"));
  ASSERT_EQ(r.code, 0) << r.output;
  r = run_dew(launch(2) + cmd + " --run " + tmp.file("two"));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("nccl"), std::string::npos) << r.output;
  const double diff = max_weight_diff(tmp.file("one"), tmp.file("two"), 20);
  std::printf("NCCL, 2 GPUs vs 1 GPU, step 20: max |weight difference| %.3g\n", diff);
  EXPECT_LT(diff, 1e-3);  // also cuBLAS's reduction order depends on the batch shape
}

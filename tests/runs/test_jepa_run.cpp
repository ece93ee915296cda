// JEPA runs through the command line and the run library: train, validate with probes, open, probe with
// baselines, and the initial encoder replayed from the run's seed.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>

#include "dew/objectives/jepa.h"
#include "dew/runs/jepa_run.h"
#include "tests/test_util.h"

namespace fs = std::filesystem;

namespace {

using dew::json;

// Gaussian blobs of 16 x 16 pixels, 4 classes; 8 x 8 tokens of 2 x 2 pixels.
const std::string kJepa =
    "train jepa --data '{\"name\":\"gaussian_blobs\",\"count\":96,\"size\":16,\"classes\":4}'"
    " --test_data '{\"name\":\"gaussian_blobs\",\"count\":48,\"size\":16,\"classes\":4,\"seed\":1}'"
    " --model.fields '{\"patch_size\":2,\"emb_features\":16,\"num_layers\":1,\"num_heads\":2}'"
    " --predictor.fields '{\"emb_features\":8,\"num_layers\":1,\"num_heads\":2}'"
    " --loader.batch_size 8 --trainer.log_every 2 --trainer.time_limit_minutes 0"
    " --objective.probe_train 96 --objective.probe_test 48 --objective.probe_epochs 3 --objective.knn_k 5";

json recipe(const std::string& dir) {
  json r = dew::runs::default_recipe("jepa");
  r["run"] = dir;
  r["data"] = {{"name", "gaussian_blobs"}, {"count", 128}, {"size", 16}, {"classes", 4}};
  r["model"]["fields"] = {{"patch_size", 2}, {"emb_features", 16}, {"num_layers", 1}, {"num_heads", 2}};
  r["predictor"]["fields"] = {{"emb_features", 8}, {"num_layers", 1}, {"num_heads", 2}};
  r["trainer"]["steps"] = 2;
  return r;
}

TEST(JepaRun, TrainsFromTheCommandLineAndLogsCollapseMetricsAndProbes) {
  dew::test::TempDir tmp("jepa_cli");
  const std::string dir = tmp.file("run");
  auto r =
      dew::test::run_dew(kJepa + " --trainer.steps 4 --trainer.val_every 2 --trainer.checkpoint_every 2 --run " + dir);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("val/linear_acc"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("val/probe_train_items: "), std::string::npos) << r.output;  // what the probe saw
  std::ifstream f(fs::path(dir) / "metrics.jsonl");
  std::string line;
  int train_lines = 0, val_lines = 0;
  while (std::getline(f, line)) {
    const json j = json::parse(line);
    if (j.contains("train/repr_std")) {
      ++train_lines;
      EXPECT_GT(j["train/repr_std"].get<double>(), 0.0);
      EXPECT_TRUE(j.contains("train/repr_cov_offdiag"));
      EXPECT_TRUE(std::isfinite(j["train/loss"].get<double>()));
    }
    if (j.contains("val/knn_acc")) {
      ++val_lines;
      EXPECT_GE(j["val/linear_acc"].get<double>(), 0.0);
      EXPECT_LE(j["val/knn_acc"].get<double>(), 1.0);
    }
  }
  EXPECT_EQ(train_lines, 2);
  EXPECT_EQ(val_lines, 2);  // at step 2 and at the end
  const json rec = dew::runs::read_record(dir);
  EXPECT_EQ(rec["kind"], "jepa");
  EXPECT_EQ(rec["model"]["architecture"], "jepa_encoder");  // "auto" resolved for images
  EXPECT_EQ(rec["model"]["fields"]["image_size"], 16);      // from the data
  EXPECT_EQ(rec["predictor"]["fields"]["patch_size"], 2);   // the encoder's grid
  EXPECT_EQ(rec["predictor"]["fields"]["encoder_features"], 16);

  // dew eval on a JEPA run: the probes of the trained encoder and both baselines, probed as the run's
  // validation probes (the recipe's tokens pool, the run's knn_k 5 and probe_epochs 3) unless flags say otherwise.
  r = dew::test::run_dew("eval " + dir + " --train-items 96");
  ASSERT_EQ(r.code, 0) << r.output;
  for (const char* row : {"trained (ema, step 4)", "initialisation", "pixels"})
    EXPECT_NE(r.output.find(row), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("kNN (k=5, weighted)"), std::string::npos) << r.output;
  const std::string written = (fs::path(dir) / "eval" / "probes_step_4.json").string();
  json probes = dew::test::read_json(written);
  EXPECT_EQ(probes["pool"], "tokens");
  EXPECT_EQ(probes["knn_k"], 5);
  EXPECT_EQ(probes["knn_prep"], "none");
  EXPECT_NE(r.output.find("written: " + written), std::string::npos) << r.output;  // the file, by name
  {  // ... and a row of eval.jsonl holding the same record with the command that made it
    std::ifstream log(fs::path(dir) / "eval.jsonl");
    std::string line;
    ASSERT_TRUE(std::getline(log, line));
    const json row = json::parse(line);
    EXPECT_EQ(row["command"], "dew eval " + dir + " --train-items 96");
    EXPECT_EQ(row["file"], written);
    EXPECT_EQ(row["rows"], probes["rows"]);
  }
  r = dew::test::run_dew("eval " + dir + " --train-items 96 --probe-epochs 1 --pool mean --knn-k 3 --knn-prep center");
  ASSERT_EQ(r.code, 0) << r.output;
  probes = dew::test::read_json(written);
  EXPECT_EQ(probes["pool"], "mean");
  EXPECT_EQ(probes["knn_k"], 3);
  EXPECT_EQ(probes["knn_prep"], "center");
  r = dew::test::run_dew("eval " + dir + " --train-items -3");
  EXPECT_EQ(r.code, 2) << r.output;
  r = dew::test::run_dew("eval " + dir + " --knn-vote plurality");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("--knn-vote: got \"plurality\", accepted: weighted, majority"), std::string::npos)
      << r.output;
  r = dew::test::run_dew("eval " + dir + " --knn-temperature 0");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("--knn-temperature: must be > 0, got 0"), std::string::npos) << r.output;
  r = dew::test::run_dew("eval " + dir +
                         " --train-items 96 --probe-epochs 1 --knn-k 5 --knn-vote majority --no-baselines");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("kNN (k=5, majority)"), std::string::npos) << r.output;
}

TEST(JepaRun, VideoRunsTrainOnMovingFashionMnist) {
  dew::test::TempDir tmp("jepa_video");
  auto r = dew::test::run_dew(
      "train jepa --data '{\"name\":\"moving_fashion_mnist\",\"count\":16,\"frames\":4,\"size\":32,\"split\":\"test\"}'"
      " --test_data "
      "'{\"name\":\"moving_fashion_mnist\",\"count\":8,\"frames\":4,\"size\":32,\"split\":\"test\",\"seed\":3}'"
      " --model.fields '{\"emb_features\":16,\"num_layers\":1,\"num_heads\":2}'"  // patch: the recipe's side / 4
      " --predictor.fields '{\"emb_features\":8,\"num_layers\":1,\"num_heads\":2}'"
      " --objective.tubes.spatial_scale '[0.25,0.25]' --objective.tubes.blocks 2"
      " --objective.probe_train 16 --objective.probe_test 8 --objective.probe_epochs 2 --objective.knn_k 3"
      " --loader.batch_size 4 --trainer.steps 2 --trainer.log_every 1 --trainer.time_limit_minutes 0 --run " +
      tmp.file("v"));
  ASSERT_EQ(r.code, 0) << r.output;
  const json rec = dew::runs::read_record(tmp.file("v"));
  EXPECT_EQ(rec["model"]["architecture"], "jepa_video_encoder");
  EXPECT_EQ(rec["model"]["fields"]["frames"], 4);
  EXPECT_EQ(rec["model"]["fields"]["patch_size"], 8);  // 32-pixel frames cut into 4 x 4 tokens
  EXPECT_EQ(rec["predictor"]["fields"]["frames"], 4);
  auto run = dew::runs::open_jepa_run(tmp.file("v"));
  EXPECT_EQ(run.encoder->grid().tokens(), 2 * 4 * 4);
}

TEST(JepaRun, TheInitialEncoderIsReplayedFromTheSeed) {
  dew::test::TempDir tmp("jepa_init");
  auto p = dew::runs::prepare("jepa", recipe(tmp.file("r")));
  auto init = dew::runs::initial_jepa_encoder(p.record);
  auto live = p.built.objective->module().named_parameters();
  int64_t n = 0;
  for (const auto& kv : init->named_parameters()) {
    EXPECT_TRUE(kv.value().equal(live["encoder." + kv.key()])) << kv.key();
    ++n;
  }
  EXPECT_GT(n, 5);
  json other = recipe(tmp.file("r"));
  other["seed"] = 5;
  other = dew::runs::prepare("jepa", other).record;
  EXPECT_FALSE(dew::runs::initial_jepa_encoder(other)->named_parameters()["blocks.0.attn.qkv.weight"].equal(
      init->named_parameters()["blocks.0.attn.qkv.weight"]));
  EXPECT_FALSE(fs::exists(tmp.file("r"))) << "prepare writes nothing";
}

TEST(JepaRun, BadRecipesAreRefusedBeforeAnythingIsWritten) {
  dew::test::TempDir tmp("jepa_bad");
  struct Case {
    std::string flags, needle;
  };
  const std::vector<Case> cases = {
      {"--model.architecture jepa_video_encoder", "does not take images"},
      {"--model.architecture bogus", "model.architecture: unknown \"bogus\""},
      {"--objective.loss huber", "objective.loss"},
      {"--objective.masks.targets 0", "objective.masks.targets"},
      {"--objective.knn_vote plurality", "objective.knn_vote: got \"plurality\", accepted: weighted, majority"},
      {"--objective.knn_temperature 0", "objective.knn_temperature: must be > 0, got 0"},
      {"--model.fields.patch_size 5", "image_size: must be a positive multiple of patch_size 5"},
      {"--data.size 18 --model.fields '{\"emb_features\":16,\"num_layers\":1,\"num_heads\":2}'",
       "model.fields.patch_size: not given, and the recipe cuts images into 4 x 4 tokens, which needs a side that is "
       "a multiple of 4, got 18"},
      {"--predictor.fields.patch_size 4", "model.predictor.fields.patch_size: must be the encoder's 2"},
      {"--device cpu --trainer.autocast float16", "trainer.autocast: float16 runs on CUDA only"},
  };
  for (const auto& c : cases) {
    auto r = dew::test::run_dew(kJepa + " --trainer.steps 1 " + c.flags + " --run " + tmp.file("x"));
    EXPECT_EQ(r.code, 2) << c.flags << "\n" << r.output;
    EXPECT_NE(r.output.find(c.needle), std::string::npos) << c.flags << "\n" << r.output;
    EXPECT_FALSE(fs::exists(tmp.file("x"))) << c.flags;
  }
}

}  // namespace

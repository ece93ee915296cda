// The bounds behind "validate everything, bound every size, then write" (issue 44, item 7), at the library's
// entry points: JSON nesting is bounded before a document is parsed, a model's integer fields before it is
// built, and a checkpoint is judged complete or damaged from its headers before a resume loads it; a model
// folder's symbolic links stay inside it (item 5).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "dew/io/files.h"
#include "dew/nn/backbones/backbone.h"
#include "dew/nn/backbones/causal_transformer.h"
#include "dew/training/checkpoint.h"
#include "tests/test_util.h"

namespace fs = std::filesystem;

namespace input_bounds {

std::string nested(int levels, const std::string& open = "[", const std::string& close = "]") {
  std::string s;
  for (int i = 0; i < levels; ++i) s += open;
  for (int i = 0; i < levels; ++i) s += close;
  return s;
}

TEST(InputBounds, JsonNestingIsBoundedBeforeParsing) {
  using dew::io::kMaxJsonDepth;
  // 64 levels parse; 65 are refused, naming the source, the bound and where it was crossed.
  EXPECT_EQ(dew::io::parse_json(nested(kMaxJsonDepth), "x.json").dump(), nested(kMaxJsonDepth));
  const std::string e = dew::test::error_of([] { dew::io::parse_json(nested(kMaxJsonDepth + 1), "x.json"); });
  EXPECT_EQ(e,
            "x.json: JSON nested more than 64 levels deep (at byte 64); accepted: at most 64 levels of arrays "
            "and objects");
  // Objects count as arrays do; a document nested 200000 deep is refused without recursing through it.
  std::string deep_object;
  for (int i = 0; i < 200000; ++i) deep_object += "{\"a\":";
  EXPECT_NE(dew::test::error_of([&] {
              dew::io::parse_json(deep_object + "1", "deep.json");
            }).find("deep.json: JSON nested more than 64 levels deep (at byte 320)"),
            std::string::npos);
  // Brackets inside strings, escaped quotes included, are text.
  const std::string text = "{\"k\": \"" + nested(100) + "\\\"" + nested(100, "{", "}") + "\"}";
  EXPECT_EQ(dew::io::parse_json(text, "s.json")["k"].get<std::string>().size(), 401u);
  // Closing brackets never make the depth negative: "]]]" then 64 levels is still 64.
  EXPECT_NO_THROW(dew::io::check_json_depth("]]]" + nested(kMaxJsonDepth), "odd"));
  // Invalid JSON names the source and the parser's position.
  const std::string bad = dew::test::error_of([] { dew::io::parse_json("{\"a\": ", "cfg.json"); });
  EXPECT_EQ(bad.rfind("cfg.json: invalid JSON: ", 0), 0u) << bad;
  EXPECT_NE(bad.find("parse error at line 1"), std::string::npos) << bad;
}

TEST(InputBounds, ModelSizesAreBoundedBeforeTheModelIsBuilt) {
  const dew::json tiny = {{"patch_size", 2}, {"emb_features", 16}, {"num_layers", 1},
                          {"num_heads", 2},  {"in_channels", 1},   {"output_channels", 1}};
  EXPECT_NO_THROW(dew::models::build("simple_dit", tiny));
  // A layer count of 2^32 is refused at once (it used to build layers until memory ran out).
  dew::json layers = tiny;
  layers["num_layers"] = int64_t(1) << 32;
  EXPECT_EQ(dew::test::error_of([&] { dew::models::build("simple_dit", layers); }),
            "model \"simple_dit\": num_layers 4294967296 is beyond what any model needs; accepted: at most 65536 "
            "(2^16, the bound of a count of layers, heads or blocks)");
  // A width beyond 2^24 likewise; 2^24 itself passes the bound (and fails, if at all, for other reasons).
  dew::json wide = tiny;
  wide["emb_features"] = (int64_t(1) << 24) + 2;
  EXPECT_EQ(dew::test::error_of([&] { dew::models::build("simple_dit", wide); }),
            "model \"simple_dit\": emb_features 16777218 is beyond what any model needs; accepted: at most 16777216 "
            "(2^24, the bound of a model size)");
  // Language models: a real vocabulary (Gemma 3's 262144 ids) builds; 70000 layers do not.
  const dew::json lm = {
      {"vocab_size", 262144}, {"emb_features", 8}, {"num_layers", 1}, {"num_heads", 2}, {"max_seq_len", 16}};
  EXPECT_NO_THROW(dew::models::language_models().build("causal_transformer", lm));
  dew::json deep = lm;
  deep["num_layers"] = 70000;
  EXPECT_NE(dew::test::error_of([&] {
              dew::models::language_models().build("causal_transformer", deep);
            }).find("model \"causal_transformer\": num_layers 70000 is beyond what any model needs"),
            std::string::npos);
}

// A checkpoint of two small tensors at `step`.
void save_tiny(const std::string& run, int64_t step) {
  dew::training::Checkpoint c;
  c.step = step;
  c.model = {{"w", at::arange(6, at::kFloat).reshape({2, 3}) * double(step)}};
  c.ema = c.model;
  c.optimizer = {{"w.exp_avg", at::zeros({2, 3})}};
  c.state = {{"seed", 1}};
  dew::training::save_checkpoint(run, c, 10);
}

TEST(InputBounds, ADamagedCheckpointIsJudgedFromItsHeadersAndSkippedOrRefused) {
  dew::test::TempDir tmp("input_bounds_ckpt");
  const std::string run = tmp.file("run");
  for (int64_t s : {2, 4, 6}) save_tiny(run, s);
  for (int64_t s : {2, 4, 6}) EXPECT_EQ(dew::training::checkpoint_damage(run, s), "") << s;
  auto rp = dew::training::resume_point(run, /*strict=*/true);
  EXPECT_EQ(rp.step, 6);
  EXPECT_TRUE(rp.damaged.empty());

  // step_6: a truncated optimizer file; step_4: a state.json of another step.
  const fs::path opt = fs::path(run) / "checkpoints/step_6/optimizer.safetensors";
  fs::resize_file(opt, fs::file_size(opt) - 1);
  std::ofstream(fs::path(run) / "checkpoints/step_4/state.json") << R"({"step": 5, "format": 1})";
  EXPECT_NE(dew::training::checkpoint_damage(run, 6).find("step_6/optimizer.safetensors"), std::string::npos);
  EXPECT_EQ(dew::training::checkpoint_damage(run, 4),
            run + "/checkpoints/step_4/state.json: records step 5 in the directory of step 4");
  rp = dew::training::resume_point(run, /*strict=*/false);
  EXPECT_EQ(rp.step, 2);
  ASSERT_EQ(rp.damaged.size(), 2u);
  EXPECT_EQ(rp.damaged[0].first, 6);
  EXPECT_EQ(rp.damaged[1].first, 4);
  const std::string strict = dew::test::error_of([&] { dew::training::resume_point(run, true); });
  EXPECT_EQ(strict.rfind("checkpoint " + run + "/checkpoints/step_6 is damaged (", 0), 0u) << strict;

  // Set aside, a damaged checkpoint is no longer listed; a second one of the same step gets its own name.
  EXPECT_EQ(dew::training::set_aside_checkpoint(run, 6), run + "/checkpoints/damaged_step_6");
  save_tiny(run, 6);
  fs::resize_file(opt, 10);
  EXPECT_EQ(dew::training::set_aside_checkpoint(run, 6), run + "/checkpoints/damaged_step_6.1");
  EXPECT_EQ(dew::training::list_checkpoints(run), (std::vector<int64_t>{2, 4}));

  // Nothing complete: refused, naming the latest and its damage.
  std::ofstream(fs::path(run) / "checkpoints/step_2/state.json") << "[]";
  const std::string none = dew::test::error_of([&] { dew::training::resume_point(run, false); });
  EXPECT_EQ(none.rfind("run " + run + ": every checkpoint is damaged (the latest, " + run + "/checkpoints/step_4: ", 0),
            0u)
      << none;
}

TEST(InputBounds, AFailedCheckpointWriteRemovesItsTemporaryDirectoryAndSaysWhatIsIntact) {
  dew::test::TempDir tmp("input_bounds_save");
  const std::string run = tmp.file("run");
  save_tiny(run, 2);
  // A write that fails inside the temporary directory (here a dtype safetensors cannot hold; on a full disk
  // ENOSPC, under a file size limit EFBIG: CheckpointFailures.* runs that through the CLI).
  dew::training::Checkpoint c;
  c.step = 4;
  c.model = {{"w", at::zeros({2}, at::kComplexFloat)}};
  c.ema = c.model;
  const std::string e = dew::test::error_of([&] { dew::training::save_checkpoint(run, c, 10); });
  EXPECT_EQ(e.rfind("checkpoint step_4 of run " + run + " could not be written (safetensors file '", 0), 0u) << e;
  EXPECT_NE(e.find("); the earlier checkpoints are intact (latest: step_2); free disk space (or raise the file size "
                   "limit) and rerun the same command to resume from step_2"),
            std::string::npos)
      << e;
  EXPECT_FALSE(fs::exists(fs::path(run) / "checkpoints" / ".tmp_step_4"));
  EXPECT_EQ(dew::training::list_checkpoints(run), (std::vector<int64_t>{2}));
  EXPECT_EQ(dew::training::checkpoint_damage(run, 2), "");
  // Without an earlier checkpoint the message says so.
  const std::string first = dew::test::error_of([&] { dew::training::save_checkpoint(tmp.file("fresh"), c, 10); });
  EXPECT_NE(first.find("; the run has no earlier checkpoint; rerun the same command to start again"), std::string::npos)
      << first;
}

TEST(InputBounds, AModelFoldersLinksStayInsideItOrItsHuggingFaceCacheRepository) {
  dew::test::TempDir tmp("folder_links");
  const fs::path t(tmp.path);
  auto write = [](const fs::path& p, const std::string& text) {
    fs::create_directories(p.parent_path());
    std::ofstream(p) << text;
  };
  auto refusal = [](const fs::path& dir) {
    return dew::test::error_of([&] { dew::io::check_folder_links(dir.string(), "model folder"); });
  };
  // Links inside the folder, a link to a folder inside it, a loop and the folder itself a link: accepted.
  write(t / "m/unet/config.json", "{}");
  fs::create_symlink("config.json", t / "m/unet/alias.json");
  fs::create_directory_symlink("unet", t / "m/unet_alias");
  fs::create_directory_symlink(".", t / "m/unet/loop");
  fs::create_directory_symlink("m", t / "m_link");
  EXPECT_EQ(refusal(t / "m"), "");
  EXPECT_EQ(refusal(t / "m_link"), "");

  // A file linked out of the tree, however deep, and a folder linked out of it: refused, naming the link,
  // where it points and the folder.
  write(t / "secret.bin", "x");
  fs::create_symlink("../../secret.bin", t / "m/unet/diffusion_pytorch_model.safetensors");
  std::string e = refusal(t / "m");
  EXPECT_NE(e.find("model folder: \"" + (t / "m/unet/diffusion_pytorch_model.safetensors").string() +
                   "\" is a symbolic link to \"" + fs::canonical(t / "secret.bin").string() +
                   "\", outside the folder \"" + fs::canonical(t / "m").string() + "\""),
            std::string::npos)
      << e;
  EXPECT_NE(refusal(t / "m/unet"), "");  // a component folder alike
  fs::remove(t / "m/unet/diffusion_pytorch_model.safetensors");
  fs::create_directory_symlink(t, t / "m/tokenizer");  // absolute, to an ancestor
  EXPECT_NE(refusal(t / "m").find("m/tokenizer\" is a symbolic link"), std::string::npos) << refusal(t / "m");
  fs::remove(t / "m/tokenizer");
  fs::create_symlink("/nowhere/at/all", t / "m/dangling");  // a dangling link out of the tree
  EXPECT_NE(refusal(t / "m").find("/nowhere/at/all"), std::string::npos) << refusal(t / "m");
  fs::remove(t / "m/dangling");
  EXPECT_EQ(refusal(t / "m"), "");

  // A Hugging Face cache snapshot: its files link into the repository's blobs/, which is outside the snapshot
  // but inside the repository folder; accepted for the snapshot and for a component inside it. A link out of
  // the repository is still refused.
  const fs::path repo = t / "hub/models--org--tiny";
  write(repo / "blobs/3f2a", "{}");
  write(repo / "blobs/9c1d", "weights");
  fs::create_directories(repo / "snapshots/abc123/unet");
  fs::create_symlink("../../../blobs/3f2a", repo / "snapshots/abc123/unet/config.json");
  fs::create_symlink("../../../blobs/9c1d", repo / "snapshots/abc123/unet/diffusion_pytorch_model.safetensors");
  EXPECT_EQ(refusal(repo / "snapshots/abc123"), "");
  EXPECT_EQ(refusal(repo / "snapshots/abc123/unet"), "");
  fs::create_symlink("../../../../../secret.bin", repo / "snapshots/abc123/unet/extra.bin");
  EXPECT_NE(refusal(repo / "snapshots/abc123/unet").find("outside the folder \"" + fs::canonical(repo).string()),
            std::string::npos)
      << refusal(repo / "snapshots/abc123/unet");
  // The same layout outside a cache (no models--ORG--NAME above snapshots/): blobs/ is out of the tree.
  const fs::path plain = t / "plain";
  write(plain / "blobs/3f2a", "{}");
  fs::create_directories(plain / "snapshots/abc123");
  fs::create_symlink("../../blobs/3f2a", plain / "snapshots/abc123/config.json");
  EXPECT_NE(refusal(plain / "snapshots/abc123"), "");
}

}  // namespace input_bounds

// Latent diffusion end to end, on tiny models and Gaussian blobs: `dew train autoencoder` trains and resumes
// bit for bit and `dew eval` scores it; a diffusion run on its frozen latents records where the autoencoder
// comes from, leaves it bitwise unchanged and out of its checkpoints, trains on cached latents equal to
// encoding on the fly, resumes bit for bit through the CLI, and `dew sample` decodes; a diffusers
// AutoencoderKL folder works the same way; bad recipes are one-line errors naming the field.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <filesystem>
#include <fstream>

#include "dew/core/rng.h"
#include "dew/io/safetensors.h"
#include "dew/objectives/diffusion.h"
#include "dew/runs/autoencoder_run.h"
#include "dew/runs/diffusion_run.h"
#include "dew/training/trainer.h"
#include "tests/runs/checkpoint_checks.h"
#include "tests/test_util.h"

namespace fs = std::filesystem;
using dew::json;

namespace {

using dew::test::run_dew;

const std::string kBlobs = R"({"name":"gaussian_blobs","count":48,"size":16,"classes":3})";
const std::string kHeldOut = R"({"name":"gaussian_blobs","count":24,"size":16,"classes":3,"seed":1})";
const json kAutoencoderFields = {
    {"block_out_channels", {8, 16}}, {"layers_per_block", 1}, {"latent_channels", 2}, {"norm_groups", 4}};
const json kUnetFields = {{"stages",
                           {{{"features", 8}, {"heads", 1}, {"cross_attention", false}},
                            {{"features", 16}, {"heads", 1}, {"cross_attention", false}}}},
                          {"blocks_per_level", 1},
                          {"norm_groups", 4},
                          {"context_features", 0}};

// The commands, with --run DIR unless `dir` is empty.
std::string autoencoder_command(const std::string& dir, int64_t steps) {
  return "train autoencoder" + (dir.empty() ? "" : " --run " + dir) + " --data '" + kBlobs + "' --test_data '" +
         kHeldOut + "' --model.fields '" + kAutoencoderFields.dump() + "' --loader.batch_size 8 --trainer.log_every 5" +
         " --trainer.val_every 0 --trainer.checkpoint_every 10 --trainer.steps " + std::to_string(steps);
}

std::string latent_command(const std::string& dir, const std::string& autoencoder) {
  return "train diffusion" + (dir.empty() ? "" : " --run " + dir) + " --autoencoder.run " + autoencoder + " --data '" +
         kBlobs + "' --model.architecture unet_2d_condition --model.fields '" + kUnetFields.dump() +
         "' --loader.batch_size 8 --trainer.log_every 2 --objective.steps 2 --objective.preview_per_class 1";
}

using dew::test::read_bytes;

// Width and height of a PNG file (its IHDR chunk).
std::pair<int, int> png_size(const fs::path& p) {
  const std::string b = read_bytes(p);
  EXPECT_GE(b.size(), 24u) << p;
  auto be = [&](size_t at) {
    return int((uint8_t(b[at]) << 24) | (uint8_t(b[at + 1]) << 16) | (uint8_t(b[at + 2]) << 8) | uint8_t(b[at + 3]));
  };
  return {be(16), be(20)};
}

using dew::test::expect_same_checkpoint;

// Runs `command` to its end in `dir` twice: straight, and (in `dir`_resumed) with its last checkpoint removed
// and the command rerun, so the rerun resumes from the one before; both must end on the same bits.
void expect_resume_bit_for_bit(const std::string& command, const std::string& dir, int64_t last, int64_t before) {
  auto r = run_dew(command + " --run " + dir);
  ASSERT_EQ(r.code, 0) << r.output;
  const std::string resumed = dir + "_resumed";
  r = run_dew(command + " --run " + resumed);
  ASSERT_EQ(r.code, 0) << r.output;
  fs::remove_all(fs::path(resumed) / "checkpoints" / ("step_" + std::to_string(last)));
  r = run_dew(command + " --run " + resumed);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("resuming " + resumed + " from step " + std::to_string(before)), std::string::npos)
      << r.output;
  expect_same_checkpoint(dir, resumed, last);
}

// One tiny autoencoder run, trained once for every test here.
class LatentDiffusion : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    tmp_ = new dew::test::TempDir("latent_diffusion");
    autoencoder_ = tmp_->file("vae");
    auto r = run_dew(autoencoder_command(autoencoder_, 20));
    ASSERT_EQ(r.code, 0) << r.output;
  }
  static void TearDownTestSuite() {
    delete tmp_;
    tmp_ = nullptr;
  }
  static std::string file(const std::string& name) { return tmp_->file(name); }

  // The latent recipe of latent_command() as the library takes it.
  static json recipe(const std::string& dir) {
    json r = dew::runs::default_recipe("diffusion");
    r["run"] = dir;
    r["autoencoder"]["run"] = autoencoder_;
    r["data"] = json::parse(kBlobs);
    r["model"] = {{"architecture", "unet_2d_condition"}, {"fields", kUnetFields}};
    r["loader"]["batch_size"] = 8;
    r["trainer"]["steps"] = 4;
    r["trainer"]["log_every"] = 2;
    r["objective"]["steps"] = 2;
    r["objective"]["preview_per_class"] = 1;
    return r;
  }

  static dew::test::TempDir* tmp_;
  static std::string autoencoder_;
};
dew::test::TempDir* LatentDiffusion::tmp_ = nullptr;
std::string LatentDiffusion::autoencoder_;

}  // namespace

TEST(AutoencoderRun, TrainsLossFallsScoresAndResumesBitForBit) {
  dew::test::TempDir tmp("autoencoder_run");
  const std::string dir = tmp.file("vae");
  auto r = run_dew(autoencoder_command(dir, 60));
  ASSERT_EQ(r.code, 0) << r.output;
  std::vector<double> losses;
  std::ifstream metrics(fs::path(dir) / "metrics.jsonl");
  json val;
  for (std::string line; std::getline(metrics, line);) {
    const json j = json::parse(line);
    if (j.contains("train/loss")) {
      losses.push_back(j["train/loss"]);
      EXPECT_TRUE(j.contains("train/reconstruction") && j.contains("train/kl")) << line;
    }
    if (j.contains("val/psnr")) val = j;
  }
  ASSERT_EQ(losses.size(), 12u);
  EXPECT_LT(losses.back(), 0.7 * losses.front()) << "first " << losses.front() << ", last " << losses.back();
  ASSERT_TRUE(val.contains("val/ssim")) << val.dump();
  EXPECT_TRUE(fs::exists(fs::path(dir) / "samples" / "step_60.png"));
  // 16 held-out images in 2 rows of 8, each over the row of their reconstructions: 8 x (16 + 2) + 2 wide, 4 x 18 + 2 high
  EXPECT_EQ(png_size(fs::path(dir) / "samples" / "step_60.png"), std::make_pair(146, 74));
  const json record = dew::runs::read_record(dir);
  EXPECT_EQ(record["model"]["fields"]["in_channels"], 1);  // from the data
  EXPECT_EQ(record["model"]["fields"]["sample_size"], 16);
  // dew eval scores the same held-out images with the same (EMA) weights as the last validation (to the float
  // rounding of another thread count)
  r = run_dew("eval " + dir);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("| ema | 60 | 24 |"), std::string::npos) << r.output;
  const auto scores = dew::runs::score_autoencoder_run(dir);
  EXPECT_NEAR(scores.psnr, val["val/psnr"].get<double>(), 1e-5);
  EXPECT_NEAR(scores.ssim, val["val/ssim"].get<double>(), 1e-6);
  EXPECT_TRUE(fs::exists(fs::path(dir) / "eval.jsonl"));
  // resumed from step 10 of 20, the run ends on the bits of the run that was not interrupted
  expect_resume_bit_for_bit(autoencoder_command("", 20), tmp.file("r"), 20, 10);
}

TEST_F(LatentDiffusion, RecordsTheAutoencoderKeepsItFrozenAndOutOfTheCheckpoints) {
  json rec = recipe(file("frozen"));
  rec["latent"]["cache"] = false;  // encoded as batches come, posterior samples from the step's generator
  rec["latent"]["sample"] = "posterior";
  auto p = dew::runs::prepare("diffusion", rec);
  auto obj = std::dynamic_pointer_cast<dew::DiffusionObjective>(p.built.objective);
  ASSERT_TRUE(obj && obj->latent());
  auto& ae = obj->latent()->autoencoder();
  const auto before = dew::training::module_state(ae);
  std::map<std::string, at::Tensor> copies;
  for (const auto& [k, v] : before) copies[k] = v.clone();
  for (const auto& prm : ae.parameters()) EXPECT_FALSE(prm.requires_grad());
  const auto model_before = dew::training::module_state(*obj->model());
  std::map<std::string, at::Tensor> model_copies;
  for (const auto& [k, v] : model_before) model_copies[k] = v.clone();
  dew::runs::train(p);
  for (const auto& [k, v] : dew::training::module_state(ae)) EXPECT_TRUE(at::equal(v, copies.at(k))) << k << " moved";
  int moved = 0;
  for (const auto& [k, v] : dew::training::module_state(*obj->model())) moved += !at::equal(v, model_copies.at(k));
  EXPECT_GT(moved, 0) << "the denoiser did not train";
  // ... and equal to the autoencoder run's own checkpoint
  auto opened = dew::runs::open_autoencoder_run(autoencoder_);
  for (const auto& [k, v] : dew::training::module_state(*opened.autoencoder))
    EXPECT_TRUE(at::equal(v, copies.at(k))) << k;
  // The checkpoint holds the denoiser only; run.json says where the autoencoder comes from.
  const auto saved = dew::io::load_safetensors(file("frozen") + "/checkpoints/step_4/model.safetensors");
  EXPECT_EQ(saved.size(), dew::training::module_state(*obj->model()).size());
  for (const auto& [k, v] : saved) EXPECT_EQ(copies.count(k), 0u) << k << " is the autoencoder's";
  const json record = dew::runs::read_record(file("frozen"));
  EXPECT_EQ(record["autoencoder"]["run"], autoencoder_);
  EXPECT_EQ(record["autoencoder"]["step"], 20);  // -1 resolved to the checkpoint it opened
  EXPECT_EQ(record["derived"]["sample_shape"], json({2, 8, 8}));
  EXPECT_EQ(record["derived"]["image_shape"], json({1, 16, 16}));
  EXPECT_EQ(record["derived"]["latent_scaling"]["source"], "std");
  EXPECT_EQ(record["model"]["fields"]["in_channels"], 2);  // from the latents
  EXPECT_EQ(record["model"]["fields"]["output_channels"], 2);
  // Opening the run rebuilds the autoencoder and the scale; its samples decode to images.
  auto opened_run = dew::runs::open_diffusion_run(file("frozen"));
  ASSERT_TRUE(opened_run.latent);
  EXPECT_EQ(opened_run.latent->scaling().scaling_factor,
            record["derived"]["latent_scaling"]["scaling_factor"].get<double>());
  EXPECT_EQ(opened_run.shape, std::vector<int64_t>({2, 8, 8}));
  EXPECT_EQ(opened_run.images(at::zeros({3, 2, 8, 8})).sizes(), at::IntArrayRef({3, 1, 16, 16}));
  // A pixel run's record has no latent sections (and, without adapters, no lora section).
  json pixel = recipe(file("pixel"));
  pixel["autoencoder"]["run"] = "";
  pixel["model"]["fields"].erase("in_channels");
  auto pp = dew::runs::prepare("diffusion", pixel);
  EXPECT_FALSE(pp.record.contains("autoencoder") || pp.record.contains("latent")) << pp.record.dump();
  EXPECT_FALSE(pp.record.contains("lora")) << pp.record.dump();
  EXPECT_EQ(pp.record["model"]["fields"]["in_channels"], 1);
}

TEST_F(LatentDiffusion, CachedLatentsEqualEncodingOnTheFly) {
  auto p = dew::runs::prepare("diffusion", recipe(file("cached")));
  auto obj = std::dynamic_pointer_cast<dew::DiffusionObjective>(p.built.objective);
  const auto& ds = p.built.loader->dataset();
  ASSERT_TRUE(ds.contains("latent"));
  EXPECT_FALSE(ds.contains("image"));
  const at::Tensor cached = ds.field("latent");
  ASSERT_EQ(cached.sizes(), at::IntArrayRef({48, 2, 8, 8}));
  auto images = dew::data::datasets().build(json::parse(kBlobs));
  // Encoded 7 at a time (the cache took 256): the same latents, to float rounding.
  auto gen = dew::rng::generator(0, 0, "unused by sample=mean");
  const at::Tensor fly = at::cat({obj->latent()->encode(images->field("image").slice(0, 0, 7), gen),
                                  obj->latent()->encode(images->field("image").slice(0, 7, 14), gen)});
  EXPECT_LT((fly - cached.slice(0, 0, 14)).abs().max().item<double>(), 1e-5);
  EXPECT_NEAR(cached.std().item<double>(), 1.0, 0.05);  // scale_by_std: unit std latents
  // The objective's loss on the cached field equals its loss on the images it encodes itself.
  const at::Tensor labels = images->field("label").slice(0, 0, 8);
  const dew::data::Batch from_cache = {{"latent", cached.slice(0, 0, 8)}, {"label", labels}};
  const dew::data::Batch from_images = {{"image", images->field("image").slice(0, 0, 8)}, {"label", labels}};
  const double a = obj->loss(from_cache, 0, dew::rng::generator(3, 0, "objective")).loss.item<double>();
  const double b = obj->loss(from_images, 0, dew::rng::generator(3, 0, "objective")).loss.item<double>();
  EXPECT_NEAR(a, b, 1e-5 * std::abs(a));
  EXPECT_EQ(obj->batch_fields(), std::vector<std::string>({"latent", "label"}));
}

TEST_F(LatentDiffusion, ResumesBitForBitThroughTheCliAndSamplesDecodedImages) {
  // Cached posterior samples: the cache is encoded again at resume from (seed, "latents/cache").
  const std::string cmd =
      latent_command("", autoencoder_) + " --latent.sample posterior --trainer.steps 6 --trainer.checkpoint_every 3";
  expect_resume_bit_for_bit(cmd, file("ld"), 6, 3);
  const std::string out = file("ld") + "/grid.png";
  auto r = run_dew("sample " + file("ld") + " --labels 0,1,2 --count 3 --steps 2 --out " + out);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(png_size(out), std::make_pair(3 * 18 + 2, 20));  // three decoded 16 x 16 images, not 8 x 8 latents
  EXPECT_TRUE(fs::exists(file("ld") + "/samples/step_6.png"));
  EXPECT_EQ(png_size(file("ld") + "/samples/step_6.png"), std::make_pair(3 * 18 + 2, 20));
  // Another autoencoder checkpoint is another run.
  r = run_dew(cmd + " --autoencoder.step 10 --run " + file("ld"));
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("was trained with autoencoder"), std::string::npos) << r.output;
}

TEST_F(LatentDiffusion, AFineTunedRunKeepsItsBasesLatentScaling) {
  // The base trains on the fixture's blobs; the fine-tuning run on other blobs (seed 1), whose own scale_by_std
  // differs. The model learned the base's scale, so a run from init_from keeps it (latent.scale auto).
  auto base = dew::runs::prepare("diffusion", recipe(file("scale_base")));
  dew::runs::train(base);
  const json base_scaling = dew::runs::read_record(file("scale_base"))["derived"]["latent_scaling"];
  json ft = recipe(file("scale_ft"));
  ft["data"] = json::parse(R"({"name":"gaussian_blobs","count":24,"size":16,"classes":3,"seed":1})");
  json own = ft;  // the same data and autoencoder without a base: the scale estimated on these blobs
  const json own_scaling = dew::runs::prepare("diffusion", own).record["derived"]["latent_scaling"];
  ASSERT_EQ(own_scaling["source"], "std");
  EXPECT_NE(own_scaling["scaling_factor"], base_scaling["scaling_factor"]);
  ft["init_from"] = file("scale_base");
  EXPECT_EQ(dew::runs::prepare("diffusion", ft).record["derived"]["latent_scaling"], base_scaling);
  // On another checkpoint of the autoencoder the base's latents were other latents: estimated anew.
  ft["autoencoder"]["step"] = 10;
  own["autoencoder"]["step"] = 10;
  EXPECT_EQ(dew::runs::prepare("diffusion", ft).record["derived"]["latent_scaling"],
            dew::runs::prepare("diffusion", own).record["derived"]["latent_scaling"]);
  // An explicit latent.scale is kept as asked.
  ft["autoencoder"]["step"] = 20;
  ft["latent"]["scale"] = "std";
  EXPECT_EQ(dew::runs::prepare("diffusion", ft).record["derived"]["latent_scaling"], own_scaling);
}

TEST_F(LatentDiffusion, ADiffusersAutoencoderFolderUsesItsOwnScalingFactor) {
  const std::string vae = std::string(DEW_SOURCE_DIR) + "/tests/golden/sd/vae";  // 3 channels, 2 levels, 4 latents
  const std::string dir = file("folder");
  auto r = run_dew("train diffusion --run " + dir + " --autoencoder.folder " + vae +
                   " --data '{\"name\":\"gaussian_blobs\",\"count\":16,\"size\":8,\"channels\":3,\"classes\":2}'"
                   " --model.architecture unet_2d_condition --model.fields '" +
                   kUnetFields.dump() +
                   "' --loader.batch_size 8 --trainer.steps 2 --objective.steps 2 --objective.preview_per_class 1");
  ASSERT_EQ(r.code, 0) << r.output;
  const json record = dew::runs::read_record(dir);
  EXPECT_EQ(record["derived"]["sample_shape"], json({4, 4, 4}));
  EXPECT_EQ(record["derived"]["latent_scaling"]["source"], "autoencoder");  // scale auto: a folder's own 0.18215
  EXPECT_EQ(record["autoencoder"]["folder"], vae);
  r = run_dew("sample " + dir + " --count 2 --labels 0,1 --steps 2 --out " + dir + "/s.png");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(png_size(dir + "/s.png"), std::make_pair(2 * 10 + 2, 12));
}

TEST_F(LatentDiffusion, BadRecipesAreOneLineErrorsNamingTheField) {
  const std::string dir = file("bad");
  const std::string cmd = latent_command(dir, autoencoder_) + " --trainer.steps 2";
  auto expect_error = [&](const std::string& extra, const std::vector<std::string>& needles) {
    auto r = run_dew(cmd + extra);
    EXPECT_EQ(r.code, 2) << extra << "\n" << r.output;
    EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << extra << "\n" << r.output;
    for (const auto& n : needles) EXPECT_NE(r.output.find(n), std::string::npos) << extra << "\n" << r.output;
    EXPECT_FALSE(fs::exists(dir)) << extra << ": a failed command wrote the run directory";
  };
  auto pixel =
      run_dew("train diffusion --run " + file("pixel_run") + " --data '" + kBlobs +
              "' --model.fields.feature_depths '[8,16]' --model.fields.emb_features 16 --model.fields.norm_groups 4"
              " --loader.batch_size 8 --trainer.steps 1 --objective.steps 1 --objective.preview_per_class 1");
  ASSERT_EQ(pixel.code, 0) << pixel.output;
  expect_error(" --autoencoder.run " + file("missing"), {"autoencoder.run: ", "is not a run directory"});
  expect_error(" --autoencoder.run " + file("pixel_run"), {"autoencoder.run: ", "not an autoencoder run"});
  expect_error(" --autoencoder.step 7", {"autoencoder.run: ", "no checkpoint of step 7"});
  expect_error(" --autoencoder.folder /tmp", {"autoencoder: give one of run"});
  expect_error(" --model.fields.in_channels 3", {"model.fields.in_channels: 3", "have 2 channels"});
  expect_error(" --model.fields.output_channels 4", {"model.fields.output_channels: 4"});
  expect_error(" --latent.sample mode", {"latent.sample", "mean, posterior"});
  expect_error(" --loader.hflip true", {"loader.hflip", "latent.cache"});
  expect_error(" --data '{\"name\":\"gaussian_blobs\",\"count\":8,\"size\":16,\"channels\":3}'",
               {"autoencoder: the images have 3 channels, the autoencoder takes 1"});
  expect_error(" --data '{\"name\":\"gaussian_blobs\",\"count\":8,\"size\":15}'",
               {"come back from the autoencoder as 14x14"});
  // The autoencoder kind checks its data the same way.
  auto r = run_dew(autoencoder_command(dir, 2) + " --data '{\"name\":\"gaussian_blobs\",\"count\":8,\"size\":15}'");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("data: gaussian_blobs images 15x15 come back"), std::string::npos) << r.output;
}

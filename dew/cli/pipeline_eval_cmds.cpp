// `dew eval --pipeline DIR --prompts FILE --clip CLIP_DIR`: the CLIP score (torchmetrics' CLIPScore) of a
// diffusers pipeline folder's images (SD, SDXL, SD3, Flux, Qwen-Image 2.1), one or more per prompt, each scored
// against its own prompt.
#include <ATen/ATen.h>

#include <fstream>
#include <iostream>

#include "dew/cli/commands.h"
#include "dew/cli/recipe.h"
#include "dew/core/threads.h"
#include "dew/interop/diffusers_pipeline.h"
#include "dew/interop/flow_pipeline.h"
#include "dew/metrics/clip_score.h"

namespace dew::cli {

namespace {
// The non-empty lines of a prompts file.
std::vector<std::string> pipeline_eval_prompts(const std::string& path) {
  std::ifstream in(path);
  DEW_CHECK(in.good(), "--prompts: cannot read \"", path, "\" (a text file, one prompt per line)");
  std::vector<std::string> out;
  for (std::string line; std::getline(in, line);) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (!line.empty()) out.push_back(line);
  }
  DEW_CHECK(!out.empty(), "--prompts: \"", path, "\" holds no prompt (one per line)");
  return out;
}
}  // namespace

int cmd_eval_pipeline(const std::vector<std::string>& args) {
  auto f = parse_flags(args, {"pipeline", "prompts", "clip", "steps", "guidance", "seed", "count", "threads"});
  DEW_CHECK(f.positional.empty(), "eval --pipeline: unexpected argument \"",
            f.positional.empty() ? "" : f.positional[0], "\" (the folder goes after --pipeline)");
  DEW_CHECK(f.has("prompts"), "eval --pipeline: --prompts FILE is required (one prompt per line)");
  DEW_CHECK(f.has("clip"), "eval --pipeline: --clip DIR is required (a transformers CLIPModel folder)");
  const auto prompts = pipeline_eval_prompts(f.get("prompts", ""));
  metrics::ClipScorer clip(f.get("clip", ""));  // refused here, before any sampling, when it is no CLIPModel
  interop::PipelineRequest r;
  r.seed = uint64_t(f.get_int("seed", 0));
  r.count = f.get_int("count", 1);
  DEW_CHECK(r.count >= 1, "--count: images per prompt, must be >= 1, got ", r.count);
  const std::string dir = f.get("pipeline", "");
  const bool flow = interop::is_flow_pipeline_folder(dir), qwen = interop::is_qwen_image_pipeline_folder(dir);
  set_threads(f.get_int("threads", 0), workload_of(qwen   ? "qwen_image_transformer"
                                                   : flow ? "sd3_transformer"
                                                          : "unet_2d_condition"));
  std::vector<at::Tensor> scores;
  const auto score = [&](const at::Tensor& images01, const std::string& prompt) {
    // [0, 1] -> [-1, 1]: ClipScorer turns them into the uint8 values diffusers' PIL images hold (round(255 x))
    const at::Tensor s = clip.scores(images01 * 2 - 1, std::vector<std::string>(size_t(images01.size(0)), prompt));
    std::cout << "| " << prompt << " | " << s.mean().item<double>() << " |\n";
    scores.push_back(s);
  };
  std::cout << "| prompt | CLIP score |\n|---|---|\n";
  if (qwen) {
    // as `dew sample --pipeline`: true_cfg_scale 1 unless asked, the folder's sample_sigmas unless --steps
    auto pipe = interop::QwenImagePipeline::load(dir);
    r.guidance = f.get_double("guidance", 1.0);
    const std::vector<double> sigmas = f.has("steps")
                                           ? interop::QwenImagePipeline::linspace_sigmas(f.get_int("steps", 40))
                                       : pipe.sample_sigmas().empty() ? interop::QwenImagePipeline::linspace_sigmas(40)
                                                                      : pipe.sample_sigmas();
    r.steps = int64_t(sigmas.size());
    for (size_t i = 0; i < prompts.size(); ++i) {
      r.prompt = prompts[i];
      r.seed = uint64_t(f.get_int("seed", 0)) + i;
      pipe.check(r);
      // RGBA images: CLIP reads the colour channels, as PIL's RGBA -> RGB conversion keeps them
      score(pipe.run(r, sigmas).images.narrow(1, 0, 3).cpu(), prompts[i]);
    }
  } else if (flow) {
    auto pipe = interop::FlowPipeline::load(dir);
    r.steps = f.get_int("steps", 28);
    r.guidance = f.get_double("guidance", pipe.flux() && !pipe.guidance_embeds() ? 0.0 : pipe.default_guidance());
    for (size_t i = 0; i < prompts.size(); ++i) {
      r.prompt = prompts[i];
      r.seed = uint64_t(f.get_int("seed", 0)) + i;
      pipe.check(r);
      score(pipe.run(r, pipe.default_max_sequence_length()).images.cpu(), prompts[i]);
    }
  } else {
    auto pipe = interop::TextToImagePipeline::load(dir);
    r.steps = f.get_int("steps", 30);
    r.guidance = f.get_double("guidance", pipe.sdxl() ? 5.0 : 7.5);
    for (size_t i = 0; i < prompts.size(); ++i) {
      r.prompt = prompts[i];
      r.seed = uint64_t(f.get_int("seed", 0)) + i;
      pipe.check(r);
      score(pipe.run(r).images.cpu(), prompts[i]);
    }
  }
  const double total = metrics::clip_score_from_scores(at::cat(scores));
  std::cout << "CLIP score (torchmetrics CLIPScore: max(mean, 0) over " << at::cat(scores).size(0)
            << " images): " << total << "\n";
  return 0;
}

}  // namespace dew::cli

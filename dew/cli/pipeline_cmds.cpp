// `dew sample --pipeline DIR`: flags in, dew::interop::TextToImagePipeline (SD, SDXL), FlowPipeline (SD3, Flux)
// or QwenImagePipeline (Qwen-Image 2.1), a PNG out.
#include <ATen/ATen.h>

#include <cmath>
#include <filesystem>
#include <iostream>

#include "dew/cli/commands.h"
#include "dew/cli/recipe.h"
#include "dew/core/threads.h"
#include "dew/interop/diffusers_pipeline.h"
#include "dew/interop/flow_pipeline.h"
#include "dew/io/image.h"
#include "dew/io/safetensors.h"
#include "dew/nn/blocks.h"

namespace fs = std::filesystem;

namespace dew::cli {

int cmd_sample_pipeline(const std::vector<std::string>& args_in) {
  std::vector<std::string> args = args_in;
  // --lora FILE[:SCALE], repeatable: checked before anything loads.
  std::vector<std::pair<std::string, double>> loras;
  for (const auto& v : take_repeated(args, "lora")) {
    std::string path = v;
    double scale = 1.0;
    const auto colon = v.rfind(':');
    if (colon != std::string::npos && !fs::is_regular_file(v)) {
      path = v.substr(0, colon);
      const std::string s = v.substr(colon + 1);
      size_t used = 0;
      try {
        scale = std::stod(s, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      DEW_CHECK(used == s.size() && !s.empty() && std::isfinite(scale),
                "--lora: expected FILE[:SCALE] with SCALE a number, got \"", v, "\"");
    }
    DEW_CHECK(fs::is_regular_file(path), "--lora: ", path, " is not a file (a diffusers or kohya LoRA .safetensors)");
    loras.emplace_back(path, scale);
  }
  auto f = parse_flags(args, {"pipeline",
                              "prompt",
                              "negative-prompt",
                              "prompt-2",
                              "negative-prompt-2",
                              "prompt-3",
                              "negative-prompt-3",
                              "steps",
                              "guidance",
                              "seed",
                              "size",
                              "count",
                              "scheduler",
                              "eta",
                              "latents",
                              "threads",
                              "out",
                              "nrow",
                              "max-sequence-length",
                              "weights-dtype"});
  DEW_CHECK(f.positional.empty(), "sample --pipeline: unexpected argument \"",
            f.positional.empty() ? "" : f.positional[0], "\" (the folder goes after --pipeline)");
  DEW_CHECK(f.has("prompt"), "sample --pipeline: --prompt TEXT is required");
  DEW_CHECK(f.has("out"), "sample --pipeline: --out FILE.png is required");
  const std::string out = f.get("out", "");
  const at::ScalarType weights_dtype = nn::parse_compute_dtype(f.get("weights-dtype", "float32"), "--weights-dtype");
  // Weights in a reduced dtype are built in it (no float32 copy of a component ever exists), except under --lora,
  // whose adapters merge into the float32 weights before they are held in it.
  const at::ScalarType build_dtype = loras.empty() ? weights_dtype : at::kFloat;
  auto hold_weights = [&](auto& pipe) {
    if (weights_dtype == at::kFloat) return;
    const int64_t bytes = pipe.hold_weights_in(weights_dtype);
    std::cout << "weights held in " << f.get("weights-dtype", "") << ": " << (bytes >> 20) << " MiB\n";
  };
  DEW_CHECK(fs::path(out).extension() == ".png", "--out: expected a .png file, got \"", out, "\"");

  interop::PipelineRequest r;
  r.prompt = f.get("prompt", "");
  r.negative_prompt = f.get("negative-prompt", "");
  if (f.has("prompt-2")) r.prompt_2 = f.get("prompt-2", "");
  if (f.has("negative-prompt-2")) r.negative_prompt_2 = f.get("negative-prompt-2", "");
  if (f.has("prompt-3")) r.prompt_3 = f.get("prompt-3", "");
  if (f.has("negative-prompt-3")) r.negative_prompt_3 = f.get("negative-prompt-3", "");
  r.steps = f.get_int("steps", 30);
  r.seed = uint64_t(f.get_int("seed", 0));
  r.count = f.get_int("count", 1);
  r.eta = f.get_double("eta", 0.0);
  if (f.has("size")) {
    const std::string s = f.get("size", "");
    const auto x = s.find('x');
    try {
      DEW_CHECK(x != std::string::npos, "");
      r.height = std::stoll(s.substr(0, x));
      r.width = std::stoll(s.substr(x + 1));
    } catch (const std::exception&) {
      fail("--size: expected HxW, e.g. 512x512, got \"", s, "\"");
    }
    DEW_CHECK(r.height > 0 && r.width > 0, "--size: expected positive HxW, got \"", s, "\"");
  }
  const int64_t nrow = f.get_int("nrow", 4);
  DEW_CHECK(nrow >= 1, "--nrow: must be >= 1, got ", nrow);
  auto read_latents = [&]() {
    const auto tensors = io::load_safetensors(f.get("latents", ""));
    const auto it = tensors.find("latents");
    DEW_CHECK(it != tensors.end(), "--latents: ", f.get("latents", ""), " holds no tensor named \"latents\"");
    return it->second;
  };
  auto write = [&](const at::Tensor& images, const std::string& what) {
    // diffusers' numpy_to_pil: round(x * 255) of the [0, 1] image.
    const at::Tensor bytes = (images * 255).round().clamp(0, 255).to(at::kByte);
    if (fs::path(out).has_parent_path()) fs::create_directories(fs::path(out).parent_path());
    io::save_png(out, r.count == 1 ? bytes[0] : io::make_grid(bytes, nrow));
    std::cout << "wrote " << r.count << (r.count == 1 ? " image" : " images") << " (" << what << ", " << r.steps
              << " steps, guidance " << r.guidance << ", " << images.size(2) << "x" << images.size(3) << ", seed "
              << r.seed << ") to " << out << "\n";
  };

  const std::string dir = f.get("pipeline", "");
  if (interop::is_qwen_image_pipeline_folder(dir)) {  // QwenImage21Pipeline
    set_threads(f.get_int("threads", 0), workload_of("qwen_image_transformer"));
    DEW_CHECK(!f.has("scheduler"), "--scheduler: Qwen-Image folders run their FlowMatchEulerDiscreteScheduler");
    DEW_CHECK(r.eta == 0.0, "--eta: only DDIMScheduler takes eta");
    DEW_CHECK(!f.has("max-sequence-length"), "--max-sequence-length: only SD3 and Flux folders take it (T5)");
    // true_cfg_scale: 1 (no guidance) unless asked; the negative prompt serves guidance only
    r.guidance = f.get_double("guidance", 1.0);
    DEW_CHECK(!f.has("negative-prompt") || r.guidance > 1.0, "--negative-prompt: used only with --guidance above 1 ",
              "(true classifier-free guidance), got guidance ", r.guidance);
    auto pipe = interop::QwenImagePipeline::load(dir, build_dtype);
    for (const auto& [path, scale] : loras)
      std::cout << "LoRA " << path << " (scale " << scale << "): " << pipe.add_lora(path, scale)
                << " transformer layers adapted\n";
    hold_weights(pipe);
    // the folder's sample_sigmas unless --steps asks for the linspace grid; 40 steps without either (diffusers')
    std::vector<double> sigmas;
    if (f.has("steps")) sigmas = interop::QwenImagePipeline::linspace_sigmas(r.steps);
    else sigmas = pipe.sample_sigmas().empty() ? interop::QwenImagePipeline::linspace_sigmas(40) : pipe.sample_sigmas();
    r.steps = int64_t(sigmas.size());
    if (f.has("latents")) r.latents = read_latents();
    pipe.check(r);  // before the text encoder and the transformer run
    const auto res = pipe.run(r, sigmas);
    write(res.images, "QwenImage21Pipeline, FlowMatchEulerDiscreteScheduler");
    return 0;
  }
  if (interop::is_flow_pipeline_folder(dir)) {  // StableDiffusion3Pipeline, FluxPipeline
    set_threads(f.get_int("threads", 0), workload_of("sd3_transformer"));
    DEW_CHECK(!f.has("scheduler"), "--scheduler: SD3 and Flux folders run their FlowMatchEulerDiscreteScheduler");
    DEW_CHECK(r.eta == 0.0, "--eta: only DDIMScheduler takes eta");
    auto pipe = interop::FlowPipeline::load(dir, build_dtype);
    for (const auto& [path, scale] : loras)
      std::cout << "LoRA " << path << " (scale " << scale << "): " << pipe.add_lora(path, scale)
                << " transformer layers adapted\n";
    hold_weights(pipe);
    if (!f.has("steps")) r.steps = 28;
    // FLUX.1 schnell has no guidance embedding: guidance 0 (unused), as its model card runs it
    r.guidance = f.get_double("guidance", pipe.flux() && !pipe.guidance_embeds() ? 0.0 : pipe.default_guidance());
    DEW_CHECK(!pipe.flux() || pipe.guidance_embeds() || !f.has("guidance"), "--guidance: ", dir,
              "/transformer has no guidance embedding (FLUX.1 schnell takes no guidance)");
    DEW_CHECK(!pipe.flux() || !f.has("negative-prompt"), "--negative-prompt: FluxPipeline uses no negative prompt");
    const int64_t max_seq = f.get_int("max-sequence-length", pipe.default_max_sequence_length());
    DEW_CHECK(max_seq >= 1, "--max-sequence-length: must be >= 1, got ", max_seq);
    if (f.has("latents")) r.latents = read_latents();
    pipe.check(r);  // before the text encoders and the transformer run
    const auto res = pipe.run(r, max_seq);
    write(res.images, pipe.class_name() + ", FlowMatchEulerDiscreteScheduler");
    return 0;
  }
  DEW_CHECK(!f.has("max-sequence-length"), "--max-sequence-length: only SD3 and Flux folders take it (T5)");
  for (const char* flag : {"prompt-3", "negative-prompt-3"})
    DEW_CHECK(!f.has(flag), "--", flag, ": only SD3 folders take it (their T5 encoder); ", dir, " is a ",
              "UNet pipeline (SD, SDXL)");
  set_threads(f.get_int("threads", 0), workload_of("unet_2d_condition"));
  auto pipe = interop::TextToImagePipeline::load(dir, build_dtype);
  for (const auto& [path, scale] : loras)
    std::cout << "LoRA " << path << " (scale " << scale << "): " << pipe.add_lora(path, scale)
              << " UNet layers adapted\n";
  hold_weights(pipe);
  r.guidance = f.get_double("guidance", pipe.sdxl() ? 5.0 : 7.5);
  if (f.has("scheduler")) {
    json cfg = pipe.scheduler_config();
    cfg["_class_name"] = f.get("scheduler", "");
    pipe.set_scheduler(sampling::Scheduler::from_config(cfg, "--scheduler"));
  }
  if (f.has("latents")) r.latents = read_latents();
  pipe.check(r);  // before the text encoders and the UNet run
  const auto res = pipe.run(r);
  write(res.images, pipe.class_name() + ", " + pipe.scheduler().class_name());
  return 0;
}

}  // namespace dew::cli

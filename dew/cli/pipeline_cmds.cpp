// `dew sample --pipeline DIR`: flags in, dew::interop::TextToImagePipeline, a PNG out.
#include <ATen/ATen.h>

#include <filesystem>
#include <iostream>

#include "dew/cli/commands.h"
#include "dew/cli/recipe.h"
#include "dew/core/threads.h"
#include "dew/interop/diffusers_pipeline.h"
#include "dew/io/image.h"
#include "dew/io/safetensors.h"

namespace fs = std::filesystem;

namespace dew::cli {

int cmd_sample_pipeline(const std::vector<std::string>& args) {
  auto f =
      parse_flags(args, {"pipeline", "prompt", "negative-prompt", "prompt-2", "negative-prompt-2", "steps", "guidance",
                         "seed", "size", "count", "scheduler", "eta", "latents", "threads", "out", "nrow"});
  DEW_CHECK(f.positional.empty(), "sample --pipeline: unexpected argument \"",
            f.positional.empty() ? "" : f.positional[0], "\" (the folder goes after --pipeline)");
  DEW_CHECK(f.has("prompt"), "sample --pipeline: --prompt TEXT is required");
  DEW_CHECK(f.has("out"), "sample --pipeline: --out FILE.png is required");
  const std::string out = f.get("out", "");
  DEW_CHECK(fs::path(out).extension() == ".png", "--out: expected a .png file, got \"", out, "\"");

  interop::PipelineRequest r;
  r.prompt = f.get("prompt", "");
  r.negative_prompt = f.get("negative-prompt", "");
  if (f.has("prompt-2")) r.prompt_2 = f.get("prompt-2", "");
  if (f.has("negative-prompt-2")) r.negative_prompt_2 = f.get("negative-prompt-2", "");
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
  set_threads(f.get_int("threads", 0), workload_of("unet_2d_condition"));

  auto pipe = interop::TextToImagePipeline::load(f.get("pipeline", ""));
  r.guidance = f.get_double("guidance", pipe.sdxl() ? 5.0 : 7.5);
  if (f.has("scheduler")) {
    json cfg = pipe.scheduler_config();
    cfg["_class_name"] = f.get("scheduler", "");
    pipe.set_scheduler(sampling::Scheduler::from_config(cfg, "--scheduler"));
  }
  if (f.has("latents")) {
    const auto tensors = io::load_safetensors(f.get("latents", ""));
    const auto it = tensors.find("latents");
    DEW_CHECK(it != tensors.end(), "--latents: ", f.get("latents", ""), " holds no tensor named \"latents\"");
    r.latents = it->second;
  }
  pipe.check(r);  // before the text encoders and the UNet run

  const auto res = pipe.run(r);
  // diffusers' numpy_to_pil: round(x * 255) of the [0, 1] image.
  const at::Tensor bytes = (res.images * 255).round().clamp(0, 255).to(at::kByte);
  if (fs::path(out).has_parent_path()) fs::create_directories(fs::path(out).parent_path());
  io::save_png(out, r.count == 1 ? bytes[0] : io::make_grid(bytes, nrow));
  std::cout << "wrote " << r.count << (r.count == 1 ? " image" : " images") << " (" << pipe.class_name() << ", "
            << pipe.scheduler().class_name() << ", " << r.steps << " steps, guidance " << r.guidance << ", "
            << res.images.size(2) << "x" << res.images.size(3) << ", seed " << r.seed << ") to " << out << "\n";
  return 0;
}

}  // namespace dew::cli

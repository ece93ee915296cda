#include "dew/metrics/clip_score.h"

#include <ATen/ops/_upsample_bicubic2d_aa.h>

#include <algorithm>
#include <filesystem>

#include "dew/core/device.h"
#include "dew/core/error.h"
#include "dew/io/files.h"
#include "dew/io/stops.h"
#include "dew/io/weights.h"

namespace fs = std::filesystem;

namespace dew::metrics {

using at::Tensor;

namespace {
json clip_score_read_json(const fs::path& path) {
  const std::string text = io::read_file(path.string(), "CLIP folder file");
  io::check_json_depth(text, "CLIP folder: " + path.string());
  try {
    return json::parse(text);
  } catch (const std::exception& e) {
    fail("CLIP folder: ", path.string(), " is not valid JSON: ", e.what());
  }
}
}  // namespace

ClipImageProcessing read_clip_image_processing(const std::string& folder) {
  const fs::path dir(folder), pre = dir / "preprocessor_config.json", proc = dir / "processor_config.json";
  json c;
  fs::path file;
  if (fs::exists(pre)) {
    file = pre;
    c = clip_score_read_json(pre);
  } else if (fs::exists(proc)) {
    file = proc;
    c = clip_score_read_json(proc);
    DEW_CHECK(c.contains("image_processor") && c["image_processor"].is_object(), "CLIP folder: ", proc.string(),
              " has no \"image_processor\" object (CLIP score needs CLIPImageProcessor's settings)");
    c = c["image_processor"];
  } else {
    fail("CLIP folder \"", folder,
         "\": no preprocessor_config.json or processor_config.json (CLIPImageProcessor's settings, written by "
         "CLIPProcessor.save_pretrained)");
  }
  const std::string where = file.string();
  const std::string type = c.value("image_processor_type", std::string("CLIPImageProcessor"));
  DEW_CHECK(type == "CLIPImageProcessor" || type == "CLIPImageProcessorFast", where, ": image_processor_type \"", type,
            "\" is not supported (accepted: CLIPImageProcessor)");
  DEW_CHECK(c.value("resample", int64_t(3)) == 3, where, ": resample ", c.value("resample", int64_t(3)),
            " is not supported (accepted: 3, bicubic)");
  ClipImageProcessing p;
  if (c.contains("size")) {
    const json& s = c["size"];
    DEW_CHECK(s.is_object() && s.contains("shortest_edge"), where, ": size ", s.dump(),
              " is not supported (accepted: {\"shortest_edge\": N})");
    p.shortest_edge = s["shortest_edge"].get<int64_t>();
  }
  if (c.contains("crop_size")) {
    const json& s = c["crop_size"];
    DEW_CHECK(s.is_object() && s.contains("height") && s.contains("width"), where, ": crop_size ", s.dump(),
              " is not supported (accepted: {\"height\": H, \"width\": W})");
    p.crop_height = s["height"].get<int64_t>();
    p.crop_width = s["width"].get<int64_t>();
  }
  p.do_resize = c.value("do_resize", true);
  p.do_center_crop = c.value("do_center_crop", true);
  p.do_rescale = c.value("do_rescale", true);
  p.do_normalize = c.value("do_normalize", true);
  p.rescale_factor = c.value("rescale_factor", 1.0 / 255.0);
  if (c.contains("image_mean")) p.image_mean = c["image_mean"].get<std::vector<double>>();
  if (c.contains("image_std")) p.image_std = c["image_std"].get<std::vector<double>>();
  DEW_CHECK(p.image_mean.size() == 3 && p.image_std.size() == 3, where, ": image_mean and image_std need 3 values");
  DEW_CHECK(p.shortest_edge > 0 && p.crop_height > 0 && p.crop_width > 0, where, ": sizes must be > 0");
  return p;
}

Tensor clip_preprocess(const Tensor& images_in, const ClipImageProcessing& p) {
  DEW_CHECK(images_in.defined() && images_in.dim() == 4, "CLIP score: images must be [N, C, H, W], got ",
            images_in.defined() ? images_in.sizes() : at::IntArrayRef{});
  DEW_CHECK(images_in.size(1) == 3 || images_in.size(1) == 1,
            "CLIP score: images must have 3 channels (RGB) or 1 (grayscale, repeated), got ", images_in.size(1));
  Tensor x = images_in.to(at::kCPU);
  if (x.is_floating_point()) {
    // Generated images in [-1, 1] become the uint8 values a PNG of them holds, the input torchmetrics users pass.
    x = ((x.to(at::kDouble) + 1.0) * 127.5).round().clamp(0, 255).to(at::kByte);
  } else {
    DEW_CHECK(x.scalar_type() == at::kByte, "CLIP score: images must be uint8 in [0, 255] or floating in [-1, 1], got ",
              x.scalar_type());
  }
  if (x.size(1) == 1) x = x.expand({x.size(0), 3, x.size(2), x.size(3)});
  x = x.contiguous();
  const int64_t h = x.size(2), w = x.size(3);
  if (p.do_resize) {
    // transformers' get_resize_output_image_size(default_to_square=False): the short side to shortest_edge,
    // the long one to int(shortest_edge * long / short).
    const bool w_short = w <= h;
    const int64_t short_side = w_short ? w : h, long_side = w_short ? h : w;
    const int64_t new_long = static_cast<int64_t>(static_cast<double>(p.shortest_edge) * long_side / short_side);
    const int64_t nh = w_short ? new_long : p.shortest_edge, nw = w_short ? p.shortest_edge : new_long;
    // torchvision's resize on CPU uint8 with bicubic + antialias calls this kernel natively on uint8 (its
    // output is rounded and saturated in the kernel); an unchanged size is returned as is.
    if (nh != h || nw != w)
      x = at::_upsample_bicubic2d_aa(x, {nh, nw}, false, std::optional<double>(), std::optional<double>());
  }
  if (p.do_center_crop) {
    const int64_t ih = x.size(2), iw = x.size(3);
    DEW_CHECK(p.crop_height <= ih && p.crop_width <= iw, "CLIP score: images of ", h, " x ", w, " are ", ih, " x ", iw,
              " after the resize, smaller than crop_size ", p.crop_height, " x ", p.crop_width,
              "; accepted: a preprocessor_config.json whose crop_size fits the resized image (transformers would pad "
              "with zeros there; dew refuses instead)");
    const int64_t top = static_cast<int64_t>((ih - p.crop_height) / 2.0);
    const int64_t left = static_cast<int64_t>((iw - p.crop_width) / 2.0);
    x = x.narrow(2, top, p.crop_height).narrow(3, left, p.crop_width);
  }
  Tensor f = x.to(at::kFloat);
  if (p.do_rescale && p.do_normalize) {
    // transformers fuses the two: mean and std (float32) times 1 / rescale_factor, then one normalize.
    const Tensor mean = at::tensor(p.image_mean, at::kFloat) * (1.0 / p.rescale_factor);
    const Tensor std = at::tensor(p.image_std, at::kFloat) * (1.0 / p.rescale_factor);
    f = (f - mean.view({1, 3, 1, 1})) / std.view({1, 3, 1, 1});
  } else if (p.do_normalize) {
    f = (f - at::tensor(p.image_mean, at::kFloat).view({1, 3, 1, 1})) /
        at::tensor(p.image_std, at::kFloat).view({1, 3, 1, 1});
  } else if (p.do_rescale) {
    f = f * p.rescale_factor;
  }
  return f.contiguous();
}

ClipScorer::ClipScorer(const std::string& folder, const std::string& device) : device_(parse_device(device)) {
  const fs::path dir(folder);
  DEW_CHECK(fs::is_directory(dir), "--clip: \"", folder, "\" is not a folder (a transformers CLIPModel folder)");
  io::check_folder_links(folder, "--clip");
  const json config = clip_score_read_json(dir / "config.json");
  const std::string where = (dir / "config.json").string();
  DEW_CHECK(config.contains("vision_config") && config["vision_config"].is_object(), where,
            ": no \"vision_config\": CLIP score needs a whole CLIPModel (vision tower + visual_projection), not a "
            "text tower");
  DEW_CHECK(config.contains("text_config") && config["text_config"].is_object(), where,
            ": no \"text_config\": CLIP score needs a whole CLIPModel (text tower + text_projection)");
  const int64_t projection = config.value("projection_dim", int64_t(512));
  DEW_CHECK(projection > 0, where, ": projection_dim must be > 0, got ", projection);
  const fs::path weights = dir / "model.safetensors";
  DEW_CHECK(fs::exists(weights), "CLIP folder \"", folder, "\": no model.safetensors");
  const auto source = io::WeightSource::open(weights.string());
  const auto names = source.names();
  const auto has = [&](const std::string& n) { return std::find(names.begin(), names.end(), n) != names.end(); };
  DEW_CHECK(has("visual_projection.weight"), weights.string(),
            ": no visual_projection.weight (CLIP score needs the projected image embeddings of a CLIPModel)");
  DEW_CHECK(has("text_projection.weight"), weights.string(),
            ": no text_projection.weight (CLIP score needs the projected text embeddings of a CLIPModel)");
  DEW_CHECK(has("vision_model.embeddings.class_embedding"), weights.string(),
            ": no vision_model.* tensors (CLIP score needs the vision tower)");

  processing = read_clip_image_processing(folder);
  nn::ClipTextOptions to = nn::clip_text_options_from_hf(config);
  to.projection_dim(projection).tokenizer(folder);
  text = nn::ClipText(to);
  io::KeyMap text_map;
  text_map.skip(R"((vision_model\..*|visual_projection\..*|logit_scale|text_model\.embeddings\.position_ids))");
  io::LoadOptions lo;
  lo.require_buffers = false;
  io::load_weights(*text, source, text_map, lo);

  vision = nn::ClipVision(nn::clip_vision_options_from_hf(config));
  io::load_weights(*vision, source, nn::clip_vision_key_map(true), lo);
  text->to(device_);
  vision->to(device_);
  text->eval();
  vision->eval();
}

// Images and texts go through the towers this many at a time (a ViT-L/14 batch of 64 at 224 x 224 holds about
// 2 GB of activations).
constexpr int64_t kClipScoreBatch = 64;

Tensor ClipScorer::image_embeds(const Tensor& images) {
  torch::NoGradGuard no_grad;
  const Tensor pixels = clip_preprocess(images, processing);  // checks the shape and channels first
  std::vector<Tensor> out;
  for (int64_t b = 0; b < pixels.size(0); b += kClipScoreBatch) {
    io::check_stop();  // `dew eval` stopped by a signal
    out.push_back(
        vision->forward(pixels.slice(0, b, b + kClipScoreBatch).to(device_)).image_embeds.to(at::kCPU, at::kFloat));
  }
  return at::cat(out);
}

Tensor ClipScorer::text_embeds(const std::vector<std::string>& texts) {
  torch::NoGradGuard no_grad;
  auto [ids, mask] = text->tokenize(texts);
  std::vector<Tensor> out;
  for (int64_t b = 0; b < ids.size(0); b += kClipScoreBatch) {
    const Tensor i = ids.slice(0, b, b + kClipScoreBatch).to(device_),
                 m = mask.slice(0, b, b + kClipScoreBatch).to(device_);
    out.push_back(text->forward_outputs(i, m).text_embeds.to(at::kCPU, at::kFloat));
  }
  return at::cat(out);
}

Tensor ClipScorer::scores(const Tensor& images, const std::vector<std::string>& texts) {
  DEW_CHECK(images.defined() && images.dim() == 4 && images.size(0) == static_cast<int64_t>(texts.size()),
            "CLIP score: ", images.defined() ? images.size(0) : 0, " images but ", texts.size(),
            " texts (one text per image)");
  const Tensor i = image_embeds(images), t = text_embeds(texts);
  // torchmetrics: each embedding divided by its L2 norm, 100 x the dot product.
  const Tensor in = i / i.norm(2, -1, true), tn = t / t.norm(2, -1, true);
  return (100.0 * (in * tn).sum(-1)).to(at::kDouble);
}

double ClipScorer::score(const Tensor& images, const std::vector<std::string>& texts) {
  return clip_score_from_scores(scores(images, texts));
}

double clip_score_from_scores(const Tensor& scores) {
  DEW_CHECK(scores.defined() && scores.numel() > 0, "CLIP score: no image-text pairs to score");
  return std::max(scores.to(at::kDouble).mean().item<double>(), 0.0);
}

}  // namespace dew::metrics

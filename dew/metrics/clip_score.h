// CLIP score as torchmetrics 1.9.0 computes it (torchmetrics.multimodal.CLIPScore): per pair
// 100 cos(image_embeds, text_embeds) of a transformers CLIPModel, the score max(mean over pairs, 0). The images go
// through CLIPImageProcessor as transformers 5 applies it to the tensors torchmetrics hands over (the torchvision
// backend): resize the shortest side to size.shortest_edge (bicubic, antialias, on uint8 values: LibTorch's and
// torchvision's kernel), center crop crop_size, (x - 255 mean) / (255 std). docs/evaluation.md#clip-score-and-lpips.
//
//   dew::metrics::ClipScorer clip("clip-vit-large-patch14");     // a CLIPModel folder
//   double s = clip.score(images_uint8, {"a cat", "a dog"});      // images [N, 3, H, W] uint8 (or [-1, 1] float)
#pragma once
#include <ATen/ATen.h>

#include <memory>
#include <string>
#include <vector>

#include "dew/data/clip_tokenizer.h"
#include "dew/nn/clip_text.h"
#include "dew/nn/clip_vision.h"

namespace dew::metrics {

/// CLIPImageProcessor's settings (preprocessor_config.json, or processor_config.json's "image_processor").
struct ClipImageProcessing {
  int64_t shortest_edge = 224;                  // size.shortest_edge
  int64_t crop_height = 224, crop_width = 224;  // crop_size
  bool do_resize = true, do_center_crop = true, do_rescale = true, do_normalize = true;
  double rescale_factor = 1.0 / 255.0;
  std::vector<double> image_mean{0.48145466, 0.4578275, 0.40821073};  // OPENAI_CLIP_MEAN
  std::vector<double> image_std{0.26862954, 0.26130258, 0.27577711};  // OPENAI_CLIP_STD
};
/// The folder's image processor settings; only CLIPImageProcessor with bicubic resampling (resample 3) is
/// accepted, other values are refused by name.
ClipImageProcessing read_clip_image_processing(const std::string& folder);

/// images: [N, 3, H, W] (or [N, 1, H, W], repeated to 3 channels) uint8 in [0, 255], or floating in [-1, 1]
/// (turned into uint8 as a PNG writer would: round((x + 1) 127.5) clamped) -> pixel_values [N, 3, crop_h, crop_w]
/// float32. Images of one size are resized together (all images of a batch share H, W).
at::Tensor clip_preprocess(const at::Tensor& images, const ClipImageProcessing& p);

/// A CLIPModel folder (config.json with text_config and vision_config, model.safetensors, the tokenizer
/// (tokenizer.json or vocab.json + merges.txt) and preprocessor_config.json / processor_config.json), loaded in
/// eval mode. A folder without a vision tower or without the projections is refused naming the missing part.
class ClipScorer {
 public:
  explicit ClipScorer(const std::string& folder, const std::string& device = "cpu");
  /// Projected image embeddings [N, projection_dim] (float32) of images as clip_preprocess takes them.
  at::Tensor image_embeds(const at::Tensor& images);
  /// Projected text embeddings [N, projection_dim] (float32).
  at::Tensor text_embeds(const std::vector<std::string>& texts);
  /// Per pair 100 cos(image, text) [N] (float64). images.size(0) == texts.size().
  at::Tensor scores(const at::Tensor& images, const std::vector<std::string>& texts);
  /// torchmetrics' CLIPScore: max(mean of scores(), 0).
  double score(const at::Tensor& images, const std::vector<std::string>& texts);

  nn::ClipText text{nullptr};
  nn::ClipVision vision{nullptr};
  ClipImageProcessing processing;

 private:
  at::Device device_;
};

/// torchmetrics' reduction of per-pair scores: max(mean, 0).
double clip_score_from_scores(const at::Tensor& scores);

}  // namespace dew::metrics

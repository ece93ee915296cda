// Hugging Face interop of decoder language models (docs/lm.md): write a CausalTransformer as a
// transformers checkpoint folder of the llama, qwen3 or gemma3_text family, and read such folders back.
//
//   dew::interop::save_pretrained_decoder(lm, "out/hf", tokenizer.get(), "llama");
//       // out/hf: config.json, generation_config.json, model.safetensors, tokenizer files
//   dew::nn::CausalTransformer back = dew::interop::load_pretrained_decoder("out/hf");
//   dew::interop::save_hf_layout(params, config, "out/raw");   // dew names and config, untranslated
//
// Weight names are the model's own (HF decoder names) under "model."; the untied head is "lm_head.weight".
// A model feature the family cannot express is refused with a dew::Error naming it (see docs/interop.md):
//   llama        swiglu, no qk_norm, no sandwich norms, scale_offset 0, embedding_scale 1, no softcap,
//                all layers full attention, partial_rotary_factor 1
//   qwen3        as llama but qk_norm required
//   gemma3_text  qk_norm, sandwich norms, scale_offset 1 and embedding_scale sqrt(D) required; swiglu or
//                geglu; sliding layers with their own rope theta; final logit softcap
#pragma once
#include <ATen/core/Tensor.h>

#include <map>
#include <string>

#include "dew/core/options.h"
#include "dew/nn/backbones/causal_transformer.h"

namespace dew {
namespace data {
class Tokenizer;
}
namespace interop {

/// The families save_pretrained_decoder writes and load_pretrained_decoder reads.
inline const std::vector<std::string>& decoder_families() {
  static const std::vector<std::string> f = {"llama", "qwen3", "gemma3_text"};
  return f;
}

/// The family whose features match the options: gemma3_text when scale_offset is 1 or sandwich norms
/// are on, qwen3 when qk_norm is on, else llama. (save_pretrained_decoder still checks every feature.)
std::string infer_family(const nn::CausalTransformerOptions& options);

/// Throws dew::Error naming the first feature of `options` that `family` cannot express (and the family).
void check_family(const nn::CausalTransformerOptions& options, const std::string& family);

/// The HF config.json of `options` for `family` (checked with check_family). bos/eos/pad ids: -1 = absent.
json hf_config(const nn::CausalTransformerOptions& options, const std::string& family, int64_t bos_id = -1,
               int64_t eos_id = -1, int64_t pad_id = -1);

/// Writes dir/model.safetensors (the tensors as given, names unchanged) and dir/config.json (`config`
/// as given), creating dir.
void save_hf_layout(const std::map<std::string, at::Tensor>& params, const json& config, const std::string& dir);

/// Writes a transformers checkpoint of `model` in `family` ("auto": infer_family) into dir (created):
/// config.json, generation_config.json, model.safetensors (float32, "model." prefixed names) and, when
/// `tokenizer` is given, its files (Tokenizer::save). The tokenizer's vocabulary must fit the model's.
void save_pretrained_decoder(nn::CausalTransformer& model, const std::string& dir,
                             const data::Tokenizer* tokenizer = nullptr, const std::string& family = "auto");

/// Sets "chat_template" in dir/tokenizer_config.json (created when missing) to `jinja`, as transformers reads it.
void add_chat_template(const std::string& dir, const std::string& jinja);

/// Reads a checkpoint folder written by save_pretrained_decoder or transformers (llama, qwen3,
/// gemma3_text; model.safetensors or sharded with model.safetensors.index.json; bf16/fp16 widened to
/// float32), or one written by save_hf_layout from a causal_transformer record
/// ({"architecture": "causal_transformer", "fields": {...}}). Missing, unexpected or mis-shaped tensors
/// are a dew::Error naming them. The model is returned in eval mode on the CPU.
/// Qwen3-VL folders (Qwen3VLForConditionalGeneration, Qwen-Image 2.1's text encoder) give their language model:
/// text_config, model.language_model.* (the vision tower is not read). `weights_dtype` bfloat16 / float16: built
/// with its matrix weights in that dtype (nn::build_weights_in), then loaded; for inference.
nn::CausalTransformer load_pretrained_decoder(const std::string& dir, at::ScalarType weights_dtype = at::kFloat);

/// Qwen-Image 2.1's text path for text prompts, as diffusers' get_qwenimage21_prompt_embeds computes it: each
/// prompt (an empty one becomes " ") in the pipeline's template (its fixed system message, the prompt as the
/// user's turn, the assistant's turn opened), through Qwen3-VL's language model; the last decoder layer's states
/// before the final norm, the system message's tokens dropped, right-padded with zeros.
///
///   dew::interop::QwenImageTextEncoder te("folder/text_encoder", "folder/tokenizer");
///   auto s = te.encode({"a cat", "a red fox"});   // s.states [2, L, D] float32, s.mask [2, L] int64 (1 = real)
class QwenImageTextEncoder {
 public:
  /// text_encoder: a Qwen3VLForConditionalGeneration folder; tokenizer: a folder (or file) with tokenizer.json
  /// holding Qwen's <|im_start|> / <|im_end|> tokens. weights_dtype: as load_pretrained_decoder's.
  QwenImageTextEncoder(const std::string& text_encoder, const std::string& tokenizer,
                       at::ScalarType weights_dtype = at::kFloat);
  struct States {
    at::Tensor states;  // [B, L, D] float32, zeros past each prompt's tokens
    at::Tensor mask;    // [B, L] int64, 1 = a real token
  };
  /// A prompt longer than the model's max_position_embeddings, or one check_prompt refuses, is a dew::Error.
  States encode(const std::vector<std::string>& prompts);
  /// A prompt with the vision tokens (<|vision_start|>, <|image_pad|>, <|vision_end|>, <|video_pad|>: an edit
  /// prompt's image slots) is a dew::Error naming it and its index.
  static void check_prompt(const std::string& prompt, size_t index = 0);
  /// The system message's tokens, dropped from every prompt's states.
  int64_t system_tokens() const { return drop_; }
  /// The pipeline's template with `prompt` in the user's turn.
  static std::string render(const std::string& prompt);
  /// The language model (its options: the states' width; nn::hold_weights_in).
  nn::CausalTransformer& model() { return model_; }

 private:
  nn::CausalTransformer model_{nullptr};
  std::shared_ptr<const data::Tokenizer> tok_;
  int64_t drop_ = 0;
};

}  // namespace interop
}  // namespace dew

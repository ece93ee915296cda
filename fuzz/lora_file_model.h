// The lora_file fuzz target's tiny model and input format (fuzz/lora_file_fuzz.cpp), shared with
// tests/reliability/test_fuzz_regressions.cpp, which replays fuzz/regressions/lora_file/ on the same model: the
// regression inputs name its modules.
#pragma once
#include <torch/nn/module.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>

#include "fuzz/fuzz_util.h"

namespace dew_fuzz::lora {

using ModulePtr = std::shared_ptr<torch::nn::Module>;

// Registers `leaf` at the dotted `path` under `root`, creating plain modules for the missing parents.
inline void add(torch::nn::Module& root, const std::string& path, ModulePtr leaf) {
  torch::nn::Module* m = &root;
  size_t start = 0;
  for (size_t dot; (dot = path.find('.', start)) != std::string::npos; start = dot + 1) {
    const std::string part = path.substr(start, dot - start);
    const auto children = m->named_children();
    const ModulePtr* child = children.find(part);
    m = child ? child->get() : m->register_module(part, std::make_shared<torch::nn::Module>()).get();
  }
  m->register_module(path.substr(start), std::move(leaf));
}

inline ModulePtr linear(int64_t in, int64_t out, bool bias = true) {
  return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(bias)).ptr();
}
inline ModulePtr conv(int64_t in, int64_t out, int64_t k, int64_t stride = 1, int64_t groups = 1,
                      int64_t dilation = 1) {
  return torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, k)
                               .stride(stride)
                               .padding(k / 2 * dilation)
                               .groups(groups)
                               .dilation(dilation))
      .ptr();
}

// The tiny model (44 Linear and Conv2d layers, 2,096 parameters), with the module names of the families whose files
// dew reads.
inline ModulePtr tiny_model() {
  auto root = std::make_shared<torch::nn::Module>();
  auto& r = *root;
  const std::string tb = "down_blocks.0.attentions.0.transformer_blocks.0.";
  // A diffusers UNet (one resnet per down block, so kohya's SGM names map: input_blocks_1_0 = down_blocks.0.resnets.0).
  add(r, "conv_in", conv(2, 4, 3));
  add(r, "time_embedding.linear_1", linear(4, 8));
  add(r, "down_blocks.0.resnets.0.conv1", conv(4, 4, 3));
  add(r, "down_blocks.0.resnets.0.time_emb_proj", linear(8, 4));
  add(r, "down_blocks.0.resnets.0.conv_depthwise", conv(4, 4, 3, 1, /*groups=*/4));  // refused as a target
  add(r, "down_blocks.0.attentions.0.norm", torch::nn::GroupNorm(2, 4).ptr());       // not a Linear / Conv2d
  add(r, "down_blocks.0.attentions.0.proj_in", conv(4, 4, 1));
  for (const char* p : {"attn1.to_q", "attn1.to_k", "attn1.to_v"}) add(r, tb + p, linear(4, 4, false));
  add(r, tb + "attn1.to_out.0", linear(4, 4));
  add(r, tb + "attn2.to_k", linear(6, 4, false));  // cross-attention from a 6-wide context
  add(r, tb + "ff.net.0.proj", linear(4, 8));
  add(r, tb + "ff.net.2", linear(4, 4));
  add(r, "down_blocks.0.downsamplers.0.conv", conv(4, 4, 3, /*stride=*/2));
  add(r, "mid_block.resnets.0.conv1", conv(4, 4, 3, 1, 1, /*dilation=*/2));  // refused as a target
  add(r, "mid_block.attentions.0.transformer_blocks.0.attn1.to_q", linear(4, 4, false));
  add(r, "up_blocks.0.resnets.0.conv1", conv(8, 4, 3));
  add(r, "up_blocks.0.attentions.0.transformer_blocks.0.attn1.to_v", linear(4, 4, false));
  add(r, "up_blocks.0.upsamplers.0.conv", conv(4, 4, 3));
  add(r, "conv_out", conv(4, 2, 3));
  // A FLUX transformer (kohya's FLUX.1 names: double_blocks_0_img_attn_qkv, single_blocks_0_linear1, ...).
  add(r, "x_embedder", linear(2, 4));
  for (const char* p : {"to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj"})
    add(r, std::string("transformer_blocks.0.attn.") + p, linear(4, 4));
  add(r, "transformer_blocks.0.norm1.linear", linear(4, 24));
  for (const char* p : {"attn.to_q", "attn.to_k", "attn.to_v"})
    add(r, std::string("single_transformer_blocks.0.") + p, linear(4, 4));
  add(r, "single_transformer_blocks.0.proj_mlp", linear(4, 8));
  add(r, "single_transformer_blocks.0.proj_out", linear(12, 4));
  add(r, "single_transformer_blocks.0.norm.linear", linear(4, 12));
  add(r, "norm_out.linear", linear(4, 8));
  add(r, "proj_out", linear(4, 2));
  // A causal LM (PEFT's usual targets) and a CLIP text encoder (its wrapper text_model).
  add(r, "model.embed_tokens", torch::nn::Embedding(8, 4).ptr());
  for (const char* p : {"q_proj", "k_proj", "v_proj", "o_proj"})
    add(r, std::string("model.layers.0.self_attn.") + p, linear(4, 4, false));
  add(r, "model.layers.0.mlp.down_proj", linear(8, 4, false));
  add(r, "lm_head", linear(4, 8, false));
  add(r, "text_model.encoder.layers.0.self_attn.q_proj", linear(4, 4));
  add(r, "text_model.encoder.layers.0.mlp.fc1", linear(4, 8));
  return root;
}

// The safetensors file of the input's second part: as it is, or, when it starts with '{', the header JSON before its
// first NUL byte and the data after it, with the 8-byte little-endian header length put in front.
inline std::string safetensors_file(std::string_view part) {
  if (part.empty() || part.front() != '{') return std::string(part);
  const auto [header, data] = dew_fuzz::split_at_nul(reinterpret_cast<const uint8_t*>(part.data()), part.size());
  std::string out(8, '\0');
  for (size_t i = 0; i < 8; ++i) out[i] = static_cast<char>(static_cast<uint64_t>(header.size()) >> (8 * i));
  out += header;
  out += data;
  return out;
}

}  // namespace dew_fuzz::lora

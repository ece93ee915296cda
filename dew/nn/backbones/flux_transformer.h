// FluxTransformer (docs/backbones/flux_transformer.md): diffusers' FluxTransformer2DModel, the denoiser of
// FLUX.1 dev (guidance embedding) and schnell (none), with its module tree and parameter names, so a diffusers
// checkpoint loads with an identity key map; also built from a diffusers config.json
// (models::fields_from_reference_config).
//
//   auto flux = dew::nn::FluxTransformer(dew::nn::FluxTransformerOptions());   // FLUX.1's layout
//   dew::Conditioning c;
//   c.context = t5_states;                         // [B, 512, 4096]
//   c.pooled = clip_pooled;                        // [B, 768]
//   c.extra["guidance"] = at::full({B}, 3.5);      // dev only, FluxPipeline's guidance_scale
//   at::Tensor v = flux->forward(latents, sigma * 1000, c);   // [B, 16, 128, 128] -> same
//
// Layout: the latents are packed into 2 x 2 patches (FluxPipeline._pack_latents), x_embedder and
// context_embedder project image and text tokens to D = heads x head_dim; temb = timestep MLP(sinusoid(t))
// (+ guidance MLP(sinusoid(1000 g)) for dev) + text MLP(pooled). num_layers double-stream blocks (each stream
// its own adaLN-Zero modulation, projections and GELU-tanh MLP, one joint attention over [text; image]), then
// num_single_layers single-stream blocks over the concatenation (parallel attention and MLP, one output
// projection), then AdaLayerNormContinuous and proj_out on the image tokens, unpacked back to [B, C, H, W].
// Queries and keys are RMS-normalised per head and rotated by a 3-axis RoPE of the token ids (text ids 0,
// image ids (0, row, col)), pairs interleaved, theta 10000.
#pragma once
#include <ATen/core/Tensor.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/linear.h>

#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "dew/nn/attention.h"
#include "dew/nn/backbones/backbone.h"
#include "dew/nn/backbones/unet_2d_condition.h"  // TimestepMLP: diffusers' TimestepEmbedding
#include "dew/nn/blocks.h"
#include "dew/nn/option_fields.h"

namespace dew::nn {

// ---- FluxPipeline's latent packing and token ids ----

/// FluxPipeline._pack_latents: [B, C, H, W] (H, W even) -> [B, (H/2)(W/2), 4 C], tokens in raster order of
/// the 2 x 2 patches, each token's features ordered (channel, row in patch, column in patch).
at::Tensor flux_pack_latents(const at::Tensor& latents);
/// FluxPipeline._unpack_latents: [B, (H/2)(W/2), 4 C] -> [B, C, H, W] for the latent size H x W (even).
at::Tensor flux_unpack_latents(const at::Tensor& tokens, int64_t height, int64_t width);
/// FluxPipeline._prepare_latent_image_ids for a packed grid of h x w tokens: [h w, 3] float32, row r w + c
/// = (0, r, c).
at::Tensor flux_image_ids(int64_t h, int64_t w, const at::Device& device = at::kCPU);
/// The text ids FluxPipeline passes: zeros [length, 3] float32.
at::Tensor flux_text_ids(int64_t length, const at::Device& device = at::kCPU);

/// Rotary tables of Flux's FluxPosEmbed, pairs interleaved (cos of frequency i at columns 2i and 2i + 1), so
/// they are applied by flux_apply_rope, not by apply_rope (rotate-half).
struct FluxRope {
  at::Tensor cos, sin;  // [S, sum(axes_dims)] float32
};
/// FluxPosEmbed(theta, axes_dims): ids [S, n] (n = axes_dims.size()) -> per axis i, for positions
/// float32(ids[:, i]), the frequencies theta^(-2j / axes_dims[i]) in float64, cos and sin repeated per pair,
/// concatenated over the axes and returned in float32, as diffusers computes them.
FluxRope flux_rope(const at::Tensor& ids, const std::vector<int64_t>& axes_dims, double theta = 10000.0);
/// diffusers' apply_rotary_emb (use_real, unbind_dim -1): x [B, H, S, D] -> x cos + rotated(x) sin with
/// rotated pairs (x0, x1) -> (-x1, x0), computed in float32 (even for float64 x, as diffusers' x.float())
/// and returned in x's dtype.
at::Tensor flux_apply_rope(const at::Tensor& x, const FluxRope& rope);

/// Fields of `flux_transformer`. Defaults are FLUX.1's (schnell; dev sets guidance_embeds).
struct FluxTransformerOptions {
#define DEW_FLUX_TRANSFORMER_FIELDS(F, C)                                                                     \
  F(int64_t, in_channels, 16,                                                                                 \
    "latent channels C of x [B, C, H, W]; the packed 2 x 2 tokens have 4 C (diffusers' in_channels = 4 C)")   \
  F(int64_t, output_channels, 16, "channels of the prediction (diffusers' out_channels = 4 output_channels)") \
  F(int64_t, num_classes, 0, "must be 0: Flux conditions on text and pooled text, not on class labels")       \
  F(int64_t, context_features, 4096, "width of the text context (joint_attention_dim; T5-XXL's 4096)")        \
  F(int64_t, pooled_projection_dim, 768, "width of the pooled text vector (CLIP-L's 768)")                    \
  F(int64_t, num_layers, 19, "double-stream blocks (transformer_blocks)")                                     \
  F(int64_t, num_single_layers, 38, "single-stream blocks (single_transformer_blocks)")                       \
  F(int64_t, num_attention_heads, 24, "attention heads; the model width is num_attention_heads x head dim")   \
  F(int64_t, attention_head_dim, 128, "width of each head")                                                   \
  F(bool, guidance_embeds, false,                                                                             \
    "FLUX.1 dev's guidance embedding: Conditioning::extra \"guidance\" [B] (FluxPipeline's guidance_scale)")  \
  F(std::vector<int64_t>, axes_dims_rope, (std::vector<int64_t>{16, 56, 56}),                                 \
    "RoPE widths of the id axes (even, summing to attention_head_dim)")                                       \
  F(bool, force_fp32_for_softmax, true, "softmax in fp32 under bf16/fp16 compute")                            \
  DEW_COMPUTE_FIELDS(F, C, "block")
  DEW_OPTIONS(DEW_FLUX_TRANSFORMER_FIELDS)
#undef DEW_FLUX_TRANSFORMER_FIELDS
};

/// The linear of diffusers' AdaLayerNormZero (chunks 6), AdaLayerNormZeroSingle (3) and AdaLayerNormContinuous
/// (2): linear(SiLU(temb)) split into `chunks` modulation vectors. Parameters: linear [chunks D, D].
class FluxAdaNormImpl : public torch::nn::Module {
 public:
  FluxAdaNormImpl(int64_t dim, int64_t chunks);
  /// temb: [B, D] -> chunks tensors [B, D], in temb's dtype.
  std::vector<at::Tensor> forward(const at::Tensor& temb);
  int64_t chunks;
  torch::nn::Linear linear{nullptr};
};
TORCH_MODULE(FluxAdaNorm);

/// diffusers' FeedForward(dim, activation_fn "gelu-approximate"): net.2(gelu_tanh(net.0.proj(x))), hidden 4 D.
/// Parameters: net.0.proj [4 D, D], net.2 [D, 4 D].
class FluxFeedForwardImpl : public torch::nn::Module {
 public:
  explicit FluxFeedForwardImpl(int64_t dim);
  /// x: [B, S, D] -> [B, S, D]
  at::Tensor forward(const at::Tensor& x);
  torch::nn::Linear proj{nullptr}, out{nullptr};  // net.0.proj, net.2
};
TORCH_MODULE(FluxFeedForward);

/// diffusers' FluxAttention: to_q / to_k / to_v with bias, RMSNorm (eps 1e-6) of each head's queries and keys;
/// the double-stream form also projects the text (add_q_proj / add_k_proj / add_v_proj, norm_added_q / _k) and
/// has both output projections (to_out.0, to_add_out); the single-stream form (pre_only) has neither.
/// `text_out` false (double-stream only): the text gives keys and values alone (no add_q_proj, norm_added_q,
/// to_add_out), for a last block whose text output nobody reads.
class FluxAttentionImpl : public torch::nn::Module {
 public:
  FluxAttentionImpl(int64_t dim, int64_t heads, int64_t head_dim, bool joint, bool text_out = true);
  /// Heads of the image (or single-stream) tokens x [B, S, D]: {q, k, v}, each [B, H, S, head_dim], q and k
  /// normalised (norm_q, norm_k).
  std::vector<at::Tensor> heads(const at::Tensor& x);
  /// The same for the text tokens of the double-stream form (add_*_proj, norm_added_q / _k).
  std::vector<at::Tensor> added_heads(const at::Tensor& txt);
  int64_t heads_count, head_dim;
  bool joint, text_out;
  HeadNorm norm_q{nullptr}, norm_k{nullptr}, norm_added_q{nullptr}, norm_added_k{nullptr};
  torch::nn::Linear to_q{nullptr}, to_k{nullptr}, to_v{nullptr}, add_q_proj{nullptr}, add_k_proj{nullptr},
      add_v_proj{nullptr}, to_add_out{nullptr};
  torch::nn::ModuleList to_out{nullptr};  // to_out.0 (to_out.1 is a parameterless dropout)
  torch::nn::Linear out{nullptr};         // view of to_out.0
};
TORCH_MODULE(FluxAttention);

/// Options shared by the blocks: width, heads, how attention runs.
struct FluxBlockOptions {
  FluxBlockOptions(int64_t heads, int64_t head_dim) : heads_(heads), head_dim_(head_dim) {}
  TORCH_ARG(int64_t, heads);
  TORCH_ARG(int64_t, head_dim);
  TORCH_ARG(std::string, attention_impl) = "auto";
  TORCH_ARG(bool, force_fp32_for_softmax) = true;
};

/// diffusers' FluxTransformerBlock (double stream). Parameters: norm1.linear, norm1_context.linear [6 D, D],
/// attn.* (joint form), ff.net.{0.proj, 2}, ff_context.net.{0.proj, 2}.
class FluxTransformerBlockImpl : public torch::nn::Module {
 public:
  explicit FluxTransformerBlockImpl(FluxBlockOptions options);
  /// x: [B, N, D] image tokens; txt: [B, L, D] text tokens; temb: [B, D]; rope: tables of the joint sequence
  /// [text; image] (L + N rows); key_mask: [B, L + N] bool or undefined. Returns {x, txt} updated.
  std::pair<at::Tensor, at::Tensor> forward(const at::Tensor& x, const at::Tensor& txt, const at::Tensor& temb,
                                            const FluxRope& rope, const at::Tensor& key_mask);
  FluxBlockOptions options;
  FluxAdaNorm norm1{nullptr}, norm1_context{nullptr};
  FluxAttention attn{nullptr};
  FluxFeedForward ff{nullptr}, ff_context{nullptr};
};
TORCH_MODULE(FluxTransformerBlock);

/// Runs double-stream blocks (FluxTransformerBlock, QwenImage1Block: forward(x, txt, temb, rope, key_mask) ->
/// {x, txt}) over the image tokens h and the text tokens txt in place; with `remat_on` each block's activations are
/// recomputed in backward (the block and its inputs captured by value: backward runs after the caller returns).
template <class Block, class Rope>
void run_double_stream_blocks(std::vector<Block>& blocks, at::Tensor& h, at::Tensor& txt, const at::Tensor& temb,
                              const Rope& rope, const at::Tensor& key_mask, bool remat_on) {
  for (auto& block : blocks) {
    if (!remat_on) {
      std::tie(h, txt) = block(h, txt, temb, rope, key_mask);
      continue;
    }
    Block b = block;
    RematFn fn = [b, rope, key_mask](const std::vector<at::Tensor>& in) mutable {
      auto out = b(in[0], in[1], in[2], rope, key_mask);
      return std::vector<at::Tensor>{out.first, out.second};
    };
    auto out = remat(fn, {h, txt, temb}, b->parameters());
    h = out[0];
    txt = out[1];
  }
}

/// diffusers' FluxSingleTransformerBlock. Parameters: norm.linear [3 D, D], proj_mlp [4 D, D],
/// proj_out [D, 5 D], attn.{to_q, to_k, to_v, norm_q, norm_k}.
class FluxSingleTransformerBlockImpl : public torch::nn::Module {
 public:
  explicit FluxSingleTransformerBlockImpl(FluxBlockOptions options);
  /// h: [B, L + N, D] the joint sequence [text; image]; temb [B, D]; rope and key_mask as the double block's.
  /// Returns h + gate proj_out([attention(norm h), gelu_tanh(proj_mlp(norm h))]).
  at::Tensor forward(const at::Tensor& h, const at::Tensor& temb, const FluxRope& rope, const at::Tensor& key_mask);
  FluxBlockOptions options;
  FluxAdaNorm norm{nullptr};
  torch::nn::Linear proj_mlp{nullptr}, proj_out{nullptr};
  FluxAttention attn{nullptr};
};
TORCH_MODULE(FluxSingleTransformerBlock);

/// diffusers' CombinedTimestepTextProjEmbeddings (schnell) / CombinedTimestepGuidanceTextProjEmbeddings (dev):
/// timestep_embedder(sinusoid_256(t)) (+ guidance_embedder(sinusoid_256(g))) + text_embedder(pooled); the
/// sinusoids ([cos, sin], shift 0) in float32 as diffusers computes them. Parameters: timestep_embedder,
/// guidance_embedder (dev), text_embedder, each linear_1 / linear_2.
class FluxTimeTextEmbedImpl : public torch::nn::Module {
 public:
  FluxTimeTextEmbedImpl(int64_t dim, int64_t pooled_dim, bool guidance);
  /// time: [B] diffusers' timestep x 1000 (dew's model time); guidance: [B] already x 1000, or undefined
  /// (schnell); pooled: [B, pooled_dim] in the compute dtype -> [B, D] in pooled's dtype.
  at::Tensor forward(const at::Tensor& time, const at::Tensor& guidance, const at::Tensor& pooled);
  TimestepMLP timestep_embedder{nullptr}, guidance_embedder{nullptr}, text_embedder{nullptr};
};
TORCH_MODULE(FluxTimeTextEmbed);

/// The FluxTransformer backbone. Parameters (diffusers' names): x_embedder [D, 4 in_channels],
/// context_embedder [D, context_features], time_text_embed.*, transformer_blocks.I.*,
/// single_transformer_blocks.J.*, norm_out.linear [2 D, D], proj_out [4 output_channels, D].
class FluxTransformerImpl : public BackboneImpl {
 public:
  explicit FluxTransformerImpl(FluxTransformerOptions options = {});
  void reset();
  /// x: [B, in_channels, H, W] latents (H, W even); time: [B] or a scalar, the model time sigma x 1000
  /// (diffusers' timestep x 1000); cond: context [B, L, context_features] (required; context_mask [B, L]
  /// optional: masked text tokens are not attended to; FluxPipeline passes none), pooled
  /// [B, pooled_projection_dim] (required), extra "guidance" [B] or a scalar (guidance_embeds only, required
  /// there). Packs x, builds the ids (image (0, row, col), text 0), runs forward_packed and unpacks:
  /// [B, output_channels, H, W] float32 (float64 for a float64 model).
  at::Tensor forward(const at::Tensor& x, const at::Tensor& time, const Conditioning& cond) override;
  /// diffusers' forward on packed tokens: tokens [B, S, 4 in_channels]; context [B, L, context_features];
  /// pooled [B, pooled_projection_dim]; time [B] = diffusers' timestep x 1000; guidance [B] on diffusers'
  /// scale (multiplied by 1000 here, as diffusers does) or undefined; img_ids [S, n], txt_ids [L, n]
  /// (n = axes_dims_rope.size()); context_mask [B, L] bool or undefined -> [B, S, 4 output_channels] float32
  /// (float64 for a float64 model).
  at::Tensor forward_packed(const at::Tensor& tokens, const at::Tensor& context, const at::Tensor& pooled,
                            const at::Tensor& time, const at::Tensor& guidance, const at::Tensor& img_ids,
                            const at::Tensor& txt_ids, const at::Tensor& context_mask = {});
  bool requires_text() const override { return true; }
  bool takes_pooled() const override { return true; }

  FluxTransformerOptions options;
  torch::nn::Linear x_embedder{nullptr}, context_embedder{nullptr}, proj_out{nullptr};
  FluxTimeTextEmbed time_text_embed{nullptr};
  FluxAdaNorm norm_out{nullptr};
  std::vector<FluxTransformerBlock> blocks;               // transformer_blocks, in order
  std::vector<FluxSingleTransformerBlock> single_blocks;  // single_transformer_blocks, in order

 private:
  at::ScalarType dtype_ = at::kFloat;
};
TORCH_MODULE(FluxTransformer);

/// The fields of a diffusers FluxTransformer2DModel config.json (bookkeeping keys already removed); a setting
/// this implementation does not support (patch_size other than 1, channels not a multiple of 4, an unknown
/// key) is a dew::Error naming it.
json flux_transformer_fields_from_diffusers(const json& config);

/// The reference method "forward" of FluxTransformer2DModel as `dew forward` runs it: hidden_states
/// [B, S, 4 in_channels] (packed), encoder_hidden_states, pooled_projections, timestep (in [0, 1], a scalar or
/// [B]), img_ids [S, 3] and txt_ids [L, 3] ([1, S, 3] and [1, L, 3] are read as diffusers reads them), optional
/// guidance -> sample [B, S, 4 output_channels] (packed).
models::ReferenceMethod flux_transformer_forward_method();

}  // namespace dew::nn

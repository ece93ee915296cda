#include "dew/nn/backbones/causal_transformer.h"

#include <cmath>

#include "dew/core/error.h"
#include "dew/nn/blocks.h"
#include "dew/nn/fused.h"
#include "dew/nn/lora.h"

namespace dew::nn {

using at::Tensor;

namespace {

const std::string kFull = "full_attention";
const std::string kSliding = "sliding_attention";

void init_linear(torch::nn::Linear& l, double std) {
  l->weight.normal_(0.0, std);
  if (l->bias.defined()) l->bias.zero_();
}

// Every id in [0, vocab): read on the host for a CPU tensor (no operator per token of a generation).
void check_token_ids(const Tensor& ids, int64_t vocab, const std::string& w) {
  int64_t lo = 0, hi = 0;
  if (ids.device().is_cpu()) {
    const Tensor c = ids.contiguous();
    const int64_t* p = c.data_ptr<int64_t>();
    if (c.numel() > 0) lo = hi = p[0];
    for (int64_t i = 1; i < c.numel(); ++i) {
      lo = std::min(lo, p[i]);
      hi = std::max(hi, p[i]);
    }
  } else {
    auto [mn, mx] = at::aminmax(ids);
    lo = mn.item<int64_t>();
    hi = mx.item<int64_t>();
  }
  DEW_CHECK(lo >= 0 && hi < vocab, w, ": token ids must be in [0, ", vocab, "), got [", lo, ", ", hi, "]");
}

Tensor branch_dropout(const Tensor& x, double p, bool training) {
  return (p > 0 && training) ? at::dropout(x, p, /*train=*/true) : x;
}

}  // namespace

int64_t CausalTransformerOptions::rotary_dim() const {
  return static_cast<int64_t>(std::floor(head_size() * partial_rotary_factor_ / 2.0)) * 2;
}

const std::string& CausalTransformerOptions::layer_type(int64_t i) const {
  return layer_types_.empty() ? kFull : layer_types_.at(i);
}

Tensor apply_partial_rope(const Tensor& x, const Rope& rope) {
  if (!rope.defined()) return x;
  const int64_t rd = rope.cos.size(-1), dh = x.size(-1);
  if (rd == dh) return apply_rope(x, rope);
  return at::cat({apply_rope(x.narrow(-1, 0, rd), rope), x.narrow(-1, rd, dh - rd)}, -1);
}

Tensor apply_partial_rope(const Tensor& x, const Tensor& positions, int64_t rotary_dim, double theta) {
  DEW_CHECK(rotary_dim >= 0 && rotary_dim % 2 == 0 && rotary_dim <= x.size(-1),
            "apply_partial_rope: rotary_dim must be even and in [0, ", x.size(-1), "], got ", rotary_dim);
  if (rotary_dim == 0) return x;
  return apply_partial_rope(x, rope_1d(positions, rotary_dim, theta));
}

void KVCache::select_rows(const Tensor& index) {
  for (auto& t : keys) t = t.index_select(0, index);
  for (auto& t : values) t = t.index_select(0, index);
  if (valid.defined()) {  // the flags stay: a subset of the rows is no less padded or segmented
    valid = valid.index_select(0, index);
    positions = positions.index_select(0, index);
    segments = segments.index_select(0, index);
  }
}

Tensor causal_mask(const Tensor& q_pos, const Tensor& q_seg, const Tensor& key_pos, const Tensor& key_seg,
                   const Tensor& key_valid, int64_t offset, int64_t window) {
  const int64_t sq = q_pos.size(1), sk = key_pos.size(1);
  auto lopts = at::TensorOptions(at::kLong).device(q_pos.device());
  Tensor qi = at::arange(offset, offset + sq, lopts).unsqueeze(1);  // [Sq, 1]
  Tensor kj = at::arange(sk, lopts).unsqueeze(0);                   // [1, Sk]
  Tensor m = (kj <= qi).unsqueeze(0);                               // [1, Sq, Sk]
  m = m.logical_and(q_seg.unsqueeze(2) == key_seg.unsqueeze(1));    // [B, Sq, Sk]
  m = m.logical_and(key_valid.unsqueeze(1));
  if (window > 0) m = m.logical_and((q_pos.unsqueeze(2) - key_pos.unsqueeze(1)) < window);
  return m.unsqueeze(1);  // [B, 1, Sq, Sk]
}

// ---- RMSNorm ----

RMSNormImpl::RMSNormImpl(int64_t dim, double eps_, double offset_) : eps(eps_), offset(offset_) {
  weight = register_parameter("weight", torch::empty({dim}));
  reset_parameters();
}

void RMSNormImpl::reset_parameters() {
  torch::NoGradGuard ng;
  weight.fill_(1.0 - offset);  // the scale offset + weight starts at 1
}

// ---- attention ----

CausalAttentionImpl::CausalAttentionImpl(const CausalTransformerOptions& o, double theta_) : options(o), theta(theta_) {
  const int64_t d = o.emb_features(), h = o.num_heads(), kv = o.kv_heads(), dh = o.head_size();
  const bool b = o.attention_bias();
  q_proj = register_module("q_proj", torch::nn::Linear(torch::nn::LinearOptions(d, h * dh).bias(b)));
  k_proj = register_module("k_proj", torch::nn::Linear(torch::nn::LinearOptions(d, kv * dh).bias(b)));
  v_proj = register_module("v_proj", torch::nn::Linear(torch::nn::LinearOptions(d, kv * dh).bias(b)));
  o_proj = register_module("o_proj", torch::nn::Linear(torch::nn::LinearOptions(h * dh, d).bias(b)));
  if (o.qk_norm()) {
    q_norm = register_module("q_norm", RMSNorm(dh, o.norm_eps(), o.scale_offset()));
    k_norm = register_module("k_norm", RMSNorm(dh, o.norm_eps(), o.scale_offset()));
  }
  reset_parameters();
}

void CausalAttentionImpl::reset_parameters() {
  torch::NoGradGuard ng;
  const double std = options.init_std();
  init_linear(q_proj, std);
  init_linear(k_proj, std);
  init_linear(v_proj, std);
  // GPT-2's scaling of the projections that write into the residual stream: its variance stays O(1).
  init_linear(o_proj, std / std::sqrt(2.0 * options.num_layers()));
}

Tensor CausalAttentionImpl::forward(const Tensor& x, const Rope& rope, const AttentionMask& mask, Tensor* cache_k,
                                    Tensor* cache_v) {
  const auto& o = options;
  const int64_t b = x.size(0), s = x.size(1), h = o.num_heads(), kv = o.kv_heads(), dh = o.head_size();
  Tensor q = dense(x, q_proj).view({b, s, h, dh});
  Tensor k = dense(x, k_proj).view({b, s, kv, dh});
  Tensor v = dense(x, v_proj).view({b, s, kv, dh}).transpose(1, 2);  // [B, Hkv, S, Dh]
  if (o.qk_norm()) {
    q = q_norm(q);
    k = k_norm(k);
  }
  q = apply_partial_rope(q.transpose(1, 2), rope);  // [B, H, S, Dh]
  k = apply_partial_rope(k.transpose(1, 2), rope);  // [B, Hkv, S, Dh]
  if (cache_k) {
    if (cache_k->defined()) {
      k = at::cat({*cache_k, k}, 2);
      v = at::cat({*cache_v, v}, 2);
    }
    *cache_k = k;
    *cache_v = v;
  }
  if (kv != h) {  // GQA: each key/value head serves h / kv query heads
    const int64_t t = k.size(2), rep = h / kv;
    k = k.unsqueeze(2).expand({b, kv, rep, t, dh}).reshape({b, h, t, dh});
    v = v.unsqueeze(2).expand({b, kv, rep, t, dh}).reshape({b, h, t, dh});
  }
  Tensor out = attention_masked(q, k, v, mask, o.attention_impl(), o.force_fp32_for_softmax());  // [B, H, S, Dh]
  return dense(out.transpose(1, 2).reshape({b, s, h * dh}), o_proj);
}

// ---- MLP ----

GatedMLPImpl::GatedMLPImpl(const CausalTransformerOptions& o) : options(o) {
  const int64_t d = o.emb_features(), f = o.mlp_hidden();
  gate_proj = register_module("gate_proj", torch::nn::Linear(torch::nn::LinearOptions(d, f).bias(false)));
  up_proj = register_module("up_proj", torch::nn::Linear(torch::nn::LinearOptions(d, f).bias(false)));
  down_proj = register_module("down_proj", torch::nn::Linear(torch::nn::LinearOptions(f, d).bias(false)));
  reset_parameters();
}

void GatedMLPImpl::reset_parameters() {
  torch::NoGradGuard ng;
  const double std = options.init_std();
  init_linear(gate_proj, std);
  init_linear(up_proj, std);
  init_linear(down_proj, std / std::sqrt(2.0 * options.num_layers()));
}

Tensor GatedMLPImpl::forward(const Tensor& x) {
  Tensor g = dense(x, gate_proj);
  g = options.mlp() == "swiglu" ? at::silu(g) : gelu_tanh(g);
  return dense(g * dense(x, up_proj), down_proj);
}

// ---- decoder layer ----

DecoderLayerImpl::DecoderLayerImpl(const CausalTransformerOptions& o, int64_t index_) : options(o), index(index_) {
  sliding = o.layer_type(index) == kSliding;
  theta = sliding && o.sliding_rope_theta() ? *o.sliding_rope_theta() : o.rope_theta();
  const int64_t d = o.emb_features();
  input_layernorm = register_module("input_layernorm", RMSNorm(d, o.norm_eps(), o.scale_offset()));
  self_attn = register_module("self_attn", CausalAttention(o, theta));
  post_attention_layernorm = register_module("post_attention_layernorm", RMSNorm(d, o.norm_eps(), o.scale_offset()));
  if (o.sandwich_norms()) {
    pre_feedforward_layernorm =
        register_module("pre_feedforward_layernorm", RMSNorm(d, o.norm_eps(), o.scale_offset()));
    post_feedforward_layernorm =
        register_module("post_feedforward_layernorm", RMSNorm(d, o.norm_eps(), o.scale_offset()));
  }
  mlp = register_module("mlp", GatedMLP(o));
}

Tensor DecoderLayerImpl::forward(const Tensor& h, const Rope& rope, const AttentionMask& mask, Tensor* cache_k,
                                 Tensor* cache_v) {
  const double p = options.dropout();
  Tensor a = self_attn(input_layernorm(h), rope, mask, cache_k, cache_v);
  if (options.sandwich_norms()) {
    // Gemma 3: norm the attention output, then norm the MLP input and output.
    Tensor x = h + branch_dropout(post_attention_layernorm(a), p, is_training());
    Tensor m = post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x)));
    return x + branch_dropout(m, p, is_training());
  }
  Tensor x = h + branch_dropout(a, p, is_training());
  return x + branch_dropout(mlp(post_attention_layernorm(x)), p, is_training());
}

// ---- the model ----

CausalTransformerImpl::CausalTransformerImpl(CausalTransformerOptions options_) : options(std::move(options_)) {
  const auto& o = options;
  const std::string w = "causal_transformer";
  DEW_CHECK(o.vocab_size() > 0, w, ": vocab_size must be > 0, got ", o.vocab_size());
  DEW_CHECK(o.emb_features() > 0, w, ": emb_features must be > 0, got ", o.emb_features());
  DEW_CHECK(o.num_layers() > 0, w, ": num_layers must be > 0, got ", o.num_layers());
  DEW_CHECK(o.num_heads() > 0, w, ": num_heads must be > 0, got ", o.num_heads());
  DEW_CHECK(o.num_kv_heads() >= 0 && o.num_heads() % o.kv_heads() == 0, w, ": num_heads (", o.num_heads(),
            ") must be a multiple of num_kv_heads, got ", o.num_kv_heads());
  DEW_CHECK(o.head_dim() >= 0, w, ": head_dim must be >= 0 (0 = emb_features / num_heads), got ", o.head_dim());
  DEW_CHECK(o.head_dim() > 0 || o.emb_features() % o.num_heads() == 0, w, ": emb_features (", o.emb_features(),
            ") must be divisible by num_heads (", o.num_heads(), ") unless head_dim is set");
  DEW_CHECK(o.head_size() > 0, w, ": head_dim must be > 0, got ", o.head_size());
  DEW_CHECK(o.mlp() == "swiglu" || o.mlp() == "geglu", w, ".mlp: got \"", o.mlp(), "\", accepted: swiglu, geglu");
  DEW_CHECK(o.mlp_features() >= 0, w, ": mlp_features must be >= 0 (0 = 8/3 D), got ", o.mlp_features());
  DEW_CHECK(o.max_seq_len() > 0, w, ": max_seq_len must be > 0, got ", o.max_seq_len());
  DEW_CHECK(o.rope_theta() > 0, w, ": rope_theta must be > 0, got ", o.rope_theta());
  DEW_CHECK(!o.sliding_rope_theta() || *o.sliding_rope_theta() > 0, w, ": sliding_rope_theta must be > 0 or null");
  DEW_CHECK(o.partial_rotary_factor() >= 0 && o.partial_rotary_factor() <= 1, w,
            ": partial_rotary_factor must be in [0, 1], got ", o.partial_rotary_factor());
  DEW_CHECK(o.layer_types().empty() || int64_t(o.layer_types().size()) == o.num_layers(), w, ": layer_types has ",
            o.layer_types().size(), " entries, expected num_layers = ", o.num_layers(), " (or none)");
  for (size_t i = 0; i < o.layer_types().size(); ++i)
    DEW_CHECK(o.layer_types()[i] == kFull || o.layer_types()[i] == kSliding, w, ".layer_types[", i, "]: got \"",
              o.layer_types()[i], "\", accepted: full_attention, sliding_attention");
  DEW_CHECK(o.sliding_window() > 0, w, ": sliding_window must be > 0, got ", o.sliding_window());
  DEW_CHECK(o.norm_eps() > 0, w, ": norm_eps must be > 0, got ", o.norm_eps());
  DEW_CHECK(o.embedding_scale() > 0, w, ": embedding_scale must be > 0, got ", o.embedding_scale());
  DEW_CHECK(o.final_logit_softcap() >= 0, w, ": final_logit_softcap must be >= 0 (0 = none), got ",
            o.final_logit_softcap());
  DEW_CHECK(o.dropout() >= 0 && o.dropout() < 1, w, ": dropout must be in [0, 1), got ", o.dropout());
  DEW_CHECK(o.init_std() > 0, w, ": init_std must be > 0, got ", o.init_std());
  dtype_ = parse_compute_dtype(o.dtype(), w + ".dtype");
  check_attention_impl(o.attention_impl(), w + ".attention_impl");
  reset();
}

void CausalTransformerImpl::reset() {
  const auto& o = options;
  embed_tokens = register_module("embed_tokens", torch::nn::Embedding(o.vocab_size(), o.emb_features()));
  layers = register_module("layers", torch::nn::ModuleList());
  layer_list.clear();
  for (int64_t i = 0; i < o.num_layers(); ++i) {
    DecoderLayer l(o, i);
    layers->push_back(l);
    layer_list.push_back(l);
  }
  norm = register_module("norm", RMSNorm(o.emb_features(), o.norm_eps(), o.scale_offset()));
  if (!o.tie_embeddings())
    lm_head = register_module(
        "lm_head", torch::nn::Linear(torch::nn::LinearOptions(o.emb_features(), o.vocab_size()).bias(false)));
  reset_parameters();
}

void CausalTransformerImpl::reset_parameters() {
  torch::NoGradGuard ng;
  embed_tokens->weight.normal_(0.0, options.init_std());
  if (!lm_head.is_empty()) lm_head->weight.normal_(0.0, options.init_std());
}

Tensor CausalTransformerImpl::hidden_states(const Tensor& ids, const Tensor& positions_in, const Tensor& segment_ids,
                                            const Tensor& attention_mask, KVCache* cache, bool final_norm) {
  const auto& o = options;
  const std::string w = "causal_transformer";
  DEW_CHECK(ids.dim() == 2 && ids.scalar_type() == at::kLong, w, ": ids must be int64 [B, S], got ", ids.scalar_type(),
            " ", ids.sizes());
  const int64_t b = ids.size(0), s = ids.size(1);
  DEW_CHECK(s > 0, w, ": ids must hold at least one token per row");
  const int64_t past = cache ? cache->length() : 0;
  DEW_CHECK(past + s <= o.max_seq_len(), w, ": ", past + s, " tokens exceed max_seq_len ", o.max_seq_len());
  DEW_CHECK(past == 0 || cache->valid.size(0) == b, w, ": batch ", b, " does not match the cache's ",
            cache->valid.size(0));
  check_token_ids(ids, o.vocab_size(), w);
  auto check_bs = [&](const Tensor& t, const char* name) {
    DEW_CHECK(!t.defined() || (t.dim() == 2 && t.size(0) == b && t.size(1) == s), w, ": ", name, " must be [", b, ", ",
              s, "], got ", t.sizes());
  };
  check_bs(positions_in, "positions");
  check_bs(segment_ids, "segment_ids");
  check_bs(attention_mask, "attention_mask");
  const auto lopts = at::TensorOptions(at::kLong).device(ids.device());

  // Host flags of what the mask must express, so an unpadded forward (training, decoding) builds none
  // when it is not needed: one new token attends to every cached one.
  Tensor valid = attention_mask.defined() ? attention_mask.to(at::kBool) : at::ones({b, s}, lopts.dtype(at::kBool));
  const bool padded_now = attention_mask.defined() && !valid.all().item<bool>();
  const bool padded = padded_now || (past > 0 && cache->padded);
  const bool segmented = segment_ids.defined() || (past > 0 && cache->segmented);
  Tensor seg = segment_ids.defined() ? segment_ids.to(at::kLong) : at::zeros({b, s}, lopts);
  Tensor pos = positions_in;
  const bool counted = !pos.defined() && !padded;  // positions past .. past + S - 1 in every row
  if (pos.defined()) {
    pos = pos.to(at::kLong);
  } else if (counted) {
    pos = at::arange(past, past + s, lopts).unsqueeze(0).expand({b, s});
  } else {
    // Each row counts its real tokens: padding does not advance the position (left or right padding).
    Tensor before = past > 0 ? cache->valid.sum(1, /*keepdim=*/true) : at::zeros({b, 1}, lopts);
    pos = (before + valid.to(at::kLong).cumsum(1) - 1).clamp_min(0);
  }
  Tensor key_pos = pos, key_seg = seg, key_valid = valid;
  if (past > 0) {
    key_pos = at::cat({cache->positions, pos}, 1);
    key_seg = at::cat({cache->segments, seg}, 1);
    key_valid = at::cat({cache->valid, valid}, 1);
  }
  if (cache) {
    cache->positions = key_pos;
    cache->segments = key_seg;
    cache->valid = key_valid;
    cache->padded = padded;
    cache->segmented = segmented;
    cache->keys.resize(o.num_layers());
    cache->values.resize(o.num_layers());
  }

  // One mask and one set of RoPE tables per layer kind, shared by the layers of that kind. A valid query
  // always keeps its own key, so only padded queries can be left without one.
  bool any_full = false, any_sliding = false;
  for (const auto& l : layer_list) (l->sliding ? any_sliding : any_full) = true;
  const bool full_needed = s > 1 || padded || segmented;
  const bool sliding_needed = full_needed || positions_in.defined() || past + s > o.sliding_window();
  AttentionMask full_mask, sliding_mask;
  auto prepare = [&](int64_t window) {
    return prepare_attention_mask(causal_mask(pos, seg, key_pos, key_seg, key_valid, past, window), dtype_, padded_now);
  };
  if (any_full && full_needed) full_mask = prepare(0);
  if (any_sliding && sliding_needed) sliding_mask = prepare(o.sliding_window());
  const int64_t rd = o.rotary_dim();
  std::map<double, Rope> ropes;
  for (const auto& l : layer_list) {
    if (rd == 0 || ropes.count(l->theta)) continue;
    if (positions_in.defined()) {
      ropes[l->theta] = rope_1d(pos, rd, l->theta);
      continue;
    }
    const Rope& table = rope_table(l->theta, past + s, ids.device());
    if (counted) {
      ropes[l->theta] = {table.cos.narrow(0, past, s), table.sin.narrow(0, past, s)};  // [S, rd]
    } else {
      const Tensor flat = pos.reshape({-1});
      ropes[l->theta] = {table.cos.index_select(0, flat).view({b, 1, s, rd}),
                         table.sin.index_select(0, flat).view({b, 1, s, rd})};
    }
  }

  Tensor h = at::embedding(embed_tokens->weight, ids).to(dtype_);
  if (o.embedding_scale() != 1.0) h = h * o.embedding_scale();
  h = branch_dropout(h, o.dropout(), is_training());
  const bool use_remat = o.remat() && !cache && at::GradMode::is_enabled() && is_training();
  for (size_t i = 0; i < layer_list.size(); ++i) {
    auto layer = layer_list[i];
    const AttentionMask& mask = layer->sliding ? sliding_mask : full_mask;
    const Rope rope = rd > 0 ? ropes[layer->theta] : Rope{};
    if (use_remat) {
      // Captured by value: backward re-runs the layer after this frame is gone.
      h = remat(*layer,
                [layer, rope, mask](const std::vector<Tensor>& in) mutable {
                  return layer(in[0], rope, mask, nullptr, nullptr);
                },
                {h});
    } else {
      h = layer(h, rope, mask, cache ? &cache->keys[i] : nullptr, cache ? &cache->values[i] : nullptr);
    }
  }
  return final_norm ? norm(h) : h;
}

const Rope& CausalTransformerImpl::rope_table(double theta, int64_t length, const c10::Device& device) {
  Rope& t = rope_tables_[theta];
  if (!t.defined() || t.cos.size(0) < length || t.cos.device() != device) {
    // Doubling keeps the rebuilds to a few per generation; never past max_seq_len.
    const int64_t have = t.defined() ? t.cos.size(0) : 0;
    const int64_t n = std::max(length, std::min(options.max_seq_len(), std::max<int64_t>(2 * have, 256)));
    t = rope_1d(at::arange(n, at::TensorOptions(at::kLong).device(device)), options.rotary_dim(), theta);
  }
  return t;
}

Tensor CausalTransformerImpl::logits(const Tensor& hidden) {
  const Tensor& wt = head_weight();
  Tensor out =
      row_parallel_linear(hidden, wt.scalar_type() == hidden.scalar_type() ? wt : wt.to(hidden.scalar_type()), {});
  // An untied lm_head may carry a LoRA adapter (lora.h); this path does not go through nn::dense.
  if (!lm_head.is_empty())
    if (Tensor d = lora_delta(hidden, *lm_head); d.defined()) out = out + d;
  if (out.scalar_type() != at::kFloat) out = out.to(at::kFloat);
  const double cap = options.final_logit_softcap();
  if (cap > 0) out = at::tanh(out / cap) * cap;
  return out;
}

Tensor CausalTransformerImpl::forward_tokens(const Tensor& ids, const Tensor& positions, const Tensor& segment_ids,
                                             const Tensor& attention_mask, KVCache* cache) {
  return logits(hidden_states(ids, positions, segment_ids, attention_mask, cache));
}

json CausalTransformerImpl::config() const {
  return {{"architecture", "causal_transformer"}, {"fields", to_json(options)}};
}

io::KeyMap hf_decoder_key_map(const CausalTransformerOptions& options) {
  io::KeyMap map;
  map.skip(R"(.*rotary_emb\.inv_freq)");                         // a buffer older checkpoints carry
  if (options.tie_embeddings()) map.skip(R"(lm_head\.weight)");  // saved by some tied checkpoints
  map.prefix("model.", "");
  return map;
}

}  // namespace dew::nn

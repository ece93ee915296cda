#include "dew/nn/t5_encoder.h"

#include <ATen/ATen.h>

#include <cmath>
#include <filesystem>
#include <limits>

#include "dew/core/error.h"
#include "dew/nn/attention.h"
#include "dew/nn/blocks.h"

namespace fs = std::filesystem;

namespace dew::nn {

using at::Tensor;

namespace {

// The compute dtype of a T5 model: float64 when its parameters were moved to float64 (a float64 reference
// run), else the configured one.
at::ScalarType t5_compute_dtype(const Tensor& weight, at::ScalarType configured) {
  return weight.scalar_type() == at::kDouble ? at::kDouble : configured;
}

// softmax(q k^T + bias) v without T5's absent 1/sqrt(d_kv) scaling. q, k, v: [B, H, L, d_kv]; bias: additive,
// broadcastable to [B, H, L, L] (position bias, with the dtype's lowest value at padded keys).
Tensor t5_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& bias, const std::string& impl) {
  if (impl == "auto" || impl == "sdpa")
    return at::scaled_dot_product_attention(q, k, v, bias, /*dropout_p=*/0.0, /*is_causal=*/false, /*scale=*/1.0);
  // The reference path, over blocks of query rows for "chunked"; half-precision scores get a float32 softmax.
  const int64_t rows = impl == "chunked" ? attention_chunk_rows() : q.size(2);
  std::vector<Tensor> outs;
  for (int64_t s = 0; s < q.size(2); s += rows) {
    const int64_t n = std::min(rows, q.size(2) - s);
    Tensor scores = at::matmul(q.narrow(2, s, n), k.transpose(-2, -1));
    if (at::elementSize(scores.scalar_type()) < 4) scores = scores.to(at::kFloat);
    scores = scores + (bias.size(-2) == 1 ? bias : bias.narrow(-2, s, n)).to(scores.scalar_type());
    outs.push_back(at::matmul(at::softmax(scores, -1).to(v.scalar_type()), v));
  }
  return outs.size() == 1 ? outs[0] : at::cat(outs, 2);
}

// transformers' T5Block clamp under float16: the states are kept within the finite range (1000 below it
// when an inf appeared), so a float16 T5 does not turn inf into nan in the next norm.
Tensor t5_clamp_half(const Tensor& h) {
  if (h.scalar_type() != at::kHalf) return h;
  const double top = 65504.0;  // torch.finfo(torch.float16).max
  const Tensor limit =
      at::where(at::isinf(h).any(), at::scalar_tensor(top - 1000.0, h.options()), at::scalar_tensor(top, h.options()));
  return at::clamp(h, -limit, limit);
}

// The lowest finite value of `dt`: what transformers puts at padded keys (torch.finfo(dtype).min).
double t5_lowest(at::ScalarType dt) {
  switch (dt) {
    case at::kDouble: return std::numeric_limits<double>::lowest();
    case at::kHalf: return -65504.0;
    case at::kBFloat16: return -3.3895313892515355e38;
    default: return std::numeric_limits<float>::lowest();
  }
}

// transformers' ACT2FN entries of the accepted feed_forward_proj values (gated-gelu uses gelu_new).
Tensor t5_activation(const Tensor& x, const std::string& act) {
  if (act == "relu") return at::relu(x);
  if (act == "gelu_new")  // NewGELUActivation, term by term as transformers writes it
    return 0.5 * x * (1.0 + at::tanh(std::sqrt(2.0 / 3.141592653589793) * (x + 0.044715 * at::pow(x, 3.0))));
  if (act == "gelu") return at::gelu(x);
  return at::silu(x);
}

}  // namespace

// ---- T5LayerNorm ----

T5LayerNormImpl::T5LayerNormImpl(int64_t dim, double eps) : eps_(eps) {
  weight = register_parameter("weight", torch::ones({dim}));
}

Tensor T5LayerNormImpl::forward(const Tensor& x) {
  // transformers' order: the mean of squares in float32 (also for float64 inputs), then x * rsqrt, then the
  // weight; half inputs come back in their dtype.
  const Tensor variance = x.to(at::kFloat).pow(2).mean(-1, /*keepdim=*/true);
  const Tensor h = x * at::rsqrt(variance + eps_);
  const Tensor out = weight.to(h.scalar_type()) * h;
  return at::elementSize(x.scalar_type()) < 4 ? out.to(x.scalar_type()) : out;
}

// ---- relative positions ----

Tensor t5_relative_position_bucket(const Tensor& relative_position, int64_t num_buckets, int64_t max_distance) {
  // Bidirectional: half the buckets for keys after the query, half for keys before (and the query itself).
  const int64_t half = num_buckets / 2, max_exact = half / 2;
  Tensor buckets = relative_position.gt(0).to(at::kLong) * half;
  const Tensor n = relative_position.abs();
  // Logarithmic bins beyond max_exact, computed in float32 as transformers does (the rounding decides the
  // bucket at the bin edges).
  Tensor large = (at::log(n.to(at::kFloat) / static_cast<double>(max_exact)) /
                  std::log(static_cast<double>(max_distance) / static_cast<double>(max_exact)) *
                  static_cast<double>(half - max_exact))
                     .to(at::kLong) +
                 max_exact;
  large = at::clamp_max(large, half - 1);
  return buckets + at::where(n.lt(max_exact), n, large);
}

// ---- T5Block ----

T5BlockImpl::T5BlockImpl(const T5EncoderOptions& opt, bool has_relative_attention_bias)
    : heads_(opt.num_heads()), d_kv_(opt.d_kv()), impl_(opt.attention_impl()) {
  const int64_t d = opt.d_model(), inner = opt.num_heads() * opt.d_kv(), f = opt.d_ff();
  const std::string& proj = opt.feed_forward_proj();
  gated_ = proj.rfind("gated-", 0) == 0;
  act_ = gated_ ? proj.substr(6) : proj;
  if (proj == "gated-gelu") act_ = "gelu_new";  // transformers' T5Config: gated-gelu means the tanh GELU
  const auto linear = [](int64_t in, int64_t out) {
    return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(false));
  };
  auto layer = register_module("layer", torch::nn::ModuleList());
  auto self_attention_layer = std::make_shared<torch::nn::Module>();
  auto ff_layer = std::make_shared<torch::nn::Module>();
  layer->push_back(self_attention_layer);
  layer->push_back(ff_layer);
  auto attn = self_attention_layer->register_module("SelfAttention", std::make_shared<torch::nn::Module>());
  q = attn->register_module("q", linear(d, inner));
  k = attn->register_module("k", linear(d, inner));
  v = attn->register_module("v", linear(d, inner));
  o = attn->register_module("o", linear(inner, d));
  if (has_relative_attention_bias)
    relative_attention_bias = attn->register_module(
        "relative_attention_bias", torch::nn::Embedding(opt.relative_attention_num_buckets(), opt.num_heads()));
  attention_norm = self_attention_layer->register_module("layer_norm", T5LayerNorm(d, opt.layer_norm_epsilon()));
  auto ff = ff_layer->register_module("DenseReluDense", std::make_shared<torch::nn::Module>());
  if (gated_) {
    wi_0 = ff->register_module("wi_0", linear(d, f));
    wi_1 = ff->register_module("wi_1", linear(d, f));
  } else {
    wi = ff->register_module("wi", linear(d, f));
  }
  wo = ff->register_module("wo", linear(f, d));
  ff_norm = ff_layer->register_module("layer_norm", T5LayerNorm(d, opt.layer_norm_epsilon()));
}

Tensor T5BlockImpl::forward(const Tensor& x, const Tensor& bias) {
  const int64_t b = x.size(0), l = x.size(1);
  const auto heads = [&](const Tensor& t) { return t.view({b, l, heads_, d_kv_}).transpose(1, 2); };
  Tensor n = attention_norm(x);
  const Tensor a = t5_attention(heads(dense(n, q)), heads(dense(n, k)), heads(dense(n, v)), bias, impl_);
  Tensor h = t5_clamp_half(x + dense(a.transpose(1, 2).reshape({b, l, heads_ * d_kv_}), o));
  n = ff_norm(h);
  const Tensor g = gated_ ? t5_activation(dense(n, wi_0), act_) * dense(n, wi_1) : t5_activation(dense(n, wi), act_);
  return t5_clamp_half(h + dense(g, wo));
}

// ---- T5Encoder ----

T5EncoderImpl::T5EncoderImpl(T5EncoderOptions options_) : options(std::move(options_)) {
  const auto& o = options;
  const std::string w = "t5_encoder";
  DEW_CHECK(o.vocab_size() > 0, w, ": vocab_size must be > 0, got ", o.vocab_size());
  DEW_CHECK(o.d_model() > 0, w, ": d_model must be > 0, got ", o.d_model());
  DEW_CHECK(o.d_kv() > 0, w, ": d_kv must be > 0, got ", o.d_kv());
  DEW_CHECK(o.d_ff() > 0, w, ": d_ff must be > 0, got ", o.d_ff());
  DEW_CHECK(o.num_layers() >= 1, w, ": num_layers must be >= 1 (the first block holds the position bias), got ",
            o.num_layers());
  DEW_CHECK(o.num_heads() > 0, w, ": num_heads must be > 0, got ", o.num_heads());
  DEW_CHECK(o.relative_attention_num_buckets() >= 4, w,
            ": relative_attention_num_buckets must be >= 4 (2 exact buckets per direction at least), got ",
            o.relative_attention_num_buckets());
  DEW_CHECK(o.relative_attention_max_distance() > o.relative_attention_num_buckets() / 4, w,
            ": relative_attention_max_distance must be > relative_attention_num_buckets / 4 = ",
            o.relative_attention_num_buckets() / 4, " (where the logarithmic buckets start), got ",
            o.relative_attention_max_distance());
  DEW_CHECK(o.layer_norm_epsilon() > 0, w, ": layer_norm_epsilon must be > 0, got ", o.layer_norm_epsilon());
  const std::string& ff = o.feed_forward_proj();
  DEW_CHECK(
      ff == "relu" || ff == "gated-gelu" || ff == "gelu" || ff == "gated-relu" || ff == "silu" || ff == "gated-silu", w,
      ".feed_forward_proj: got \"", ff, "\", accepted: relu, gated-gelu, gelu, gated-relu, silu, gated-silu");
  DEW_CHECK(o.pad_token_id() >= 0 && o.pad_token_id() < o.vocab_size(), w, ": pad_token_id must be in [0, ",
            o.vocab_size(), "), got ", o.pad_token_id());
  DEW_CHECK(o.eos_token_id() >= 0 && o.eos_token_id() < o.vocab_size(), w, ": eos_token_id must be in [0, ",
            o.vocab_size(), "), got ", o.eos_token_id());
  DEW_CHECK(o.max_length() >= 1, w, ": max_length must be >= 1 (room for </s>), got ", o.max_length());
  dtype_ = parse_compute_dtype(o.dtype(), w + ".dtype");
  check_attention_impl(o.attention_impl(), w + ".attention_impl");
  reset();
  if (!o.weights().empty()) load_t5_encoder_weights(*this, o.weights());
  if (!o.tokenizer().empty()) {
    const std::string path = t5_sentencepiece_path(o.tokenizer());
    try {
      tokenizer_ = data::load_tokenizer(json{{"name", "sentencepiece"}, {"path", path}});
    } catch (const Error& e) {
      fail(w, ".tokenizer \"", path, "\": expected a SentencePiece model (T5's spiece.model): ", e.what());
    }
    DEW_CHECK(tokenizer_->vocab_size() <= o.vocab_size(), w, ": the tokenizer \"", path, "\" has ",
              tokenizer_->vocab_size(), " pieces but vocab_size is ", o.vocab_size());
    DEW_CHECK(tokenizer_->eos_id() == o.eos_token_id(), w, ": the tokenizer's </s> is id ", tokenizer_->eos_id(),
              " but eos_token_id is ", o.eos_token_id(), " (set eos_token_id to ", tokenizer_->eos_id(), ")");
    DEW_CHECK(tokenizer_->pad_id() < 0 || tokenizer_->pad_id() == o.pad_token_id(), w, ": the tokenizer's <pad> is id ",
              tokenizer_->pad_id(), " but pad_token_id is ", o.pad_token_id());
  }
}

void T5EncoderImpl::reset() {
  const auto& o = options;
  shared = register_module("shared", torch::nn::Embedding(o.vocab_size(), o.d_model()));
  encoder = register_module("encoder", std::make_shared<torch::nn::Module>());
  block = encoder->register_module("block", torch::nn::ModuleList());
  block_list.clear();
  for (int64_t i = 0; i < o.num_layers(); ++i) {
    T5Block b(o, /*has_relative_attention_bias=*/i == 0);
    block->push_back(b);
    block_list.push_back(b);
  }
  final_layer_norm = encoder->register_module("final_layer_norm", T5LayerNorm(o.d_model(), o.layer_norm_epsilon()));
  reset_parameters();
}

void T5EncoderImpl::reset_parameters() {
  torch::NoGradGuard no_grad;
  const auto& o = options;
  const double d = static_cast<double>(o.d_model()), dkv = static_cast<double>(o.d_kv());
  const double inner = static_cast<double>(o.num_heads() * o.d_kv()), f = static_cast<double>(o.d_ff());
  shared->weight.normal_(0.0, 1.0);
  for (auto& b : block_list) {
    b->q->weight.normal_(0.0, std::pow(d * dkv, -0.5));
    b->k->weight.normal_(0.0, std::pow(d, -0.5));
    b->v->weight.normal_(0.0, std::pow(d, -0.5));
    b->o->weight.normal_(0.0, std::pow(inner, -0.5));
    if (b->relative_attention_bias) b->relative_attention_bias->weight.normal_(0.0, std::pow(d, -0.5));
    for (auto* lin : {&b->wi, &b->wi_0, &b->wi_1})
      if (*lin) (*lin)->weight.normal_(0.0, std::pow(d, -0.5));
    b->wo->weight.normal_(0.0, std::pow(f, -0.5));
    b->attention_norm->weight.fill_(1.0);
    b->ff_norm->weight.fill_(1.0);
  }
  final_layer_norm->weight.fill_(1.0);
}

std::pair<Tensor, Tensor> T5EncoderImpl::tokenize(const std::vector<std::string>& texts) const {
  DEW_CHECK(tokenizer_ != nullptr,
            "t5_encoder: tokenize() needs a tokenizer: set the field \"tokenizer\" to T5's spiece.model or its "
            "folder (forward(ids, mask) works without one)");
  const int64_t b = static_cast<int64_t>(texts.size()), l = options.max_length();
  Tensor ids = at::full({b, l}, options.pad_token_id(), at::kLong);
  Tensor mask = at::zeros({b, l}, at::kBool);
  auto id = ids.accessor<int64_t, 2>();
  auto m = mask.accessor<bool, 2>();
  for (int64_t i = 0; i < b; ++i) {
    std::vector<int64_t> pieces = tokenizer_->encode(texts[static_cast<size_t>(i)], /*add_special=*/false);
    // transformers truncates so that </s> still fits (truncation=True counts the special token).
    if (static_cast<int64_t>(pieces.size()) > l - 1) pieces.resize(static_cast<size_t>(l - 1));
    pieces.push_back(options.eos_token_id());
    for (size_t j = 0; j < pieces.size(); ++j) {
      id[i][static_cast<int64_t>(j)] = pieces[j];
      m[i][static_cast<int64_t>(j)] = true;
    }
  }
  return {ids, mask};
}

Tensor T5EncoderImpl::position_bias(int64_t length) {
  const auto& o = options;
  const Tensor& table = block_list.front()->relative_attention_bias->weight;  // [num_buckets, H]
  const Tensor pos = at::arange(length, table.options().dtype(at::kLong));
  const Tensor relative = pos.view({1, length}) - pos.view({length, 1});  // key - query: [L, L]
  const Tensor buckets =
      t5_relative_position_bucket(relative, o.relative_attention_num_buckets(), o.relative_attention_max_distance());
  return at::embedding(table, buckets).permute({2, 0, 1}).unsqueeze(0);  // [1, H, L, L]
}

Tensor T5EncoderImpl::last_hidden_state(const Tensor& ids, const Tensor& mask_in) {
  const auto& o = options;
  DEW_CHECK(ids.defined(), "t5_encoder: ids are undefined");
  DEW_CHECK(ids.dim() == 2 && ids.scalar_type() == at::kLong, "t5_encoder: ids must be [B, L] int64, got ", ids.sizes(),
            " ", ids.scalar_type());
  const int64_t b = ids.size(0), l = ids.size(1);
  DEW_CHECK(l >= 1, "t5_encoder: ids must hold at least one token, got ", ids.sizes());
  if (ids.numel() > 0) {
    const int64_t lo = ids.min().item<int64_t>(), hi = ids.max().item<int64_t>();
    DEW_CHECK(lo >= 0 && hi < o.vocab_size(), "t5_encoder: token ids must be in [0, ", o.vocab_size(), "), got [", lo,
              ", ", hi, "]");
  }
  const at::ScalarType dt = t5_compute_dtype(shared->weight, dtype_);
  Tensor h = at::embedding(shared->weight, ids).to(dt);
  // Position bias + padding, once for every block (transformers' create_position_bias_mask): padded keys get
  // the dtype's lowest finite value, so a row without any real key attends uniformly rather than to nan.
  Tensor bias = position_bias(l).to(dt);
  if (mask_in.defined()) {
    DEW_CHECK(mask_in.scalar_type() == at::kBool && mask_in.sizes() == ids.sizes(), "t5_encoder: mask must be bool ",
              ids.sizes(), " like ids, got ", mask_in.scalar_type(), " ", mask_in.sizes());
    const Tensor keys = mask_in.to(ids.device()).view({b, 1, 1, l});
    bias = at::where(keys, bias, at::scalar_tensor(t5_lowest(dt), bias.options()));
  }
  for (auto& blk : block_list) {
    if (o.remat()) {
      // The bias is an input, so its gradient reaches the first block's relative_attention_bias.
      h = remat(*blk, [blk](const std::vector<Tensor>& in) mutable { return blk(in[0], in[1]); }, {h, bias});
    } else {
      h = blk(h, bias);
    }
  }
  return final_layer_norm(h).to(dt == at::kDouble ? at::kDouble : at::kFloat);
}

TextEncoding T5EncoderImpl::forward(const Tensor& ids, const Tensor& mask_in) {
  TextEncoding e;
  e.context = last_hidden_state(ids, mask_in);
  e.mask = mask_in.defined() ? mask_in.to(ids.device()) : at::ones_like(ids, ids.options().dtype(at::kBool));
  e.pooled = masked_mean(e.context, e.mask);
  if (e.context.scalar_type() == at::kDouble) e.pooled = e.pooled.to(at::kDouble);
  return e;
}

// ---------------------------------------------------------------------------------------------------------
// Config and weights
// ---------------------------------------------------------------------------------------------------------

io::KeyMap t5_encoder_key_map(bool has_shared) {
  io::KeyMap map;
  map.skip(R"((decoder\..*|lm_head\..*))");  // a whole T5 model's decoder side
  // encoder.embed_tokens is tied to shared in transformers: one of the two names carries the tensor.
  if (has_shared) map.skip(R"(encoder\.embed_tokens\.weight)");
  else map.regex(R"(^encoder\.embed_tokens\.weight$)", "shared.weight");
  return map;
}

void load_t5_encoder_weights(T5EncoderImpl& model, const std::string& path) {
  const auto source = io::WeightSource::open(path);
  io::LoadOptions o;
  o.require_buffers = false;
  io::load_weights(model, source, t5_encoder_key_map(source.contains("shared.weight")), o);
}

std::string t5_sentencepiece_path(const std::string& tokenizer) {
  const fs::path p(tokenizer);
  if (fs::is_directory(p)) {
    for (const char* name : {"spiece.model", "tokenizer.model"})
      if (fs::exists(p / name)) return (p / name).string();
    fail("t5_encoder.tokenizer \"", tokenizer,
         "\": the folder holds no spiece.model or tokenizer.model (T5's tokenizer is a SentencePiece model; "
         "tokenizer.json alone is not read)");
  }
  DEW_CHECK(fs::exists(p), "t5_encoder.tokenizer \"", tokenizer,
            "\": no such file (expected T5's spiece.model or the folder holding it)");
  return tokenizer;
}

}  // namespace dew::nn

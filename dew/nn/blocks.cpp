#include "dew/nn/blocks.h"

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/function.h>
#include <torch/nn/functional/conv.h>

#include <mutex>

#include "dew/core/error.h"
#include "dew/nn/fused.h"
#include "dew/nn/lora.h"
#include "dew/nn/winograd.h"

namespace dew::nn {

// ---- small shared pieces ----

const std::vector<std::string>& compute_dtypes() {
  static const std::vector<std::string> names{"float32", "bfloat16", "float16"};
  return names;
}

at::ScalarType parse_compute_dtype(const std::string& name, const std::string& where) {
  if (name == "float32") return at::kFloat;
  if (name == "bfloat16") return at::kBFloat16;
  if (name == "float16") return at::kHalf;
  fail(where, ": got \"", name, "\", accepted: float32, bfloat16, float16");
}

const std::vector<std::string>& activations() {
  static const std::vector<std::string> names{"swish", "silu", "gelu", "gelu_tanh", "relu", "mish"};
  return names;
}

Tensor activation(const Tensor& x, const std::string& name) {
  if (name == "swish" || name == "silu") return at::silu(x);
  if (name == "gelu") return at::gelu(x);
  if (name == "gelu_tanh") return gelu_tanh(x);
  if (name == "relu") return at::relu(x);
  if (name == "mish") return at::mish(x);
  fail("activation: got \"", name, "\", accepted: swish, silu, gelu, gelu_tanh, relu, mish");
}

namespace {
// Normalisations run in float32 at least: half precision is upcast, float64 keeps its precision.
at::ScalarType norm_dtype(const Tensor& x) { return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat; }
}  // namespace

Tensor layer_norm_fp32(const Tensor& x, double eps) {
  return at::layer_norm(x.to(norm_dtype(x)), {x.size(-1)}, {}, {}, eps).to(x.scalar_type());
}

Tensor layer_norm_affine(const Tensor& x, const torch::nn::LayerNorm& ln) {
  const auto dt = norm_dtype(x);
  return at::layer_norm(x.to(dt), ln->options.normalized_shape(), ln->weight.to(dt), ln->bias.to(dt), ln->options.eps())
      .to(x.scalar_type());
}

Tensor modulate(const Tensor& x, const Tensor& shift, const Tensor& scale) {
  // x + x * scale + shift in one fused op: addcmul(shift, x, 1 + scale).
  return at::addcmul(shift.unsqueeze(1), x, 1 + scale.unsqueeze(1));
}

namespace {

// Whether a Conv2d's padding is one pixel on every side for a 3 x 3 kernel: explicit {1, 1}, or "same".
// A visitor found by argument-dependent lookup reads the variant, which is c10's in LibTorch 1.13 and
// std's in 2.x.
struct PadsOne {
  bool operator()(const torch::ExpandingArray<2>& p) const { return (*p)[0] == 1 && (*p)[1] == 1; }
  bool operator()(const torch::enumtype::kSame&) const { return true; }
  bool operator()(const torch::enumtype::kValid&) const { return false; }
};

// A 3 x 3 convolution with stride 1, padding 1, no dilation and no groups: what conv3x3_winograd computes.
bool same_size_3x3(const torch::nn::detail::ConvNdOptions<2>& o) {
  const auto &k = *o.kernel_size(), &s = *o.stride(), &d = *o.dilation();
  return k[0] == 3 && k[1] == 3 && s[0] == 1 && s[1] == 1 && d[0] == 1 && d[1] == 1 && o.groups() == 1 &&
         visit(PadsOne{}, o.padding());
}

}  // namespace

Tensor conv(const Tensor& x, const torch::nn::Conv2d& layer) {
  const auto& o = layer->options;
  DEW_CHECK(torch::enumtype::get_enum_name(o.padding_mode()) == "kZeros", "conv: only zero padding is supported");
  const auto dt = x.scalar_type();
  const Tensor w = layer->weight.to(dt);
  const Tensor b = layer->bias.defined() ? layer->bias.to(dt) : layer->bias;
  Tensor y;
  if (same_size_3x3(o) && winograd_conv_applies(x, w, b)) {
    y = conv3x3_winograd(x, w, b);
  } else {
    // The padding variant is passed through untouched.
    namespace F = torch::nn::functional;
    y = F::conv2d(x, w,
                  F::Conv2dFuncOptions()
                      .bias(b)
                      .stride(o.stride())
                      .padding(o.padding())
                      .dilation(o.dilation())
                      .groups(o.groups()));
  }
  // A LoRA adapter attached to the layer (lora.h) adds scale * B(A(dropout(x))).
  if (Tensor d = lora_delta(x, *layer); d.defined()) y = y + d;
  return y;
}

Tensor cpu_channels_last(const Tensor& x) {
  if (x.dim() != 4 || !x.device().is_cpu() || x.scalar_type() != at::kFloat) return x;
  const auto n = x.sizes();
  const std::vector<int64_t> nhwc{n[1] * n[2] * n[3], 1, n[3] * n[1], n[1]};
  if (x.strides() == at::IntArrayRef(nhwc)) return x;
  return at::empty(n, x.options().memory_format(at::MemoryFormat::ChannelsLast)).copy_(x);
}

Tensor group_norm_fp32(const Tensor& x, const torch::nn::GroupNorm& layer) {
  const auto& o = layer->options;
  const auto dt = norm_dtype(x);
  const Tensor& w = layer->weight;
  const Tensor& b = layer->bias;
  return at::group_norm(x.to(dt), o.num_groups(), w.defined() ? w.to(dt) : w, b.defined() ? b.to(dt) : b, o.eps())
      .to(x.scalar_type());
}

std::array<Tensor, 2> group_norm_act_and_input(const Tensor& x, const torch::nn::GroupNorm& layer,
                                               const std::string& act, const Tensor& shift) {
  const auto& o = layer->options;
  if ((act == "swish" || act == "silu") && x.scalar_type() == at::kFloat && o.affine())
    return group_norm_silu_and_input(x, o.num_groups(), layer->weight, layer->bias, o.eps(), shift);
  const Tensor z = add_channel_shift(x, shift.defined() ? shift.to(x.scalar_type()) : shift);
  return {activation(group_norm_fp32(z, layer), act), x};
}

Tensor group_norm_act(const Tensor& x, const torch::nn::GroupNorm& layer, const std::string& act, const Tensor& shift) {
  return group_norm_act_and_input(x, layer, act, shift)[0];
}

Tensor masked_mean(const Tensor& x, const Tensor& mask) {
  DEW_CHECK(x.dim() == 3, "masked_mean: x must be [B, L, D], got ", x.sizes());
  const Tensor xf = x.to(at::kFloat);
  if (!mask.defined()) return xf.mean(1);
  DEW_CHECK(mask.dim() == 2 && mask.size(0) == x.size(0) && mask.size(1) == x.size(1), "masked_mean: mask must be [",
            x.size(0), ", ", x.size(1), "], got ", mask.sizes());
  const Tensor m = mask.to(at::kFloat).unsqueeze(-1);  // [B, L, 1]
  return (xf * m).sum(1) / m.sum(1).clamp_min(1.0);
}

// ---- TimeEmbedding ----

TimeEmbeddingImpl::TimeEmbeddingImpl(TimeEmbeddingOptions options_) : options(std::move(options_)) {
  DEW_CHECK(options.features() > 0 && options.features() % 2 == 0, "TimeEmbedding: features must be even and > 0, got ",
            options.features());
  reset();
}

void TimeEmbeddingImpl::reset() {
  const int64_t f = options.features();
  fourier = register_module("fourier", FourierFeatures(FourierFeaturesOptions(f).scale(options.scale())));
  linear_1 = register_module("linear_1", torch::nn::Linear(f, f));
  linear_2 = register_module("linear_2", torch::nn::Linear(f, f));
  reset_parameters();
}

void TimeEmbeddingImpl::reset_parameters() {
  // N(0, 0.02) weights as DiT's timestep embedder.
  torch::NoGradGuard no_grad;
  for (auto* l : {&linear_1, &linear_2}) {
    (*l)->weight.normal_(0.0, 0.02);
    (*l)->bias.zero_();
  }
}

Tensor TimeEmbeddingImpl::forward(const Tensor& t, at::ScalarType dtype) {
  Tensor f = fourier(t).to(dtype);                       // [B, F]
  return dense(at::silu(dense(f, linear_1)), linear_2);  // [B, F]
}

// ---- Mlp ----

MlpImpl::MlpImpl(MlpOptions options_) : options(std::move(options_)) {
  DEW_CHECK(options.dim() > 0 && options.hidden() > 0, "Mlp: dim and hidden must be > 0, got ", options.dim(), " and ",
            options.hidden());
  activation(at::zeros({1}), options.activation());  // validates the name now, not at the first forward
  DEW_CHECK(options.dropout() >= 0 && options.dropout() < 1, "Mlp: dropout must be in [0, 1), got ", options.dropout());
  reset();
}

void MlpImpl::reset() {
  fc1 = register_module("fc1", torch::nn::Linear(options.dim(), options.hidden()));
  fc2 = register_module("fc2", torch::nn::Linear(options.hidden(), options.dim()));
  reset_parameters();
}

void MlpImpl::reset_parameters() {
  torch::NoGradGuard no_grad;
  for (auto* l : {&fc1, &fc2}) {
    torch::nn::init::xavier_uniform_((*l)->weight);
    (*l)->bias.zero_();
  }
}

Tensor MlpImpl::forward(const Tensor& x) {
  Tensor h = torch::dropout(activation(dense(x, fc1), options.activation()), options.dropout(), is_training());
  return torch::dropout(dense(h, fc2), options.dropout(), is_training());
}

// ---- DiTBlock ----

DiTBlockImpl::DiTBlockImpl(DiTBlockOptions options_) : options(std::move(options_)) {
  DEW_CHECK(options.mlp_ratio() > 0, "DiTBlock: mlp_ratio must be > 0, got ", options.mlp_ratio());
  DEW_CHECK(options.norm_eps() > 0, "DiTBlock: norm_eps must be > 0, got ", options.norm_eps());
  reset();
}

void DiTBlockImpl::reset() {
  const int64_t d = options.dim();
  adaLN_modulation = register_module("adaLN_modulation", torch::nn::Linear(d, 6 * d));
  attn = register_module("attn", SelfAttention(SelfAttentionOptions(d, options.num_heads())
                                                   .qk_norm(options.qk_norm() ? "rms" : "none")
                                                   .norm_eps(1e-6)
                                                   .impl(options.attention_impl())
                                                   .force_fp32_for_softmax(options.force_fp32_for_softmax())
                                                   .dropout(options.dropout())));
  const auto hidden = static_cast<int64_t>(options.mlp_ratio() * static_cast<double>(d));
  mlp = register_module("mlp", Mlp(MlpOptions(d, hidden).activation("gelu_tanh").dropout(options.dropout())));
  reset_parameters();
}

void DiTBlockImpl::reset_parameters() {
  // adaLN-Zero: all gates start at 0, so the block starts as the identity.
  torch::NoGradGuard no_grad;
  adaLN_modulation->weight.zero_();
  adaLN_modulation->bias.zero_();
}

Tensor DiTBlockImpl::forward(const Tensor& x, const Tensor& c, const Rope& rope) {
  DEW_CHECK(x.dim() == 3 && c.dim() == 2 && c.size(0) == x.size(0) && c.size(1) == x.size(2),
            "DiTBlock: x must be [B, S, D] and c [B, D], got ", x.sizes(), " and ", c.sizes());
  auto m = dense(at::silu(c.to(x.scalar_type())), adaLN_modulation).chunk(6, 1);  // 6 x [B, D]
  const Tensor &shift_msa = m[0], &scale_msa = m[1], &gate_msa = m[2];
  const Tensor &shift_mlp = m[3], &scale_mlp = m[4], &gate_mlp = m[5];
  const double eps = options.norm_eps();
  Tensor h = x + gate_msa.unsqueeze(1) * attn(modulate(layer_norm_fp32(x, eps), shift_msa, scale_msa), rope);
  return h + gate_mlp.unsqueeze(1) * mlp(modulate(layer_norm_fp32(h, eps), shift_mlp, scale_mlp));
}

// ---- FinalLayer ----

FinalLayerImpl::FinalLayerImpl(FinalLayerOptions options_) : options(std::move(options_)) {
  DEW_CHECK(options.dim() > 0 && options.out_features() > 0, "FinalLayer: dim and out_features must be > 0, got ",
            options.dim(), " and ", options.out_features());
  reset();
}

void FinalLayerImpl::reset() {
  adaLN_modulation = register_module("adaLN_modulation", torch::nn::Linear(options.dim(), 2 * options.dim()));
  linear = register_module("linear", torch::nn::Linear(options.dim(), options.out_features()));
  reset_parameters();
}

void FinalLayerImpl::reset_parameters() {
  // Zero output at initialisation (DiT): the model starts by predicting 0.
  torch::NoGradGuard no_grad;
  for (auto* l : {&adaLN_modulation, &linear}) {
    (*l)->weight.zero_();
    (*l)->bias.zero_();
  }
}

Tensor FinalLayerImpl::forward(const Tensor& x, const Tensor& c) {
  auto m = dense(at::silu(c.to(x.scalar_type())), adaLN_modulation).chunk(2, 1);  // shift, scale: [B, D]
  return dense(modulate(layer_norm_fp32(x, options.norm_eps()), m[0], m[1]), linear);
}

// ---- ResBlock ----

ResBlockImpl::ResBlockImpl(ResBlockOptions options_) : options(std::move(options_)) {
  const auto& o = options;
  DEW_CHECK(o.in_channels() > 0 && o.out_channels() > 0 && o.emb_features() >= 0,
            "ResBlock: channels and emb_features must be > 0, got ", o.in_channels(), ", ", o.out_channels(), ", ",
            o.emb_features());
  DEW_CHECK(o.norm_groups() > 0 && o.in_channels() % o.norm_groups() == 0 && o.out_channels() % o.norm_groups() == 0,
            "ResBlock: norm_groups must divide the channels (", o.in_channels(), " -> ", o.out_channels(), "), got ",
            o.norm_groups());
  activation(at::zeros({1}), o.activation());
  DEW_CHECK(o.dropout() >= 0 && o.dropout() < 1, "ResBlock: dropout must be in [0, 1), got ", o.dropout());
  reset();
}

void ResBlockImpl::reset() {
  const auto& o = options;
  auto gn = [&](int64_t ch) {
    return torch::nn::GroupNorm(torch::nn::GroupNormOptions(o.norm_groups(), ch).eps(o.norm_eps()));
  };
  auto conv3 = [](int64_t in, int64_t out) {
    return torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, 3).padding(1));
  };
  norm1 = register_module("norm1", gn(o.in_channels()));
  conv1 = register_module("conv1", conv3(o.in_channels(), o.out_channels()));
  if (o.emb_features() > 0)
    time_emb_proj = register_module("time_emb_proj", torch::nn::Linear(o.emb_features(), o.out_channels()));
  norm2 = register_module("norm2", gn(o.out_channels()));
  conv2 = register_module("conv2", conv3(o.out_channels(), o.out_channels()));
  if (o.in_channels() != o.out_channels())
    conv_shortcut = register_module("conv_shortcut",
                                    torch::nn::Conv2d(torch::nn::Conv2dOptions(o.in_channels(), o.out_channels(), 1)));
  reset_parameters();
}

void ResBlockImpl::reset_parameters() {
  // conv2 starts at zero (ADM's zero_module): the block starts as its skip path.
  if (!options.zero_init()) return;
  torch::NoGradGuard no_grad;
  conv2->weight.zero_();
  conv2->bias.zero_();
}

Tensor ResBlockImpl::forward(const Tensor& x, const Tensor& temb) {
  const auto& o = options;
  const bool timed = o.emb_features() > 0;
  DEW_CHECK(
      x.dim() == 4 && x.size(1) == o.in_channels() &&
          (timed ? temb.defined() && temb.dim() == 2 && temb.size(0) == x.size(0) && temb.size(1) == o.emb_features()
                 : !temb.defined()),
      "ResBlock: x must be [B, ", o.in_channels(), ", H, W] and temb [B, ", o.emb_features(),
      "] (none when emb_features is 0), got ", x.sizes(), " and ",
      temb.defined() ? c10::str(temb.sizes()) : std::string("none"));
  // norm1 also passes x through for the skip path: its backward then sums x's two gradients in one pass
  const auto [a, skip] = group_norm_act_and_input(x, norm1, o.activation());
  Tensor h = conv(a, conv1);  // [B, out, H, W]
  Tensor t = timed ? dense(activation(temb.to(x.scalar_type()), o.activation()), time_emb_proj) : Tensor();  // [B, out]
  // norm2 of h + t (t broadcast over the positions), with the addition folded into the norm's pass
  h = torch::dropout(group_norm_act(h, norm2, o.activation(), t), o.dropout(), is_training());
  h = conv(h, conv2);
  return (conv_shortcut.is_empty() ? skip : conv(skip, conv_shortcut)) + h;
}

// ---- remat ----

namespace {

// Swaps the default generator of `device` to `state` for its lifetime, then restores the previous state,
// so the recomputation draws what the forward drew without disturbing the stream afterwards.
class RngReplay {
 public:
  RngReplay(const at::Device& device, const Tensor& state) {
    if (!state.defined()) return;
    gen_ = at::globalContext().defaultGenerator(device);
    std::lock_guard<std::mutex> lock(gen_.mutex());
    saved_ = gen_.get_state();
    gen_.set_state(state);
  }
  ~RngReplay() {
    if (!saved_.defined()) return;
    std::lock_guard<std::mutex> lock(gen_.mutex());
    gen_.set_state(saved_);
  }

 private:
  at::Generator gen_;
  Tensor saved_;
};

// The backward node of a remat segment: recomputes fn from the saved inputs with grad enabled and
// back-propagates the incoming gradients through the recomputed graph.
struct RematBackward : torch::autograd::Node {
  RematFn fn;
  std::vector<Tensor> inputs;  // detached aliases: they share the version counter of the originals
  std::vector<int64_t> versions;
  std::vector<bool> needs_grad;
  std::vector<Tensor> params;
  at::Device device{at::kCPU};
  Tensor rng_state;
  bool released = false;

  std::string name() const override { return "dew::nn::RematBackward"; }

  void release_variables() override {
    inputs.clear();
    params.clear();
    fn = nullptr;
    released = true;
  }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    DEW_CHECK(!released,
              "remat: backward through the same graph a second time (retain_graph is not supported "
              "under remat)");
    for (size_t i = 0; i < inputs.size(); ++i)
      DEW_CHECK(inputs[i]._version() == versions[i], "remat: input ", i,
                " was modified in place after the forward; the recomputation would differ");
    std::vector<Tensor> in(inputs.size());
    for (size_t i = 0; i < inputs.size(); ++i)
      in[i] = needs_grad[i] ? inputs[i].detach().requires_grad_(true) : inputs[i];
    std::vector<Tensor> outs;
    {
      RngReplay replay(device, rng_state);
      torch::AutoGradMode enable(true);
      outs = fn(in);
    }
    DEW_CHECK(outs.size() == grads.size(), "remat: the recomputation returned ", outs.size(), " outputs, the forward ",
              grads.size());
    std::vector<Tensor> o, g;
    for (size_t i = 0; i < outs.size(); ++i) {
      if (grads[i].defined() && outs[i].requires_grad()) {
        o.push_back(outs[i]);
        g.push_back(grads[i]);
      }
    }
    std::vector<Tensor> targets;
    std::vector<size_t> slot;  // position of each target in the result (inputs first, then params)
    for (size_t i = 0; i < in.size(); ++i)
      if (needs_grad[i]) targets.push_back(in[i]), slot.push_back(i);
    for (size_t j = 0; j < params.size(); ++j)
      if (params[j].requires_grad()) targets.push_back(params[j]), slot.push_back(in.size() + j);
    torch::autograd::variable_list result(in.size() + params.size());
    if (!o.empty() && !targets.empty()) {
      auto gs = torch::autograd::grad(o, targets, g, /*retain_graph=*/false, /*create_graph=*/false,
                                      /*allow_unused=*/true);
      for (size_t k = 0; k < gs.size(); ++k) result[slot[k]] = gs[k];
    }
    return result;
  }
};

}  // namespace

std::vector<Tensor> remat(const RematFn& fn, const std::vector<Tensor>& inputs, const std::vector<Tensor>& params) {
  bool any_grad = false;
  for (const auto& t : inputs) {
    DEW_CHECK(t.defined(), "remat: inputs must be defined tensors");
    any_grad |= t.requires_grad();
  }
  for (const auto& p : params) any_grad |= p.requires_grad();
  if (!torch::GradMode::is_enabled() || !any_grad) return fn(inputs);

  auto node = c10::make_intrusive<RematBackward>();
  node->fn = fn;
  for (const auto& t : inputs) {
    node->inputs.push_back(t.detach());
    node->versions.push_back(t._version());
    node->needs_grad.push_back(t.requires_grad());
  }
  node->params = params;
  if (!inputs.empty()) {
    node->device = inputs[0].device();
    if (node->device.is_cpu() || node->device.is_cuda()) {
      at::Generator gen = at::globalContext().defaultGenerator(node->device);
      std::lock_guard<std::mutex> lock(gen.mutex());
      node->rng_state = gen.get_state();
    }
  }
  std::vector<Tensor> all(inputs);
  all.insert(all.end(), params.begin(), params.end());
  node->set_next_edges(torch::autograd::collect_next_edges(all));

  std::vector<Tensor> outs;
  {
    torch::NoGradGuard no_grad;
    outs = fn(inputs);
  }
  for (auto& out : outs) {
    DEW_CHECK(out.defined() && at::isFloatingType(out.scalar_type()), "remat: outputs must be floating point tensors");
    // A view or an input passed through would carry someone else's history: give it its own storage.
    bool aliased = out.is_view();
    for (const auto& t : inputs) aliased |= out.is_alias_of(t);
    if (aliased) out = out.clone();
    torch::autograd::create_gradient_edge(out, node);
  }
  return outs;
}

Tensor remat(const torch::nn::Module& block, const std::function<Tensor(const std::vector<Tensor>&)>& fn,
             const std::vector<Tensor>& inputs) {
  RematFn wrapped = [fn](const std::vector<Tensor>& in) { return std::vector<Tensor>{fn(in)}; };
  return remat(wrapped, inputs, block.parameters())[0];
}

}  // namespace dew::nn

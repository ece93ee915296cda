#include "dew/nn/backbones/hybrid_dit.h"

#include <algorithm>
#include <cctype>

#include "dew/core/error.h"
#include "dew/nn/attention.h"

namespace dew::nn {

using at::Tensor;

// ---- SSMDiTBlock ----

SSMDiTBlockImpl::SSMDiTBlockImpl(SSMDiTBlockOptions options_) : options(std::move(options_)) {
  DEW_CHECK(options.mlp_ratio() > 0, "SSMDiTBlock: mlp_ratio must be > 0, got ", options.mlp_ratio());
  DEW_CHECK(options.norm_eps() > 0, "SSMDiTBlock: norm_eps must be > 0, got ", options.norm_eps());
  reset();
}

void SSMDiTBlockImpl::reset() {
  const int64_t d = options.dim();
  adaLN_modulation = register_module("adaLN_modulation", torch::nn::Linear(d, 6 * d));
  ssm = register_module("ssm", S5(S5Options(d, options.state_dim()).bidirectional(options.bidirectional())));
  if (options.use_2d_fusion()) spatial_fusion = register_module("spatial_fusion", SpatialFusion(d));
  const auto hidden = static_cast<int64_t>(options.mlp_ratio() * static_cast<double>(d));
  mlp = register_module("mlp", Mlp(MlpOptions(d, hidden).activation("gelu_tanh").dropout(options.dropout())));
  reset_parameters();
}

void SSMDiTBlockImpl::reset_parameters() {
  // adaLN-Zero, as DiTBlock: both gates start at 0, so the block starts as the identity.
  torch::NoGradGuard no_grad;
  adaLN_modulation->weight.zero_();
  adaLN_modulation->bias.zero_();
}

Tensor SSMDiTBlockImpl::forward(const Tensor& x, const Tensor& c, int64_t h, int64_t w, const Tensor& perm,
                                const Tensor& inverse) {
  DEW_CHECK(x.dim() == 3 && c.dim() == 2 && c.size(0) == x.size(0) && c.size(1) == x.size(2),
            "SSMDiTBlock: x must be [B, S, D] and c [B, D], got ", x.sizes(), " and ", c.sizes());
  auto m = dense(at::silu(c.to(x.scalar_type())), adaLN_modulation).chunk(6, 1);  // 6 x [B, D]
  const Tensor &shift_msa = m[0], &scale_msa = m[1], &gate_msa = m[2];
  const Tensor &shift_mlp = m[3], &scale_mlp = m[4], &gate_mlp = m[5];
  const double eps = options.norm_eps();
  Tensor y = ssm(modulate(layer_norm_fp32(x, eps), shift_msa, scale_msa));
  if (!spatial_fusion.is_empty()) y = spatial_fusion(y, h, w, perm, inverse);
  Tensor out = x + gate_msa.unsqueeze(1) * y;
  return out + gate_mlp.unsqueeze(1) * mlp(modulate(layer_norm_fp32(out, eps), shift_mlp, scale_mlp));
}

// ---- the layer pattern ----

namespace {

// "N:M" with non-negative integers N, M, not both zero.
bool parse_ratio(const std::string& s, int64_t& n_ssm, int64_t& n_attn) {
  const auto colon = s.find(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == s.size()) return false;
  auto digits = [](const std::string& t) {
    if (t.empty() || t.size() > 6) return false;
    for (char ch : t)
      if (!std::isdigit(static_cast<unsigned char>(ch))) return false;
    return true;
  };
  const std::string a = s.substr(0, colon), b = s.substr(colon + 1);
  if (!digits(a) || !digits(b)) return false;
  n_ssm = std::stoll(a);
  n_attn = std::stoll(b);
  return n_ssm + n_attn > 0;
}

}  // namespace

std::vector<std::string> hybrid_block_pattern(const HybridDiTOptions& o) {
  const int64_t layers = o.num_layers();
  const std::string& ratio = o.ssm_attention_ratio();
  int64_t n_ssm = 0, n_attn = 0;
  const bool named = ratio == "all-ssm" || ratio == "all-attn";
  DEW_CHECK(named || parse_ratio(ratio, n_ssm, n_attn),
            "hybrid_dit: ssm_attention_ratio must be \"N:M\" (N SSM blocks then M attention blocks, e.g. \"3:1\"), "
            "\"all-ssm\" or \"all-attn\", got \"",
            ratio, "\"");
  if (!o.block_pattern().empty()) {
    DEW_CHECK(ratio == "3:1", "hybrid_dit: block_pattern and ssm_attention_ratio \"", ratio,
              "\" both name the layers' mixers; set one, not both");
    DEW_CHECK(static_cast<int64_t>(o.block_pattern().size()) == layers, "hybrid_dit: block_pattern must name ", layers,
              " layers (num_layers), got ", o.block_pattern().size());
    for (size_t i = 0; i < o.block_pattern().size(); ++i) {
      const std::string& k = o.block_pattern()[i];
      DEW_CHECK(k == "ssm" || k == "attn", "hybrid_dit: block_pattern[", i, "] must be \"ssm\" or \"attn\", got \"", k,
                "\"");
    }
    return o.block_pattern();
  }
  std::vector<std::string> out;
  out.reserve(static_cast<size_t>(std::max<int64_t>(layers, 0)));
  for (int64_t i = 0; i < layers; ++i) {
    if (ratio == "all-ssm") out.push_back("ssm");
    else if (ratio == "all-attn") out.push_back("attn");
    else out.push_back(i % (n_ssm + n_attn) < n_ssm ? "ssm" : "attn");
  }
  return out;
}

// ---- HybridDiT ----

namespace {

// Validates the hybrid fields before SimpleDiT builds the stem, and hands it its own fields.
SimpleDiTOptions checked(const HybridDiTOptions& o) {
  DEW_CHECK(o.ssm_state_dim() > 0, "hybrid_dit: ssm_state_dim must be > 0, got ", o.ssm_state_dim());
  DEW_CHECK(o.num_layers() > 0, "hybrid_dit: num_layers must be > 0, got ", o.num_layers());
  hybrid_block_pattern(o);
  return o;
}

}  // namespace

HybridDiTImpl::HybridDiTImpl(HybridDiTOptions options_)
    : SimpleDiTImpl(checked(options_), "hybrid_dit", /*build_blocks=*/false),
      hybrid_options(std::move(options_)),
      pattern_(hybrid_block_pattern(hybrid_options)) {
  const auto& o = hybrid_options;
  blocks = register_module("blocks", torch::nn::ModuleList());
  attn_list.assign(pattern_.size(), DiTBlock{nullptr});
  ssm_list.assign(pattern_.size(), SSMDiTBlock{nullptr});
  for (size_t i = 0; i < pattern_.size(); ++i) {
    if (pattern_[i] == "attn") {
      attn_list[i] = make_block();
      blocks->push_back(attn_list[i]);
    } else {
      ssm_list[i] = SSMDiTBlock(SSMDiTBlockOptions(o.emb_features(), o.ssm_state_dim())
                                    .mlp_ratio(o.mlp_ratio())
                                    .dropout(o.dropout_rate())
                                    .norm_eps(o.norm_epsilon())
                                    .bidirectional(o.bidirectional_ssm())
                                    .use_2d_fusion(o.use_2d_fusion()));
      blocks->push_back(ssm_list[i]);
    }
  }
}

Tensor HybridDiTImpl::forward(const Tensor& x, const Tensor& time, const Conditioning& cond) {
  cond.check_inputs("hybrid_dit", /*takes_pooled=*/false);
  Grid g;
  Tensor h = embed(x, g);
  const Tensor c = condition(time.to(x.device()), cond, x.size(0));  // [B, D]
  // The 2D fusion places scan-ordered tokens back on the grid; raster order needs no permutation.
  Tensor perm, inverse;
  if (hybrid_options.use_2d_fusion() && !g.scan.is_raster()) {
    perm = g.perm;
    inverse = g.scan.inverse.to(x.device());
  }
  const int64_t gh = g.h, gw = g.w;
  for (size_t i = 0; i < pattern_.size(); ++i) {
    if (!attn_list[i].is_empty()) {
      h = run_block(attn_list[i], h, c, g.rope);
    } else if (hybrid_options.remat()) {
      // Captured by value: backward runs the function after this frame is gone.
      SSMDiTBlock block = ssm_list[i];
      h = remat(*block,
                [block, gh, gw, perm, inverse](const std::vector<Tensor>& in) mutable {
                  return block(in[0], in[1], gh, gw, perm, inverse);
                },
                {h, c});
    } else {
      h = ssm_list[i](h, c, gh, gw, perm, inverse);
    }
  }
  return output(h, c, g);
}

}  // namespace dew::nn

#include "dew/nn/backbones/hierarchical_mmdit.h"

#include "dew/core/error.h"
#include "dew/nn/backbones/dit_common.h"

namespace dew::nn {

using at::Tensor;

Tensor merge_2x2(const Tensor& x, int64_t h, int64_t w) {
  DEW_CHECK(x.dim() == 3 && x.size(1) == h * w && h % 2 == 0 && w % 2 == 0, "merge_2x2: x must be [B, ", h, " * ", w,
            ", C] with even sides, got ", x.sizes());
  const int64_t B = x.size(0), C = x.size(2);
  // [B, h/2, 2 (p1), w/2, 2 (p2), C] -> [B, h/2, w/2, p1, p2, C]
  return x.view({B, h / 2, 2, w / 2, 2, C}).permute({0, 1, 3, 2, 4, 5}).reshape({B, (h / 2) * (w / 2), 4 * C});
}

Tensor expand_2x2(const Tensor& x, int64_t h, int64_t w) {
  DEW_CHECK(x.dim() == 3 && x.size(1) == h * w && x.size(2) % 4 == 0, "expand_2x2: x must be [B, ", h, " * ", w,
            ", 4C], got ", x.sizes());
  const int64_t B = x.size(0), C = x.size(2) / 4;
  // [B, h, w, p1, p2, C] -> [B, h, p1, w, p2, C]
  return x.view({B, h, w, 2, 2, C}).permute({0, 1, 3, 2, 4, 5}).reshape({B, 4 * h * w, C});
}

HierarchicalMMDiTImpl::HierarchicalMMDiTImpl(HierarchicalMMDiTOptions options_) : options(std::move(options_)) {
  const auto& o = options;
  const std::string w = "hierarchical_mmdit";
  const auto &D = o.emb_features(), &NL = o.num_layers(), &NH = o.num_heads();
  DEW_CHECK(!D.empty(), w, ": emb_features must name at least one stage");
  DEW_CHECK(NL.size() == D.size() && NH.size() == D.size(), w,
            ": emb_features, num_layers and num_heads must have one entry per stage, got ", D.size(), ", ", NL.size(),
            " and ", NH.size(), " entries");
  const size_t S = D.size();
  for (size_t s = 0; s < S; ++s) {
    DEW_CHECK(NH[s] > 0, w, ": num_heads[", s, "] must be > 0, got ", NH[s]);
    DEW_CHECK(D[s] > 0 && D[s] % NH[s] == 0 && (D[s] / NH[s]) % 2 == 0, w, ": emb_features[", s, "] / num_heads[", s,
              "] must be an even integer, got ", D[s], " / ", NH[s]);
    if (s + 1 < S) {
      DEW_CHECK(NL[s] > 0 && NL[s] % 2 == 0, w, ": num_layers[", s,
                "] must be even and > 0 (half on the down path, half on the up path), got ", NL[s]);
    } else {
      DEW_CHECK(NL[s] > 0, w, ": num_layers[", s, "] (the deepest stage) must be > 0, got ", NL[s]);
    }
  }
  DEW_CHECK(D[0] % 4 == 0, w, ": emb_features[0] must be a multiple of 4 (2D sin-cos table), got ", D[0]);
  DEW_CHECK(o.base_patch_size() > 0, w, ": base_patch_size must be > 0, got ", o.base_patch_size());
  check_channel_fields(o, w);
  check_block_fields(o, w);
  DEW_CHECK(o.context_features() > 0, w,
            ": context_features must be > 0 (the model attends jointly over text and image tokens and cannot "
            "run without text), got ",
            o.context_features());
  DEW_CHECK(o.scan_order() == "raster", w,
            ": scan_order must be raster (2x2 patch merging groups grid neighbours of the raster layout), got \"",
            o.scan_order(), "\"");
  dtype_ = checked_compute_fields(o, w);
  reset();
}

void HierarchicalMMDiTImpl::reset() {
  const auto& o = options;
  const auto &D = o.emb_features(), &NL = o.num_layers(), &NH = o.num_heads();
  const int64_t S = stages(), p = o.base_patch_size(), top = D.back();
  auto block = [&](int64_t s, bool pre_only) {
    return MMDiTBlock(dit_block_options<MMDiTBlockOptions>(o, D[s], NH[s]).context_pre_only(pre_only));
  };
  // A stack of n blocks whose text output is discarded after the last one.
  auto stack = [&](int64_t s, int64_t n, torch::nn::ModuleList& list, std::vector<MMDiTBlock>& typed) {
    for (int64_t i = 0; i < n; ++i) {
      MMDiTBlock b = block(s, i + 1 == n);
      list->push_back(b);
      typed.push_back(b);
    }
  };
  auto linear = [](int64_t in, int64_t out, torch::nn::ModuleList& list, std::vector<torch::nn::Linear>& typed) {
    torch::nn::Linear l(in, out);
    list->push_back(l);
    typed.push_back(l);
  };

  x_embedder = register_module("x_embedder", patch_embedder(o.in_channels(), D[0], p));
  t_embedder = register_module("t_embedder", TimeEmbedding(top));
  if (o.num_classes() > 0) y_embedder = register_module("y_embedder", label_embedder(o.num_classes(), top));
  pooled_text_embedder = register_module("pooled_text_embedder", torch::nn::Linear(o.context_features(), top));

  cond_projections = register_module("cond_projections", torch::nn::ModuleList());
  context_embedders = register_module("context_embedders", torch::nn::ModuleList());
  down_blocks = register_module("down_blocks", torch::nn::ModuleList());
  merges = register_module("merges", torch::nn::ModuleList());
  mid_blocks = register_module("mid_blocks", torch::nn::ModuleList());
  expands = register_module("expands", torch::nn::ModuleList());
  fusions = register_module("fusions", torch::nn::ModuleList());
  up_blocks = register_module("up_blocks", torch::nn::ModuleList());
  cond_list.clear(), context_list.clear(), merge_list.clear(), expand_list.clear(), fusion_list.clear();
  down_list.assign(S - 1, {});
  up_list.assign(S - 1, {});
  mid_list.clear();

  for (int64_t s = 0; s < S; ++s) linear(o.context_features(), D[s], context_embedders, context_list);
  for (int64_t s = 0; s + 1 < S; ++s) {
    linear(top, D[s], cond_projections, cond_list);
    torch::nn::ModuleList down, up;
    stack(s, NL[s] / 2, down, down_list[s]);
    stack(s, NL[s] / 2, up, up_list[s]);
    down_blocks->push_back(down);
    up_blocks->push_back(up);
    linear(4 * D[s], D[s + 1], merges, merge_list);
    linear(D[s + 1], 4 * D[s], expands, expand_list);
    linear(2 * D[s], D[s], fusions, fusion_list);
  }
  stack(S - 1, NL[S - 1], mid_blocks, mid_list);
  final_layer = register_module(
      "final_layer", FinalLayer(FinalLayerOptions(D[0], p * p * o.output_channels()).norm_eps(o.norm_epsilon())));
  reset_parameters();
}

void HierarchicalMMDiTImpl::reset_parameters() {
  // DiT's initialisation for the embeddings, xavier-uniform dense layers with zero biases; the blocks and the
  // final layer initialise themselves (adaLN-Zero, zero output).
  std::vector<torch::nn::Linear> dense_layers{pooled_text_embedder};
  for (const auto* list : {&cond_list, &context_list, &merge_list, &expand_list, &fusion_list})
    dense_layers.insert(dense_layers.end(), list->begin(), list->end());
  init_dit_embedders(x_embedder, y_embedder, dense_layers);
}

Tensor HierarchicalMMDiTImpl::forward(const Tensor& x, const Tensor& time, const Conditioning& cond) {
  cond.check_inputs("hierarchical_mmdit", /*takes_pooled=*/false);
  const auto& o = options;
  const int64_t S = stages(), p = o.base_patch_size(), unit = p << (S - 1);
  DEW_CHECK(x.dim() == 4 && x.size(1) == o.in_channels(), "hierarchical_mmdit: x must be [B, ", o.in_channels(),
            ", H, W], got ", x.sizes());
  DEW_CHECK(x.size(2) % unit == 0 && x.size(3) % unit == 0,
            "hierarchical_mmdit: H and W must be multiples of base_patch_size * 2^(stages - 1) = ", p, " * ",
            (1 << (S - 1)), " = ", unit, ", got ", x.size(2), " x ", x.size(3));
  const int64_t B = x.size(0);
  const Tensor mask = checked_text_mask(cond, B, o.context_features(), "hierarchical_mmdit");
  int64_t gh = x.size(2) / p, gw = x.size(3) / p;
  const Grid g = grid(gh, gw, x.device());

  const Tensor c_top = mmdit_condition(t_embedder, y_embedder, pooled_text_embedder, o.num_classes(),
                                       time.to(x.device()), cond, mask, B, dtype_, "hierarchical_mmdit");
  const Tensor context = cond.context.to(dtype_);
  auto c_of = [&](int64_t s) { return s + 1 == S ? c_top : dense(c_top, cond_list[s]); };  // [B, D_s]
  auto text_of = [&](int64_t s) { return dense(context, context_list[s]); };               // [B, L, D_s]

  Tensor h = conv(x.to(dtype_), x_embedder).flatten(2).transpose(1, 2) + g.pos.to(dtype_);  // [B, N_0, D_0]
  std::vector<Tensor> skips, conds(S);
  for (int64_t s = 0; s < S; ++s) conds[s] = c_of(s);
  for (int64_t s = 0; s + 1 < S; ++s) {
    h = run_mmdit_blocks(down_list[s], h, text_of(s), conds[s], g.ropes[s], mask, o.remat());
    skips.push_back(h);
    h = dense(merge_2x2(h, gh, gw), merge_list[s]);  // [B, N_{s+1}, D_{s+1}]
    gh /= 2, gw /= 2;
  }
  h = run_mmdit_blocks(mid_list, h, text_of(S - 1), conds[S - 1], g.ropes[S - 1], mask, o.remat());
  for (int64_t s = S - 2; s >= 0; --s) {
    h = expand_2x2(dense(h, expand_list[s]), gh, gw);  // [B, N_s, D_s]
    gh *= 2, gw *= 2;
    h = dense(at::cat({h, skips[s]}, -1), fusion_list[s]);
    h = run_mmdit_blocks(up_list[s], h, text_of(s), conds[s], g.ropes[s], mask, o.remat());
  }
  Tensor out = final_layer(h, conds[0]).to(at::kFloat);  // [B, N_0, p p out], raster
  return unpatchify(out, p, make_scan("raster", gh, gw));
}

HierarchicalMMDiTImpl::Grid HierarchicalMMDiTImpl::grid(int64_t gh, int64_t gw, const at::Device& device) {
  std::lock_guard<std::mutex> lock(grid_mutex_);
  if (grid_.h == gh && grid_.w == gw && grid_.device == device) return grid_;
  const auto &D = options.emb_features(), &NH = options.num_heads();
  Grid g;
  g.h = gh;
  g.w = gw;
  g.device = device;
  g.pos = sincos_2d_table(D[0], gh, gw).to(device);
  for (int64_t s = 0; s < stages(); ++s) {
    const int64_t n = (gh >> s) * (gw >> s);
    g.ropes.push_back(rope_1d(at::arange(n, at::TensorOptions(at::kLong).device(device)), D[s] / NH[s]));
  }
  grid_ = g;
  return g;
}

}  // namespace dew::nn

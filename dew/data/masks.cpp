#include "dew/data/masks.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "dew/core/error.h"

namespace dew::data {

namespace {

double uniform(at::Generator& gen) { return at::rand({1}, gen, at::kDouble).item<double>(); }
int64_t randint(at::Generator& gen, int64_t lo, int64_t hi) {  // [lo, hi)
  return at::randint(lo, hi, {1}, gen, at::kLong).item<int64_t>();
}
// Python's round(): halves to even, as the references' int(round(x)).
int64_t round_half_even(double x) { return int64_t(std::nearbyint(x)); }

struct Block {
  int64_t h, w;
};

// I-JEPA's _sample_block_size: one uniform draw sets both the scale and the aspect ratio.
Block ijepa_block_size(double r, std::pair<double, double> scale, std::pair<double, double> aspect,
                       const TokenGrid& g) {
  const double s = scale.first + r * (scale.second - scale.first);
  const int64_t keep = int64_t(double(g.h * g.w) * s);
  const double ar = aspect.first + r * (aspect.second - aspect.first);
  int64_t h = round_half_even(std::sqrt(double(keep) * ar)), w = round_half_even(std::sqrt(double(keep) / ar));
  while (h >= g.h) --h;
  while (w >= g.w) --w;
  return {h, w};
}

// The smallest block ijepa_block_size gives over every r in [0, 1]. Its sides are step functions of r, and
// not monotone in it (scale and aspect grow together), so the ends alone can miss a 1 x 1 block in the
// middle. Every step edge lies where int(n s) or a rounded side changes; r at each edge and halfway between
// neighbouring edges visits every block the draws can make.
Block smallest_block(std::pair<double, double> scale, std::pair<double, double> aspect, const TokenGrid& g) {
  const double n = double(g.h * g.w), ds = scale.second - scale.first, da = aspect.second - aspect.first;
  std::vector<double> edges{0.0, 1.0};
  auto edge = [&](double r) {
    if (r > 0 && r < 1) edges.push_back(r);
  };
  const int64_t k_lo = int64_t(n * scale.first), k_hi = int64_t(n * scale.second);
  if (ds > 0)
    for (int64_t k = k_lo; k <= k_hi + 1; ++k) edge((double(k) / n - scale.first) / ds);
  if (da > 0)
    for (int64_t k = std::max<int64_t>(k_lo, 1); k <= k_hi; ++k)
      for (int64_t m = 0; m <= std::max(g.h, g.w); ++m) {           // sides are clamped below the grid's
        const double half = (double(m) + 0.5) * (double(m) + 0.5);  // a side's rounding flips at m + 1/2
        edge((half / double(k) - aspect.first) / da);               // h = round(sqrt(k ar))
        edge((double(k) / half - aspect.first) / da);               // w = round(sqrt(k / ar))
      }
  std::sort(edges.begin(), edges.end());
  Block best = ijepa_block_size(0.0, scale, aspect, g);
  auto visit = [&](double r) {
    const Block b = ijepa_block_size(r, scale, aspect, g);
    if (b.h * b.w < best.h * best.w) best = b;
  };
  for (size_t i = 0; i < edges.size(); ++i) {
    visit(edges[i]);
    if (i + 1 < edges.size()) visit(0.5 * (edges[i] + edges[i + 1]));
  }
  return best;
}

void check_range(std::pair<double, double> r, double lo, double hi, const std::string& field) {
  DEW_CHECK(r.first >= lo && r.first <= r.second && r.second <= hi, field, ": must be [min, max] with ", lo,
            " <= min <= max <= ", hi, ", got [", r.first, ", ", r.second, "]");
}

// Rows of one index list per item, truncated to the shortest: [B, K].
at::Tensor collate(const std::vector<std::vector<int64_t>>& rows) {
  size_t k = rows.front().size();
  for (const auto& r : rows) k = std::min(k, r.size());
  at::Tensor out = at::empty({int64_t(rows.size()), int64_t(k)}, at::kLong);
  auto a = out.accessor<int64_t, 2>();
  for (size_t i = 0; i < rows.size(); ++i)
    for (size_t j = 0; j < k; ++j) a[i][j] = rows[i][j];
  return out;
}

}  // namespace

void validate(const MultiBlockOptions& o, const TokenGrid& g, const std::string& where) {
  DEW_CHECK(g.t == 1 && g.h >= 2 && g.w >= 2, where, ": multi-block masks need an image grid of at least 2 x 2, got ",
            g.t, " x ", g.h, " x ", g.w);
  DEW_CHECK(o.targets >= 1, where, ".targets: must be >= 1, got ", o.targets);
  check_range(o.target_scale, 0.0, 1.0, where + ".target_scale");
  check_range(o.context_scale, 0.0, 1.0, where + ".context_scale");
  DEW_CHECK(o.target_aspect.first > 0, where, ".target_aspect: must be positive, got [", o.target_aspect.first, ", ",
            o.target_aspect.second, "]");
  check_range(o.target_aspect, 0.0, 1e9, where + ".target_aspect");
  DEW_CHECK(o.min_keep >= 0, where, ".min_keep: must be >= 0, got ", o.min_keep);
  // Every block the draws can make must keep more than min_keep tokens, or the reference's retry loop never
  // ends.
  const Block t = smallest_block(o.target_scale, o.target_aspect, g);
  DEW_CHECK(t.h * t.w > o.min_keep, where, ".target_scale: the smallest target block (", t.h, " x ", t.w,
            " tokens on a ", g.h, " x ", g.w, " grid) must keep more than min_keep = ", o.min_keep);
  const Block c = smallest_block(o.context_scale, {1.0, 1.0}, g);
  DEW_CHECK(c.h * c.w > o.min_keep, where, ".context_scale: the smallest context block (", c.h, " x ", c.w,
            " tokens on a ", g.h, " x ", g.w, " grid) must keep more than min_keep = ", o.min_keep);
}

void validate(const TubeOptions& o, const TokenGrid& g, const std::string& where) {
  DEW_CHECK(g.h >= 1 && g.w >= 1 && g.t >= 1, where, ": tube masks need a token grid, got ", g.t, " x ", g.h, " x ",
            g.w);
  DEW_CHECK(o.blocks >= 1, where, ".blocks: must be >= 1, got ", o.blocks);
  check_range(o.spatial_scale, 0.0, 1.0, where + ".spatial_scale");
  check_range(o.temporal_scale, 0.0, 1.0, where + ".temporal_scale");
  DEW_CHECK(o.aspect.first > 0 && o.aspect.first <= o.aspect.second, where,
            ".aspect: must be [min, max] with 0 < min <= max, got [", o.aspect.first, ", ", o.aspect.second, "]");
  const int64_t keep = int64_t(double(g.h * g.w) * o.spatial_scale.first);
  for (double ar : {o.aspect.first, o.aspect.second}) {
    const int64_t h = round_half_even(std::sqrt(double(keep) * ar)), w = round_half_even(std::sqrt(double(keep) / ar));
    DEW_CHECK(h >= 1 && w >= 1, where, ".spatial_scale: the smallest tube (", h, " x ", w, " tokens on a ", g.h, " x ",
              g.w, " grid) is empty");
  }
  // A tube that can span the whole clip leaves no context in any redraw, so the sampler's loop would never
  // end: refuse sizes whose largest tube fills every frame of every token.
  const int64_t k_max = int64_t(double(g.h * g.w) * o.spatial_scale.second);
  const double full_h = (double(g.h) - 0.5) * (double(g.h) - 0.5), full_w = (double(g.w) - 0.5) * (double(g.w) - 0.5);
  const bool fills_frame = k_max > 0 && std::max(o.aspect.first, full_h / double(k_max)) <=
                                            std::min(o.aspect.second, double(k_max) / full_w);
  const bool spans_clip = std::max<int64_t>(1, int64_t(double(g.t) * o.temporal_scale.second)) >= g.t;
  DEW_CHECK(!(fills_frame && spans_clip), where, ".spatial_scale: its largest tube ([", o.spatial_scale.first, ", ",
            o.spatial_scale.second, "] of a ", g.h, " x ", g.w, " grid, aspect [", o.aspect.first, ", ",
            o.aspect.second, "], over ", g.t,
            " frames) can cover every token and leave no context; lower the largest "
            "spatial_scale or temporal_scale");
}

Masks multiblock_masks(const MultiBlockOptions& o, const TokenGrid& g, int64_t batch, at::Generator gen) {
  validate(o, g, "masks");
  DEW_CHECK(batch >= 1, "masks: batch must be >= 1, got ", batch);
  const int64_t n = g.h * g.w;
  // One target size and one context size per batch, as the reference's seeded generator draws them.
  const Block tb = ijepa_block_size(uniform(gen), o.target_scale, o.target_aspect, g);
  const Block cb = ijepa_block_size(uniform(gen), o.context_scale, {1.0, 1.0}, g);

  // _sample_block_mask: a block at a random corner (top in [0, H - h), as the reference's randint), restricted
  // to the acceptable regions; after 20 misses one region fewer is imposed.
  auto sample = [&](const Block& b, const std::vector<std::vector<uint8_t>>* regions,
                    std::vector<uint8_t>* complement) {
    int64_t tries = 0, timeout = 20;
    while (true) {
      const int64_t top = randint(gen, 0, g.h - b.h), left = randint(gen, 0, g.w - b.w);
      std::vector<uint8_t> mask(size_t(n), 0);
      for (int64_t y = top; y < top + b.h; ++y)
        for (int64_t x = left; x < left + b.w; ++x) mask[size_t(y * g.w + x)] = 1;
      if (regions) {
        const int64_t keep_regions = std::max<int64_t>(int64_t(regions->size()) - tries, 0);
        for (int64_t k = 0; k < keep_regions; ++k)
          for (int64_t i = 0; i < n; ++i) mask[size_t(i)] &= (*regions)[size_t(k)][size_t(i)];
      }
      std::vector<int64_t> idx;
      for (int64_t i = 0; i < n; ++i)
        if (mask[size_t(i)]) idx.push_back(i);
      if (int64_t(idx.size()) > o.min_keep) {
        if (complement) {
          complement->assign(size_t(n), 1);
          for (int64_t y = top; y < top + b.h; ++y)
            for (int64_t x = left; x < left + b.w; ++x) (*complement)[size_t(y * g.w + x)] = 0;
        }
        return idx;
      }
      if (--timeout == 0) {
        ++tries;
        timeout = 20;
      }
    }
  };

  std::vector<std::vector<std::vector<int64_t>>> targets(size_t(o.targets));  // [M][B] rows
  std::vector<std::vector<int64_t>> context;
  for (int64_t i = 0; i < batch; ++i) {
    std::vector<std::vector<uint8_t>> complements(size_t(o.targets));
    for (int64_t m = 0; m < o.targets; ++m) targets[size_t(m)].push_back(sample(tb, nullptr, &complements[size_t(m)]));
    context.push_back(sample(cb, o.allow_overlap ? nullptr : &complements, nullptr));
  }
  // The same number of tokens for every item: each row truncated to the batch's smallest (all target blocks
  // share one count).
  size_t kt = size_t(n);
  for (const auto& per_block : targets)
    for (const auto& r : per_block) kt = std::min(kt, r.size());
  std::vector<at::Tensor> blocks;
  for (auto& per_block : targets) {
    for (auto& r : per_block) r.resize(kt);
    blocks.push_back(collate(per_block));
  }
  return {collate(context), at::stack(blocks)};
}

Masks tube_masks(const TubeOptions& o, const TokenGrid& g, int64_t batch, at::Generator gen) {
  validate(o, g, "masks");
  DEW_CHECK(batch >= 1, "masks: batch must be >= 1, got ", batch);
  // _sample_block_size: three draws (length, cross-section, aspect) per batch.
  auto lerp = [&](std::pair<double, double> r) { return r.first + uniform(gen) * (r.second - r.first); };
  const int64_t t = std::max<int64_t>(1, int64_t(double(g.t) * lerp(o.temporal_scale)));
  const int64_t keep = int64_t(double(g.h * g.w) * lerp(o.spatial_scale));
  const double ar = lerp(o.aspect);
  const int64_t h = std::min(round_half_even(std::sqrt(double(keep) * ar)), g.h);
  const int64_t w = std::min(round_half_even(std::sqrt(double(keep) / ar)), g.w);
  const int64_t n = g.tokens();
  std::vector<std::vector<int64_t>> context, target;
  for (int64_t i = 0; i < batch; ++i) {
    while (true) {  // redrawn while the tubes cover every token (an empty context)
      std::vector<uint8_t> visible(size_t(n), 1);
      for (int64_t b = 0; b < o.blocks; ++b) {
        const int64_t top = randint(gen, 0, g.h - h + 1), left = randint(gen, 0, g.w - w + 1);
        const int64_t start = randint(gen, 0, g.t - t + 1);
        for (int64_t f = start; f < start + t; ++f)
          for (int64_t y = top; y < top + h; ++y)
            for (int64_t x = left; x < left + w; ++x) visible[size_t((f * g.h + y) * g.w + x)] = 0;
      }
      std::vector<int64_t> c, p;
      for (int64_t k = 0; k < n; ++k) (visible[size_t(k)] ? c : p).push_back(k);
      if (c.empty()) continue;
      context.push_back(std::move(c));
      target.push_back(std::move(p));
      break;
    }
  }
  return {collate(context), collate(target).unsqueeze(0)};
}

}  // namespace dew::data

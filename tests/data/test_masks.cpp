// JEPA masks: the geometry I-JEPA's MaskCollator and V-JEPA's multi-block 3D collator promise, over many
// draws, and reproducibility from the generator.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <random>
#include <set>

#include "dew/core/rng.h"
#include "dew/data/masks.h"
#include "tests/test_util.h"

namespace {

using dew::data::Masks;

// The bounding box of a set of raster indices on a w-wide grid, and whether the set fills it.
struct Box {
  int64_t h, w;
  bool full;
};
Box box_of(const at::Tensor& idx, int64_t width) {
  int64_t y0 = 1 << 30, y1 = -1, x0 = 1 << 30, x1 = -1;
  auto a = idx.accessor<int64_t, 1>();
  for (int64_t i = 0; i < idx.size(0); ++i) {
    y0 = std::min(y0, a[i] / width), y1 = std::max(y1, a[i] / width);
    x0 = std::min(x0, a[i] % width), x1 = std::max(x1, a[i] % width);
  }
  const int64_t h = y1 - y0 + 1, w = x1 - x0 + 1;
  return {h, w, h * w == idx.size(0)};
}

TEST(Masks, MultiBlockGeometryOverManyDraws) {
  dew::data::MultiBlockOptions o;  // I-JEPA's: 4 targets, scale (0.15, 0.2), aspect (0.75, 1.5), context (0.85, 1)
  const dew::TokenGrid g{1, 14, 14};
  const int64_t B = 8;
  for (int64_t step = 0; step < 60; ++step) {
    const Masks m = dew::data::multiblock_masks(o, g, B, dew::rng::generator(7, step, "masks"));
    ASSERT_EQ(m.targets.dim(), 3);
    ASSERT_EQ(m.targets.size(0), 4);
    ASSERT_EQ(m.targets.size(1), B);
    ASSERT_EQ(m.context.size(0), B);
    EXPECT_GT(m.context.size(1), o.min_keep);
    EXPECT_GT(m.targets.size(2), o.min_keep);
    // One block size per batch: the shortest untruncated block is h x w with h * w within the scale range.
    const int64_t kt = m.targets.size(2);
    EXPECT_LE(kt, int64_t(0.2 * 196) + 8) << "the block area follows the scale (rounding of h and w aside)";
    for (int64_t b = 0; b < B; ++b) {
      std::set<int64_t> ctx;
      auto c = m.context[b];
      for (int64_t i = 0; i < c.size(0); ++i) ctx.insert(c[i].item<int64_t>());
      EXPECT_EQ(int64_t(ctx.size()), c.size(0)) << "context indices are distinct";
      EXPECT_TRUE(c.slice(0, 1).gt(c.slice(0, 0, -1)).all().item<bool>()) << "sorted";
      for (int64_t k = 0; k < 4; ++k) {
        const at::Tensor t = m.targets[k][b];
        EXPECT_GE(t.min().item<int64_t>(), 0);
        EXPECT_LT(t.max().item<int64_t>(), 196);
        for (int64_t i = 0; i < t.size(0); ++i)
          EXPECT_EQ(ctx.count(t[i].item<int64_t>()), 0u) << "context meets a target";
      }
    }
  }
}

TEST(Masks, UntruncatedTargetBlocksHaveTheScaleAndAspect) {
  // With a batch of one nothing is truncated: each target is one full rectangle whose area and aspect come
  // from I-JEPA's size rule (one uniform draw for both), with h, w below the grid side.
  dew::data::MultiBlockOptions o;
  o.min_keep = 2;
  const dew::TokenGrid g{1, 20, 20};
  for (int64_t step = 0; step < 200; ++step) {
    const Masks m = dew::data::multiblock_masks(o, g, 1, dew::rng::generator(3, step, "masks"));
    for (int64_t k = 0; k < 4; ++k) {
      const Box bx = box_of(m.targets[k][0], 20);
      ASSERT_TRUE(bx.full) << "a target is a filled rectangle";
      const double area = double(bx.h * bx.w) / 400.0;
      EXPECT_GE(area, 0.15 * 0.7);  // int() of the token budget and round() of h and w move it a little
      EXPECT_LE(area, 0.2 * 1.3);
      const double aspect = double(bx.h) / double(bx.w);
      EXPECT_GE(aspect, 0.75 / 1.5);
      EXPECT_LE(aspect, 1.5 * 1.5);
      EXPECT_LT(bx.h, 20);
      EXPECT_LT(bx.w, 20);
    }
  }
}

TEST(Masks, TheSameGeneratorDrawsTheSameMasks) {
  dew::data::MultiBlockOptions o;
  const dew::TokenGrid g{1, 7, 7};
  const Masks a = dew::data::multiblock_masks(o, g, 16, dew::rng::generator(1, 5, "objective"));
  const Masks b = dew::data::multiblock_masks(o, g, 16, dew::rng::generator(1, 5, "objective"));
  const Masks c = dew::data::multiblock_masks(o, g, 16, dew::rng::generator(1, 6, "objective"));
  EXPECT_TRUE(a.context.equal(b.context));
  EXPECT_TRUE(a.targets.equal(b.targets));
  EXPECT_FALSE(a.context.sizes() == c.context.sizes() && a.context.equal(c.context) &&
               a.targets.sizes() == c.targets.sizes() && a.targets.equal(c.targets));
}

TEST(Masks, TubesSpanTheFramesAndTheContextIsTheRest) {
  dew::data::TubeOptions o;  // 8 tubes of 15% of a frame, across every frame
  const dew::TokenGrid g{4, 8, 8};
  for (int64_t step = 0; step < 40; ++step) {
    const Masks m = dew::data::tube_masks(o, g, 6, dew::rng::generator(2, step, "masks"));
    ASSERT_EQ(m.targets.size(0), 1);
    for (int64_t b = 0; b < 6; ++b) {
      std::set<int64_t> tgt, ctx;
      for (int64_t i = 0; i < m.targets.size(2); ++i) tgt.insert(m.targets[0][b][i].item<int64_t>());
      for (int64_t i = 0; i < m.context.size(1); ++i) ctx.insert(m.context[b][i].item<int64_t>());
      for (int64_t t : tgt) EXPECT_EQ(ctx.count(t), 0u);
      // temporal scale 1: a hidden token is hidden in every frame (the truncation keeps a prefix, which
      // may cut the last frames, so check the frames of the first one)
      for (int64_t t : tgt)
        if (t < 64 && t + 64 * 3 <= *tgt.rbegin()) {
          EXPECT_EQ(tgt.count(t + 64), 1u) << "tube across frames at " << t;
        }
    }
    EXPECT_GE(m.context.size(1), 1);
    EXPECT_EQ(m.context.size(1) + m.targets.size(2) <= 256, true);
  }
}

// min_keep must hold for every block size the draws can give, not only at the ends of the range: on a 4 x 4
// grid I-JEPA's default target range gives 1 x 2 blocks at both ends and 1 x 1 blocks in the middle, where
// the reference's retry loop would never end. Oracle: I-JEPA's _sample_block_size (int(n s) tokens,
// h = round(sqrt(keep ar)), w = round(sqrt(keep / ar)), each side kept below the grid's) on 100001 draws.
TEST(Masks, MinKeepHoldsForEveryBlockTheDrawsCanMake) {
  auto brute_min = [](std::pair<double, double> scale, std::pair<double, double> aspect, int64_t gh, int64_t gw) {
    int64_t best = gh * gw;
    for (int i = 0; i <= 100000; ++i) {
      const double r = i / 100000.0, s = scale.first + r * (scale.second - scale.first);
      const double ar = aspect.first + r * (aspect.second - aspect.first);
      const int64_t keep = int64_t(double(gh * gw) * s);
      int64_t h = int64_t(std::nearbyint(std::sqrt(double(keep) * ar)));
      int64_t w = int64_t(std::nearbyint(std::sqrt(double(keep) / ar)));
      h = std::min(h, gh - 1), w = std::min(w, gw - 1);
      best = std::min(best, h * w);
    }
    return best;
  };
  dew::data::MultiBlockOptions o;
  o.targets = 1;
  o.min_keep = 1;
  EXPECT_EQ(brute_min(o.target_scale, o.target_aspect, 4, 4), 1);
  EXPECT_NE(dew::test::error_of([&] {
              dew::data::validate(o, {1, 4, 4}, "objective.masks");
            }).find("objective.masks.target_scale: the smallest target block (1 x 1 tokens on a 4 x 4 grid)"),
            std::string::npos);
  // Random ranges: refused exactly when some draw gives a block of min_keep tokens or fewer; every accepted
  // one draws masks (the sampler's loop ends).
  std::mt19937 mt(17);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  int accepted = 0, refused = 0;
  for (int c = 0; c < 300; ++c) {
    const int64_t side = 3 + int64_t(u(mt) * 6);
    const double s0 = 0.05 + 0.3 * u(mt), a0 = 0.3 + 1.2 * u(mt);
    o.target_scale = {s0, s0 + 0.2 * u(mt)};
    o.target_aspect = {a0, a0 + 1.5 * u(mt)};
    o.context_scale = {0.85, 1.0};
    o.min_keep = int64_t(u(mt) * 4);
    const int64_t smallest = std::min(brute_min(o.target_scale, o.target_aspect, side, side),
                                      brute_min(o.context_scale, {1.0, 1.0}, side, side));
    const std::string err = dew::test::error_of([&] { dew::data::validate(o, {1, side, side}, "masks"); });
    EXPECT_EQ(err.empty(), smallest > o.min_keep)
        << "grid " << side << ", scale [" << o.target_scale.first << ", " << o.target_scale.second << "], aspect ["
        << o.target_aspect.first << ", " << o.target_aspect.second << "], min_keep " << o.min_keep << ": " << err;
    if (!err.empty()) {
      ++refused;
      continue;
    }
    ++accepted;
    for (int64_t step = 0; step < 3; ++step)
      dew::data::multiblock_masks(o, {1, side, side}, 4, dew::rng::generator(5, uint64_t(c * 3 + step), "masks"));
  }
  EXPECT_GT(accepted, 50);
  EXPECT_GT(refused, 20);
}

TEST(Masks, OptionsOutOfRangeAreRefusedByName) {
  dew::data::MultiBlockOptions o;
  o.target_scale = {0.3, 0.2};
  EXPECT_NE(dew::test::error_of([&] {
              dew::data::validate(o, {1, 7, 7}, "objective.masks");
            }).find("objective.masks.target_scale: must be [min, max]"),
            std::string::npos);
  o = {};
  o.min_keep = 40;
  EXPECT_NE(dew::test::error_of([&] {
              dew::data::validate(o, {1, 7, 7}, "objective.masks");
            }).find("must keep more than min_keep = 40"),
            std::string::npos);
  dew::data::TubeOptions t;
  t.spatial_scale = {0.001, 0.001};
  EXPECT_NE(dew::test::error_of([&] {
              dew::data::validate(t, {2, 4, 4}, "objective.tubes");
            }).find("objective.tubes.spatial_scale: the smallest tube"),
            std::string::npos);
  // A tube that can fill every frame of the clip would leave no context in any redraw: refused. 0.9 of 16
  // tokens is 14, whose rounded square root is 4, the whole side; the same range over half the frames, or
  // with aspects that cannot make it square, is accepted, and draws.
  t = {};
  t.spatial_scale = {0.5, 0.9};
  EXPECT_NE(dew::test::error_of([&] {
              dew::data::validate(t, {2, 4, 4}, "objective.tubes");
            }).find("objective.tubes.spatial_scale: its largest tube"),
            std::string::npos);
  t.temporal_scale = {0.5, 0.5};
  EXPECT_EQ(dew::test::error_of([&] { dew::data::validate(t, {2, 4, 4}, "objective.tubes"); }), "");
  t.temporal_scale = {1.0, 1.0};
  t.aspect = {1.5, 2.0};
  EXPECT_EQ(dew::test::error_of([&] { dew::data::validate(t, {2, 4, 4}, "objective.tubes"); }), "");
  for (int64_t step = 0; step < 20; ++step)
    EXPECT_GT(dew::data::tube_masks(t, {2, 4, 4}, 3, dew::rng::generator(9, uint64_t(step), "masks")).context.size(1),
              0);
}

}  // namespace

// JEPA masks (docs/jepa.md), drawn as the reference collators draw them, from a generator the caller
// derives from (seed, purpose, step), so a run's masks are reproducible and a resumed run draws the same.
//
//   dew::data::MultiBlockOptions o;                               // I-JEPA: 4 targets, one context block
//   auto m = dew::data::multiblock_masks(o, {1, 7, 7}, 32, gen);  // m.context [32, Kc], m.targets [4, 32, Kt]
//   dew::data::TubeOptions v;                                     // V-JEPA: blocks spanning the frames
//   auto mv = dew::data::tube_masks(v, {4, 8, 8}, 8, gen);        // mv.targets [1, 8, Kt]
#pragma once
#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>

#include <utility>

#include "dew/core/options.h"

namespace dew {

/// The token grid of an encoder (and of the masks drawn over it): frames (1 for images) x rows x columns, tokens in raster order (t, h, w).
struct TokenGrid {
  int64_t t = 1, h = 1, w = 1;
  int64_t tokens() const { return t * h * w; }
};

}  // namespace dew

namespace dew::data {

/// Token indices of a batch's masks: the visible (context) tokens and M target blocks, each row sorted
/// ascending and truncated to the batch's smallest count (so every item keeps the same number of tokens).
struct Masks {
  at::Tensor context;  // [B, Kc] int64
  at::Tensor targets;  // [M, B, Kt] int64
};

/// I-JEPA's MaskCollator (src/masks/multiblock.py): per batch one target block size and one context block
/// size; per item M target blocks and a context block with the targets removed.
struct MultiBlockOptions {
  int64_t targets = 4;
  std::pair<double, double> target_scale{0.15, 0.2};
  std::pair<double, double> target_aspect{0.75, 1.5};
  std::pair<double, double> context_scale{0.85, 1.0};
  int64_t min_keep = 4;
  bool allow_overlap = false;
  template <class V>
  void visit(V& v) {
    v("targets", targets, "target blocks per item");
    v("target_scale", target_scale, "[min, max] area of a target block as a fraction of the grid");
    v("target_aspect", target_aspect, "[min, max] height / width of a target block");
    v("context_scale", context_scale, "[min, max] area of the context block (square)");
    v("min_keep", min_keep, "a block must keep more than this many tokens");
    v("allow_overlap", allow_overlap, "let the context keep target tokens");
  }
};

/// V-JEPA's multi-block 3D masks (src/masks/multiblock3d.py): one target = the union of `blocks` tubes of
/// one size per batch (spanning temporal_scale of the frames); the context is every other token.
struct TubeOptions {
  int64_t blocks = 8;
  std::pair<double, double> spatial_scale{0.15, 0.15};
  std::pair<double, double> temporal_scale{1.0, 1.0};
  std::pair<double, double> aspect{0.75, 1.5};
  template <class V>
  void visit(V& v) {
    v("blocks", blocks, "tubes per target (their union)");
    v("spatial_scale", spatial_scale, "[min, max] tube cross-section as a fraction of a frame");
    v("temporal_scale", temporal_scale, "[min, max] tube length as a fraction of the clip");
    v("aspect", aspect, "[min, max] height / width of a tube");
  }
};

/// dew::Error naming the field (`where`.field) when an option is out of range for `grid`.
void validate(const MultiBlockOptions& o, const TokenGrid& grid, const std::string& where);
void validate(const TubeOptions& o, const TokenGrid& grid, const std::string& where);

/// Masks of `batch` items over an image grid (grid.t == 1). Every draw comes from `gen`.
Masks multiblock_masks(const MultiBlockOptions& o, const TokenGrid& grid, int64_t batch, at::Generator gen);
/// Masks of `batch` clips over a video grid; targets has M = 1.
Masks tube_masks(const TubeOptions& o, const TokenGrid& grid, int64_t batch, at::Generator gen);

}  // namespace dew::data

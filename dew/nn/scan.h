// Scan orders of a token grid and (un)patchify between images and token sequences.
//
//   auto scan = dew::nn::make_scan("hilbert", 16, 16);       // for a 16 x 16 patch grid
//   auto tokens = dew::nn::patchify(x, 2, scan);              // x: [B, C, 32, 32] -> [B, 256, 4 C]
//   auto back = dew::nn::unpatchify(tokens, 2, scan);        // -> [B, C, 32, 32]
//
// Orders: raster (row by row), hilbert (a continuous space-filling curve: the Hilbert curve on
// power-of-two squares, its generalisation "gilbert" on any rectangle), zigzag (boustrophedon: rows
// alternate left-to-right and right-to-left, so consecutive tokens are always neighbours).
#pragma once
#include <ATen/ATen.h>

#include <string>
#include <utility>
#include <vector>

namespace dew::nn {

using at::Tensor;

/// The accepted scan orders: raster, hilbert, zigzag.
const std::vector<std::string>& scan_orders();

/// A scan order of an h x w grid as a permutation of raster indices.
struct Scan {
  std::string order;  // "raster" | "hilbert" | "zigzag"
  int64_t h = 0, w = 0;
  Tensor perm;     // [h*w] int64: perm[n] = raster index (row * w + col) of the n-th token in scan order
  Tensor inverse;  // [h*w] int64: inverse[perm[n]] = n
  bool is_raster() const { return order == "raster"; }
};

/// The (row, col) cells of an h x w grid in `order`; throws dew::Error for an unknown order.
std::vector<std::pair<int64_t, int64_t>> scan_cells(const std::string& order, int64_t h, int64_t w);
/// The scan of an h x w grid in `order` as permutation tensors (CPU).
Scan make_scan(const std::string& order, int64_t h, int64_t w);

/// x: [B, C, H, W] -> [B, N, p*p*C] with N = (H/p)(W/p) tokens in the scan's order; each token holds its
/// patch as (row, col, channel), DiT's layout. H/p and W/p must equal scan.h, scan.w.
Tensor patchify(const Tensor& x, int64_t p, const Scan& scan);
/// The inverse of patchify: tokens [B, N, p*p*C] in the scan's order -> [B, C, scan.h * p, scan.w * p].
Tensor unpatchify(const Tensor& tokens, int64_t p, const Scan& scan);

}  // namespace dew::nn

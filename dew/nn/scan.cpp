#include "dew/nn/scan.h"

#include <cstdlib>

#include "dew/core/error.h"

namespace dew::nn {

namespace {

using Cells = std::vector<std::pair<int64_t, int64_t>>;  // (row, col)

int64_t sgn(int64_t v) { return (v > 0) - (v < 0); }
// Python's floor division: the curve construction relies on it for negative axes.
int64_t floor_half(int64_t v) { return v >= 0 ? v / 2 : -((-v + 1) / 2); }

// Generalised Hilbert curve ("gilbert", J. Cervený, 2018): fills the rectangle spanned by the major axis
// (ax, ay) and minor axis (bx, by) from (x, y); on power-of-two squares it is the Hilbert curve, and on
// other rectangles every step is to a 4-neighbour except at most one diagonal step when both sides are odd.
void gilbert(int64_t x, int64_t y, int64_t ax, int64_t ay, int64_t bx, int64_t by, Cells& out) {
  const int64_t w = std::abs(ax + ay), h = std::abs(bx + by);
  const int64_t dax = sgn(ax), day = sgn(ay), dbx = sgn(bx), dby = sgn(by);
  if (h == 1) {
    for (int64_t i = 0; i < w; ++i, x += dax, y += day) out.emplace_back(y, x);
    return;
  }
  if (w == 1) {
    for (int64_t i = 0; i < h; ++i, x += dbx, y += dby) out.emplace_back(y, x);
    return;
  }
  int64_t ax2 = floor_half(ax), ay2 = floor_half(ay), bx2 = floor_half(bx), by2 = floor_half(by);
  const int64_t w2 = std::abs(ax2 + ay2), h2 = std::abs(bx2 + by2);
  if (2 * w > 3 * h) {
    if ((w2 % 2) && w > 2) ax2 += dax, ay2 += day;  // prefer even steps
    // Long rectangle: split it in two along the major axis.
    gilbert(x, y, ax2, ay2, bx, by, out);
    gilbert(x + ax2, y + ay2, ax - ax2, ay - ay2, bx, by, out);
  } else {
    if ((h2 % 2) && h > 2) bx2 += dbx, by2 += dby;
    // Standard case: up the minor axis, along the major axis, back down.
    gilbert(x, y, bx2, by2, ax2, ay2, out);
    gilbert(x + bx2, y + by2, ax, ay, bx - bx2, by - by2, out);
    gilbert(x + (ax - dax) + (bx2 - dbx), y + (ay - day) + (by2 - dby), -bx2, -by2, -(ax - ax2), -(ay - ay2), out);
  }
}

}  // namespace

const std::vector<std::string>& scan_orders() {
  static const std::vector<std::string> orders{"raster", "hilbert", "zigzag"};
  return orders;
}

std::vector<std::pair<int64_t, int64_t>> scan_cells(const std::string& order, int64_t h, int64_t w) {
  DEW_CHECK(h > 0 && w > 0, "scan order \"", order, "\": grid must be non-empty, got ", h, " x ", w);
  Cells cells;
  cells.reserve(h * w);
  if (order == "raster") {
    for (int64_t r = 0; r < h; ++r)
      for (int64_t c = 0; c < w; ++c) cells.emplace_back(r, c);
  } else if (order == "zigzag") {
    for (int64_t r = 0; r < h; ++r)
      for (int64_t i = 0; i < w; ++i) cells.emplace_back(r, r % 2 ? w - 1 - i : i);
  } else if (order == "hilbert") {
    // x runs along columns, y along rows; start along the longer side.
    if (w >= h) gilbert(0, 0, w, 0, 0, h, cells);
    else gilbert(0, 0, 0, h, w, 0, cells);
  } else {
    fail("scan_order: got \"", order, "\", accepted: raster, hilbert, zigzag");
  }
  return cells;
}

Scan make_scan(const std::string& order, int64_t h, int64_t w) {
  const Cells cells = scan_cells(order, h, w);
  Scan s;
  s.order = order;
  s.h = h;
  s.w = w;
  s.perm = at::empty({h * w}, at::kLong);
  s.inverse = at::full({h * w}, -1, at::kLong);
  auto perm = s.perm.accessor<int64_t, 1>();
  auto inv = s.inverse.accessor<int64_t, 1>();
  for (int64_t n = 0; n < h * w; ++n) {
    const int64_t idx = cells[n].first * w + cells[n].second;
    // A curve that left the grid or visited a cell twice is a bug, not bad input; fail loudly.
    DEW_CHECK(
        cells[n].first >= 0 && cells[n].first < h && cells[n].second >= 0 && cells[n].second < w && inv[idx] == -1,
        "scan order \"", order, "\" is not a permutation of the ", h, " x ", w, " grid");
    perm[n] = idx;
    inv[idx] = n;
  }
  return s;
}

Tensor patchify(const Tensor& x, int64_t p, const Scan& scan) {
  DEW_CHECK(x.dim() == 4, "patchify: x must be [B, C, H, W], got ", x.sizes());
  DEW_CHECK(p > 0 && x.size(2) == scan.h * p && x.size(3) == scan.w * p, "patchify: image ", x.size(2), " x ",
            x.size(3), " does not match the ", scan.h, " x ", scan.w, " grid of ", p, " x ", p, " patches");
  const int64_t B = x.size(0), C = x.size(1);
  Tensor t = x.reshape({B, C, scan.h, p, scan.w, p})
                 .permute({0, 2, 4, 3, 5, 1})  // [B, h, w, p, p, C]
                 .reshape({B, scan.h * scan.w, p * p * C});
  if (scan.is_raster()) return t;
  return t.index_select(1, scan.perm.to(t.device()));
}

Tensor unpatchify(const Tensor& tokens, int64_t p, const Scan& scan) {
  DEW_CHECK(tokens.dim() == 3 && tokens.size(1) == scan.h * scan.w && p > 0 && tokens.size(2) % (p * p) == 0,
            "unpatchify: tokens must be [B, ", scan.h * scan.w, ", p*p*C] with p = ", p, ", got ", tokens.sizes());
  const int64_t B = tokens.size(0), C = tokens.size(2) / (p * p);
  Tensor t = scan.is_raster() ? tokens : tokens.index_select(1, scan.inverse.to(tokens.device()));
  return t.reshape({B, scan.h, scan.w, p, p, C})
      .permute({0, 5, 1, 3, 2, 4})  // [B, C, h, p, w, p]
      .reshape({B, C, scan.h * p, scan.w * p});
}

}  // namespace dew::nn

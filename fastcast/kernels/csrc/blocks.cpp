// Block-scaled FP8 (1x128 or 128x128 tiles, one FP32 scale each) and MXFP8 (1x32
// blocks, one E8M0 exponent each) of a matrix [R, K]. Each tile or block is read twice
// while it sits in cache (its amax, then its cast); each output is written once.
//
// The values are exactly those of the PyTorch reference (fastcast/quantize/block.py:
// quantize_tiles; fastcast/quantize/mx.py: quantize_blocks); tests/test_kernels_blocks.py
// checks them bit for bit. CPU only: other devices take the reference path.
//
// The input is read in place when its rows are contiguous, and also when it is the
// transposed view of a row-major matrix (the column-wise layouts quantize m.t()): that
// one is read a panel at a time, widened into a row-major FP32 buffer, so that memory is
// still read in order and no transposed copy is made.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

#include "fp8.h"

namespace fastcast {
namespace {

constexpr int64_t kTileCols = 128;  // block scaling: tile extent along K
constexpr int64_t kMxBlock = 32;    // MXFP8: block extent along K
// A panel of the transposed input: rows x kPanelCols elements. 32 rows are a cache line
// (or two) of each source row the panel reads.
constexpr int64_t kPanelRows = 32;
constexpr int64_t kPanelCols = 128;
// The panel buffer's row stride: not a power of two, so that the gather's column of
// writes (one per row) spreads over the L1 cache's sets instead of thrashing a few.
constexpr int64_t kPanelLd = kPanelCols + 16;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// How the matrix [rows, cols] lies in memory: row-major (element (r, c) at r * ld + c)
// or transposed (at c * ld + r, the .t() view of a row-major [cols, rows] matrix).
struct Layout {
  bool transposed;
  int64_t ld;
};

// The layout the kernels read `m` in, or nullopt when they need a contiguous copy.
std::optional<Layout> layout_of(const at::Tensor& m) {
  if (m.stride(1) == 1) return Layout{false, m.stride(0)};
  if (m.stride(0) == 1) return Layout{true, m.stride(1)};
  return std::nullopt;
}

// Calls fn(row, first, last) for the units [begin, end) of a grid laid out row by row,
// `per_row` units to a row, once for each row the range touches.
template <typename Fn>
void for_each_row_run(int64_t begin, int64_t end, int64_t per_row, Fn&& fn) {
  for (int64_t u = begin; u < end;) {
    const int64_t row = u / per_row, first = u % per_row;
    const int64_t last = std::min(per_row, first + (end - u));
    fn(row, first, last);
    u += last - first;
  }
}

// Rows [r0, r0 + rows) and columns [c0, c0 + cols) of the transposed source x, widened
// into buf (row-major, rows kPanelLd apart). The loops read x in memory order.
template <typename T>
inline void gather_panel(const T* x, int64_t ld, int64_t r0, int64_t rows, int64_t c0,
                         int64_t cols, float* __restrict buf) {
  for (int64_t c = 0; c < cols; ++c) {
    const T* src = x + (c0 + c) * ld + r0;
    for (int64_t r = 0; r < rows; ++r) buf[r * kPanelLd + c] = widen(src[r]);
  }
}

// ---- Block scaling --------------------------------------------------------------------

struct BlockParams {
  int64_t tile_rows;
  float fmt_max;
  bool power_2;
  double epsilon;
};

// One tile of rows x cols elements (row stride ld): its amax (NaN-propagating, as the
// reference's inf-norm), its scale, its codes (row stride out_ld). Returns scale_inv.
template <typename T, typename F8>
inline float quantize_tile(const T* x, int64_t ld, int64_t rows, int64_t cols, uint8_t* out,
                           int64_t out_ld, const BlockParams& p) {
  uint32_t m = 0;
  for (int64_t r = 0; r < rows; ++r) m = std::max(m, max_magnitude(x + r * ld, cols));
  const float scale = scale_from_amax(from_magnitude<T>(m), p.fmt_max, p.power_2, p.epsilon);
  for (int64_t r = 0; r < rows; ++r)
    cast_span<T, F8>(x + r * ld, out + r * out_ld, cols, scale, p.fmt_max);
  return 1.0f / scale;
}

// Tiles [first, last) of one band (rows tile rows) of a row-major x, whose columns
// number cols; scale_inv is the band's row of scales.
template <typename T, typename F8>
void quantize_band(const T* x, int64_t ld, int64_t rows, int64_t cols, int64_t first,
                   int64_t last, uint8_t* out, float* scale_inv, const BlockParams& p) {
  for (int64_t j = first; j < last; ++j) {
    const int64_t c0 = j * kTileCols, width = std::min(kTileCols, cols - c0);
    scale_inv[j] = quantize_tile<T, F8>(x + c0, ld, rows, width, out + c0, cols, p);
  }
}

// Tile column j of the bands in rows [r0, r0 + rows) of a transposed x: gathered into
// buf, then quantized tile by tile.
template <typename T, typename F8>
void quantize_panel(const T* x, int64_t ld, int64_t r0, int64_t rows, int64_t j, int64_t cols,
                    uint8_t* out, float* scale_inv, const BlockParams& p, float* buf) {
  const int64_t c0 = j * kTileCols, width = std::min(kTileCols, cols - c0);
  const int64_t col_tiles = ceil_div(cols, kTileCols);
  gather_panel(x, ld, r0, rows, c0, width, buf);
  for (int64_t s = 0; s < rows; s += p.tile_rows) {
    const int64_t r = r0 + s, band_rows = std::min(p.tile_rows, rows - s);
    scale_inv[(r / p.tile_rows) * col_tiles + j] = quantize_tile<float, F8>(
        buf + s * kPanelLd, kPanelLd, band_rows, width, out + r * cols + c0, cols, p);
  }
}

template <typename T, typename F8>
void blocks_typed(const at::Tensor& m, Layout layout, const BlockParams& p, at::Tensor& data,
                  at::Tensor& scale_inv) {
  const int64_t rows = m.size(0), cols = m.size(1), ld = layout.ld;
  const int64_t col_tiles = ceil_div(cols, kTileCols);
  const T* x = m.const_data_ptr<T>();
  uint8_t* out = static_cast<uint8_t*>(data.data_ptr());
  float* inv = scale_inv.data_ptr<float>();
  if (!layout.transposed) {
    const int64_t grain = std::max<int64_t>(1, kGrain / (p.tile_rows * kTileCols));
    at::parallel_for(0, ceil_div(rows, p.tile_rows) * col_tiles, grain, [&](int64_t b, int64_t e) {
      for_each_row_run(b, e, col_tiles, [&](int64_t band, int64_t first, int64_t last) {
        const int64_t r0 = band * p.tile_rows, band_rows = std::min(p.tile_rows, rows - r0);
        quantize_band<T, F8>(x + r0 * ld, ld, band_rows, cols, first, last, out + r0 * cols,
                             inv + band * col_tiles, p);
      });
    });
    return;
  }
  // A panel holds whole bands: kPanelRows of 1-row tiles, or one band of 128.
  const int64_t panel_rows = std::max(p.tile_rows, kPanelRows);
  const int64_t grain = std::max<int64_t>(1, kGrain / (panel_rows * kTileCols));
  at::parallel_for(0, ceil_div(rows, panel_rows) * col_tiles, grain, [&](int64_t b, int64_t e) {
    std::vector<float> buf(panel_rows * kPanelLd);
    for (int64_t panel = b; panel < e; ++panel) {
      const int64_t r0 = (panel / col_tiles) * panel_rows;
      quantize_panel<T, F8>(x, ld, r0, std::min(panel_rows, rows - r0), panel % col_tiles, cols,
                            out, inv, p, buf.data());
    }
  });
}

// m [R, K] quantized to `dtype` (float8_e4m3fn or float8_e5m2) in tiles of tile_rows
// (1 or 128) x 128, each scaled by scale_from_amax of its own elements (a partial tile at
// an edge included). Returns the data [R, K] and the scale_inv [ceil(R / tile_rows),
// ceil(K / 128)] (FP32), as quantize_tiles does.
std::tuple<at::Tensor, at::Tensor> quantize_blocks(const at::Tensor& input, int64_t tile_rows,
                                                   at::ScalarType dtype, bool power_2,
                                                   double epsilon) {
  TORCH_CHECK(input.device().is_cpu(), "fastcast::quantize_blocks: CPU tensors only");
  TORCH_CHECK(input.dim() == 2, "fastcast::quantize_blocks: needs a matrix, got ", input.dim(),
              " dims");
  TORCH_CHECK(tile_rows == 1 || tile_rows == kTileCols,
              "fastcast::quantize_blocks: tile_rows must be 1 or 128, got ", tile_rows);
  const auto layout = layout_of(input);
  const at::Tensor m = layout ? input : input.contiguous();
  const int64_t rows = m.size(0), cols = m.size(1);
  at::Tensor data = at::empty({rows, cols}, m.options().dtype(dtype));
  at::Tensor scale_inv = at::empty({ceil_div(rows, tile_rows), ceil_div(cols, kTileCols)},
                                   m.options().dtype(at::kFloat));
  dispatch_types(m.scalar_type(), dtype, "quantize_blocks", [&](auto t, auto f8) {
    using T = decltype(t);
    using F8 = decltype(f8);
    const BlockParams p{tile_rows, fmt_max_of<F8>(), power_2, epsilon};
    blocks_typed<T, F8>(m, layout.value_or(Layout{false, cols}), p, data, scale_inv);
  });
  return {data, scale_inv};
}

// ---- MXFP8 ----------------------------------------------------------------------------

// MxParams, shared_exponent and power_of_2 (the E8M0 arithmetic) are in element.h.
template <typename F8>
MxParams mx_params(bool ocp) {
  return fastcast::mx_params(std::is_same_v<F8, c10::Float8_e4m3fn>, ocp);
}

// Blocks [0, n) of 32 consecutive elements from x: each one's amax over its finite
// elements, shared exponent X, codes of x * 2**-X, and E8M0 byte X + 127.
template <typename T, typename F8>
FASTCAST_HOT void quantize_mx_run(const T* __restrict x, int64_t n, uint8_t* __restrict out,
                                  uint8_t* __restrict e8m0, const MxParams& p) {
  for (int64_t b = 0; b < n; ++b) {
    const T* block = x + b * kMxBlock;
    uint32_t m = 0;
    for (int64_t i = 0; i < kMxBlock; ++i) {
      // inf and NaN left out: masked to 0 (GCC vectorises the mask, not a select).
      const uint32_t v = magnitude(block[i]);
      m = std::max(m, v & (0u - static_cast<uint32_t>(v < kInfMagnitude<T>)));
    }
    const int32_t shared = shared_exponent(from_magnitude<T>(m), p);
    const float scale = power_of_2(-shared);
    for (int64_t i = 0; i < kMxBlock; ++i)
      out[b * kMxBlock + i] = cast_one<F8>(widen(block[i]), scale, p.fmt_max);
    e8m0[b] = static_cast<uint8_t>(shared + 127);
  }
}

template <typename T, typename F8>
void mx_typed(const at::Tensor& m, Layout layout, const MxParams& p, at::Tensor& data,
              at::Tensor& e8m0) {
  const int64_t rows = m.size(0), cols = m.size(1), ld = layout.ld;
  const int64_t per_row = cols / kMxBlock;
  const T* x = m.const_data_ptr<T>();
  uint8_t* out = static_cast<uint8_t*>(data.data_ptr());
  uint8_t* exps = static_cast<uint8_t*>(e8m0.data_ptr());
  if (!layout.transposed) {
    const int64_t grain = std::max<int64_t>(1, kGrain / kMxBlock);
    at::parallel_for(0, rows * per_row, grain, [&](int64_t b, int64_t e) {
      for_each_row_run(b, e, per_row, [&](int64_t r, int64_t first, int64_t last) {
        quantize_mx_run<T, F8>(x + r * ld + first * kMxBlock, last - first,
                               out + r * cols + first * kMxBlock, exps + r * per_row + first, p);
      });
    });
    return;
  }
  // Panels of kPanelRows x kPanelCols, gathered, then each row's blocks as above.
  const int64_t col_panels = ceil_div(cols, kPanelCols);
  const int64_t grain = std::max<int64_t>(1, kGrain / (kPanelRows * kPanelCols));
  at::parallel_for(0, ceil_div(rows, kPanelRows) * col_panels, grain, [&](int64_t b, int64_t e) {
    std::vector<float> buf(kPanelRows * kPanelLd);
    for (int64_t panel = b; panel < e; ++panel) {
      const int64_t r0 = (panel / col_panels) * kPanelRows;
      const int64_t c0 = (panel % col_panels) * kPanelCols;
      const int64_t height = std::min(kPanelRows, rows - r0);
      const int64_t width = std::min(kPanelCols, cols - c0);
      gather_panel(x, ld, r0, height, c0, width, buf.data());
      for (int64_t r = 0; r < height; ++r)
        quantize_mx_run<float, F8>(buf.data() + r * kPanelLd, width / kMxBlock,
                                   out + (r0 + r) * cols + c0,
                                   exps + (r0 + r) * per_row + c0 / kMxBlock, p);
    }
  });
}

// m [R, K] (K a multiple of 32) quantized to MXFP8 `dtype` in 1x32 blocks under the
// "ocp" or "rceil" rule. Returns the data [R, K] and the E8M0 bytes [R, K / 32] (uint8),
// as mx.py's quantize_blocks does.
std::tuple<at::Tensor, at::Tensor> quantize_mxfp8(const at::Tensor& input, at::ScalarType dtype,
                                                  bool ocp) {
  TORCH_CHECK(input.device().is_cpu(), "fastcast::quantize_mxfp8: CPU tensors only");
  TORCH_CHECK(input.dim() == 2, "fastcast::quantize_mxfp8: needs a matrix, got ", input.dim(),
              " dims");
  TORCH_CHECK(input.size(1) % kMxBlock == 0,
              "fastcast::quantize_mxfp8: K must be a multiple of 32, got ", input.size(1));
  const auto layout = layout_of(input);
  const at::Tensor m = layout ? input : input.contiguous();
  const int64_t rows = m.size(0), cols = m.size(1);
  at::Tensor data = at::empty({rows, cols}, m.options().dtype(dtype));
  at::Tensor e8m0 = at::empty({rows, cols / kMxBlock}, m.options().dtype(at::kByte));
  dispatch_types(m.scalar_type(), dtype, "quantize_mxfp8", [&](auto t, auto f8) {
    using T = decltype(t);
    using F8 = decltype(f8);
    mx_typed<T, F8>(m, layout.value_or(Layout{false, cols}), mx_params<F8>(ocp), data, e8m0);
  });
  return {data, e8m0};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fastcast_kernels, m) {
  m.def(
      "quantize_blocks(Tensor m, int tile_rows, ScalarType dtype, bool power_2, float epsilon) "
      "-> (Tensor, Tensor)");
  m.def("quantize_mxfp8(Tensor m, ScalarType dtype, bool ocp) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(fastcast_kernels, CPU, m) {
  m.impl("quantize_blocks", &quantize_blocks);
  m.impl("quantize_mxfp8", &quantize_mxfp8);
}

}  // namespace fastcast

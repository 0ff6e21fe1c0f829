// NVFP4 quantization in two passes over the input: the block amaxes (and from them the
// tensor amax), then the block scales, the E2M1 codes and their packing.
//
// The values are exactly those of the PyTorch reference (fastcast/quantize/nvfp4.py, whose
// module docstring defines the math); tests/test_kernels_nvfp4.py checks them bit for bit.
// Both passes walk the input by strips of 16 rows (in parallel), each strip row by row, so
// that one read of a row serves its row-wise blocks, the column-wise blocks and 16x16
// tiles it belongs to; each row's codes are one loop at full vector width (the block
// multipliers spread over the elements). CPU only.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

#include "fp8.h"

namespace fastcast {
namespace nvfp4 {
namespace {

constexpr int64_t kBlock = 16;

// What the tiles of one quantization share: the shape, the layouts asked, where the
// draws, block amaxes and outputs are. `rows x cols` is the input viewed as [R, K].
struct Job {
  int64_t rows, cols;
  bool block_2d, rowwise, columnwise;
  const float* rand = nullptr;    // stochastic rounding draws laid out like x
  const float* rand_t = nullptr;  // draws for the 1x16 column-wise codes, [K, R]
  // Pass 1 writes the block amaxes (FP32, from the magnitude bits); pass 2 reads them.
  float* amax = nullptr;    // row blocks [R, K/16]; with block_2d: tiles [R/16, K/16]
  float* amax_t = nullptr;  // 1x16 column-wise blocks, by strip: [R/16, K]
  // Outputs, null when not asked (or empty).
  uint8_t* data = nullptr;     // [R, K/2]
  uint8_t* scale = nullptr;    // like amax
  uint8_t* data_t = nullptr;   // [K, R/2]
  uint8_t* scale_t = nullptr;  // [K, R/16]; with block_2d: [K/16, R/16]
};

// ---- Pass 1: block amaxes --------------------------------------------------------------

// Magnitude bits of each 16-element block of one row: block_max[cb] for cb < blocks.
template <typename T>
FASTCAST_HOT void block_maxima(const T* __restrict row, int64_t blocks,
                                     uint32_t* __restrict block_max) {
  for (int64_t cb = 0; cb < blocks; ++cb) {
    uint32_t m = 0;
    for (int64_t j = 0; j < kBlock; ++j) m = std::max(m, magnitude(row[cb * kBlock + j]));
    block_max[cb] = m;
  }
}

// Elementwise running maxima of magnitude bits down a strip: acc[c] over the rows seen.
template <typename T>
FASTCAST_HOT void column_maxima(const T* __restrict row, int64_t cols,
                                      uint32_t* __restrict acc) {
  for (int64_t c = 0; c < cols; ++c) acc[c] = std::max(acc[c], magnitude(row[c]));
}

// The largest finite magnitude bits among the 16 elements of a block (one that holds a
// NaN or an infinity: rare, so rescanned rather than tracked in the hot loop).
template <typename T>
uint32_t finite_block_max(const T* block) {
  uint32_t m = 0;
  for (int64_t j = 0; j < kBlock; ++j) {
    const uint32_t v = magnitude(block[j]);
    if (v < kInfMagnitude<T>) m = std::max(m, v);
  }
  return m;
}

// The block amaxes of the 16-row strip `strip` (fewer rows only for the last strip of a
// 1x16 row-wise layout), row by row so that the input streams in order; returns the
// largest FP32 magnitude bits among its finite elements (the tensor amax leaves
// non-finite elements out, as _global_encode_scale does). `block_max`, `tile_max` and `col_max` are the
// task's scratch (K/16, K/16 and K entries).
template <typename T>
uint32_t strip_amaxes(const T* x, const Job& job, int64_t strip, uint32_t* block_max,
                      uint32_t* tile_max, uint32_t* col_max) {
  const int64_t r0 = strip * kBlock, n = std::min(kBlock, job.rows - r0);
  const int64_t cols = job.cols, blocks = cols / kBlock;
  std::fill(tile_max, tile_max + blocks, 0u);
  if (job.amax_t != nullptr) std::fill(col_max, col_max + cols, 0u);
  uint32_t finite_max = 0;
  for (int64_t i = 0; i < n; ++i) {
    const T* row = x + (r0 + i) * cols;
    block_maxima(row, blocks, block_max);
    for (int64_t cb = 0; cb < blocks; ++cb)
      finite_max = std::max(finite_max, block_max[cb] < kInfMagnitude<T>
                                            ? block_max[cb]
                                            : finite_block_max(row + cb * kBlock));
    for (int64_t cb = 0; cb < blocks; ++cb) tile_max[cb] = std::max(tile_max[cb], block_max[cb]);
    if (!job.block_2d)
      for (int64_t cb = 0; cb < blocks; ++cb)
        job.amax[(r0 + i) * blocks + cb] = from_magnitude<T>(block_max[cb]);
    if (job.amax_t != nullptr) column_maxima(row, cols, col_max);
  }
  if (job.block_2d)
    for (int64_t cb = 0; cb < blocks; ++cb)
      job.amax[strip * blocks + cb] = from_magnitude<T>(tile_max[cb]);
  if (job.amax_t != nullptr)  // 1x16 column-wise: each column of the strip is a block
    for (int64_t c = 0; c < cols; ++c) job.amax_t[strip * cols + c] = from_magnitude<T>(col_max[c]);
  return magnitude(from_magnitude<T>(finite_max));
}

int64_t strip_count(int64_t rows) { return (rows + kBlock - 1) / kBlock; }

// Strips per task: about kGrain elements.
int64_t strip_grain(int64_t cols) {
  return std::max<int64_t>(1, kGrain / (kBlock * std::max<int64_t>(cols, 1)));
}

// Pass 1 over the whole input; returns the tensor amax over the finite elements.
template <typename T>
float block_amaxes(const T* x, const Job& job) {
  const uint32_t m = at::parallel_reduce(
      0, strip_count(job.rows), strip_grain(job.cols), uint32_t{0},
      [x, &job](int64_t begin, int64_t end, uint32_t) {
        const int64_t blocks = job.cols / kBlock;
        std::vector<uint32_t> scratch(2 * blocks + (job.amax_t != nullptr ? job.cols : 0));
        uint32_t* block_max = scratch.data();
        uint32_t m = 0;
        for (int64_t s = begin; s < end; ++s)
          m = std::max(m, strip_amaxes(x, job, s, block_max, block_max + blocks,
                                       block_max + 2 * blocks));
        return m;
      },
      [](uint32_t a, uint32_t b) { return std::max(a, b); });
  return float_of(m);
}

// ---- Scales ----------------------------------------------------------------------------
// The element arithmetic (s_enc, the E4M3 block scales, the multipliers, the E2M1
// rounding) is element.h's, shared with the CUDA kernel (cuda/nvfp4.cu).

// The scale bytes and encode multipliers of n blocks from their amaxes.
FASTCAST_HOT void block_scales(const float* __restrict amax, int64_t n, float s_enc,
                                     uint8_t* __restrict s_dec, float* __restrict mult) {
  const float s_enc_6 = s_enc * kOneSixth, s_dec_global = 1.0f / s_enc;
  for (int64_t b = 0; b < n; ++b) {
    s_dec[b] = nvfp4_decode_scale(amax[b], s_enc_6);
    mult[b] = nvfp4_encode_multiplier(s_dec[b], s_dec_global);
  }
}

// Each block's multiplier repeated over its 16 elements (a row's codes then run in one
// loop at full vector width).
void spread(const float* block_mult, int64_t blocks, float* mult) {
  for (int64_t b = 0; b < blocks; ++b) std::fill_n(mult + b * kBlock, kBlock, block_mult[b]);
}

// ---- Pass 2: codes ---------------------------------------------------------------------

// The signed codes of one row segment: out[c] = code of x[c] under mult[c] (the
// multiplier of its block, spread over the block's elements, so the loop runs the whole
// row at full vector width). Stochastic draws at rand[c * rand_stride].
template <typename T, bool Stochastic>
FASTCAST_HOT void row_codes(const T* __restrict x, const float* __restrict mult,
                                  const float* __restrict rand, int64_t rand_stride, int64_t n,
                                  uint8_t* __restrict out) {
  for (int64_t c = 0; c < n; ++c) {
    const float draw = Stochastic ? rand[c * rand_stride] : 0.0f;
    out[c] = e2m1_code<Stochastic>(static_cast<float>(x[c]), mult[c], draw);
  }
}

// _pack: two codes per byte, the first in the low nibble (n codes, n even).
FASTCAST_HOT void pack_pairs(const uint8_t* __restrict codes, int64_t n,
                                   uint8_t* __restrict out) {
  for (int64_t k = 0; k < n / 2; ++k)
    out[k] = static_cast<uint8_t>(codes[2 * k] | (codes[2 * k + 1] << 4));
}

// Per-task scratch of pass 2: per-element multipliers and codes (K entries), per-block
// multipliers and scale bytes, and the strip's column-wise bytes (8 per column).
struct Scratch {
  std::vector<float> mult, mult_t, block_mult;
  std::vector<uint8_t> codes, codes_t, even_t, packed_t, s_dec;
  explicit Scratch(int64_t cols)
      : mult(cols), mult_t(cols), block_mult(cols), codes(cols), codes_t(cols), even_t(cols),
        packed_t(8 * cols), s_dec(cols) {}
};

// Pass 2 for one 16-row strip, row by row: each row's codes in one sweep per layout,
// the column-wise codes paired across rows (2k and 2k+1 share a byte) in `packed_t`, which
// holds the strip's column-wise bytes until the strip ends.
template <typename T, bool Stochastic>
void strip_codes(const T* x, const Job& job, float s_enc, int64_t strip, Scratch& w) {
  const int64_t r0 = strip * kBlock, n = std::min(kBlock, job.rows - r0);
  const int64_t cols = job.cols, blocks = cols / kBlock, strips = job.rows / kBlock;
  const bool row_wanted = job.rowwise || job.block_2d;  // 16x16: both layouts' codes
  if (job.block_2d) {  // one scale per tile, the same in both layouts
    const int64_t first = strip * blocks;
    uint8_t* s_dec = job.scale != nullptr ? job.scale + first : w.s_dec.data();
    block_scales(job.amax + first, blocks, s_enc, s_dec, w.block_mult.data());
    if (job.scale_t != nullptr)
      for (int64_t cb = 0; cb < blocks; ++cb) job.scale_t[cb * strips + strip] = s_dec[cb];
    spread(w.block_mult.data(), blocks, w.mult.data());
  } else if (job.data_t != nullptr) {  // 1x16 column-wise: one scale per column
    block_scales(job.amax_t + strip * cols, cols, s_enc, w.s_dec.data(), w.mult_t.data());
    for (int64_t c = 0; c < cols; ++c) job.scale_t[c * strips + strip] = w.s_dec[c];
  }
  for (int64_t i = 0; i < n; ++i) {
    const int64_t r = r0 + i;
    const T* row = x + r * cols;
    if (row_wanted) {
      if (!job.block_2d) {  // 1x16 row-wise (asked, so job.scale is there)
        block_scales(job.amax + r * blocks, blocks, s_enc, job.scale + r * blocks,
                     w.block_mult.data());
        spread(w.block_mult.data(), blocks, w.mult.data());
      }
      const float* rand = Stochastic ? job.rand + r * cols : nullptr;
      row_codes<T, Stochastic>(row, w.mult.data(), rand, 1, cols, w.codes.data());
      if (job.data != nullptr) pack_pairs(w.codes.data(), cols, job.data + r * (cols / 2));
    }
    if (job.data_t == nullptr) continue;
    const uint8_t* codes_t = w.codes.data();  // 16x16: the same codes
    if (!job.block_2d) {
      const float* rand = Stochastic ? job.rand_t + r : nullptr;
      row_codes<T, Stochastic>(row, w.mult_t.data(), rand, job.rows, cols, w.codes_t.data());
      codes_t = w.codes_t.data();
    }
    if (i % 2 == 0) {
      std::copy_n(codes_t, cols, w.even_t.data());
    } else {
      for (int64_t c = 0; c < cols; ++c)
        w.packed_t[c * 8 + i / 2] = static_cast<uint8_t>(w.even_t[c] | (codes_t[c] << 4));
    }
  }
  if (job.data_t != nullptr)
    for (int64_t c = 0; c < cols; ++c)
      std::memcpy(job.data_t + c * (job.rows / 2) + r0 / 2, w.packed_t.data() + c * 8, 8);
}

template <typename T, bool Stochastic>
void all_codes(const T* x, const Job& job, float s_enc) {
  at::parallel_for(0, strip_count(job.rows), strip_grain(job.cols),
                   [x, &job, s_enc](int64_t begin, int64_t end) {
                     Scratch scratch(job.cols);
                     for (int64_t s = begin; s < end; ++s)
                       strip_codes<T, Stochastic>(x, job, s_enc, s, scratch);
                   });
}

// ---- The operator ----------------------------------------------------------------------

// Both passes over x (T); returns the tensor encode scale s_enc.
template <typename T>
float quantize_typed(const at::Tensor& input, const Job& job, bool stochastic) {
  const T* x = input.const_data_ptr<T>();
  const float s_enc = nvfp4_encode_scale(block_amaxes(x, job));
  if (stochastic)
    all_codes<T, true>(x, job, s_enc);
  else
    all_codes<T, false>(x, job, s_enc);
  return s_enc;
}

int64_t leading_rows(const at::Tensor& x) {
  int64_t rows = 1;
  for (int64_t d = 0; d + 1 < x.dim(); ++d) rows *= x.size(d);
  return rows;
}

// Draws for stochastic rounding: FP32 CPU, `numel` elements in the layout's order.
const float* draws(const std::optional<at::Tensor>& rand, int64_t numel, const char* what,
                   at::Tensor& keep) {
  TORCH_CHECK(rand.has_value(), "fastcast::quantize_nvfp4: stochastic rounding needs ", what);
  TORCH_CHECK(rand->device().is_cpu() && rand->scalar_type() == at::kFloat &&
                  rand->numel() == numel,
              "fastcast::quantize_nvfp4: ", what, " must be FP32 on the CPU with ", numel,
              " elements");
  keep = rand->contiguous();
  return keep.const_data_ptr<float>();
}

uint8_t* bytes_of(at::Tensor& t) {
  return t.numel() ? static_cast<uint8_t*>(t.data_ptr()) : nullptr;
}

// NVFP4 of x viewed as [R, K] (K and, for 16x16 tiles or a column-wise layout, R multiples
// of 16). With `stochastic`, `rand` holds the draws of the row-wise (or 16x16) codes laid
// out like x, `rand_t` those of the 1x16 column-wise codes, [K, R] (each only where those
// codes are computed). Returns data [R, K/2] uint8 and scale_inv (E4M3: [R, K/16], 16x16:
// [R/16, K/16]), empty unless rowwise; data_t [K, R/2] and scale_inv_t ([K, R/16], 16x16:
// [K/16, R/16]), empty unless columnwise; global_scale_inv (FP32, 0-dim).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_nvfp4(
    const at::Tensor& input, bool block_2d, bool rowwise, bool columnwise, bool stochastic,
    const std::optional<at::Tensor>& rand, const std::optional<at::Tensor>& rand_t) {
  TORCH_CHECK(input.device().is_cpu(), "fastcast::quantize_nvfp4: CPU tensors only");
  TORCH_CHECK(input.dim() > 0, "fastcast::quantize_nvfp4: needs at least one dim");
  TORCH_CHECK(rowwise || columnwise,
              "fastcast::quantize_nvfp4: ask for rowwise and/or columnwise data");
  const at::Tensor x = input.contiguous();
  const int64_t cols = x.size(-1), rows = leading_rows(x);
  TORCH_CHECK(cols % kBlock == 0, "fastcast::quantize_nvfp4: K must be a multiple of 16");
  TORCH_CHECK(!(block_2d || columnwise) || rows % kBlock == 0,
              "fastcast::quantize_nvfp4: R must be a multiple of 16");

  const auto floats = x.options().dtype(at::kFloat);
  const auto bytes = x.options().dtype(at::kByte);
  const auto e4m3 = x.options().dtype(at::kFloat8_e4m3fn);
  const int64_t blocks = cols / kBlock, strips = rows / kBlock;
  const bool column_1x16 = columnwise && !block_2d;
  at::Tensor amax = block_2d ? at::empty({strips, blocks}, floats) : at::empty({rows, blocks}, floats);
  at::Tensor amax_t = at::empty({column_1x16 ? strips : 0, cols}, floats);
  at::Tensor data = at::empty({rowwise ? rows : 0, cols / 2}, bytes);
  at::Tensor scale = at::empty({rowwise ? amax.size(0) : 0, blocks}, e4m3);
  at::Tensor data_t = at::empty({columnwise ? cols : 0, rows / 2}, bytes);
  at::Tensor scale_t = block_2d ? at::empty({columnwise ? blocks : 0, strips}, e4m3)
                                : at::empty({columnwise ? cols : 0, strips}, e4m3);

  Job job{rows, cols, block_2d, rowwise, columnwise};
  at::Tensor rand_keep, rand_t_keep;
  if (stochastic && (rowwise || block_2d)) job.rand = draws(rand, rows * cols, "rand", rand_keep);
  if (stochastic && column_1x16) job.rand_t = draws(rand_t, rows * cols, "rand_t", rand_t_keep);
  job.amax = amax.data_ptr<float>();
  job.amax_t = column_1x16 && amax_t.numel() ? amax_t.data_ptr<float>() : nullptr;
  job.data = bytes_of(data);
  job.scale = bytes_of(scale);
  job.data_t = bytes_of(data_t);
  job.scale_t = bytes_of(scale_t);

  float s_enc = 1.0f;
  switch (x.scalar_type()) {
    case at::kFloat: s_enc = quantize_typed<float>(x, job, stochastic); break;
    case at::kBFloat16: s_enc = quantize_typed<c10::BFloat16>(x, job, stochastic); break;
    case at::kHalf: s_enc = quantize_typed<c10::Half>(x, job, stochastic); break;
    default: TORCH_CHECK(false, "fastcast::quantize_nvfp4: cannot quantize ", x.scalar_type());
  }
  at::Tensor global_scale_inv = at::empty({}, floats);
  *global_scale_inv.data_ptr<float>() = 1.0f / s_enc;
  return {data, scale, data_t, scale_t, global_scale_inv};
}

}  // namespace
}  // namespace nvfp4

TORCH_LIBRARY_FRAGMENT(fastcast_kernels, m) {
  m.def(
      "quantize_nvfp4(Tensor x, bool block_2d, bool rowwise, bool columnwise, bool stochastic, "
      "Tensor? rand, Tensor? rand_t) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(fastcast_kernels, CPU, m) {
  m.impl("quantize_nvfp4", &nvfp4::quantize_nvfp4);
}

}  // namespace fastcast

// Block-scaled FP8 dequantization on the CPU: out[r, c] = float(data[r, c]) * scale of
// the block holding (r, c), for every Float8 and MXFP8 layout (per tensor, per row,
// 1x128, 128x128, 1x32); and NVFP4's (E2M1 codes, E4M3 block scales, FP32 tensor scale).
//
// The values are exactly those of the PyTorch reference (fastcast/tensor.py:
// QuantizedTensor._dequantize_layout: widen, then multiply by the block's FP32 scale, one
// rounding); tests/test_kernels.py checks them bit for bit. One pass and one dispatch
// where the reference widens, pads, multiplies and slices: this is what the emulated
// GEMM of every block-scaled recipe reads.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>

#include "fp8.h"

namespace fastcast {
namespace {

// E8M0 byte -> its FP32 scale 2**(b - 127), 255 being NaN (tensor.py: decode_e8m0).
std::array<float, 256> e8m0_values() {
  std::array<float, 256> table;
  for (int b = 0; b < 256; ++b) table[b] = b == 255 ? NAN : std::ldexp(1.0f, b - 127);
  return table;
}

// The FP32 scales: FP32 as given, or E8M0 bytes (MXFP8) decoded.
at::Tensor fp32_scales(const at::Tensor& scales) {
  if (scales.scalar_type() == at::kFloat) return scales.contiguous();
  TORCH_CHECK(scales.scalar_type() == at::kByte,
              "fastcast::dequantize_blocks: scales must be FP32 or E8M0 bytes (uint8)");
  static const std::array<float, 256> table = e8m0_values();
  const at::Tensor bytes = scales.contiguous();
  at::Tensor out = at::empty(bytes.sizes(), bytes.options().dtype(at::kFloat));
  const uint8_t* src = bytes.const_data_ptr<uint8_t>();
  float* dst = out.mutable_data_ptr<float>();
  for (int64_t i = 0; i < bytes.numel(); ++i) dst[i] = table[src[i]];
  return out;
}

// Rows per task when reading a transposed layout.
constexpr int64_t kStrip = 64;

// A block extent as the reference reads it: 0 scales the whole dimension, n > 0 blocks
// of n (the last one possibly partial).
int64_t tile_extent(int64_t block, int64_t extent) {
  return block == 0 ? std::max<int64_t>(extent, 1) : block;
}

at::Tensor dequantize_blocks(const at::Tensor& input, const at::Tensor& scales,
                             int64_t block_rows, int64_t block_cols) {
  TORCH_CHECK(input.device().is_cpu() && scales.device().is_cpu(),
              "fastcast::dequantize_blocks: CPU tensors only");
  TORCH_CHECK(input.dim() == 2, "fastcast::dequantize_blocks: data must be 2-D");
  const auto type = input.scalar_type();
  TORCH_CHECK(type == at::kFloat8_e4m3fn || type == at::kFloat8_e5m2,
              "fastcast::dequantize_blocks: data must be float8_e4m3fn or float8_e5m2");
  TORCH_CHECK(block_rows >= 0 && block_cols >= 0,
              "fastcast::dequantize_blocks: block extents must be >= 0");
  // The transposed view of a row-major matrix, with one scale across each row (the .t()
  // column-wise layouts of per-tensor and row-wise FP8), is read in place, not copied.
  const bool transposed = input.stride(0) == 1 && input.stride(1) >= input.size(0) &&
                          input.size(1) > 1 && input.stride(1) != 1 &&
                          (block_cols == 0 || block_cols >= input.size(1));
  const at::Tensor data = transposed ? input : input.contiguous();
  const int64_t rows = data.size(0), cols = data.size(1);
  const int64_t tile_r = tile_extent(block_rows, rows), tile_c = tile_extent(block_cols, cols);
  const int64_t grid_r = (rows + tile_r - 1) / tile_r, grid_c = (cols + tile_c - 1) / tile_c;
  TORCH_CHECK(scales.numel() == std::max<int64_t>(grid_r, 1) * std::max<int64_t>(grid_c, 1) ||
                  rows == 0 || cols == 0,
              "fastcast::dequantize_blocks: ", scales.numel(), " scales for a ", rows, "x", cols,
              " matrix in blocks of ", tile_r, "x", tile_c);
  at::Tensor out = at::empty({rows, cols}, data.options().dtype(at::kFloat));
  if (rows == 0 || cols == 0) return out;

  const auto& table = fp8_values(type);
  const at::Tensor grid = fp32_scales(scales);
  const float* scale = grid.const_data_ptr<float>();
  const auto* src = reinterpret_cast<const uint8_t*>(data.const_data_ptr());
  float* dst = out.mutable_data_ptr<float>();
  if (transposed) {
    // Tiles of kStrip x kStrip: the tile's codes are gathered column by column (each a
    // contiguous run in memory), then written out row by row with the row's scale.
    const int64_t ld = data.stride(1);
    at::parallel_for(0, (rows + kStrip - 1) / kStrip, 1, [&](int64_t begin, int64_t end) {
      std::array<uint8_t, kStrip * kStrip> tile;
      for (int64_t strip = begin; strip < end; ++strip) {
        const int64_t r0 = strip * kStrip, height = std::min(kStrip, rows - r0);
        for (int64_t c0 = 0; c0 < cols; c0 += kStrip) {
          const int64_t width = std::min(kStrip, cols - c0);
          for (int64_t c = 0; c < width; ++c) {
            const uint8_t* codes = src + (c0 + c) * ld + r0;
            for (int64_t r = 0; r < height; ++r) tile[r * kStrip + c] = codes[r];
          }
          for (int64_t r = 0; r < height; ++r) {
            const float s = scale[(r0 + r) / tile_r];  // one block across the row
            float* values = dst + (r0 + r) * cols + c0;
            for (int64_t c = 0; c < width; ++c) values[c] = table[tile[r * kStrip + c]] * s;
          }
        }
      }
    });
    return out;
  }
  const int64_t grain = std::max<int64_t>(1, (1 << 15) / cols);
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row_scales = scale + (r / tile_r) * grid_c;
      const uint8_t* codes = src + r * cols;
      float* values = dst + r * cols;
      for (int64_t c0 = 0, b = 0; c0 < cols; c0 += tile_c, ++b) {
        const float s = row_scales[b];
        const int64_t c1 = std::min(cols, c0 + tile_c);
        for (int64_t c = c0; c < c1; ++c) values[c] = table[codes[c]] * s;
      }
    }
  });
  return out;
}

// E2M1 code (4 bits: sign, then magnitude index) -> its value (tensor.py: E2M1_VALUES).
constexpr std::array<float, 16> kE2M1 = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                         -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

// NVFP4 dequantization: packed [R, K/2] bytes of two E2M1 codes (the first element in the
// low nibble), E4M3 scales [R / block_rows, K / 16], FP32 tensor scale -> FP32 [R, K].
// As the reference (NVFP4Tensor._decode_scales, then apply_scales): each block's scale is
// float(e4m3) * global_scale_inv, rounded to FP32, and each value is code * that scale.
at::Tensor dequantize_nvfp4(const at::Tensor& packed, const at::Tensor& scales,
                            const at::Tensor& global_scale_inv, int64_t block_rows) {
  TORCH_CHECK(packed.device().is_cpu() && scales.device().is_cpu() &&
                  global_scale_inv.device().is_cpu(),
              "fastcast::dequantize_nvfp4: CPU tensors only");
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte,
              "fastcast::dequantize_nvfp4: data must be 2-D uint8 (two E2M1 codes a byte)");
  TORCH_CHECK(scales.scalar_type() == at::kFloat8_e4m3fn,
              "fastcast::dequantize_nvfp4: block scales must be float8_e4m3fn");
  TORCH_CHECK(global_scale_inv.numel() == 1 && global_scale_inv.scalar_type() == at::kFloat,
              "fastcast::dequantize_nvfp4: the tensor scale must be one FP32 value");
  TORCH_CHECK(block_rows == 1 || block_rows == 16,
              "fastcast::dequantize_nvfp4: blocks are 1x16 or 16x16, got block_rows=",
              block_rows);
  const at::Tensor data = packed.contiguous();
  const int64_t rows = data.size(0), cols = data.size(1) * 2, blocks = cols / 16;
  TORCH_CHECK(cols % 16 == 0 && rows % block_rows == 0 &&
                  scales.numel() == (rows / block_rows) * blocks,
              "fastcast::dequantize_nvfp4: ", scales.numel(), " scales for a ", rows, "x", cols,
              " tensor in blocks of ", block_rows, "x16");
  at::Tensor out = at::empty({rows, cols}, data.options().dtype(at::kFloat));
  if (rows == 0 || cols == 0) return out;
  const float global = *global_scale_inv.const_data_ptr<float>();
  const at::Tensor grid = scales.contiguous();
  const auto* scale_codes = reinterpret_cast<const uint8_t*>(grid.const_data_ptr());
  const auto& e4m3 = fp8_values(at::kFloat8_e4m3fn);
  const uint8_t* src = data.const_data_ptr<uint8_t>();
  float* dst = out.mutable_data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, (1 << 15) / cols);
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint8_t* row_scales = scale_codes + (r / block_rows) * blocks;
      const uint8_t* bytes = src + r * (cols / 2);
      float* values = dst + r * cols;
      for (int64_t b = 0; b < blocks; ++b) {
        const float s = e4m3[row_scales[b]] * global;
        for (int64_t i = 0; i < 8; ++i) {
          const uint8_t byte = bytes[b * 8 + i];
          values[b * 16 + 2 * i] = kE2M1[byte & 0x0F] * s;
          values[b * 16 + 2 * i + 1] = kE2M1[byte >> 4] * s;
        }
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fastcast_kernels, m) {
  m.def("dequantize_blocks(Tensor data, Tensor scales, int block_rows, int block_cols) -> Tensor");
  m.def(
      "dequantize_nvfp4(Tensor data, Tensor scales, Tensor global_scale_inv, int block_rows) "
      "-> Tensor");
}

TORCH_LIBRARY_IMPL(fastcast_kernels, CPU, m) {
  m.impl("dequantize_blocks", &dequantize_blocks);
  m.impl("dequantize_nvfp4", &dequantize_nvfp4);
}

}  // namespace fastcast

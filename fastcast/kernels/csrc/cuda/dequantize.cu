// Dequantization on CUDA: the CUDA kernels of dequantize_blocks and dequantize_nvfp4
// (dequantize.cpp), same signatures, outputs and values: each code widened exactly
// (element.h: fp8_to_float, e2m1_value, the values of the CPU's tables), times its
// block's FP32 scale, one rounding.
//
// dequantize_blocks reads the codes through their strides, so a transposed view (the .t()
// column-wise layouts) is read in place as on the CPU, with no copy. A NaN comes out as
// the GPU's canonical NaN, not with the CPU's payload: the values are the same, the NaN
// bits may differ.

#include <torch/library.h>

#include "common.cuh"

namespace fastcast {
namespace cuda {
namespace {

// An FP8 byte's value, as c10 widens it (the CPU's fp8_values table): element.h's
// fp8_to_float (c10's own widening costs the E4M3 kernels an 8-byte spill).
template <bool E4M3>
__device__ __forceinline__ float fp8_value(uint8_t byte) {
  return fp8_to_float<E4M3>(byte);
}

// An E8M0 byte's scale 2**(b - 127), 255 being NaN (tensor.py: decode_e8m0).
__device__ __forceinline__ float e8m0_value(uint8_t byte) {
  return byte == 255 ? float_of(0x7FC00000u) : power_of_2(int32_t{byte} - 127);
}

// Where the codes are and how the scales tile them.
struct Grid {
  int64_t rows, cols, stride_r, stride_c;  // the codes' strides, in elements
  int64_t tile_r, tile_c, grid_c;          // block extents; scale (i, j) at i * grid_c + j
};

// out[r, c] = value(data[r, c]) * scale of (r, c): four consecutive outputs of a row per
// thread (one 16-byte store when the rows stay aligned).
template <bool E4M3, bool E8M0>
__global__ void __launch_bounds__(kThreads)
    blocks_kernel(const uint8_t* __restrict__ data, const void* __restrict__ scales, Grid g,
                  bool vector_out, float* __restrict__ out) {
  const int64_t quads_per_row = (g.cols + 3) / 4, quads = g.rows * quads_per_row;
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t q = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; q < quads; q += stride) {
    const int64_t r = q / quads_per_row, c0 = (q % quads_per_row) * 4;
    const int64_t scale_row = (r / g.tile_r) * g.grid_c;
    float v[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t c = min_of(c0 + j, g.cols - 1);  // past the end: recomputed, not stored
      const int64_t s = scale_row + c / g.tile_c;
      const float scale = E8M0 ? e8m0_value(static_cast<const uint8_t*>(scales)[s])
                               : static_cast<const float*>(scales)[s];
      v[j] = fp8_value<E4M3>(data[r * g.stride_r + c * g.stride_c]) * scale;
    }
    float* dst = out + r * g.cols + c0;
    if (vector_out) {
      *reinterpret_cast<float4*>(dst) = make_float4(v[0], v[1], v[2], v[3]);
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j)
        if (c0 + j < g.cols) dst[j] = v[j];
    }
  }
}

// A block extent as the reference reads it: 0 scales the whole dimension.
int64_t tile_extent(int64_t block, int64_t extent) {
  return block == 0 ? (extent > 1 ? extent : 1) : block;
}

at::Tensor dequantize_blocks(const at::Tensor& data, const at::Tensor& scales,
                             int64_t block_rows, int64_t block_cols) {
  TORCH_CHECK(data.is_cuda() && scales.device() == data.device(),
              "fastcast::dequantize_blocks: data and scales must be on one CUDA device");
  TORCH_CHECK(data.dim() == 2, "fastcast::dequantize_blocks: data must be 2-D");
  const auto type = data.scalar_type();
  TORCH_CHECK(type == at::kFloat8_e4m3fn || type == at::kFloat8_e5m2,
              "fastcast::dequantize_blocks: data must be float8_e4m3fn or float8_e5m2");
  TORCH_CHECK(scales.scalar_type() == at::kFloat || scales.scalar_type() == at::kByte,
              "fastcast::dequantize_blocks: scales must be FP32 or E8M0 bytes (uint8)");
  TORCH_CHECK(block_rows >= 0 && block_cols >= 0,
              "fastcast::dequantize_blocks: block extents must be >= 0");
  const c10::cuda::CUDAGuard guard(data.device());
  const int64_t rows = data.size(0), cols = data.size(1);
  const int64_t tile_r = tile_extent(block_rows, rows), tile_c = tile_extent(block_cols, cols);
  const int64_t grid_r = (rows + tile_r - 1) / tile_r, grid_c = (cols + tile_c - 1) / tile_c;
  TORCH_CHECK(scales.numel() == (grid_r > 1 ? grid_r : 1) * (grid_c > 1 ? grid_c : 1) ||
                  rows == 0 || cols == 0,
              "fastcast::dequantize_blocks: ", scales.numel(), " scales for a ", rows, "x", cols,
              " matrix in blocks of ", tile_r, "x", tile_c);
  at::Tensor out = at::empty({rows, cols}, data.options().dtype(at::kFloat));
  if (rows == 0 || cols == 0) return out;
  const at::Tensor grid = scales.contiguous();
  const Grid g{rows, cols, data.stride(0), data.stride(1), tile_r, tile_c, grid_c};
  const auto* codes = static_cast<const uint8_t*>(data.const_data_ptr());
  float* dst = out.data_ptr<float>();
  const bool vector_out = cols % 4 == 0 && aligned_16(dst);
  const int blocks = grid_for(rows * ((cols + 3) / 4), kThreads);
  const cudaStream_t stream = current_stream();
  auto run = [&](auto e4m3, auto e8m0) {
    blocks_kernel<decltype(e4m3)::value, decltype(e8m0)::value>
        <<<blocks, kThreads, 0, stream>>>(codes, grid.const_data_ptr(), g, vector_out, dst);
  };
  const bool e4m3 = type == at::kFloat8_e4m3fn, e8m0 = grid.scalar_type() == at::kByte;
  if (e4m3 && e8m0) run(std::true_type{}, std::true_type{});
  if (e4m3 && !e8m0) run(std::true_type{}, std::false_type{});
  if (!e4m3 && e8m0) run(std::false_type{}, std::true_type{});
  if (!e4m3 && !e8m0) run(std::false_type{}, std::false_type{});
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

// NVFP4: one thread per 16-element block, its 8 bytes of packed codes (the first element
// in the low nibble) in, 16 values out. The block's scale is float(e4m3) * the tensor
// scale (read from device memory, or given by value for a CPU tensor scale), rounded to
// FP32 as the reference's _decode_scales; each value is code * that scale.
__global__ void __launch_bounds__(kThreads)
    nvfp4_kernel(const uint8_t* __restrict__ packed, const uint8_t* __restrict__ scales,
                 const float* global_ptr, float global_value, int64_t rows, int64_t cols,
                 int64_t block_rows, bool aligned, float* __restrict__ out) {
  const int64_t blocks = cols / 16, total = rows * blocks;
  const float global = global_ptr != nullptr ? *global_ptr : global_value;
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t b = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; b < total; b += stride) {
    const int64_t r = b / blocks, cb = b % blocks;
    const float s = fp8_value<true>(scales[(r / block_rows) * blocks + cb]) * global;
    uint2 word;  // the block's 8 bytes: one load, or byte by byte from a view's offset
    if (aligned) {
      word = reinterpret_cast<const uint2*>(packed)[b];
    } else {
      uint32_t lo = 0, hi = 0;
      for (int k = 0; k < 4; ++k) {
        lo |= uint32_t{packed[8 * b + k]} << (8 * k);
        hi |= uint32_t{packed[8 * b + 4 + k]} << (8 * k);
      }
      word = make_uint2(lo, hi);
    }
    float4* dst = reinterpret_cast<float4*>(out + r * cols + cb * 16);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const uint32_t half = k < 2 ? word.x : word.y;
      const uint32_t bits = half >> (16 * (k % 2));  // four codes
      dst[k] = make_float4(e2m1_value(bits & 0xFu) * s, e2m1_value((bits >> 4) & 0xFu) * s,
                           e2m1_value((bits >> 8) & 0xFu) * s, e2m1_value((bits >> 12) & 0xFu) * s);
    }
  }
}

at::Tensor dequantize_nvfp4(const at::Tensor& packed, const at::Tensor& scales,
                            const at::Tensor& global_scale_inv, int64_t block_rows) {
  TORCH_CHECK(packed.is_cuda() && scales.device() == packed.device(),
              "fastcast::dequantize_nvfp4: data and scales must be on one CUDA device");
  TORCH_CHECK(global_scale_inv.device() == packed.device() || global_scale_inv.is_cpu(),
              "fastcast::dequantize_nvfp4: the tensor scale must be on ", packed.device(),
              " or the CPU");
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte,
              "fastcast::dequantize_nvfp4: data must be 2-D uint8 (two E2M1 codes a byte)");
  TORCH_CHECK(scales.scalar_type() == at::kFloat8_e4m3fn,
              "fastcast::dequantize_nvfp4: block scales must be float8_e4m3fn");
  TORCH_CHECK(global_scale_inv.numel() == 1 && global_scale_inv.scalar_type() == at::kFloat,
              "fastcast::dequantize_nvfp4: the tensor scale must be one FP32 value");
  TORCH_CHECK(block_rows == 1 || block_rows == 16,
              "fastcast::dequantize_nvfp4: blocks are 1x16 or 16x16, got block_rows=",
              block_rows);
  const c10::cuda::CUDAGuard guard(packed.device());
  const at::Tensor data = packed.contiguous();
  const int64_t rows = data.size(0), cols = data.size(1) * 2, blocks = cols / 16;
  TORCH_CHECK(cols % 16 == 0 && rows % block_rows == 0 &&
                  scales.numel() == (rows / block_rows) * blocks,
              "fastcast::dequantize_nvfp4: ", scales.numel(), " scales for a ", rows, "x", cols,
              " tensor in blocks of ", block_rows, "x16");
  at::Tensor out = at::empty({rows, cols}, data.options().dtype(at::kFloat));
  if (rows == 0 || cols == 0) return out;
  const at::Tensor grid = scales.contiguous();
  // A CPU scale is read here (host memory, no device sync); a device one by the kernel.
  const bool on_device = global_scale_inv.is_cuda();
  const float value = on_device ? 0.0f : *global_scale_inv.const_data_ptr<float>();
  const float* pointer = on_device ? global_scale_inv.const_data_ptr<float>() : nullptr;
  const bool aligned = reinterpret_cast<uintptr_t>(data.const_data_ptr()) % 8 == 0;
  nvfp4_kernel<<<grid_for(rows * blocks, kThreads), kThreads, 0, current_stream()>>>(
      data.const_data_ptr<uint8_t>(), static_cast<const uint8_t*>(grid.const_data_ptr()),
      pointer, value, rows, cols, block_rows, aligned, out.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace
}  // namespace cuda

TORCH_LIBRARY_IMPL(fastcast_kernels, CUDA, m) {
  m.impl("dequantize_blocks", &cuda::dequantize_blocks);
  m.impl("dequantize_nvfp4", &cuda::dequantize_nvfp4);
}

}  // namespace fastcast

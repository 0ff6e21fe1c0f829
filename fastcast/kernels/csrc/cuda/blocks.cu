// Block-scaled FP8 (1x128 and 128x128 tiles, FP32 scales) and MXFP8 (1x32 blocks, E8M0
// exponents) on CUDA: the CUDA kernels of quantize_blocks and quantize_mxfp8
// (blocks.cpp), same signatures, outputs and values.
//
// 1x128: a warp per tile, each lane four elements, kept in registers between the amax
// and the cast. 128x128: a block per tile, the tile read twice (the second time from
// cache). MXFP8: eight lanes per 32-element block. The input is made contiguous first
// (the CPU operator also reads a transposed view in place; here that costs a copy).

#include <torch/library.h>

#include <tuple>

#include "common.cuh"

namespace fastcast {
namespace cuda {
namespace {

constexpr int64_t kTileCols = 128;
constexpr int64_t kMxBlock = 32;

struct TileParams {
  float fmt_max;
  bool power_2;
  double epsilon;
};

// Tiles of 1 x 128: tile t = (row t / col_tiles, column tile t % col_tiles), one warp
// each. `quads`: rows aligned for Quad loads (cols % 4 == 0, x aligned).
template <typename In, bool E4M3>
__global__ void __launch_bounds__(kThreads)
    row_tiles_kernel(const typename In::Raw* __restrict__ x, int64_t rows, int64_t cols,
                     bool quads, TileParams p, uint8_t* __restrict__ out,
                     float* __restrict__ inv) {
  const int lane = threadIdx.x % 32;
  const int64_t col_tiles = (cols + kTileCols - 1) / kTileCols, tiles = rows * col_tiles;
  const int64_t warps = int64_t{gridDim.x} * kWarps;
  for (int64_t t = int64_t{blockIdx.x} * kWarps + threadIdx.x / 32; t < tiles; t += warps) {
    const int64_t r = t / col_tiles, c = (t % col_tiles) * kTileCols + 4 * lane;
    const typename In::Raw* row = x + r * cols;
    const bool inside = c < cols;
    // A quad from c: whole when quads (cols % 4 == 0), else element by element up to cols.
    Quad<In> q{};
    if (inside) q = load_quad<In>(row + c, 0, quads, cols - c);
    uint32_t m = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) m = max_of(m, In::magnitude(q.v[j]));  // padding reads 0
    m = group_max<32>(m);
    const float s = scale_from_amax(In::from_magnitude(m), p.fmt_max, p.power_2, p.epsilon);
    if (inside) {
      const uint32_t word = cast_quad<In, E4M3>(q, s, p.fmt_max);
      uint8_t* dst = out + r * cols + c;
      if (quads) {
        *reinterpret_cast<uint32_t*>(dst) = word;
      } else {
        for (int j = 0; j < 4 && c + j < cols; ++j) dst[j] = static_cast<uint8_t>(word >> (8 * j));
      }
    }
    if (lane == 0) inv[t] = 1.0f / s;
  }
}

// Tiles of 128 x 128, one block each: warp w takes rows w, w + 8, ... of the tile, each
// lane four columns; the tile's amax over the block, then the cast.
template <typename In, bool E4M3>
__global__ void __launch_bounds__(kThreads)
    square_tiles_kernel(const typename In::Raw* __restrict__ x, int64_t rows, int64_t cols,
                        bool quads, TileParams p, uint8_t* __restrict__ out,
                        float* __restrict__ inv) {
  __shared__ uint32_t shared[kWarps];
  __shared__ float tile_scale;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t col_tiles = (cols + kTileCols - 1) / kTileCols;
  const int64_t tiles = ((rows + kTileCols - 1) / kTileCols) * col_tiles;
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int64_t r0 = (t / col_tiles) * kTileCols, c = (t % col_tiles) * kTileCols + 4 * lane;
    const int64_t r1 = min_of(rows, r0 + kTileCols);
    uint32_t m = 0;
    if (c < cols) {
      for (int64_t r = r0 + warp; r < r1; r += kWarps) {
        const Quad<In> q = load_quad<In>(x + r * cols + c, 0, quads, cols - c);
#pragma unroll
        for (int j = 0; j < 4; ++j) m = max_of(m, In::magnitude(q.v[j]));
      }
    }
    m = block_max(m, shared);
    if (threadIdx.x == 0) {
      const float s = scale_from_amax(In::from_magnitude(m), p.fmt_max, p.power_2, p.epsilon);
      tile_scale = s;
      inv[t] = 1.0f / s;
    }
    __syncthreads();
    const float s = tile_scale;
    if (c < cols) {
      for (int64_t r = r0 + warp; r < r1; r += kWarps) {
        const uint32_t word =
            cast_quad<In, E4M3>(load_quad<In>(x + r * cols + c, 0, quads, cols - c), s, p.fmt_max);
        uint8_t* dst = out + r * cols + c;
        if (quads) {
          *reinterpret_cast<uint32_t*>(dst) = word;
        } else {
          for (int j = 0; j < 4 && c + j < cols; ++j)
            dst[j] = static_cast<uint8_t>(word >> (8 * j));
        }
      }
    }
    __syncthreads();  // shared and tile_scale are rewritten by the next tile
  }
}

// MXFP8 over x as a sequence of 32-element blocks (K % 32 == 0 and x contiguous, so
// block b is elements [32 b, 32 b + 32) and its E8M0 byte is e8m0[b]): eight lanes per
// block, four elements each. The loop runs per warp, so that every lane of a warp takes
// part in the shuffles (a block is whole or absent: the quad count is a multiple of 8).
template <typename In, bool E4M3>
__global__ void __launch_bounds__(kThreads)
    mx_kernel(const typename In::Raw* __restrict__ x, int64_t quads_total, bool quads,
              MxParams p, uint8_t* __restrict__ out, uint8_t* __restrict__ e8m0) {
  const int lane = threadIdx.x % 32;
  const int64_t stride = int64_t{gridDim.x} * kThreads;
  for (int64_t base = int64_t{blockIdx.x} * kThreads + threadIdx.x - lane; base < quads_total;
       base += stride) {
    const int64_t i = base + lane;
    const bool inside = i < quads_total;
    Quad<In> q{};
    if (inside) q = load_quad<In>(x, i, quads, 4 * quads_total);
    uint32_t m = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      // inf and NaN are left out of the amax (mx.py: the amax over finite elements).
      const uint32_t v = In::magnitude(q.v[j]);
      m = max_of(m, v < In::kInfMagnitude ? v : 0u);
    }
    m = group_max<8>(m);
    const int32_t shared = shared_exponent(In::from_magnitude(m), p);
    const float scale = power_of_2(-shared);
    if (inside) {
      reinterpret_cast<uint32_t*>(out)[i] = cast_quad<In, E4M3>(q, scale, p.fmt_max);
      if (lane % 8 == 0) e8m0[i / 8] = static_cast<uint8_t>(shared + 127);
    }
  }
}

std::tuple<at::Tensor, at::Tensor> quantize_blocks(const at::Tensor& input, int64_t tile_rows,
                                                   at::ScalarType dtype, bool power_2,
                                                   double epsilon) {
  TORCH_CHECK(input.is_cuda(), "fastcast::quantize_blocks: CUDA tensors only");
  TORCH_CHECK(input.dim() == 2, "fastcast::quantize_blocks: needs a matrix, got ", input.dim(),
              " dims");
  TORCH_CHECK(tile_rows == 1 || tile_rows == kTileCols,
              "fastcast::quantize_blocks: tile_rows must be 1 or 128, got ", tile_rows);
  const c10::cuda::CUDAGuard guard(input.device());
  const at::Tensor m = input.contiguous();
  const cudaStream_t stream = current_stream();
  const int64_t rows = m.size(0), cols = m.size(1);
  const int64_t row_tiles = (rows + tile_rows - 1) / tile_rows;
  const int64_t col_tiles = (cols + kTileCols - 1) / kTileCols;
  at::Tensor data = at::empty({rows, cols}, m.options().dtype(dtype));
  at::Tensor scale_inv = at::empty({row_tiles, col_tiles}, m.options().dtype(at::kFloat));
  if (row_tiles * col_tiles == 0) return {data, scale_inv};
  dispatch_types(m.scalar_type(), dtype, "quantize_blocks", [&](auto in, auto e4m3) {
    using In = decltype(in);
    constexpr bool E4M3 = decltype(e4m3)::value;
    const auto* x = static_cast<const typename In::Raw*>(m.const_data_ptr());
    const bool quads = quads_fit<In>(x, cols);
    const TileParams p{kFmtMax<E4M3>, power_2, epsilon};
    auto* out = static_cast<uint8_t*>(data.data_ptr());
    float* inv = scale_inv.data_ptr<float>();
    const int64_t tiles = row_tiles * col_tiles;
    if (tile_rows == 1) {
      row_tiles_kernel<In, E4M3><<<grid_for(tiles, kWarps), kThreads, 0, stream>>>(
          x, rows, cols, quads, p, out, inv);
    } else {
      square_tiles_kernel<In, E4M3><<<grid_for(tiles, 1), kThreads, 0, stream>>>(
          x, rows, cols, quads, p, out, inv);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {data, scale_inv};
}

std::tuple<at::Tensor, at::Tensor> quantize_mxfp8(const at::Tensor& input, at::ScalarType dtype,
                                                  bool ocp) {
  TORCH_CHECK(input.is_cuda(), "fastcast::quantize_mxfp8: CUDA tensors only");
  TORCH_CHECK(input.dim() == 2, "fastcast::quantize_mxfp8: needs a matrix, got ", input.dim(),
              " dims");
  TORCH_CHECK(input.size(1) % kMxBlock == 0,
              "fastcast::quantize_mxfp8: K must be a multiple of 32, got ", input.size(1));
  const c10::cuda::CUDAGuard guard(input.device());
  const at::Tensor m = input.contiguous();
  const cudaStream_t stream = current_stream();
  const int64_t rows = m.size(0), cols = m.size(1);
  at::Tensor data = at::empty({rows, cols}, m.options().dtype(dtype));
  at::Tensor e8m0 = at::empty({rows, cols / kMxBlock}, m.options().dtype(at::kByte));
  if (m.numel() == 0) return {data, e8m0};
  dispatch_types(m.scalar_type(), dtype, "quantize_mxfp8", [&](auto in, auto e4m3) {
    using In = decltype(in);
    constexpr bool E4M3 = decltype(e4m3)::value;
    const auto* x = static_cast<const typename In::Raw*>(m.const_data_ptr());
    const int64_t quads_total = m.numel() / 4;
    mx_kernel<In, E4M3><<<grid_for(quads_total, kThreads), kThreads, 0, stream>>>(
        x, quads_total, quads_fit<In>(x, cols), mx_params(E4M3, ocp),
        static_cast<uint8_t*>(data.data_ptr()), static_cast<uint8_t*>(e8m0.data_ptr()));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {data, e8m0};
}

}  // namespace
}  // namespace cuda

TORCH_LIBRARY_IMPL(fastcast_kernels, CUDA, m) {
  m.impl("quantize_blocks", &cuda::quantize_blocks);
  m.impl("quantize_mxfp8", &cuda::quantize_mxfp8);
}

}  // namespace fastcast

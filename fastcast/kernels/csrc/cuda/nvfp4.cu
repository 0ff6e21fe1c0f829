// NVFP4 on CUDA: the CUDA kernel of quantize_nvfp4 (nvfp4.cpp), same signature, outputs
// and values (element.h's arithmetic: s_enc, the E4M3 block scales, the multipliers, the
// E2M1 rounding, stochastic rounding from the caller's draws).
//
// Two kernels on torch's current stream, nothing read back by the host: the tensor amax
// over the finite elements (each block's max of FP32 magnitude bits, atomicMax into one
// zeroed word), then the codes, which read that word and compute s_enc themselves. The
// codes kernel gives each 16x16 tile (a strip of 16 rows, a block of 16 columns) to a
// half-warp, lane i holding row i's 16 elements: the 1x16 row-wise blocks are a lane's
// own, a 16x16 tile's amax is a 16-lane shuffle max, and the 1x16 column-wise blocks (and
// the transposed codes of a tile) pass through shared memory. The loop runs per warp, so
// that both halves of a warp take part in every shuffle and __syncwarp.
//
// Stochastic rounding reads the draws the quantizer took with torch.rand on the tensor's
// device (NVFP4Quantizer._draws): torch's CUDA generator (Philox, seed and offset handled
// by torch, CUDA-graph safe), reproducible under torch.manual_seed, and the same numbers
// give the same codes as the CPU operator, bit for bit.

#include <torch/library.h>

#include <optional>
#include <tuple>

#include "common.cuh"

namespace fastcast {
namespace cuda {
namespace {

constexpr int kBlock = 16;
constexpr int kHalves = kThreads / kBlock;  // tiles in flight per thread block

// What the codes kernel needs besides x: the shape, the layouts asked, the draws and
// the outputs (null where not asked or empty).
struct Job {
  int64_t rows, cols;
  bool block_2d, rowwise, columnwise;
  bool vector_x;     // x 16-byte aligned (rows of 16 elements then are too)
  bool vector_rand;  // rand and rand_t 16-byte aligned
  const uint32_t* amax;  // the tensor amax's FP32 magnitude bits (pass 1)
  const float* rand;     // stochastic rounding draws laid out like x [R, K]
  const float* rand_t;   // draws of the 1x16 column-wise codes, [K, R]
  uint8_t* data;         // [R, K/2]
  uint8_t* scale;        // [R, K/16]; 16x16: [R/16, K/16]
  uint8_t* data_t;       // [K, R/2]
  uint8_t* scale_t;      // [K, R/16]; 16x16: [K/16, R/16]
  float* global_scale_inv;
};

// ---- Pass 1: the tensor amax over the finite elements ----------------------------------

template <typename In>
__global__ void __launch_bounds__(kThreads)
    finite_amax_kernel(const typename In::Raw* __restrict__ x, int64_t n, bool vectorized,
                       uint32_t* amax) {
  __shared__ uint32_t shared[kWarps];
  using V = Vec<In>;
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  const int64_t first = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  const int64_t vecs = vectorized ? n / V::kSize : 0;
  const V* __restrict__ xv = reinterpret_cast<const V*>(x);
  uint32_t m = 0;  // In's magnitude bits; infinities and NaN left out
  for (int64_t i = first; i < vecs; i += stride) {
    const V v = xv[i];
#pragma unroll
    for (int j = 0; j < V::kSize; ++j) {
      const uint32_t b = In::magnitude(v.v[j]);
      m = max_of(m, b < In::kInfMagnitude ? b : 0u);
    }
  }
  for (int64_t i = vecs * V::kSize + first; i < n; i += stride) {
    const uint32_t b = In::magnitude(x[i]);
    m = max_of(m, b < In::kInfMagnitude ? b : 0u);
  }
  m = block_max(m, shared);
  if (threadIdx.x == 0 && m != 0) atomicMax(amax, magnitude_f32(In::from_magnitude(m)));
}

// ---- Pass 2: scales and codes ----------------------------------------------------------

// 16 consecutive elements from p (four or two 16-byte loads when aligned).
template <typename In>
__device__ __forceinline__ void load_16(const typename In::Raw* p, bool vectorized,
                                        typename In::Raw (&out)[kBlock]) {
  using V = Vec<In>;
  if (vectorized) {
#pragma unroll
    for (int k = 0; k < kBlock / V::kSize; ++k) {
      const V v = reinterpret_cast<const V*>(p)[k];
#pragma unroll
      for (int j = 0; j < V::kSize; ++j) out[k * V::kSize + j] = v.v[j];
    }
  } else {
#pragma unroll
    for (int j = 0; j < kBlock; ++j) out[j] = p[j];
  }
}

// The j-th of 16 consecutive draws from p (rare path: not 16-byte aligned) or the four
// 16-byte loads' values.
__device__ __forceinline__ void load_draws(const float* p, bool vectorized, float (&out)[kBlock]) {
  if (vectorized) {
#pragma unroll
    for (int k = 0; k < kBlock / 4; ++k) {
      const float4 v = reinterpret_cast<const float4*>(p)[k];
      out[4 * k] = v.x;
      out[4 * k + 1] = v.y;
      out[4 * k + 2] = v.z;
      out[4 * k + 3] = v.w;
    }
  } else {
#pragma unroll
    for (int j = 0; j < kBlock; ++j) out[j] = p[j];
  }
}

// Block scale byte and encode multiplier of a block whose amax is `amax_b`.
struct BlockScale {
  uint8_t byte;
  float multiplier;
};

__device__ __forceinline__ BlockScale block_scale(float amax_b, float s_enc_6, float s_dec_global) {
  const uint8_t byte = nvfp4_decode_scale(amax_b, s_enc_6);
  return BlockScale{byte, nvfp4_encode_multiplier(byte, s_dec_global)};
}

// The 16 signed codes of `v` under one multiplier, packed two a byte (the first in the
// low nibble) into 8 bytes, little-endian.
template <bool Stochastic>
__device__ __forceinline__ uint64_t packed_codes(const float (&v)[kBlock], float multiplier,
                                                 const float (&draw)[kBlock]) {
  uint64_t word = 0;
#pragma unroll
  for (int j = 0; j < kBlock; ++j)
    word |= uint64_t{e2m1_code<Stochastic>(v[j], multiplier, Stochastic ? draw[j] : 0.0f)}
            << (4 * j);
  return word;
}

template <typename In, bool Stochastic>
__global__ void __launch_bounds__(kThreads) codes_kernel(const typename In::Raw* __restrict__ x,
                                                         Job job) {
  // Per half-warp: the tile's values (1x16 column-wise blocks) and its codes (16x16
  // column-wise layout), rows padded by one word against bank conflicts.
  __shared__ float values[kHalves][kBlock][kBlock + 1];
  __shared__ uint8_t codes[kHalves][kBlock][kBlock + 1];
  const int lane = threadIdx.x % 32, i = lane % kBlock;
  const int half = threadIdx.x / kBlock;  // this half-warp's slot in shared memory
  const int64_t rows = job.rows, cols = job.cols, blocks = cols / kBlock;
  const int64_t strips = (rows + kBlock - 1) / kBlock, tiles = strips * blocks;
  const float s_enc = nvfp4_encode_scale(float_of(*job.amax));
  const float s_enc_6 = s_enc * kOneSixth, s_dec_global = 1.0f / s_enc;
  if (blockIdx.x == 0 && threadIdx.x == 0) *job.global_scale_inv = 1.0f / s_enc;
  const bool rows_1x16 = job.rowwise && !job.block_2d;
  const bool cols_1x16 = job.columnwise && !job.block_2d;
  const int64_t warps = int64_t{gridDim.x} * kWarps;
  for (int64_t w = int64_t{blockIdx.x} * kWarps + threadIdx.x / 32; 2 * w < tiles; w += warps) {
    const int64_t t = 2 * w + lane / kBlock;
    const bool tile_in = t < tiles;
    const int64_t strip = tile_in ? t / blocks : 0, cb = tile_in ? t % blocks : 0;
    const int64_t r = strip * kBlock + i, c0 = cb * kBlock;
    const bool row_in = tile_in && r < rows;  // only a 1x16 row-wise last strip is short

    typename In::Raw raw[kBlock];
    float v[kBlock], draw[kBlock];
    uint32_t m = 0;
    if (row_in) {
      load_16<In>(x + r * cols + c0, job.vector_x, raw);
#pragma unroll
      for (int j = 0; j < kBlock; ++j) {
        m = max_of(m, In::magnitude(raw[j]));
        v[j] = In::widen(raw[j]);
      }
    } else {
#pragma unroll
      for (int j = 0; j < kBlock; ++j) v[j] = 0.0f;
    }
    const bool row_codes = job.block_2d || rows_1x16;
    if (Stochastic && row_codes && row_in)
      load_draws(job.rand + r * cols + c0, job.vector_rand, draw);

    if (job.block_2d) {  // one scale per tile, the same in both layouts
      const BlockScale s = block_scale(In::from_magnitude(group_max<kBlock>(m)), s_enc_6,
                                       s_dec_global);
      const uint64_t word = packed_codes<Stochastic>(v, s.multiplier, draw);
      if (tile_in && job.data != nullptr) {
        *reinterpret_cast<uint64_t*>(job.data + r * (cols / 2) + c0 / 2) = word;
        if (i == 0) job.scale[strip * blocks + cb] = s.byte;
      }
      if (job.data_t != nullptr) {
#pragma unroll
        for (int j = 0; j < kBlock; ++j) codes[half][i][j] = (word >> (4 * j)) & 0xFu;
        __syncwarp();
        uint64_t word_t = 0;  // column c0 + i, rows of the strip
#pragma unroll
        for (int k = 0; k < kBlock; ++k) word_t |= uint64_t{codes[half][k][i]} << (4 * k);
        __syncwarp();  // the next tile rewrites codes
        if (tile_in) {
          *reinterpret_cast<uint64_t*>(job.data_t + (c0 + i) * (rows / 2) + strip * 8) = word_t;
          if (i == 0) job.scale_t[cb * strips + strip] = s.byte;
        }
      }
      continue;
    }
    if (rows_1x16 && row_in) {
      const BlockScale s = block_scale(In::from_magnitude(m), s_enc_6, s_dec_global);
      *reinterpret_cast<uint64_t*>(job.data + r * (cols / 2) + c0 / 2) =
          packed_codes<Stochastic>(v, s.multiplier, draw);
      job.scale[r * blocks + cb] = s.byte;
    }
    if (cols_1x16) {  // lane i takes column c0 + i of the tile (R % 16 == 0 here)
#pragma unroll
      for (int j = 0; j < kBlock; ++j) values[half][i][j] = v[j];
      __syncwarp();
      uint32_t mc = 0;
#pragma unroll
      for (int k = 0; k < kBlock; ++k) {
        v[k] = values[half][k][i];
        mc = max_of(mc, magnitude_f32(v[k]));
      }
      __syncwarp();  // the next tile rewrites values
      if (tile_in) {
        const int64_t c = c0 + i;
        if (Stochastic) load_draws(job.rand_t + c * rows + strip * kBlock, job.vector_rand, draw);
        const BlockScale s = block_scale(float_of(mc), s_enc_6, s_dec_global);
        *reinterpret_cast<uint64_t*>(job.data_t + c * (rows / 2) + strip * 8) =
            packed_codes<Stochastic>(v, s.multiplier, draw);
        job.scale_t[c * strips + strip] = s.byte;
      }
    }
  }
}

// ---- The operator ----------------------------------------------------------------------

int64_t leading_rows(const at::Tensor& x) {
  int64_t rows = 1;
  for (int64_t d = 0; d + 1 < x.dim(); ++d) rows *= x.size(d);
  return rows;
}

// Draws for stochastic rounding: FP32 on x's device, `numel` elements in the layout's
// order.
at::Tensor draws(const std::optional<at::Tensor>& rand, const at::Tensor& x, int64_t numel,
                 const char* what) {
  TORCH_CHECK(rand.has_value(), "fastcast::quantize_nvfp4: stochastic rounding needs ", what);
  TORCH_CHECK(rand->device() == x.device() && rand->scalar_type() == at::kFloat &&
                  rand->numel() == numel,
              "fastcast::quantize_nvfp4: ", what, " must be FP32 on ", x.device(), " with ",
              numel, " elements");
  return rand->contiguous();
}

uint8_t* bytes_of(at::Tensor& t) {
  return t.numel() ? static_cast<uint8_t*>(t.data_ptr()) : nullptr;
}

template <typename In, bool Stochastic>
void launch(const at::Tensor& x, const Job& job, uint32_t* amax, cudaStream_t stream) {
  const auto* src = static_cast<const typename In::Raw*>(x.const_data_ptr());
  const int64_t n = x.numel();
  finite_amax_kernel<In><<<grid_for(n, int64_t{kThreads} * Vec<In>::kSize), kThreads, 0,
                           stream>>>(src, n, aligned_16(src), amax);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const int64_t tiles = ((job.rows + kBlock - 1) / kBlock) * (job.cols / kBlock);
  codes_kernel<In, Stochastic><<<grid_for(tiles, kHalves), kThreads, 0, stream>>>(src, job);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// quantize_nvfp4 (nvfp4.cpp has the contract): data [R, K/2], scale_inv, data_t
// [K, R/2], scale_inv_t (each with 0 rows where not asked), global_scale_inv (0-dim).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_nvfp4(
    const at::Tensor& input, bool block_2d, bool rowwise, bool columnwise, bool stochastic,
    const std::optional<at::Tensor>& rand, const std::optional<at::Tensor>& rand_t) {
  TORCH_CHECK(input.is_cuda(), "fastcast::quantize_nvfp4: CUDA tensors only");
  TORCH_CHECK(input.dim() > 0, "fastcast::quantize_nvfp4: needs at least one dim");
  TORCH_CHECK(rowwise || columnwise,
              "fastcast::quantize_nvfp4: ask for rowwise and/or columnwise data");
  const c10::cuda::CUDAGuard guard(input.device());
  const at::Tensor x = input.contiguous();
  const int64_t cols = x.size(-1), rows = leading_rows(x);
  TORCH_CHECK(cols % kBlock == 0, "fastcast::quantize_nvfp4: K must be a multiple of 16");
  TORCH_CHECK(!(block_2d || columnwise) || rows % kBlock == 0,
              "fastcast::quantize_nvfp4: R must be a multiple of 16");
  const cudaStream_t stream = current_stream();

  const auto bytes = x.options().dtype(at::kByte);
  const auto e4m3 = x.options().dtype(at::kFloat8_e4m3fn);
  const int64_t blocks = cols / kBlock, strips = rows / kBlock;
  at::Tensor data = at::empty({rowwise ? rows : 0, cols / 2}, bytes);
  at::Tensor scale = at::empty({rowwise ? (block_2d ? strips : rows) : 0, blocks}, e4m3);
  at::Tensor data_t = at::empty({columnwise ? cols : 0, rows / 2}, bytes);
  at::Tensor scale_t = block_2d ? at::empty({columnwise ? blocks : 0, strips}, e4m3)
                                : at::empty({columnwise ? cols : 0, strips}, e4m3);
  at::Tensor global_scale_inv = at::empty({}, x.options().dtype(at::kFloat));
  // The amax word: zeroed, then folded into by pass 1 (the caching allocator's block, so
  // no cudaMalloc in a training step, and capturable).
  at::Tensor amax = at::empty({1}, x.options().dtype(at::kInt));
  C10_CUDA_CHECK(cudaMemsetAsync(amax.data_ptr(), 0, sizeof(uint32_t), stream));

  at::Tensor rand_c, rand_t_c;
  if (stochastic && (rowwise || block_2d)) rand_c = draws(rand, x, rows * cols, "rand");
  if (stochastic && columnwise && !block_2d) rand_t_c = draws(rand_t, x, rows * cols, "rand_t");
  Job job{rows, cols, block_2d, rowwise, columnwise};
  job.vector_x = aligned_16(x.const_data_ptr());
  job.rand = rand_c.defined() ? rand_c.const_data_ptr<float>() : nullptr;
  job.rand_t = rand_t_c.defined() ? rand_t_c.const_data_ptr<float>() : nullptr;
  job.vector_rand = (job.rand == nullptr || aligned_16(job.rand)) &&
                    (job.rand_t == nullptr || aligned_16(job.rand_t));
  job.amax = static_cast<const uint32_t*>(amax.const_data_ptr());
  job.data = bytes_of(data);
  job.scale = bytes_of(scale);
  job.data_t = bytes_of(data_t);
  job.scale_t = bytes_of(scale_t);
  job.global_scale_inv = global_scale_inv.data_ptr<float>();

  auto* folded = static_cast<uint32_t*>(amax.data_ptr());
  auto run = [&](auto in) {
    using In = decltype(in);
    if (stochastic)
      launch<In, true>(x, job, folded, stream);
    else
      launch<In, false>(x, job, folded, stream);
  };
  switch (x.scalar_type()) {
    case at::kFloat: run(F32{}); break;
    case at::kBFloat16: run(BF16{}); break;
    case at::kHalf: run(F16{}); break;
    default: TORCH_CHECK(false, "fastcast::quantize_nvfp4: cannot quantize ", x.scalar_type());
  }
  return {data, scale, data_t, scale_t, global_scale_inv};
}

}  // namespace
}  // namespace cuda

TORCH_LIBRARY_IMPL(fastcast_kernels, CUDA, m) {
  m.impl("quantize_nvfp4", &cuda::quantize_nvfp4);
}

}  // namespace fastcast

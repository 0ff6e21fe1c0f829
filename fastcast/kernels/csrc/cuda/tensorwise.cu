// Per-tensor FP8 quantization on CUDA: the CUDA kernels of the operators tensorwise.cpp
// defines (quantize_tensorwise, record_amax, quantize_recording), with the same
// signatures, outputs and values (element.h's arithmetic).
//
// Current scaling is two kernels on torch's current stream: the amax (each block's max
// of magnitude bits folded with atomicMax; the last block to finish turns it into the
// scale and scale_inv, in device memory) and the cast, which reads that scale. Nothing
// waits on the host. Delayed scaling's recording cast is one kernel: the cast with the
// given scale, its amax folded the same way and recorded into the slot by the last
// block. The column-wise (transposed) codes come from a tiled kernel that also writes the
// row-wise codes when both are asked for, so x is read once.

#include <torch/library.h>

#include <optional>
#include <tuple>

#include "common.cuh"

namespace fastcast {
namespace cuda {
namespace {

// The scratch of the amax fold: [0] max magnitude bits, [1] blocks done (both zeroed
// before the kernel), [2] the scale (FP32 bits) once the last block has computed it.
constexpr int64_t kScratch = 4;

// This thread's max magnitude bits over its share of x[0, n): 16-byte vector loads when
// x is 16-byte aligned, then the tail element by element.
template <typename In>
__device__ __forceinline__ uint32_t local_max(const typename In::Raw* __restrict__ x, int64_t n,
                                              bool vectorized) {
  using V = Vec<In>;
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  const int64_t first = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  const int64_t vecs = vectorized ? n / V::kSize : 0;
  const V* __restrict__ xv = reinterpret_cast<const V*>(x);
  uint32_t m = 0;
  for (int64_t i = first; i < vecs; i += stride) {
    const V v = xv[i];
#pragma unroll
    for (int j = 0; j < V::kSize; ++j) m = max_of(m, In::magnitude(v.v[j]));
  }
  for (int64_t i = vecs * V::kSize + first; i < n; i += stride) m = max_of(m, In::magnitude(x[i]));
  return m;
}

// record_into (tensorwise.cpp): slot = max(slot, amax) for a finite amax only.
__device__ __forceinline__ void record_into(float* slot, float amax) {
  if (is_finite(amax)) *slot = max_of(*slot, amax);
}

// Current scaling, pass 1: the amax of x, then (last block) scale_from_amax into
// scratch[2] and its reciprocal into scale_inv.
template <typename In>
__global__ void __launch_bounds__(kThreads)
    amax_scale_kernel(const typename In::Raw* __restrict__ x, int64_t n, bool vectorized,
                      uint32_t* scratch, float* scale_inv, float fmt_max, bool power_2,
                      double epsilon) {
  const uint32_t m = local_max<In>(x, n, vectorized);
  if (fold_block_max(m, scratch)) {
    const float s = scale_from_amax(In::from_magnitude(folded_max(scratch)), fmt_max, power_2,
                                    epsilon);
    scratch[2] = bits_of(s);
    *scale_inv = 1.0f / s;
  }
}

// record_amax: the amax of x folded over the blocks, recorded by the last one.
template <typename In>
__global__ void __launch_bounds__(kThreads)
    record_kernel(const typename In::Raw* __restrict__ x, int64_t n, bool vectorized,
                  uint32_t* scratch, float* slot) {
  const uint32_t m = local_max<In>(x, n, vectorized);
  if (fold_block_max(m, scratch)) record_into(slot, In::from_magnitude(folded_max(scratch)));
}

// out[i] = cast(x[i] * scale) over [0, n), scale read from device memory. Block 0 writes
// 1 / scale to scale_inv when that is given (a scale from the caller). With Record, the
// amax of x is folded into scratch and recorded into slot (quantize_recording).
template <typename In, bool E4M3, bool Record>
__global__ void __launch_bounds__(kThreads)
    cast_kernel(const typename In::Raw* __restrict__ x, int64_t n, bool vectorized,
                uint8_t* __restrict__ out, const float* scale, float* scale_inv,
                uint32_t* scratch, float* slot) {
  using V = Vec<In>;
  using C = Codes<V::kSize>;
  constexpr float fmt_max = kFmtMax<E4M3>;
  const float s = *scale;
  if (scale_inv != nullptr && blockIdx.x == 0 && threadIdx.x == 0) *scale_inv = 1.0f / s;
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  const int64_t first = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  const int64_t vecs = vectorized ? n / V::kSize : 0;
  const V* __restrict__ xv = reinterpret_cast<const V*>(x);
  C* __restrict__ outv = reinterpret_cast<C*>(out);
  uint32_t m = 0;
  for (int64_t i = first; i < vecs; i += stride) {
    const V v = xv[i];
    C c;
#pragma unroll
    for (int j = 0; j < V::kSize; ++j) {
      if (Record) m = max_of(m, In::magnitude(v.v[j]));
      c.c[j] = cast_fp8<E4M3>(In::widen(v.v[j]), s, fmt_max);
    }
    outv[i] = c;
  }
  for (int64_t i = vecs * V::kSize + first; i < n; i += stride) {
    if (Record) m = max_of(m, In::magnitude(x[i]));
    out[i] = cast_fp8<E4M3>(In::widen(x[i]), s, fmt_max);
  }
  if (Record && fold_block_max(m, scratch))
    record_into(slot, In::from_magnitude(folded_max(scratch)));
}

// Square tiles of the transposed cast: 64 x 64 elements per block, each thread four
// consecutive elements of four rows; the codes pass through shared memory, a row of
// the tile as 16 words (+1, which spreads the transposed reads over the banks).
constexpr int kTile = 64;
constexpr int kTileWords = kTile / 4;

// x viewed as [rows, cols]: out_t[c, r] = cast(x[r, c] * scale) ([cols, rows], contiguous)
// and, when out is given, out[r, c] too (x's layout). `vectorized`: cols % 4 == 0 and x
// aligned for Quad loads (then every row starts aligned, and so does every 4-code word
// of out). Block 0 writes scale_inv when given.
template <typename In, bool E4M3>
__global__ void __launch_bounds__(kThreads)
    cast_tiles_kernel(const typename In::Raw* __restrict__ x, int64_t rows, int64_t cols,
                      bool vectorized, uint8_t* __restrict__ out, uint8_t* __restrict__ out_t,
                      const float* scale, float* scale_inv) {
  constexpr float fmt_max = kFmtMax<E4M3>;
  __shared__ uint32_t tile[kTile][kTileWords + 1];
  const float s = *scale;
  if (scale_inv != nullptr && blockIdx.x == 0 && threadIdx.x == 0) *scale_inv = 1.0f / s;
  const int64_t col_tiles = (cols + kTile - 1) / kTile;
  const int64_t tiles = col_tiles * ((rows + kTile - 1) / kTile);
  const int tx = threadIdx.x % kTileWords, ty = threadIdx.x / kTileWords;
  // Rows of out_t are written 4 codes (one word) at a time where they stay aligned.
  const bool words_t = rows % 4 == 0;
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int64_t r0 = (t / col_tiles) * kTile, c0 = (t % col_tiles) * kTile;
    const int64_t c = c0 + 4 * tx;
#pragma unroll
    for (int k = 0; k < kTile / (kThreads / kTileWords); ++k) {
      const int rl = ty + k * (kThreads / kTileWords);
      const int64_t r = r0 + rl;
      uint32_t word = 0;
      if (r < rows && c < cols) {
        const typename In::Raw* row = x + r * cols;
        if (vectorized) {
          word = cast_quad<In, E4M3>(*reinterpret_cast<const Quad<In>*>(row + c), s, fmt_max);
          if (out != nullptr) *reinterpret_cast<uint32_t*>(out + r * cols + c) = word;
        } else {
          for (int j = 0; j < 4 && c + j < cols; ++j) {
            const uint8_t code = cast_fp8<E4M3>(In::widen(row[c + j]), s, fmt_max);
            word |= uint32_t{code} << (8 * j);
            if (out != nullptr) out[r * cols + c + j] = code;
          }
        }
      }
      tile[rl][tx] = word;
    }
    __syncthreads();
    // out_t: 16 threads per column, each 4 consecutive rows (one word of out_t's row).
#pragma unroll
    for (int k = 0; k < kTile * kTileWords / kThreads; ++k) {
      const int item = threadIdx.x + k * kThreads;
      const int cl = item / kTileWords, g = item % kTileWords;
      const int64_t col = c0 + cl, r = r0 + 4 * g;
      if (col >= cols || r >= rows) continue;
      uint32_t word = 0;
#pragma unroll
      for (int i = 0; i < 4; ++i)
        word |= ((tile[4 * g + i][cl / 4] >> (8 * (cl % 4))) & 0xFFu) << (8 * i);
      uint8_t* dst = out_t + col * rows + r;
      if (words_t) {
        *reinterpret_cast<uint32_t*>(dst) = word;
      } else {
        for (int i = 0; i < 4 && r + i < rows; ++i) dst[i] = static_cast<uint8_t>(word >> (8 * i));
      }
    }
    __syncthreads();  // the tile is rewritten by the next iteration
  }
}

// R of x viewed as [R, K]: the product of the leading dims (1 for a 1-D x).
int64_t leading_rows(const at::Tensor& x) {
  int64_t rows = 1;
  for (int64_t d = 0; d + 1 < x.dim(); ++d) rows *= x.size(d);
  return rows;
}

// A zeroed scratch for the amax fold (kScratch words), on x's device and stream.
at::Tensor amax_scratch(const at::Tensor& x, cudaStream_t stream) {
  at::Tensor scratch = at::empty({kScratch}, x.options().dtype(at::kInt));
  C10_CUDA_CHECK(cudaMemsetAsync(scratch.data_ptr(), 0, 2 * sizeof(uint32_t), stream));
  return scratch;
}

template <typename In>
const typename In::Raw* raw(const at::Tensor& x) {
  return static_cast<const typename In::Raw*>(x.const_data_ptr());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_tensorwise(
    const at::Tensor& input, const std::optional<at::Tensor>& scale, at::ScalarType dtype,
    bool power_2, double epsilon, bool rowwise, bool columnwise) {
  TORCH_CHECK(input.is_cuda(), "fastcast::quantize_tensorwise: CUDA tensors only");
  TORCH_CHECK(input.dim() > 0, "fastcast::quantize_tensorwise: needs at least one dim");
  const c10::cuda::CUDAGuard guard(input.device());
  const at::Tensor x = input.contiguous();
  const cudaStream_t stream = current_stream();
  const int64_t n = x.numel(), cols = x.size(-1), rows = leading_rows(x);

  const auto bytes = x.options().dtype(dtype);
  at::Tensor data = at::empty(rowwise ? x.sizes() : at::IntArrayRef{0}, bytes);
  at::Tensor data_t = columnwise ? at::empty({cols, rows}, bytes) : at::empty({0}, bytes);
  at::Tensor scale_inv, scratch;
  if (scale.has_value()) {
    check_scalar(*scale, x, "quantize_tensorwise", "scale");
    scale_inv = at::empty_like(*scale, at::MemoryFormat::Contiguous);
  } else {
    scale_inv = at::empty({}, x.options().dtype(at::kFloat));
    scratch = amax_scratch(x, stream);
  }

  dispatch_types(x.scalar_type(), dtype, "quantize_tensorwise", [&](auto in, auto e4m3) {
    using In = decltype(in);
    constexpr bool E4M3 = decltype(e4m3)::value;
    const auto* src = raw<In>(x);
    const bool vectorized = aligned_16(src);
    const float* s;
    float* inv = nullptr;  // written by the cast for a given scale, else by the amax pass
    if (scale.has_value()) {
      s = scale->const_data_ptr<float>();
      inv = scale_inv.data_ptr<float>();
    } else {
      auto* folded = static_cast<uint32_t*>(scratch.data_ptr());
      amax_scale_kernel<In><<<grid_for(n, int64_t{kThreads} * Vec<In>::kSize), kThreads, 0,
                              stream>>>(src, n, vectorized, folded, scale_inv.data_ptr<float>(),
                                        kFmtMax<E4M3>, power_2, epsilon);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      s = reinterpret_cast<const float*>(folded + 2);
    }
    auto* codes = rowwise ? static_cast<uint8_t*>(data.data_ptr()) : nullptr;
    if (columnwise) {
      const bool quads = quads_fit<In>(src, cols);
      const int64_t tiles = ((rows + kTile - 1) / kTile) * ((cols + kTile - 1) / kTile);
      cast_tiles_kernel<In, E4M3><<<grid_for(tiles, 1), kThreads, 0, stream>>>(
          src, rows, cols, quads, codes, static_cast<uint8_t*>(data_t.data_ptr()), s, inv);
    } else {
      // Without either layout only the scale_inv of a given scale is left to write: one
      // block over no elements.
      const int64_t m = rowwise ? n : 0;
      cast_kernel<In, E4M3, false><<<grid_for(m, int64_t{kThreads} * Vec<In>::kSize), kThreads, 0,
                                     stream>>>(src, m, vectorized, codes, s, inv, nullptr, nullptr);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {data, scale_inv, data_t};
}

void record_amax(const at::Tensor& slot, const at::Tensor& input) {
  TORCH_CHECK(input.is_cuda(), "fastcast::record_amax: CUDA tensors only");
  check_scalar(slot, input, "record_amax", "the slot");
  const c10::cuda::CUDAGuard guard(input.device());
  const at::Tensor x = input.contiguous();
  const cudaStream_t stream = current_stream();
  const at::Tensor scratch = amax_scratch(x, stream);
  auto run = [&](auto in) {
    using In = decltype(in);
    const auto* src = raw<In>(x);
    const int64_t n = x.numel();
    record_kernel<In><<<grid_for(n, int64_t{kThreads} * Vec<In>::kSize), kThreads, 0, stream>>>(
        src, n, aligned_16(src), static_cast<uint32_t*>(scratch.data_ptr()),
        slot.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  switch (x.scalar_type()) {
    case at::kFloat: return run(F32{});
    case at::kBFloat16: return run(BF16{});
    case at::kHalf: return run(F16{});
    default: TORCH_CHECK(false, "fastcast: cannot quantize ", x.scalar_type());
  }
}

std::tuple<at::Tensor, at::Tensor> quantize_recording(const at::Tensor& input,
                                                      const at::Tensor& scale,
                                                      const at::Tensor& slot,
                                                      at::ScalarType dtype) {
  TORCH_CHECK(input.is_cuda(), "fastcast::quantize_recording: CUDA tensors only");
  TORCH_CHECK(input.dim() > 0, "fastcast::quantize_recording: needs at least one dim");
  check_scalar(scale, input, "quantize_recording", "scale");
  check_scalar(slot, input, "quantize_recording", "the slot");
  const c10::cuda::CUDAGuard guard(input.device());
  const at::Tensor x = input.contiguous();
  const cudaStream_t stream = current_stream();
  at::Tensor scale_inv = at::empty_like(scale, at::MemoryFormat::Contiguous);
  at::Tensor data = at::empty(x.sizes(), x.options().dtype(dtype));
  const at::Tensor scratch = amax_scratch(x, stream);
  dispatch_types(x.scalar_type(), dtype, "quantize_recording", [&](auto in, auto e4m3) {
    using In = decltype(in);
    const auto* src = raw<In>(x);
    const int64_t n = x.numel();
    cast_kernel<In, decltype(e4m3)::value, true>
        <<<grid_for(n, int64_t{kThreads} * Vec<In>::kSize), kThreads, 0, stream>>>(
            src, n, aligned_16(src), static_cast<uint8_t*>(data.data_ptr()),
            scale.const_data_ptr<float>(), scale_inv.data_ptr<float>(),
            static_cast<uint32_t*>(scratch.data_ptr()), slot.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {data, scale_inv};
}

}  // namespace
}  // namespace cuda

TORCH_LIBRARY_IMPL(fastcast_kernels, CUDA, m) {
  m.impl("quantize_tensorwise", &cuda::quantize_tensorwise);
  m.impl("record_amax", &cuda::record_amax);
  m.impl("quantize_recording", &cuda::quantize_recording);
}

}  // namespace fastcast

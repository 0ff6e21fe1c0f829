// Row-wise FP8 on CUDA: the CUDA kernel of quantize_rows (rows.cpp), same signature,
// outputs and values. One scale per row: a warp per row, which reads the row for its
// amax and again (from cache) for the cast. One scale per column: the column maxima
// folded with atomicMax, the scales from them, then the cast (three kernels, no host
// sync).

#include <torch/library.h>

#include <tuple>

#include "common.cuh"

namespace fastcast {
namespace cuda {
namespace {

constexpr int kRowsPerBlock = kWarps;  // a warp per row

// Row r of x [rows, cols] quantized with scale_from_amax of its own amax; inv[r] = 1 / s.
// `quads`: every row is aligned for Quad loads (cols % 4 == 0, x aligned).
template <typename In, bool E4M3>
__global__ void __launch_bounds__(kThreads)
    per_row_kernel(const typename In::Raw* __restrict__ x, int64_t rows, int64_t cols, bool quads,
                   bool power_2, uint8_t* __restrict__ out, float* __restrict__ inv) {
  constexpr float fmt_max = kFmtMax<E4M3>;
  const int lane = threadIdx.x % 32;
  const int64_t quad_count = quads ? cols / 4 : 0;
  for (int64_t r = int64_t{blockIdx.x} * kRowsPerBlock + threadIdx.x / 32; r < rows;
       r += int64_t{gridDim.x} * kRowsPerBlock) {
    const typename In::Raw* row = x + r * cols;
    const auto* row_q = reinterpret_cast<const Quad<In>*>(row);
    uint32_t m = 0;
    for (int64_t q = lane; q < quad_count; q += 32) {
      const Quad<In> v = row_q[q];
#pragma unroll
      for (int j = 0; j < 4; ++j) m = max_of(m, In::magnitude(v.v[j]));
    }
    for (int64_t c = quad_count * 4 + lane; c < cols; c += 32) m = max_of(m, In::magnitude(row[c]));
    m = group_max<32>(m);
    const float s = scale_from_amax(In::from_magnitude(m), fmt_max, power_2, 0.0);
    uint8_t* dst = out + r * cols;
    for (int64_t q = lane; q < quad_count; q += 32)
      reinterpret_cast<uint32_t*>(dst)[q] = cast_quad<In, E4M3>(row_q[q], s, fmt_max);
    for (int64_t c = quad_count * 4 + lane; c < cols; c += 32)
      dst[c] = cast_fp8<E4M3>(In::widen(row[c]), s, fmt_max);
    if (lane == 0) inv[r] = 1.0f / s;
  }
}

// Column maxima: block (bx, by) folds rows [by * kSlab, ...) of columns
// [bx * kThreads, ...) into col_max (zeroed), one column per thread.
constexpr int64_t kSlab = 256;

template <typename In>
__global__ void __launch_bounds__(kThreads)
    column_max_kernel(const typename In::Raw* __restrict__ x, int64_t rows, int64_t cols,
                      uint32_t* __restrict__ col_max) {
  const int64_t c = int64_t{blockIdx.x} * kThreads + threadIdx.x;
  if (c >= cols) return;
  for (int64_t r0 = int64_t{blockIdx.y} * kSlab; r0 < rows; r0 += int64_t{gridDim.y} * kSlab) {
    const int64_t r1 = min_of(rows, r0 + kSlab);
    uint32_t m = 0;
    for (int64_t r = r0; r < r1; ++r) m = max_of(m, In::magnitude(x[r * cols + c]));
    atomicMax(col_max + c, m);
  }
}

// scale[c] and inv[c] from the column maxima (scale_from_amax, as per_column does).
template <typename In, bool E4M3>
__global__ void __launch_bounds__(kThreads)
    column_scale_kernel(const uint32_t* __restrict__ col_max, int64_t cols, bool power_2,
                        float* __restrict__ scale, float* __restrict__ inv) {
  for (int64_t c = int64_t{blockIdx.x} * kThreads + threadIdx.x; c < cols;
       c += int64_t{gridDim.x} * kThreads) {
    const float s = scale_from_amax(In::from_magnitude(col_max[c]), kFmtMax<E4M3>, power_2, 0.0);
    scale[c] = s;
    inv[c] = 1.0f / s;
  }
}

// out[r, c] = cast(x[r, c] * scale[c]), four columns per thread where rows are aligned.
template <typename In, bool E4M3>
__global__ void __launch_bounds__(kThreads)
    column_cast_kernel(const typename In::Raw* __restrict__ x, int64_t rows, int64_t cols,
                       bool quads, const float* __restrict__ scale, uint8_t* __restrict__ out) {
  constexpr float fmt_max = kFmtMax<E4M3>;
  const int64_t stride = int64_t{gridDim.x} * kThreads;
  const int64_t first = int64_t{blockIdx.x} * kThreads + threadIdx.x;
  if (quads) {
    const int64_t per_row = cols / 4, n = rows * per_row;
    const auto* xq = reinterpret_cast<const Quad<In>*>(x);
    for (int64_t i = first; i < n; i += stride) {
      const int64_t c = (i % per_row) * 4;
      const Quad<In> v = xq[i];
      uint32_t word = 0;
#pragma unroll
      for (int j = 0; j < 4; ++j)
        word |= uint32_t{cast_fp8<E4M3>(In::widen(v.v[j]), scale[c + j], fmt_max)} << (8 * j);
      reinterpret_cast<uint32_t*>(out)[i] = word;
    }
    return;
  }
  const int64_t n = rows * cols;
  for (int64_t i = first; i < n; i += stride)
    out[i] = cast_fp8<E4M3>(In::widen(x[i]), scale[i % cols], fmt_max);
}

std::tuple<at::Tensor, at::Tensor> quantize_rows(const at::Tensor& input, at::ScalarType dtype,
                                                 bool power_2, bool columns) {
  TORCH_CHECK(input.is_cuda(), "fastcast::quantize_rows: CUDA tensors only");
  TORCH_CHECK(input.dim() == 2, "fastcast::quantize_rows: needs a matrix, got ", input.dim(),
              " dims");
  const c10::cuda::CUDAGuard guard(input.device());
  const at::Tensor m = input.contiguous();
  const cudaStream_t stream = current_stream();
  const int64_t rows = m.size(0), cols = m.size(1);
  at::Tensor data = at::empty({rows, cols}, m.options().dtype(dtype));
  at::Tensor scale_inv =
      at::empty(columns ? at::IntArrayRef{1, cols} : at::IntArrayRef{rows, 1},
                m.options().dtype(at::kFloat));
  dispatch_types(m.scalar_type(), dtype, "quantize_rows", [&](auto in, auto e4m3) {
    using In = decltype(in);
    constexpr bool E4M3 = decltype(e4m3)::value;
    const auto* x = static_cast<const typename In::Raw*>(m.const_data_ptr());
    auto* out = static_cast<uint8_t*>(data.data_ptr());
    float* inv = scale_inv.data_ptr<float>();
    const bool quads = quads_fit<In>(x, cols);
    if (!columns) {
      if (rows == 0) return;
      per_row_kernel<In, E4M3><<<grid_for(rows, kRowsPerBlock), kThreads, 0, stream>>>(
          x, rows, cols, quads, power_2, out, inv);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      return;
    }
    if (cols == 0) return;
    // Scratch: the column maxima (zeroed), then the FP32 scales.
    at::Tensor scratch = at::empty({2 * cols}, m.options().dtype(at::kInt));
    auto* col_max = static_cast<uint32_t*>(scratch.data_ptr());
    auto* scale = reinterpret_cast<float*>(col_max + cols);
    C10_CUDA_CHECK(cudaMemsetAsync(col_max, 0, cols * sizeof(uint32_t), stream));
    if (rows > 0) {
      const int64_t col_blocks = (cols + kThreads - 1) / kThreads;
      // Enough slabs of rows to fill the GPU; each folds with one atomic per column.
      const int64_t slabs = std::min<int64_t>((rows + kSlab - 1) / kSlab,
                                              std::max<int64_t>(1, max_blocks() / col_blocks));
      const dim3 grid(static_cast<unsigned>(col_blocks),
                      static_cast<unsigned>(std::min<int64_t>(slabs, 65535)));
      column_max_kernel<In><<<grid, kThreads, 0, stream>>>(x, rows, cols, col_max);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    column_scale_kernel<In, E4M3><<<grid_for(cols, kThreads), kThreads, 0, stream>>>(
        col_max, cols, power_2, scale, inv);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    if (rows > 0) {
      column_cast_kernel<In, E4M3>
          <<<grid_for(rows * cols, int64_t{kThreads} * 4), kThreads, 0, stream>>>(
              x, rows, cols, quads, scale, out);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  });
  return {data, scale_inv};
}

}  // namespace
}  // namespace cuda

TORCH_LIBRARY_IMPL(fastcast_kernels, CUDA, m) { m.impl("quantize_rows", &cuda::quantize_rows); }

}  // namespace fastcast

// Row-wise FP8 of a matrix [R, K]: one FP32 scale per row, or per column (the column-wise
// layout's rows are m's columns; its codes are written in m's layout, as the reference
// casts them, and the caller takes the transposed view).
//
// The values are exactly those of the PyTorch reference (fastcast/quantize/rowwise.py:
// row_amax, scale_from_amax, scale_and_cast); tests/test_rowwise.py checks them bit for
// bit. Per row, the amax and the cast read the row while it sits in cache; per column,
// one pass gathers the column maxima and a second casts. CPU only.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <vector>

#include "fp8.h"

namespace fastcast {
namespace {

// Columns per task of the column-maxima pass: each task reads a band of every row, long
// enough to stream, and keeps its maxima in L1.
constexpr int64_t kBand = 1024;

template <typename T, typename F8>
void per_row(const T* x, int64_t rows, int64_t cols, bool power_2, uint8_t* out, float* inv) {
  const float fmt_max = fmt_max_of<F8>();
  const int64_t grain = std::max<int64_t>(1, kGrain / std::max<int64_t>(cols, 1));
  at::parallel_for(0, rows, grain, [=](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = x + r * cols;
      const float amax = from_magnitude<T>(max_magnitude(row, cols));
      const float s = scale_from_amax(amax, fmt_max, power_2, 0.0);
      cast_span<T, F8>(row, out + r * cols, cols, s, fmt_max);
      inv[r] = 1.0f / s;
    }
  });
}

template <typename T, typename F8>
void per_column(const T* x, int64_t rows, int64_t cols, bool power_2, uint8_t* out,
                float* inv) {
  const float fmt_max = fmt_max_of<F8>();
  std::vector<float> scale(cols);
  at::parallel_for(0, (cols + kBand - 1) / kBand, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint32_t> m(kBand);
    for (int64_t band = begin; band < end; ++band) {
      const int64_t c0 = band * kBand, width = std::min(kBand, cols - c0);
      std::fill_n(m.begin(), width, 0u);
      for (int64_t r = 0; r < rows; ++r) max_magnitude_each(x + r * cols + c0, m.data(), width);
      for (int64_t c = 0; c < width; ++c) {
        scale[c0 + c] = scale_from_amax(from_magnitude<T>(m[c]), fmt_max, power_2, 0.0);
        inv[c0 + c] = 1.0f / scale[c0 + c];
      }
    }
  });
  const int64_t grain = std::max<int64_t>(1, kGrain / std::max<int64_t>(cols, 1));
  const float* s = scale.data();
  at::parallel_for(0, rows, grain, [=](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      cast_span_each<T, F8>(x + r * cols, out + r * cols, cols, s, fmt_max);
  });
}

// m [R, K] quantized to `dtype` with one scale per row (scale_inv [R, 1]) or, with
// `per_column`, one per column (scale_inv [1, K]); data [R, K] in m's layout either way.
std::tuple<at::Tensor, at::Tensor> quantize_rows(const at::Tensor& input, at::ScalarType dtype,
                                                 bool power_2, bool columns) {
  TORCH_CHECK(input.device().is_cpu(), "fastcast::quantize_rows: CPU tensors only");
  TORCH_CHECK(input.dim() == 2, "fastcast::quantize_rows: needs a matrix, got ", input.dim(),
              " dims");
  const at::Tensor m = input.contiguous();
  const int64_t rows = m.size(0), cols = m.size(1);
  at::Tensor data = at::empty({rows, cols}, m.options().dtype(dtype));
  at::Tensor scale_inv =
      at::empty(columns ? at::IntArrayRef{1, cols} : at::IntArrayRef{rows, 1},
                m.options().dtype(at::kFloat));
  dispatch_types(m.scalar_type(), dtype, "quantize_rows", [&](auto t, auto f8) {
    using T = decltype(t);
    using F8 = decltype(f8);
    const T* x = m.const_data_ptr<T>();
    auto* out = static_cast<uint8_t*>(data.data_ptr());
    float* inv = scale_inv.data_ptr<float>();
    if (columns)
      per_column<T, F8>(x, rows, cols, power_2, out, inv);
    else
      per_row<T, F8>(x, rows, cols, power_2, out, inv);
  });
  return {data, scale_inv};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fastcast_kernels, m) {
  m.def("quantize_rows(Tensor m, ScalarType dtype, bool power_2, bool columns) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(fastcast_kernels, CPU, m) { m.impl("quantize_rows", &quantize_rows); }

}  // namespace fastcast

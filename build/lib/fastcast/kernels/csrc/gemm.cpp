// Per-tensor scaled FP8 GEMM on the CPU: out = (a * scale_a) @ (b * scale_b).T (+ bias).
//
// The values are exactly those of torch._scaled_mm's CPU kernel, which widens each
// operand to FP32 and multiplies it by its scale (separate passes), multiplies the two
// in FP32, adds the bias in FP32 and casts the result. Here each operand is widened and
// scaled in one pass through a 256-entry table of the FP8 values (built once), and the
// product is the same at::mm: at small shapes the kernel's own passes cost more than the
// multiplication. tests/test_kernels.py compares it with torch._scaled_mm bit for bit.

#include <ATen/ATen.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <torch/library.h>

#include <array>
#include <cstdint>
#include <optional>

#include "fp8.h"

namespace fastcast {
namespace {

// The FP32 matrix `t` * `scale` of a 2-D FP8 tensor, laid out as `t` is (as the CPU
// kernel's widening keeps the layout: the GEMM then sees the same strides, and so sums
// in the same order).
at::Tensor widen(const at::Tensor& t, const at::Tensor& scale) {
  TORCH_CHECK(t.dim() == 2, "scaled_mm_tensorwise: operands must be 2-D, got ", t.dim(), "-D");
  check_scalar(scale, "scaled_mm_tensorwise", "each scale");
  const float s = *scale.const_data_ptr<float>();  // item() would dispatch an op
  const auto& table = fp8_values(t.scalar_type());
  // A dense layout (row- or column-major, the operands fastcast makes) is widened in
  // storage order; any other is made row-major first.
  const at::Tensor dense = t.is_non_overlapping_and_dense() ? t : t.contiguous();
  at::Tensor out = at::empty_strided(dense.sizes(), dense.strides(),
                                     dense.options().dtype(at::kFloat));
  const auto* src = reinterpret_cast<const uint8_t*>(dense.const_data_ptr());
  float* dst = out.mutable_data_ptr<float>();
  const int64_t n = dense.numel();
  for (int64_t i = 0; i < n; ++i) dst[i] = table[src[i]] * s;
  return out;
}

// out += bias, each row, in FP32 (out.add_(bias)'s values: the bias widened exactly,
// one FP32 addition), without dispatching an op: at small shapes that costs more.
void add_bias(at::Tensor& out, const at::Tensor& bias) {
  const int64_t rows = out.size(0), cols = out.size(1);
  if (!(out.is_contiguous() && bias.dim() == 1 && bias.size(0) == cols && bias.is_cpu())) {
    out.add_(bias);
    return;
  }
  const at::Tensor b = bias.to(at::kFloat).contiguous();  // no copy for an FP32 bias
  const float* add = b.const_data_ptr<float>();
  float* y = out.mutable_data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) y[r * cols + c] += add[c];
}

at::Tensor scaled_mm_tensorwise(const at::Tensor& a, const at::Tensor& b,
                                const at::Tensor& scale_a, const at::Tensor& scale_b,
                                const std::optional<at::Tensor>& bias,
                                at::ScalarType out_dtype) {
  for (const at::Tensor* t : {&a, &b}) {
    const auto type = t->scalar_type();
    TORCH_CHECK(type == at::kFloat8_e4m3fn || type == at::kFloat8_e5m2,
                "scaled_mm_tensorwise: operands must be float8_e4m3fn or float8_e5m2");
  }
  TORCH_CHECK(a.size(1) == b.size(1), "scaled_mm_tensorwise: contraction dims differ");
  at::Tensor out = at::mm(widen(a, scale_a), widen(b, scale_b).t());
  if (bias.has_value()) add_bias(out, *bias);  // in FP32, as the kernel's epilogue
  return out_dtype == at::kFloat ? out : out.to(out_dtype);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fastcast_kernels, m) {
  m.def(
      "scaled_mm_tensorwise(Tensor a, Tensor b, Tensor scale_a, Tensor scale_b, "
      "Tensor? bias, ScalarType out_dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(fastcast_kernels, CPU, m) {
  m.impl("scaled_mm_tensorwise", &scaled_mm_tensorwise);
}

}  // namespace fastcast

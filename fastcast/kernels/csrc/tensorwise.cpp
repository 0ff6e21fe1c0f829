// Per-tensor FP8 quantization in two passes over the input: the amax, then the cast; one
// pass where the scale is known (delayed scaling), recording the amax as it casts.
//
// The values are exactly those of the PyTorch reference (fastcast/quantize/base.py:
// tensor_amax, scale_from_amax, scale_and_cast); tests/test_kernels.py checks them bit
// for bit. CPU only: other devices take the reference path.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

#include "fp8.h"

namespace fastcast {
namespace {

// Square tiles of the transposed copy: a tile's rows and columns stay in L1.
constexpr int64_t kTile = 64;

template <typename T>
float tensor_amax(const T* x, int64_t n) {
  const uint32_t m = at::parallel_reduce(
      0, n, kGrain, uint32_t{0},
      [x](int64_t begin, int64_t end, uint32_t) { return max_magnitude(x + begin, end - begin); },
      [](uint32_t a, uint32_t b) { return std::max(a, b); });
  return from_magnitude<T>(m);
}

template <typename T, typename F8>
void cast_rows(const T* x, uint8_t* out, int64_t n, float scale, float fmt_max) {
  at::parallel_for(0, n, kGrain, [=](int64_t begin, int64_t end) {
    cast_span<T, F8>(x + begin, out + begin, end - begin, scale, fmt_max);
  });
}

// out_t[k, r] = cast(x[r, k]) for x viewed as [rows, cols], one tile at a time.
template <typename T, typename F8>
void cast_transposed(const T* x, uint8_t* out_t, int64_t rows, int64_t cols, float scale,
                     float fmt_max) {
  const int64_t row_tiles = (rows + kTile - 1) / kTile;
  at::parallel_for(0, row_tiles, 1, [=](int64_t begin, int64_t end) {
    for (int64_t tile = begin; tile < end; ++tile) {
      const int64_t r0 = tile * kTile, r1 = std::min(rows, r0 + kTile);
      for (int64_t c0 = 0; c0 < cols; c0 += kTile) {
        const int64_t c1 = std::min(cols, c0 + kTile);
        for (int64_t c = c0; c < c1; ++c)
          for (int64_t r = r0; r < r1; ++r)
            out_t[c * rows + r] = cast_one<F8>(widen(x[r * cols + c]), scale, fmt_max);
      }
    }
  });
}

// R of x viewed as [R, K]: the product of the leading dims (1 for a 1-D x).
int64_t leading_rows(const at::Tensor& x) {
  int64_t rows = 1;
  for (int64_t d = 0; d + 1 < x.dim(); ++d) rows *= x.size(d);
  return rows;
}

template <typename T, typename F8>
void quantize_typed(const at::Tensor& x, float scale, bool rowwise, bool columnwise,
                    at::Tensor& data, at::Tensor& data_t) {
  const T* src = x.const_data_ptr<T>();
  const float fmt_max = static_cast<float>(std::numeric_limits<F8>::max());
  if (rowwise)
    cast_rows<T, F8>(src, static_cast<uint8_t*>(data.data_ptr()), x.numel(), scale, fmt_max);
  if (columnwise) {
    const int64_t cols = x.size(-1), rows = leading_rows(x);
    cast_transposed<T, F8>(src, static_cast<uint8_t*>(data_t.data_ptr()), rows, cols, scale,
                           fmt_max);
  }
}

template <typename T>
float amax_typed(const at::Tensor& x) {
  return tensor_amax(x.const_data_ptr<T>(), x.numel());
}

float amax_of(const at::Tensor& x) {
  switch (x.scalar_type()) {
    case at::kFloat: return amax_typed<float>(x);
    case at::kBFloat16: return amax_typed<c10::BFloat16>(x);
    case at::kHalf: return amax_typed<c10::Half>(x);
    default: TORCH_CHECK(false, "fastcast: cannot quantize ", x.scalar_type());
  }
}

// x quantized per tensor to `dtype` (float8_e4m3fn or float8_e5m2). With `scale` (an FP32
// one-element tensor) that scale is used, else the current one (fmt_max / amax).
// Returns data (shaped like x; empty unless rowwise), scale_inv (shaped like scale, 0-dim
// for the current scale) and data_t (x viewed as [R, K], transposed and contiguous;
// empty unless columnwise).
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_tensorwise(
    const at::Tensor& input, const std::optional<at::Tensor>& scale, at::ScalarType dtype,
    bool power_2, double epsilon, bool rowwise, bool columnwise) {
  TORCH_CHECK(input.device().is_cpu(), "fastcast::quantize_tensorwise: CPU tensors only");
  TORCH_CHECK(input.dim() > 0, "fastcast::quantize_tensorwise: needs at least one dim");
  TORCH_CHECK(dtype == at::kFloat8_e4m3fn || dtype == at::kFloat8_e5m2,
              "fastcast::quantize_tensorwise: dtype must be an FP8 type, got ", dtype);
  const at::Tensor x = input.contiguous();
  const bool e4m3 = dtype == at::kFloat8_e4m3fn;
  const float fmt_max = e4m3 ? 448.0f : 57344.0f;

  float s;
  at::Tensor scale_inv;
  if (scale.has_value()) {
    const at::Tensor& given = *scale;
    check_scalar(given, "quantize_tensorwise", "scale");
    s = *given.const_data_ptr<float>();
    scale_inv = at::empty_like(given, at::MemoryFormat::Contiguous);
  } else {
    s = scale_from_amax(amax_of(x), fmt_max, power_2, epsilon);
    scale_inv = at::empty({}, x.options().dtype(at::kFloat));
  }
  *scale_inv.data_ptr<float>() = 1.0f / s;

  const auto bytes = x.options().dtype(dtype);
  at::Tensor data = at::empty(rowwise ? x.sizes() : at::IntArrayRef{0}, bytes);
  const int64_t cols = x.size(-1), rows = leading_rows(x);
  at::Tensor data_t = columnwise ? at::empty({cols, rows}, bytes) : at::empty({0}, bytes);
  dispatch_types(x.scalar_type(), dtype, "quantize_tensorwise", [&](auto t, auto f8) {
    quantize_typed<decltype(t), decltype(f8)>(x, s, rowwise, columnwise, data, data_t);
  });
  return {data, scale_inv, data_t};
}

// slot = max(slot, amax(x)) in place for a finite amax; a non-finite one records nothing
// (fastcast/quantize/tensorwise.py: record_amax, whose reasons hold here too).
void record_into(const at::Tensor& slot, float amax) {
  if (!std::isfinite(amax)) return;
  float* value = slot.data_ptr<float>();
  *value = std::max(*value, amax);
}

void record_amax(const at::Tensor& slot, const at::Tensor& input) {
  check_scalar(slot, "record_amax", "the slot");
  TORCH_CHECK(input.device().is_cpu(), "fastcast::record_amax: CPU tensors only");
  const at::Tensor x = input.contiguous();
  record_into(slot, x.numel() == 0 ? 0.0f : amax_of(x));
}

template <typename T, typename F8>
float cast_recording(const at::Tensor& x, float scale, at::Tensor& data) {
  const T* src = x.const_data_ptr<T>();
  auto* out = static_cast<uint8_t*>(data.data_ptr());
  const float fmt_max = static_cast<float>(std::numeric_limits<F8>::max());
  const uint32_t m = at::parallel_reduce(
      0, x.numel(), kGrain, uint32_t{0},
      [=](int64_t begin, int64_t end, uint32_t) {
        return cast_span_amax<T, F8>(src + begin, out + begin, end - begin, scale, fmt_max);
      },
      [](uint32_t a, uint32_t b) { return std::max(a, b); });
  return from_magnitude<T>(m);
}

// Delayed scaling's quantize in one pass over x: data = cast(x * scale) (row-wise,
// shaped like x), scale_inv = 1 / scale, and slot = max(slot, amax(x)) when that amax
// is finite (record_amax's rule). The values are those of record_amax followed by
// quantize_tensorwise with the scale.
std::tuple<at::Tensor, at::Tensor> quantize_recording(const at::Tensor& input,
                                                      const at::Tensor& scale,
                                                      const at::Tensor& slot,
                                                      at::ScalarType dtype) {
  TORCH_CHECK(input.device().is_cpu(), "fastcast::quantize_recording: CPU tensors only");
  TORCH_CHECK(input.dim() > 0, "fastcast::quantize_recording: needs at least one dim");
  TORCH_CHECK(dtype == at::kFloat8_e4m3fn || dtype == at::kFloat8_e5m2,
              "fastcast::quantize_recording: dtype must be an FP8 type, got ", dtype);
  check_scalar(scale, "quantize_recording", "scale");
  check_scalar(slot, "quantize_recording", "the slot");
  const at::Tensor x = input.contiguous();
  const float s = *scale.const_data_ptr<float>();
  at::Tensor scale_inv = at::empty_like(scale, at::MemoryFormat::Contiguous);
  *scale_inv.data_ptr<float>() = 1.0f / s;
  at::Tensor data = at::empty(x.sizes(), x.options().dtype(dtype));
  float amax = 0.0f;
  if (x.numel() > 0)
    dispatch_types(x.scalar_type(), dtype, "quantize_recording", [&](auto t, auto f8) {
      amax = cast_recording<decltype(t), decltype(f8)>(x, s, data);
    });
  record_into(slot, amax);
  return {data, scale_inv};
}

// A multiple of `cols` of at least 64: loops over that many consecutive elements of a
// [rows, cols] history vectorise whatever its width (a slab of one module is one or two
// columns wide, and a row-by-row loop over so few elements does not).
int64_t period_of(int64_t cols) { return cols * std::max<int64_t>(1, (64 + cols - 1) / cols); }

// Delayed scaling's update of one slab (fastcast/reference/amax.py:
// delayed_update_reference is the definition, bit for bit): per column j of history
// [L, N] and scale [N], amax = max over the window (or row 0, `most_recent`), the new
// scale target / max(amax, floor) (at least `min_scale` when that is > 0) where the amax
// is finite and > 0, else the old one; only a column whose row 0 is > 0 (it recorded
// this step) takes it and has its history rolled up by one row; row 0 is then zeroed.
//
// The history is walked as it lies in memory, `period` elements at a time, element p
// of a period belonging to column p % N (a column-by-column walk strides by N and cost
// ~3.5 us per column at L = 1024).
void delayed_update(const at::Tensor& history, const at::Tensor& scale, double target,
                    double floor, double min_scale, bool most_recent) {
  TORCH_CHECK(history.device().is_cpu() && scale.device().is_cpu(),
              "fastcast::delayed_update: CPU tensors only");
  TORCH_CHECK(history.scalar_type() == at::kFloat && scale.scalar_type() == at::kFloat &&
                  history.dim() == 2 && scale.dim() == 1 &&
                  history.size(1) == scale.size(0) && history.is_contiguous() &&
                  scale.is_contiguous(),
              "fastcast::delayed_update: needs a contiguous float32 history [L, N] and "
              "scale [N]");
  const int64_t rows = history.size(0), cols = history.size(1);
  if (cols == 0) return;
  float* h = history.data_ptr<float>();
  float* s = scale.data_ptr<float>();
  const float t = static_cast<float>(target), lo = static_cast<float>(floor);
  const float least = static_cast<float>(min_scale);
  const int64_t period = period_of(cols);
  // Row 0 as recorded, and whether each element of a period belongs to a column that
  // recorded this step (row 0 > 0; false for NaN, as torch's `>` is).
  const std::vector<float> recorded(h, h + cols);
  std::vector<uint8_t> ran(period);
  bool all_ran = true, any_ran = false;
  for (int64_t p = 0; p < period; ++p) {
    ran[p] = recorded[p % cols] > 0;
    all_ran = all_ran && ran[p];
    any_ran = any_ran || ran[p];
  }
  if (!any_ran) {  // nothing moves (a slab updated in a step none of its modules ran in)
    std::fill(h, h + cols, 0.0f);
    return;
  }

  std::vector<float> amax(recorded);
  if (!most_recent && rows > 1) {
    // Rows 1.. folded into one period of partial maxima, then into the columns.
    std::vector<float> partial(period, -std::numeric_limits<float>::infinity());
    const float* past = h + cols;
    const int64_t n = (rows - 1) * cols;
    for (int64_t start = 0; start < n; start += period) {
      const float* x = past + start;
      const int64_t len = std::min(period, n - start);
      for (int64_t p = 0; p < len; ++p) partial[p] = nan_max(partial[p], x[p]);
    }
    for (int64_t p = 0; p < period; ++p) amax[p % cols] = nan_max(amax[p % cols], partial[p]);
  }
  // element.h: only a finite amax > 0 makes a scale (nan_to_num(nan=0, posinf=0)).
  for (int64_t j = 0; j < cols; ++j)
    if (ran[j]) s[j] = delayed_scale(amax[j], s[j], t, lo, least);
  if (rows > 1) {
    // Rows 1..L-2 take the row below them, the last row the recorded amax, in the
    // columns that recorded (row 0 would take row 1, but is zeroed below).
    float* row1 = h + cols;
    const int64_t n = (rows - 2) * cols;
    if (all_ran) {
      std::memmove(row1, row1 + cols, sizeof(float) * n);
    } else {
      for (int64_t start = 0; start < n; start += period) {
        float* x = row1 + start;
        const int64_t len = std::min(period, n - start);
        for (int64_t p = 0; p < len; ++p) {
          const float below = x[p + cols];  // loaded either way: the loop then vectorises
          x[p] = ran[p] ? below : x[p];
        }
      }
    }
    float* last = h + (rows - 1) * cols;
    for (int64_t j = 0; j < cols; ++j) last[j] = ran[j] ? recorded[j] : last[j];
  }
  std::fill(h, h + cols, 0.0f);
}

// The cheapest op there is: measures what dispatch through torch.ops costs.
at::Tensor noop(const at::Tensor& x) { return x; }

}  // namespace

TORCH_LIBRARY(fastcast_kernels, m) {
  m.def(
      "quantize_tensorwise(Tensor x, Tensor? scale, ScalarType dtype, bool power_2, "
      "float epsilon, bool rowwise, bool columnwise) -> (Tensor, Tensor, Tensor)");
  m.def("record_amax(Tensor(a!) slot, Tensor x) -> ()");
  m.def(
      "quantize_recording(Tensor x, Tensor scale, Tensor(a!) slot, ScalarType dtype) "
      "-> (Tensor, Tensor)");
  m.def(
      "delayed_update(Tensor(a!) history, Tensor(b!) scale, float target, float floor, "
      "float min_scale, bool most_recent) -> ()");
  m.def("noop(Tensor(a) x) -> Tensor(a)");
}

TORCH_LIBRARY_IMPL(fastcast_kernels, CPU, m) {
  m.impl("quantize_tensorwise", &quantize_tensorwise);
  m.impl("record_amax", &record_amax);
  m.impl("quantize_recording", &quantize_recording);
  m.impl("delayed_update", &delayed_update);
  m.impl("noop", &noop);
}

}  // namespace fastcast

// Per-tensor FP8 quantization in two passes over the input: the amax, then the cast.
//
// The values are exactly those of the PyTorch reference (fastcast/quantize/base.py:
// tensor_amax, scale_from_amax, scale_and_cast); tests/test_kernels.py checks them bit
// for bit. CPU only: other devices take the reference path.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>

// The two hot loops are compiled for AVX-512 and AVX2 too, picked at load time by the
// CPU (GCC function multi-versioning): wide vectors without -march=native, so the
// library runs on any x86-64. Not inlined, so that each clone keeps its loop.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define FASTCAST_HOT \
  __attribute__((noinline, target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define FASTCAST_HOT __attribute__((noinline))
#endif

namespace fastcast {
namespace {

// Elements per task: big enough that a task outweighs its scheduling.
constexpr int64_t kGrain = 1 << 15;
// Square tiles of the transposed copy: a tile's rows and columns stay in L1.
constexpr int64_t kTile = 64;

uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

template <typename T>
float widen(T v) {
  return static_cast<float>(v);
}

// Magnitude bits: for a value without its sign, the integer order of the bits is the
// order of the values, with every NaN above infinity. A max over these is an unsigned
// integer max, which vectorises, and NaN-propagating for free.
inline uint32_t magnitude(float v) { return bits_of(v) & 0x7FFFFFFFu; }
inline uint32_t magnitude(c10::BFloat16 v) { return v.x & 0x7FFFu; }
inline uint32_t magnitude(c10::Half v) { return v.x & 0x7FFFu; }

// The value whose magnitude bits are `m` (the max found): NaN when any element was NaN,
// as with torch's inf-norm.
template <typename T>
float from_magnitude(uint32_t m) {
  T v;
  v.x = static_cast<uint16_t>(m);
  return static_cast<float>(v);
}
template <>
float from_magnitude<float>(uint32_t m) {
  float f;
  std::memcpy(&f, &m, sizeof f);
  return f;
}

// Max magnitude bits over x[0, n).
template <typename T>
FASTCAST_HOT uint32_t max_magnitude(const T* __restrict x, int64_t n) {
  uint32_t m = 0;
  for (int64_t i = 0; i < n; ++i) m = std::max(m, magnitude(x[i]));
  return m;
}

template <typename T>
float tensor_amax(const T* x, int64_t n) {
  const uint32_t m = at::parallel_reduce(
      0, n, kGrain, uint32_t{0},
      [x](int64_t begin, int64_t end, uint32_t) { return max_magnitude(x + begin, end - begin); },
      [](uint32_t a, uint32_t b) { return std::max(a, b); });
  return from_magnitude<T>(m);
}

// scale_from_amax with margin 0: fmt_max / amax, floored so it stays finite, and 1.0
// for an amax that is 0, NaN or infinite. Each step rounds to FP32 where torch does.
float scale_from_amax(float amax, float fmt_max, bool power_2, double epsilon) {
  const bool finite = std::isfinite(amax);
  float usable = finite ? amax : 0.0f;
  if (epsilon > 0 && finite) usable = std::max(usable, static_cast<float>(epsilon));
  const float floor = static_cast<float>(static_cast<double>(fmt_max) / FLT_MAX);
  float scale = fmt_max / std::max(usable, floor);
  if (power_2) {
    int exponent = 0;
    std::frexp(scale, &exponent);  // scale = m * 2**exponent, m in [0.5, 1)
    scale = std::ldexp(1.0f, exponent - 1);
  }
  return usable > 0 ? scale : 1.0f;
}

float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// torch's rounding of an FP32 value to FP8 (c10's fp8e4m3fn_from_fp32_value and
// fp8e5m2_from_fp32_value, round to nearest even), rewritten without branches so that
// the cast loop vectorises: each case is computed and the right one selected. `man`
// is the format's mantissa width, `bias` its exponent bias, `nan_or_inf` what an input
// at or beyond the first unrepresentable value becomes, `nan` what a NaN becomes.
template <int man, int bias>
inline uint8_t round_to_fp8(float f, uint32_t overflow_from, uint32_t overflow_code,
                            uint32_t max_code) {
  uint32_t b = bits_of(f);
  const uint32_t sign = b & 0x80000000u;
  b ^= sign;
  // Below the smallest normal: an FP32 addition rounds the value into the subnormal
  // codes (the magic constant puts the code in the low mantissa bits).
  constexpr uint32_t denorm_magic = uint32_t((127 - bias) + (23 - man) + 1) << 23;
  const uint32_t subnormal = bits_of(float_of(b) + float_of(denorm_magic)) - denorm_magic;
  // Normal: rebias the exponent and round the mantissa to nearest even.
  const uint32_t odd = (b >> (23 - man)) & 1u;
  uint32_t normal =
      (b + (uint32_t(bias - 127) << 23) + ((1u << (22 - man)) - 1u) + odd) >> (23 - man);
  normal = normal > max_code ? max_code : normal;  // e4m3: a carry into the NaN code
  uint32_t code = b < (uint32_t(127 - bias + 1) << 23) ? subnormal : normal;
  code = b >= overflow_from ? (b > 0x7F800000u ? 0x7Fu : overflow_code) : code;
  return static_cast<uint8_t>(code | (sign >> 24));
}

// One element of scale_and_cast: the FP32 product, clamped to the format's range, then
// rounded as torch rounds. An input infinity stays infinite in E5M2 and is NaN in E4M3;
// an input NaN is NaN (E4M3's reference makes every NaN positive first; E5M2 keeps the
// sign, as the product does). Selects, not branches: the loop must vectorise.
template <typename F8>
uint8_t cast_one(float v, float scale, float fmt_max);

// The clamp keeps NaN: both comparisons are false for it (std::max(a, b) is
// `a < b ? b : a`), so it reaches its NaN code.
inline float clamp(float p, float fmt_max) { return std::min(std::max(p, -fmt_max), fmt_max); }

inline bool is_inf_or_nan(float v) { return (bits_of(v) & 0x7FFFFFFFu) >= 0x7F800000u; }

template <>
inline uint8_t cast_one<c10::Float8_e4m3fn>(float v, float scale, float fmt_max) {
  const uint8_t code = round_to_fp8<3, 7>(clamp(v * scale, fmt_max), 1087u << 20, 0x7Eu, 0x7Eu);
  return is_inf_or_nan(v) ? uint8_t{0x7F} : code;
}

template <>
inline uint8_t cast_one<c10::Float8_e5m2>(float v, float scale, float fmt_max) {
  const bool inf = (bits_of(v) & 0x7FFFFFFFu) == 0x7F800000u;
  const float y = inf ? v : clamp(v * scale, fmt_max);
  return round_to_fp8<2, 15>(y, 143u << 23, 0x7Cu, 0x7Fu);
}

// The pointers do not alias (out is fresh): telling the compiler lets it vectorise
// (a byte store may otherwise alias anything).
template <typename T, typename F8>
FASTCAST_HOT void cast_span(const T* __restrict x, uint8_t* __restrict out, int64_t n, float scale,
               float fmt_max) {
  for (int64_t i = 0; i < n; ++i) out[i] = cast_one<F8>(widen(x[i]), scale, fmt_max);
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

template <typename F8>
void cast_of(const at::Tensor& x, float scale, bool rowwise, bool columnwise,
             at::Tensor& data, at::Tensor& data_t) {
  switch (x.scalar_type()) {
    case at::kFloat:
      return quantize_typed<float, F8>(x, scale, rowwise, columnwise, data, data_t);
    case at::kBFloat16:
      return quantize_typed<c10::BFloat16, F8>(x, scale, rowwise, columnwise, data, data_t);
    case at::kHalf:
      return quantize_typed<c10::Half, F8>(x, scale, rowwise, columnwise, data, data_t);
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
    TORCH_CHECK(given.device().is_cpu() && given.scalar_type() == at::kFloat &&
                    given.numel() == 1,
                "fastcast::quantize_tensorwise: scale must be a one-element FP32 CPU tensor");
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
  if (e4m3)
    cast_of<c10::Float8_e4m3fn>(x, s, rowwise, columnwise, data, data_t);
  else
    cast_of<c10::Float8_e5m2>(x, s, rowwise, columnwise, data, data_t);
  return {data, scale_inv, data_t};
}

// The cheapest op there is: measures what dispatch through torch.ops costs.
at::Tensor noop(const at::Tensor& x) { return x; }

}  // namespace

TORCH_LIBRARY(fastcast_kernels, m) {
  m.def(
      "quantize_tensorwise(Tensor x, Tensor? scale, ScalarType dtype, bool power_2, "
      "float epsilon, bool rowwise, bool columnwise) -> (Tensor, Tensor, Tensor)");
  m.def("noop(Tensor(a) x) -> Tensor(a)");
}

TORCH_LIBRARY_IMPL(fastcast_kernels, CPU, m) {
  m.impl("quantize_tensorwise", &quantize_tensorwise);
  m.impl("noop", &noop);
}

}  // namespace fastcast

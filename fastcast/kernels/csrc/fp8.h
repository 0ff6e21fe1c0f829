// What every fused FP8 quantize shares: reading the input types, the amax by magnitude
// bits, the scale from an amax, and the FP32 -> FP8 rounding that matches torch's cast.
//
// Header-only, included by each source of the library: the functions are inline (or
// templates), so each translation unit inlines them into its own hot loops.

#pragma once

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <array>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

// The hot loops are compiled for AVX-512 and AVX2 too, picked at load time by the CPU
// (GCC function multi-versioning): wide vectors without -march=native, so the library
// runs on any x86-64. Not inlined, so that each clone keeps its loop.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define FASTCAST_HOT \
  __attribute__((noinline, target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define FASTCAST_HOT __attribute__((noinline))
#endif

namespace fastcast {

// Elements per task: big enough that a task outweighs its scheduling.
constexpr int64_t kGrain = 1 << 15;

inline uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Every input type becomes FP32 exactly (the reference widens with .float()).
template <typename T>
inline float widen(T v) {
  return static_cast<float>(v);
}

// Magnitude bits: for a value without its sign, the integer order of the bits is the
// order of the values, with every NaN above infinity. A max over these is an unsigned
// integer max, which vectorises, and NaN-propagating for free.
inline uint32_t magnitude(float v) { return bits_of(v) & 0x7FFFFFFFu; }
inline uint32_t magnitude(c10::BFloat16 v) { return v.x & 0x7FFFu; }
inline uint32_t magnitude(c10::Half v) { return v.x & 0x7FFFu; }

// The magnitude bits from which infinity and NaN start, per input type.
template <typename T>
constexpr uint32_t kInfMagnitude = 0x7F800000u;
template <>
constexpr uint32_t kInfMagnitude<c10::BFloat16> = 0x7F80u;
template <>
constexpr uint32_t kInfMagnitude<c10::Half> = 0x7C00u;

// The value whose magnitude bits are `m` (a max found), as FP32: NaN when any element
// was NaN, as with torch's inf-norm.
template <typename T>
inline float from_magnitude(uint32_t m) {
  T v;
  v.x = static_cast<uint16_t>(m);
  return static_cast<float>(v);
}
template <>
inline float from_magnitude<float>(uint32_t m) {
  return float_of(m);
}

// The largest power of two not above a positive `scale` (round_to_power_of_2: frexp's
// 2**(exponent - 1)). For a normal value that is its exponent field alone; frexp only
// for the rest (never met: every scale lies in [fmt_max / FLT_MAX, FLT_MAX]).
inline float power_2_below(float scale) {
  if (std::isnormal(scale)) return float_of(bits_of(scale) & 0xFF800000u);
  int exponent = 0;
  std::frexp(scale, &exponent);  // scale = m * 2**exponent, m in [0.5, 1)
  return std::ldexp(1.0f, exponent - 1);
}

// scale_from_amax with margin 0: fmt_max / amax, floored so it stays finite, and 1.0
// for an amax that is 0, NaN or infinite. Each step rounds to FP32 where torch does.
// A power-of-two scale is no smaller than min_scale's 2**(e - 128) (fmt_max = m * 2**e,
// 0.5 <= m < 1): below it, fmt_max / scale overflows FP32, and a finite input near the
// FP32 max would dequantize to inf. (Without power_2, fmt_max / amax is never below
// fmt_max / FLT_MAX, which dequantizes fmt_max to a finite value.)
inline float scale_from_amax(float amax, float fmt_max, bool power_2, double epsilon) {
  const bool finite = std::isfinite(amax);
  float usable = finite ? amax : 0.0f;
  if (epsilon > 0 && finite) usable = std::max(usable, static_cast<float>(epsilon));
  const float floor = static_cast<float>(static_cast<double>(fmt_max) / FLT_MAX);
  float scale = fmt_max / std::max(usable, floor);
  if (power_2) {
    // min_scale, 2**(e - 1) * 2**-127: fmt_max's exponent field less 127 (fmt_max >= 2,
    // so it stays normal). Built from the bits: a product with the subnormal 2**-127
    // takes the CPU's slow path for denormal operands, once per block (1.6x the
    // 1x128 block quantize).
    const float min_scale = float_of(((bits_of(fmt_max) >> 23) - 127u) << 23);
    scale = std::max(power_2_below(scale), min_scale);
  }
  return usable > 0 ? scale : 1.0f;
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

// The two hot loops every quantize runs. In an unnamed namespace: each source gets its
// own copies, clones and clone resolver (GCC's multi-versioning of a function with
// external linkage, shared between objects, is fragile).
namespace {

// Max magnitude bits over x[0, n).
template <typename T>
FASTCAST_HOT uint32_t max_magnitude(const T* __restrict x, int64_t n) {
  uint32_t m = 0;
  for (int64_t i = 0; i < n; ++i) m = std::max(m, magnitude(x[i]));
  return m;
}

// out[i] = cast(x[i] * scale) over [0, n). The pointers do not alias (out is fresh):
// telling the compiler lets it vectorise (a byte store may otherwise alias anything).
// A function of its own: GCC vectorises this loop, not the same loop inlined into a
// loop over tiles.
template <typename T, typename F8>
FASTCAST_HOT void cast_span(const T* __restrict x, uint8_t* __restrict out, int64_t n,
                            float scale, float fmt_max) {
  for (int64_t i = 0; i < n; ++i) out[i] = cast_one<F8>(widen(x[i]), scale, fmt_max);
}

// m[i] = max(m[i], magnitude(x[i])) over [0, n): one row's share of per-column maxima.
template <typename T>
FASTCAST_HOT void max_magnitude_each(const T* __restrict x, uint32_t* __restrict m, int64_t n) {
  for (int64_t i = 0; i < n; ++i) m[i] = std::max(m[i], magnitude(x[i]));
}

// out[i] = cast(x[i] * scale[i]) over [0, n): a row cast with a scale per column.
template <typename T, typename F8>
FASTCAST_HOT void cast_span_each(const T* __restrict x, uint8_t* __restrict out, int64_t n,
                                 const float* __restrict scale, float fmt_max) {
  for (int64_t i = 0; i < n; ++i) out[i] = cast_one<F8>(widen(x[i]), scale[i], fmt_max);
}

// cast_span and max_magnitude in one pass (delayed scaling: the scale is known, the
// amax is recorded for later steps); returns the max magnitude bits.
template <typename T, typename F8>
FASTCAST_HOT uint32_t cast_span_amax(const T* __restrict x, uint8_t* __restrict out, int64_t n,
                                     float scale, float fmt_max) {
  uint32_t m = 0;
  for (int64_t i = 0; i < n; ++i) {
    m = std::max(m, magnitude(x[i]));
    out[i] = cast_one<F8>(widen(x[i]), scale, fmt_max);
  }
  return m;
}

}  // namespace

// code -> float(code) for every byte of an FP8 type (e4m3fn or e5m2), built once per
// process. Decoding through this table is how the dequantizing kernels read FP8; a value
// times an FP32 scale is then the same product as widening, then multiplying (every FP8
// value is exact in FP32, so one rounding).
template <typename F8>
inline const std::array<float, 256>& fp8_table_of() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> values;
    for (int code = 0; code < 256; ++code)
      values[code] = static_cast<float>(c10::bit_cast<F8>(static_cast<uint8_t>(code)));
    return values;
  }();
  return table;
}

inline const std::array<float, 256>& fp8_values(at::ScalarType type) {
  return type == at::kFloat8_e4m3fn ? fp8_table_of<c10::Float8_e4m3fn>()
                                    : fp8_table_of<c10::Float8_e5m2>();
}

// What the operators check of a one-element FP32 CPU tensor they read or write (a
// scale, an amax slot): `op` and `what` name it in the error.
inline void check_scalar(const at::Tensor& t, const char* op, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.numel() == 1,
              "fastcast::", op, ": ", what, " must be a one-element FP32 CPU tensor");
}

template <typename F8>
inline float fmt_max_of() {
  return static_cast<float>(std::numeric_limits<F8>::max());
}

// Calls fn(T{}, F8{}) with the input element type T (float, BFloat16 or Half) and the
// FP8 type F8 of `dtype`: one template instance per pair, picked at run time.
template <typename Fn>
void dispatch_types(at::ScalarType input, at::ScalarType dtype, const char* op, Fn&& fn) {
  TORCH_CHECK(dtype == at::kFloat8_e4m3fn || dtype == at::kFloat8_e5m2, "fastcast::", op,
              ": dtype must be an FP8 type, got ", dtype);
  auto with_input = [&](auto f8) {
    switch (input) {
      case at::kFloat: return fn(float{}, f8);
      case at::kBFloat16: return fn(c10::BFloat16{}, f8);
      case at::kHalf: return fn(c10::Half{}, f8);
      default: TORCH_CHECK(false, "fastcast::", op, ": cannot quantize ", input);
    }
  };
  if (dtype == at::kFloat8_e4m3fn)
    with_input(c10::Float8_e4m3fn{});
  else
    with_input(c10::Float8_e5m2{});
}

}  // namespace fastcast

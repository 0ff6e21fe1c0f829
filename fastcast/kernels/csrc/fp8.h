// What every fused FP8 quantize shares: reading the input types, the amax by magnitude
// bits, the scale from an amax, and the FP32 -> FP8 rounding that matches torch's cast.
//
// Header-only, included by each source of the library: the functions are inline (or
// templates), so each translation unit inlines them into its own hot loops. The element
// arithmetic itself (scales, rounding, E8M0) is element.h's, shared with the CUDA kernels.

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

#include "element.h"

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

// Every input type becomes FP32 exactly (the reference widens with .float()).
template <typename T>
inline float widen(T v) {
  return static_cast<float>(v);
}

// Magnitude bits: for a value without its sign, the integer order of the bits is the
// order of the values, with every NaN above infinity. A max over these is an unsigned
// integer max, which vectorises, and NaN-propagating for free.
inline uint32_t magnitude(float v) { return magnitude_f32(v); }
inline uint32_t magnitude(c10::BFloat16 v) { return magnitude_16(v.x); }
inline uint32_t magnitude(c10::Half v) { return magnitude_16(v.x); }

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

// One element of scale_and_cast (element.h: cast_e4m3, cast_e5m2) for the FP8 type F8.
template <typename F8>
uint8_t cast_one(float v, float scale, float fmt_max);

template <>
inline uint8_t cast_one<c10::Float8_e4m3fn>(float v, float scale, float fmt_max) {
  return cast_e4m3(v, scale, fmt_max);
}

template <>
inline uint8_t cast_one<c10::Float8_e5m2>(float v, float scale, float fmt_max) {
  return cast_e5m2(v, scale, fmt_max);
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

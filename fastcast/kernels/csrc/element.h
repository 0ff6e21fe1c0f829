// The element arithmetic of every FP8 quantize, compiled for both sides: the scale from
// an amax, FP32 -> E4M3/E5M2 rounding as torch's cast rounds, saturation and non-finite
// rules, MXFP8's E8M0 exponent. The CPU operators (fp8.h includes this header) and the
// CUDA kernels (cuda/*.cu) call these very functions, so the CPU's bit-exact tests
// against the PyTorch reference cover the arithmetic the GPU runs; the CUDA files hold
// only the parallel structure (reductions, tiling, layouts).
//
// Torch-free and without std:: calls that have no device form: every function is
// bit manipulation, comparisons and IEEE FP32 arithmetic, which round the same way on
// an x86-64 CPU (SSE/AVX) and a GPU (no fused multiply-add is formed: each function has
// at most one product feeding no addition, and the CUDA build passes --fmad=false).

#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define FASTCAST_HD __host__ __device__ __forceinline__
#else
#define FASTCAST_HD inline
#endif

namespace fastcast {

// FLT_MAX spelt out: <cfloat>'s macro is fine on both sides, but a literal keeps this
// header free of host headers in device code.
constexpr float kFloatMax = 3.40282346638528859811704183484516925e+38f;

FASTCAST_HD uint32_t bits_of(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

FASTCAST_HD float float_of(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

// std::max/std::min's exact semantics (`a < b ? b : a`, `b < a ? b : a`): which operand
// a NaN comparison returns is part of the numerics (fmaxf would drop the NaN instead).
template <typename V>
FASTCAST_HD V max_of(V a, V b) {
  return a < b ? b : a;
}
template <typename V>
FASTCAST_HD V min_of(V a, V b) {
  return b < a ? b : a;
}

// Magnitude bits: for a value without its sign, the integer order of the bits is the
// order of the values, with every NaN above infinity. A max over these is an unsigned
// integer max, which vectorises (and is an atomicMax on a GPU), NaN-propagating for free.
// 16-bit inputs (BF16, FP16) take their raw bits.
FASTCAST_HD uint32_t magnitude_f32(float v) { return bits_of(v) & 0x7FFFFFFFu; }
FASTCAST_HD uint32_t magnitude_16(uint16_t bits) { return bits & 0x7FFFu; }

FASTCAST_HD bool is_inf_or_nan(float v) { return (bits_of(v) & 0x7FFFFFFFu) >= 0x7F800000u; }
FASTCAST_HD bool is_finite(float v) { return !is_inf_or_nan(v); }

// Index of the highest set bit of a nonzero u.
FASTCAST_HD int highest_bit(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return 31 - __clz(static_cast<int>(u));
#else
  return 31 - __builtin_clz(u);
#endif
}

// The largest power of two not above a positive finite `scale` (round_to_power_of_2:
// frexp's 2**(exponent - 1)): for a normal value its exponent field alone, for a
// subnormal its highest mantissa bit. (Every scale lies in [fmt_max / FLT_MAX, FLT_MAX],
// so only the first case is met; 0 gives 0.)
FASTCAST_HD float power_2_below(float scale) {
  const uint32_t b = bits_of(scale) & 0x7FFFFFFFu;
  if (b >= 0x00800000u) return float_of(b & 0xFF800000u);
  return b == 0 ? 0.0f : float_of(1u << highest_bit(b));
}

// scale_from_amax with margin 0: fmt_max / amax, floored so it stays finite, and 1.0
// for an amax that is 0, NaN or infinite. Each step rounds to FP32 where torch does.
// A power-of-two scale is no smaller than min_scale's 2**(e - 128) (fmt_max = m * 2**e,
// 0.5 <= m < 1): below it, fmt_max / scale overflows FP32, and a finite input near the
// FP32 max would dequantize to inf. (Without power_2, fmt_max / amax is never below
// fmt_max / FLT_MAX, which dequantizes fmt_max to a finite value.)
FASTCAST_HD float scale_from_amax(float amax, float fmt_max, bool power_2, double epsilon) {
  const bool finite = is_finite(amax);
  float usable = finite ? amax : 0.0f;
  if (epsilon > 0 && finite) usable = max_of(usable, static_cast<float>(epsilon));
  // fmt_max / FLT_MAX rounded once, from the double quotient (as torch's clamp_min with
  // a Python float bound).
  const float floor = static_cast<float>(static_cast<double>(fmt_max) / kFloatMax);
  float scale = fmt_max / max_of(usable, floor);
  if (power_2) {
    // min_scale, 2**(e - 1) * 2**-127: fmt_max's exponent field less 127 (fmt_max >= 2,
    // so it stays normal). Built from the bits: a product with the subnormal 2**-127
    // takes the CPU's slow path for denormal operands, once per block (1.6x the
    // 1x128 block quantize).
    const float min_scale = float_of(((bits_of(fmt_max) >> 23) - 127u) << 23);
    scale = max_of(power_2_below(scale), min_scale);
  }
  return usable > 0 ? scale : 1.0f;
}

// torch's rounding of an FP32 value to FP8 (c10's fp8e4m3fn_from_fp32_value and
// fp8e5m2_from_fp32_value, round to nearest even), rewritten without branches so that
// the cast loop vectorises: each case is computed and the right one selected. `man`
// is the format's mantissa width, `bias` its exponent bias; an input at or beyond
// `overflow_from` becomes `overflow_code` (NaN 0x7F for any NaN input), `max_code` caps
// a mantissa carry (E4M3: into the NaN code).
template <int man, int bias>
FASTCAST_HD uint8_t round_to_fp8(float f, uint32_t overflow_from, uint32_t overflow_code,
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

// The clamp keeps NaN: both comparisons are false for it (max_of(a, b) is
// `a < b ? b : a`), so it reaches its NaN code.
FASTCAST_HD float clamp(float p, float fmt_max) { return min_of(max_of(p, -fmt_max), fmt_max); }

// One element of scale_and_cast: the FP32 product, clamped to the format's range, then
// rounded as torch rounds. An input infinity is NaN in E4M3 (it has no infinity); an
// input NaN is NaN (E4M3's reference makes every NaN positive first). Selects, not
// branches: the loop must vectorise.
FASTCAST_HD uint8_t cast_e4m3(float v, float scale, float fmt_max) {
  const uint8_t code = round_to_fp8<3, 7>(clamp(v * scale, fmt_max), 1087u << 20, 0x7Eu, 0x7Eu);
  return is_inf_or_nan(v) ? uint8_t{0x7F} : code;
}

// E5M2: an input infinity stays infinite (taken from the input, not the product, which
// is what tells it from an overflow); a NaN keeps the input's sign, as the CPU's product
// does. Taken from the input too: a GPU's FP32 multiply returns the canonical, positive
// NaN whatever its operand's sign (the first H200 run: every E5M2 cast of a negative NaN
// was 0x7F on the device, 0xFF on the CPU).
FASTCAST_HD uint8_t cast_e5m2(float v, float scale, float fmt_max) {
  const bool inf_or_nan = (bits_of(v) & 0x7FFFFFFFu) >= 0x7F800000u;
  const float y = inf_or_nan ? v : clamp(v * scale, fmt_max);
  return round_to_fp8<2, 15>(y, 143u << 23, 0x7Cu, 0x7Fu);
}

template <bool E4M3>
FASTCAST_HD uint8_t cast_fp8(float v, float scale, float fmt_max) {
  return E4M3 ? cast_e4m3(v, scale, fmt_max) : cast_e5m2(v, scale, fmt_max);
}

// ---- MXFP8: E8M0 shared exponents ------------------------------------------------------

struct MxParams {
  float fmt_max;
  bool ocp;
  int32_t emax_elem;   // exponent of the largest normal element value (ocp; X's cap)
  float fmt_mantissa;  // rceil: fmt_max = fmt_mantissa * 2**fmt_exponent (frexp)
  int32_t fmt_exponent;
};

// MxParams of E4M3 (e4m3 true) or E5M2. fmt_max's frexp from its bits (both maxima are
// normal): mantissa field over 2**24 plus 0.5, exponent field less 126.
FASTCAST_HD MxParams mx_params(bool e4m3, bool ocp) {
  const float fmt_max = e4m3 ? 448.0f : 57344.0f;
  const uint32_t b = bits_of(fmt_max);
  const float mantissa = float_of((126u << 23) | (b & 0x7FFFFFu));
  const int32_t exponent = static_cast<int32_t>(b >> 23) - 126;
  return MxParams{fmt_max, ocp, e4m3 ? 8 : 15, mantissa, exponent};
}

// shared_exponent (mx.py) of a finite amax >= 0, from its exponent field E. frexp gives
// amax = mant * 2**(E - 126), mant in [0.5, 1), for a normal amax, so
//   ocp:   X = (E - 126) - 1 - emax_elem,
//   rceil: X = (E - 126) - fmt_exponent + (mant > fmt_mantissa).
// An amax below the smallest normal (0 included) gives X < -127 under both rules (frexp's
// exponent is at most -126 there), so -127, which is also the reference's X for 0.
FASTCAST_HD int32_t shared_exponent(float amax, const MxParams& p) {
  const uint32_t b = bits_of(amax);
  const int32_t field = static_cast<int32_t>(b >> 23);
  const int32_t e = field - 126;
  const float mant = float_of((126u << 23) | (b & 0x7FFFFFu));
  const int32_t up = mant > p.fmt_mantissa ? 1 : 0;
  const int32_t x = p.ocp ? e - 1 - p.emax_elem : e - p.fmt_exponent + up;
  // At most 127 - emax_elem (mx.py's x_max): fmt_max * 2**X must stay finite. Only rceil
  // reaches past it, for an amax above fmt_max * 2**x_max.
  return field == 0 ? -127 : min_of(max_of(x, -127), 127 - p.emax_elem);
}

// 2**n as FP32 for n in [-127, 127] (power_of_2 in mx.py): 2**-127 is the subnormal
// 0x00400000, the rest have a zero mantissa.
FASTCAST_HD float power_of_2(int32_t n) {
  return float_of(n >= -126 ? static_cast<uint32_t>(n + 127) << 23 : 1u << 22);
}

// ---- NVFP4: E2M1 elements, E4M3 block scales, an FP32 tensor scale ---------------------
// (fastcast/quantizers/nvfp4.py's module docstring defines the math; TransformerEngine's
// formulas, each step rounded to FP32 where the reference rounds.)

constexpr float kE2M1Max = 6.0f;
constexpr float kE4M3Max = 448.0f;
constexpr float kOneSixth = 1.0f / 6.0f;  // 1/6 rounded to FP32, as the reference's

// The absolute value by clearing the sign bit (fabs; NaN stays NaN).
FASTCAST_HD float abs_of(float v) { return float_of(bits_of(v) & 0x7FFFFFFFu); }

// floor for a value >= 0 or NaN (the stochastic rounding's units, at most 12).
FASTCAST_HD float floor_of(float v) {
#if defined(__CUDA_ARCH__)
  return floorf(v);
#else
  return __builtin_floorf(v);
#endif
}

// scale_from_amax(amax, 6 * 448): the tensor encode scale s_enc, 1.0 for an amax of 0,
// floored so it stays finite. `amax` is the max over the finite elements.
FASTCAST_HD float nvfp4_encode_scale(float amax) {
  const float target = kE2M1Max * kE4M3Max;
  const float usable = is_finite(amax) ? amax : 0.0f;
  const float floor = static_cast<float>(static_cast<double>(target) / kFloatMax);
  const float scale = target / max_of(usable, floor);
  return usable > 0 ? scale : 1.0f;
}

// A value in [0, 448] (or NaN) as its E4M3 byte, rounded as torch's cast rounds.
FASTCAST_HD uint8_t e4m3_byte(float y) { return round_to_fp8<3, 7>(y, 1087u << 20, 0x7Eu, 0x7Eu); }

// The value of a non-negative E4M3 byte (0x7F: NaN), as c10 widens it, without branches.
FASTCAST_HD float e4m3_value(uint8_t byte) {
  const uint32_t code = byte;
  const float subnormal = static_cast<float>(code & 7u) * 0x1p-9f;
  const float normal = float_of((code << 20) + (uint32_t(127 - 7) << 23));
  const float value = (code >> 3) == 0 ? subnormal : normal;
  return code == 0x7Fu ? float_of(0x7FC00000u) : value;
}

// Any E4M3 (fn) or E5M2 byte widened to FP32, as c10 widens it (a NaN's payload aside):
// the magnitude from e4m3_value, or E5M2's as the top byte of an FP16, then the sign.
FASTCAST_HD float e5m2_value(uint8_t byte) {
  const uint32_t exponent = (byte >> 2) & 0x1Fu, mantissa = byte & 3u;
  const float subnormal = static_cast<float>(mantissa) * 0x1p-16f;
  const float normal = float_of(((exponent + 112u) << 23) | (mantissa << 21));
  const float special = float_of(mantissa == 0 ? 0x7F800000u : 0x7FC00000u);
  return exponent == 0 ? subnormal : (exponent == 31 ? special : normal);
}

template <bool E4M3>
FASTCAST_HD float fp8_to_float(uint8_t byte) {
  const float magnitude = E4M3 ? e4m3_value(byte & 0x7Fu) : e5m2_value(byte & 0x7Fu);
  return float_of(bits_of(magnitude) | (uint32_t(byte & 0x80u) << 24));
}

// The E4M3 byte of a block decode scale s_dec = amax_b * s_enc_6 with s_enc_6 = s_enc *
// (1/6) (scale_and_cast e4m3: a non-finite amax gives NaN, a finite one saturates at 448).
FASTCAST_HD uint8_t nvfp4_decode_scale(float amax_b, float s_enc_6) {
  const uint8_t byte = e4m3_byte(min_of(amax_b * s_enc_6, kE4M3Max));
  return is_inf_or_nan(amax_b) ? uint8_t{0x7F} : byte;
}

// The per-block encode multiplier 1 / (s_dec * s_dec_global) from the stored E4M3 s_dec,
// clamped to the FP32 max; 0 for a zero s_dec (the block encodes as zeros), NaN for a
// NaN one.
FASTCAST_HD float nvfp4_encode_multiplier(uint8_t s_dec_byte, float s_dec_global) {
  const float s_dec = e4m3_value(s_dec_byte);
  const float multiplier = min_of(1.0f / (s_dec * s_dec_global), kFloatMax);  // NaN stays
  return s_dec == 0.0f ? 0.0f : multiplier;
}

// E2M1 magnitude code of a scaled magnitude, rounded to nearest with ties to the even
// code (>= where a tie rounds up); NaN gives 0. Comparisons summed: it vectorises.
FASTCAST_HD uint8_t e2m1_nearest(float s) {
  return static_cast<uint8_t>((s > 0.25f) + (s >= 0.75f) + (s > 1.25f) + (s >= 1.75f) +
                              (s > 2.5f) + (s >= 3.5f) + (s > 5.0f));
}

// _round_stochastic for one scaled magnitude and its draw: to the grid value below plus
// one step when the draw is below the fraction of a step (all exact in FP32).
FASTCAST_HD uint8_t e2m1_stochastic(float s, float draw) {
  const float clamped = min_of(s, kE2M1Max);  // NaN stays NaN
  const float step = clamped >= 4.0f ? 2.0f : (clamped >= 2.0f ? 1.0f : 0.5f);
  const float units = clamped / step;
  float lower = floor_of(units);
  lower += (draw < units - lower) ? 1.0f : 0.0f;
  return e2m1_nearest(lower * step);
}

// The signed E2M1 code of x under its block's multiplier: bit 3 for x < 0 (NaN and -0.0
// give +0). `draw` is read only when Stochastic.
template <bool Stochastic>
FASTCAST_HD uint8_t e2m1_code(float x, float multiplier, float draw) {
  const float s = abs_of(x) * multiplier;
  const uint8_t code = Stochastic ? e2m1_stochastic(s, draw) : e2m1_nearest(s);
  return static_cast<uint8_t>(code | (x < 0.0f ? 8 : 0));
}

// The value of a 4-bit E2M1 code (bit 3 the sign, then the magnitude index of
// formats.E2M1_VALUES {0, 0.5, 1, 1.5, 2, 3, 4, 6}), built as FP32 bits: index 1 is the
// subnormal 0.5, an index i >= 2 is (1 + (i & 1) / 2) * 2**((i >> 1) - 1).
FASTCAST_HD float e2m1_value(uint8_t code) {
  const uint32_t mag = code & 7u, sign = uint32_t(code & 8u) << 28;
  const uint32_t normal = ((mag >> 1) + 126u) << 23 | (mag & 1u) << 22;
  const uint32_t bits = mag >= 2 ? normal : (mag == 1 ? 0x3F000000u : 0u);
  return float_of(bits | sign);
}

// ---- Delayed scaling's update ----------------------------------------------------------

// max() that keeps a NaN from either side, as torch.amax does (`v > a` is false for a
// NaN on either side, so only `v != v` takes one in). Branch-free: it vectorises.
FASTCAST_HD float nan_max(float a, float v) { return (v > a || v != v) ? v : a; }

// The new scale of a column whose window amax is `amax`: target / max(amax, floor), at
// least `least` when that is > 0; the old scale where the amax is not finite and > 0
// (nan_to_num(nan=0, posinf=0)).
FASTCAST_HD float delayed_scale(float amax, float old, float target, float floor, float least) {
  float next = target / max_of(amax, floor);
  next = least > 0 ? max_of(next, least) : next;
  return is_finite(amax) && amax > 0 ? next : old;
}

}  // namespace fastcast

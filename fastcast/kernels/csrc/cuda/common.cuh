// What the CUDA quantize kernels share: reading the input types, block-wide max
// reductions, launch sizes and the host-side type dispatch. The element arithmetic is
// element.h's (the very functions the CPU operators run).

#pragma once

// c10/cuda only, not ATen/cuda: ATen/cuda/CUDAContext.h pulls in cuBLAS and cuSPARSE
// headers, which a bare nvcc install (the compiler wheels) does not have.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_fp16.h>

#include <atomic>
#include <cstdint>

#include "../element.h"

namespace fastcast {
namespace cuda {

constexpr int kThreads = 256;  // threads per block of the elementwise kernels
constexpr int kWarps = kThreads / 32;

// The input element types, read as raw bits: FP32 as float, BF16 and FP16 as uint16_t.
// Each widens to FP32 exactly (as the reference's .float()), and its magnitude bits order
// the values as the CPU's do (element.h: magnitude_f32, magnitude_16).
struct F32 {
  using Raw = float;
  static constexpr uint32_t kInfMagnitude = 0x7F800000u;  // from here on: inf, then NaN
  static __device__ __forceinline__ float widen(float v) { return v; }
  static __device__ __forceinline__ uint32_t magnitude(float v) { return magnitude_f32(v); }
  static __device__ __forceinline__ float from_magnitude(uint32_t m) { return float_of(m); }
};

struct BF16 {
  using Raw = uint16_t;
  static constexpr uint32_t kInfMagnitude = 0x7F80u;
  static __device__ __forceinline__ float widen(uint16_t v) {
    return float_of(static_cast<uint32_t>(v) << 16);
  }
  static __device__ __forceinline__ uint32_t magnitude(uint16_t v) { return magnitude_16(v); }
  static __device__ __forceinline__ float from_magnitude(uint32_t m) {
    return widen(static_cast<uint16_t>(m));
  }
};

struct F16 {
  using Raw = uint16_t;
  static constexpr uint32_t kInfMagnitude = 0x7C00u;
  // Exact. __half2float returns the canonical, positive NaN for every NaN: the sign is
  // put back (an H200 run cast every negative FP16 NaN to E5M2 0x7F, the CPU to 0xFF);
  // a NaN's payload reaches no output. (A widening from the bits alone made
  // cast_tiles_kernel<F16, E5M2> spill 8 bytes on sm_90a.)
  static __device__ __forceinline__ float widen(uint16_t v) {
    return float_of(bits_of(__half2float(__ushort_as_half(v))) | (uint32_t(v & 0x8000u) << 16));
  }
  static __device__ __forceinline__ uint32_t magnitude(uint16_t v) { return magnitude_16(v); }
  static __device__ __forceinline__ float from_magnitude(uint32_t m) {
    return widen(static_cast<uint16_t>(m));
  }
};

// 16 bytes of input: one vector load (ld.global.v4) per thread and iteration.
template <typename In>
struct alignas(16) Vec {
  static constexpr int kSize = 16 / sizeof(typename In::Raw);
  typename In::Raw v[kSize];
};

// kSize output codes, stored at once (4 or 8 bytes).
template <int N>
struct Codes;
template <>
struct alignas(4) Codes<4> {
  uint8_t c[4];
};
template <>
struct alignas(8) Codes<8> {
  uint8_t c[8];
};

// Four consecutive inputs (one 8- or 16-byte load) and their four codes (one word).
template <typename In>
struct alignas(4 * sizeof(typename In::Raw)) Quad {
  typename In::Raw v[4];
};

// The four codes of q * scale, packed little-endian into a word (the bytes in order).
template <typename In, bool E4M3>
__device__ __forceinline__ uint32_t cast_quad(const Quad<In>& q, float scale, float fmt_max) {
  uint32_t word = 0;
#pragma unroll
  for (int j = 0; j < 4; ++j)
    word |= uint32_t{cast_fp8<E4M3>(In::widen(q.v[j]), scale, fmt_max)} << (8 * j);
  return word;
}

// Elements [4i, 4i + 4) of x (a Quad load when `quads`, else four loads; elements at or
// beyond `end` read as 0).
template <typename In>
__device__ __forceinline__ Quad<In> load_quad(const typename In::Raw* x, int64_t i, bool quads,
                                              int64_t end) {
  if (quads) return reinterpret_cast<const Quad<In>*>(x)[i];
  Quad<In> q;
#pragma unroll
  for (int j = 0; j < 4; ++j) q.v[j] = 4 * i + j < end ? x[4 * i + j] : typename In::Raw{0};
  return q;
}

// The max of `m` over the `width` lanes of each aligned group of a warp (a power of two
// up to 32): every lane of the group gets it.
template <int width>
__device__ __forceinline__ uint32_t group_max(uint32_t m) {
#pragma unroll
  for (int offset = width / 2; offset > 0; offset >>= 1)
    m = max_of(m, __shfl_xor_sync(0xFFFFFFFFu, m, offset));
  return m;
}

// The max of `m` over the block (every thread passes one); the result is valid in
// thread 0. `shared` holds kWarps entries.
__device__ __forceinline__ uint32_t block_max(uint32_t m, uint32_t* shared) {
  for (int offset = 16; offset > 0; offset >>= 1)
    m = max_of(m, __shfl_xor_sync(0xFFFFFFFFu, m, offset));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) shared[warp] = m;
  __syncthreads();
  if (warp == 0) {
    m = lane < kWarps ? shared[lane] : 0u;
    for (int offset = kWarps / 2; offset > 0; offset >>= 1)
      m = max_of(m, __shfl_xor_sync(0xFFFFFFFFu, m, offset));
  }
  return m;
}

// Folds the block's max magnitude bits into amax[0] and counts the block done in
// amax[1]: true in thread 0 of the block that finishes last, which then sees every
// block's max in amax[0] (the fence orders each block's max before its count).
__device__ __forceinline__ bool fold_block_max(uint32_t m, uint32_t* amax) {
  __shared__ uint32_t shared[kWarps];
  m = block_max(m, shared);
  if (threadIdx.x != 0) return false;
  atomicMax(amax, m);
  __threadfence();
  const bool last = atomicAdd(amax + 1, 1u) == gridDim.x - 1;
  if (last) __threadfence();
  return last;
}

// The current block's max magnitude bits as folded by every block (valid in the last
// block, after fold_block_max returned true): read through L2, where the atomics went.
__device__ __forceinline__ uint32_t folded_max(uint32_t* amax) { return atomicOr(amax, 0u); }

// Blocks for a grid-stride loop over `work` items of `per_block` each: enough to fill
// the GPU a few times over, never more than the work, at least one (a kernel that also
// writes a scale runs for an empty tensor too).
inline int64_t max_blocks() {
  // The SM count per device, asked once (a device attribute: no sync, but not free).
  static std::atomic<int> sms[256] = {};
  const int device = c10::cuda::current_device();
  int count = sms[device].load(std::memory_order_relaxed);
  if (count == 0) {
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
    sms[device].store(count, std::memory_order_relaxed);
  }
  return int64_t{count} * 8;  // 8 blocks of kThreads fill an SM (2048 threads)
}

inline int grid_for(int64_t work, int64_t per_block) {
  const int64_t cap = max_blocks();
  const int64_t blocks = (work + per_block - 1) / per_block;
  return static_cast<int>(blocks < 1 ? 1 : (blocks < cap ? blocks : cap));
}

// torch's current stream on the current device (the caller's guard has set it to x's).
inline cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

inline bool aligned_16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Whether rows of `cols` elements starting at p are all aligned for Quad loads.
template <typename In>
bool quads_fit(const void* p, int64_t cols) {
  return cols % 4 == 0 && reinterpret_cast<uintptr_t>(p) % (4 * sizeof(typename In::Raw)) == 0;
}

// What the operators check of a one-element FP32 tensor they read or write (a scale, an
// amax slot): on x's device. `op` and `what` name it in the error.
inline void check_scalar(const at::Tensor& t, const at::Tensor& x, const char* op,
                         const char* what) {
  TORCH_CHECK(t.device() == x.device() && t.scalar_type() == at::kFloat && t.numel() == 1,
              "fastcast::", op, ": ", what, " must be a one-element FP32 tensor on ", x.device());
}

// Calls fn(In{}, std::bool_constant<e4m3>{}) with the input reader In (F32, BF16, F16)
// and whether `dtype` is E4M3 (else E5M2): one kernel instance per pair.
template <typename Fn>
void dispatch_types(at::ScalarType input, at::ScalarType dtype, const char* op, Fn&& fn) {
  TORCH_CHECK(dtype == at::kFloat8_e4m3fn || dtype == at::kFloat8_e5m2, "fastcast::", op,
              ": dtype must be an FP8 type, got ", dtype);
  auto with_input = [&](auto e4m3) {
    switch (input) {
      case at::kFloat: return fn(F32{}, e4m3);
      case at::kBFloat16: return fn(BF16{}, e4m3);
      case at::kHalf: return fn(F16{}, e4m3);
      default: TORCH_CHECK(false, "fastcast::", op, ": cannot quantize ", input);
    }
  };
  if (dtype == at::kFloat8_e4m3fn)
    with_input(std::true_type{});
  else
    with_input(std::false_type{});
}

template <bool E4M3>
constexpr float kFmtMax = E4M3 ? 448.0f : 57344.0f;

}  // namespace cuda
}  // namespace fastcast

// Delayed scaling's update on CUDA: the CUDA kernel of delayed_update (tensorwise.cpp),
// same signature and values (element.h: nan_max, delayed_scale), in place, in one launch
// on torch's current stream; nothing is read back by the host.
//
// One thread block per column j of history [L, N] (a column's update touches no other):
// the threads walk rows 1..L-1 in chunks of kThreads, each thread reading one row's value
// (folded into the window's amax) and, after the block has read the whole chunk, writing
// it one row up when the column recorded this step. A chunk writes only rows the chunks
// before it have read, so the roll needs no copy. Then thread 0 sets the scale, the last
// row (the recorded amax) and row 0 (zero).

#include <torch/library.h>

#include "common.cuh"

namespace fastcast {
namespace cuda {
namespace {

struct Update {
  float target, floor, least;
  bool most_recent;
};

// nan_max over the block (every thread passes one value): valid in thread 0. The order
// of a NaN-keeping max does not change its result (NaN if any is NaN, else the max).
__device__ __forceinline__ float block_nan_max(float v, float* shared) {
  for (int offset = 16; offset > 0; offset >>= 1)
    v = nan_max(v, __shfl_xor_sync(0xFFFFFFFFu, v, offset));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < kWarps ? shared[lane] : v;
    for (int offset = kWarps / 2; offset > 0; offset >>= 1)
      v = nan_max(v, __shfl_xor_sync(0xFFFFFFFFu, v, offset));
  }
  return v;
}

__global__ void __launch_bounds__(kThreads)
    update_kernel(float* history, float* scale, int64_t rows, int64_t cols, Update u) {
  __shared__ float shared[kWarps];
  const int64_t j = blockIdx.x;
  const float recorded = history[j];
  if (!(recorded > 0)) {  // did not record this step (NaN included, as torch's `>`)
    if (threadIdx.x == 0) history[j] = 0.0f;
    return;
  }
  float amax = recorded;
  for (int64_t start = 1; start < rows; start += kThreads) {
    const int64_t r = start + threadIdx.x;
    const float v = r < rows ? history[r * cols + j] : recorded;
    if (!u.most_recent) amax = nan_max(amax, v);
    __syncthreads();  // the chunk is read before any of it moves up
    if (r < rows && r >= 2) history[(r - 1) * cols + j] = v;
  }
  amax = block_nan_max(amax, shared);
  if (threadIdx.x != 0) return;
  scale[j] = delayed_scale(amax, scale[j], u.target, u.floor, u.least);
  if (rows > 1) history[(rows - 1) * cols + j] = recorded;
  history[j] = 0.0f;
}

void delayed_update(const at::Tensor& history, const at::Tensor& scale, double target,
                    double floor, double min_scale, bool most_recent) {
  TORCH_CHECK(history.is_cuda() && scale.device() == history.device(),
              "fastcast::delayed_update: history and scale must be on one CUDA device");
  TORCH_CHECK(history.scalar_type() == at::kFloat && scale.scalar_type() == at::kFloat &&
                  history.dim() == 2 && scale.dim() == 1 &&
                  history.size(1) == scale.size(0) && history.is_contiguous() &&
                  scale.is_contiguous(),
              "fastcast::delayed_update: needs a contiguous float32 history [L, N] and "
              "scale [N]");
  const int64_t rows = history.size(0), cols = history.size(1);
  if (cols == 0 || rows == 0) return;
  TORCH_CHECK(cols <= 0x7FFFFFFF, "fastcast::delayed_update: too many columns");
  const c10::cuda::CUDAGuard guard(history.device());
  const Update u{static_cast<float>(target), static_cast<float>(floor),
                 static_cast<float>(min_scale), most_recent};
  update_kernel<<<static_cast<unsigned>(cols), kThreads, 0, current_stream()>>>(
      history.data_ptr<float>(), scale.data_ptr<float>(), rows, cols, u);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace
}  // namespace cuda

TORCH_LIBRARY_IMPL(fastcast_kernels, CUDA, m) {
  m.impl("delayed_update", &cuda::delayed_update);
}

}  // namespace fastcast

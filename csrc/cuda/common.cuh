// Warp and block reductions shared by the CUDA kernels.
#pragma once

#include <cuda_runtime.h>
#include <math.h>

namespace fastcl::cuda {

template <typename T>
__device__ __forceinline__ T neg_inf() {
  return -static_cast<T>(HUGE_VAL);
}

template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// max that propagates NaN (fmaxf and `a > b ? a : b` drop it): a NaN logit must make its
// row's LSE NaN (docs/losses.md, "Non-finite inputs"), never be skipped
template <typename T>
__device__ __forceinline__ T nan_max(T a, T b) {
  return (a != a || b != b) ? a + b : (a > b ? a : b);
}

template <typename T>
__device__ __forceinline__ T warp_max(T v) {
  for (int o = 16; o > 0; o >>= 1) v = nan_max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Block-wide reductions for blockDim.x a multiple of 32 (<= 1024); scratch holds 32 values.
// Every thread gets the result. The trailing barrier lets the caller reuse scratch.
template <typename T, bool kMax>
__device__ T block_reduce(T v, T* scratch) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  v = kMax ? warp_max(v) : warp_sum(v);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  T out = lane < warps ? scratch[lane] : (kMax ? neg_inf<T>() : T(0));
  out = kMax ? warp_max(out) : warp_sum(out);
  __syncthreads();
  return out;
}

}  // namespace fastcl::cuda

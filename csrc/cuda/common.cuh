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

template <typename T>
__device__ __forceinline__ T warp_max(T v) {
  for (int o = 16; o > 0; o >>= 1) {
    const T w = __shfl_xor_sync(0xffffffffu, v, o);
    v = w > v ? w : v;
  }
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

// Host-side interface of the CUDA kernels (lse_rows.cu, lse_forward_tc.cu) for the torch glue
// (lse_cuda.cpp). No torch here: the .cu files compile with a bare nvcc (test_cuda_compile.py).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../cpu/head.h"

namespace fastcl::cuda {

enum RowMode : int { kForward = 0, kBackward = 1, kFused = 2 };

// One block of R anchor rows (r0 .. r0 + R) against all N candidates; see lse_rows.cu.
template <typename T>
struct RowArgs {
  int mode = kForward;
  int64_t r0 = 0, R = 0, N = 0;
  T* s = nullptr;                // [R, N] raw dot products in; forward: logits/probs (scratch),
                                 // backward/fused: the weights X = dLoss/d<a_i, c> out
  const T* inv_a = nullptr;      // [B] 1 / max(|a_i|, eps) (ones for dot similarity)
  const T* inv_c = nullptr;      // [N]
  const int32_t* tags = nullptr; // [N] -2 padding, -1 every row, i >= 0 all rows but i
  const T* inv_tau = nullptr;    // 0-d, on the device (no host sync)
  T* lse = nullptr;              // [B] out (forward, fused)
  T* mean_logit = nullptr;       // [B] out (forward, fused)
  const T* lse_in = nullptr;     // [B] (backward)
  const T* grad_lse = nullptr;   // [B] (backward)
  fastcl::cpu::Head<T> head{};   // fused: the loss head (device pointers)
  T* g_rows = nullptr;           // [B] out (fused): w_i dloss_i/dlse_i
  fastcl::cpu::Fold<T> fold{};   // own positives to fold (dpos null: none)
};

template <typename T>
cudaError_t launch_rows(const RowArgs<T>& args, cudaStream_t stream);

// e[r] <- normalisation backward of gradient row e[r] against raw row x[r] (norm > eps).
template <typename T>
cudaError_t launch_normalize_backward(T* e, const T* x, const T* norm, int64_t rows, int64_t d, double eps,
                                      cudaStream_t stream);

// Tensor-core forward (WMMA, float32 accumulation) for 16-bit inputs: lse and mean logit
// of every anchor row, flash-style (online softmax over candidate tiles, no [B, N] buffer).
// half_kind: 0 = float16, 1 = bfloat16. a [B, d], c [N, d] row-major contiguous.
cudaError_t launch_forward_tc(int half_kind, const void* a, const void* c, int64_t B, int64_t N, int64_t d,
                              const float* inv_a, const float* inv_c, const int32_t* tags, const float* inv_tau,
                              float* lse, float* mean_logit, cudaStream_t stream);

}  // namespace fastcl::cuda

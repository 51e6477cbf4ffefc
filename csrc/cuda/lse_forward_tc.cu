// Tensor-core forward of the masked-LSE primitive for float16/bfloat16 inputs, flash-style
// (online max / sum exp / sum exp * logit over candidate tiles, no B x N buffer, inputs
// read in their own dtype). Tiles, shared-memory budget and limits: docs/csrc.md.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>

#include "common.cuh"
#include "launch.h"

namespace fastcl::cuda {
namespace {

namespace wmma = nvcuda::wmma;

constexpr int kBM = 64, kBN = 64, kBK = 64, kWarps = 4, kThreads = kWarps * 32;
constexpr int kLdIn = kBK + 8, kLdS = kBN + 4;

template <typename In>
__device__ __forceinline__ In zero_in();
template <>
__device__ __forceinline__ __half zero_in<__half>() {
  return __float2half(0.0f);
}
template <>
__device__ __forceinline__ __nv_bfloat16 zero_in<__nv_bfloat16>() {
  return __float2bfloat16(0.0f);
}

template <typename In>
__global__ void __launch_bounds__(kThreads) forward_tc_kernel(const In* __restrict__ A, const In* __restrict__ C,
                                                              int64_t B, int64_t N, int64_t d,
                                                              const float* __restrict__ inv_a,
                                                              const float* __restrict__ inv_c,
                                                              const int32_t* __restrict__ tags,
                                                              const float* __restrict__ inv_tau,
                                                              float* __restrict__ lse, float* __restrict__ mean_logit) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  __shared__ __align__(32) In sa[kBM * kLdIn];
  __shared__ __align__(32) In sc[kBN * kLdIn];
  __shared__ __align__(32) float st[kBM * kLdS];
  __shared__ float run_m[kBM], run_s[kBM], run_pl[kBM];

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t m0 = static_cast<int64_t>(blockIdx.x) * kBM;
  const float it = *inv_tau;
  const float ninf = neg_inf<float>();
  for (int r = threadIdx.x; r < kBM; r += kThreads) {
    run_m[r] = ninf;
    run_s[r] = 0.0f;
    run_pl[r] = 0.0f;
  }
  __syncthreads();

  for (int64_t n0 = 0; n0 < N; n0 += kBN) {
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[kBN / 16];
#pragma unroll
    for (int j = 0; j < kBN / 16; ++j) wmma::fill_fragment(acc[j], 0.0f);

    for (int64_t k0 = 0; k0 < d; k0 += kBK) {
      __syncthreads();  // the previous chunk's fragments are loaded
      for (int idx = threadIdx.x; idx < kBM * kBK; idx += kThreads) {
        const int r = idx / kBK, k = idx % kBK;
        const int64_t gk = k0 + k, ga = m0 + r, gc = n0 + r;
        sa[r * kLdIn + k] = (ga < B && gk < d) ? A[ga * d + gk] : zero_in<In>();
        sc[r * kLdIn + k] = (gc < N && gk < d) ? C[gc * d + gk] : zero_in<In>();
      }
      __syncthreads();
#pragma unroll
      for (int kk = 0; kk < kBK; kk += 16) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, In, wmma::row_major> fa;
        wmma::load_matrix_sync(fa, sa + warp * 16 * kLdIn + kk, kLdIn);
#pragma unroll
        for (int j = 0; j < kBN / 16; ++j) {
          // C stored [n, k] row-major is the [k, n] operand in column-major
          wmma::fragment<wmma::matrix_b, 16, 16, 16, In, wmma::col_major> fb;
          wmma::load_matrix_sync(fb, sc + j * 16 * kLdIn + kk, kLdIn);
          wmma::mma_sync(acc[j], fa, fb, acc[j]);
        }
      }
    }
    float* sw = st + warp * 16 * kLdS;
#pragma unroll
    for (int j = 0; j < kBN / 16; ++j) wmma::store_matrix_sync(sw + j * 16, acc[j], kLdS, wmma::mem_row_major);
    __syncwarp();

    // this warp's 16 rows: lane owns columns lane and lane + 32 of the tile
    for (int r = 0; r < 16; ++r) {
      const int lr = warp * 16 + r;
      const int64_t gr = m0 + lr;
      if (gr >= B) break;  // warp-uniform
      const float rs = inv_a[gr] * it;
      float l[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int c = lane + 32 * h;
        const int64_t gc = n0 + c;
        const int32_t t = gc < N ? tags[gc] : -2;
        l[h] = (t == -2 || t == gr) ? ninf : sw[r * kLdS + c] * rs * inv_c[gc];
      }
      // NaN-propagating max: a NaN logit makes the row's LSE NaN instead of being skipped
      const float tile_max = warp_max(nan_max(l[0], l[1]));
      if (tile_max == ninf) continue;  // warp-uniform: nothing valid in this tile
      const float m_old = run_m[lr];
      const float m_new = nan_max(m_old, tile_max);
      float p_sum = 0.0f, pl_sum = 0.0f;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if (l[h] != ninf) {
          const float p = __expf(l[h] - m_new);
          p_sum += p;
          pl_sum += p * l[h];
        }
      }
      p_sum = warp_sum(p_sum);
      pl_sum = warp_sum(pl_sum);
      if (lane == 0) {
        const float scale = m_old == ninf ? 0.0f : __expf(m_old - m_new);
        run_s[lr] = run_s[lr] * scale + p_sum;
        run_pl[lr] = run_pl[lr] * scale + pl_sum;
        run_m[lr] = m_new;
      }
      __syncwarp();
    }
  }
  __syncthreads();
  for (int r = threadIdx.x; r < kBM; r += kThreads) {
    const int64_t gr = m0 + r;
    if (gr >= B) continue;
    const bool empty = run_m[r] == ninf;
    lse[gr] = empty ? ninf : run_m[r] + logf(run_s[r]);
    mean_logit[gr] = empty ? 0.0f : run_pl[r] / run_s[r];
  }
#endif
}

}  // namespace

cudaError_t launch_forward_tc(int half_kind, const void* a, const void* c, int64_t B, int64_t N, int64_t d,
                              const float* inv_a, const float* inv_c, const int32_t* tags, const float* inv_tau,
                              float* lse, float* mean_logit, cudaStream_t stream) {
  if (B == 0) return cudaSuccess;
  const unsigned grid = static_cast<unsigned>((B + kBM - 1) / kBM);
  if (half_kind == 0) {
    forward_tc_kernel<__half><<<grid, kThreads, 0, stream>>>(static_cast<const __half*>(a),
                                                             static_cast<const __half*>(c), B, N, d, inv_a, inv_c,
                                                             tags, inv_tau, lse, mean_logit);
  } else {
    forward_tc_kernel<__nv_bfloat16><<<grid, kThreads, 0, stream>>>(
        static_cast<const __nv_bfloat16*>(a), static_cast<const __nv_bfloat16*>(c), B, N, d, inv_a, inv_c, tags,
        inv_tau, lse, mean_logit);
  }
  return cudaGetLastError();
}

}  // namespace fastcl::cuda

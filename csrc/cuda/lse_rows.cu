// Row kernels of the CUDA backend (docs/csrc.md, "CUDA kernels"). rows_kernel: one thread
// block per anchor row of a [R, N] block of raw dot products; the same passes as the CPU
// row passes (logits, max, exp-sums, head.h, weights X, own-positive fold). Each thread
// visits the same columns in every pass, so only the reductions and the fold need barriers.
#include "common.cuh"
#include "launch.h"

namespace fastcl::cuda {
namespace {

constexpr int kRowThreads = 256;

template <typename T>
__global__ void __launch_bounds__(kRowThreads) rows_kernel(RowArgs<T> a) {
  __shared__ T scratch[32];
  __shared__ T g_shared;
  const int64_t i = blockIdx.x, gi = a.r0 + i, N = a.N;
  T* row = a.s + i * N;
  const T rs = a.inv_a[gi] * *a.inv_tau;
  const T ninf = neg_inf<T>();

  if (a.mode == kBackward) {
    const T lse = a.lse_in[gi], g = a.grad_lse[gi];
    const bool none = lse == ninf || g == T(0);  // a NaN lse stays NaN in the weights
    for (int64_t c = threadIdx.x; c < N; c += blockDim.x) {
      const int32_t t = a.tags[c];
      T x = T(0);
      if (!none && t != -2 && t != gi) {
        const T cs = a.inv_c[c];
        x = ::exp(row[c] * rs * cs - lse) * g * rs * cs;
      }
      row[c] = x;
    }
  } else {
    T m = ninf;
    for (int64_t c = threadIdx.x; c < N; c += blockDim.x) {
      const int32_t t = a.tags[c];
      const T l = (t == -2 || t == gi) ? ninf : row[c] * rs * a.inv_c[c];
      row[c] = l;
      m = nan_max(m, l);
    }
    m = block_reduce<T, true>(m, scratch);
    T sp = T(0), spl = T(0);
    for (int64_t c = threadIdx.x; c < N; c += blockDim.x) {
      const T l = row[c];
      const T p = m == ninf ? T(0) : ::exp(l - m);  // excluded columns: exp(-inf) = 0; NaN m: NaN
      row[c] = p;
      sp += p;
      if (l > ninf) spl += p * l;
    }
    sp = block_reduce<T, false>(sp, scratch);
    spl = block_reduce<T, false>(spl, scratch);
    const bool empty = m == ninf;  // a NaN m (a NaN logit) is not empty: the LSE is NaN
    const T lse = empty ? ninf : m + ::log(sp);
    if (threadIdx.x == 0) {
      a.lse[gi] = lse;
      a.mean_logit[gi] = empty ? T(0) : spl / sp;
    }
    if (a.mode == kFused) {
      if (threadIdx.x == 0) {
        const T g = a.head.row(gi, lse);
        a.g_rows[gi] = g;
        g_shared = g;
      }
      __syncthreads();
      const T factor = sp > T(0) ? g_shared * rs / sp : T(0);
      for (int64_t c = threadIdx.x; c < N; c += blockDim.x) row[c] = row[c] * factor * a.inv_c[c];
    }
  }
  if (a.fold.dpos != nullptr && a.mode != kForward) {
    __syncthreads();  // the row and (fused) the head's d_pos are complete
    const T* dp = a.fold.dpos + gi * a.fold.count;
    const int64_t c0 = a.fold.offset + gi * a.fold.count;
    for (int64_t k = threadIdx.x; k < a.fold.count; k += blockDim.x) row[c0 + k] += dp[k] * rs * a.inv_c[c0 + k];
  }
}

// One warp per row; written as normalize_backward() in fastcl/ops/normalize.py.
template <typename T>
__global__ void __launch_bounds__(256) normalize_backward_kernel(T* e, const T* x, const T* norm, int64_t rows,
                                                                 int64_t d, T eps) {
  const int64_t r = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (r >= rows) return;
  const T n = norm[r];
  if (!(n > eps)) return;  // clamped norm: the gradient is e itself
  T* er = e + r * d;
  const T* xr = x + r * d;
  T radial = T(0);
  for (int64_t c = lane; c < d; c += 32) radial += (xr[c] / n) * (er[c] * n);
  radial = warp_sum(radial);
  for (int64_t c = lane; c < d; c += 32) er[c] = (er[c] * n - (xr[c] / n) * radial) / n;
}

}  // namespace

template <typename T>
cudaError_t launch_rows(const RowArgs<T>& args, cudaStream_t stream) {
  if (args.R == 0) return cudaSuccess;
  rows_kernel<T><<<static_cast<unsigned>(args.R), kRowThreads, 0, stream>>>(args);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_normalize_backward(T* e, const T* x, const T* norm, int64_t rows, int64_t d, double eps,
                                      cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  const int64_t blocks = (rows * 32 + 255) / 256;
  normalize_backward_kernel<T><<<static_cast<unsigned>(blocks), 256, 0, stream>>>(e, x, norm, rows, d, T(eps));
  return cudaGetLastError();
}

template cudaError_t launch_rows<float>(const RowArgs<float>&, cudaStream_t);
template cudaError_t launch_rows<double>(const RowArgs<double>&, cudaStream_t);
template cudaError_t launch_normalize_backward<float>(float*, const float*, const float*, int64_t, int64_t, double,
                                                      cudaStream_t);
template cudaError_t launch_normalize_backward<double>(double*, const double*, const double*, int64_t, int64_t,
                                                       double, cudaStream_t);

}  // namespace fastcl::cuda

// fastcl's own float32 GEMM tile for step 1 of the cpp sweep (lse_cpu.cpp, tiled_raw_dots):
// S = A C^T, kRows x kCols outputs per call, where MKL runs generic kernels (docs/csrc.md,
// "Own GEMM tile"). AVX-512 builds only; elsewhere kAvailable is false and the sweep calls MKL.
//
// A block's anchors are packed into row tiles of kRows, k-major; each thread packs its
// candidates into panels of kCols columns, k-major, a group of panels (~64 KB) at a time, and
// runs every row tile over the group while it is in L2. Each output is the plain sum
// a_0 c_0 + a_1 c_1 + ... in k order with one fused multiply-add per term.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string_view>
#include <type_traits>

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

namespace fastcl::cpu::gemm {

// 12 x 32: 24 accumulators (two 16-lane registers per row), 2 panel registers and the
// broadcast fit AVX-512's 32 registers.
constexpr int64_t kRows = 12, kCols = 32;

#if defined(CPU_CAPABILITY_AVX512)
constexpr bool kAvailable = true;
#define FASTCL_CPU_TARGET "AVX-512"
#elif defined(CPU_CAPABILITY_AVX2)
constexpr bool kAvailable = false;
#define FASTCL_CPU_TARGET "AVX2"
#else
constexpr bool kAvailable = false;
#define FASTCL_CPU_TARGET "no vector extension"
#endif

// Whether the CPU reports itself as Intel's (cpuid leaf 0; a VM reports its host's).
inline bool cpu_vendor_is_intel() {
#if defined(__x86_64__) || defined(__i386__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(0, &a, &b, &c, &d)) return false;
  char vendor[12];
  std::memcpy(vendor, &b, 4), std::memcpy(vendor + 4, &d, 4), std::memcpy(vendor + 8, &c, 4);
  return std::string_view(vendor, 12) == "GenuineIntel";
#else
  return false;
#endif
}

inline int64_t num_panels(int64_t n) { return (n + kCols - 1) / kCols; }
inline int64_t num_tiles(int64_t rows) { return (rows + kRows - 1) / kRows; }

// Panel q of `out` ([panels, d, kCols]) from candidates [q kCols, (q + 1) kCols) (row(c) gives
// candidate c's [d] row); columns beyond N are zero.
template <typename T, typename RowOf>
void pack_panel(T* out, int64_t q, int64_t N, int64_t d, const RowOf& row) {
  T* dst = out + q * d * kCols;
  const T* src[kCols];
  const int64_t n = std::min(kCols, N - q * kCols);
  for (int64_t j = 0; j < n; ++j) src[j] = row(q * kCols + j);
  for (int64_t k = 0; k < d; ++k) {  // writes in order, reads from kCols rows in order
    for (int64_t j = 0; j < n; ++j) dst[k * kCols + j] = src[j][k];
    for (int64_t j = n; j < kCols; ++j) dst[k * kCols + j] = T(0);
  }
}

// Row tiles [t0, t1) of the tiles of `rows` rows of a ([rows, d], contiguous) into out
// ([num_tiles(rows), d, kRows]), zero beyond the last row.
template <typename T>
void pack_rows(T* out, const T* a, int64_t rows, int64_t d, int64_t t0, int64_t t1) {
  for (int64_t t = t0; t < t1; ++t) {
    T* dst = out + t * d * kRows;
    const int64_t n = std::min(kRows, rows - t * kRows);
    const T* src = a + t * kRows * d;
    for (int64_t k = 0; k < d; ++k) {
      for (int64_t r = 0; r < n; ++r) dst[k * kRows + r] = src[r * d + k];
      for (int64_t r = n; r < kRows; ++r) dst[k * kRows + r] = T(0);
    }
  }
}

// out[r * ld + j] = sum_k at[k * kRows + r] * panel[k * kCols + j] for r < kRows, j < kCols
// (at: a packed row tile, panel: a packed panel). float only: other types never take this path.
template <typename T>
void tile(const T* __restrict at, const T* __restrict panel, int64_t d, T* __restrict out, int64_t ld) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, float>) {
    // 24 named accumulators rather than arrays: arrays were zeroed and stored through the stack
#define FASTCL_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
#define FASTCL_ZERO(r) __m512 lo##r = _mm512_setzero_ps(), hi##r = _mm512_setzero_ps();
#define FASTCL_FMA(r)                      \
  {                                        \
    const __m512 x = _mm512_set1_ps(a[r]); \
    lo##r = _mm512_fmadd_ps(x, c0, lo##r); \
    hi##r = _mm512_fmadd_ps(x, c1, hi##r); \
  }
#define FASTCL_STORE(r)                  \
  _mm512_storeu_ps(out + r * ld, lo##r); \
  _mm512_storeu_ps(out + r * ld + 16, hi##r);
    FASTCL_ROWS(FASTCL_ZERO)
    for (int64_t k = 0; k < d; ++k) {
      const __m512 c0 = _mm512_load_ps(panel + k * kCols), c1 = _mm512_load_ps(panel + k * kCols + 16);
      const float* a = at + k * kRows;
      FASTCL_ROWS(FASTCL_FMA)
    }
    FASTCL_ROWS(FASTCL_STORE)
#undef FASTCL_ROWS
#undef FASTCL_ZERO
#undef FASTCL_FMA
#undef FASTCL_STORE
  }
#else
  (void)at, (void)panel, (void)d, (void)out, (void)ld;
#endif
}

}  // namespace fastcl::cpu::gemm

// The loss head of fastcl/ops/head.py for one anchor row (head_rows() and HeadInputs.rows(),
// transcribed line by line; formulas in docs/csrc.md), used by lse_fused.
#pragma once

#include <math.h>  // the float and double overloads of exp/log1p in the global namespace

#include <cstdint>

namespace fastcl::cpu {

// Own positives folded into the weights X: anchor i's positive k is column
// offset + i * count + k of block 0, its logit gradient dpos[i * count + k].
template <typename T>
struct Fold {
  const T* dpos = nullptr;
  int64_t offset = 0, count = 0;
};

template <typename T>
struct Head {
  bool use_softplus;   // phi = softplus (SupMPN) instead of the identity (cross entropy)
  int64_t num_pos;     // P
  const T* pos;        // [B, P] own-positive logits
  const bool* mask;    // [B, P] or nullptr (all valid)
  const T* log_extra;  // [B] (this prefix's rows with matryoshka dims) or nullptr
  const T* weights;    // [B]
  T* loss_rows;        // [B] out
  T* d_pos;            // [B, P] out

  static T inf() { return static_cast<T>(HUGE_VAL); }
  static T logaddexp(T a, T b) {
    const T m = a > b ? a : b;
    if (m == -inf()) return m;
    return m + ::log1p(::exp(-(a > b ? a - b : b - a)));
  }
  // exact for every x (no threshold): max(x, 0) + log1p(exp(-|x|)), as head.py's
  // logaddexp(x, 0); NaN stays NaN
  static T softplus(T x) {
    if (x != x) return x;
    return (x > T(0) ? x : T(0)) + ::log1p(::exp(x > T(0) ? -x : x));
  }
  static T sigmoid(T x) { return T(1) / (T(1) + ::exp(-x)); }

  // Writes loss_rows[i] and d_pos[i, :]; returns w_i * dloss_i/dlse_i.
  T row(int64_t i, T lse) const {
    const T* p = pos + i * num_pos;
    const bool* m = mask ? mask + i * num_pos : nullptr;
    T* dp = d_pos + i * num_pos;
    T count = 0;
    for (int64_t k = 0; k < num_pos; ++k) count += (!m || m[k]) ? T(1) : T(0);
    const T inv_count = T(1) / (count > T(1) ? count : T(1));
    const T w = weights[i];
    const T r = log_extra ? logaddexp(lse, log_extra[i]) : lse;
    T sum_phi = 0, sum_dphi = 0;
    for (int64_t k = 0; k < num_pos; ++k) {
      if (m && !m[k]) {
        dp[k] = T(0);
        continue;
      }
      const T x = r - p[k];
      const T phi = use_softplus ? softplus(x) : x;
      const T dphi = use_softplus ? sigmoid(x) : T(1);
      sum_phi += phi;
      sum_dphi += dphi;
      dp[k] = -dphi * inv_count * w;
    }
    loss_rows[i] = sum_phi * inv_count;
    T dlse = sum_dphi * inv_count;
    // d logaddexp(lse, c) / d lse = exp(lse - r): none for an empty row (r = -inf); NaN stays NaN
    if (log_extra) dlse *= (r == -inf()) ? T(0) : ::exp(lse - r);
    return dlse * w;
  }
};

}  // namespace fastcl::cpu

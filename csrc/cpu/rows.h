// Vectorised passes over one row of a logits block (at::vec), used by lse_cpu.cpp. A row
// holds the raw dot products s_c = <a_i, c>; the logit is l_c = s_c * row_scale *
// col_scale[c] + col_add[c] (row_scale = inv_a_i / tau, col_scale = inv_c, col_add 0 or
// -inf for padding; excluded columns are -inf already). Each pass writes back into the
// row. Reductions keep one accumulator per lane, added in a fixed order (thread-independent).
#pragma once

#include <ATen/cpu/vec/vec.h>

#include <cmath>
#include <limits>
#include <utility>

namespace fastcl::cpu::rows {

using at::vec::Vectorized;

template <typename T>
constexpr T neg_inf() {
  return -std::numeric_limits<T>::infinity();
}

// max that propagates NaN (a NaN logit must make the row's LSE NaN, not be skipped)
template <typename T>
T nan_max(T x, T y) {
  return (x != x || y != y) ? x + y : (x > y ? x : y);
}

template <typename T, typename Op>
T reduce_lanes(const Vectorized<T>& v, T init, Op op) {
  T lanes[Vectorized<T>::size()];
  v.store(lanes);
  T out = init;
  for (int k = 0; k < Vectorized<T>::size(); ++k) out = op(out, lanes[k]);
  return out;
}

// max_k |x_k|, NaN when an entry is NaN (else inf when one is infinite): one vectorised
// pass (the row scan of every input row; a scalar loop cost ~5 % of a B = 1024 step).
template <typename T>
T max_abs(const T* x, int64_t n) {
  using V = Vectorized<T>;
  V vmax(T(0));
  int64_t k = 0;
  for (; k + V::size() <= n; k += V::size()) vmax = at::vec::maximum(vmax, V::loadu(x + k).abs());
  T m = reduce_lanes<T>(vmax, T(0), nan_max<T>);
  for (; k < n; ++k) m = nan_max(m, std::abs(x[k]));
  return m;
}

// sum_k x_k^2 accumulated in double, in 8 independent partial sums (added in a fixed
// order) so that the compiler can vectorise it; results do not depend on threads.
template <typename T>
double sum_squares(const T* x, int64_t n) {
  double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) {
    for (int j = 0; j < 8; ++j) acc[j] += double(x[k + j]) * double(x[k + j]);
  }
  double s = 0;
  for (int j = 0; j < 8; ++j) s += acc[j];
  for (; k < n; ++k) s += double(x[k]) * double(x[k]);
  return s;
}

// row[c] <- logit l_c (kStore false: the row keeps its raw dot products); returns max_c l_c
// (-inf when every column is excluded, NaN when a logit is NaN: at::vec::maximum propagates
// NaN, and so do the lane and tail reductions).
template <typename T, bool kStore = true>
T logits_and_max(T* row, const T* col_scale, const T* col_add, T row_scale, int64_t n) {
  using V = Vectorized<T>;
  const V rs(row_scale);
  V vmax(neg_inf<T>());
  int64_t c = 0;
  for (; c + V::size() <= n; c += V::size()) {
    V l = V::loadu(row + c) * rs * V::loadu(col_scale + c) + V::loadu(col_add + c);
    if constexpr (kStore) l.store(row + c);
    vmax = at::vec::maximum(vmax, l);
  }
  T m = reduce_lanes<T>(vmax, neg_inf<T>(), nan_max<T>);
  for (; c < n; ++c) {
    T l = row[c] * row_scale * col_scale[c] + col_add[c];
    if constexpr (kStore) row[c] = l;
    m = nan_max(m, l);
  }
  return m;
}

// The exp pass: row[c] <- p_c = exp(l_c - m), times col_scale[c] with kScaleOut (the fused
// step's column factor of X), or row unchanged with kStore false; returns (sum_c p_c, sum_c
// p_c * l_c), excluded columns (l = -inf, p = 0) adding nothing to either sum. The logit l_c is
// row[c], or with kRaw it is formed from the raw dot product as in logits_and_max (m then a
// bound, or the max of a pass that kept the raw row). m must be finite.
template <bool kRaw, bool kScaleOut, typename T, bool kStore = true>
std::pair<T, T> exp_and_sums(T* row, T m, const T* col_scale, const T* col_add, T row_scale, int64_t n) {
  using V = Vectorized<T>;
  const V vm(m), zero(T(0)), ninf(neg_inf<T>()), rs(row_scale);
  V sum_p(T(0)), sum_pl(T(0));
  int64_t c = 0;
  for (; c + V::size() <= n; c += V::size()) {
    V l = V::loadu(row + c);
    if constexpr (kRaw) l = l * rs * V::loadu(col_scale + c) + V::loadu(col_add + c);
    V p = (l - vm).exp();
    sum_p = sum_p + p;
    sum_pl = sum_pl + V::blendv(p * l, zero, l == ninf);
    if constexpr (kScaleOut) p = p * V::loadu(col_scale + c);
    if constexpr (kStore) p.store(row + c);
  }
  auto add = [](T x, T y) { return x + y; };
  T s = reduce_lanes<T>(sum_p, T(0), add);
  T spl = reduce_lanes<T>(sum_pl, T(0), add);
  for (; c < n; ++c) {
    T l = row[c];
    if constexpr (kRaw) l = l * row_scale * col_scale[c] + col_add[c];
    T p = std::exp(l - m);
    s += p;
    if (l != neg_inf<T>()) spl += p * l;
    if constexpr (kStore) row[c] = kScaleOut ? p * col_scale[c] : p;
  }
  return {s, spl};
}

// row[c] <- row[c] * factor
template <typename T>
void scale(T* row, T factor, int64_t n) {
  using V = Vectorized<T>;
  const V f(factor);
  int64_t c = 0;
  for (; c + V::size() <= n; c += V::size()) (V::loadu(row + c) * f).store(row + c);
  for (; c < n; ++c) row[c] *= factor;
}

// Recompute backward in one pass: row[c] <- w_c = exp(l_c - lse) * row_factor * col_scale[c] with
// l_c formed from the raw dot product s_c as in logits_and_max. lse must not be -inf. With col_rad
// (Matryoshka prefixes: the radial sums of the normalisation backward, docs/csrc.md), also
// col_rad[c] += w_c s_c, and returns sum_c w_c s_c (a zero weight adds nothing: s_c may be -inf).
// kSelect (a filter): w_c = 0 where col_add[c] = -inf (the column left the row) even when lse is NaN.
template <typename T, bool kSelect = false>
T softmax_weights(T* row, const T* col_scale, const T* col_add, T row_scale, T lse, T row_factor, int64_t n,
                  T* col_rad = nullptr) {
  using V = Vectorized<T>;
  const V rs(row_scale), vlse(lse), rf(row_factor), zero(T(0));
  V acc(T(0));
  int64_t c = 0;
  for (; c + V::size() <= n; c += V::size()) {
    V s = V::loadu(row + c), cs = V::loadu(col_scale + c), ad = V::loadu(col_add + c);
    V l = s * rs * cs + ad;
    V w = (l - vlse).exp() * rf * cs;
    if constexpr (kSelect) w = V::blendv(w, zero, ad == V(neg_inf<T>()));
    w.store(row + c);
    if (col_rad) {
      V ws = V::blendv(w * s, zero, w == zero);
      (V::loadu(col_rad + c) + ws).store(col_rad + c);
      acc = acc + ws;
    }
  }
  T rad = reduce_lanes<T>(acc, T(0), [](T a, T b) { return a + b; });
  for (; c < n; ++c) {
    const T s = row[c];
    T l = s * row_scale * col_scale[c] + col_add[c];
    row[c] = kSelect && col_add[c] == neg_inf<T>() ? T(0) : std::exp(l - lse) * row_factor * col_scale[c];
    if (col_rad && row[c] != T(0)) col_rad[c] += row[c] * s, rad += row[c] * s;
  }
  return rad;
}

// row[c] <- row[c] * factor, or 0 where col_add[c] = -inf (the column left the row) whatever the
// product (a filter's non-finite row: X must be 0 there, not 0 * NaN)
template <typename T>
void scale_kept(T* row, const T* col_add, T factor, int64_t n) {
  using V = Vectorized<T>;
  const V f(factor), zero(T(0)), ninf(neg_inf<T>());
  int64_t c = 0;
  for (; c + V::size() <= n; c += V::size()) {
    V::blendv(V::loadu(row + c) * f, zero, V::loadu(col_add + c) == ninf).store(row + c);
  }
  for (; c < n; ++c) row[c] = col_add[c] == neg_inf<T>() ? T(0) : row[c] * factor;
}

// A filter's column adds for one row (contract.Filter): out[c] <- -inf where c leaves the row
// (base[c] = -inf: padding; or sim_c > thr, strictly: ties stay, a NaN drops nothing), else
// base[c] + row_add (base: the columns' 0 or NaN poison, row_add the anchor's). sim_c = x[c] *
// x_scale * x_col[c]: the guide's cosine from its raw dot products, or (kSelf) the model's own
// similarity, which also carries the poison (base[c] + row_add). The caller restores the own
// positives (never dropped) and adds the row's tag exclusions.
template <bool kSelf, typename T>
void filter_adds(T* out, const T* x, T x_scale, const T* x_col, const T* base, T row_add, T thr, int64_t n) {
  using V = Vectorized<T>;
  const V xs(x_scale), ra(row_add), th(thr), ninf(neg_inf<T>());
  int64_t c = 0;
  for (; c + V::size() <= n; c += V::size()) {
    const V b = V::loadu(base + c);
    V sim = V::loadu(x + c) * xs * V::loadu(x_col + c);
    if constexpr (kSelf) sim = sim + b + ra;
    V::blendv(b + ra, ninf, (sim > th) | (b == ninf)).store(out + c);
  }
  for (; c < n; ++c) {
    T sim = x[c] * x_scale * x_col[c];
    if constexpr (kSelf) sim = sim + base[c] + row_add;
    out[c] = (sim > thr || base[c] == neg_inf<T>()) ? neg_inf<T>() : base[c] + row_add;
  }
}

// The sigmoid reduction's sums over one row segment (contract.Sigmoid).
template <typename T>
struct SigmoidSums {
  T value = 0, sigma_l = 0, sigma = 0, rad = 0;  // sum softplus(u), sum sigma l, sum sigma, sum w s
  void operator+=(const SigmoidSums& o) { value += o.value, sigma_l += o.sigma_l, sigma += o.sigma, rad += o.rad; }
};

// The sigmoid pass over n columns of one sign z (+1: own positives, -1: the rest): with the logit
// l_c formed from the raw dot product as in logits_and_max, u = -z (l_c + bias), the term
// softplus(u) = max(u, 0) + log1p(exp(-|u|)) (exact for every u) and sigma = -z sigmoid(u) =
// dterm/dl; a column with col_add[c] = -inf (left out of the row) gives 0 to every sum whatever l
// holds. kStore: row[c] <- w_c = sigma * factor * col_scale[c] (0 where left out), and with
// col_rad (Matryoshka cosine) col_rad[c] += w_c s_c and the sums' rad.
template <bool kStore, typename T>
SigmoidSums<T> sigmoid_pass(T* row, const T* col_scale, const T* col_add, T row_scale, T bias, T z, T factor, int64_t n,
                            T* col_rad) {
  using V = Vectorized<T>;
  const V rs(row_scale), vb(bias), mz(-z), vf(factor), zero(T(0)), one(T(1)), ninf(neg_inf<T>());
  V sum_t(T(0)), sum_sl(T(0)), sum_s(T(0)), sum_r(T(0));
  int64_t c = 0;
  for (; c + V::size() <= n; c += V::size()) {
    const V s = V::loadu(row + c), cs = V::loadu(col_scale + c), ad = V::loadu(col_add + c);
    const V l = s * rs * cs + ad, keep = ad != ninf;
    const V u = (l + vb) * mz;
    const V e = (zero - u.abs()).exp();  // exp(-|u|)
    const V term = at::vec::maximum(u, zero) + e.log1p();
    const V sigma = V::blendv(zero, V::blendv(e, one, u >= zero) / (one + e) * mz, keep);
    sum_t = sum_t + V::blendv(zero, term, keep);
    sum_s = sum_s + sigma;
    sum_sl = sum_sl + V::blendv(zero, sigma * l, keep);
    if constexpr (kStore) {
      const V w = V::blendv(zero, sigma * vf * cs, keep);  // 0 where left out, even for a NaN factor
      w.store(row + c);
      if (col_rad) {
        const V ws = V::blendv(w * s, zero, w == zero);
        (V::loadu(col_rad + c) + ws).store(col_rad + c);
        sum_r = sum_r + ws;
      }
    }
  }
  auto add = [](T x, T y) { return x + y; };
  SigmoidSums<T> out{reduce_lanes<T>(sum_t, T(0), add), reduce_lanes<T>(sum_sl, T(0), add),
                     reduce_lanes<T>(sum_s, T(0), add), reduce_lanes<T>(sum_r, T(0), add)};
  for (; c < n; ++c) {
    const T s = row[c];
    if (col_add[c] == neg_inf<T>()) {
      if constexpr (kStore) row[c] = T(0);
      continue;
    }
    const T l = s * row_scale * col_scale[c] + col_add[c];
    const T u = -z * (l + bias);
    const T e = std::exp(-std::abs(u));
    const T sigma = (u >= T(0) ? T(1) : e) / (T(1) + e) * -z;
    out.value += (u > T(0) ? u : T(0)) + std::log1p(e);
    out.sigma += sigma;
    out.sigma_l += sigma * l;
    if constexpr (kStore) {
      row[c] = sigma * factor * col_scale[c];
      if (col_rad && row[c] != T(0)) col_rad[c] += row[c] * s, out.rad += row[c] * s;
    }
  }
  return out;
}

// Normalisation backward of one row x (|x| > eps) from e = dL/dx_hat / |x|, written exactly
// as normalize_backward() in fastcl/ops/normalize.py (x_hat = x / |x| by division, so that
// d = 1 cancels to exactly 0): d_hat = e |x|, e <- (d_hat - x_hat <x_hat, d_hat>) / |x|
template <typename T>
void normalize_backward(T* e, const T* x, T norm, int64_t n) {
  using V = Vectorized<T>;
  const V vn(norm);
  V acc(T(0));
  int64_t c = 0;
  for (; c + V::size() <= n; c += V::size()) {
    acc = at::vec::fmadd(V::loadu(x + c) / vn, V::loadu(e + c) * vn, acc);
  }
  T radial = reduce_lanes<T>(acc, T(0), [](T a, T b) { return a + b; });
  for (; c < n; ++c) radial += (x[c] / norm) * (e[c] * norm);
  const V vr(radial);
  c = 0;
  for (; c + V::size() <= n; c += V::size()) {
    ((V::loadu(e + c) * vn - (V::loadu(x + c) / vn) * vr) / vn).store(e + c);
  }
  for (; c < n; ++c) e[c] = (e[c] * norm - (x[c] / norm) * radial) / norm;
}

}  // namespace fastcl::cpu::rows

// The inputs of a sweep (lse_cpu.cpp) in the compute dtype, with what every block needs:
// per-row norms and factors (the robustness rules of fastcl/ops/normalize.py, docs/csrc.md,
// "Non-finite and extreme rows"), the tags as column offsets and own-column lists.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "rows.h"

namespace fastcl::cpu {

// at::parallel_for whose workers, like the calling thread, dispatch the kernel's own ATen
// calls (GEMMs on views of the inputs) below autograd: thread-local dispatch state is
// not inherited by OpenMP workers.
template <typename F>
void parallel(int64_t begin, int64_t end, int64_t grain, const F& f) {
  at::parallel_for(begin, end, grain, [&](int64_t b0, int64_t b1) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    f(b0, b1);
  });
}

// What prepare() learned about each row of one input matrix (see scan_rows), per prefix k of
// the row (Matryoshka; a plain problem has one prefix, the whole row): entry [k, row].
template <typename T>
struct RowInfo {
  at::Tensor norm;                 // [K, rows] norm of the prefix as stored (cosine only)
  at::Tensor inv;                  // [K, rows] the factor its raw dot products take: 1/max(|x|, eps)
                                   // (times 2^e for a rescaled row); 1 for dot; NaN if non-finite
  std::vector<T> unscale;          // [rows] 2^-e for a row stored as x * 2^-e, else 1
  std::vector<uint8_t> unclamped;  // [K * rows] |x| > eps (the normalisation backward applies)
  bool nonfinite = false;          // some (unpadded) row has a prefix holding NaN/Inf
};

// The robustness rules of fastcl/ops/normalize.py (docs/csrc.md, "Non-finite and extreme
// rows"), per prefix [0, ends[k]) of each row: a padded row (tag -2) is zeroed; a prefix holding
// NaN/Inf gets inv = NaN; with cosine, a row whose largest entry in its finite prefixes exceeds
// 2^40 is stored as x * 2^-e (exact) so that the GEMMs' raw dot products cannot overflow. `x`
// is the compute-dtype copy (it may alias `input`; it is cloned before any change).
constexpr int kScaleExponent = 40;
// A prefix of a rescaled row stored below this norm (2^60 below the row's largest entry) would
// lose bits to underflow in the GEMMs: refused (Matryoshka only; a whole row is never so small).
constexpr int kTinyPrefixExponent = -60;

template <typename T>
RowInfo<T> scan_rows(at::Tensor& x, const at::Tensor& input, const int32_t* tags, bool cosine, double eps,
                     const std::vector<int64_t>& ends) {
  enum Action : int8_t { kKeep, kZero, kNonFinite, kScale };
  const int64_t rows = x.size(0), d = x.size(1), K = int64_t(ends.size());
  std::vector<int8_t> action(rows, kKeep);
  std::vector<int> expo(rows, 0);
  std::vector<int64_t> finite(rows, K);  // prefixes [0, finite) hold no NaN/Inf
  const T* xr = x.template data_ptr<T>();
  parallel(0, rows, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t i = r0; i < r1; ++i) {
      if (tags && tags[i] == -2) {
        action[i] = kZero;
        continue;
      }
      T m = 0;  // largest |entry| of the finite prefixes
      int64_t k = 0;
      for (; k < K; ++k) {
        const int64_t lo = k ? ends[k - 1] : 0;
        const T mk = rows::max_abs(xr + i * d + lo, ends[k] - lo);  // NaN or inf when not finite
        if (!std::isfinite(mk)) break;
        m = std::max(m, mk);
      }
      finite[i] = k;
      if (k == 0) {
        action[i] = kNonFinite;
      } else if (cosine && m > std::ldexp(T(1), kScaleExponent)) {
        std::frexp(m, &expo[i]);
        action[i] = kScale;
      }
    }
  });
  const bool modify = std::any_of(action.begin(), action.end(), [](int8_t a) { return a == kZero || a == kScale; });
  if (modify && x.data_ptr() == input.data_ptr()) x = x.clone();
  T* xw = x.template data_ptr<T>();

  RowInfo<T> info{at::zeros({K, rows}, x.options()), at::ones({K, rows}, x.options()), std::vector<T>(rows, T(1)),
                  std::vector<uint8_t>(K * rows, 0)};
  info.nonfinite = std::any_of(finite.begin(), finite.end(), [K](int64_t k) { return k < K; });
  T* norm = info.norm.template data_ptr<T>();
  T* inv = info.inv.template data_ptr<T>();
  std::atomic<bool> tiny{false};
  parallel(0, rows, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t i = r0; i < r1; ++i) {
      T* row = xw + i * d;
      if (action[i] == kZero) {
        std::fill(row, row + d, T(0));
        for (int64_t k = 0; k < K; ++k) inv[k * rows + i] = cosine ? T(1 / eps) : T(1);
        continue;
      }
      if (cosine && action[i] == kScale) {
        for (int64_t k = 0; k < d; ++k) row[k] = std::ldexp(row[k], -expo[i]);
        info.unscale[i] = std::ldexp(T(1), -expo[i]);
      }
      double ss = 0;  // sum of squares of the prefix so far
      for (int64_t k = 0; k < K; ++k) {
        const int64_t j = k * rows + i, lo = k ? ends[k - 1] : 0;
        if (k >= finite[i]) {
          norm[j] = inv[j] = std::numeric_limits<T>::quiet_NaN();
          info.unclamped[j] = 1;
          continue;
        }
        if (!cosine) continue;
        ss += rows::sum_squares(row + lo, ends[k] - lo);
        const T n = T(std::sqrt(ss));
        norm[j] = n;
        // the clamp compares the true norm n * 2^e with eps: a rescaled prefix (refused below
        // 2^-60) never is
        info.unclamped[j] = action[i] == kScale || n > eps;
        inv[j] = T(1) / (info.unclamped[j] ? n : T(eps));
        const bool kept = n >= std::ldexp(T(1), kTinyPrefixExponent) && std::ldexp(double(n), expo[i]) > eps;
        if (action[i] == kScale && !kept) tiny = true;
      }
    }
  });
  TORCH_CHECK(!tiny,
              "fastcl: a matryoshka prefix more than 2^60 below its row's largest entry (> 2^40), or "
              "within eps of zero, is not supported by the cpp backend (backend=\"reference\" computes it)");
  return info;
}

// The problem in the compute dtype T (float or double), with everything a block needs.
template <typename T>
struct Prepared {
  int64_t B = 0, N0 = 0, N1 = 0, N = 0, d = 0;
  bool cosine = true;
  double eps = 0;
  T inv_tau = 1;
  std::vector<int64_t> ends;                   // prefix lengths, increasing: {d} for a plain problem
  at::Tensor a, c0, c1;                        // [B, d], [N0, d], [N1, d] in T, contiguous (see scan_rows)
  RowInfo<T> ra, rc0, rc1;                     // per-row norms and factors of a, c0, c1
  at::Tensor inv_a, inv_c;                     // [K, B], [K, N] the rows' factors (RowInfo::inv), c0 then c1
  at::Tensor col_add;                          // [N] 0, or -inf for a padded candidate
  std::vector<std::vector<int64_t>> own_cols;  // [B] the columns row i leaves out by tag
};

template <typename T>
Prepared<T> prepare(const at::Tensor& anchor, const at::Tensor& block0, const at::Tensor& block1,
                    const at::Tensor& tags0, const at::Tensor& tags1, const at::Tensor& tau, bool cosine, double eps,
                    std::vector<int64_t> ends) {
  const auto st = c10::CppTypeToScalarType<T>::value;
  const int64_t N0 = block0.size(0), N1 = block1.size(0);
  Prepared<T> p{anchor.size(0), N0, N1, N0 + N1, anchor.size(1), cosine, eps};
  const double t = tau.item<double>();
  TORCH_CHECK(t > 0 && std::isfinite(t), "fastcl: tau must be finite and > 0, got ", t);
  p.inv_tau = T(1) / T(t);
  p.ends = std::move(ends);
  // tags0 then tags1 (at::cat took ~50 us at N = 1024: 1 % of a small step)
  std::vector<int32_t> tags(N0 + N1);
  std::copy_n(tags0.contiguous().data_ptr<int32_t>(), N0, tags.begin());
  std::copy_n(tags1.contiguous().data_ptr<int32_t>(), N1, tags.begin() + N0);
  const int32_t* tg = tags.data();
  p.a = anchor.to(st).contiguous();
  p.c0 = block0.to(st).contiguous();
  p.c1 = block1.to(st).contiguous();
  p.ra = scan_rows<T>(p.a, anchor, nullptr, cosine, eps, p.ends);
  p.rc0 = scan_rows<T>(p.c0, block0, tg, cosine, eps, p.ends);
  p.rc1 = scan_rows<T>(p.c1, block1, tg + p.N0, cosine, eps, p.ends);
  p.inv_a = p.ra.inv;
  p.inv_c = at::cat({p.rc0.inv, p.rc1.inv}, 1);
  p.col_add = at::zeros({p.N}, p.a.options());
  T* add = p.col_add.template data_ptr<T>();
  p.own_cols.resize(p.B);
  for (int64_t c = 0; c < p.N; ++c) {
    TORCH_CHECK(tg[c] >= -2, "fastcl: tags must be -2 (padding), -1 (all rows) or a row index >= 0; got ", tg[c]);
    if (tg[c] == -2) add[c] = rows::neg_inf<T>();
    if (tg[c] >= 0 && tg[c] < p.B) p.own_cols[tg[c]].push_back(c);
  }
  return p;
}

}  // namespace fastcl::cpu

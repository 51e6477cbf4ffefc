// The one record a sweep (lse_cpu.cpp) takes, Params: the problem in the compute dtype with what
// every block needs (per-row norms and factors: the robustness rules of fastcl/ops/normalize.py,
// docs/csrc.md, "Non-finite and extreme rows"; the tags as column offsets and own-column lists;
// the extensions' inputs) and where the mode reads its row gradients from and writes its results to.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "../checks.h"
#include "head.h"
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
  at::Tensor poison;               // [K, rows] (clean only) NaN for a prefix that held NaN/Inf, else 0
};

// The robustness rules of fastcl/ops/normalize.py (docs/csrc.md, "Non-finite and extreme
// rows"), per prefix [0, ends[k]) of each row: a padded row (tag -2) is zeroed; a prefix holding
// NaN/Inf gets inv = NaN; with cosine, a row whose largest entry in its finite prefixes exceeds
// 2^40 is stored as x * 2^-e (exact) so that the GEMMs' raw dot products cannot overflow. `x`
// is the compute-dtype copy (it may alias `input`; it is cloned before any change). With clean
// (a filter, contract.Filter) a non-finite entry is stored as 0 instead and the prefixes holding
// one get poison = NaN (added to their logits) with the factors of the cleaned row: no NaN reaches
// a product, so a dropped logit, masked by selection, carries none into the gradients.
constexpr int kScaleExponent = 40;
// A prefix of a rescaled row stored below this norm (2^60 below the row's largest entry) would
// lose bits to underflow in the GEMMs: refused (Matryoshka only; a whole row is never so small).
constexpr int kTinyPrefixExponent = -60;

template <typename T>
RowInfo<T> scan_rows(at::Tensor& x, const at::Tensor& input, const int32_t* tags, bool cosine, double eps,
                     const std::vector<int64_t>& ends, bool clean = false) {
  enum Action : int8_t { kKeep, kZero, kNonFinite, kScale, kClean };
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
      if (clean && k < K) {
        action[i] = kClean;  // then scaled too if its finite prefixes are huge (below)
        if (cosine && m > std::ldexp(T(1), kScaleExponent)) std::frexp(m, &expo[i]);
      } else if (k == 0) {
        action[i] = kNonFinite;
      } else if (cosine && m > std::ldexp(T(1), kScaleExponent)) {
        std::frexp(m, &expo[i]);
        action[i] = kScale;
      }
    }
  });
  const bool modify =
      std::any_of(action.begin(), action.end(), [](int8_t a) { return a == kZero || a == kScale || a == kClean; });
  if (modify && x.data_ptr() == input.data_ptr()) x = x.clone();
  T* xw = x.template data_ptr<T>();

  RowInfo<T> info{at::zeros({K, rows}, x.options()), at::ones({K, rows}, x.options()), std::vector<T>(rows, T(1)),
                  std::vector<uint8_t>(K * rows, 0)};
  info.nonfinite = std::any_of(finite.begin(), finite.end(), [K](int64_t k) { return k < K; });
  if (clean) info.poison = at::zeros({K, rows}, x.options());
  T* poison = clean ? info.poison.template data_ptr<T>() : nullptr;
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
      if (action[i] == kClean) {
        for (int64_t k = 0; k < d; ++k) row[k] = std::isfinite(row[k]) ? row[k] : T(0);
        for (int64_t k = finite[i]; k < K; ++k) poison[k * rows + i] = std::numeric_limits<T>::quiet_NaN();
      }
      const bool scaled = action[i] == kScale || (action[i] == kClean && expo[i] != 0);
      if (cosine && scaled) {
        for (int64_t k = 0; k < d; ++k) row[k] = std::ldexp(row[k], -expo[i]);
        info.unscale[i] = std::ldexp(T(1), -expo[i]);
      }
      double ss = 0;  // sum of squares of the prefix so far
      for (int64_t k = 0; k < K; ++k) {
        const int64_t j = k * rows + i, lo = k ? ends[k - 1] : 0;
        if (k >= finite[i] && !clean) {
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
        info.unclamped[j] = scaled || n > eps;
        inv[j] = T(1) / (info.unclamped[j] ? n : T(eps));
        const bool kept = n >= std::ldexp(T(1), kTinyPrefixExponent) && std::ldexp(double(n), expo[i]) > eps;
        if (scaled && !kept && k < finite[i]) tiny = true;
      }
    }
  });
  TORCH_CHECK(!tiny,
              "fastcl: a matryoshka prefix more than 2^60 below its row's largest entry (> 2^40), or "
              "within eps of zero, is not supported by the cpp backend (backend=\"reference\" computes it)");
  return info;
}

// Everything a sweep reads and writes, in the compute dtype T (float or double): the problem with
// what every block needs (filled by prepare()), then where the mode reads its row gradients from
// and writes its results to (filled by run() in lse_cpu.cpp; unused: null). Per-row arrays of
// prefix k (Matryoshka; a plain problem has K = 1) hold entry k * B + i.
template <typename T>
struct Params {
  Mode mode = Mode::kForward;
  int64_t B = 0, N0 = 0, N1 = 0, N = 0, d = 0;
  bool cosine = true;
  double eps = 0;
  T inv_tau = 1;
  std::vector<int64_t> ends;                   // prefix lengths, increasing: {d} for a plain problem
  at::Tensor a, c0, c1;                        // [B, d], [N0, d], [N1, d] in T, contiguous (see scan_rows)
  RowInfo<T> ra, rc0, rc1;                     // per-row norms and factors of a, c0, c1
  at::Tensor inv_a, inv_c;                     // [K, B], [K, N] the rows' factors (RowInfo::inv), c0 then c1
  at::Tensor col_add;                          // [K or 1, N] 0, -inf for a padded candidate, NaN: poison (filter)
  std::vector<std::vector<int64_t>> own_cols;  // [B] the columns row i leaves out by tag
  int64_t pos_offset = 0, pos_count = 0;       // own positives: columns pos_offset + i * pos_count + k (0: none)

  // the sigmoid reduction (contract.Sigmoid): v_i = sum_c softplus(-z (l + bias)) instead of the LSE
  bool sigmoid = false;
  T bias = 0;
  // the filter (contract.Filter): c leaves row i where sim(i, c) > threshold (not an own positive)
  bool filter = false;
  at::Tensor threshold;        // [1 or K, B]
  at::Tensor row_poison;       // [K, B] NaN for an anchor prefix that held NaN/Inf, else 0
  at::Tensor ga, gc0, gc1;     // the guide's rows in T ([B, g], [N0, g], [N1, g]; guide filter only)
  RowInfo<T> rga, rgc0, rgc1;  // their norms: sim = cosine (a non-finite guide row: NaN, drops nothing)
  at::Tensor inv_gc;           // [N] guide candidates' factors, c0 then c1
  bool guided() const { return ga.defined(); }
  // Joint rows (OpArgs::anchor1): block 1's anchors a1 as stored (scan_rows) and a1s = a1 * ratio
  // with ratio = inv_a1 / inv_a, so that block 1's raw dots a1s . c take the row factor inv_a like
  // block 0's: the row passes stay those of one anchor. Without joint rows, a1s is a and ratio 1.
  at::Tensor a1, a1s;      // [B, d]
  RowInfo<T> ra1;          // a1's norms and factors (the normalisation backward of d_a1)
  std::vector<T> ratio;    // [B] inv_a1 / inv_a (joint rows only)
  at::Tensor row_poison1;  // [1, B] (filter) the poison of block 1's columns: a1's, else a's
  at::Tensor inv_ga1;      // [B] (guide) block 1's guide anchor factors: ga1's, else ga's
  at::Tensor ga1;          // [B, g] (guide) block 1's guide anchors (ga without joint rows)
  bool joint() const { return a1.defined(); }
  // column statistics (LSEProblem.columns; plain LSE only): forward writes the columns' lse and mean
  // logit after the rows' (lse, mean_logit [B + N]); backward reads the columns' lse and gradient
  bool columns = false;
  const T* col_lse = nullptr;  // [N] (backward) the column's lse; 0 for an empty column (-inf)
  const T* col_g = nullptr;    // [N] (backward) its gradient; 0 for an empty column
  // the column adds of prefix k: col_add's row k with a filter (per-prefix poison), else row 0
  const T* add(int64_t k) const { return col_add.template data_ptr<T>() + (filter ? k : 0) * N; }

  // the mode's inputs and outputs
  at::Tensor d_a, d_c0, d_c1;      // [B, d], [N0, d], [N1, d] out (backward, fused)
  at::Tensor d_a1;                 // [B, d] out (fused, joint rows)
  Fold<T> fold;                    // own positives to fold (backward with d_pos, fused)
  T* lse = nullptr;                // [K, B] out (forward, fused): the LSE, or the sigmoid's value
  T* mean_logit = nullptr;         // [K, B] out (forward, fused): the mean logit, or the sigmoid's stats[0]
  T* stats1 = nullptr;             // [K, B] out (forward, fused; sigmoid): stats[1] = sum_c sigma
  const T* lse_in = nullptr;       // [K, B] (backward)
  const T* grad_lse = nullptr;     // [K, B] (backward): dLoss/dlse, or dLoss/dvalue (sigmoid)
  const Head<T>* heads = nullptr;  // [K] (fused, LSE): prefix k's head
  const T* weights = nullptr;      // [K, B] (fused, sigmoid): the rows' weights (dLoss/dvalue)
  T* loss_rows = nullptr;          // [K, B] out (fused, sigmoid): the value again
  T* g_rows = nullptr;             // [K, B] out (fused): w_i dloss_i/dlse_i (sigmoid: the weights)
  T* own_logits = nullptr;         // [K, B, P] out (fused, own_logits): the heads' pos, per row
  T* row_rad = nullptr;            // [K, B] (Matryoshka cosine): the rows' radial sums
  T* row_factor = nullptr;         // [B] (fused, K = 1): X = diag(r) Q with Q in the block buffer
};

// The problem of op arguments `o` (checked) in T: copies, row scans, tags and the extensions' inputs.
template <typename T>
Params<T> prepare(const OpArgs& o) {
  const auto st = c10::CppTypeToScalarType<T>::value;
  const int64_t N0 = o.block0.size(0), N1 = o.block1.size(0), B = o.anchor.size(0);
  Params<T> p;
  p.mode = o.mode;
  p.B = B, p.N0 = N0, p.N1 = N1, p.N = N0 + N1, p.d = o.anchor.size(1), p.cosine = o.cosine, p.eps = o.eps;
  const double t = o.tau.item<double>();
  TORCH_CHECK(t > 0 && std::isfinite(t), "fastcl: tau must be finite and > 0, got ", t);
  p.inv_tau = T(1) / T(t);
  p.ends = o.ends;
  p.pos_offset = o.pos_count ? o.pos_offset : 0, p.pos_count = o.pos_count;
  p.sigmoid = o.sigmoid(), p.filter = o.filter(), p.columns = o.columns;
  if (p.sigmoid) p.bias = T(o.bias->item<double>());
  // tags0 then tags1 (at::cat took ~50 us at N = 1024: 1 % of a small step)
  std::vector<int32_t> tags(N0 + N1);
  std::copy_n(o.tags0.contiguous().data_ptr<int32_t>(), N0, tags.begin());
  std::copy_n(o.tags1.contiguous().data_ptr<int32_t>(), N1, tags.begin() + N0);
  const int32_t* tg = tags.data();
  const bool clean = p.filter;  // the filter's non-finite rule (contract.Filter): zeros and an additive NaN
  p.a = o.anchor.to(st).contiguous();
  p.c0 = o.block0.to(st).contiguous();
  p.c1 = o.block1.to(st).contiguous();
  p.ra = scan_rows<T>(p.a, o.anchor, nullptr, p.cosine, p.eps, p.ends, clean);
  p.rc0 = scan_rows<T>(p.c0, o.block0, tg, p.cosine, p.eps, p.ends, clean);
  p.rc1 = scan_rows<T>(p.c1, o.block1, tg + N0, p.cosine, p.eps, p.ends, clean);
  p.inv_a = p.ra.inv;
  p.inv_c = at::cat({p.rc0.inv, p.rc1.inv}, 1);
  p.col_add = clean ? at::cat({p.rc0.poison, p.rc1.poison}, 1) : at::zeros({1, p.N}, p.a.options());
  T* add = p.col_add.template data_ptr<T>();
  const int64_t Kc = p.col_add.size(0);
  p.own_cols.resize(B);
  for (int64_t c = 0; c < p.N; ++c) {
    TORCH_CHECK(tg[c] >= -2, "fastcl: tags must be -2 (padding), -1 (all rows) or a row index >= 0; got ", tg[c]);
    if (tg[c] == -2) {
      for (int64_t k = 0; k < Kc; ++k) add[k * p.N + c] = rows::neg_inf<T>();
    }
    if (tg[c] >= 0 && tg[c] < B) p.own_cols[tg[c]].push_back(c);
  }
  if (p.filter) {
    p.row_poison = p.ra.poison;
    p.threshold = o.threshold->to(st).contiguous().view({o.threshold->dim() == 2 ? o.threshold->size(0) : 1, B});
    if (o.guided()) {  // cosine of the guide's rows, clamped at eps; any float dtype in, T here
      p.ga = o.guide_anchor->to(st).contiguous();
      p.gc0 = o.guide_block0->to(st).contiguous();
      p.gc1 = o.guide_block1->to(st).contiguous();
      const std::vector<int64_t> whole{p.ga.size(1)};
      p.rga = scan_rows<T>(p.ga, *o.guide_anchor, nullptr, true, p.eps, whole);
      p.rgc0 = scan_rows<T>(p.gc0, *o.guide_block0, tg, true, p.eps, whole);
      p.rgc1 = scan_rows<T>(p.gc1, *o.guide_block1, tg + N0, true, p.eps, whole);
      p.inv_gc = at::cat({p.rgc0.inv, p.rgc1.inv}, 1).view({p.N});
    }
  }
  p.a1s = p.a;
  if (o.joint()) {
    p.a1 = o.anchor1->to(st).contiguous();
    p.ra1 = scan_rows<T>(p.a1, *o.anchor1, nullptr, p.cosine, p.eps, p.ends, clean);
    // the ratio in double, rounded once; a factor is finite and > 0 unless its row is non-finite
    // without a filter, and then the row is NaN whatever the ratio. One [B, d] copy in T.
    const at::Tensor ratio = p.ra1.inv.to(at::kDouble).div(p.ra.inv.to(at::kDouble)).view({B}).to(st).contiguous();
    p.a1s = p.a1.mul(ratio.unsqueeze(1));
    p.ratio.assign(ratio.template data_ptr<T>(), ratio.template data_ptr<T>() + B);
  }
  if (p.filter) p.row_poison1 = o.joint() ? p.ra1.poison : p.row_poison;
  if (p.guided()) {
    p.ga1 = p.ga, p.inv_ga1 = p.rga.inv.view({B});
    if (o.joint()) {
      p.ga1 = o.guide_anchor1->to(st).contiguous();
      const RowInfo<T> rga1 = scan_rows<T>(p.ga1, *o.guide_anchor1, nullptr, true, p.eps, {p.ga1.size(1)});
      p.inv_ga1 = rga1.inv.view({B});
    }
  }
  return p;
}

}  // namespace fastcl::cpu

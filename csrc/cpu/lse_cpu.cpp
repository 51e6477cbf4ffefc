// CPU kernels of the masked-LSE primitive (schemas: ../registration.cpp). The design (row
// blocks, the three GEMMs, the parallel split and why results are bitwise reproducible for a
// thread count) and the measurements behind its constants: docs/csrc.md, "CPU kernel".
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <limits>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <vector>

#include "../checks.h"
#include "gemm_tile.h"
#include "head.h"
#include "options.h"
#include "prepare.h"
#include "rows.h"

namespace fastcl::cpu {
namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The sweep's [tiles, H, N] block buffer. One of at most kKeepBytes (test hook
// cpp.test_keep_bytes; 0: never) is kept for the calling thread's next call: a fresh one costs ~1 page fault
// per 4 KiB page on first touch (up to ~600 per small step, 13 % of the median InfoNCE step at B = 1024, d = 128;
// benchmarks/results/cpu-2026-11-27-amd/notes.md). Larger buffers are allocated per call, as nothing may hold O(B N).
constexpr int64_t kKeepBytes = int64_t(16) << 20;
at::Tensor block_buffer(at::IntArrayRef shape, const at::TensorOptions& options) {
  thread_local at::Tensor kept;
  const int64_t n = c10::multiply_integers(shape);
  const int64_t set = cpu::options().test_keep_bytes.load(std::memory_order_relaxed);  // (options: the argument)
  if (n * int64_t(options.dtype().itemsize()) > (set < 0 ? kKeepBytes : set)) {
    return at::empty(shape, options);
  }
  if (!kept.defined() || kept.numel() < n || kept.dtype() != options.dtype()) {
    kept = at::Tensor();  // the old one goes first: never two at once
    kept = at::empty({n}, options);
  }
  return kept.narrow(0, 0, n).view(shape);
}

// Anchor rows H per block (all threads share a block): a [H, N] buffer of about (B + N) d
// elements, at least 2^21 per thread, H in [8, 1024], evened out over the blocks. Each
// block streams all of C, so short blocks lose (docs/csrc.md). fastcl.config's cpp.tile
// (options().tile) sets the element budget; the test hook cpp.test_rows forces H (to
// cross block edges). A sweep that keeps several [H, N] tiles (Matryoshka prefixes) shares the
// budget among them.
int64_t block_height(int64_t B, int64_t N, int64_t d, int64_t threads, int64_t tiles) {
  int64_t rows = options().test_rows.load(std::memory_order_relaxed);
  if (rows == 0) {
    const int64_t set = options().tile.load(std::memory_order_relaxed);
    const int64_t budget = set > 0 ? set : std::max<int64_t>(threads << 21, (B + N) * d);
    rows = std::clamp<int64_t>(budget / (std::max<int64_t>(N, 1) * tiles), 8, 1024);
    rows = ceil_div(B, ceil_div(B, rows));  // even blocks: no short last one
  }
  return std::clamp<int64_t>(rows, 1, std::max<int64_t>(B, 1));
}

// out = x @ m, zero when x has no column
void mm_cols(at::Tensor out, const at::Tensor& x, const at::Tensor& m) {
  if (x.size(1)) at::mm_out(out, x, m);
  else out.zero_();
}

// out = x[:, 0:N0] @ m0 (+ x[:, N0:N] @ m1), the two candidate blocks side by side.
template <typename T>
void mm_blocks(at::Tensor out, const at::Tensor& x, const Params<T>& p, const at::Tensor& m0, const at::Tensor& m1) {
  if (p.N0) at::mm_out(out, x.narrow(1, 0, p.N0), m0);
  if (p.N1) {
    if (p.N0) out.addmm_(x.narrow(1, p.N0, p.N1), m1);
    else at::mm_out(out, x.narrow(1, p.N0, p.N1), m1);
  }
  if (p.N == 0) out.zero_();
}

// The per-prefix normalisation backward of Matryoshka gradient rows [r0, r1) of e, the sum over
// prefixes k of E_k (zero beyond ends[k]): prefix k's backward is E_k - x <x, E_k> / |x|^2 on
// [0, ends[k]), and <x, E_k> is the radial sum rad[k * rad_stride + i] = sum_c X_k s_k (formed
// with the weights, block_rows), so coordinate j of slice s gets x_j times the sum over k >= s.
template <typename T>
void unnormalize_prefix_rows(const at::Tensor& e_rows, const at::Tensor& x_rows, const RowInfo<T>& info, const T* rad,
                             int64_t rad_stride, const std::vector<int64_t>& ends, int64_t r0, int64_t r1,
                             int64_t grain) {
  T* e = e_rows.data_ptr<T>();
  const T* x = x_rows.data_ptr<T>();
  const T* norm = info.norm.template data_ptr<T>();
  const int64_t rows = x_rows.size(0), d = x_rows.size(1);
  parallel(r0, r1, grain, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      T coef = 0;
      T* ei = e + i * d;
      const T* xi = x + i * d;
      for (int64_t k = int64_t(ends.size()) - 1; k >= 0; --k) {
        const int64_t j = k * rows + i;
        if (info.unclamped[j]) coef += rad[k * rad_stride + i] / (norm[j] * norm[j]);
        for (int64_t c = k ? ends[k - 1] : 0; c < ends[k]; ++c) ei[c] = (ei[c] - xi[c] * coef) * info.unscale[i];
      }
    }
  });
}

// Normalisation backward (in parallel) of gradient rows [r0, r1) of e against the rows of
// x as stored (RowInfo); a rescaled row's gradient is then scaled back by 2^-e (scan_rows).
// (A clamped norm's gradient is e itself: d_hat / eps with d_hat = e * eps.) With factor, row i
// of e is first multiplied by factor[i] (the fused step's row factor of X C: one pass, not two).
template <typename T>
void unnormalize_rows(const at::Tensor& e_rows, const at::Tensor& x_rows, const RowInfo<T>& info, int64_t r0,
                      int64_t r1, int64_t grain, const T* factor = nullptr) {
  T* e = e_rows.data_ptr<T>();
  const T* x = x_rows.data_ptr<T>();
  const T* norm = info.norm.template data_ptr<T>();
  const int64_t d = x_rows.size(1);
  parallel(r0, r1, grain, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      if (factor) rows::scale(e + i * d, factor[i], d);
      if (info.unclamped[i]) rows::normalize_backward(e + i * d, x + i * d, norm[i], d);
      if (info.unscale[i] != T(1)) {
        for (int64_t k = 0; k < d; ++k) e[i * d + k] *= info.unscale[i];
      }
    }
  });
}

// out rows [i0, i1) <- factor[i] * x row i, rows of [h, d] (out may be x itself)
template <typename T>
void scale_rows(const at::Tensor& out, const at::Tensor& x, const T* factor, int64_t i0, int64_t i1) {
  const int64_t d = x.size(1);
  for (int64_t i = i0; i < i1; ++i) {
    T* o = out.data_ptr<T>() + i * d;
    if (o != x.data_ptr<T>() + i * d) std::copy_n(x.data_ptr<T>() + i * d, d, o);
    rows::scale(o, factor[i], d);
  }
}

// A slice [c, c + n) of candidate block `blk` (0 or 1): what steps 1 and 4 of sweep() split.
struct Chunk {
  int blk;
  int64_t c, n;
};

// The candidates each thread takes in steps 1 and 4 of sweep(): an equal share
// [t N / T, (t + 1) N / T) of the N columns, cut at the edge between the two blocks (one or
// two GEMM calls; smaller chunks lose, docs/csrc.md). The test hook cpp.test_chunk caps every
// call.
template <typename T>
std::vector<std::vector<Chunk>> candidate_shares(const Params<T>& p, int64_t threads) {
  const int64_t chunk = options().test_chunk.load(std::memory_order_relaxed);
  const int64_t most = chunk > 0 ? chunk : std::numeric_limits<int64_t>::max();
  std::vector<std::vector<Chunk>> shares(threads);
  auto add = [&](int64_t t, int blk, int64_t c, int64_t n) {
    for (int64_t k = 0; k < n; k += most) shares[t].push_back({blk, c + k, std::min(most, n - k)});
  };
  for (int64_t t = 0; t < threads; ++t) {
    const int64_t lo = p.N * t / threads, hi = p.N * (t + 1) / threads;
    if (lo < std::min(hi, p.N0)) add(t, 0, lo, std::min(hi, p.N0) - lo);
    if (std::max(lo, p.N0) < hi) add(t, 1, std::max(lo, p.N0) - p.N0, hi - std::max(lo, p.N0));
  }
  return shares;
}

// One row task's running partials of the column statistics (forward, LSEProblem.columns), [N]
// each: the columns' max so far (or the bound), and sum exp(l - max), sum exp(l - max) l over the
// task's rows. The sweep merges the tasks' partials in task order (finish_columns).
template <typename T>
struct ColumnPartial {
  T *max, *sum, *suml;
};

// Buffer rows [i0, i1) of a block starting at anchor r0, prefix k (0 for a plain problem): raw
// dot products in, weights X (or, forward only, probabilities) out; all passes of a row back to
// back, while it is in L2. With col_rad (Matryoshka cosine backward) the radial sums too. guide:
// the block's guide dot products ([h, N], guide filter), else null. With cols (column statistics,
// forward) the rows' terms of the columns' partials too, from the raw rows before their passes.
//
// With a filter or the sigmoid reduction a row first gets its column adds (`add`: -inf where the
// column leaves the row by padding, tag or filter, the NaN poison of non-finite rows, else 0),
// which its passes read in place of the shared col_add, and every weight of a column left out is
// 0 by selection (contract.Filter: a dropped NaN reaches nothing). Without them the passes are
// those of the plain LSE (the tag's columns marked -inf in the raw row). Column statistics take
// the row's own adds too: the tag's -inf must not reach a column through a NaN anchor's row (-inf
// times a NaN factor).
template <typename T>
void block_rows(const Params<T>& p, T* s, const T* guide, int64_t r0, int64_t i0, int64_t i1, int64_t k, T* col_rad,
                const ColumnPartial<T>* cols = nullptr) {
  const int64_t N = p.N, kb = k * p.B;
  const T* inv_a = p.inv_a.template data_ptr<T>() + kb;
  const T* inv_c = p.inv_c.template data_ptr<T>() + k * N;
  const T* col_add = p.add(k);
  const bool fused = p.mode == Mode::kFused;
  const bool masked = p.filter || p.sigmoid || p.columns;  // rows with their own column adds
  std::vector<T> add_buf(masked ? N : 0);
  const T* row_poison = p.filter ? p.row_poison.template data_ptr<T>() + kb : nullptr;
  const T* row_poison1 = p.filter ? p.row_poison1.template data_ptr<T>() + kb : nullptr;
  const T* thr = p.filter ? p.threshold.template data_ptr<T>() + (p.threshold.size(0) > 1 ? kb : 0) : nullptr;
  // Cosine logits lie in [-1/tau, 1/tau]: while exp(-2/tau) is far from underflow (and the row
  // factor r = g / (|a| tau sum_p) from overflow), 1/tau stands in for the row max and the
  // logits pass is skipped (forward and fused modes; bound 0: take the max).
  constexpr double kMaxInvTau = std::is_same_v<T, float> ? 25 : 300;
  const T bound = p.cosine && p.inv_tau <= kMaxInvTau ? p.inv_tau : T(0);

  // Row i's column adds (masked rows; else the shared col_add): the filter's decisions against the
  // guide's cosine or the model's own similarity (the raw row, before any pass changes it), the
  // own positives restored (never dropped), the row's tag exclusions.
  auto row_adds = [&](int64_t i, int64_t gi, const T* row) -> const T* {
    if (!masked) return col_add;
    T* out = add_buf.data();
    // block by block: joint rows take block 1's poison and guide factor from its own anchors
    const int64_t N0 = p.N0, N1 = p.N1;
    const T rp = row_poison ? row_poison[gi] : T(0), rp1 = row_poison1 ? row_poison1[gi] : T(0);
    if (p.filter && guide) {
      const T *g = guide + i * N, *inv_gc = p.inv_gc.template data_ptr<T>();
      const T ga = p.rga.inv.template data_ptr<T>()[gi], ga1 = p.inv_ga1.template data_ptr<T>()[gi];
      rows::filter_adds<false>(out, g, ga, inv_gc, col_add, rp, thr[gi], N0);
      rows::filter_adds<false>(out + N0, g + N0, ga1, inv_gc + N0, col_add + N0, rp1, thr[gi], N1);
    } else if (p.filter) {
      rows::filter_adds<true>(out, row, inv_a[gi], inv_c, col_add, rp, thr[gi], N0);
      rows::filter_adds<true>(out + N0, row + N0, inv_a[gi], inv_c + N0, col_add + N0, rp1, thr[gi], N1);
    } else {
      std::copy(col_add, col_add + N, out);
    }
    for (int64_t c = p.pos_offset + gi * p.pos_count, j = 0; p.filter && j < p.pos_count; ++j, ++c) {
      out[c] = col_add[c] == rows::neg_inf<T>() ? col_add[c] : col_add[c] + rp;
    }
    for (int64_t c : p.own_cols[gi]) out[c] = rows::neg_inf<T>();
    return out;
  };
  // X from lse and g = dLoss/dlse in one pass over the raw row; returns its radial sum
  auto softmax_weights = [&](T* row, const T* add, T row_scale, T lse, T g) -> T {
    if (lse == rows::neg_inf<T>() || g == T(0)) {
      std::fill(row, row + N, T(0));
      return T(0);
    }
    return p.filter ? rows::softmax_weights<T, true>(row, inv_c, add, row_scale, lse, g * row_scale, N, col_rad)
                    : rows::softmax_weights<T, false>(row, inv_c, add, row_scale, lse, g * row_scale, N, col_rad);
  };
  // Whether the folded own positives' entries w / r stay far from overflow in the GEMMs (fused,
  // one prefix). A row whose LSE is a vanishing share of its loss (log_extra: the ring's or a
  // joint row's other part, e^-88 and less in float32) has a tiny r beside a d_pos of order 1,
  // and w / r = 1e38 or inf: such a row forms X itself.
  auto fold_fits = [&](int64_t gi, T r, T row_scale) {
    const int64_t P = p.fold.count, c0 = p.fold.offset + gi * P;
    const T* dp = p.fold.dpos ? p.fold.dpos + gi * P : nullptr;
    for (int64_t j = 0; dp && j < P; ++j) {
      if (!(std::abs(dp[j] * row_scale * inv_c[c0 + j]) <= r * std::ldexp(T(1), 40))) return false;
    }
    return true;
  };
  // The row's weights X (one row of the block) from its logits, by mode; returns its radial sum.
  auto weights = [&](int64_t gi, T* row, const T* add, T row_scale) -> T {
    if (p.mode == Mode::kBackward && p.columns) {  // the row's softmax and the columns' (one pass)
      rows::column_softmax_weights(row, inv_c, add, row_scale, p.lse_in[gi], p.grad_lse[gi], p.col_lse, p.col_g, N);
      return T(0);
    }
    if (p.mode == Mode::kBackward) {
      return softmax_weights(row, add, row_scale, p.lse_in[kb + gi], p.grad_lse[kb + gi]);
    }
    T* lse = p.lse + kb;
    T* mean_logit = p.mean_logit + kb;
    // the row's LSE and mean logit from the exp sums (no candidate: -inf and 0)
    auto store_stats = [&](T m, T sum_p, T sum_pl) {
      lse[gi] = sum_p == T(0) ? rows::neg_inf<T>() : m + std::log(sum_p);
      mean_logit[gi] = sum_p == T(0) ? T(0) : sum_pl / sum_p;
    };
    if (fused && !p.row_factor) {
      // Matryoshka: the GEMMs sum the prefixes' weights, so prefix k's cannot leave a row
      // factor to them: the backward's pass forms them, after two passes (max unless bounded,
      // exp sums) that keep the raw dot products it reads. The arithmetic of
      // lse_prefix_forward + the head + lse_prefix_backward, less the recomputed A C^T.
      const T m = bound > T(0) ? bound : rows::logits_and_max<T, false>(row, inv_c, add, row_scale, N);
      T sum_p = 0, sum_pl = 0;
      if (m != rows::neg_inf<T>()) {
        std::tie(sum_p, sum_pl) = rows::exp_and_sums<true, false, T, false>(row, m, inv_c, add, row_scale, N);
      }
      store_stats(m, sum_p, sum_pl);
      const T g = p.heads[k].row(gi, lse[gi]);
      p.g_rows[kb + gi] = g;
      return softmax_weights(row, add, row_scale, lse[gi], g);
    }
    // the shift: the bound, or the row's max (that pass also turns the row into logits)
    const T m = bound > T(0) ? bound : rows::logits_and_max(row, inv_c, add, row_scale, N);
    auto exp_pass = [&](auto raw) {  // fused: the row holds p_c * inv_c afterwards
      return fused ? rows::exp_and_sums<raw(), true>(row, m, inv_c, add, row_scale, N)
                   : rows::exp_and_sums<raw(), false>(row, m, inv_c, add, row_scale, N);
    };
    T sum_p = 0, sum_pl = 0;
    if (bound > T(0)) std::tie(sum_p, sum_pl) = exp_pass(std::true_type{});
    else if (m != rows::neg_inf<T>()) std::tie(sum_p, sum_pl) = exp_pass(std::false_type{});
    store_stats(m, sum_p, sum_pl);
    if (fused && sum_p == T(0)) std::fill(row, row + N, T(0));  // no candidate: no gradient
    if (fused) {
      const T g = p.heads[0].row(gi, lse[gi]);
      p.g_rows[gi] = g;
      // X = r * row; r goes into the GEMMs (sweep) instead of a pass over the row, unless it is
      // not a finite nonzero number (g = 0, overflow, NaN) or too small for the folded own
      // positives' w / r (below): then X is formed here and r = 1
      T r = sum_p == T(0) ? T(1) : g * inv_a[gi] * p.inv_tau / sum_p;
      if (!(std::isfinite(r) && r != T(0)) || !fold_fits(gi, r, row_scale)) {
        rows::scale(row, T(1) / sum_p, N);
        if (p.filter) rows::scale_kept(row, add, g * inv_a[gi] * p.inv_tau, N);
        else rows::scale(row, g * inv_a[gi] * p.inv_tau, N);
        r = T(1);
      }
      p.row_factor[gi] = r;
    }
    return T(0);
  };
  // The sigmoid reduction's row (contract.Sigmoid): value and stats (forward, fused) and the
  // weights X = g sigma / (tau |a| |c|) (backward, fused: g the row's weight; with a row factor
  // the row keeps Q = sigma inv_c and r = g inv_a / tau goes into the GEMMs, as for the LSE); the
  // own positives' columns (z = +1) are a segment of their own. Returns its radial sum.
  auto sigmoid_row = [&](int64_t gi, T* row, const T* add, T row_scale) -> T {
    const int64_t P = p.pos_count, c0 = P ? p.pos_offset + gi * P : N, c1 = P ? c0 + P : N;
    T g = 0;
    if (p.mode == Mode::kBackward) g = p.grad_lse[kb + gi];
    if (fused) g = p.weights[kb + gi], p.g_rows[kb + gi] = g;
    const bool store = p.mode != Mode::kForward && g != T(0);  // no gradient: X = 0 (below)
    T factor = g * row_scale;
    if (p.row_factor) {
      const bool to_gemms = store && std::isfinite(factor) && factor != T(0);
      p.row_factor[gi] = to_gemms ? factor : T(1);
      if (to_gemms) factor = T(1);
    }
    auto pass = [&](int64_t lo, int64_t hi, T z) {
      T* rad = col_rad ? col_rad + lo : nullptr;
      return store
                 ? rows::sigmoid_pass<true>(row + lo, inv_c + lo, add + lo, row_scale, p.bias, z, factor, hi - lo, rad)
                 : rows::sigmoid_pass<false>(row + lo, inv_c + lo, add + lo, row_scale, p.bias, z, factor, hi - lo,
                                             rad);
    };
    rows::SigmoidSums<T> sums = pass(0, c0, T(-1));
    if (P) sums += pass(c0, c1, T(1)), sums += pass(c1, N, T(-1));
    if (p.mode != Mode::kForward && !store) std::fill(row, row + N, T(0));
    if (p.mode != Mode::kBackward) {
      p.lse[kb + gi] = sums.value, p.mean_logit[kb + gi] = sums.sigma_l, p.stats1[kb + gi] = sums.sigma;
    }
    if (fused) p.loss_rows[kb + gi] = sums.value;
    return sums.rad;
  };

  if (cols && bound > T(0)) {  // cosine: 1/tau bounds every logit and is every column's shift
    std::fill(cols->max, cols->max + N, bound);
  } else if (cols) {  // the block's rows raise the columns' max first: the sums so far rescaled once
    std::vector<T> old(cols->max, cols->max + N);
    for (int64_t i = i0; i < i1; ++i) {
      const T* row = s + i * N;
      rows::column_max(cols->max, row, inv_c, row_adds(i, r0 + i, row), inv_a[r0 + i] * p.inv_tau, N);
    }
    rows::column_rescale(cols->sum, cols->suml, old.data(), cols->max, N);
  }
  const int64_t P = p.fold.count;
  std::vector<T> pos_raw(col_rad ? P : 0);  // the own positives' raw dot products (radial sums)
  for (int64_t i = i0; i < i1; ++i) {
    const int64_t gi = r0 + i;
    T* row = s + i * N;
    const T row_scale = inv_a[gi] * p.inv_tau;
    const int64_t c0 = p.fold.offset + gi * P;
    const T* add = row_adds(i, gi, row);
    if (cols) rows::column_sums(cols->sum, cols->suml, cols->max, row, inv_c, add, row_scale, N);
    if (p.fold.dpos && col_rad) std::copy(row + c0, row + c0 + P, pos_raw.begin());
    if (p.own_logits) {
      // the own positives' logits from their raw dot products, formed like every other logit
      // (no [B, P, d] normalisation pass in Python); row gi's head reads only row gi's. A
      // masked positive reads as zero (the contract), whatever its row holds. With a filter the
      // poison is added (a valid positive is never padding: checked).
      const bool* m = p.heads[k].mask ? p.heads[k].mask + gi * P : nullptr;
      const T rp = row_poison ? row_poison[gi] : T(0);
      for (int64_t j = 0; j < P; ++j) {
        const T poison = p.filter ? col_add[c0 + j] + rp : T(0);
        p.own_logits[(kb + gi) * P + j] = m && !m[j] ? T(0) : row[c0 + j] * row_scale * inv_c[c0 + j] + poison;
      }
    }
    if (!masked) {
      for (int64_t c : p.own_cols[gi]) row[c] = rows::neg_inf<T>();
    }
    T rad = p.sigmoid ? sigmoid_row(gi, row, add, row_scale) : weights(gi, row, add, row_scale);
    if (p.fold.dpos) {
      // d_pos * dl/d<a_i, c> is one more entry of X, summed by the GEMMs in the compute
      // dtype before any rounding (contract.py, OwnPositives); fused: the head just wrote it
      const T* dp = p.fold.dpos + (kb + gi) * P;
      for (int64_t j = 0; j < P; ++j) {
        const T w = dp[j] * row_scale * inv_c[c0 + j];
        row[c0 + j] += p.row_factor ? w / p.row_factor[gi] : w;
        if (col_rad) rad += w * pos_raw[j], col_rad[c0 + j] += w * pos_raw[j];
      }
    }
    if (p.row_rad) p.row_rad[kb + gi] = rad;
  }
}

// Whether a padded candidate's gradient row may be other than 0: its weights are exactly 0, but
// the GEMMs give 0 * NaN = NaN when an anchor row or a row's factor (lse, g, a folded d_pos) is
// not finite, and a folded d_pos lands on its column whatever the tag. O(K B P) reads after the
// sweep: the finite case (a head gives padded positives d_pos = 0) touches no [N, d] data.
template <typename T>
bool padded_rows_may_be_nonzero(const Params<T>& p) {
  const bool fused = p.mode == Mode::kFused;
  const int64_t n = int64_t(p.ends.size()) * p.B, P = p.fold.count;
  const int64_t stats = n + (p.columns ? p.N : 0);  // the columns' lse and g follow the rows'
  const T *lse = fused ? p.lse : p.lse_in, *g = fused ? p.g_rows : p.grad_lse, *dp = p.fold.dpos;
  const T* add = p.col_add.template data_ptr<T>();
  auto bad_lse = [](T x) { return std::isnan(x) || x == std::numeric_limits<T>::infinity(); };  // -inf: no weights
  if (p.ra.nonfinite || std::any_of(g, g + stats, [](T x) { return !std::isfinite(x); }) ||
      std::any_of(lse, lse + stats, bad_lse)) {
    return true;
  }
  for (int64_t j = 0; dp && j < n * P; ++j) {  // entry (k, i, s) of d_pos: column offset + i P + s
    if (!std::isfinite(dp[j]) || (dp[j] != T(0) && add[p.fold.offset + j % (p.B * P)] == rows::neg_inf<T>())) {
      return true;
    }
  }
  return false;
}

// Padded candidates get exactly zero gradient (the contract), rows of d_c0 / d_c1 (contiguous).
template <typename T>
void zero_padded_rows(const Params<T>& p) {
  const T* add = p.col_add.template data_ptr<T>();
  for (int64_t c = 0; c < p.N; ++c) {
    if (add[c] != rows::neg_inf<T>()) continue;
    T* row = c < p.N0 ? p.d_c0.template data_ptr<T>() + c * p.d : p.d_c1.template data_ptr<T>() + (c - p.N0) * p.d;
    std::fill(row, row + p.d, T(0));
  }
}

// Column statistics (forward): the tasks' partials [tasks, 3, N] (ColumnPartial: max, sum, suml)
// merged in task order into the columns' lse and mean logit, written after the rows' (an empty
// column, or none of its partials: -inf and 0).
template <typename T>
void finish_columns(const Params<T>& p, const at::Tensor& partials) {
  const int64_t tasks = partials.defined() ? partials.size(0) : 0, N = p.N;
  const T* part = tasks ? partials.template data_ptr<T>() : nullptr;
  parallel(0, N, 1024, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      T m = rows::neg_inf<T>(), sum = 0, suml = 0;
      for (int64_t t = 0; t < tasks; ++t) m = rows::nan_max(m, part[3 * t * N + c]);
      for (int64_t t = 0; t < tasks; ++t) {
        const T mt = part[3 * t * N + c];
        if (mt == rows::neg_inf<T>()) continue;  // no row of the task holds the column
        const T f = std::exp(mt - m);
        sum += part[(3 * t + 1) * N + c] * f, suml += part[(3 * t + 2) * N + c] * f;
      }
      p.lse[p.B + c] = sum == T(0) ? rows::neg_inf<T>() : m + std::log(sum);
      p.mean_logit[p.B + c] = sum == T(0) ? T(0) : suml / sum;
    }
  });
}

// ------------------------------------------------------------------ step 1 by fastcl's GEMM tile

// Whether step 1 (S = A_blk C^T) of B anchors uses fastcl's GEMM tile (gemm_tile.h) instead of
// MKL: cpp.gemm "own", or by default ("auto") from kMinTileAnchors anchors on CPUs other than
// Intel's, where MKL runs its generic kernels (docs/csrc.md, "Own GEMM tile": fewer anchors do
// not repay packing the candidates); "mkl": MKL everywhere.
constexpr int64_t kMinTileAnchors = 512;
bool own_gemm_wanted(int64_t B) {
  const auto choice = static_cast<Gemm>(options().gemm.load(std::memory_order_relaxed));
  if (choice != Gemm::kAuto) return choice == Gemm::kOwn;  // set_options refused "own" without the tile
  static const bool intel = gemm::cpu_vendor_is_intel();
  return gemm::kAvailable && !intel && B >= kMinTileAnchors;
}

// Per-thread buffers: a group of packed candidate panels and a tile at the block's edges.
struct Tiles {
  int64_t group = 0, threads = 0;  // panels per group (~64 KB), threads
  at::Tensor panels;               // [threads, group, d, kCols] (gemm::pack_panel)
  at::Tensor rows;                 // [tiles(H), d, kRows] the block's anchors (gemm::pack_rows)
  at::Tensor scratch;              // [threads, kRows, kCols]
};

// Tiles for a float sweep of a plain problem, or none: Matryoshka prefixes keep MKL, a single
// prefix shorter than d included (the tile multiplies whole rows).
template <typename T>
Tiles make_tiles(const Params<T>& p, int64_t threads, int64_t H) {
  Tiles tl;
  const bool plain = p.ends.size() == 1 && p.ends[0] == p.d;
  if (!own_gemm_wanted(p.B) || !std::is_same_v<T, float> || !plain || p.N == 0 || p.d == 0) return tl;
  tl.group = std::max<int64_t>(1, (int64_t(1) << 14) / (p.d * gemm::kCols)), tl.threads = threads;
  const auto opt = p.a.options();
  tl.panels = at::empty({threads, tl.group, p.d, gemm::kCols}, opt);
  tl.rows = at::empty({gemm::num_tiles(H), p.d, gemm::kRows}, opt);
  tl.scratch = at::empty({threads, gemm::kRows, gemm::kCols}, opt);
  return tl;
}

// Step 1 of a block of h anchors `a_blk` by the tile, for the candidate columns [lo, hi): S [h, N]
// (row stride N). The block's anchors are packed once (shared); thread t takes panels [t P / T,
// (t + 1) P / T) of the range in groups of ~64 KB, packs each group (once per block, as MKL does:
// no packed copy of all candidates) and runs every row tile over it, so that S is written row by
// row in spans of the group's width (a column strip of S would touch a page per row) while the
// group stays in L2. Joint rows take two calls: block 0 with a, block 1 with a1s.
template <typename T>
void tiled_raw_dots(const Params<T>& p, const Tiles& tl, T* s, const T* a_blk, int64_t h, int64_t lo, int64_t hi) {
  const int64_t d = p.d, N = p.N, n = hi - lo, R = gemm::kRows, C = gemm::kCols, panels = gemm::num_panels(n);
  const T *c0 = p.c0.template data_ptr<T>(), *c1 = p.c1.template data_ptr<T>();
  T* rows = tl.rows.template data_ptr<T>();
  parallel(0, gemm::num_tiles(h), 8, [&](int64_t t0, int64_t t1) { gemm::pack_rows(rows, a_blk, h, d, t0, t1); });
  parallel(0, tl.threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      T* group = tl.panels[t].template data_ptr<T>();
      T* scratch = tl.scratch[t].template data_ptr<T>();
      const int64_t q0 = panels * t / tl.threads, q1 = panels * (t + 1) / tl.threads;
      for (int64_t g = q0; g < q1; g += tl.group) {
        const int64_t gn = std::min(tl.group, q1 - g);
        for (int64_t q = 0; q < gn; ++q) {  // column c of the group is column lo + g C + c
          gemm::pack_panel(group, q, n - g * C, d, [&](int64_t c) {
            c += lo + g * C;
            return c < p.N0 ? c0 + c * d : c1 + (c - p.N0) * d;
          });
        }
        for (int64_t i = 0; i < h; i += R) {
          const int64_t m = std::min(R, h - i);
          for (int64_t q = 0; q < gn; ++q) {
            const int64_t c = (g + q) * C, w = std::min(C, n - c);
            T* out = s + i * N + lo + c;
            if (m == R && w == C) {
              gemm::tile(rows + (i / R) * d * R, group + q * d * C, d, out, N);
            } else {  // an edge: the tile's rows or columns beyond the block are not written
              gemm::tile(rows + (i / R) * d * R, group + q * d * C, d, scratch, C);
              for (int64_t r = 0; r < m; ++r) std::copy_n(scratch + r * C, w, out + r * N);
            }
          }
        }
      }
    }
  });
}

// One block of H anchor rows at a time, every thread working on it, each GEMM split along
// a dimension of C so that a thread reads (and MKL packs) only its share per block:
//   1. S = A_blk C^T by candidate shares   2. row passes by rows
//   3. E_a = X C by columns of d           4. E_c += X^T A_blk by the candidate shares
// Every output element has one writer in a fixed order (docs/csrc.md). Matryoshka prefixes
// (docs/csrc.md): step 1 runs per d-slice [ends[k-1], ends[k]), S_k = S_{k-1} + A_k C_k^T, each
// S_k then through step 2 with prefix k's norms; the backward keeps all K weight tiles X_k and
// runs steps 3 and 4 per slice on Y_k = X_k + ... + X_{K-1} (every prefix covering the slice).
template <typename T>
void sweep(const Params<T>& p) {
  const bool grad = p.mode != Mode::kForward;
  const int64_t K = int64_t(p.ends.size()), d = p.d, top = p.ends.back();
  if (grad && top < d) {  // coordinates beyond every prefix get no gradient
    for (const at::Tensor* t : {&p.d_a, &p.d_c0, &p.d_c1}) t->narrow(1, top, d - top).zero_();
  }
  const bool columns = p.columns && !grad;  // the forward's column partials
  if (p.B == 0) {  // otherwise the first block's X^T A writes E_c (no zeroing pass over [N, d])
    if (grad) p.d_c0.zero_(), p.d_c1.zero_();
    if (columns) finish_columns(p, at::Tensor());  // no row: every column is empty
    return;
  }
  const int64_t T_ = at::in_parallel_region() ? 1 : std::max<int64_t>(1, at::get_num_threads());
  // the backward and fused steps keep every prefix's weights until they are summed per
  // slice; the forward needs S_{k-1} until S_k is formed
  const int64_t tiles = p.mode == Mode::kForward ? std::min<int64_t>(K, 2) : K;
  // a guide filter's dot products S_g = A_g C_g^T take one more [H, N] tile (the last)
  const int64_t H = block_height(p.B, p.N, d, T_, tiles + p.guided());
  at::Tensor buf = block_buffer({tiles + p.guided(), H, p.N}, p.a.options());
  const at::Tensor a_scaled = p.row_factor ? at::empty({H, d}, p.a.options()) : at::Tensor();
  const at::Tensor a1_scaled = p.row_factor && p.joint() ? at::empty({H, d}, p.a.options()) : at::Tensor();
  std::vector<T> factor1(p.joint() ? p.B : 0);  // joint rows: d_a1's row factor r * ratio
  const std::vector<std::vector<Chunk>> shares = candidate_shares(p, T_);
  const Tiles tiles_1 = make_tiles(p, T_, H);  // step 1 by fastcl's GEMM tile (or MKL: none)
  // radial sums of the candidates, one [K, N] partial per row task (summed in task order)
  at::Tensor col_rad = p.row_rad ? at::zeros({T_, K, p.N}, p.a.options()) : at::Tensor();
  // column statistics: one [3, N] partial (max, sums) per row task, O(threads N), merged at the end
  at::Tensor col_part = columns ? at::zeros({T_, 3, p.N}, p.a.options()) : at::Tensor();
  if (columns) col_part.select(1, 0).fill_(rows::neg_inf<T>());
  auto slice = [&](int64_t k) { return std::make_pair(k ? p.ends[k - 1] : 0, p.ends[k] - (k ? p.ends[k - 1] : 0)); };

  for (int64_t r0 = 0; r0 < p.B; r0 += H) {
    const int64_t h = std::min(H, p.B - r0);
    auto tile = [&](int64_t k) { return buf[k % tiles].narrow(0, 0, h); };
    const at::Tensor a_blk = p.a.narrow(0, r0, h), a1_blk = p.a1s.narrow(0, r0, h);  // block 0's, block 1's
    // fused: X = diag(r) Q, so r scales the anchors of X^T A (a copy, formed in the row pass)
    // and the rows of X C (with the normalisation backward)
    const at::Tensor a_x = p.row_factor ? a_scaled.narrow(0, 0, h) : a_blk;
    const at::Tensor a1_x = !p.joint() ? a_x : p.row_factor ? a1_scaled.narrow(0, 0, h) : a1_blk;
    auto raw_dots = [&](int64_t k) {  // S_k = S_{k-1} + A_blk,k C_k^T (step 1, slice k)
      const auto [lo, w] = slice(k);
      at::Tensor S = tile(k), prev = k ? tile(k - 1) : at::Tensor();
      parallel(0, T_, 1, [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t)
          for (const Chunk& ch : shares[t]) {
            const at::Tensor c_k = (ch.blk ? p.c1 : p.c0).narrow(0, ch.c, ch.n).narrow(1, lo, w).t();
            const int64_t col = (ch.blk ? p.N0 : 0) + ch.c;
            at::Tensor s_cols = S.narrow(1, col, ch.n);
            const at::Tensor& anchors = ch.blk ? a1_blk : a_blk;
            if (k == 0) at::mm_out(s_cols, anchors.narrow(1, lo, w), c_k);
            else at::addmm_out(s_cols, prev.narrow(1, col, ch.n), anchors.narrow(1, lo, w), c_k);
          }
      });
    };
    // the guide's dot products of the block (filter): by the same candidate shares, shared by every prefix
    const at::Tensor guide = p.guided() ? buf[tiles].narrow(0, 0, h) : at::Tensor();
    if (p.guided()) {
      const at::Tensor ga_blk = p.ga.narrow(0, r0, h), ga1_blk = p.ga1.narrow(0, r0, h);
      parallel(0, T_, 1, [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t)
          for (const Chunk& ch : shares[t]) {
            const at::Tensor g_c = (ch.blk ? p.gc1 : p.gc0).narrow(0, ch.c, ch.n).t();
            at::Tensor g_cols = guide.narrow(1, (ch.blk ? p.N0 : 0) + ch.c, ch.n);
            at::mm_out(g_cols, ch.blk ? ga1_blk : ga_blk, g_c);
          }
      });
    }
    const T* guide_dots = p.guided() ? guide.template data_ptr<T>() : nullptr;
    if (tiles_1.rows.defined()) {
      T* s0 = tile(0).template data_ptr<T>();
      if (p.joint()) {
        tiled_raw_dots(p, tiles_1, s0, a_blk.template data_ptr<T>(), h, 0, p.N0);
        tiled_raw_dots(p, tiles_1, s0, a1_blk.template data_ptr<T>(), h, p.N0, p.N);
      } else {
        tiled_raw_dots(p, tiles_1, s0, a_blk.template data_ptr<T>(), h, 0, p.N);
      }
    } else {
      raw_dots(0);
    }
    for (int64_t k = 0; k < K; ++k) {
      if (k + 1 < K) raw_dots(k + 1);
      T* s = tile(k).template data_ptr<T>();
      if (col_rad.defined() || columns) {  // fixed row tasks: each owns one partial of the column sums
        parallel(0, T_, 1, [&](int64_t t0, int64_t t1) {
          for (int64_t t = t0; t < t1; ++t) {
            T* rad = col_rad.defined() ? col_rad[t][k].template data_ptr<T>() : nullptr;
            T* part = columns ? col_part[t].template data_ptr<T>() : nullptr;
            const ColumnPartial<T> cols{part, part + p.N, part + 2 * p.N};
            block_rows(p, s, guide_dots, r0, h * t / T_, h * (t + 1) / T_, k, rad, columns ? &cols : nullptr);
          }
        });
      } else {
        parallel(0, h, 1, [&](int64_t i0, int64_t i1) {
          block_rows(p, s, guide_dots, r0, i0, i1, k, (T*)nullptr);
          if (p.row_factor) scale_rows(a_x, a_blk, p.row_factor + r0, i0, i1);  // K = 1: the rows' r is known
          if (p.row_factor && p.joint()) {
            scale_rows(a1_x, a1_blk, p.row_factor + r0, i0, i1);
            for (int64_t i = r0 + i0; i < r0 + i1; ++i) factor1[i] = p.row_factor[i] * p.ratio[i];
          }
        });
      }
    }
    if (!grad) continue;
    for (int64_t k = K - 1; k >= 0; --k) {
      const at::Tensor X = tile(k);  // Y_k: the weights of every prefix that covers slice k
      if (k + 1 < K) X.add_(tile(k + 1));
      const auto [lo, w] = slice(k);
      // E_a = X C in one call that MKL threads itself: split by hand along d, every thread
      // packed all of X (10-13 % slower at d = 128-256, docs/csrc.md)
      at::Tensor e_a = p.d_a.narrow(0, r0, h);
      if (p.joint()) {  // each block's columns times its candidates, into its anchors' gradient (K = 1)
        mm_cols(e_a, X.narrow(1, 0, p.N0), p.c0);
        mm_cols(p.d_a1.narrow(0, r0, h), X.narrow(1, p.N0, p.N1), p.c1);
      } else {
        mm_blocks(e_a.narrow(1, lo, w), X, p, p.c0.narrow(1, lo, w), p.c1.narrow(1, lo, w));
      }
      parallel(0, T_, 1, [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t)
          for (const Chunk& ch : shares[t]) {
            at::Tensor e_c = (ch.blk ? p.d_c1 : p.d_c0).narrow(0, ch.c, ch.n).narrow(1, lo, w);
            const at::Tensor x_cols = X.narrow(1, (ch.blk ? p.N0 : 0) + ch.c, ch.n).t();
            const at::Tensor& anchors_x = ch.blk ? a1_x : a_x;
            if (r0 == 0) at::mm_out(e_c, x_cols, anchors_x.narrow(1, lo, w));  // the first block writes E_c
            else e_c.addmm_(x_cols, anchors_x.narrow(1, lo, w));
          }
      });
    }
    if (p.cosine && p.row_rad) {
      unnormalize_prefix_rows(p.d_a, p.a, p.ra, p.row_rad, p.B, p.ends, r0, r0 + h, 16);
    } else if (p.cosine) {
      unnormalize_rows(p.d_a, p.a, p.ra, r0, r0 + h, 16, p.row_factor);
      if (p.joint()) unnormalize_rows(p.d_a1, p.a1, p.ra1, r0, r0 + h, 16, factor1.data());
    } else if (p.row_factor) {
      at::Tensor e_a = p.d_a.narrow(0, r0, h), e_a1 = p.joint() ? p.d_a1.narrow(0, r0, h) : at::Tensor();
      parallel(0, h, 16, [&](int64_t i0, int64_t i1) {
        scale_rows(e_a, e_a, p.row_factor + r0, i0, i1);
        if (p.joint()) scale_rows(e_a1, e_a1, factor1.data() + r0, i0, i1);
      });
    }
  }

  if (grad && p.cosine && p.row_rad) {
    at::Tensor rad = col_rad[0];
    for (int64_t t = 1; t < T_; ++t) rad.add_(col_rad[t]);  // in task order: deterministic
    const T* r = rad.template data_ptr<T>();
    unnormalize_prefix_rows(p.d_c0, p.c0, p.rc0, r, p.N, p.ends, 0, p.N0, 64);
    unnormalize_prefix_rows(p.d_c1, p.c1, p.rc1, r + p.N0, p.N, p.ends, 0, p.N1, 64);
  } else if (grad && p.cosine) {
    unnormalize_rows(p.d_c0, p.c0, p.rc0, 0, p.N0, 64);
    unnormalize_rows(p.d_c1, p.c1, p.rc1, 0, p.N1, 64);
  }
  if (columns) finish_columns(p, col_part);
  if (grad && padded_rows_may_be_nonzero(p)) zero_padded_rows(p);
}

// ------------------------------------------------------------------ ops

// The one driver of every op: checks the record, prepares the problem in the compute dtype and
// points the sweep at the mode's inputs and outputs.
void run(OpArgs& o) {
  // the kernel's own ATen calls (GEMMs on views of the inputs) are not autograd's business
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  check(o);
  const auto cd = compute_dtype(o.anchor);
  const int64_t K = o.K, B = o.anchor.size(0);
  dispatch_compute(cd, [&](auto zero) {
    using T = decltype(zero);
    Params<T> p = prepare<T>(o);
    const auto opt = p.a.options();
    // Matryoshka cosine: the per-prefix normalisation backward needs the rows' radial sums
    const at::Tensor row_rad = o.dims && o.cosine && o.mode != Mode::kForward ? at::empty({K, B}, opt) : at::Tensor();
    if (row_rad.defined()) p.row_rad = row_rad.template data_ptr<T>();
    if (o.mode != Mode::kBackward) {
      p.lse = o.lse.data_ptr<T>();
      p.mean_logit = o.mean_logit.data_ptr<T>();
      if (p.sigmoid) p.stats1 = p.mean_logit + K * B;  // stats [2, K, B]
    }
    if (o.mode != Mode::kForward) p.d_a = o.d_anchor, p.d_c0 = o.d_block0, p.d_c1 = o.d_block1;
    if (o.d_anchor1) p.d_a1 = *o.d_anchor1;
    at::Tensor lse_c, g_c, dpos_c;
    if (o.mode == Mode::kBackward) {
      lse_c = o.lse_in.to(cd).contiguous(), g_c = o.grad_lse.to(cd).contiguous();
      if (o.d_pos_in) {
        dpos_c = o.d_pos_in->to(cd).contiguous();
        p.fold = {dpos_c.data_ptr<T>(), o.pos_offset, o.fold_count};
      }
      p.lse_in = lse_c.data_ptr<T>();
      p.grad_lse = g_c.data_ptr<T>();
    }
    std::vector<T> col_lse(o.columns && o.mode == Mode::kBackward ? p.N : 0), col_g(col_lse.size());
    for (int64_t c = 0; c < int64_t(col_lse.size()); ++c) {  // an empty column (-inf) gets no weights
      const T l = p.lse_in[B + c];
      col_lse[c] = l == rows::neg_inf<T>() ? T(0) : l;
      col_g[c] = l == rows::neg_inf<T>() ? T(0) : p.grad_lse[B + c];
    }
    p.col_lse = col_lse.data(), p.col_g = col_g.data();
    std::optional<HeadTensors> ht;
    std::vector<Head<T>> heads;
    const at::Tensor g_rows = o.mode == Mode::kFused ? at::empty({K, B}, opt) : at::Tensor();
    std::vector<T> row_factor(o.mode == Mode::kFused && !o.dims ? B : 0);  // one prefix: X's row factor
    if (o.mode == Mode::kFused) {
      ht.emplace(o.pos_logits, o.pos_mask, o.log_extra, o.weights, cd);
      p.g_rows = g_rows.data_ptr<T>();
      if (!o.dims) p.row_factor = row_factor.data();  // goes into the GEMMs
      if (p.sigmoid) {  // the head is the identity: the weights are dLoss/dvalue, the loss rows the values
        p.weights = ht->weights.data_ptr<T>();
        p.loss_rows = o.loss_rows.data_ptr<T>();
        o.d_pos.zero_();  // no pairs to fold (usually [B, 0])
      } else {
        heads = ht->heads<T>(o.head, o.loss_rows, o.d_pos);
        p.heads = heads.data();
        if (o.fold_positives) p.fold = {o.d_pos.data_ptr<T>(), o.pos_offset, o.fold_count};
        if (o.own_logits) p.own_logits = ht->pos.data_ptr<T>();  // pos_logits itself (checked: contiguous, cd)
      }
    }
    sweep(p);
    if (o.mode == Mode::kFused) {
      T acc = 0;  // the temperature gradient, summed in row order (deterministic)
      for (int64_t i = 0; i < K * B; ++i) acc += p.g_rows[i] * p.mean_logit[i];
      o.g_dot_mean_logit.fill_(acc);
    }
  });
}

// The op entry points (schemas: ../registration.cpp) only fill the record.
OpArgs inputs(Mode mode, const at::Tensor& anchor, const at::Tensor& block0, const at::Tensor& block1,
              const at::Tensor& tags0, const at::Tensor& tags1, const at::Tensor& tau, bool cosine, double eps,
              const at::IntArrayRef* dims) {
  OpArgs o;
  o.mode = mode;
  o.anchor = anchor, o.block0 = block0, o.block1 = block1, o.tags0 = tags0, o.tags1 = tags1, o.tau = tau;
  o.cosine = cosine, o.eps = eps;
  if (dims) o.dims = dims->vec();
  return o;
}

// The extensions' arguments, the same trailing group on every op.
void extensions(OpArgs& o, int64_t pos_count, const OptTensor& bias, const OptTensor& threshold,
                const OptTensor& guide_anchor, const OptTensor& guide_block0, const OptTensor& guide_block1,
                bool columns = false) {
  o.pos_count = pos_count, o.bias = bias, o.threshold = threshold, o.columns = columns;
  o.guide_anchor = guide_anchor, o.guide_block0 = guide_block0, o.guide_block1 = guide_block1;
}

// lse_forward, and lse_prefix_forward with dims (lse, mean_logit [K, B]; sigmoid: stats [2, K, B]).
void forward(const at::Tensor& anchor, const at::Tensor& block0, const at::Tensor& block1, const at::Tensor& tags0,
             const at::Tensor& tags1, const at::Tensor& tau, bool cosine, double eps, const at::IntArrayRef* dims,
             int64_t pos_offset, int64_t pos_count, const OptTensor& bias, const OptTensor& threshold,
             const OptTensor& guide_anchor, const OptTensor& guide_block0, const OptTensor& guide_block1, bool columns,
             const at::Tensor& lse, const at::Tensor& mean_logit) {
  OpArgs o = inputs(Mode::kForward, anchor, block0, block1, tags0, tags1, tau, cosine, eps, dims);
  o.pos_offset = pos_offset;
  extensions(o, pos_count, bias, threshold, guide_anchor, guide_block0, guide_block1, columns);
  o.lse = lse, o.mean_logit = mean_logit;
  run(o);
}

void lse_forward(const at::Tensor& anchor, const at::Tensor& block0, const at::Tensor& block1, const at::Tensor& tags0,
                 const at::Tensor& tags1, const at::Tensor& tau, bool cosine, double eps, int64_t pos_offset,
                 int64_t pos_count, const OptTensor& bias, const OptTensor& threshold, const OptTensor& guide_anchor,
                 const OptTensor& guide_block0, const OptTensor& guide_block1, bool columns, const at::Tensor& lse,
                 const at::Tensor& mean_logit) {
  forward(anchor, block0, block1, tags0, tags1, tau, cosine, eps, nullptr, pos_offset, pos_count, bias, threshold,
          guide_anchor, guide_block0, guide_block1, columns, lse, mean_logit);
}

void lse_prefix_forward(const at::Tensor& anchor, const at::Tensor& block0, const at::Tensor& block1,
                        const at::Tensor& tags0, const at::Tensor& tags1, const at::Tensor& tau, bool cosine,
                        double eps, at::IntArrayRef dims, int64_t pos_offset, int64_t pos_count, const OptTensor& bias,
                        const OptTensor& threshold, const OptTensor& guide_anchor, const OptTensor& guide_block0,
                        const OptTensor& guide_block1, const at::Tensor& lse, const at::Tensor& mean_logit) {
  forward(anchor, block0, block1, tags0, tags1, tau, cosine, eps, &dims, pos_offset, pos_count, bias, threshold,
          guide_anchor, guide_block0, guide_block1, false, lse, mean_logit);
}

// lse_backward, and lse_prefix_backward with dims (lse, grad_lse [K, B], d_pos [K, B, P]).
void backward(const at::Tensor& anchor, const at::Tensor& block0, const at::Tensor& block1, const at::Tensor& tags0,
              const at::Tensor& tags1, const at::Tensor& tau, bool cosine, double eps, const at::IntArrayRef* dims,
              const at::Tensor& lse, const at::Tensor& grad_lse, const OptTensor& d_pos, int64_t pos_offset,
              int64_t pos_count, const OptTensor& bias, const OptTensor& threshold, const OptTensor& guide_anchor,
              const OptTensor& guide_block0, const OptTensor& guide_block1, bool columns, const at::Tensor& d_anchor,
              const at::Tensor& d_block0, const at::Tensor& d_block1) {
  OpArgs o = inputs(Mode::kBackward, anchor, block0, block1, tags0, tags1, tau, cosine, eps, dims);
  o.lse_in = lse, o.grad_lse = grad_lse, o.d_pos_in = d_pos, o.pos_offset = pos_offset;
  extensions(o, pos_count, bias, threshold, guide_anchor, guide_block0, guide_block1, columns);
  o.d_anchor = d_anchor, o.d_block0 = d_block0, o.d_block1 = d_block1;
  run(o);
}

void lse_backward(const at::Tensor& anchor, const at::Tensor& block0, const at::Tensor& block1, const at::Tensor& tags0,
                  const at::Tensor& tags1, const at::Tensor& tau, bool cosine, double eps, const at::Tensor& lse,
                  const at::Tensor& grad_lse, const OptTensor& d_pos, int64_t pos_offset, int64_t pos_count,
                  const OptTensor& bias, const OptTensor& threshold, const OptTensor& guide_anchor,
                  const OptTensor& guide_block0, const OptTensor& guide_block1, bool columns,
                  const at::Tensor& d_anchor, const at::Tensor& d_block0, const at::Tensor& d_block1) {
  backward(anchor, block0, block1, tags0, tags1, tau, cosine, eps, nullptr, lse, grad_lse, d_pos, pos_offset, pos_count,
           bias, threshold, guide_anchor, guide_block0, guide_block1, columns, d_anchor, d_block0, d_block1);
}

void lse_prefix_backward(const at::Tensor& anchor, const at::Tensor& block0, const at::Tensor& block1,
                         const at::Tensor& tags0, const at::Tensor& tags1, const at::Tensor& tau, bool cosine,
                         double eps, at::IntArrayRef dims, const at::Tensor& lse, const at::Tensor& grad_lse,
                         const OptTensor& d_pos, int64_t pos_offset, int64_t pos_count, const OptTensor& bias,
                         const OptTensor& threshold, const OptTensor& guide_anchor, const OptTensor& guide_block0,
                         const OptTensor& guide_block1, const at::Tensor& d_anchor, const at::Tensor& d_block0,
                         const at::Tensor& d_block1) {
  backward(anchor, block0, block1, tags0, tags1, tau, cosine, eps, &dims, lse, grad_lse, d_pos, pos_offset, pos_count,
           bias, threshold, guide_anchor, guide_block0, guide_block1, false, d_anchor, d_block0, d_block1);
}

// lse_fused, and lse_prefix_fused with dims (weights, lse, mean_logit, loss_rows [K, B],
// pos_logits, d_pos [K, B, P]; prefix k's head takes row k of weights). lse_fused's joint rows:
// anchor1 (and guide_anchor1) in, d_anchor1 out (OpArgs::anchor1).
void fused(const at::Tensor& anchor, const at::Tensor& block0, const at::Tensor& block1, const at::Tensor& tags0,
           const at::Tensor& tags1, const at::Tensor& tau, bool cosine, double eps, const at::IntArrayRef* dims,
           std::string_view head, const at::Tensor& pos_logits, const OptTensor& pos_mask, const OptTensor& log_extra,
           const at::Tensor& weights, int64_t pos_offset, bool fold_positives, bool own_logits, int64_t pos_count,
           const OptTensor& bias, const OptTensor& threshold, const OptTensor& guide_anchor,
           const OptTensor& guide_block0, const OptTensor& guide_block1, const OptTensor& anchor1,
           const OptTensor& guide_anchor1, const at::Tensor& lse, const at::Tensor& mean_logit,
           const at::Tensor& loss_rows, const at::Tensor& d_pos, const at::Tensor& d_anchor, const at::Tensor& d_block0,
           const at::Tensor& d_block1, const at::Tensor& g_dot_mean_logit, const OptTensor& d_anchor1) {
  OpArgs o = inputs(Mode::kFused, anchor, block0, block1, tags0, tags1, tau, cosine, eps, dims);
  o.anchor1 = anchor1, o.guide_anchor1 = guide_anchor1, o.d_anchor1 = d_anchor1;
  o.head = head, o.pos_logits = pos_logits, o.pos_mask = pos_mask, o.log_extra = log_extra, o.weights = weights;
  o.pos_offset = pos_offset, o.fold_positives = fold_positives, o.own_logits = own_logits;
  extensions(o, pos_count, bias, threshold, guide_anchor, guide_block0, guide_block1);
  o.lse = lse, o.mean_logit = mean_logit, o.loss_rows = loss_rows, o.d_pos = d_pos;
  o.d_anchor = d_anchor, o.d_block0 = d_block0, o.d_block1 = d_block1, o.g_dot_mean_logit = g_dot_mean_logit;
  run(o);
}

void lse_fused(const at::Tensor& anchor, const at::Tensor& block0, const at::Tensor& block1, const at::Tensor& tags0,
               const at::Tensor& tags1, const at::Tensor& tau, bool cosine, double eps, std::string_view head,
               const at::Tensor& pos_logits, const OptTensor& pos_mask, const OptTensor& log_extra,
               const at::Tensor& weights, int64_t pos_offset, bool fold_positives, bool own_logits, int64_t pos_count,
               const OptTensor& bias, const OptTensor& threshold, const OptTensor& guide_anchor,
               const OptTensor& guide_block0, const OptTensor& guide_block1, const OptTensor& anchor1,
               const OptTensor& guide_anchor1, const at::Tensor& lse, const at::Tensor& mean_logit,
               const at::Tensor& loss_rows, const at::Tensor& d_pos, const at::Tensor& d_anchor,
               const at::Tensor& d_block0, const at::Tensor& d_block1, const at::Tensor& g_dot_mean_logit,
               const OptTensor& d_anchor1) {
  fused(anchor, block0, block1, tags0, tags1, tau, cosine, eps, nullptr, head, pos_logits, pos_mask, log_extra, weights,
        pos_offset, fold_positives, own_logits, pos_count, bias, threshold, guide_anchor, guide_block0, guide_block1,
        anchor1, guide_anchor1, lse, mean_logit, loss_rows, d_pos, d_anchor, d_block0, d_block1, g_dot_mean_logit,
        d_anchor1);
}

void lse_prefix_fused(const at::Tensor& anchor, const at::Tensor& block0, const at::Tensor& block1,
                      const at::Tensor& tags0, const at::Tensor& tags1, const at::Tensor& tau, bool cosine, double eps,
                      at::IntArrayRef dims, std::string_view head, const at::Tensor& pos_logits,
                      const OptTensor& pos_mask, const OptTensor& log_extra, const at::Tensor& weights,
                      int64_t pos_offset, bool fold_positives, bool own_logits, int64_t pos_count,
                      const OptTensor& bias, const OptTensor& threshold, const OptTensor& guide_anchor,
                      const OptTensor& guide_block0, const OptTensor& guide_block1, const at::Tensor& lse,
                      const at::Tensor& mean_logit, const at::Tensor& loss_rows, const at::Tensor& d_pos,
                      const at::Tensor& d_anchor, const at::Tensor& d_block0, const at::Tensor& d_block1,
                      const at::Tensor& g_dot_mean_logit) {
  fused(anchor, block0, block1, tags0, tags1, tau, cosine, eps, &dims, head, pos_logits, pos_mask, log_extra, weights,
        pos_offset, fold_positives, own_logits, pos_count, bias, threshold, guide_anchor, guide_block0, guide_block1,
        std::nullopt, std::nullopt, lse, mean_logit, loss_rows, d_pos, d_anchor, d_block0, d_block1, g_dot_mean_logit,
        std::nullopt);
}

}  // namespace

void set_options(int64_t tile, std::string_view gemm, int64_t test_rows, int64_t test_chunk, int64_t test_keep_bytes) {
  TORCH_CHECK(tile >= 0, "fastcl: cpp.tile must be >= 0 (0: automatic), got ", tile);
  TORCH_CHECK(test_rows >= 0 && test_chunk >= 0 && test_keep_bytes >= -1,
              "fastcl: cpp.test_rows and cpp.test_chunk must be >= 0, cpp.test_keep_bytes >= -1");
  TORCH_CHECK(gemm == "auto" || gemm == "own" || gemm == "mkl", "fastcl: cpp.gemm='", gemm,
              "'; expected auto, own or mkl");
  TORCH_CHECK(gemm != "own" || gemm::kAvailable,
              "fastcl: cpp.gemm='own' (FASTCL_CPP_GEMM=own) needs the "
              "AVX-512 build of the cpp backend (this one targets ",
              FASTCL_CPU_TARGET, ")");
  options().tile.store(tile, std::memory_order_relaxed);
  options().test_rows.store(test_rows, std::memory_order_relaxed);
  options().test_chunk.store(test_chunk, std::memory_order_relaxed);
  options().test_keep_bytes.store(test_keep_bytes, std::memory_order_relaxed);
  options().gemm.store(static_cast<int>(gemm == "own"   ? Gemm::kOwn
                                        : gemm == "mkl" ? Gemm::kMkl
                                                        : Gemm::kAuto),
                       std::memory_order_relaxed);
}

TORCH_LIBRARY_IMPL(fastcl, CPU, m) {
  m.impl("lse_forward", &lse_forward);
  m.impl("lse_backward", &lse_backward);
  m.impl("lse_fused", &lse_fused);
  m.impl("lse_prefix_forward", &lse_prefix_forward);
  m.impl("lse_prefix_backward", &lse_prefix_backward);
  m.impl("lse_prefix_fused", &lse_prefix_fused);
}

}  // namespace fastcl::cpu

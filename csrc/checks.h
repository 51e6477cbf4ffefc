// Host code of the CPU ops (cpu/lse_cpu.cpp): the one record every op fills from its arguments
// (OpArgs), its argument check (every op validates shapes, dtypes and devices before any
// compute), the compute dtype and the head's inputs.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "cpu/head.h"

namespace fastcl {

using OptTensor = std::optional<at::Tensor>;

enum class Mode { kForward, kBackward, kFused };

// What an op was given, one record for the six ops (schemas: ../registration.cpp): the
// problem, its extensions, the mode's inputs and the outputs it overwrites. The op entry points
// only fill it; check() validates it and completes the derived fields, run() (lse_cpu.cpp)
// computes it.
struct OpArgs {
  Mode mode = Mode::kForward;
  at::Tensor anchor, block0, block1, tags0, tags1, tau;  // [B, d], [N0, d], [N1, d], int32 [N0], [N1], 0-d
  bool cosine = true;
  double eps = 0;
  std::optional<std::vector<int64_t>> dims;  // Matryoshka prefix lengths (increasing), or none: a plain op
  // Own positives, anchor i's k-th at row pos_offset + i * count + k of block 0: count pos_count,
  // or (0) the folded d_pos's / pos_logits' P, or none. What the sigmoid's z = +1 and the
  // filter's exemption read.
  int64_t pos_offset = 0, pos_count = 0;
  // Extensions (contract.Sigmoid, contract.Filter): the sigmoid's 0-d bias; the filter's
  // threshold [B] or [K, B], and a guide's embeddings [B, g], [N0, g], [N1, g] (none: self filter).
  OptTensor bias, threshold, guide_anchor, guide_block0, guide_block1;
  // Block 1's own anchors (the joint rows of fastcl/ops/joint.py; fused, plain, LSE only): row i
  // takes <anchor1_i, c> for the candidates c of block 1, one denominator over both blocks;
  // guide_anchor1 [B, g] with a guide. d_anchor1 [B, d] is their gradient (an output).
  OptTensor anchor1, guide_anchor1, d_anchor1;
  // Column statistics (LSEProblem.columns; plain LSE forward and backward only): the per-row
  // outputs and inputs are [B + N], the rows' then the columns'.
  bool columns = false;
  // backward: lse (the sigmoid's value) and grad_lse [B] / [K, B]; d_pos [B, P] / [K, B, P] to fold
  at::Tensor lse_in, grad_lse;
  OptTensor d_pos_in;
  // fused: the head ("cross_entropy", "softplus" or "sigmoid"), its inputs and flags
  std::string_view head;
  at::Tensor pos_logits, weights;
  OptTensor pos_mask, log_extra;
  bool fold_positives = false, own_logits = false;
  // outputs (forward: lse, mean_logit; backward: the gradients; fused: all)
  at::Tensor lse, mean_logit, loss_rows, d_pos, d_anchor, d_block0, d_block1, g_dot_mean_logit;

  // derived by check()
  int64_t K = 1;           // prefixes (1: a plain op)
  int64_t fold_count = 0;  // P of the own positives folded (d_pos), 0: none
  std::vector<int64_t> ends;

  bool sigmoid() const { return bias.has_value(); }
  bool filter() const { return threshold.has_value(); }
  bool guided() const { return guide_anchor.has_value(); }
  bool joint() const { return anchor1.has_value(); }
  // [B] for a plain op, [K, B] for a Matryoshka one
  std::vector<int64_t> rows() const {
    const int64_t B = anchor.size(0);
    return dims ? std::vector<int64_t>{K, B} : std::vector<int64_t>{B};
  }
  // the per-row outputs' (forward) and inputs' (backward) shape: rows(), or [B + N] with columns
  std::vector<int64_t> stat_rows() const {
    return columns ? std::vector<int64_t>{anchor.size(0) + block0.size(0) + block1.size(0)} : rows();
  }
};

// "[a, b]" for error messages. Messages format shapes with this instead of streaming an
// IntArrayRef: on torch 2.11 (the H200 image, 2026-11-26) every check that streamed one
// crashed the process (segfault) instead of raising; checks with scalars raised fine.
inline std::string shape_str(at::IntArrayRef shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

// float64 for float64 inputs, float32 otherwise (contract.py).
inline at::ScalarType compute_dtype(const at::Tensor& anchor) {
  return anchor.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// Calls f(double{}) or f(float{}): the kernels' accumulation type for compute dtype cd.
template <typename F>
void dispatch_compute(at::ScalarType cd, const F& f) {
  if (cd == at::kDouble) f(double{});
  else f(float{});
}

inline bool is_float(at::ScalarType dt) {
  return dt == at::kFloat || dt == at::kDouble || dt == at::kBFloat16 || dt == at::kHalf;
}

inline void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), "fastcl: the CPU kernels take CPU tensors, got ", name, " on ", t.device());
}

inline void check_out(const at::Tensor& t, const char* name, at::IntArrayRef shape, at::ScalarType dtype) {
  TORCH_CHECK(t.sizes() == shape, "fastcl: output ", name, " must have shape ", shape_str(shape), ", got ",
              shape_str(t.sizes()));
  TORCH_CHECK(t.scalar_type() == dtype, "fastcl: output ", name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous() && t.device().is_cpu(), "fastcl: output ", name, " must be a contiguous CPU tensor");
}

// Own positives offset + i * P + k, i < B, k < P, must be rows of block 0.
inline void check_positives(int64_t offset, int64_t P, int64_t B, int64_t N0) {
  TORCH_CHECK(offset >= 0 && offset + B * P <= N0, "fastcl: own positives at rows ", offset, " + i * ", P, " (B = ", B,
              ") do not fit in block0 of ", N0, " rows");
}

inline void check_inputs(const OpArgs& a) {
  TORCH_CHECK(a.anchor.dim() == 2 && a.block0.dim() == 2 && a.block1.dim() == 2,
              "fastcl: anchor, block0 and block1 must be 2-D [rows, d]");
  const auto dt = a.anchor.scalar_type();
  TORCH_CHECK(is_float(dt), "fastcl: unsupported dtype ", dt, " (float32, float64, bfloat16 or float16)");
  TORCH_CHECK(a.block0.scalar_type() == dt && a.block1.scalar_type() == dt,
              "fastcl: anchor and candidate blocks must share a dtype");
  TORCH_CHECK(a.block0.size(1) == a.anchor.size(1) && a.block1.size(1) == a.anchor.size(1),
              "fastcl: anchor and candidate blocks must share d");
  TORCH_CHECK(a.tags0.scalar_type() == at::kInt && a.tags1.scalar_type() == at::kInt, "fastcl: tags must be int32");
  TORCH_CHECK(a.tags0.dim() == 1 && a.tags0.size(0) == a.block0.size(0) && a.tags1.dim() == 1 &&
                  a.tags1.size(0) == a.block1.size(0),
              "fastcl: tags0/tags1 must have one entry per row of block0/block1");
  TORCH_CHECK(a.tau.numel() == 1, "fastcl: tau must be a 0-d tensor");
  for (const at::Tensor* t : {&a.anchor, &a.block0, &a.block1, &a.tags0, &a.tags1, &a.tau}) {
    TORCH_CHECK(t->device().is_cpu(), "fastcl: the CPU kernels take CPU tensors");
  }
}

// The prefix lengths: dims (Matryoshka), increasing in 1..d (the glue sorts them), or {d}.
inline void check_dims(OpArgs& a) {
  const int64_t d = a.anchor.size(1);
  if (!a.dims) {
    a.ends = {d}, a.K = 1;
    return;
  }
  const std::vector<int64_t>& dims = *a.dims;
  TORCH_CHECK(!dims.empty(), "fastcl: matryoshka dims must not be empty");
  for (size_t k = 0; k < dims.size(); ++k) {
    TORCH_CHECK(dims[k] >= 1 && dims[k] <= d && (k == 0 || dims[k] > dims[k - 1]),
                "fastcl: matryoshka dims must be increasing integers in 1..d, got ", shape_str(dims));
  }
  a.ends = dims, a.K = int64_t(dims.size());
}

inline void check_extensions(const OpArgs& a) {
  const int64_t B = a.anchor.size(0);
  if (a.bias) {
    TORCH_CHECK(a.bias->numel() == 1 && is_float(a.bias->scalar_type()), "fastcl: bias must be a 0-d float tensor");
    check_cpu(*a.bias, "bias");
  }
  if (a.filter()) {
    const at::Tensor& t = *a.threshold;
    const auto rows = a.rows();
    TORCH_CHECK(is_float(t.scalar_type()) && (t.sizes() == at::IntArrayRef{B} || (a.dims && t.sizes() == rows)),
                "fastcl: threshold must be a float [B]", a.dims ? " or [K, B]" : "", " tensor, got ",
                shape_str(t.sizes()));
    check_cpu(t, "threshold");
  }
  const int given = int(a.guide_anchor.has_value()) + a.guide_block0.has_value() + a.guide_block1.has_value();
  TORCH_CHECK(given == 0 || given == 3, "fastcl: a guide filter takes guide_anchor, guide_block0 and guide_block1");
  if (given == 3) {
    TORCH_CHECK(a.filter(), "fastcl: guide embeddings need a threshold (the filter)");
    const at::Tensor *ga = &*a.guide_anchor, *g0 = &*a.guide_block0, *g1 = &*a.guide_block1;
    const int64_t g = ga->dim() == 2 ? ga->size(1) : -1;
    const int64_t want[3] = {B, a.block0.size(0), a.block1.size(0)};
    const at::Tensor* got[3] = {ga, g0, g1};
    for (int j = 0; j < 3; ++j) {
      TORCH_CHECK(got[j]->dim() == 2 && got[j]->size(0) == want[j] && got[j]->size(1) == g,
                  "fastcl: guide embeddings must be [B, g], [N0, g], [N1, g]; got ", shape_str(ga->sizes()), ", ",
                  shape_str(g0->sizes()), ", ", shape_str(g1->sizes()));
      TORCH_CHECK(is_float(got[j]->scalar_type()), "fastcl: guide embeddings must be float tensors");
      check_cpu(*got[j], "a guide embedding");
    }
  }
  TORCH_CHECK(!a.guide_anchor1 || (a.joint() && given == 3), "fastcl: guide_anchor1 goes with anchor1 and a guide");
  if (a.joint()) {
    const at::Tensor& a1 = *a.anchor1;
    TORCH_CHECK(a.mode == Mode::kFused && !a.dims && !a.sigmoid() && !a.columns,
                "fastcl: anchor1 (joint rows) is a plain fused LSE step (no matryoshka dims, sigmoid or columns)");
    TORCH_CHECK(a1.sizes() == a.anchor.sizes() && a1.scalar_type() == a.anchor.scalar_type(),
                "fastcl: anchor1 must be like anchor, ", shape_str(a.anchor.sizes()), ", got ", shape_str(a1.sizes()));
    check_cpu(a1, "anchor1");
    TORCH_CHECK(given == 0 || a.guide_anchor1, "fastcl: a guided joint step needs guide_anchor1");
    if (a.guide_anchor1) {
      const at::Tensor& g1 = *a.guide_anchor1;
      TORCH_CHECK(g1.sizes() == a.guide_anchor->sizes() && is_float(g1.scalar_type()),
                  "fastcl: guide_anchor1 must be a float tensor like guide_anchor, got ", shape_str(g1.sizes()));
      check_cpu(g1, "guide_anchor1");
    }
  }
}

// The whole argument check of an op (inputs, then the outputs it overwrites); completes K,
// ends, fold_count and pos_count.
inline void check(OpArgs& a) {
  check_inputs(a);
  check_dims(a);
  check_extensions(a);
  const auto cd = compute_dtype(a.anchor);
  const int64_t B = a.anchor.size(0), d = a.anchor.size(1), N0 = a.block0.size(0);
  const auto rows = a.rows();  // [B], or [K, B] for a Matryoshka op
  const int64_t R = int64_t(rows.size());
  const char* rows_str = a.columns ? "[B + N]" : a.dims ? "[K, B]" : "[B]";
  TORCH_CHECK(!a.columns || (!a.dims && !a.sigmoid() && !a.filter() && a.mode != Mode::kFused),
              "fastcl: column statistics are a plain LSE forward and backward (no matryoshka dims, sigmoid, "
              "filter or fused head)");
  const auto stat_rows = a.stat_rows();
  // the sigmoid's row statistics: [2, B] or [2, K, B]
  std::vector<int64_t> stats = rows;
  if (a.sigmoid()) stats.insert(stats.begin(), 2);
  TORCH_CHECK(a.pos_count >= 0, "fastcl: pos_count must be >= 0");
  if (a.mode != Mode::kBackward) {
    check_out(a.lse, "lse", stat_rows, cd);
    check_out(a.mean_logit, "mean_logit", a.columns ? stat_rows : stats, cd);
  }
  if (a.mode != Mode::kForward) {
    check_out(a.d_anchor, "d_anchor", {B, d}, cd);
    check_out(a.d_block0, "d_block0", {N0, d}, cd);
    check_out(a.d_block1, "d_block1", {a.block1.size(0), d}, cd);
    TORCH_CHECK(a.joint() == a.d_anchor1.has_value(), "fastcl: d_anchor1 is the output of anchor1, and only its");
    if (a.d_anchor1) check_out(*a.d_anchor1, "d_anchor1", {B, d}, cd);
  }
  if (a.mode == Mode::kBackward) {
    TORCH_CHECK(a.lse_in.sizes() == stat_rows && a.grad_lse.sizes() == stat_rows, "fastcl: lse and grad_lse must be ",
                rows_str);
    if (a.d_pos_in) {
      TORCH_CHECK(!a.sigmoid(), "fastcl: the sigmoid reduction folds no d_pos (its pairs are inside the sum)");
      TORCH_CHECK(a.d_pos_in->dim() == R + 1 && a.d_pos_in->sizes().slice(0, R) == rows, "fastcl: d_pos must be ",
                  a.dims ? "[K, B, P]" : "[B, P]");
      a.fold_count = a.d_pos_in->size(-1);
    }
  }
  if (a.mode == Mode::kFused) {
    const bool sig = a.head == "sigmoid";
    TORCH_CHECK(a.head == "cross_entropy" || a.head == "softplus" || sig, "fastcl: unknown head '", a.head,
                "' (cross_entropy, softplus or sigmoid)");
    TORCH_CHECK(sig == a.sigmoid(), "fastcl: the head 'sigmoid' goes with a bias (the sigmoid reduction), and only it");
    TORCH_CHECK(a.pos_logits.dim() == R + 1 && a.pos_logits.sizes().slice(0, R) == rows, "fastcl: pos_logits must be ",
                a.dims ? "[K, B, P]" : "[B, P]");
    const int64_t P = a.pos_logits.size(-1);
    if (a.pos_mask) {
      TORCH_CHECK(a.pos_mask->scalar_type() == at::kBool && a.pos_mask->sizes() == a.pos_logits.sizes().slice(R - 1),
                  "fastcl: pos_mask must be a bool [B, P] tensor");
    }
    if (a.log_extra) {
      TORCH_CHECK((a.log_extra->dim() == 1 && a.log_extra->size(0) == B) || (a.dims && a.log_extra->sizes() == rows),
                  "fastcl: log_extra must be [B]", a.dims ? " or [K, B]" : "");
    }
    TORCH_CHECK(a.weights.sizes() == rows, "fastcl: weights must be ", rows_str);
    check_out(a.loss_rows, "loss_rows", rows, cd);
    check_out(a.d_pos, "d_pos", a.pos_logits.sizes().vec(), cd);
    check_out(a.g_dot_mean_logit, "g_dot_mean_logit", {}, cd);
    TORCH_CHECK(!(sig && (a.fold_positives || a.own_logits)),
                "fastcl: the sigmoid head folds no own positives (pos_count gives their layout)");
    if (a.fold_positives) a.fold_count = P;
    if (a.own_logits) {
      TORCH_CHECK(a.fold_positives, "fastcl: own_logits forms the logits of folded own positives (fold_positives)");
      check_out(a.pos_logits, "pos_logits", a.pos_logits.sizes().vec(), cd);
      check_positives(a.pos_offset, P, B, N0);
      // the kernel forms a positive's logit from its row as stored, and a padded row is stored
      // as zeros: a valid positive must not be padding (the losses tag exactly the masked ones)
      const at::Tensor padded = a.tags0.narrow(0, a.pos_offset, B * P).view({B, P}) == -2;
      TORCH_CHECK(!(a.pos_mask ? padded & *a.pos_mask : padded).any().item<bool>(),
                  "fastcl: own_logits needs every valid own positive (pos_mask True) to be a candidate, not "
                  "padding (tag -2)");
    }
  }
  if (a.fold_count) {
    TORCH_CHECK(a.pos_count == 0 || a.pos_count == a.fold_count, "fastcl: pos_count ", a.pos_count,
                " differs from the ", a.fold_count, " own positives folded");
    a.pos_count = a.fold_count;
  }
  if (a.pos_count) check_positives(a.pos_offset, a.pos_count, B, N0);
}

// The loss head's inputs in the compute dtype cd, alive while the kernels read them.
struct HeadTensors {
  at::Tensor pos, mask, extra, weights;
  HeadTensors(const at::Tensor& pos_logits, const OptTensor& pos_mask, const OptTensor& log_extra, const at::Tensor& w,
              at::ScalarType cd)
      : pos(pos_logits.to(cd).contiguous()),
        mask(pos_mask ? pos_mask->contiguous() : at::Tensor()),
        extra(log_extra ? log_extra->to(cd).contiguous() : at::Tensor()),
        weights(w.to(cd).contiguous()) {}
  template <typename T>
  cpu::Head<T> head(std::string_view kind, const at::Tensor& loss_rows, const at::Tensor& d_pos) const {
    return {kind == "softplus",
            pos.size(-1),
            pos.data_ptr<T>(),
            mask.defined() ? mask.data_ptr<bool>() : nullptr,
            extra.defined() ? extra.data_ptr<T>() : nullptr,
            weights.data_ptr<T>(),
            loss_rows.data_ptr<T>(),
            d_pos.data_ptr<T>()};
  }
  // One head per matryoshka prefix k: its slices of pos_logits, weights, loss_rows [K, B],
  // d_pos [K, B, P] and of log_extra when it is [K, B] (the ring's other blocks' lse per
  // prefix; a [B] one and the mask are shared); a plain problem has one.
  template <typename T>
  std::vector<cpu::Head<T>> heads(std::string_view kind, const at::Tensor& loss_rows, const at::Tensor& d_pos) const {
    const int64_t K = pos.dim() == 3 ? pos.size(0) : 1, B = pos.size(-2), P = pos.size(-1);
    const bool extra_per_prefix = extra.defined() && extra.dim() == 2;
    std::vector<cpu::Head<T>> out(K, head<T>(kind, loss_rows, d_pos));
    for (int64_t k = 0; k < K; ++k) {
      out[k].pos += k * B * P, out[k].weights += k * B, out[k].loss_rows += k * B, out[k].d_pos += k * B * P;
      if (extra_per_prefix) out[k].log_extra += k * B;
    }
    return out;
  }
};

}  // namespace fastcl

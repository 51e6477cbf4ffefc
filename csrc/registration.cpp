// Every op schema of fastcl, in one place: TORCH_LIBRARY(fastcl, m). Kernels: cpu/lse_cpu.cpp;
// fakes: fastcl/ops/_cpp.py. Semantics: fastcl/ops/contract.py and
// head.py; the conventions shared by every op (shapes, tags, outputs passed in, in the
// compute dtype, every element written) are in docs/csrc.md, "Op conventions".

#include <torch/library.h>

#include <string_view>

#include "cpu/options.h"

namespace {
// The op's kernel: a plain function of no tensor (nothing to dispatch on).
void set_cpu_options(int64_t tile, c10::string_view gemm, int64_t test_rows, int64_t test_chunk,
                     int64_t test_keep_bytes) {
  fastcl::cpu::set_options(tile, std::string_view(gemm.data(), gemm.size()), test_rows, test_chunk, test_keep_bytes);
}
}  // namespace

TORCH_LIBRARY(fastcl, m) {
  // The CPU kernels' knobs from fastcl.config (csrc/cpu/options.h): cpp.tile (0: automatic),
  // cpp.gemm ("auto", "own", "mkl") and the test hooks cpp.test_rows, cpp.test_chunk (0: none) and
  // cpp.test_keep_bytes (-1: the default). Refuses what it cannot honour, keeping the old ones.
  m.def("set_cpu_options(int tile, str gemm, int test_rows=0, int test_chunk=0, int test_keep_bytes=-1) -> ()",
        &set_cpu_options);

  // The primitive's extensions, the same trailing group on every op (docs/csrc.md, "Op conventions"):
  // pos_count, with pos_offset, the own positives' layout (0: those folded, or none); bias: the
  // sigmoid reduction (contract.Sigmoid) instead of the LSE, its statistics [2, B] ([2, K, B]) in
  // place of mean_logit; threshold [B] ([K, B]): the filter (contract.Filter), with the guide's
  // embeddings guide_anchor [B, g], guide_block0 [N0, g], guide_block1 [N1, g], or (none) the model's
  // own similarity. columns (lse_forward and lse_backward only: a plain LSE): column statistics
  // (LSEProblem.columns), lse and mean_logit (forward), lse and grad_lse (backward) [B + N], the
  // rows' then the columns'.

  // Forward only: lse [B] (-inf for a row without candidates) and the softmax-weighted
  // mean logit [B] (0 for such a row).
  m.def(
      "lse_forward(Tensor anchor, Tensor block0, Tensor block1, Tensor tags0, Tensor tags1, "
      "Tensor tau, bool cosine, float eps, int pos_offset=0, "
      "int pos_count=0, Tensor? bias=None, Tensor? threshold=None, Tensor? guide_anchor=None, "
      "Tensor? guide_block0=None, Tensor? guide_block1=None, bool columns=False, "
      "*, Tensor(a!) lse, Tensor(b!) mean_logit) -> ()");

  // Recompute backward from lse and grad_lse = dLoss/dlse [B]; d_pos [B, P], the gradient of
  // the own-positive logits (rows pos_offset + i*P + k of block0), is folded in too.
  m.def(
      "lse_backward(Tensor anchor, Tensor block0, Tensor block1, Tensor tags0, Tensor tags1, "
      "Tensor tau, bool cosine, float eps, Tensor lse, Tensor grad_lse, Tensor? d_pos, int pos_offset, "
      "int pos_count=0, Tensor? bias=None, Tensor? threshold=None, Tensor? guide_anchor=None, "
      "Tensor? guide_block0=None, Tensor? guide_block1=None, bool columns=False, "
      "*, Tensor(a!) d_anchor, Tensor(b!) d_block0, Tensor(c!) d_block1) -> ()");

  // Gradient in forward: the loss head ("cross_entropy" | "softplus"; "sigmoid" with bias) applied
  // to each block of rows as soon as its lse is known; outputs, fold_positives and own_logits (the
  // kernel writes the folded own positives' logits into pos_logits instead of reading them):
  // docs/csrc.md. Joint rows (fastcl/ops/joint.py): anchor1 [B, d] takes block 1's candidates
  // (guide_anchor1 with a guide), d_anchor1 its gradient.
  m.def(
      "lse_fused(Tensor anchor, Tensor block0, Tensor block1, Tensor tags0, Tensor tags1, "
      "Tensor tau, bool cosine, float eps, str head, Tensor(i!) pos_logits, Tensor? pos_mask, "
      "Tensor? log_extra, Tensor weights, int pos_offset, bool fold_positives, bool own_logits=False, "
      "int pos_count=0, Tensor? bias=None, Tensor? threshold=None, Tensor? guide_anchor=None, "
      "Tensor? guide_block0=None, Tensor? guide_block1=None, Tensor? anchor1=None, Tensor? guide_anchor1=None, "
      "*, Tensor(a!) lse, Tensor(b!) mean_logit, "
      "Tensor(c!) loss_rows, Tensor(d!) d_pos, Tensor(e!) d_anchor, Tensor(f!) d_block0, "
      "Tensor(g!) d_block1, Tensor(h!) g_dot_mean_logit, Tensor(j!)? d_anchor1=None) -> ()");

  // Matryoshka (LSEProblem.dims): the K plain problems on the first dims[k] coordinates, dims
  // increasing in 1..d (the glue sorts them), in one sweep over d (docs/csrc.md). lse and
  // mean_logit [K, B]; the backward takes lse, grad_lse [K, B] and d_pos [K, B, P] and writes the
  // sum of the K gradients, zero beyond each prefix.
  m.def(
      "lse_prefix_forward(Tensor anchor, Tensor block0, Tensor block1, Tensor tags0, Tensor tags1, "
      "Tensor tau, bool cosine, float eps, int[] dims, int pos_offset=0, "
      "int pos_count=0, Tensor? bias=None, Tensor? threshold=None, Tensor? guide_anchor=None, "
      "Tensor? guide_block0=None, Tensor? guide_block1=None, "
      "*, Tensor(a!) lse, Tensor(b!) mean_logit) -> ()");
  m.def(
      "lse_prefix_backward(Tensor anchor, Tensor block0, Tensor block1, Tensor tags0, Tensor tags1, "
      "Tensor tau, bool cosine, float eps, int[] dims, Tensor lse, Tensor grad_lse, Tensor? d_pos, "
      "int pos_offset, "
      "int pos_count=0, Tensor? bias=None, Tensor? threshold=None, Tensor? guide_anchor=None, "
      "Tensor? guide_block0=None, Tensor? guide_block1=None, "
      "*, Tensor(a!) d_anchor, Tensor(b!) d_block0, Tensor(c!) d_block1) -> ()");
  // lse_fused on the K prefixes: weights, lse, mean_logit and loss_rows [K, B],
  // pos_logits and d_pos [K, B, P], prefix k's head weighted by row k of weights.
  m.def(
      "lse_prefix_fused(Tensor anchor, Tensor block0, Tensor block1, Tensor tags0, Tensor tags1, "
      "Tensor tau, bool cosine, float eps, int[] dims, str head, Tensor(i!) pos_logits, Tensor? pos_mask, "
      "Tensor? log_extra, Tensor weights, int pos_offset, bool fold_positives, bool own_logits=False, "
      "int pos_count=0, Tensor? bias=None, Tensor? threshold=None, Tensor? guide_anchor=None, "
      "Tensor? guide_block0=None, Tensor? guide_block1=None, "
      "*, Tensor(a!) lse, Tensor(b!) mean_logit, "
      "Tensor(c!) loss_rows, Tensor(d!) d_pos, Tensor(e!) d_anchor, Tensor(f!) d_block0, "
      "Tensor(g!) d_block1, Tensor(h!) g_dot_mean_logit) -> ()");
}

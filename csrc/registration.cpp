// Every op schema of fastcl, in one place: TORCH_LIBRARY(fastcl, m).
//
// The kernels live in cpu/*.cpp (TORCH_LIBRARY_IMPL(fastcl, CPU, m)) and cuda/*
// (TORCH_LIBRARY_IMPL(fastcl, CUDA, m)); the Python side is fastcl/ops/_cpp.py and
// fastcl/ops/_cuda.py, which also register the fake (meta) implementations.
//
// The semantics are those of fastcl/ops/contract.py (the masked-LSE primitive) and
// fastcl/ops/head.py (the loss head); read those first. Conventions of every op here:
//
//  * anchor [B, d], block0 [N0, d], block1 [N1, d]: same floating dtype, contiguous.
//  * tags0 [N0], tags1 [N1]: int32; -2 padding, -1 valid in every row, i >= 0 valid but
//    left out of row i.
//  * tau: 0-d tensor (> 0); logits are cos/tau (cosine=True) or <a, c>/tau.
//  * Outputs are passed in (keyword-only, mutated) in the *compute dtype*: float64 for
//    float64 inputs, float32 otherwise. The caller allocates them (fastcl's new_output,
//    which tests fill with NaN) and every kernel writes every element of every output.
//  * Gradients are with respect to the raw (un-normalised) inputs; padded candidates get
//    exactly zero.

#include <torch/library.h>

TORCH_LIBRARY(fastcl, m) {
  // Forward only: lse [B] (-inf for a row without candidates) and the softmax-weighted
  // mean logit [B] (0 for such a row).
  m.def(
      "lse_forward(Tensor anchor, Tensor block0, Tensor block1, Tensor tags0, Tensor tags1, "
      "Tensor tau, bool cosine, float eps, *, Tensor(a!) lse, Tensor(b!) mean_logit) -> ()");

  // Recompute backward: given lse [B] from lse_forward and grad_lse [B] = dLoss/dlse,
  // d_anchor [B, d], d_block0 [N0, d], d_block1 [N1, d]. With d_pos [B, P] (the gradient of
  // the own-positive logits, anchor i's positive k being row pos_offset + i*P + k of
  // block0; see OwnPositives in contract.py) that gradient is folded in too, before the
  // normalisation backward and the rounding to the input dtype.
  m.def(
      "lse_backward(Tensor anchor, Tensor block0, Tensor block1, Tensor tags0, Tensor tags1, "
      "Tensor tau, bool cosine, float eps, Tensor lse, Tensor grad_lse, Tensor? d_pos, int pos_offset, "
      "*, Tensor(a!) d_anchor, "
      "Tensor(b!) d_block0, Tensor(c!) d_block1) -> ()");

  // Gradient in forward: the loss head (head = "supcon" | "supmpn", pos_logits [B, P],
  // pos_mask [B, P] bool or None, log_extra [B] or None, weights [B]) is applied to each
  // block of rows as soon as its lse is known. Outputs: lse, mean_logit, loss_rows [B]
  // (unweighted per-anchor loss), d_pos [B, P] (weighted dLoss/dpos_logits), d_anchor,
  // d_block0, d_block1 (weighted gradients) and g_dot_mean_logit (0-d,
  // sum_i w_i dloss_i/dlse_i * mean_logit_i: the temperature gradient is -that/tau).
  // fold_positives: the pos_logits are those of rows pos_offset + i*P + k of block0, and
  // d_pos is folded into d_anchor / d_block0 as in lse_backward (d_pos is still output,
  // for the temperature gradient of the positive logits).
  m.def(
      "lse_fused(Tensor anchor, Tensor block0, Tensor block1, Tensor tags0, Tensor tags1, "
      "Tensor tau, bool cosine, float eps, str head, Tensor pos_logits, Tensor? pos_mask, "
      "Tensor? log_extra, Tensor weights, int pos_offset, bool fold_positives, *, Tensor(a!) lse, Tensor(b!) mean_logit, "
      "Tensor(c!) loss_rows, Tensor(d!) d_pos, Tensor(e!) d_anchor, Tensor(f!) d_block0, "
      "Tensor(g!) d_block1, Tensor(h!) g_dot_mean_logit) -> ()");
}

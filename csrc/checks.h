// Host code of the CPU ops (cpu/lse_cpu.cpp): argument
// checks (every op validates shapes, dtypes and devices before any compute), the compute
// dtype, the head's inputs and the strict reading of the environment's size options.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "cpu/head.h"

namespace fastcl {

// An integer >= least from the environment (test hooks such as _FASTCL_TEST_CPP_ROWS, and
// FASTCL_CUDA_TILE), or fallback when unset or empty. Anything else ("abc", "-3", "1e6", "0"
// where least is 1, a value beyond int64) is refused loudly: never read as 1 or clamped.
inline int64_t env_int(const char* name, int64_t fallback, int64_t least = 1) {
  const char* s = std::getenv(name);
  if (!s || !*s) return fallback;
  const std::string text(s);
  const bool digits = std::all_of(text.begin(), text.end(), [](char c) { return c >= '0' && c <= '9'; });
  errno = 0;
  char* end = nullptr;
  const long long value = digits ? std::strtoll(text.c_str(), &end, 10) : 0;
  TORCH_CHECK(digits && errno == 0 && end && *end == '\0' && value >= least, "fastcl: ", name, "='", text,
              "': expected an integer >= ", least);
  return value;
}

inline const char* device_name(c10::DeviceType dev) { return dev == c10::DeviceType::CPU ? "CPU" : "CUDA"; }

inline void check_inputs(const at::Tensor& anchor, const at::Tensor& block0, const at::Tensor& block1,
                         const at::Tensor& tags0, const at::Tensor& tags1, const at::Tensor& tau, c10::DeviceType dev) {
  TORCH_CHECK(anchor.dim() == 2 && block0.dim() == 2 && block1.dim() == 2,
              "fastcl: anchor, block0 and block1 must be 2-D [rows, d]");
  const auto dt = anchor.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kDouble || dt == at::kBFloat16 || dt == at::kHalf,
              "fastcl: unsupported dtype ", dt, " (float32, float64, bfloat16 or float16)");
  TORCH_CHECK(block0.scalar_type() == dt && block1.scalar_type() == dt,
              "fastcl: anchor and candidate blocks must share a dtype");
  TORCH_CHECK(block0.size(1) == anchor.size(1) && block1.size(1) == anchor.size(1),
              "fastcl: anchor and candidate blocks must share d");
  TORCH_CHECK(tags0.scalar_type() == at::kInt && tags1.scalar_type() == at::kInt, "fastcl: tags must be int32");
  TORCH_CHECK(
      tags0.dim() == 1 && tags0.size(0) == block0.size(0) && tags1.dim() == 1 && tags1.size(0) == block1.size(0),
      "fastcl: tags0/tags1 must have one entry per row of block0/block1");
  TORCH_CHECK(tau.numel() == 1, "fastcl: tau must be a 0-d tensor");
  for (const at::Tensor* t : {&anchor, &block0, &block1, &tags0, &tags1, &tau}) {
    TORCH_CHECK(t->device().type() == dev && t->device() == anchor.device(), "fastcl: the ", device_name(dev),
                " kernels take ", device_name(dev), " tensors on one device");
  }
}

// Own positives pos_offset + i * P + k, i < B, k < P, must be rows of block 0.
inline void check_positives(int64_t offset, int64_t P, int64_t B, int64_t N0) {
  TORCH_CHECK(offset >= 0 && offset + B * P <= N0, "fastcl: own positives at rows ", offset, " + i * ", P, " (B = ", B,
              ") do not fit in block0 of ", N0, " rows");
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

// "[a, b]" for error messages. Messages format shapes with this instead of streaming an
// IntArrayRef: on torch 2.11 (the H200 image, 2026-11-26) every check that streamed one
// crashed the process (segfault) instead of raising; checks with scalars raised fine.
inline std::string shape_str(at::IntArrayRef shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

inline void check_out(const at::Tensor& t, const char* name, at::IntArrayRef shape, at::ScalarType dtype,
                      c10::DeviceType dev) {
  TORCH_CHECK(t.sizes() == shape, "fastcl: output ", name, " must have shape ", shape_str(shape), ", got ",
              shape_str(t.sizes()));
  TORCH_CHECK(t.scalar_type() == dtype, "fastcl: output ", name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous() && t.device().type() == dev, "fastcl: output ", name, " must be a contiguous ",
              device_name(dev), " tensor");
}

using OptTensor = std::optional<at::Tensor>;

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

// The whole argument check of each op (inputs, then the outputs it overwrites), one
// definition for the CPU kernels (cpu/lse_cpu.cpp).
inline void check_forward(const at::Tensor& anchor, const at::Tensor& block0, const at::Tensor& block1,
                          const at::Tensor& tags0, const at::Tensor& tags1, const at::Tensor& tau,
                          const at::Tensor& lse, const at::Tensor& mean_logit, c10::DeviceType dev, int64_t K = 0) {
  check_inputs(anchor, block0, block1, tags0, tags1, tau, dev);
  const auto cd = compute_dtype(anchor);
  const int64_t B = anchor.size(0);
  const auto rows = K ? std::vector<int64_t>{K, B} : std::vector<int64_t>{B};  // [K, B]: matryoshka
  check_out(lse, "lse", rows, cd, dev);
  check_out(mean_logit, "mean_logit", rows, cd, dev);
}

// Returns P, the number of own positives per anchor folded from d_pos (0 without d_pos). K > 0:
// matryoshka, lse and grad_lse [K, B], d_pos [K, B, P].
inline int64_t check_backward(const at::Tensor& anchor, const at::Tensor& block0, const at::Tensor& block1,
                              const at::Tensor& tags0, const at::Tensor& tags1, const at::Tensor& tau,
                              const at::Tensor& lse, const at::Tensor& grad_lse, const OptTensor& d_pos,
                              int64_t pos_offset, const at::Tensor& d_anchor, const at::Tensor& d_block0,
                              const at::Tensor& d_block1, c10::DeviceType dev, int64_t K = 0) {
  check_inputs(anchor, block0, block1, tags0, tags1, tau, dev);
  const auto cd = compute_dtype(anchor);
  const int64_t B = anchor.size(0), d = anchor.size(1);
  const auto rows = K ? std::vector<int64_t>{K, B} : std::vector<int64_t>{B};
  TORCH_CHECK(lse.sizes() == rows && grad_lse.sizes() == rows, "fastcl: lse and grad_lse must be ",
              K ? "[K, B]" : "[B]");
  check_out(d_anchor, "d_anchor", {B, d}, cd, dev);
  check_out(d_block0, "d_block0", {block0.size(0), d}, cd, dev);
  check_out(d_block1, "d_block1", {block1.size(0), d}, cd, dev);
  if (!d_pos) return 0;
  TORCH_CHECK(d_pos->dim() == int64_t(rows.size()) + 1 && d_pos->sizes().slice(0, rows.size()) == rows,
              "fastcl: d_pos must be ", K ? "[K, B, P]" : "[B, P]");
  const int64_t P = d_pos->size(-1);
  check_positives(pos_offset, P, B, block0.size(0));
  return P;
}

// Returns P, the number of positive logits per anchor.
inline int64_t check_fused(const at::Tensor& anchor, const at::Tensor& block0, const at::Tensor& block1,
                           const at::Tensor& tags0, const at::Tensor& tags1, const at::Tensor& tau,
                           std::string_view head, const at::Tensor& pos_logits, const OptTensor& pos_mask,
                           const OptTensor& log_extra, const at::Tensor& weights, int64_t pos_offset,
                           bool fold_positives, bool own_logits, const at::Tensor& lse, const at::Tensor& mean_logit,
                           const at::Tensor& loss_rows, const at::Tensor& d_pos, const at::Tensor& d_anchor,
                           const at::Tensor& d_block0, const at::Tensor& d_block1, const at::Tensor& g_dot_mean_logit,
                           c10::DeviceType dev, int64_t K = 0) {
  check_forward(anchor, block0, block1, tags0, tags1, tau, lse, mean_logit, dev, K);
  TORCH_CHECK(head == "cross_entropy" || head == "softplus", "fastcl: unknown head '", head,
              "' (cross_entropy or softplus)");
  const auto cd = compute_dtype(anchor);
  const int64_t B = anchor.size(0), d = anchor.size(1);
  // K > 0 (matryoshka): pos_logits, d_pos [K, B, P], weights and loss_rows [K, B]
  const auto rows = K ? std::vector<int64_t>{K, B} : std::vector<int64_t>{B};
  const int64_t R = int64_t(rows.size());
  TORCH_CHECK(pos_logits.dim() == R + 1 && pos_logits.sizes().slice(0, R) == rows, "fastcl: pos_logits must be ",
              K ? "[K, B, P]" : "[B, P]");
  const int64_t P = pos_logits.size(-1);
  if (pos_mask) {
    TORCH_CHECK(pos_mask->scalar_type() == at::kBool && pos_mask->sizes() == pos_logits.sizes().slice(R - 1),
                "fastcl: pos_mask must be a bool [B, P] tensor");
  }
  if (log_extra) {
    TORCH_CHECK((log_extra->dim() == 1 && log_extra->size(0) == B) || (K && log_extra->sizes() == rows),
                "fastcl: log_extra must be [B]", K ? " or [K, B]" : "");
  }
  TORCH_CHECK(weights.sizes() == rows, "fastcl: weights must be ", K ? "[K, B]" : "[B]");
  check_out(loss_rows, "loss_rows", rows, cd, dev);
  check_out(d_pos, "d_pos", pos_logits.sizes().vec(), cd, dev);
  check_out(d_anchor, "d_anchor", {B, d}, cd, dev);
  check_out(d_block0, "d_block0", {block0.size(0), d}, cd, dev);
  check_out(d_block1, "d_block1", {block1.size(0), d}, cd, dev);
  check_out(g_dot_mean_logit, "g_dot_mean_logit", {}, cd, dev);
  if (fold_positives) check_positives(pos_offset, P, B, block0.size(0));
  if (own_logits) {
    TORCH_CHECK(fold_positives, "fastcl: own_logits forms the logits of folded own positives (fold_positives)");
    check_out(pos_logits, "pos_logits", pos_logits.sizes().vec(), cd, dev);
    // the kernel forms a positive's logit from its row as stored, and a padded row is stored
    // as zeros: a valid positive must not be padding (the losses tag exactly the masked ones)
    const at::Tensor padded = tags0.narrow(0, pos_offset, B * P).view({B, P}) == -2;
    TORCH_CHECK(!(pos_mask ? padded & *pos_mask : padded).any().item<bool>(),
                "fastcl: own_logits needs every valid own positive (pos_mask True) to be a candidate, not "
                "padding (tag -2)");
  }
  return P;
}

}  // namespace fastcl

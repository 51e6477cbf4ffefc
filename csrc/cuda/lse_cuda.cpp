// CUDA implementations of the fastcl ops (schemas: ../registration.cpp): the torch glue
// around lse_rows.cu and lse_forward_tc.cu, the CPU backend's strategy on the GPU with
// cuBLAS GEMMs (docs/csrc.md, "CUDA kernels"). No host synchronisation: tau stays on the
// device; the tag values are checked by the Python layer (contract.structured_tags).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <optional>
#include <cmath>
#include <limits>
#include <string_view>
#include <tuple>

#include "../checks.h"
#include "launch.h"

namespace fastcl::cuda {
namespace {

constexpr c10::DeviceType kDev = c10::DeviceType::CUDA;

void check_launch(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, "fastcl: CUDA kernel ", what, " failed: ", cudaGetErrorString(err));
}

int64_t rows_per_block(int64_t B, int64_t N) {
  const int64_t tile = env_int("FASTCL_CUDA_TILE", int64_t(1) << 24);  // elements of the [R, N] buffer
  return std::clamp<int64_t>(tile / std::max<int64_t>(N, 1), 1, std::max<int64_t>(B, 1));
}

// The problem in the compute dtype T, candidates of both blocks as one [N, d] matrix.
struct Prepared {
  int64_t B = 0, N0 = 0, N = 0, d = 0;
  at::Tensor a, c;             // [B, d], [N, d] compute dtype (see robust_rows)
  at::Tensor norm_a, norm_c;   // norms of the rows as stored (cosine) or undefined
  at::Tensor inv_a, inv_c;     // 1 / max(norm, eps), ones for dot similarity; NaN for non-finite rows
  at::Tensor unscale_a, unscale_c;  // [rows, 1] 2^-e for a row stored as x * 2^-e (cosine), else 1
  at::Tensor tags;             // [N] int32
  at::Tensor inv_tau;          // 0-d, compute dtype, on the device
};

// The robustness rules of scan_rows (docs/csrc.md, "Non-finite and extreme rows") with tensor
// ops (no host sync). Returns (rows as stored, inv, norm or undefined, unscale or undefined).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> robust_rows(at::Tensor x, const at::Tensor& tags,
                                                                      bool cosine, double eps, at::ScalarType st) {
  if (tags.defined()) x = at::where(tags.eq(-2).unsqueeze(1), at::zeros({}, x.options()), x);
  const at::Tensor m = x.abs().amax({1}).to(st);
  const at::Tensor finite = at::isfinite(m);
  const at::Tensor nan = at::full({}, std::numeric_limits<double>::quiet_NaN(), m.options());
  if (!cosine) return {x, at::where(finite, at::ones_like(m), nan), at::Tensor(), at::Tensor()};
  const at::Tensor big = finite.logical_and(m.gt(std::ldexp(1.0, 40)));
  const at::Tensor expo = at::where(big, std::get<1>(at::frexp(m)), at::zeros_like(m, m.options().dtype(at::kInt)));
  const at::Tensor unscale = at::ldexp(at::ones_like(m), expo.neg()).unsqueeze(1);  // 2^-e (1 for most rows)
  x = (x.to(st) * unscale).to(x.scalar_type());  // exact: a power of two
  const at::Tensor norm = at::linalg_vector_norm(x, 2, {1}, false, st);
  const at::Tensor inv = at::where(finite, norm.clamp_min(eps).reciprocal(), nan);
  return {x, inv, norm, unscale};
}

Prepared prepare(const at::Tensor& anchor, const at::Tensor& block0, const at::Tensor& block1,
                 const at::Tensor& tags0, const at::Tensor& tags1, const at::Tensor& tau, bool cosine, double eps,
                 at::ScalarType st, bool copy_inputs = true) {
  Prepared p{anchor.size(0), block0.size(0), block0.size(0) + block1.size(0), anchor.size(1)};
  p.tags = at::cat({tags0, tags1}).contiguous();
  std::tie(p.a, p.inv_a, p.norm_a, p.unscale_a) = robust_rows(anchor.contiguous(), at::Tensor(), cosine, eps, st);
  std::tie(p.c, p.inv_c, p.norm_c, p.unscale_c) =
      robust_rows(at::cat({block0, block1}).contiguous(), p.tags, cosine, eps, st);
  p.a = (copy_inputs ? p.a.to(st) : p.a).contiguous();
  p.c = (copy_inputs ? p.c.to(st) : p.c).contiguous();
  p.inv_a = p.inv_a.contiguous();
  p.inv_c = p.inv_c.contiguous();
  p.inv_tau = tau.reshape({}).to(st).reciprocal();
  return p;
}

template <typename T>
RowArgs<T> row_args(const Prepared& p, int mode) {
  // r0, R and s are set per block by sweep()
  return {mode, 0, 0, p.N, nullptr, p.inv_a.data_ptr<T>(), p.inv_c.data_ptr<T>(), p.tags.data_ptr<int32_t>(),
          p.inv_tau.data_ptr<T>()};
}

// The block loop; d_a / d_c (undefined for forward) receive the gradients against the raw
// rows (normalisation backward included).
template <typename T>
void sweep(const Prepared& p, RowArgs<T> args, const at::Tensor& d_a, const at::Tensor& d_c, bool cosine,
           double eps) {
  const bool grad = args.mode != kForward;
  auto stream = c10::cuda::getCurrentCUDAStream();
  if (grad) d_c.zero_();
  if (p.B == 0) return;
  const int64_t R = rows_per_block(p.B, p.N);
  at::Tensor buf = at::empty({R, p.N}, p.a.options());
  for (int64_t r0 = 0; r0 < p.B; r0 += R) {
    const int64_t rows = std::min(R, p.B - r0);
    at::Tensor s = buf.narrow(0, 0, rows);
    const at::Tensor a_blk = p.a.narrow(0, r0, rows);
    if (p.N) at::mm_out(s, a_blk, p.c.t());
    args.r0 = r0;
    args.R = rows;
    args.s = s.data_ptr<T>();
    check_launch(launch_rows<T>(args, stream), "rows");
    if (!grad) continue;
    at::Tensor e_a = d_a.narrow(0, r0, rows);
    if (p.N) at::mm_out(e_a, s, p.c);
    else e_a.zero_();
    if (p.N) d_c.addmm_(s.t(), a_blk);
  }
  if (!grad || !cosine) return;
  // a row stored as x * 2^-e (scale): its gradient w.r.t. x is 2^-e times the stored row's
  auto unnormalize = [&](const at::Tensor& e, const at::Tensor& x, const at::Tensor& norm, const at::Tensor& scale) {
    check_launch(launch_normalize_backward<T>(e.data_ptr<T>(), x.data_ptr<T>(), norm.data_ptr<T>(), x.size(0), p.d,
                                              eps, stream),
                 "normalize_backward");
    e.mul_(scale);
  };
  unnormalize(d_a, p.a, p.norm_a, p.unscale_a);
  unnormalize(d_c, p.c, p.norm_c, p.unscale_c);
}

// d_c into the two blocks' outputs, padded rows exactly 0 (the contract): their weights are 0,
// but a NaN/Inf anchor row or row factor makes them 0 * NaN = NaN in the GEMMs. One pass, as
// the copy it replaces; testing first whether it is needed would cost a host sync.
void store_candidate_grads(const Prepared& p, const at::Tensor& d_c, at::Tensor d_block0, at::Tensor d_block1) {
  const at::Tensor keep = p.tags.ne(-2).unsqueeze(1), zero = at::zeros({}, d_c.options());
  at::where_out(d_block0, keep.narrow(0, 0, p.N0), d_c.narrow(0, 0, p.N0), zero);
  at::where_out(d_block1, keep.narrow(0, p.N0, p.N - p.N0), d_c.narrow(0, p.N0, p.N - p.N0), zero);
}

void lse_forward(const at::Tensor& anchor, const at::Tensor& block0, const at::Tensor& block1,
                 const at::Tensor& tags0, const at::Tensor& tags1, const at::Tensor& tau, bool cosine, double eps,
                 const at::Tensor& lse, const at::Tensor& mean_logit) {
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  check_forward(anchor, block0, block1, tags0, tags1, tau, lse, mean_logit, kDev);
  c10::cuda::CUDAGuard guard(anchor.device());
  const auto cd = compute_dtype(anchor);
  const auto dt = anchor.scalar_type();
  if (dt == at::kHalf || dt == at::kBFloat16) {  // tensor cores on the 16-bit inputs
    const Prepared p = prepare(anchor, block0, block1, tags0, tags1, tau, cosine, eps, at::kFloat, false);
    check_launch(launch_forward_tc(dt == at::kHalf ? 0 : 1, p.a.data_ptr(), p.c.data_ptr(), p.B, p.N, p.d,
                                   p.inv_a.data_ptr<float>(), p.inv_c.data_ptr<float>(), p.tags.data_ptr<int32_t>(),
                                   p.inv_tau.data_ptr<float>(), lse.data_ptr<float>(), mean_logit.data_ptr<float>(),
                                   c10::cuda::getCurrentCUDAStream()),
                 "forward_tc");
    return;
  }
  dispatch_compute(cd, [&](auto zero) {
    using T = decltype(zero);
    const Prepared p = prepare(anchor, block0, block1, tags0, tags1, tau, cosine, eps, cd);
    RowArgs<T> args = row_args<T>(p, kForward);
    args.lse = lse.data_ptr<T>();
    args.mean_logit = mean_logit.data_ptr<T>();
    sweep<T>(p, args, at::Tensor(), at::Tensor(), cosine, eps);
  });
}

void lse_backward(const at::Tensor& anchor, const at::Tensor& block0, const at::Tensor& block1,
                  const at::Tensor& tags0, const at::Tensor& tags1, const at::Tensor& tau, bool cosine, double eps,
                  const at::Tensor& lse, const at::Tensor& grad_lse, const std::optional<at::Tensor>& d_pos,
                  int64_t pos_offset, const at::Tensor& d_anchor, const at::Tensor& d_block0,
                  const at::Tensor& d_block1) {
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  const int64_t P = check_backward(anchor, block0, block1, tags0, tags1, tau, lse, grad_lse, d_pos, pos_offset,
                                   d_anchor, d_block0, d_block1, kDev);
  c10::cuda::CUDAGuard guard(anchor.device());
  const auto cd = compute_dtype(anchor);
  const int64_t d = anchor.size(1);
  dispatch_compute(cd, [&](auto zero) {
    using T = decltype(zero);
    const Prepared p = prepare(anchor, block0, block1, tags0, tags1, tau, cosine, eps, cd);
    const at::Tensor lse_c = lse.to(cd).contiguous(), g_c = grad_lse.to(cd).contiguous();
    const at::Tensor dpos_c = d_pos ? d_pos->to(cd).contiguous() : at::Tensor();
    RowArgs<T> args = row_args<T>(p, kBackward);
    args.lse_in = lse_c.data_ptr<T>();
    args.grad_lse = g_c.data_ptr<T>();
    if (d_pos) args.fold = {dpos_c.data_ptr<T>(), pos_offset, P};
    at::Tensor d_c = at::empty({p.N, d}, p.a.options());
    sweep<T>(p, args, d_anchor, d_c, cosine, eps);
    store_candidate_grads(p, d_c, d_block0, d_block1);
  });
}

void lse_fused(const at::Tensor& anchor, const at::Tensor& block0, const at::Tensor& block1,
               const at::Tensor& tags0, const at::Tensor& tags1, const at::Tensor& tau, bool cosine, double eps,
               std::string_view head, const at::Tensor& pos_logits, const std::optional<at::Tensor>& pos_mask,
               const std::optional<at::Tensor>& log_extra, const at::Tensor& weights, int64_t pos_offset,
               bool fold_positives, bool own_logits, const at::Tensor& lse, const at::Tensor& mean_logit,
               const at::Tensor& loss_rows, const at::Tensor& d_pos, const at::Tensor& d_anchor,
               const at::Tensor& d_block0, const at::Tensor& d_block1, const at::Tensor& g_dot_mean_logit) {
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  TORCH_CHECK(!own_logits, "fastcl: the CUDA lse_fused reads the own-positive logits from pos_logits; it does "
              "not form them (own_logits=True is CPU only)");
  const int64_t P = check_fused(anchor, block0, block1, tags0, tags1, tau, head, pos_logits, pos_mask, log_extra,
                                weights, pos_offset, fold_positives, own_logits, lse, mean_logit, loss_rows, d_pos,
                                d_anchor, d_block0, d_block1, g_dot_mean_logit, kDev);
  c10::cuda::CUDAGuard guard(anchor.device());
  const auto cd = compute_dtype(anchor);
  const int64_t B = anchor.size(0), d = anchor.size(1);
  dispatch_compute(cd, [&](auto zero) {
    using T = decltype(zero);
    const Prepared p = prepare(anchor, block0, block1, tags0, tags1, tau, cosine, eps, cd);
    const HeadTensors ht(pos_logits, pos_mask, log_extra, weights, cd);
    at::Tensor g_rows = at::empty({B}, p.a.options());
    RowArgs<T> args = row_args<T>(p, kFused);
    args.lse = lse.data_ptr<T>();
    args.mean_logit = mean_logit.data_ptr<T>();
    args.g_rows = g_rows.data_ptr<T>();
    args.head = ht.head<T>(head, loss_rows, d_pos);
    if (fold_positives) args.fold = {d_pos.data_ptr<T>(), pos_offset, P};
    at::Tensor d_c = at::empty({p.N, d}, p.a.options());
    sweep<T>(p, args, d_anchor, d_c, cosine, eps);
    store_candidate_grads(p, d_c, d_block0, d_block1);
    g_dot_mean_logit.copy_(at::dot(g_rows, mean_logit));  // on the device, no sync
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(fastcl, CUDA, m) {
  m.impl("lse_forward", &lse_forward);
  m.impl("lse_backward", &lse_backward);
  m.impl("lse_fused", &lse_fused);
}

}  // namespace fastcl::cuda

// Argument checks shared by the CPU (cpu/lse_cpu.cpp) and CUDA (cuda/lse_cuda.cpp) ops:
// every op validates shapes, dtypes and devices before any compute.
#pragma once

#include <ATen/ATen.h>

namespace fastcl {

inline const char* device_name(c10::DeviceType dev) { return dev == c10::DeviceType::CPU ? "CPU" : "CUDA"; }

inline void check_inputs(const at::Tensor& anchor, const at::Tensor& block0, const at::Tensor& block1,
                         const at::Tensor& tags0, const at::Tensor& tags1, const at::Tensor& tau,
                         c10::DeviceType dev) {
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
  TORCH_CHECK(tags0.dim() == 1 && tags0.size(0) == block0.size(0) && tags1.dim() == 1 &&
                  tags1.size(0) == block1.size(0),
              "fastcl: tags0/tags1 must have one entry per row of block0/block1");
  TORCH_CHECK(tau.numel() == 1, "fastcl: tau must be a 0-d tensor");
  for (const at::Tensor* t : {&anchor, &block0, &block1, &tags0, &tags1, &tau}) {
    TORCH_CHECK(t->device().type() == dev && t->device() == anchor.device(), "fastcl: the ", device_name(dev),
                " kernels take ", device_name(dev), " tensors on one device");
  }
}

// Own positives pos_offset + i * P + k, i < B, k < P, must be rows of block 0.
inline void check_positives(int64_t offset, int64_t P, int64_t B, int64_t N0) {
  TORCH_CHECK(offset >= 0 && offset + B * P <= N0, "fastcl: own positives at rows ", offset, " + i * ", P,
              " (B = ", B, ") do not fit in block0 of ", N0, " rows");
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

inline void check_out(const at::Tensor& t, const char* name, at::IntArrayRef shape, at::ScalarType dtype,
                      c10::DeviceType dev) {
  TORCH_CHECK(t.sizes() == shape, "fastcl: output ", name, " must have shape ", shape, ", got ", t.sizes());
  TORCH_CHECK(t.scalar_type() == dtype, "fastcl: output ", name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous() && t.device().type() == dev, "fastcl: output ", name, " must be a contiguous ",
              device_name(dev), " tensor");
}

}  // namespace fastcl

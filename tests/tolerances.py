"""One table of tolerances for comparing a backend with the float64 reference.

Errors are relative Frobenius errors ``|got - ref| / |ref|`` against the reference run in
float64 on the *same* (already rounded) inputs. For bf16/fp16 the bound is the larger of
the floor below and twice the error of eager PyTorch computing the reference in that
dtype (flash-attention's rule): a fused kernel may not be worse than what users have.
NaN or inf never passes.
"""

from __future__ import annotations

import torch

FLOOR = {
    torch.float64: 1e-9,
    torch.float32: 3e-5,
    torch.float16: 5e-3,
    torch.bfloat16: 3e-2,
}


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.detach().double(), ref.detach().double()
    if not torch.isfinite(got).all():
        return float("inf")
    scale = ref.norm().item()
    diff = (got - ref).norm().item()
    return diff / scale if scale > 0 else diff


def bound(dtype: torch.dtype, eager_lowp: torch.Tensor | None = None, ref: torch.Tensor | None = None) -> float:
    floor = FLOOR[dtype]
    if eager_lowp is None or ref is None or dtype in (torch.float32, torch.float64):
        return floor
    return max(floor, 2.0 * rel_err(eager_lowp, ref))


def assert_close(name: str, got, ref, dtype: torch.dtype, eager_lowp=None) -> None:
    assert got is not None, f"{name}: no value (gradient missing?)"
    assert tuple(got.shape) == tuple(ref.shape), f"{name}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    err = rel_err(got, ref)
    b = bound(dtype, eager_lowp, ref)
    assert err <= b, f"{name}: relative error {err:.3e} > {b:.3e} ({dtype})"

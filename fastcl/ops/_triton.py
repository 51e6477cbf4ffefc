"""The ``"triton"`` backend: fastcl's Triton kernels (``fastcl.kernels``) behind the op contract.

Runs CUDA tensors on sm_80+ GPUs (A100, H100 and newer), or CPU tensors when the Triton
interpreter is on (``TRITON_INTERPRET=1`` set before ``fastcl.kernels`` is imported;
tests only: it is slow). Compiled Triton is never chosen for CPU tensors: it cannot run
there.

Strategy: forward keeps only ``lse`` and backward recomputes logit tiles (no ``fused``
method, so ``ContrastiveLSE`` always recomputes). Own positives are folded
(``folds_positives``): ``d_pos`` joins the recomputed float32 dS tile, so the positives'
large gradient and the softmax's nearly equal one cancel before anything is rounded. Gradient-in-forward would save one of
four GEMM passes but must keep an fp32 ``[N, d]`` accumulator for ``d candidates``
across row blocks (126 MB at N = 40960, d = 768: over the 64 MB budget) and hold both
gradients from forward to backward; see docs/triton.md.
"""

from __future__ import annotations

import importlib
import os

import torch
from torch import Tensor

from .contract import LSEProblem

_SUPPORTED = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _kernels():
    """Import ``fastcl.kernels`` lazily (importing fastcl must not import triton)."""
    return importlib.import_module("fastcl.kernels")


def _interpreting() -> bool:
    return _kernels().INTERPRET


def _device_reasons(tensors: list[Tensor]) -> list[str]:
    device = tensors[0].device
    reasons = []
    if any(t.device != device for t in tensors):
        reasons.append("inputs are on different devices")
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if major < 8:
            reasons.append(f"the Triton kernels need sm_80 or newer (bf16 tensor cores); got sm_{major}{minor}")
    elif not (device.type == "cpu" and _interpreting()):
        reasons.append(
            f"{device.type} tensors: compiled Triton runs on CUDA only (CPU tensors need TRITON_INTERPRET=1 "
            "set before fastcl.kernels is imported; tests only)"
        )
    return reasons


def _dtype_reasons(dtype: torch.dtype) -> list[str]:
    if dtype not in _SUPPORTED:
        return [f"dtype {dtype} is not supported (float16, bfloat16, float32, float64)"]
    return []


DS_ENV = "FASTCL_TRITON_DS"
DS_PRECISIONS = ("fp32", "input")


def ds_precision() -> str:
    """How the backward keeps the recomputed softmax gradient dS of 16-bit inputs.

    ``fp32`` (default): float32, fed to tensor cores as two 16-bit halves: fp32-accurate
    gradients (like the ``torch`` backend), two MMAs per backward product. ``input``:
    rounded to the input dtype, one MMA (flash-attention's choice): faster, but a
    gradient that is a small difference of large terms (a confident positive, p ~ 1)
    carries rounding noise of the terms' size. ``FASTCL_TRITON_DS`` selects.
    """
    mode = os.environ.get(DS_ENV, "fp32") or "fp32"
    if mode not in DS_PRECISIONS:
        raise ValueError(f"{DS_ENV}={mode!r}; expected one of {DS_PRECISIONS}")
    return mode


class TritonLSE:
    """Masked LSE primitive on Triton kernels (see ``kernels/lse_fwd.py``, ``kernels/lse_bwd.py``)."""

    name = "triton"
    autograd = False
    folds_positives = True  # backward adds d_pos to the float32 dS tile (contract.py)

    def unsupported(self, problem: LSEProblem) -> list[str]:
        tensors = [problem.anchor, *problem.blocks, *problem.tags]
        reasons = _device_reasons(tensors) + _dtype_reasons(problem.dtype)
        if any(b.dtype != problem.dtype for b in problem.blocks):
            reasons.append("candidate blocks must have the anchor's dtype")
        if any(t.dtype != torch.int32 for t in problem.tags):
            reasons.append("tags must be int32")
        reasons += _kernels().size_reasons(*problem.anchor.shape)
        return reasons

    def forward(self, problem: LSEProblem, tau: Tensor) -> tuple[Tensor, Tensor]:
        k = _kernels()
        (b0, b1), (t0, t1) = problem.blocks, problem.tags
        return k.lse_forward(problem.anchor, b0, b1, t0, t1, tau, problem.cosine, problem.eps)

    def backward(self, problem: LSEProblem, tau: Tensor, lse: Tensor, g: Tensor, d_pos: Tensor | None = None):
        """``d_pos [B, P]``: own-positive logit gradient, folded when ``problem.positives`` is set."""
        k = _kernels()
        (b0, b1), (t0, t1) = problem.blocks, problem.tags
        pos = problem.positives
        if pos is None or d_pos is None:
            d_pos, offset = None, 0
        else:
            if tuple(d_pos.shape) != (problem.num_anchors, pos.count):
                raise ValueError(f"d_pos has shape {tuple(d_pos.shape)}; expected {(problem.num_anchors, pos.count)}")
            offset = pos.offset
        d_anchor, d_b0, d_b1 = k.lse_backward(problem.anchor, b0, b1, t0, t1, tau, lse, g, d_pos, offset,
                                              problem.cosine, problem.eps, ds_precision() == "fp32")
        return d_anchor, (d_b0, d_b1)


class TritonGroupedCosine:
    """GCLSR grouped cosine on one fused normalise-and-dot kernel (``fastcl/kernels/grouped_cosine.py``)."""

    name = "triton"
    autograd = False

    def unsupported(self, h: Tensor, z: Tensor, group_size: int) -> list[str]:
        reasons = _device_reasons([h, z]) + _dtype_reasons(h.dtype)
        if z.dtype != h.dtype:
            reasons.append("h and z must have the same dtype")
        return reasons

    def forward(self, h: Tensor, z: Tensor, group_size: int, eps: float) -> Tensor:
        return _kernels().grouped_cosine_forward(h, z, group_size, eps)

    def backward(self, h: Tensor, z: Tensor, group_size: int, eps: float, d_cos: Tensor) -> Tensor:
        return _kernels().grouped_cosine_backward(h, z, group_size, eps, d_cos)


OPS = {"lse": TritonLSE(), "grouped_cosine": TritonGroupedCosine()}


def unavailable() -> str | None:
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        return f"triton is not installed ({exc}); pip install 'fastcl[triton]'"
    try:
        _kernels()
    except Exception as exc:  # a broken triton install must not break dispatch
        return f"cannot import fastcl.kernels: {type(exc).__name__}: {exc}"
    if not torch.cuda.is_available() and not _interpreting():
        return "no CUDA device (set TRITON_INTERPRET=1 to run the kernels in the Triton interpreter, tests only)"
    return None

"""The ``"triton"`` backend: fastcl's Triton kernels (``fastcl.kernels``) behind the op contract.

Runs CUDA tensors on sm_80+ GPUs, or CPU tensors when the Triton interpreter is on
(``TRITON_INTERPRET=1`` before ``fastcl.kernels`` is imported; tests only). Forward keeps
``lse`` and backward recomputes logit tiles, folding ``d_pos`` into the float32 dS tile;
there is no gradient-in-forward (``fused``): why, in docs/triton.md.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from .backend import input_reasons
from .contract import LSEProblem


def _kernels():
    """``fastcl.kernels``, imported on first use (importing fastcl must not import triton).

    An import statement, not importlib: torch.compile traces it."""
    import fastcl.kernels

    return fastcl.kernels


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
    """The ``"triton"`` backend (``fastcl.ops.backend.Backend``) on ``kernels/lse_fwd.py`` and ``kernels/lse_bwd.py``."""

    name = "triton"
    double_backward = False
    fused = None

    def unavailable(self) -> str | None:
        try:
            import triton  # noqa: F401
        except ImportError as exc:
            return f"triton is not installed ({exc}); pip install 'fastcl[triton]'"
        try:
            _kernels()
        except Exception as exc:  # a broken triton install must not break dispatch
            return f"cannot import fastcl.kernels: {type(exc).__name__}: {exc}"
        if not torch.cuda.is_available() and not _kernels().INTERPRET:
            return "no CUDA device (set TRITON_INTERPRET=1 to run the kernels in the Triton interpreter, tests only)"
        return None

    def unsupported(self, problem: LSEProblem) -> list[str]:
        # compiled Triton runs on CUDA only; the interpreter (tests) runs CPU tensors
        device_type = "cpu" if _kernels().INTERPRET else "cuda"
        why = input_reasons(problem, backend=self.name, device_type=device_type, takes_dims=True)
        why += _kernels().prefix_reasons(problem.dims)
        if not why and problem.device.type == "cuda":
            major, minor = torch.cuda.get_device_capability(problem.device)
            if major < 8:
                why.append(f"the Triton kernels need sm_80 or newer (bf16 tensor cores); got sm_{major}{minor}")
        return why + _kernels().size_reasons(*problem.anchor.shape)

    def forward(self, problem: LSEProblem, tau: Tensor) -> tuple[Tensor, Tensor]:
        k = _kernels()
        (b0, b1), (t0, t1) = problem.blocks, problem.tags
        if problem.dims is not None:  # [K, B]: every prefix from one pass over d
            return k.lse_forward_prefixes(
                problem.anchor, b0, b1, t0, t1, tau, list(problem.dims), problem.cosine, problem.eps
            )
        return k.lse_forward(problem.anchor, b0, b1, t0, t1, tau, problem.cosine, problem.eps)

    def backward(self, problem: LSEProblem, tau: Tensor, lse: Tensor, g: Tensor, d_pos: Tensor | None = None):
        """``d_pos [B, P]``: own-positive logit gradient, folded when ``problem.positives`` is set."""
        k = _kernels()
        (b0, b1), (t0, t1) = problem.blocks, problem.tags
        pos = problem.positives
        if pos is None or d_pos is None:
            d_pos, offset = None, 0
        else:
            want = (problem.num_anchors, pos.count)
            want = want if problem.dims is None else (problem.num_prefixes, *want)
            if tuple(d_pos.shape) != want:
                raise ValueError(f"d_pos has shape {tuple(d_pos.shape)}; expected {want}")
            offset = pos.offset
        inputs = (problem.anchor, b0, b1, t0, t1, tau, lse, g, d_pos, offset)
        if problem.dims is not None:
            d_anchor, d_b0, d_b1 = k.lse_backward_prefixes(*inputs, list(problem.dims), problem.cosine, problem.eps)
            return d_anchor, (d_b0, d_b1)
        d_anchor, d_b0, d_b1 = k.lse_backward(*inputs, problem.cosine, problem.eps, ds_precision() == "fp32")
        return d_anchor, (d_b0, d_b1)


BACKEND = TritonLSE()

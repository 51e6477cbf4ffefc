"""The ``"cpp"`` backend: fused C++ CPU kernels of the masked-LSE primitive.

Op schemas in ``csrc/registration.cpp``, kernels in ``csrc/cpu/lse_cpu.cpp``; the op
conventions and design notes are in docs/csrc.md. Built with ninja the first time the backend is asked whether it
is available (``fastcl.ops._build``); importing this module compiles nothing. Outputs are
allocated here with ``new_output`` in the compute dtype and the kernels overwrite them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._build import Extension, cpu_capability_flags
from .backend import input_reasons
from .contract import FusedResult, LSEProblem, compute_dtype, new_output
from .head import HeadInputs

_capability, _vec_flags = cpu_capability_flags()
EXTENSION = Extension(
    name="fastcl_cpp",
    sources=["registration.cpp", "cpu/lse_cpu.cpp"],
    # no FMA contraction: the normalisation backward relies on exact cancellation
    # (x_hat <x_hat, d_hat> == d_hat for d = 1), as in fastcl/ops/normalize.py
    cflags=["-O3", "-ffp-contract=off", "-fopenmp", *_vec_flags],
    ldflags=["-fopenmp"],
    describe=f"C++ CPU ({_capability})",
)
_fakes_registered = False


def _register_fakes() -> None:
    """Shape-only implementations so the ops trace under FakeTensor / torch.compile."""
    global _fakes_registered
    if _fakes_registered:
        return
    _fakes_registered = True
    for op in ("lse_forward", "lse_backward", "lse_fused", "lse_prefix_forward", "lse_prefix_backward"):
        torch.library.register_fake(f"fastcl::{op}")(lambda *args, **kwargs: None)


def _ops():
    return torch.ops.fastcl


def _args(problem: LSEProblem, tau: Tensor) -> tuple:
    return (problem.anchor, *problem.blocks, *problem.tags, tau, problem.cosine, float(problem.eps))


def _prefix_order(problem: LSEProblem) -> list[int]:
    """The prefixes by increasing length (the prefix ops take them so): ``order[j]`` is the
    caller's index of the ``j``-th shortest."""
    return sorted(range(problem.num_prefixes), key=lambda k: problem.dims[k])


class CppLSE:
    """The ``"cpp"`` backend of the masked-LSE primitive (``fastcl.ops.backend.Backend``)."""

    name = "cpp"
    device_type = "cpu"
    double_backward = False

    def unavailable(self) -> str | None:
        """Why the C++ library cannot run here (builds it on the first call), or None."""
        why = EXTENSION.error()
        if why is None:
            _register_fakes()
        return why

    def unsupported(self, problem: LSEProblem) -> list[str]:
        return input_reasons(problem, backend=self.name, device_type=self.device_type, takes_dims=True)

    def forward(self, problem: LSEProblem, tau: Tensor) -> tuple[Tensor, Tensor]:
        """``(lse [B], mean_logit [B])`` in the compute dtype; ``[K, B]`` with ``problem.dims``."""
        cd, B = compute_dtype(problem.dtype), problem.num_anchors
        shape = B if problem.dims is None else (problem.num_prefixes, B)
        lse = new_output(shape, dtype=cd, device=problem.device)
        mean_logit = new_output(shape, dtype=cd, device=problem.device)
        if problem.dims is None:
            _ops().lse_forward(*_args(problem, tau), lse=lse, mean_logit=mean_logit)
            return lse, mean_logit
        order = _prefix_order(problem)  # one sweep over d takes the prefixes shortest first
        dims = [problem.dims[k] for k in order]
        _ops().lse_prefix_forward(*_args(problem, tau), dims, lse=lse, mean_logit=mean_logit)
        back = sorted(range(len(order)), key=order.__getitem__)  # row k: the caller's prefix k
        return (lse, mean_logit) if back == list(range(len(order))) else (lse[back], mean_logit[back])

    def backward(self, problem: LSEProblem, tau: Tensor, lse: Tensor, g: Tensor, d_pos: Tensor | None = None):
        """Recomputes the logits; folds ``d_pos`` when ``problem.positives`` is set."""
        cd = compute_dtype(problem.dtype)
        d_anchor, d0, d1 = (
            new_output(t.shape, dtype=cd, device=problem.device) for t in (problem.anchor, *problem.blocks)
        )
        fold = d_pos is not None and problem.positives is not None
        offset = problem.positives.offset if fold else 0
        op, dims = _ops().lse_backward, ()
        if problem.dims is not None:  # the prefixes shortest first, as lse_prefix_backward takes them
            order = _prefix_order(problem)
            lse, g, d_pos = lse[order], g[order], d_pos[order] if fold else None
            op, dims = _ops().lse_prefix_backward, ([problem.dims[k] for k in order],)
        out = dict(d_anchor=d_anchor, d_block0=d0, d_block1=d1)
        op(*_args(problem, tau), *dims, lse.to(cd), g.to(cd), d_pos.to(cd) if fold else None, offset, **out)
        return d_anchor, (d0, d1)

    def fused(self, problem: LSEProblem, tau: Tensor, head: HeadInputs) -> FusedResult:
        if problem.dims is not None:  # the contract has no fused Matryoshka step
            raise ValueError(f"fastcl: the {self.name} backend's fused step does not take matryoshka dims")
        cd, B, dev = compute_dtype(problem.dtype), problem.num_anchors, problem.device
        out = FusedResult(new_output(B, dtype=cd, device=dev), new_output(B, dtype=cd, device=dev))
        out.loss_rows = new_output(B, dtype=cd, device=dev)
        out.d_pos = new_output(head.pos_logits.shape, dtype=cd, device=dev)
        out.d_anchor = new_output(problem.anchor.shape, dtype=cd, device=dev)
        out.d_blocks = tuple(new_output(b.shape, dtype=cd, device=dev) for b in problem.blocks)
        out.g_dot_mean_logit = new_output((), dtype=cd, device=dev)
        _ops().lse_fused(
            *_args(problem, tau),
            head.kind,
            head.pos_logits.to(cd),
            head.pos_mask,
            None if head.log_extra is None else head.log_extra.to(cd),
            head.weights.to(cd),
            0 if problem.positives is None else problem.positives.offset,
            problem.positives is not None,
            lse=out.lse,
            mean_logit=out.mean_logit,
            loss_rows=out.loss_rows,
            d_pos=out.d_pos,
            d_anchor=out.d_anchor,
            d_block0=out.d_blocks[0],
            d_block1=out.d_blocks[1],
            g_dot_mean_logit=out.g_dot_mean_logit,
        )
        return out


BACKEND = CppLSE()

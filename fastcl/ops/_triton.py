"""The ``"triton"`` backend: fastcl's Triton kernels (``fastcl.kernels``) behind the op contract.

CUDA tensors on sm_80+, or CPU tensors under ``TRITON_INTERPRET=1`` (tests only). Recompute
strategy only, no ``fused``; the losses run the *head step* (forward and backward with the
loss head fused into the kernels, :class:`TritonHeadStep`), other callers the primitive
(``forward``/``backward``). Why, and the launch plan: docs/triton.md.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import config
from .backend import Backend, HeadSaved, HeadStep, input_reasons
from .contract import LSEProblem
from .head import HEADS, HeadInputs


def _kernels():
    """``fastcl.kernels``, imported on first use (importing fastcl must not import triton).

    An import statement, not importlib: torch.compile traces it."""
    import fastcl.kernels

    return fastcl.kernels


DS_PRECISIONS = config.TRITON_DS


def ds_precision() -> str:
    """``fastcl.config``'s ``triton.ds`` (``FASTCL_TRITON_DS``; ``config.override(triton={"ds":
    ...})`` for a block of code): how the backward keeps the recomputed softmax gradient dS of
    bf16 inputs: ``fp32`` (fp32-accurate, two MMAs per product), ``input`` (rounded to bf16, one
    MMA) or ``auto`` (default: ``input``); fp16 always keeps fp32 (docs/triton.md)."""
    return config.get().triton.ds


def fp32_ds(dtype: torch.dtype) -> bool:
    """Whether the backward keeps dS in fp32 for ``dtype`` inputs. ``auto`` and ``input``: bf16
    rounds dS to bf16 (an H100's backward GEMMs ran 2.5x faster, gradients stay within ~2.5x of
    bf16's own rounding, measured in the interpreter); fp16 always keeps fp32 (dS ~ 1 / (B N
    tau) is subnormal in fp16 at large batches)."""
    mode = ds_precision()
    return mode == "fp32" or dtype != torch.bfloat16


def _extensions(problem: LSEProblem, own: bool = False):
    """The problem's extensions as the launchers' one record (``kernels/lse.py``'s
    ``Extensions``): its filter and sigmoid reduction and, where an extension (or, ``own``, a
    ``d_pos`` to fold) reads them, its own positives. Plain problems get the empty record, whose
    launches stay as they were."""
    f, sig, pos = problem.filter, problem.sigmoid, problem.positives
    guide = None
    if f is not None and f.guide_anchor is not None and f.guide_blocks is not None:
        guide = (f.guide_anchor, *f.guide_blocks)
    ext = _kernels().Extensions(
        threshold=None if f is None else f.threshold, guide=guide, bias=None if sig is None else sig.bias
    )
    if pos is not None and (own or f is not None or sig is not None):
        ext = ext.with_positives(pos.offset, pos.count)
    return ext


class TritonHeadStep(HeadStep):
    """The loss step with the head fused into the kernels (``backend.HeadStep``): a forward of
    four launches that also returns the reduced loss, and a backward that takes the upstream
    gradient and the reduction weights as device tensors (no PyTorch op between the kernels)."""

    def takes(self, problem: LSEProblem, head: HeadInputs, own_count: int) -> bool:
        """Problems without Matryoshka dims or the sigmoid reduction (a filter is fine) of a known
        head with 1..``MAX_OWN`` positives."""
        plain = problem.dims is None and problem.sigmoid is None
        return plain and head.kind in HEADS and 1 <= own_count <= _kernels().MAX_OWN

    @staticmethod
    def _filter(problem: LSEProblem) -> dict:
        """A filter's keyword arguments: the threshold, the guide, and the own positives it never
        drops (the head ops' ``own_offset``/``own_count``: their ``pos_*`` are the head's)."""
        if problem.filter is None:
            return {}
        kw = _extensions(problem).op_args()
        if "pos_count" in kw:
            kw["own_offset"], kw["own_count"] = kw.pop("pos_offset"), kw.pop("pos_count")
        return kw

    def forward(self, problem: LSEProblem, tau: Tensor, head: HeadInputs, per_row: bool) -> tuple[Tensor, HeadSaved]:
        """``(loss, saved)``: the reduced loss (0-d, input dtype) or the rows ``[B]`` (compute
        dtype, ``per_row``), and what :meth:`backward` needs."""
        (b0, b1), (t0, t1) = problem.blocks, problem.tags
        pos = problem.positives
        if head.pos_logits is None:  # own positives folded from block 0
            if pos is None:
                raise ValueError("the fused head needs own positives (problem.positives) or given pos_logits")
            offset, count = pos.offset, pos.count
        else:
            offset, count = 0, head.pos_logits.shape[1]
        loss, lse, dlse, dpos, w_row, norms = _kernels().head_forward(
            problem.anchor, b0, b1, t0, t1, tau, problem.cosine, problem.eps, head.kind, offset, count,
            head.pos_logits, head.pos_mask, head.log_extra, head.weights, per_row, **self._filter(problem),
        )  # fmt: skip
        return loss, HeadSaved(dpos, w_row, (lse, dlse, norms))

    def backward(
        self, problem: LSEProblem, tau: Tensor, saved: HeadSaved, weights: Tensor, grad_out: Tensor
    ) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """``(d anchor, (d block0, d block1))`` for the upstream ``grad_out`` (0-d or ``[B]``)."""
        dpos, w_row, (lse, dlse, norms) = saved
        (b0, b1), (t0, t1) = problem.blocks, problem.tags
        pos = problem.positives
        d_anchor, d_b0, d_b1 = _kernels().head_backward(
            problem.anchor, b0, b1, t0, t1, tau, norms, lse, dlse, dpos, w_row, weights, grad_out,
            0 if pos is None else pos.offset, pos is not None, problem.cosine, fp32_ds(problem.anchor.dtype), problem.padded,
            **self._filter(problem), **({"eps": problem.eps} if problem.filter is not None else {}),
        )  # fmt: skip
        return d_anchor, (d_b0, d_b1)


class TritonLSE(Backend):
    """The ``"triton"`` backend on ``kernels/`` (launchers: ``kernels/lse.py``)."""

    name = "triton"
    fused = None
    head_step = TritonHeadStep()
    takes_filter = True
    takes_sigmoid = True
    # No column statistics (their per-column partials over row tiles are not in the sweeps):
    # extension_reasons refuses them by name and CLIP runs its two directional calls instead.
    takes_columns = False

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
        f, sig = problem.filter, problem.sigmoid
        if (f is not None and f.threshold.device != problem.device) or (
            sig is not None and sig.bias.device != problem.device
        ):
            why.append(f"the triton backend needs the filter's threshold and the sigmoid's bias on {problem.device}")
        if not why and problem.device.type == "cuda":
            major, minor = torch.cuda.get_device_capability(problem.device)
            if major < 8:
                why.append(f"the Triton kernels need sm_80 or newer (bf16 tensor cores); got sm_{major}{minor}")
        return why + _kernels().size_reasons(*problem.anchor.shape)

    def forward(self, problem: LSEProblem, tau: Tensor) -> tuple[Tensor, Tensor]:
        """``(lse, mean_logit)``, or the sigmoid reduction's ``(value, stats [2, ...])``; ``[K, B]``
        with Matryoshka dims (every prefix from one pass over d)."""
        (b0, b1), (t0, t1) = problem.blocks, problem.tags
        dims = None if problem.dims is None else list(problem.dims)
        return _kernels().lse_forward(
            problem.anchor, b0, b1, t0, t1, tau, problem.cosine, problem.eps, dims, **_extensions(problem).op_args()
        )

    def backward(self, problem: LSEProblem, tau: Tensor, lse: Tensor, g: Tensor, d_pos: Tensor | None = None):
        """``d_pos [B, P]``: own-positive logit gradient, folded when ``problem.positives`` is set
        (the LSE only: the sigmoid's pairs are inside its sum)."""
        (b0, b1), (t0, t1) = problem.blocks, problem.tags
        pos = problem.positives
        d_pos = None if pos is None or problem.sigmoid is not None else d_pos
        if pos is not None and d_pos is not None:
            want: tuple[int, ...] = (problem.num_anchors, pos.count)
            if problem.dims is not None:
                want = (problem.num_prefixes, *want)
            if tuple(d_pos.shape) != want:
                raise ValueError(f"d_pos has shape {tuple(d_pos.shape)}; expected {want}")
        dims = None if problem.dims is None else list(problem.dims)
        ext = _extensions(problem, own=d_pos is not None)
        d_anchor, d_b0, d_b1 = _kernels().lse_backward(
            problem.anchor, b0, b1, t0, t1, tau, lse, g, d_pos, problem.cosine, problem.eps,
            fp32_ds(problem.anchor.dtype), dims, **ext.op_args(),
        )  # fmt: skip
        return d_anchor, (d_b0, d_b1)


BACKEND = TritonLSE()

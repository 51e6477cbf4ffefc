"""The ``"cpp"`` backend: fused C++ CPU kernels (``csrc/``, docs/csrc.md), built with ninja on
the first availability check (``fastcl.ops._build``), never at import; they overwrite outputs
allocated here with ``new_output`` in the compute dtype.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from .. import config
from ._build import Extension, cpu_capability_flags
from .backend import Backend, input_reasons
from .contract import Filter, FusedResult, LSEProblem, compute_dtype, new_output, prefix_order
from .head import SIGMOID_HEAD, HeadInputs

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


@functools.cache
def _register_fakes() -> None:
    """Shape-only implementations so the ops trace under FakeTensor / torch.compile."""
    for op in (
        "lse_forward",
        "lse_backward",
        "lse_fused",
        "lse_prefix_forward",
        "lse_prefix_backward",
        "lse_prefix_fused",
    ):
        torch.library.register_fake(f"fastcl::{op}")(lambda *args, **kwargs: None)


def _push_config(cfg: config.Config) -> None:
    cpp = cfg.cpp
    keep = -1 if cpp.test_keep_bytes is None else cpp.test_keep_bytes
    try:
        torch.ops.fastcl.set_cpu_options(cpp.tile or 0, cpp.gemm, cpp.test_rows or 0, cpp.test_chunk or 0, keep)
    except RuntimeError as exc:  # the library refuses a knob ("own" GEMM without AVX-512)
        raise config.ConfigError(str(exc).splitlines()[0]) from exc


@functools.cache
def _follow_config() -> None:
    """Hand ``fastcl.config``'s ``cpp`` knobs to the loaded library, now and on every change."""
    config.on_change(_push_config)


def _args(problem: LSEProblem, tau: Tensor) -> tuple:
    return (problem.anchor, *problem.blocks, *problem.tags, tau, problem.cosine, float(problem.eps))


def _extensions(problem: LSEProblem, order: list[int] | None) -> dict:
    """The ops' trailing group of extension arguments (registration.cpp): the own positives'
    count (their layout for the sigmoid's pairs and the filter's exemption), the sigmoid's bias,
    the filter's threshold (a ``[K, B]`` one in the op's prefix ``order``) and guide embeddings,
    and the column statistics' flag."""
    cd = compute_dtype(problem.dtype)
    ext: dict = {"pos_count": 0 if problem.positives is None else problem.positives.count}
    if problem.sigmoid is not None:
        ext["bias"] = problem.sigmoid.bias.to(cd)
    if problem.columns:  # lse_forward and lse_backward only (no Matryoshka or fused column statistics)
        ext["columns"] = True
    f = problem.filter
    if f is not None:
        thr = f.threshold.to(cd)
        ext["threshold"] = thr[order] if thr.dim() == 2 and order is not None else thr
        if f.guide_anchor is not None and f.guide_blocks is not None:
            ext.update(guide_anchor=f.guide_anchor, guide_block0=f.guide_blocks[0], guide_block1=f.guide_blocks[1])
    return ext


def _one_block(pair: tuple[Tensor, Tensor]) -> Tensor:
    """Two blocks' rows as one tensor: the non-empty one itself, else their concatenation."""
    first, second = pair
    return first if second.shape[0] == 0 else second if first.shape[0] == 0 else torch.cat(pair)


def _offset(problem: LSEProblem) -> int:
    return 0 if problem.positives is None else problem.positives.offset


def _out(problem: LSEProblem, shape) -> Tensor:
    """An output the kernel overwrites, in the compute dtype on the problem's device."""
    return new_output(shape, dtype=compute_dtype(problem.dtype), device=problem.device)


class CppLSE(Backend):
    """The ``"cpp"`` backend of the masked-LSE primitive."""

    name = "cpp"
    device_type = "cpu"
    forms_own_logits = True
    fused_takes_dims = True
    takes_filter = True
    takes_sigmoid = True
    takes_columns = True  # without Matryoshka dims (extension_reasons), in forward and backward

    def unavailable(self) -> str | None:
        """Why the C++ library cannot run here (builds it on the first call), or None. A
        configuration the library refuses (``cpp.gemm="own"`` without AVX-512) raises here."""
        why = EXTENSION.error()
        if why is None:
            _register_fakes()
            _follow_config()
        return why

    def unsupported(self, problem: LSEProblem) -> list[str]:
        return input_reasons(problem, backend=self.name, device_type=self.device_type, takes_dims=True)

    def forward(self, problem: LSEProblem, tau: Tensor) -> tuple[Tensor, Tensor]:
        """``(lse [B], mean_logit [B])``; ``[K, B]`` with ``problem.dims``; ``[B + N]`` with
        ``problem.columns``. The sigmoid reduction: ``(value, stats [2, ...])``."""
        rows = (problem.num_rows,) if problem.dims is None else (problem.num_prefixes, problem.num_anchors)
        sigmoid = problem.sigmoid is not None
        lse, mean_logit = _out(problem, rows), _out(problem, ((2,) if sigmoid else ()) + rows)
        out = dict(lse=lse, mean_logit=mean_logit)
        if problem.dims is None:
            ext = _extensions(problem, None)
            torch.ops.fastcl.lse_forward(*_args(problem, tau), _offset(problem), **ext, **out)
            return lse, mean_logit
        order, back = prefix_order(problem.dims)  # the prefix ops take them shortest first
        dims = [problem.dims[k] for k in order]
        ext = _extensions(problem, order)
        torch.ops.fastcl.lse_prefix_forward(*_args(problem, tau), dims, _offset(problem), **ext, **out)
        if back == list(range(len(order))):
            return lse, mean_logit
        return lse[back], (mean_logit[:, back] if sigmoid else mean_logit[back])

    def backward(self, problem: LSEProblem, tau: Tensor, lse: Tensor, g: Tensor, d_pos: Tensor | None = None):
        """Recomputes the logits; folds ``d_pos`` when ``problem.positives`` is set (the LSE)."""
        cd = compute_dtype(problem.dtype)
        d_anchor, d0, d1 = (_out(problem, t.shape) for t in (problem.anchor, *problem.blocks))
        if problem.positives is None or problem.sigmoid is not None:
            d_pos = None  # nothing to fold (the sigmoid's pairs are inside its sum)
        op, dims, order = torch.ops.fastcl.lse_backward, [], None
        if problem.dims is not None:  # the prefixes shortest first, as lse_prefix_backward takes them
            order, _ = prefix_order(problem.dims)
            lse, g, d_pos = lse[order], g[order], None if d_pos is None else d_pos[order]
            op, dims = torch.ops.fastcl.lse_prefix_backward, [[problem.dims[k] for k in order]]
        out = dict(d_anchor=d_anchor, d_block0=d0, d_block1=d1)
        op(
            *_args(problem, tau),
            *dims,
            lse.to(cd),
            g.to(cd),
            None if d_pos is None else d_pos.to(cd),
            _offset(problem),
            **_extensions(problem, order),
            **out,
        )
        return d_anchor, (d0, d1)

    def fused_joint(self, q: LSEProblem, e: LSEProblem, tau: Tensor, head: HeadInputs) -> FusedResult:
        """Joint rows (``fastcl/ops/joint.py``, ``joint.native``) in one sweep: the op's block 0 is
        ``q``'s two blocks side by side, its block 1 ``e``'s first block with ``e``'s anchors
        (``anchor1``). ``d_blocks`` are ``q``'s, ``joint_grads`` ``e``'s."""
        if e.blocks[1].shape[0] or e.positives is not None:
            raise ValueError("fused_joint: the extra problem takes one block and no own positives")
        n0 = q.blocks[0].shape[0]
        both = _one_block  # q's blocks side by side (a copy unless one is empty: GIST passes one block)
        blocks = (both(q.blocks), e.blocks[0])
        tags = (both(q.tags), e.tags[0])
        filt = q.filter
        joint: dict[str, Tensor | None] = {"anchor1": e.anchor}
        if q.filter is not None and q.filter.guide_blocks is not None:
            assert e.filter is not None and e.filter.guide_blocks is not None  # joint.native checked
            guides = (both(q.filter.guide_blocks), e.filter.guide_blocks[0])
            filt = Filter(q.filter.threshold, q.filter.guide_anchor, guides)
            joint["guide_anchor1"] = e.filter.guide_anchor
        problem = LSEProblem(
            q.anchor, blocks, tags, q.cosine, q.eps, q.positives, padded=q.padded or e.padded, filter=filt
        )
        d_anchor1 = _out(problem, e.anchor.shape)
        out = self.fused(problem, tau, head, {**joint, "d_anchor1": d_anchor1})
        assert out.d_blocks is not None
        d_cat, d_e0 = out.d_blocks
        out.d_blocks = (d_cat[:n0], d_cat[n0:])
        out.joint_grads = (d_anchor1, (d_e0, d_e0.new_zeros(e.blocks[1].shape)))
        return out

    def fused(self, problem: LSEProblem, tau: Tensor, head: HeadInputs, joint: dict | None = None) -> FusedResult:
        """One sweep: forward, head and gradients; with ``problem.dims`` every prefix's (rows
        ``[K, B]``, ``d_pos [K, B, P]``; ``head.weights [K, B]``) in the caller's order. The sigmoid
        reduction (``head.kind == "sigmoid"``): ``lse = loss_rows`` = the values, ``mean_logit`` the
        stats ``[2, ...]``, ``d_pos`` empty. ``joint``: the op's joint-row arguments (:meth:`fused_joint`)."""
        cd, B = compute_dtype(problem.dtype), problem.num_anchors
        rows = (B,) if problem.dims is None else (problem.num_prefixes, B)
        order, back = prefix_order(problem.dims) if problem.dims is not None else (None, None)
        sort = (lambda t: t) if order is None else (lambda t: t[order])  # noqa: E731  (the op's order)
        sigmoid = problem.sigmoid is not None
        if sigmoid != (head.kind == SIGMOID_HEAD):
            raise ValueError(f"fused: head {head.kind!r} does not go with this problem's reduction")
        if problem.columns:
            raise ValueError("fused: column statistics take forward and backward (fastcl/ops/symmetric.py)")
        lse, loss_rows = _out(problem, rows), _out(problem, rows)
        mean_logit = _out(problem, ((2,) if sigmoid else ()) + rows)
        d_anchor, g_dot_mean_logit = _out(problem, problem.anchor.shape), _out(problem, ())
        d_blocks = (_out(problem, problem.blocks[0].shape), _out(problem, problem.blocks[1].shape))
        own = head.pos_logits is None and not sigmoid  # the kernel writes the own positives' logits
        fold = problem.positives is not None and not sigmoid
        if sigmoid:
            pos_logits = torch.empty((*rows, 0), dtype=cd, device=problem.device)  # no head logits
        elif head.pos_logits is not None:
            pos_logits = sort(head.pos_logits.to(cd))
        elif problem.positives is not None:
            pos_logits = _out(problem, (*rows, problem.positives.count))
        else:
            raise ValueError("fused: without own positives the head needs pos_logits")
        d_pos = _out(problem, pos_logits.shape)
        op, dims = torch.ops.fastcl.lse_fused, []
        if problem.dims is not None and order is not None:
            op, dims = torch.ops.fastcl.lse_prefix_fused, [[problem.dims[k] for k in order]]
        op(
            *_args(problem, tau),
            *dims,
            head.kind,
            pos_logits,
            head.pos_mask,
            None
            if head.log_extra is None
            else (head.log_extra if head.log_extra.dim() == 1 else sort(head.log_extra)).to(cd),
            sort(head.weights.to(cd)),
            _offset(problem),
            fold,
            own,
            **_extensions(problem, order),
            lse=lse,
            mean_logit=mean_logit,
            loss_rows=loss_rows,
            d_pos=d_pos,
            d_anchor=d_anchor,
            d_block0=d_blocks[0],
            d_block1=d_blocks[1],
            g_dot_mean_logit=g_dot_mean_logit,
            **(joint or {}),
        )
        out = FusedResult(lse, mean_logit, d_anchor, d_blocks, g_dot_mean_logit, loss_rows, d_pos)
        out.pos_logits = pos_logits if own else None
        if back is not None and back != list(range(len(back))):  # back to the caller's order of dims
            for name in ("lse", "loss_rows", "d_pos", "pos_logits"):
                t = getattr(out, name)
                setattr(out, name, None if t is None else t[back])
            out.mean_logit = mean_logit[:, back] if sigmoid else mean_logit[back]
        return out


BACKEND = CppLSE()

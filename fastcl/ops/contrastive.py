"""One loss call's description (``LossSpec``), the autograd Function of the fused LSE losses
(``ContrastiveLSE``: primitive + head on any backend) and ``contrastive_loss``, which picks
the backend and runs it. Call path, the three strategies (the losses' ``strategy=`` argument,
and the backend's head step) and the double-backward rule: docs/design.md.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from .. import config
from . import dispatch
from .backend import Backend, HeadSaved, HeadStep
from .contract import EPS, Filter, LSEProblem, OwnPositives, Sigmoid, compute_dtype
from .head import HeadInputs, head_rows
from .positive_logits import own_positive_similarities


@dataclass(frozen=True)
class LossSpec:
    """One fused loss call's description: everything about it that is not a differentiable
    tensor. The loss builds it once (``fastcl.losses._shared.Options.spec``) and passes it
    down: :func:`contrastive_loss` or :func:`~fastcl.ops.sigmoid.sigmoid_loss` (or their ring
    forms) choose its backend (:meth:`choose`), the autograd Function keeps it, and
    :meth:`problem` gives the backend its ``LSEProblem``."""

    kind: str  # the head: "cross_entropy" | "softplus" (ops/head.py), or "sigmoid" (ops/sigmoid.py)
    tags: tuple[Tensor, Tensor]  # int32 [N0], [N1]: the structural mask (contract.py)
    reduction: str = "mean"
    # [B] the reduction's weight of each row; None until known (fastcl.losses' fused_loss sets
    # them after the gather, the ring forms from the global count): see :attr:`row_weights`
    weights: Tensor | None = None
    cosine: bool = True
    eps: float = EPS
    positives: OwnPositives | None = None  # set: own positives are in block 0 and the backend folds d_pos
    pos_mask: Tensor | None = None  # [B, P] valid own positives
    log_extra: Tensor | None = None  # [B] log of extra denominator mass (ops/head.py)
    dims: tuple[int, ...] | None = None  # Matryoshka prefixes: loss = sum_k dim_weights[k] * loss_k
    dim_weights: Tensor | None = None  # [K] compute dtype; None (reduction "none"): rows [K, B]
    padded: bool = True  # False: no tag is TAG_PADDING (no masks were given)
    strategy: str = "auto"  # "auto" (fastcl.config's strategy), "fused" or "recompute"
    filter: Filter | None = None  # false negatives left out of the rows (contract.Filter)
    backend: str = "auto"  # the name asked for: "auto" or one of dispatch.NAMES
    columns: bool = False  # the columns' LSEs too (CLIP's symmetric step, ops/symmetric.py)
    chosen: Backend | None = None  # the backend that runs the call (:meth:`choose`)

    @property
    def impl(self) -> Backend:
        """The chosen backend (:meth:`choose`)."""
        if self.chosen is None:
            raise RuntimeError(f"fastcl: the backend of this LossSpec ({self.backend!r}) is not chosen yet")
        return self.chosen

    @property
    def row_weights(self) -> Tensor:
        """``weights``, which must be known by now."""
        if self.weights is None:
            raise RuntimeError("fastcl: LossSpec.weights are not set")
        return self.weights

    def choose(self, problem: LSEProblem) -> LossSpec:
        """This description with its backend chosen for ``problem`` (``fastcl.ops.dispatch``)."""
        if self.chosen is not None:
            return self
        return replace(self, chosen=dispatch.choose(problem, backend=self.backend))

    def head_weights(self, weights: Tensor) -> Tensor:
        """The head's row weights from the reduction's ``[B]``: ``[K, B]`` with dims (each
        prefix's weight times the row's), else as given."""
        return weights if self.dim_weights is None else self.dim_weights.to(weights.dtype)[:, None] * weights

    def combine(self, rows: Tensor) -> Tensor:
        """``[B]`` loss rows from per-prefix ``rows [K, B]`` (``sum_k dim_weights[k] * rows[k]``);
        without ``dim_weights``, ``rows`` as given."""
        if self.dim_weights is None:
            return rows
        return (rows * self.dim_weights.to(rows.dtype)[:, None]).sum(0)

    def problem(self, anchor: Tensor, block0: Tensor, block1: Tensor, sigmoid: Sigmoid | None = None) -> LSEProblem:
        """The primitive's problem on these tensors (``sigmoid``: the sigmoid reduction's bias)."""
        return LSEProblem(
            anchor, (block0, block1), self.tags, self.cosine, self.eps, self.positives, self.dims, self.padded,
            filter=self.filter, sigmoid=sigmoid, columns=self.columns,
        )  # fmt: skip


def _strategy(spec: LossSpec) -> str:
    """``"fused"`` or ``"recompute"`` for a call that needs gradients: the requested one
    (``"auto"``: ``fastcl.config``'s ``strategy``, whose own ``"auto"`` fuses where it can)."""
    impl, reduction, dims, strategy = spec.impl, spec.reduction, spec.dims, spec.strategy
    wanted = config.get().strategy if strategy == "auto" else strategy
    can_fuse = impl.fused is not None and reduction != "none" and (dims is None or impl.fused_takes_dims)
    if wanted == "fused" and not can_fuse:
        source = "strategy='fused'" if strategy == "fused" else "FASTCL_STRATEGY=fused (fastcl.config's strategy)"
        raise ValueError(
            f"{source} needs reduction 'mean' or 'sum' and a backend with a fused path "
            f"(with matryoshka dims: one whose fused path takes them); got reduction={reduction!r}, "
            f"backend={impl.name!r}, dims={dims}"
        )
    return "fused" if can_fuse and wanted != "recompute" else "recompute"


def _grad_store_dtype(dtype: torch.dtype) -> torch.dtype:
    # Gradients formed in forward are kept until backward multiplies them by the upstream
    # gradient, which under fp16 GradScaler is a large scale: keep fp16 ones in float32 so
    # small values do not underflow before scaling. bf16 has float32's range.
    return torch.float32 if dtype == torch.float16 else dtype


def _tau_grad(g_dot_mean_logit: Tensor, d_pos: Tensor, pos_logits: Tensor, tau: Tensor, folded: bool) -> Tensor:
    """Temperature gradient (``l = s / tau``) of the LSE part and, when folded, of the own positives."""
    d_tau = -g_dot_mean_logit / tau.to(g_dot_mean_logit.dtype)
    return d_tau - (d_pos * pos_logits).sum() / tau.to(d_pos.dtype) if folded else d_tau


def _own_logits(spec: LossSpec, problem: LSEProblem, tau: Tensor) -> Tensor:
    """``[B, P]`` own-positive logits from the block-0 layout (no custom autograd: torch ops
    that a second-order backward differentiates); ``[K, B, P]`` with dims, prefix ``k`` on
    the first ``dims[k]`` coordinates."""
    assert spec.positives is not None  # folded own positives only
    B, P = problem.num_anchors, spec.positives.count
    own = problem.blocks[0][spec.positives.rows(0, B)].view(B, P, -1)
    prefixes = problem.prefixes if spec.dims is not None else (None,)
    sims = [
        own_positive_similarities(problem.anchor[:, :m], own[..., :m], spec.cosine, spec.eps, spec.pos_mask)
        for m in prefixes
    ]
    sim = torch.stack(sims) if spec.dims is not None else sims[0]
    return sim / tau.to(compute_dtype(problem.dtype))


def _head(spec: LossSpec, problem: LSEProblem, tau: Tensor, pos_logits: Tensor):
    """The primitive and the head: ``(lse, mean_logit, loss_rows, dlse, dpos)``."""
    lse, mean_logit = spec.impl.forward(problem, tau)
    return (lse, mean_logit, *head_of(spec, lse, pos_logits))


def head_of(spec: LossSpec, lse: Tensor, pos_logits: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The head on the primitive's ``lse``: ``(loss_rows, dlse, dpos)``. With dims the head runs
    on the ``K * B`` prefix rows and ``loss_rows`` is ``sum_k dim_weights[k] * rows_k`` (the
    derivatives carry the weights); without ``dim_weights`` the rows stay ``[K, B]``."""
    if spec.dims is None:
        return head_rows(lse, pos_logits, spec.pos_mask, spec.kind, spec.log_extra)
    K, B, P = pos_logits.shape
    tile = lambda t: None if t is None else t.repeat(K, *([1] * (t.dim() - 1)))  # noqa: E731
    rows, dlse, dpos = head_rows(
        lse.reshape(K * B), pos_logits.reshape(K * B, P), tile(spec.pos_mask), spec.kind, tile(spec.log_extra)
    )
    if spec.dim_weights is None:  # the caller combines the prefixes' rows itself
        return rows.view(K, B), dlse.view(K, B), dpos.view(K, B, P)
    w = spec.dim_weights.to(rows.dtype)
    return spec.combine(rows.view(K, B)), dlse.view(K, B) * w[:, None], dpos.view(K, B, P) * w[:, None, None]


class _FirstOrderOnly(torch.autograd.Function):
    """Passes gradients through; differentiating them again raises (see ``ContrastiveLSE.backward``)."""

    @staticmethod
    def forward(ctx, message: str, *grads: Tensor):
        ctx.message = message
        return tuple(g.view_as(g) for g in grads)

    @staticmethod
    def backward(ctx, *_):
        raise RuntimeError(ctx.message)


def _first_order_only(name: str, grads: tuple, message: str | None = None) -> tuple:
    """``grads`` attached to a node that raises on a second backward, so that it is never
    silently ``None`` or wrong (the detached inputs are what makes the node part of the graph).
    ``message``: the error, by default that backend ``name`` computes first derivatives only."""
    message = message or (
        f"fastcl: the {name!r} backend computes first derivatives only, so the gradient of its "
        "gradient (create_graph=True, double backward, gradgradcheck) is not available; "
        "use backend='reference', whose backward is differentiable"
    )
    wrapped = iter(_FirstOrderOnly.apply(message, *(g.detach().requires_grad_() for g in grads if g is not None)))
    return tuple(None if g is None else next(wrapped) for g in grads)


def _head_step(spec: LossSpec, problem: LSEProblem, head: HeadInputs, own_count: int) -> HeadStep | None:
    """The backend's fused loss step if it takes this call (``Backend.head_step``), else None."""
    step = spec.impl.head_step
    return step if step is not None and step.takes(problem, head, own_count) else None


class ContrastiveLSE(torch.autograd.Function):
    """Reduced LSE loss ``sum_i w_i * mean_k phi(lse_i - l_ik)`` (per row for ``none``) of
    ``anchor``, the two candidate blocks, ``pos_logits`` (the shared positives' differentiable
    logits, or None when own positives are folded from block 0) and ``tau``."""

    @staticmethod
    def forward(ctx, anchor, block0, block1, pos_logits, tau, spec: LossSpec):
        problem = spec.problem(anchor, block0, block1)
        cd = compute_dtype(anchor.dtype)
        folded, pos_input = pos_logits is None, pos_logits
        if spec.dims is not None and not folded and (pos_input.dim() != 3 or pos_input.shape[0] != len(spec.dims)):
            raise ValueError(f"with matryoshka dims pos_logits is [K={len(spec.dims)}, B, P]: one per prefix")
        needs_grad = any(ctx.needs_input_grad[:5])
        ctx.spec, ctx.dtype, ctx.folded = spec, anchor.dtype, folded
        ctx.mode = _strategy(spec) if needs_grad else "none"
        # a backend that forms the folded own-positive logits in its sweep spares the [B, P, d]
        # normalisation passes of _own_logits (~5 % of a cpp SupMPN step)
        if ctx.mode != "fused":
            head = HeadInputs(
                spec.kind,
                None if folded else pos_input.detach().to(cd),
                spec.pos_mask,
                spec.log_extra,
                spec.row_weights,
            )
            own_count = (
                pos_input.shape[-1] if pos_input is not None else (spec.positives.count if spec.positives else 0)
            )
            step = _head_step(spec, problem, head, own_count)
            if step is not None:  # the head fused into the backend's kernels
                loss, saved = step.forward(problem, tau, head, per_row=spec.reduction == "none")
                if needs_grad:
                    ctx.mode = "head"
                    ctx.save_for_backward(anchor, block0, block1, tau, saved.d_pos, saved.w_row, *saved.state)
                return loss.to(anchor.dtype)
        in_sweep = ctx.mode == "fused" and folded and spec.impl.forms_own_logits
        if in_sweep:
            pos_logits = None
        else:
            pos_logits = (_own_logits(spec, problem, tau) if folded else pos_input).detach().to(cd)

        if ctx.mode == "fused":
            # _strategy chose "fused": the backend has a sweep, and with dims a reduction's weights
            assert spec.impl.fused is not None and (spec.dims is None or spec.dim_weights is not None)
            head = HeadInputs(spec.kind, pos_logits, spec.pos_mask, spec.log_extra, spec.head_weights(spec.row_weights))
            out = spec.impl.fused(problem, tau, head)
            d_anchor, d_blocks, g_dot_mean_logit, rows, d_pos = out.sweep_outputs()
            pos_logits = out.pos_logits if in_sweep else pos_logits
            keep = _grad_store_dtype(anchor.dtype)
            # a float temperature needs no gradient: spare the small ops (launches on a GPU)
            d_tau = None
            if ctx.needs_input_grad[4]:
                assert pos_logits is not None  # given, or formed by the sweep (forms_own_logits)
                d_tau = _tau_grad(g_dot_mean_logit, d_pos, pos_logits, tau, folded)
            d_inputs = (t.to(keep) for t in (d_anchor, *d_blocks))
            ctx.save_for_backward(*d_inputs, d_pos, None if d_tau is None else d_tau.to(tau.dtype))
            # with dims the head's rows are per prefix [K, B]
            loss_rows = spec.combine(rows)
        else:
            lse, mean_logit, loss_rows, dlse, dpos = _head(spec, problem, tau, pos_logits)
            if needs_grad:
                ctx.save_for_backward(anchor, block0, block1, tau, pos_input, lse, mean_logit, dlse, dpos, pos_logits)

        out_loss = loss_rows if spec.reduction == "none" else (loss_rows * spec.row_weights.to(cd)).sum()
        return out_loss.to(anchor.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        # create_graph=True runs backward with grad mode on: the caller wants a differentiable
        # gradient. Only a backend whose backward is plain torch ops can give one; the others'
        # gradients are computed as usual and marked so that a second backward raises.
        if torch.is_grad_enabled() and not ctx.spec.impl.double_backward:
            with torch.no_grad():
                grads = ContrastiveLSE._grads(ctx, grad_out, second_order=False)
            return _first_order_only(ctx.spec.impl.name, grads)
        return ContrastiveLSE._grads(ctx, grad_out, second_order=torch.is_grad_enabled())

    @staticmethod
    def _grads(ctx, grad_out, second_order: bool):
        spec = ctx.spec
        if ctx.mode == "head":
            return ContrastiveLSE._head_grads(ctx, grad_out)
        go = grad_out.to(compute_dtype(ctx.dtype))
        if ctx.mode == "fused":
            d_anchor, d_b0, d_b1, d_pos, d_tau = ctx.saved_tensors
            unscaled = go.device.type == "cpu" and go.numel() == 1 and not go.requires_grad
            if unscaled and not torch.compiler.is_compiling() and bool(go == 1):
                # loss.backward() without a scale: skip three passes over [B + N, d]
                # (5 % of a SupMPN step at B = 1024, d = 768; no host sync on a CPU tensor;
                # not under torch.compile, where the value test would break the graph)
                d_inputs = (g.to(ctx.dtype) for g in (d_anchor, d_b0, d_b1))
                return (*d_inputs, None if ctx.folded else d_pos, d_tau, None)
            d_inputs = ((g * go).to(ctx.dtype) for g in (d_anchor, d_b0, d_b1))
            return (*d_inputs, None if ctx.folded else d_pos * go, None if d_tau is None else d_tau * go, None)

        anchor, block0, block1, tau, pos_input, *head = ctx.saved_tensors
        problem = spec.problem(anchor, block0, block1)
        if second_order:  # the head's values depend on the inputs too: recompute them with autograd
            pos_logits = _own_logits(spec, problem, tau) if ctx.folded else pos_input
            lse, mean_logit, _, dlse, dpos = _head(spec, problem, tau, pos_logits)
        else:
            lse, mean_logit, dlse, dpos, pos_logits = head
        row_w = go * spec.row_weights.to(go.dtype) if spec.reduction != "none" else go  # [B] (or [K, B])
        g = dlse * row_w  # [B], or [K, B] with dims
        d_pos = dpos * row_w[..., None]
        d_anchor, (d_b0, d_b1) = spec.impl.backward(problem, tau, lse, g, d_pos if ctx.folded else None)
        d_tau = None
        if ctx.needs_input_grad[4]:
            d_tau = _tau_grad((g * mean_logit).sum(), d_pos, pos_logits, tau, ctx.folded).to(tau.dtype)
        d_inputs = (g.to(ctx.dtype) for g in (d_anchor, d_b0, d_b1))
        return (*d_inputs, None if ctx.folded else d_pos, d_tau, None)

    @staticmethod
    def _head_grads(ctx, grad_out):
        """Gradients of the fused head step: the kernels scale by ``grad_out`` and the weights
        themselves; only the temperature's (and shared positives') gradients take small ops."""
        spec = ctx.spec
        anchor, block0, block1, tau, dpos, w_row, *state = ctx.saved_tensors
        problem = spec.problem(anchor, block0, block1)
        step = spec.impl.head_step
        assert step is not None  # forward ran it
        saved = HeadSaved(dpos, w_row, tuple(state))
        d_anchor, (d_b0, d_b1) = step.backward(problem, tau, saved, spec.row_weights, grad_out)
        d_tau = d_pos = None
        if ctx.needs_input_grad[4] or not ctx.folded:
            go = grad_out.to(compute_dtype(ctx.dtype))
            s = go * spec.row_weights.to(go.dtype) if spec.reduction != "none" else go  # [B]
            if ctx.needs_input_grad[4]:  # l = s / tau: dL/dtau = -sum_i s_i w_row_i / tau
                d_tau = (-(s * w_row).sum() / tau.to(s.dtype)).to(tau.dtype)
            if not ctx.folded:
                d_pos = dpos * s[:, None]
        return d_anchor, d_b0, d_b1, d_pos, d_tau, None


def ready(
    anchor: Tensor, blocks: tuple[Tensor, Tensor], spec: LossSpec
) -> tuple[Tensor, tuple[Tensor, Tensor], LossSpec]:
    """``(anchor, blocks, spec)`` as ``ContrastiveLSE`` takes them: contiguous, and ``spec``'s
    backend chosen for them (``LossSpec.choose``)."""
    anchor = anchor.contiguous()
    blocks = (blocks[0].contiguous(), blocks[1].contiguous())
    return anchor, blocks, spec.choose(spec.problem(anchor, *blocks))


def contrastive_loss(
    anchor: Tensor, blocks: tuple[Tensor, Tensor], tau: Tensor, spec: LossSpec, pos_logits: Tensor | None = None
) -> Tensor:
    """Run one LSE loss, described by ``spec`` (its ``weights`` set), on the backend it names or
    the one dispatch chooses (validated inputs; see ``fastcl.losses``; their ``fused_loss``
    runs ``ContrastiveLSE`` itself, after :func:`ready`). Own positives are a layout in block 0
    (``spec.positives``: every backend folds their gradient) or precomputed differentiable
    ``pos_logits [B, P]`` (shared positives, ``supcon_pool_loss``). With ``spec.dims``
    (``pos_logits`` then ``[K, B, P]``): the sum of the loss on each prefix weighted by
    ``spec.dim_weights``; with ``reduction="none"`` and no ``dim_weights``, the prefixes'
    rows ``[K, B]``. Strategies: docs/design.md, "Three strategies"."""
    anchor, (b0, b1), spec = ready(anchor, blocks, spec)
    return ContrastiveLSE.apply(anchor, b0, b1, pos_logits, tau, spec)

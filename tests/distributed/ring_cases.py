"""The multi-process side of tests/distributed/test_ring_primitive.py: ``ring_contrastive_loss``
on every rank against ``contrastive_loss`` of one process on the concatenated batch.

Each case builds one rank's inputs from ``(seed, case, rank)`` alone (so the parent builds the
same global batch), lays them out as the structured losses do (:func:`layout`: positives in
block 0 with owner tags, negatives in block 1, padding from masks) and runs the primitive.
Masks leave rank ``r`` with ``VALID[r % 3]`` anchors that have a valid positive (uneven, and
rank 2 has none). Run one world by hand: ``python -m tests.distributed.ring_cases 3 /tmp/out``.
"""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fastcl import config
from fastcl.ops import dispatch
from fastcl.ops.contract import EPS, OwnPositives, compute_dtype, structured_tags
from fastcl.ops.contrastive import LossSpec, contrastive_loss
from fastcl.ops.head import reduction_weights
from fastcl.ops.positive_logits import positive_logits
from fastcl.ops.ring import ring_contrastive_loss
from tests.helpers.spawn import run_rank

B, D = 3, 8
VALID = (3, 2, 0)
TIMEOUT_S = 90
# triton only in the Triton interpreter suite (TRITON_INTERPRET=1: its kernels on CPU tensors)
_TRITON = ("triton",) if os.environ.get("TRITON_INTERPRET") == "1" else ()
BACKENDS = tuple(b for b in ("torch", "reference", "cpp", *_TRITON) if dispatch.unavailable(b) is None)
# the primitive cases also under fastcl.config's strategy "recompute": the default fuses the
# own block where the backend can (torch, cpp), so the recompute path needs its own runs
# (the ring's recompute code is the same for every backend: cpp's runs it against the
# reference here, and triton, which has no sweep, always takes it in the interpreter suite)
CASE_BACKENDS = BACKENDS + tuple(f"{b}:recompute" for b in ("cpp",) if b in BACKENDS)


@dataclass(frozen=True)
class Case:
    name: str
    P: int
    Q: int
    kind: str = "softplus"  # head (ops/head.py); "softplus" (SupMPN) also excludes own positives from the denominator
    zero_logit: bool = False  # SupMPN's released code: log_extra = log(P_i - 1)
    shared: bool = False  # own-positive logits given as a differentiable input (pool losses)
    dims: tuple[int, ...] | None = None
    dim_weights: tuple[float, ...] | None = None
    reduction: str = "mean"
    learn_tau: bool = False
    masks: bool = True
    dtype: torch.dtype = torch.float64
    cosine: bool = True


CASES = [
    Case("supmpn-masks", 3, 2),
    Case("supmpn-zero-logit-sum", 3, 2, zero_logit=True, reduction="sum"),
    Case("supcon-learned-tau", 2, 2, kind="cross_entropy", learn_tau=True),
    Case("supcon-none", 2, 1, kind="cross_entropy", reduction="none"),
    Case("mnrl-like-dot", 1, 2, kind="cross_entropy", masks=False, cosine=False),
    Case("shared-pos-logits", 2, 2, kind="cross_entropy", shared=True, learn_tau=True),
    Case("matryoshka", 2, 2, dims=(8, 3, 5), dim_weights=(1.0, 0.5, 2.0), learn_tau=True),
    Case("matryoshka-shared", 2, 1, kind="cross_entropy", shared=True, dims=(5, 8), dim_weights=(1.0, 0.25)),
    Case("supmpn-fp32", 2, 2, dtype=torch.float32),
]
CASE_NAMES = [c.name for c in CASES]


def inputs(case: Case, seed: int, rank: int) -> dict:
    g = torch.Generator().manual_seed((seed * 1_000_003 + sum(map(ord, case.name)) * 101 + rank) % (1 << 62))
    x = {
        "anchor": torch.randn(B, D, generator=g, dtype=torch.float64).to(case.dtype),
        "positives": torch.randn(B, case.P, D, generator=g, dtype=torch.float64).to(case.dtype),
        "negatives": torch.randn(B, case.Q, D, generator=g, dtype=torch.float64).to(case.dtype),
    }
    if case.masks:
        pm = torch.rand(B, case.P, generator=g) < 0.6
        pm[:, 0] = True
        pm[VALID[rank % 3] :] = False
        x["pos_mask"] = pm
        x["neg_mask"] = torch.rand(B, case.Q, generator=g) < 0.7
    return x


def concat(parts: list[dict]) -> dict:
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def layout(case: Case, x: dict, tau: torch.Tensor) -> dict:
    """The structured losses' layout of ``x`` (one rank's, or the concatenated batch)."""
    a, pos, neg = x["anchor"], x["positives"], x["negatives"]
    n, d, P, Q = a.shape[0], a.shape[1], pos.shape[1], neg.shape[1]
    pm, nm = x.get("pos_mask"), x.get("neg_mask")
    tags = (
        structured_tags(n, P, pm, device=a.device, exclude_owner=case.kind == "softplus"),
        structured_tags(n, Q, nm, device=a.device, exclude_owner=False),
    )
    cd = compute_dtype(a.dtype)
    log_extra = None
    if case.zero_logit:
        count = torch.full((n,), P) if pm is None else pm.sum(1)
        log_extra = (count - 1).clamp_min(0).to(cd).log()
    pos_logits = None
    if case.shared:
        prefixes = (d,) if case.dims is None else case.dims
        parts = [
            positive_logits(a[:, :m], pos[..., :m], tau, cosine=case.cosine, eps=EPS, pos_mask=pm) for m in prefixes
        ]
        pos_logits = parts[0] if case.dims is None else torch.stack(parts)
    has_pos = torch.ones(n, dtype=torch.bool) if pm is None else pm.any(1)
    return dict(
        anchor=a,
        blocks=(pos.reshape(n * P, d), neg.reshape(n * Q, d)),
        tags=tags,
        kind=case.kind,
        positives=None if case.shared else OwnPositives(0, P),
        pos_logits=pos_logits,
        pos_mask=pm,
        reduction=case.reduction,
        cosine=case.cosine,
        eps=EPS,
        log_extra=log_extra,
        dims=case.dims,
        dim_weights=None if case.dims is None else torch.tensor(case.dim_weights, dtype=cd),
    ), has_pos


def run(case: Case, x: dict, backend: str, group) -> dict:
    """Loss and gradients on one rank of the ring (``group``) or of one process (``None``)."""
    x = {k: (v.detach().clone().requires_grad_(v.is_floating_point())) for k, v in x.items()}
    tau = torch.tensor(0.1, dtype=x["anchor"].dtype, requires_grad=case.learn_tau)
    args, has_pos = layout(case, x, tau)
    backend, _, strategy = backend.partition(":")  # "cpp:recompute": fastcl.config's strategy
    with config.override(strategy=strategy) if strategy else contextlib.nullcontext():
        anchor, blocks, pos_logits = args.pop("anchor"), args.pop("blocks"), args.pop("pos_logits")
        if group is None:
            weights = reduction_weights(has_pos, case.reduction, compute_dtype(x["anchor"].dtype))
            spec = LossSpec(weights=weights, backend=backend, **args)
            out = contrastive_loss(anchor, blocks, tau, spec, pos_logits)
        else:
            check = args["pos_mask"] is not None
            spec = LossSpec(backend=backend, **args)
            out = ring_contrastive_loss(
                anchor, blocks, tau, spec, pos_logits, group=group, has_pos=has_pos, check_positive=check
            )
    (out.sum() if case.reduction == "none" else out).backward()
    grads = {k: v.grad.detach().clone() for k, v in x.items() if v.is_floating_point()}
    return {"loss": out.detach().clone(), "grads": grads, "tau_grad": tau.grad.clone() if case.learn_tau else None}


# --------------------------------------------------------------------------- labels (SupCon)

N_LABELED, NUM_LABELS = 5, 3  # rows per rank; few labels, so positives lie on other ranks too


@dataclass(frozen=True)
class LabelsCase:
    name: str
    reduction: str = "mean"
    cosine: bool = True
    dims: tuple[int, ...] | None = None
    learn_tau: bool = False


LABEL_CASES = [
    LabelsCase("labels"),
    LabelsCase("labels-sum-dot", reduction="sum", cosine=False),
    LabelsCase("labels-matryoshka-tau", dims=(8, 3, 5), learn_tau=True),
]
LABEL_CASE_NAMES = [c.name for c in LABEL_CASES]


def label_inputs(case: LabelsCase, seed: int, rank: int) -> dict:
    g = torch.Generator().manual_seed((seed * 7919 + sum(map(ord, case.name)) + rank) % (1 << 62))
    labels = torch.randint(0, NUM_LABELS, (N_LABELED,), generator=g)
    if rank == 1:
        labels[:] = NUM_LABELS + 7  # a label no other rank has, seen on this rank only
        labels[0] = NUM_LABELS + 8  # ... and one seen once in the whole batch: no positive
    return {"features": torch.randn(N_LABELED, D, generator=g, dtype=torch.float64), "labels": labels}


def run_labels(case: LabelsCase, x: dict, backend: str, group) -> dict:
    from fastcl.losses import supcon_labels_loss
    from fastcl.ops.ring_labels import supcon_labels_ring

    f = x["features"].detach().clone().requires_grad_()
    tau = torch.tensor(0.2, dtype=torch.float64, requires_grad=case.learn_tau)
    dims = dict(matryoshka_dims=case.dims, matryoshka_weights=None if case.dims is None else (1.0, 0.5, 2.0))
    similarity = "cos" if case.cosine else "dot"
    if group is None:
        out = supcon_labels_loss(
            f, x["labels"], temperature=tau, reduction=case.reduction, backend=backend, similarity=similarity, **dims
        )
    else:
        w = None if case.dims is None else torch.tensor(dims["matryoshka_weights"], dtype=torch.float64)
        out = supcon_labels_ring(
            f, x["labels"], tau, reduction=case.reduction, backend=backend, cosine=case.cosine, dims=case.dims,
            dim_weights=w, group=group,
        )  # fmt: skip
    out.backward()
    return {"loss": out.detach(), "grad": f.grad.clone(), "tau_grad": tau.grad.clone() if case.learn_tau else None}


# --------------------------------------------------------------------------- failures


class _Raises:
    """Wraps a backend: its ``method`` raises on the ``when``-th call (1-based)."""

    def __init__(self, impl, method: str, when: int):
        self.impl, self.method, self.when, self.calls = impl, method, when, 0

    def __getattr__(self, name):
        attr = getattr(self.impl, name)
        if name != self.method:
            return attr

        def wrapped(*args, **kwargs):
            self.calls += 1
            if self.calls == self.when:
                raise FloatingPointError(f"injected failure in {self.method} call {self.when}")
            return attr(*args, **kwargs)

        return wrapped


def _outcome(fn) -> tuple[str, str] | None:
    try:
        fn()
    except Exception as exc:  # the test asserts on type and message
        return type(exc).__name__, str(exc)
    return None


# (case, backend method that raises, on which rank, on which call, fastcl.config's strategy)
FAILURES = (
    ("forward", "forward", 1, 2, "recompute"),
    ("backward", "backward", 0, 2, "recompute"),
    ("own-sweep", "fused", 1, 1, "auto"),
)


def failures(seed: int, group, rank: int, world: int) -> dict:
    """Errors that must reach every rank, then a call that must still work (group usable)."""
    case = CASES[0]
    x = inputs(case, seed, rank)
    out = {}
    real = dispatch.get("torch")
    # the recompute strategy calls forward/backward once per block (the 2nd call is mid-ring);
    # the default one runs the own block's gradient-in-forward sweep ("fused") after the others
    for name, method, bad_rank, when, strategy in FAILURES:
        impl = _Raises(real, method, when) if rank == bad_rank else real
        choose = dispatch.choose
        dispatch.choose = lambda problem, backend=None, impl=impl: impl  # noqa: E731
        try:
            with config.override(strategy=strategy):
                out[name] = _outcome(lambda: run(case, x, "torch", group))
        finally:
            dispatch.choose = choose
    bad = dict(x, negatives=x["negatives"][:, :1], neg_mask=x["neg_mask"][:, :1]) if rank == world - 1 else x
    out["mismatch"] = _outcome(lambda: run(case, bad, "torch", group))
    wrong = {k: v.float() if v.is_floating_point() else v for k, v in x.items()} if rank == 0 else x
    out["dtype"] = _outcome(lambda: run(case, wrong, "torch", group))
    none = dict(x, pos_mask=torch.zeros_like(x["pos_mask"]))
    out["no-positive"] = _outcome(lambda: run(case, none, "torch", group))
    out["after"] = run(case, x, "torch", group)["loss"]
    return out


# --------------------------------------------------------------------------- worker


def worker(rank: int, world: int, store_path: str, out_dir: str, seed: int) -> None:
    def body() -> dict:
        group = dist.group.WORLD
        results = {"failures": failures(seed, group, rank, world), "cases": {}, "labels": {}}
        for case in LABEL_CASES:
            x = label_inputs(case, seed, rank)
            for backend in BACKENDS:
                results["labels"][case.name, backend] = run_labels(case, x, backend, group)
        for case in CASES:
            x = inputs(case, seed, rank)
            for backend in CASE_BACKENDS:
                results["cases"][case.name, backend] = run(case, x, backend, group)
        return results

    run_rank(rank, world, store_path, out_dir, body, timeout_s=TIMEOUT_S)


if __name__ == "__main__":
    import tempfile

    import torch.multiprocessing as mp

    world, out = int(sys.argv[1]), sys.argv[2]
    os.makedirs(out, exist_ok=True)
    mp.spawn(worker, args=(world, tempfile.mktemp(prefix="fastcl_store_"), out, 0), nprocs=world)
    print("ok:", sorted(os.listdir(out)))

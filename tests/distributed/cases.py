"""The multi-process side of tests/distributed/test_distributed.py: cases, the rank worker, DDP and errors.

Each case builds one rank's inputs from ``(seed, case, rank)`` alone, so every process (and
the pytest parent, which runs the one-process reference on the concatenated batch) builds
the same global batch without communication. Masks differ by rank on purpose: in the
masked cases ranks 0, 1, 2 have 3, 2 and 0 anchors with a valid positive.

Run one world by hand (prints each case):
    python -m tests.distributed.cases 3 /tmp/dist_out
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

import fastcl.losses as L
from fastcl import config
from tests.helpers.spawn import run_rank

B, D = 3, 8  # anchors per rank (odd on purpose), embedding width
EMBEDDINGS = ("anchor", "positives", "negatives", "positive", "dropout_view", "augmented_view", "candidates")
BACKENDS = ("torch", "torch:recompute", "reference")
EMPTY_RANK = 2  # in the masked cases of a 3-process run this rank has no valid anchor
TIMEOUT_S = 90  # process-group timeout inside the workers (the parent kills them later)


def _gen(seed: int, case: str, rank: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed((seed * 1_000_003 + sum(map(ord, case)) * 101 + rank) % (1 << 62))
    return g


def _randn(g, *shape, dtype=torch.float64):
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


VALID_ANCHORS = (B, B - 1, 0)  # per rank in the masked cases: uneven, and rank 2 has none


def _mask(g, rows: int, cols: int, rank: int, *, uneven_anchors: bool) -> torch.Tensor:
    """Random padding, a different amount per rank; with ``uneven_anchors`` rank r has
    exactly ``VALID_ANCHORS[r]`` anchors with a valid slot (so the global count is never 0)."""
    keep = 0.35 + 0.2 * (rank % 3)
    m = torch.rand(rows, cols, generator=g) < keep
    if uneven_anchors:
        m[:, 0] = True
        m[VALID_ANCHORS[rank % len(VALID_ANCHORS)] :] = False
    return m


# --------------------------------------------------------------------------- cases


def _structured(P, Q, *, masks=True, dtype=torch.float64):
    def make(g, rank):
        x = {"anchor": _randn(g, B, D, dtype=dtype), "positives": _randn(g, B, P, D, dtype=dtype)}
        if Q:
            x["negatives"] = _randn(g, B, Q, D, dtype=dtype)
        if masks:
            x["pos_mask"] = _mask(g, B, P, rank, uneven_anchors=True)
            if Q:
                x["neg_mask"] = _mask(g, B, Q, rank + 1, uneven_anchors=False)
        return x

    return make


def _pairs(*names, Q=0):
    def make(g, rank):
        x = {n: _randn(g, B, D) for n in names}
        if Q:
            x["negatives"] = _randn(g, B, Q, D)
            x["neg_mask"] = _mask(g, B, Q, rank, uneven_anchors=False)
        return x

    return make


def _pool(N=5, P=2):
    def make(g, rank):
        cand_mask = torch.rand(N, generator=g) < 0.8
        pos_index = torch.randint(0, N, (B, P), generator=g)
        cand_mask[pos_index[:, 0]] = True  # keep VALID_ANCHORS exact (an invalid candidate is no positive)
        pos_mask = _mask(g, B, P, rank, uneven_anchors=True)
        return {
            "anchor": _randn(g, B, D),
            "candidates": _randn(g, N, D),
            "pos_index": pos_index,
            "pos_mask": pos_mask,
            "cand_mask": cand_mask,
        }

    return make


def _concat(parts: list[dict]) -> dict:
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def _concat_pool(parts: list[dict]) -> dict:
    """Global pool: candidates of rank r start at r * N, so its pos_index shifts by r * N."""
    out = _concat(parts)
    n = parts[0]["candidates"].shape[0]
    out["pos_index"] = torch.cat([p["pos_index"] + r * n for r, p in enumerate(parts)])
    return out


@dataclass(frozen=True)
class Case:
    name: str
    make: Callable  # (generator, rank) -> this rank's inputs
    loss: Callable  # (inputs, **kw) -> loss; kw: process_group, backend, temperature, reduction
    reduction: str = "mean"
    merge: Callable = _concat
    learn_tau: bool = False
    masked: bool = True  # uneven valid anchors per rank (VALID_ANCHORS)


def _supmpn(own):
    return lambda x, **kw: L.supmpn_loss(
        x["anchor"],
        x["positives"],
        x.get("negatives"),
        pos_mask=x.get("pos_mask"),
        neg_mask=x.get("neg_mask"),
        own_positives=own,
        **kw,
    )


def _full_on_rank0(P, Q):
    """Rank 0's masks all True, the others' padded: rank 0 passes None (as the SupMPN trainer
    does for a batch without padding), the one-process reference the concatenated masks."""
    structured = _structured(P, Q)

    def make(g, rank):
        x = structured(g, rank)
        if rank == 0:
            x["pos_mask"], x["neg_mask"] = torch.ones_like(x["pos_mask"]), torch.ones_like(x["neg_mask"])
        return x

    return make


def _supmpn_without_full_masks(x, **kw):
    full = "process_group" in kw and kw["process_group"] is not None and bool(x["pos_mask"].all())
    if full and bool(x["neg_mask"].all()):
        x = {k: v for k, v in x.items() if k not in ("pos_mask", "neg_mask")}
    return _supmpn("exclude")(x, **kw)


def _supcon(x, **kw):
    return L.supcon_loss(
        x["anchor"], x["positives"], x.get("negatives"), pos_mask=x.get("pos_mask"), neg_mask=x.get("neg_mask"), **kw
    )


CASES = [
    Case("supmpn-exclude", _structured(3, 2), _supmpn("exclude")),
    Case("supmpn-zero_logit", _structured(3, 2), _supmpn("zero_logit")),
    Case("supmpn-nomask-noneg", _structured(2, 0, masks=False), _supmpn("exclude"), masked=False),
    Case("supmpn-sum", _structured(2, 2), _supmpn("exclude"), reduction="sum"),
    Case("supmpn-learned-tau", _structured(2, 1), _supmpn("exclude"), learn_tau=True),
    Case("supcon", _structured(2, 3), _supcon),
    Case("supcon-none", _structured(2, 2), _supcon, reduction="none"),
    Case("supcon-fp32", _structured(2, 2, dtype=torch.float32), _supcon),
    Case("supmpn-bf16", _structured(2, 2, dtype=torch.bfloat16), _supmpn("exclude")),
    Case("supmpn-masks-on-some-ranks", _full_on_rank0(2, 2), _supmpn_without_full_masks),
    Case(
        "mnrl-hard-negatives",
        _pairs("anchor", "positive", Q=2),
        lambda x, **kw: L.mnrl_loss(x["anchor"], x["positive"], x["negatives"], neg_mask=x["neg_mask"], **kw),
        masked=False,
    ),
    Case(
        "mnrl-in-batch",
        _pairs("anchor", "positive"),
        lambda x, **kw: L.mnrl_loss(x["anchor"], x["positive"], **kw),
        masked=False,
    ),
    Case(
        "infonce-symmetric",
        _pairs("anchor", "positive"),
        lambda x, **kw: L.infonce_loss(x["anchor"], x["positive"], symmetric=True, **kw),
        masked=False,
    ),
    Case(
        "edacse",
        _pairs("anchor", "dropout_view", "augmented_view"),
        lambda x, **kw: L.edacse_loss(x["anchor"], x["dropout_view"], x["augmented_view"], lam=0.6, **kw),
        masked=False,
    ),
    Case(
        "supcon-pool",
        _pool(),
        lambda x, **kw: L.supcon_pool_loss(
            x["anchor"], x["candidates"], x["pos_index"], pos_mask=x["pos_mask"], cand_mask=x["cand_mask"], **kw
        ),
        merge=_concat_pool,
    ),
]
MATRYOSHKA = dict(matryoshka_dims=(8, 3, 5), matryoshka_weights=(1.0, 0.5, 2.0))
CASES += [
    Case("supmpn-matryoshka", _structured(3, 2), lambda x, **kw: _supmpn("exclude")(x, **MATRYOSHKA, **kw)),
    Case(
        "mnrl-gte-matryoshka",
        _pairs("anchor", "positive", Q=1),
        lambda x, **kw: L.mnrl_loss(
            x["anchor"], x["positive"], x["negatives"], directions=("query_to_doc", "doc_to_doc"), **MATRYOSHKA, **kw
        ),
        masked=False,
    ),
    Case(
        "supcon-pool-matryoshka",
        _pool(),
        lambda x, **kw: L.supcon_pool_loss(
            x["anchor"],
            x["candidates"],
            x["pos_index"],
            pos_mask=x["pos_mask"],
            cand_mask=x["cand_mask"],
            **MATRYOSHKA,
            **kw,
        ),
        merge=_concat_pool,
    ),
]
CASE_NAMES = [c.name for c in CASES]


def inputs(case: Case, seed: int, rank: int) -> dict:
    return case.make(_gen(seed, case.name, rank), rank)


@contextmanager
def _strategy(backend: str):
    """``torch:recompute`` runs the torch backend with ``fastcl.config``'s strategy "recompute"
    (what ``strategy="auto"``, every case's default, then means)."""
    name, _, strategy = backend.partition(":")
    with config.override(strategy=strategy or "auto"):
        yield name


def run_case(case: Case, x: dict, backend: str, group) -> dict:
    """Loss and gradients of one rank (``group``) or of one process (``group=None``).

    Returns ``loss`` (0-d, or ``[B]`` rows for ``reduction="none"``), ``grads`` of every
    embedding and ``tau_grad``; for ``none`` the backward seed is ``rows.sum()``.
    """
    x = {k: (v.detach().clone().requires_grad_(True) if k in EMBEDDINGS else v) for k, v in x.items()}
    dtype = x["anchor"].dtype
    tau = torch.tensor(0.1, dtype=dtype, requires_grad=True) if case.learn_tau else 0.1
    with _strategy(backend) as name:
        out = case.loss(x, temperature=tau, reduction=case.reduction, backend=name, process_group=group)
        (out.sum() if case.reduction == "none" else out).backward()
    grads = {k: v.grad.detach().clone() for k, v in x.items() if k in EMBEDDINGS}
    return {"loss": out.detach().clone(), "grads": grads, "tau_grad": tau.grad.clone() if case.learn_tau else None}


# --------------------------------------------------------------------------- DDP


class ToyEncoder(nn.Module):
    """A linear "encoder" plus a SupMPN loss with a learnable temperature, as one DDP module."""

    def __init__(self, group=None):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, D))
        self.loss = L.SupMPNLoss(0.1, learn_temperature=True, process_group=group, backend="torch")

    def forward(self, xa, xp, xn, pos_mask, neg_mask):
        b, p, _ = xp.shape
        return self.loss(
            self.enc(xa), self.enc(xp).reshape(b, p, D), self.enc(xn).reshape(b, -1, D), pos_mask, neg_mask
        )


def ddp_inputs(seed: int, rank: int) -> tuple:
    g = _gen(seed, "ddp", rank)
    xa, xp, xn = _randn(g, B, 6), _randn(g, B, 2, 6), _randn(g, B, 2, 6)
    return xa, xp, xn, _mask(g, B, 2, rank, uneven_anchors=True), _mask(g, B, 2, rank + 1, uneven_anchors=False)


def ddp_model(seed: int, group=None) -> ToyEncoder:
    torch.manual_seed(seed)
    return ToyEncoder(group).double()


def param_grads(model: nn.Module) -> dict:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _ddp(seed: int, group) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(ddp_model(seed, group), process_group=group)
    loss = model(*ddp_inputs(seed, dist.get_rank(group)))
    loss.backward()
    return {"loss": loss.detach(), "grads": param_grads(model.module)}


# --------------------------------------------------------------------------- errors


def _error(fn) -> tuple[str, str] | None:
    try:
        fn()
    except Exception as exc:  # the test asserts on type and message
        return type(exc).__name__, str(exc)
    return None


def _errors(seed: int, group, rank: int, world: int) -> dict:
    """Failures that must raise on *every* rank (no rank may be left in a collective)."""
    g = _gen(seed, "errors", rank)
    a, p, n = _randn(g, B, D), _randn(g, B, 2, D), _randn(g, B, 2, D)
    last = world - 1
    out = {}
    # one rank has another P
    p_bad = _randn(g, B, 3, D) if rank == last else p
    out["mismatch"] = _error(lambda: L.supmpn_loss(a, p_bad, n, process_group=group))
    # one rank has another dtype
    a_bad, p_b, n_b = (a.float(), p.float(), n.float()) if rank == last else (a, p, n)
    out["dtype"] = _error(lambda: L.supcon_loss(a_bad, p_b, n_b, process_group=group))
    # no anchor of any rank has a valid positive
    none = torch.zeros(B, 2, dtype=torch.bool)
    out["no-positive"] = _error(lambda: L.supcon_loss(a, p, n, pos_mask=none, process_group=group))
    # rank 0's inputs fail local validation (a mask of the wrong dtype) before any collective
    mask = torch.ones(B, 2, dtype=torch.int64 if rank == 0 else torch.bool)
    out["invalid-on-rank-0"] = _error(lambda: L.supmpn_loss(a, p, n, neg_mask=mask, process_group=group))
    # the same inside symmetric InfoNCE (nested public calls guard once)
    a2 = a[:, :4] if rank == 0 else a
    out["invalid-nested"] = _error(lambda: L.infonce_loss(a2, a, symmetric=True, process_group=group))
    # the same in EdaCSE's second view
    aug = a[:2] if rank == 0 else a
    out["invalid-edacse"] = _error(lambda: L.edacse_loss(a, a, aug, process_group=group))
    return out


# --------------------------------------------------------------------------- worker


def worker(rank: int, world: int, store_path: str, out_dir: str, seed: int) -> None:
    """One rank: errors first (the group must stay usable after them), then every case, then DDP."""

    def body() -> dict:
        group = dist.group.WORLD
        results = {"errors": _errors(seed, group, rank, world), "cases": {}}
        for case in CASES:
            x = inputs(case, seed, rank)
            for backend in BACKENDS:
                results["cases"][case.name, backend] = run_case(case, x, backend, group)
        results["ddp"] = _ddp(seed, group)
        return results

    run_rank(rank, world, store_path, out_dir, body, timeout_s=TIMEOUT_S)


if __name__ == "__main__":
    import tempfile

    import torch.multiprocessing as mp

    world, out = int(sys.argv[1]), sys.argv[2]
    os.makedirs(out, exist_ok=True)
    store = tempfile.mktemp(prefix="fastcl_store_")
    mp.spawn(worker, args=(world, store, out, 0), nprocs=world)
    print("ok:", sorted(os.listdir(out)))

"""The multi-process side of tests/distributed/test_ring_losses.py: every public LSE loss with
``cross_device="ring"`` on every rank, for the parent to compare with one process.

The cases are tests/distributed/cases.py's (SupMPN with padding masks and uneven valid
anchors, SupCon, MNRL with hard negatives, symmetric InfoNCE, EdaCSE, the pool form,
Matryoshka, a learnable temperature, bf16, ...) plus MNRL with sentence-transformers 6's
directions and hardness and SupCon with labels. Then a DDP model whose SupMPN loss runs the
ring, and the loss-level errors (a rank failing validation, mismatched shapes).
Run one world by hand: ``python -m tests.distributed.ring_loss_cases 4 /tmp/out``.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

import fastcl.losses as L
from fastcl import distributed
from fastcl.ops import dispatch, ring_comm
from tests.distributed import cases as C
from tests.helpers.spawn import run_rank

BACKENDS = tuple(b for b in ("torch", "reference", "cpp") if dispatch.unavailable(b) is None)
GTE = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")


def _labels(g, rank):
    """Two views of ``B`` samples; few labels so positives lie on other ranks, and on rank 1 a
    label seen nowhere else once (a sample whose views are its only positives)."""
    y = torch.randint(0, 3, (C.B,), generator=g)
    if rank == 1:
        y[0] = 100
    return {"features": C._randn(g, C.B, 2, C.D), "labels": y}


def _mnrl(**options):
    return lambda x, **kw: L.mnrl_loss(x["anchor"], x["positive"], x.get("negatives"), **options, **kw)


CASES = [
    *C.CASES,
    C.Case(
        "mnrl-gte-all-negatives",
        C._pairs("anchor", "positive", Q=2),
        _mnrl(directions=GTE, hardness_mode="all_negatives", hardness_strength=2.0),
        masked=False,
    ),
    C.Case(
        "mnrl-per-direction-in-batch",
        C._pairs("anchor", "positive", Q=1),
        _mnrl(
            directions=("query_to_doc", "doc_to_query"),
            partition_mode="per_direction",
            hardness_mode="in_batch_negatives",
            hardness_strength=1.0,
        ),  # fmt: skip
        masked=False,
        learn_tau=True,
    ),
    C.Case(
        "mnrl-q2q-hard-negatives",
        C._pairs("anchor", "positive", Q=2),
        _mnrl(directions=("query_to_doc", "query_to_query"), hardness_mode="hard_negatives", hardness_strength=1.5),
        masked=False,
        reduction="sum",
    ),
    C.Case(
        "supcon-labels",
        _labels,
        lambda x, **kw: L.supcon_loss(x["features"], labels=x["labels"], **kw),
        masked=False,
        learn_tau=True,
    ),
    C.Case(
        "supcon-labels-matryoshka",
        _labels,
        lambda x, **kw: L.supcon_labels_loss(x["features"], x["labels"], **C.MATRYOSHKA, **kw),
        masked=False,
    ),
]
CASE_NAMES = [c.name for c in CASES]
EMBEDDINGS = (*C.EMBEDDINGS, "features")


class _NoGather:
    """Inside: the gather mode's collectives raise and every ring is counted (``rings``), so a
    ring case that silently took the gather path fails instead of passing on equal values."""

    def __init__(self):
        self.rings = 0

    def __enter__(self):
        self._saved = (distributed.gather_candidates, distributed.all_gather_with_grad, ring_comm.RingComm.__init__)
        init = self._saved[2]

        def counted(comm, group):
            self.rings += 1
            init(comm, group)

        def refuse(*args, **kwargs):
            raise AssertionError("cross_device='ring' used the gather mode's all-gather")

        distributed.gather_candidates = distributed.all_gather_with_grad = refuse
        ring_comm.RingComm.__init__ = counted
        return self

    def __exit__(self, *exc):
        distributed.gather_candidates, distributed.all_gather_with_grad, ring_comm.RingComm.__init__ = self._saved


def run_case(case: C.Case, x: dict, backend: str, group) -> dict:
    """Loss and gradients of one rank (ring) or of one process (``group=None``), as ``C.run_case``;
    ``rings``: how many rings the rank ran (forward and backward of each primitive call)."""
    x = {k: (v.detach().clone().requires_grad_(True) if k in EMBEDDINGS else v) for k, v in x.items()}
    dtype = next(v for k, v in x.items() if k in EMBEDDINGS).dtype
    tau = torch.tensor(0.1, dtype=dtype, requires_grad=True) if case.learn_tau else 0.1
    ring = {} if group is None else {"cross_device": "ring"}
    with _NoGather() as watch:
        out = case.loss(x, temperature=tau, reduction=case.reduction, backend=backend, process_group=group, **ring)
        (out.sum() if case.reduction == "none" else out).backward()
    grads = {k: v.grad.detach().clone() for k, v in x.items() if k in EMBEDDINGS}
    tau_grad = tau.grad.clone() if case.learn_tau else None
    return {"loss": out.detach().clone(), "grads": grads, "tau_grad": tau_grad, "rings": watch.rings}


def _ddp(seed: int, group) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = C.ddp_model(seed, group)
    model.loss = L.SupMPNLoss(0.1, learn_temperature=True, process_group=group, backend="torch", cross_device="ring")
    ddp = DDP(model.double(), process_group=group)
    with _NoGather() as watch:
        loss = ddp(*C.ddp_inputs(seed, dist.get_rank(group)))
        loss.backward()
    return {"loss": loss.detach(), "grads": C.param_grads(model), "rings": watch.rings}


def _errors(seed: int, group, rank: int, world: int) -> dict:
    """Loss-level failures that must raise on every rank with ``cross_device="ring"``."""
    g = C._gen(seed, "ring-errors", rank)
    a, p, n = C._randn(g, C.B, C.D), C._randn(g, C.B, 2, C.D), C._randn(g, C.B, 2, C.D)
    ring = dict(process_group=group, cross_device="ring")
    out = {}
    p_bad = C._randn(g, C.B, 3, C.D) if rank == world - 1 else p
    out["mismatch"] = C._error(lambda: L.supmpn_loss(a, p_bad, n, **ring))
    mask = torch.ones(C.B, 2, dtype=torch.int64 if rank == 0 else torch.bool)
    out["invalid-on-rank-0"] = C._error(lambda: L.supmpn_loss(a, p, n, neg_mask=mask, **ring))
    a2 = a[:, :4] if rank == 0 else a
    out["invalid-mnrl-directions"] = C._error(lambda: L.mnrl_loss(a2, a, directions=GTE, **ring))
    y = torch.arange(C.B) + rank * C.B  # every label once in the global batch
    out["labels-no-positive"] = C._error(lambda: L.supcon_loss(a, labels=y, **ring))
    out["bad-choice"] = C._error(lambda: L.supcon_loss(a, p, n, process_group=group, cross_device="rings"))
    # strategy="fused" where the ring cannot fuse its own block (inputs with gradients: the
    # strategy only matters then, as in one process)
    ag = a.clone().requires_grad_()
    dims = dict(matryoshka_dims=(4, 8))
    torch_dims = dict(dims, backend="torch")  # torch's sweep does not take dims (cpp's does)
    out["fused-with-dims"] = C._error(lambda: L.supmpn_loss(ag, p, n, strategy="fused", **torch_dims, **ring))
    out["fused-rows"] = C._error(lambda: L.supmpn_loss(ag, p, n, strategy="fused", reduction="none", **ring))
    return out


def _nonfinite(seed: int, group, rank: int) -> dict:
    """The non-finite contract (docs/contracts.md) through the ring: a NaN in a valid candidate of rank 0 makes
    every rank's loss NaN; one in a padded slot changes nothing and gets exactly zero gradient."""
    g = C._gen(seed, "ring-nonfinite", rank)
    a, p, n = C._randn(g, C.B, C.D), C._randn(g, C.B, 2, C.D), C._randn(g, C.B, 2, C.D)
    neg_mask = torch.ones(C.B, 2, dtype=torch.bool)
    neg_mask[0, 1] = False
    ring = dict(process_group=group, cross_device="ring", neg_mask=neg_mask, backend="torch")
    out = {}
    bad = n.clone()
    if rank == 0:
        bad[1, 0] = float("nan")  # a valid negative
    out["valid-nan"] = L.supmpn_loss(a, p, bad, **ring).detach()
    # the gradients too, with a cross-entropy head (whose dlse is 1 even on a NaN row): every
    # rank's own block, whose share the gradient-in-forward sweep forms, sees the NaN
    for strategy in ("auto", "recompute"):
        pos = p.clone().requires_grad_()
        L.supcon_loss(a, pos, bad, strategy=strategy, **ring).backward()
        out[f"valid-nan-grad-{strategy}"] = pos.grad.clone()
    padded = n.clone()
    padded[0, 1] = float("inf") if rank == 0 else float("nan")  # a padded slot on every rank
    zeroed = n.clone()
    zeroed[0, 1] = 0
    for name, negs in (("padded", padded), ("zeroed", zeroed)):
        negs = negs.requires_grad_()
        loss = L.supmpn_loss(a, p, negs, **ring)
        loss.backward()
        out[name] = (loss.detach(), negs.grad.clone())
    return out


def _second_order(seed: int, group, rank: int):
    """``create_graph=True`` gives first derivatives; differentiating them again raises."""
    g = C._gen(seed, "ring-second-order", rank)
    a = C._randn(g, C.B, C.D).requires_grad_()
    loss = L.infonce_loss(a, C._randn(g, C.B, C.D), process_group=group, cross_device="ring")
    (d_a,) = torch.autograd.grad(loss, a, create_graph=True)
    return d_a.detach(), C._error(lambda: d_a.square().sum().backward())


def worker(rank: int, world: int, store_path: str, out_dir: str, seed: int) -> None:
    def body() -> dict:
        group = dist.group.WORLD
        results = {"errors": _errors(seed, group, rank, world), "cases": {}}
        results["nonfinite"] = _nonfinite(seed, group, rank)
        results["second-order"] = _second_order(seed, group, rank)
        for case in CASES:
            x = C.inputs(case, seed, rank)
            for backend in BACKENDS:
                results["cases"][case.name, backend] = run_case(case, x, backend, group)
        results["ddp"] = _ddp(seed, group)
        return results

    run_rank(rank, world, store_path, out_dir, body, timeout_s=C.TIMEOUT_S)


if __name__ == "__main__":
    import tempfile

    import torch.multiprocessing as mp

    world, out = int(sys.argv[1]), sys.argv[2]
    os.makedirs(out, exist_ok=True)
    mp.spawn(worker, args=(world, tempfile.mktemp(prefix="fastcl_store_"), out, 0), nprocs=world)
    print("ok:", sorted(os.listdir(out)))

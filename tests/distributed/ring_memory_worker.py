"""The multi-process side of tests/distributed/test_ring_memory.py: each rank's extra peak
RSS of one forward + backward step, ring against gather, at a fixed per-rank batch.

The step is SupMPN's layout at the primitive (``ring_cases.layout``) on the torch backend in
float64, sized so that one rank's candidate block is ``BLOCK_MIB`` and dominates the noise.
Peak RSS is read as ``fastcl.bench.memory`` reads it (``VmHWM`` after ``clear_refs``, one
warm-up step first); the parent sets ``MALLOC_MMAP_THRESHOLD_`` so freed blocks leave RSS.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fastcl import distributed
from fastcl.bench.memory import measure_extra_rss
from fastcl.ops.contract import compute_dtype
from fastcl.ops.contrastive import contrastive_loss
from fastcl.ops.ring import ring_contrastive_loss
from tests.distributed import ring_cases as C
from tests.helpers.spawn import run_rank

B, P, Q, D = 32, 4, 4, 1024  # one rank's candidates: B * (P + Q) * D float64 = 2 MiB
CASE = C.Case("memory", P, Q, masks=False)
MODES = ("ring", "gather")


def _inputs(rank: int) -> dict:
    g = torch.Generator().manual_seed(rank)
    return {
        "anchor": torch.randn(B, D, generator=g, dtype=torch.float64).requires_grad_(),
        "positives": torch.randn(B, P, D, generator=g, dtype=torch.float64).requires_grad_(),
        "negatives": torch.randn(B, Q, D, generator=g, dtype=torch.float64).requires_grad_(),
    }


def step(mode: str, x: dict, group) -> None:
    tau = torch.tensor(0.1, dtype=torch.float64)
    args, has_pos = C.layout(CASE, x, tau)
    if mode == "ring":
        loss = ring_contrastive_loss(tau=tau, group=group, has_pos=has_pos, backend="torch", **args)
    else:
        sizes = {"B": B, "P": P, "Q": Q, "d": D}
        cd = compute_dtype(torch.float64)
        g = distributed.gather_candidates(
            args.pop("blocks"), args.pop("tags"), has_pos, sizes=sizes, reduction="mean",
            weight_dtype=cd, check_positive=False, group=group,
        )  # fmt: skip
        args["positives"] = type(args["positives"])(g.offset, P)
        loss = contrastive_loss(tau=tau, blocks=g.blocks, tags=g.tags, weights=g.weights, backend="torch", **args)
    loss.backward()
    for t in x.values():
        t.grad = None


def worker(rank: int, world: int, store_path: str, out_dir: str, seed: int) -> None:
    def body() -> dict:
        x = _inputs(rank)
        return {mode: measure_extra_rss(lambda mode=mode: step(mode, x, dist.group.WORLD)) for mode in MODES}

    run_rank(rank, world, store_path, out_dir, body, timeout_s=C.TIMEOUT_S)

"""One rank of tests/distributed/test_filters_distributed.py: the filtered losses with a process group.

Each rank draws its own float64 inputs (seeded by rank) and computes, with gradients for its
embeddings, ``gist_loss`` (guide filter; sentence-transformers' ``gather_across_devices``
semantics) and ``mnrl_loss(..., false_negative_margin=m)`` (self-margin filter), each with
``cross_device="gather"`` and ``"ring"``, on the ``torch`` backend and the other backends listed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.helpers.spawn import run_rank

B, D, G, Q = 4, 6, 5, 1
TIMEOUT_S = 120
BACKENDS = ("torch",)
GIST = dict(margin_strategy="relative", margin=0.2, temperature=0.1)


def inputs(seed: int, rank: int) -> dict:
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    a = torch.randn(B, D, generator=g, dtype=torch.float64)
    ga = torch.randn(B, G, generator=g, dtype=torch.float64)
    return {
        "anchor": a,
        "positive": a + torch.randn(B, D, generator=g, dtype=torch.float64),
        "negatives": torch.randn(B, Q, D, generator=g, dtype=torch.float64),
        "guide": (
            ga,
            ga + 0.8 * torch.randn(B, G, generator=g, dtype=torch.float64),
            torch.randn(B, Q, G, generator=g, dtype=torch.float64),
        ),
    }


def run(kind: str, x: dict, backend: str, group, cross_device: str):
    import fastcl.losses as L

    leaves = [x[k].clone().requires_grad_() for k in ("anchor", "positive", "negatives")]
    if kind == "gist":
        loss = L.gist_loss(
            *leaves, guide=x["guide"], backend=backend, process_group=group, cross_device=cross_device, **GIST
        )
    else:
        loss = L.mnrl_loss(
            *leaves, false_negative_margin=0.05, temperature=0.1, backend=backend, process_group=group,
            cross_device=cross_device,
        )  # fmt: skip
    return loss.detach(), [g.detach() for g in torch.autograd.grad(loss, leaves)]


def body(rank: int, seed: int) -> dict:
    x = inputs(seed, rank)
    out = {}
    for kind in ("gist", "self_margin"):
        for backend in BACKENDS:
            for cross_device in ("gather", "ring"):
                out[kind, backend, cross_device] = run(kind, x, backend, dist.group.WORLD, cross_device)
    return out


def worker(rank: int, world: int, store: str, tmp: str, seed: int) -> None:
    run_rank(rank, world, store, tmp, lambda: body(rank, seed), timeout_s=TIMEOUT_S)

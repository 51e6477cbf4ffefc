"""One rank of tests/distributed/test_settings_handshake.py: calls whose settings differ by rank.

Each case calls a loss with a setting that depends on the rank (gather on rank 0 and ring on
rank 1, different ``ring_pieces``, Matryoshka dims, losses, reductions); every rank records
the exception it got, then a barrier proves the group is still usable.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.helpers.spawn import run_rank

TIMEOUT_S = 60


def _inputs():
    g = torch.Generator().manual_seed(dist.get_rank())
    return torch.randn(4, 8, generator=g), torch.randn(4, 2, 8, generator=g)


def body(rank: int) -> dict:
    import fastcl.losses as L
    from fastcl import config

    a, p = _inputs()
    group = dist.group.WORLD
    cases = {
        "cross_device": lambda: L.supmpn_loss(a, p, process_group=group, cross_device="ring" if rank else "gather"),
        "ring_pieces": lambda: _with_pieces(
            config, 2 + rank, lambda: L.supmpn_loss(a, p, process_group=group, cross_device="ring")
        ),
        "dims": lambda: L.supmpn_loss(a, p, process_group=group, matryoshka_dims=(8, 4) if rank else (8, 2)),
        "loss": lambda: (L.supcon_loss if rank else L.supmpn_loss)(a, p, process_group=group),
        "reduction": lambda: L.supmpn_loss(a, p, process_group=group, reduction="sum" if rank else "mean"),
        "agree": lambda: L.supmpn_loss(a, p, process_group=group),
        # refused as in one process (the labels ring passed no strategy and accepted it)
        "labels_ring_fused_reference": lambda: L.supcon_labels_loss(
            a.requires_grad_(),
            torch.tensor([0, 0, 1, 1]),
            process_group=group,
            cross_device="ring",
            backend="reference",
            strategy="fused",
        ),
    }
    out = {}
    for name, call in cases.items():
        try:
            call()
            out[name] = None
        except Exception as exc:  # the parent checks type and message
            out[name] = (type(exc).__name__, str(exc))
        dist.barrier()  # still usable
    return out


def _with_pieces(config, pieces, fn):
    with config.override(ring_pieces=pieces):
        return fn()


def worker(rank: int, world: int, store: str, tmp: str, seed: int) -> None:
    run_rank(rank, world, store, tmp, lambda: body(rank), timeout_s=TIMEOUT_S)

"""One rank of tests/distributed/test_supcon_labels_distributed.py: labels-SupCon with a process group."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.helpers.spawn import run_rank

B, V, D = 5, 2, 6
TIMEOUT_S = 120


def inputs(seed: int, rank: int):
    g = torch.Generator().manual_seed(seed * 100 + rank)
    features = torch.randn(B, V, D, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 4, (B,), generator=g)
    return features, labels


def worker(rank: int, world: int, store_path: str, out_dir: str, seed: int) -> None:
    def body() -> dict:
        from fastcl.losses import supcon_loss

        features, labels = inputs(seed, rank)
        out = {}
        for backend in ("reference", "torch", "cpp"):
            for reduction in ("mean", "sum"):
                x = features.clone().requires_grad_()
                loss = supcon_loss(
                    x,
                    labels=labels,
                    temperature=0.2,
                    reduction=reduction,
                    backend=backend,
                    process_group=dist.group.WORLD,
                )
                loss.backward()
                out[(backend, reduction)] = (loss.detach(), x.grad)
        return out

    run_rank(rank, world, store_path, out_dir, body, timeout_s=TIMEOUT_S)

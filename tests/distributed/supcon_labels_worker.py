"""One rank of tests/distributed/test_supcon_labels_distributed.py: labels-SupCon with a process group."""

from __future__ import annotations

import os
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

B, V, D = 5, 2, 6
TIMEOUT_S = 120


def inputs(seed: int, rank: int):
    g = torch.Generator().manual_seed(seed * 100 + rank)
    features = torch.randn(B, V, D, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 4, (B,), generator=g)
    return features, labels


def worker(rank: int, world: int, store_path: str, out_dir: str, seed: int) -> None:
    try:
        torch.set_num_threads(1)
        from fastcl.losses import supcon_loss

        dist.init_process_group(
            "gloo",
            init_method=f"file://{store_path}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=TIMEOUT_S),
        )
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
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise

"""A torchrun-like rank for tests/train/test_train.py: env vars, then the ordinary CLI parse + loop."""

from __future__ import annotations

import os

import torch


def sgd(cfg, model):
    return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=cfg.lr)


def run_rank(rank: int, world: int, port: int, argvs: list[list[str]]) -> None:
    """Train each command line in ``argvs`` in turn, in one process group (spawn costs)."""
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )
    torch.set_num_threads(1)
    import torch.distributed as dist

    from fastcl.cli.train import parse
    from fastcl.trainers.loop import train

    try:
        for argv in argvs:
            recipe, cfg = parse(argv)
            recipe.build_optimizer = sgd
            train(recipe, cfg)
        if dist.is_initialized():
            dist.barrier()  # leave together (see examples/ddp.py); not after a failure: it would hang
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()

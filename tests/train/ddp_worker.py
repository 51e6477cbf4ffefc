"""A torchrun-like rank for tests/train/test_train.py: env vars, then `fastcl train` itself, per command line."""

from __future__ import annotations

import os

import torch


def sgd(cfg, model):
    return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=cfg.lr)


def run_rank(rank: int, world: int, ports: list[int], argvs: list[list[str]]) -> None:
    """Train each command line in ``argvs`` in turn through ``fastcl train`` (one spawn for all)."""
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
        }
    )
    torch.set_num_threads(1)
    import torch.distributed as dist

    import fastcl.cli
    from fastcl.__main__ import main
    from fastcl.trainers.registry import get_recipe

    # each through the CLI, as torchrun runs it: the group starts and ends with the run (a new
    # rendezvous port per run, as separate launches have)
    for argv, port in zip(argvs, ports, strict=True):
        os.environ["MASTER_PORT"] = str(port)
        recipe_class = type(get_recipe(argv[0]))
        recipe_class.build_optimizer = lambda self, cfg, model: sgd(cfg, model)
        assert main(["train", *argv]) == 0
        assert not dist.is_initialized(), "the CLI left its process group open"
        assert fastcl.cli._skip_teardown, "the CLI ended its group but would leave through the teardown"

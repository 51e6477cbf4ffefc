"""One rank of the 2-process gloo DDP run of tests/distributed/test_gradcache_ddp.py.

Usage: python -m tests.distributed.gradcache_ddp_worker RANK WORLD PORT OUT.pt. Two accumulation steps of
SimCSE-unsup with gradient caching (two cached calls per step): the first backward inside
the user's ``ddp.no_sync()``, the second synced. Saves the final parameter gradients and
how many bucket all-reduces each backward issued (and a plain DDP backward, for scale).
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from fastcl.cli import exit_process, skip_teardown
from fastcl.gradcache import GradCache
from fastcl.losses import infonce_loss
from tests.helpers.gradcache import make_batch, param_grads, tiny_encoder

N, CHUNK, STEPS = 7, 3, 2


def step_data(rank: int, step: int):
    """This rank's batch and dropout seed at this step (the test's oracle uses the same)."""
    return make_batch(N, seed=100 + 10 * rank + step), 1000 + 10 * rank + step


def main(rank: int, world: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    enc = tiny_encoder(dropout=0.1)
    ddp = DistributedDataParallel(enc)
    allreduces = []
    ddp.register_comm_hook(None, lambda state, bucket: allreduces.append(1) or allreduce_hook(state, bucket))

    gc = GradCache(ddp, chunk_size=CHUNK)
    per_step = []
    for step in range(STEPS):
        batch, seed = step_data(rank, step)
        torch.manual_seed(seed)
        loss = infonce_loss(gc(**batch), gc(**batch), temperature=0.05, backend="torch")
        accumulate_only = step < STEPS - 1
        with ddp.no_sync() if accumulate_only else torch.enable_grad():
            loss.backward()
        per_step.append(len(allreduces))
        allreduces.clear()
    grads = param_grads(enc)

    enc.zero_grad(set_to_none=True)
    ddp(**make_batch(4)).sum().backward()
    torch.save({"grads": grads, "allreduces": per_step, "plain_allreduces": len(allreduces)}, out)
    # both ranks done with every collective before gloo's threads are torn down, and DDP's
    # reducer gone first: without this, rank 0 was once seen to abort at exit in CI
    # ("terminate called without an active exception") on a loaded machine
    del gc, ddp
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
    # The results are saved and the group destroyed: leave without the interpreter's teardown,
    # where gloo's threads (kept alive by DDP) can abort the process (fastcl.cli.skip_teardown)
    skip_teardown()
    exit_process(0)

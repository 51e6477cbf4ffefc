"""Run a test's worker function on several spawned processes, with a deadline.

``target(rank, world, store_path, tmp, seed)`` writes ``rank{r}.pt`` (its results) or a
``*.err`` file (its traceback) into ``tmp``. Every process is killed as soon as one fails
or time runs out, so a broken collective never hangs the suite.
"""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Callable
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fastcl.cli import exit_process, skip_teardown


def spawn_ranks(target, world: int, tmp: str, seed: int, timeout_s: float) -> list[dict]:
    """The ``rank{r}.pt`` results of ``world`` processes (``pytest.fail`` on any error)."""
    ctx = mp.get_context("spawn")
    store = os.path.join(tmp, "store")
    procs = [ctx.Process(target=target, args=(r, world, store, tmp, seed), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    try:
        while any(p.is_alive() for p in procs):
            if time.monotonic() > deadline or any(p.exitcode not in (None, 0) for p in procs):
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
    errors = [open(os.path.join(tmp, f)).read() for f in sorted(os.listdir(tmp)) if f.endswith(".err")]
    if errors:
        pytest.fail(f"{world}-process run failed (seed {seed}):\n" + "\n".join(errors))
    codes = [p.exitcode for p in procs]
    if codes != [0] * world:
        pytest.fail(f"{world}-process run did not finish in {timeout_s}s or crashed: exit codes {codes}")
    return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(world)]


def run_rank(
    rank: int,
    world: int,
    store_path: str,
    out_dir: str,
    body: Callable[[], dict],
    *,
    timeout_s: float,
    before_group: Callable[[], None] | None = None,
) -> None:
    """The side of :func:`spawn_ranks` inside one process: a gloo group on the file store,
    ``body()``'s results saved as ``rank{r}.pt``, or the traceback as ``rank{r}.err``. Does not
    return: the process ends here (``os._exit(0)``), or with the exception."""
    try:
        torch.set_num_threads(1)
        if before_group is not None:
            before_group()
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store_path}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=timeout_s),
        )
        torch.save(body(), os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise
    # Results saved, group destroyed: leave without the interpreter's teardown, where gloo's
    # threads (kept alive by a DDP body's references) can abort the process
    skip_teardown()
    exit_process(0)

"""Gradient caching under DDP: two gloo processes on the CPU against a one-process oracle."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from fastcl.losses import infonce_loss
from tests.distributed.gradcache_ddp_worker import CHUNK, STEPS, N, step_data
from tests.helpers.gradcache import chunked_graph, one_thread, param_grads, tiny_encoder  # noqa: F401
from tests.helpers.roundoff import assert_grad_roundoff

WORLD = 2
TIMEOUT_S = 180
# tiny_encoder's sums behind a parameter gradient (hidden 32, intermediate 64, 2 layers, 11
# tokens): per layer the Q, K, V, attention-output and FFN-in projections' 32, FFN-out's 64 and
# attention's 11; mean pooling's 11; the loss's 32 coordinates and WORLD x N candidates by rows
# and by columns; the STEPS x WORLD accumulated halves
GRADCACHE_TERMS = 2 * (5 * 32 + 64 + 11) + 11 + 32 + 2 * WORLD * N + STEPS * WORLD

pytestmark = [
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo"),
    pytest.mark.usefixtures("one_thread"),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_workers(tmp_path: Path) -> list[dict]:
    root = Path(__file__).resolve().parents[2]  # the worker imports tests.helpers: run it as a module from the root
    port, outs = free_port(), [tmp_path / f"rank{r}.pt" for r in range(WORLD)]
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.distributed.gradcache_ddp_worker",
                str(r),
                str(WORLD),
                str(port),
                str(outs[r]),
            ],
            env=env,
            cwd=root,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(WORLD)
    ]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=TIMEOUT_S)[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"DDP workers did not finish in {TIMEOUT_S} s (a hang in the collective?)")
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} failed:\n{logs[r] if r < len(logs) else ''}"
    return [torch.load(o) for o in outs]


def oracle() -> dict:
    """The gradient DDP must produce: the mean over ranks of each rank's summed step gradients."""
    enc = tiny_encoder(dropout=0.1)
    for step in range(STEPS):
        for rank in range(WORLD):
            batch, seed = step_data(rank, step)
            torch.manual_seed(seed)
            a, p = chunked_graph(enc, batch, CHUNK), chunked_graph(enc, batch, CHUNK)
            (infonce_loss(a, p, temperature=0.05, backend="torch") / WORLD).backward()
    return param_grads(enc)


def test_two_process_ddp_equals_one_process(tmp_path):
    results = run_workers(tmp_path)
    want = oracle()
    # The ranks' halves are summed in another order than the oracle's: float32 round-off of the
    # tiny BERT's sums at logits of size 1/0.05, relative to the largest gradient entry (the size
    # of the terms that cancel in key biases, exactly 0 in theory).
    size = max(w.abs().max().item() for w in want.values())
    for rank, res in enumerate(results):
        assert res["grads"].keys() == want.keys()
        for name in want:
            assert_grad_roundoff(
                res["grads"][name],
                want[name],
                torch.float32,
                terms=GRADCACHE_TERMS,
                logit_scale=1 / 0.05,
                term_size=size,
                msg=f"rank {rank}, {name}",
            )
        # One sync per synced backward, covering both cached calls and all their chunks, just
        # like a plain DDP backward; none inside the user's no_sync().
        assert res["plain_allreduces"] >= 1
        assert res["allreduces"] == [0] * (STEPS - 1) + [res["plain_allreduces"]]

"""The labels-SupCon and ST-6 MNRL options on the ``triton`` backend, through the interpreter.

Both losses only compose fastcl's primitive, so every backend runs them; this checks the
Triton one on the CPU (``TRITON_INTERPRET=1`` must be set before Triton is imported, hence
a child process) against the float64 reference backend, values and gradients, tiny shapes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("triton")

CHILD = textwrap.dedent(
    """
    import torch
    import fastcl.losses as L

    def check(fn, inputs, what):
        got = fn("triton")
        want = fn("reference")
        g = torch.autograd.grad(got, inputs)
        w = torch.autograd.grad(want, inputs)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10, msg=what)
        for a, b in zip(g, w):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=what)

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 2, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    y = torch.tensor([0, 1, 0, 2, 1, 3])
    r = torch.randn(7, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    ry = torch.tensor([0, 0, 1, 2, 2, 3, 4])
    check(lambda b: L.supcon_loss(x, labels=y, temperature=0.1, backend=b), [x], "supcon labels")
    check(lambda b: L.supcon_labels_loss(x[:, 0], y, ref_emb=r, ref_labels=ry, temperature=0.2, backend=b),
          [x, r], "supcon labels with ref_emb")

    q, d, n = (torch.randn(5, 4, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(3))
    dirs = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")
    for mode in (None, "in_batch_negatives", "hard_negatives", "all_negatives"):
        check(lambda b: L.mnrl_loss(q, d, n, temperature=0.1, directions=dirs, hardness_mode=mode,
                                    hardness_strength=3.0, backend=b), [q, d, n], f"mnrl joint {mode}")
        check(lambda b: L.mnrl_loss(q, d, n, temperature=0.1, directions=dirs[::2], partition_mode="per_direction",
                                    hardness_mode=mode, hardness_strength=3.0, backend=b), [q, d, n], f"mnrl per_direction {mode}")
    print("ok")
    """
)


def test_triton_interpreter_matches_reference():
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", CHILD],
        cwd=Path(__file__).resolve().parents[2],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), (done.stdout + done.stderr)[-4000:]

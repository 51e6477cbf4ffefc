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
    from tests.helpers.roundoff import assert_grad_roundoff, assert_loss_roundoff

    # float64 against float64: a logit's d (<= 5) coordinates, a row's candidates (<= 3 x 5 for
    # MNRL's four directions, 12 views for SupCon) and a column's anchors; logits of size 1/0.1
    # plus a hardness term of size 3
    KW = dict(terms=5 + 20 + 12, logit_scale=13.0)

    def check(fn, inputs, what):
        got = fn("triton")
        want = fn("reference")
        g = torch.autograd.grad(got, inputs)
        w = torch.autograd.grad(want, inputs)
        assert_loss_roundoff(got, want, torch.float64, msg=what, **KW)
        for a, b in zip(g, w):  # may cancel: terms of size d logit / d x ~ 1 per unit of logit
            assert_grad_roundoff(a, b, torch.float64, term_size=1.0, msg=what, **KW)

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

"""Labels-SupCon with ``process_group``: a 2-process gloo run against one process on the global batch.

Each rank keeps its anchors and sees every rank's features as candidates and positives.
fastcl's distributed contract (``fastcl.distributed``): ``mean_r L_r`` equals the loss of
the concatenated batch in one process, and each rank's gradient is ``W`` times that loss's
gradient for its slice (so DDP's averaging gives the one-process gradient).
"""

from __future__ import annotations

import pytest
import torch

from fastcl.losses import supcon_loss
from tests.distributed import supcon_labels_worker as W
from tests.helpers.roundoff import assert_grad_roundoff, assert_loss_roundoff
from tests.helpers.spawn import spawn_ranks

WORLD = 2
SPAWN_TIMEOUT_S = 150
pytestmark = pytest.mark.timeout(SPAWN_TIMEOUT_S + 30)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    tmp = str(tmp_path_factory.mktemp("supcon_dist"))
    seed = int(torch.initial_seed() % 10_000)
    return seed, spawn_ranks(W.worker, WORLD, tmp, seed, SPAWN_TIMEOUT_S)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("backend", ["reference", "torch", "cpp"])
def test_gathered_supcon_labels_equals_one_process(ranks, backend, reduction):
    seed, results = ranks
    parts = [W.inputs(seed, r) for r in range(WORLD)]
    # the global batch as one process sees it: each rank's rows (flattened view-major), rank after rank
    flat = [torch.cat(torch.unbind(f, dim=1)) for f, _ in parts]
    x = torch.cat(flat).requires_grad_()
    y = torch.cat([lab.repeat(W.V) for _, lab in parts])
    ref = supcon_loss(x, labels=y, temperature=0.2, reduction=reduction, backend="reference")
    (ref_grad,) = torch.autograd.grad(ref, x)
    values = torch.stack([results[r][(backend, reduction)][0] for r in range(WORLD)])
    # float64: a logit's D coordinates, the global batch's WORLD x B x V rows as candidates and
    # as anchors (and their sum); logits of size 1/0.2
    kw = dict(terms=W.D + 2 * WORLD * W.B * W.V, logit_scale=1 / 0.2)
    assert_loss_roundoff(values.mean(), ref, torch.float64, **kw)
    n = W.B * W.V
    size = WORLD * ref_grad.abs().max().item()  # the terms a small entry cancels
    for r in range(WORLD):
        grad = results[r][(backend, reduction)][1]  # [B, V, d], this rank's features
        want = WORLD * ref_grad[r * n : (r + 1) * n].reshape(W.V, W.B, W.D).transpose(0, 1)
        assert want.abs().max() > 0
        assert_grad_roundoff(grad, want, torch.float64, **kw, term_size=size, msg=f"rank {r}")

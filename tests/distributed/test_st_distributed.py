"""``gather_across_devices=True`` is sentence-transformers' gathering: a 2-process gloo run.

On every rank, fastcl's losses with ``gather_across_devices=True`` (or an explicit
``process_group``) give the value and the embedding gradients of sentence-transformers'
``MultipleNegativesRankingLoss(gather_across_devices=True)`` (symmetric InfoNCE: its
``doc_to_query`` / ``per_direction`` form; sentence-transformers 6's directions and
hardness options, gathered; also with fastcl's ``cross_device="ring"``), its ``GISTEmbedLoss``
and ``CachedGISTEmbedLoss`` with ``gather_across_devices=True`` likewise (lookup stand-in
models: the value and each rank's embedding gradients); and a DDP-wrapped tiny BERT trained with
fastcl's cached MNRL gets the parameter gradients of sentence-transformers' cached MNRL.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("sentence_transformers")

from tests.distributed import st_worker as W  # noqa: E402
from tests.helpers.roundoff import assert_grad_roundoff, assert_loss_roundoff  # noqa: E402
from tests.helpers.spawn import spawn_ranks  # noqa: E402
from tests.helpers.st import ST_SCALE, assert_grads_close, assert_value_close  # noqa: E402

WORLD = 2
SPAWN_TIMEOUT_S = 150
pytestmark = pytest.mark.timeout(SPAWN_TIMEOUT_S + 30)
# float64 sums behind an embedding case's value or gradient entry: a logit's D coordinates, a
# row's candidates (up to 4 directions' blocks of the WORLD x B gathered rows) and a column's anchors
TERMS = W.D + 4 * WORLD * W.B + WORLD * W.B


def _logit_scale(case: str) -> float:
    """ST's scale 20 (GIST: 1/0.05) plus a hardness strength of up to 4; GIST's default 1/0.01."""
    return 1 / 0.01 if case == "gist_pairs_relative" else ST_SCALE + 4.0


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    tmp = str(tmp_path_factory.mktemp("st_dist"))
    seed = int(torch.initial_seed() % 10_000)
    return spawn_ranks(W.worker, WORLD, tmp, seed, SPAWN_TIMEOUT_S)


@pytest.mark.parametrize(
    "case",
    [
        "mnrl",
        "mnrl_group",
        "infonce_symmetric",
        "mnrl_gte_hardness",
        "mnrl_per_direction_hardness",
        "mnrl_ring",
        "mnrl_gte_hardness_ring",
        "gist",
        "gist_pairs_relative",
        "gist_ring",
        "gist_cached",
    ],
)
def test_gathered_loss_equals_sentence_transformers(ranks, case):
    for rank, result in enumerate(ranks):
        (ref_value, ref_grads), (value, grads) = result["embeddings"][case]
        kw = dict(terms=TERMS, logit_scale=_logit_scale(case))
        assert_loss_roundoff(value, ref_value, torch.float64, **kw, msg=f"rank {rank}")
        size = max(rg.abs().max().item() for rg in ref_grads)  # the terms a small entry cancels
        for i, (g, rg) in enumerate(zip(grads, ref_grads)):
            assert rg.abs().max() > 0, f"rank {rank} column {i}: zero reference gradient"
            assert_grad_roundoff(g, rg, torch.float64, **kw, term_size=size, msg=f"rank {rank} column {i}")


def test_gist_guide_drops_candidates_of_the_other_rank(ranks):
    """The gathered GIST cases exercise the filter across ranks, not only within one."""
    assert sum(r["gist_cross_rank_drops"] for r in ranks) > 0


def test_ddp_cached_parameter_gradients_equal_sentence_transformers(ranks):
    for rank, result in enumerate(ranks):
        ref_value, ref_grads = result["ddp_cached"]["st"]
        value, grads = result["ddp_cached"]["fastcl"]
        assert_value_close(value, ref_value, f"rank {rank}")
        assert_grads_close(grads, ref_grads, f"rank {rank}")
    # DDP averaged: both ranks hold the same parameter gradients, bitwise (two ranks: each entry
    # is one addition, a + b = b + a, then the same division)
    for k, g in ranks[0]["ddp_cached"]["fastcl"][1].items():
        torch.testing.assert_close(ranks[1]["ddp_cached"]["fastcl"][1][k], g, rtol=0, atol=0, msg=k)

"""Spearman / Pearson / ranks against SciPy, cosine against torch, STS aggregation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fastcl.eval.metrics import aggregate, paired_cosine, pearson, rankdata, spearman
from fastcl.testing import assert_roundoff, roundoff

scipy_stats = pytest.importorskip("scipy.stats")


@pytest.mark.parametrize("seed", range(5))
def test_spearman_and_pearson_match_scipy_with_ties(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 400))
    gold = rng.integers(0, 6, n) + rng.choice([0.0, 0.2, 0.4], n)  # STS-like, many ties
    pred = np.round(gold + rng.normal(0, 1.5, n), 1)  # ties on this side too
    # float64 sums over n (the means) and n (the products), whose terms, normalised by the
    # denominator, add up to at most 1 (Cauchy-Schwarz): an absolute error of size 1
    tol = roundoff(torch.float64, 2 * n)
    assert spearman(pred, gold) == pytest.approx(scipy_stats.spearmanr(pred, gold).statistic, abs=tol, rel=0)
    assert pearson(pred, gold) == pytest.approx(scipy_stats.pearsonr(pred, gold).statistic, abs=tol, rel=0)
    np.testing.assert_array_equal(rankdata(pred), scipy_stats.rankdata(pred))


def test_known_values():
    tol = roundoff(torch.float64, 2 * 4)  # as above, n <= 4
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0, abs=tol, rel=0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0, abs=tol, rel=0)
    assert spearman([1, 2, 3], [1, 3, 2]) == pytest.approx(0.5, abs=tol, rel=0)
    assert spearman(torch.tensor([0.1, 0.5, 0.2]), [1, 3, 2]) == pytest.approx(1.0, abs=tol, rel=0)
    assert np.isnan(spearman([1, 1, 1], [1, 2, 3]))  # constant side, as SciPy


def test_bad_inputs():
    with pytest.raises(ValueError, match="same length"):
        spearman([1, 2, 3], [1, 2])
    with pytest.raises(ValueError, match="at least 2"):
        spearman([1], [1])
    with pytest.raises(ValueError, match="NaN"):
        pearson([1, float("nan")], [1, 2])
    with pytest.raises(ValueError, match="1-D"):
        spearman(np.ones((2, 2)), np.ones((2, 2)))


def test_paired_cosine_matches_torch_and_handles_zero_rows():
    a, b = torch.randn(50, 16), torch.randn(50, 16)
    a[3] = 0
    got = paired_cosine(a, b)
    ref = torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1).numpy()
    # float64 both: a dot product and two norms of d = 16 coordinates, cosines of size 1
    assert_roundoff(torch.from_numpy(got), torch.from_numpy(ref), torch.float64, terms=3 * 16, magnitude=1.0)
    assert got[3] == 0.0
    with pytest.raises(ValueError, match=r"\(N, H\)"):
        paired_cosine(a, b[:10])


def test_aggregations():
    per = {"x": 80.0, "y": 60.0}
    sizes = {"x": 300, "y": 100}
    assert aggregate(per, sizes, 71.0, "all") == 71.0
    tol = roundoff(torch.float64, 2, 80.0)  # float64 sums of 2 scores (weighted: over 400 = the weights' sum)
    assert aggregate(per, sizes, 71.0, "mean") == pytest.approx(70.0, abs=tol, rel=0)
    assert aggregate(per, sizes, 71.0, "wmean") == pytest.approx(75.0, abs=tol, rel=0)
    with pytest.raises(ValueError, match="aggregation"):
        aggregate(per, sizes, 71.0, "median")

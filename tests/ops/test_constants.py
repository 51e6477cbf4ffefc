"""The per-shape constants of a loss call (``fastcl.ops.constants``: unmasked tags, a float
temperature, unmasked reduction weights) are made once and never written to: every backend's
forward and backward, fused and recompute, leave them bit for bit as made; masks and tensor
temperatures never take them; tracing modes and ``inference_mode`` never fill the cache."""

from __future__ import annotations

import pytest
import torch

import fastcl.losses as L
from fastcl.ops import constants
from tests.helpers.backends import backends_under_test, require


def _inputs(B=5, P=2, Q=3, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g).requires_grad_() for s in ((B, d), (B, P, d), (B, Q, d))]


def _steps(backend: str):
    a, p, n = _inputs()
    for strategy in ("fused", "recompute"):
        for reduction in ("mean", "sum"):
            for fn in (L.supmpn_loss, L.supcon_loss):
                fn(a, p, n, temperature=0.05, backend=backend, strategy=strategy, reduction=reduction).backward()
            L.mnrl_loss(a, p[:, 0], n[:, 0], temperature=0.05, backend=backend, reduction=reduction).backward()
            L.infonce_loss(a, p[:, 0], temperature=0.05, backend=backend, reduction=reduction).backward()


@pytest.mark.parametrize("backend", [b for b in backends_under_test() if b in ("reference", "torch", "cpp")])
def test_steps_reuse_the_constants_and_never_write_them(backend):
    require(backend)
    constants.clear()
    _steps(backend)
    made = dict(constants._cache)
    assert any(k[0] == "structured_tags" for k in made) and any(k[0] == "row_weights" for k in made)
    assert any(k[0] == "temperature" for k in made)
    snapshot = {k: v.clone() for k, v in made.items()}
    _steps(backend)
    for k, v in made.items():
        assert constants._cache.get(k) is v, f"{k} was made again"
        assert torch.equal(v, snapshot[k]), f"{k} was written to"


def test_masks_and_tensor_temperatures_are_not_cached():
    constants.clear()
    a, p, n = _inputs()
    pos_mask = torch.tensor([[True, False]] * 5)
    L.supmpn_loss(a, p, n, temperature=torch.tensor(0.05), pos_mask=pos_mask, backend="reference").backward()
    kinds = {k[0] for k in constants._cache}
    assert "row_weights" not in kinds and "temperature" not in kinds
    # the negatives have no mask: their tags are the unmasked grid's (cached); the positives' are not
    assert [k for k in constants._cache if k[0] == "structured_tags"] == [("structured_tags", 5, 3, False, "cpu")]


def test_tracing_and_inference_mode_do_not_fill_the_cache():
    constants.clear()
    a, p, n = _inputs()
    with torch.inference_mode():
        L.supmpn_loss(a.detach(), p.detach(), n.detach(), temperature=0.05, backend="reference")
    assert not constants._cache
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        t = constants.constant(("probe",), lambda: torch.ones(3))
    assert type(t) is not torch.Tensor and not constants._cache


def test_the_cache_is_bounded():
    constants.clear()
    for i in range(constants.MAX_ENTRIES + 10):
        constants.constant(("probe", i), lambda: torch.zeros(1))
    assert len(constants._cache) == constants.MAX_ENTRIES
    assert ("probe", 0) not in constants._cache and ("probe", constants.MAX_ENTRIES + 9) in constants._cache

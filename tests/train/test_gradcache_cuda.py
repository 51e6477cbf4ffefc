"""Gradient caching on a CUDA device: dropout replayed from the CUDA RNG, autocast, GradScaler.

The CPU versions of these checks are in ``test_gradcache.py``; here the encoder, the
batch and the RNG streams live on the GPU. Runs where ``FASTCL_TEST_DEVICE=cuda``
(``tests/helpers/backends.py``); skipped elsewhere.
"""

from __future__ import annotations

import pytest
import torch

from fastcl.gradcache import GradCache
from fastcl.losses import infonce_loss
from fastcl.testing import assert_roundoff
from tests.helpers.backends import device_under_test
from tests.helpers.gradcache import chunked_graph, make_batch, param_grads, tiny_encoder

DEVICE = device_under_test()
pytestmark = pytest.mark.skipif(DEVICE.type != "cuda", reason="needs FASTCL_TEST_DEVICE=cuda")
# The chunks' parameter gradients are summed in another order than the oracle's one graph,
# and CUDA's embedding backward accumulates with atomics (in any order): float32 round-off of
# a sum over both views' rows (2 x 10), terms of the gradient's size (fastcl.testing.roundoff).
# Under autocast both sides run the same 16-bit chunks; only the float32 sums differ.
ROWS = 20


def _setup(n: int):
    enc = tiny_encoder(dropout=0.1).to(DEVICE)
    batch = {k: v.to(DEVICE) for k, v in make_batch(n).items()}
    return enc, batch


def _step(enc, batch, encode, seed: int, dtype=None, scaler=None):
    enc.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    with torch.autocast("cuda", dtype=dtype or torch.float32, enabled=dtype is not None, cache_enabled=False):
        a, p = encode(batch), encode(batch)
        loss = infonce_loss(a, p, temperature=0.05)
    (scaler.scale(loss) if scaler else loss).backward()
    return a.detach(), p.detach(), param_grads(enc)


def _close(got: dict, want: dict):
    assert got.keys() == want.keys() and got
    for name in want:
        assert_roundoff(got[name], want[name], torch.float32, terms=ROWS, msg=name)


@pytest.mark.parametrize("chunk_size", [3, 16])
def test_dropout_replayed_from_the_cuda_rng(chunk_size):
    enc, batch = _setup(10)
    a0, p0, want = _step(enc, batch, lambda b: chunked_graph(enc, b, chunk_size), seed=1)
    after_oracle = torch.cuda.get_rng_state()
    gc = GradCache(enc, chunk_size=chunk_size)
    a1, p1, got = _step(enc, batch, lambda b: gc(**b), seed=1)
    assert torch.equal(torch.cuda.get_rng_state(), after_oracle), "the replay moved the caller's CUDA RNG"
    assert torch.equal(a1, a0) and torch.equal(p1, p0)
    assert not torch.allclose(a1, p1), "dropout is off: the two views are identical"
    _close(got, want)
    _, _, other = _step(enc, batch, lambda b: gc(**b), seed=2)  # control: other masks, other gradients
    name = "model.encoder.layer.0.output.dense.weight"
    assert not torch.allclose(other[name], want[name], rtol=1e-3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_and_grad_scaler(dtype):
    enc, batch = _setup(9)
    gc = GradCache(enc, chunk_size=4)
    scale = 2.0**10 if dtype == torch.float16 else 1.0
    runs = []
    for encode in (lambda b: chunked_graph(enc, b, 4), lambda b: gc(**b)):
        scaler = torch.amp.GradScaler("cuda", init_scale=scale) if dtype == torch.float16 else None
        runs.append(_step(enc, batch, encode, seed=3, dtype=dtype, scaler=scaler))
    (a0, _, want), (a1, _, got) = runs
    assert a1.dtype == a0.dtype and torch.equal(a1, a0)
    _close(got, want)  # scaled by the GradScaler's scale: so is the bound (max |want|)
    assert all(torch.isfinite(g).all() for g in got.values())

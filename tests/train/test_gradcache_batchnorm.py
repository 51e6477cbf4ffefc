"""GradCache with norm layers that keep running statistics (BatchNorm, tracked InstanceNorm).

The first (no-grad) pass runs each chunk once, which updates the running statistics exactly
as one uncached forward per chunk would; the replay in backward must leave them as they are
(it used to update them a second time: ``num_batches_tracked`` 8 instead of 4).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from fastcl.gradcache import GradCache
from fastcl.losses import infonce_loss
from fastcl.testing import assert_roundoff
from tests.helpers.gradcache import one_thread, param_grads  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")
N, CHUNK = 16, 4
# the parameter gradients sum the 2 N rows' contributions in another order (chunk by chunk):
# float32 round-off of 2 N terms of the gradient's size (fastcl.testing.roundoff)
GRAD_TERMS = 2 * N


class BNEncoder(nn.Module):
    """Linear -> BatchNorm1d -> dropout -> Linear, plus a tracked InstanceNorm1d over a 3-d view."""

    def __init__(self, momentum=0.1):
        super().__init__()
        self.inp = nn.Linear(8, 12)
        self.bn = nn.BatchNorm1d(12, momentum=momentum)
        self.inorm = nn.InstanceNorm1d(3, affine=True, track_running_stats=True, momentum=momentum)
        self.drop = nn.Dropout(0.2)
        self.out = nn.Linear(12, 6)

    def forward(self, x):
        h = self.bn(self.inp(x))
        h = self.inorm(h.view(-1, 3, 4)).view(-1, 12)
        return self.out(self.drop(torch.relu(h)))


def _stats(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: b.detach().clone() for k, b in module.named_buffers()}


def _step(encode, x, seed=3):
    torch.manual_seed(seed)
    a, p = encode(x), encode(x)
    infonce_loss(a, p, temperature=0.1, backend="torch").backward()


def _oracle(enc: nn.Module, x: torch.Tensor):
    """One uncached forward per chunk, all in one graph: buffers and gradients to match."""
    ref = copy.deepcopy(enc)

    def encode(t):
        return torch.cat([ref(x=t[s : s + CHUNK]) for s in range(0, t.shape[0], CHUNK)])

    _step(encode, x)
    return _stats(ref), param_grads(ref)


def _assert_buffers_equal(got: dict, want: dict):
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), f"{k}: {got[k]} != {want[k]}"


@pytest.mark.parametrize("momentum", [0.1, None])  # None: cumulative average, driven by num_batches_tracked
@pytest.mark.parametrize("wrap", ["module", "callable"])
def test_running_stats_equal_one_forward_per_chunk(momentum, wrap):
    torch.manual_seed(0)
    enc = BNEncoder(momentum).train()
    x = torch.randn(N, 8)
    want_stats, want_grads = _oracle(enc, x)
    # a plain callable hides the modules: GradCache must find the norm layers as they run
    encode_fn = enc if wrap == "module" else (lambda **kw: enc(**kw))
    gc = GradCache(encode_fn, chunk_size=CHUNK)
    _step(lambda t: gc(x=t), x)
    got = _stats(enc)
    # two calls (anchor, positive) x 4 chunks, each run once as far as the statistics go
    # (InstanceNorm updates its running mean and variance but never counts batches)
    assert int(got["bn.num_batches_tracked"]) == 2 * N // CHUNK
    _assert_buffers_equal(got, want_stats)
    grads = param_grads(enc)
    assert grads.keys() == want_grads.keys()
    for k in want_grads:
        assert_roundoff(grads[k], want_grads[k], torch.float32, terms=GRAD_TERMS, msg=k)


def test_running_stats_restored_when_replay_fails():
    """An error inside the replay must not leave half-updated statistics behind."""
    torch.manual_seed(0)
    enc = BNEncoder().train()
    x = torch.randn(N, 8)
    gc = GradCache(enc, chunk_size=CHUNK)
    emb = gc(x=x)
    after_first_pass = _stats(enc)
    calls = {"n": 0}
    real_forward = enc.out.forward

    def fail_on_second_replayed_chunk(h):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("boom")
        return real_forward(h)

    enc.out.forward = fail_on_second_replayed_chunk
    with pytest.raises(RuntimeError, match="boom"):
        emb.sum().backward()
    _assert_buffers_equal(_stats(enc), after_first_pass)


def test_eval_mode_batchnorm_is_untouched():
    torch.manual_seed(0)
    enc = BNEncoder().eval()
    enc.drop.train()  # still something to replay
    x = torch.randn(N, 8)
    before = _stats(enc)
    gc = GradCache(enc, chunk_size=CHUNK)
    _step(lambda t: gc(x=t), x)
    _assert_buffers_equal(_stats(enc), before)


def test_checkpointed_encoder_recomputation_is_undone_too():
    """Activation checkpointing re-runs the forward during the replay's backward: a third
    update of the statistics that must be undone as well. (Non-reentrant: the reentrant
    form needs an input that requires grad, which a raw feature tensor here is not.)"""
    from torch.utils.checkpoint import checkpoint

    class Checkpointed(BNEncoder):
        def forward(self, x):
            return checkpoint(super().forward, x, use_reentrant=False)

    torch.manual_seed(0)
    enc = Checkpointed().train()
    x = torch.randn(N, 8)
    plain = BNEncoder().train()
    plain.load_state_dict(enc.state_dict())
    want_stats, want_grads = _oracle(plain, x)
    gc = GradCache(enc, chunk_size=CHUNK)
    _step(lambda t: gc(x=t), x)
    _assert_buffers_equal(_stats(enc), want_stats)
    grads = param_grads(enc)
    for k in want_grads:
        assert_roundoff(grads[k], want_grads[k], torch.float32, terms=GRAD_TERMS, msg=k)

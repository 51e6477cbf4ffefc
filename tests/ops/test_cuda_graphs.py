"""A ``triton`` loss step in a CUDA graph (``fastcl.graphs.capture_step``, and
``torch.compile(mode="reduce-overhead")``) gives eager's loss and gradients, replay after
replay with new input values; the scratch a capture uses stays pinned (CPU test).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from fastcl.kernels import plan  # noqa: E402
from tests.helpers.roundoff import assert_loss_and_grads_roundoff

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_scratch_used_by_a_capture_is_pinned(monkeypatch):
    """Buffers handed out while a graph is captured are never released (the graph replays
    into them); other layouts are dropped beyond plan.KEEP or by release_scratch."""
    plan.release_scratch(include_pinned=True)
    dev = torch.device("cpu")
    monkeypatch.setattr(plan, "_capturing", lambda device: True)
    pinned = plan.scratch(dev, {"x": ((3,), torch.float32)})["x"]
    monkeypatch.setattr(plan, "_capturing", lambda device: False)
    for n in range(plan.KEEP + 2):  # more unpinned layouts than are kept
        plan.scratch(dev, {"x": ((10 + n,), torch.float32)})
    assert plan.scratch(dev, {"x": ((3,), torch.float32)})["x"] is pinned
    assert plan.scratch(dev, {"x": ((10,), torch.float32)})["x"].shape == (10,)  # evicted, made again
    plan.release_scratch()
    assert plan.scratch(dev, {"x": ((3,), torch.float32)})["x"] is pinned
    plan.release_scratch(include_pinned=True)
    assert plan.scratch(dev, {"x": ((3,), torch.float32)})["x"] is not pinned


def _inputs(B=512, P=3, Q=2, d=128, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(*s, device="cuda", generator=gen).bfloat16() for s in ((B, d), (B, P, d), (B, Q, d))]


@cuda
def test_captured_step_equals_eager_across_replays():
    import fastcl.losses as L
    from fastcl.graphs import capture_step

    leaves = [x.clone().requires_grad_() for x in _inputs()]
    step = capture_step(lambda: L.supmpn_loss(*leaves, temperature=0.05, backend="triton"), leaves)
    for seed in (1, 2, 3):
        fresh = _inputs(seed=seed)
        with torch.no_grad():
            for x, y in zip(leaves, fresh):
                x.copy_(y)
        loss = step()
        ref = [y.clone().requires_grad_() for y in fresh]
        want = L.supmpn_loss(*ref, temperature=0.05, backend="triton")
        want.backward()
        assert torch.equal(loss, want)  # deterministic kernels: bitwise
        for x, y in zip(leaves, ref):
            assert torch.equal(x.grad, y.grad)


@cuda
def test_reduce_overhead_compile_equals_eager():
    import fastcl.losses as L

    leaves = [x.clone().requires_grad_() for x in _inputs()]
    ref = [x.clone().detach().requires_grad_() for x in leaves]
    compiled = torch.compile(
        lambda a, p, n: L.supmpn_loss(a, p, n, temperature=0.05, backend="triton"), mode="reduce-overhead"
    )
    for _ in range(3):
        for x in leaves:
            x.grad = None
        loss = compiled(*leaves)
        loss.backward()
    want = L.supmpn_loss(*ref, temperature=0.05, backend="triton")
    want.backward()
    # bfloat16 outputs of float32 sums over d + N + B terms with logits of size 1/tau
    # (tests/helpers/roundoff.py)
    B, P, Q, d = 512, 3, 2, 128
    assert_loss_and_grads_roundoff(
        loss, want, [x.grad for x in leaves], [y.grad for y in ref], torch.bfloat16,
        terms=d + B * (1 + P + Q) + B, logit_scale=1 / 0.05,
    )  # fmt: skip


@cuda
@pytest.mark.parametrize("masked", [False, True])
def test_a_warm_cuda_step_makes_no_host_sync(masked):
    """``torch.cuda.set_sync_debug_mode("error")`` raises on any synchronising call: a warm
    step, masks included, makes none; a mask with no valid positive gives NaN, not an error."""
    import fastcl.losses as L

    leaves = [x.requires_grad_() for x in _inputs()]
    mask = torch.ones(512, 3, dtype=torch.bool, device="cuda") if masked else None

    def step(m):
        for x in leaves:
            x.grad = None
        loss = L.supmpn_loss(*leaves, pos_mask=m, temperature=0.05, backend="triton")
        loss.backward()
        return loss

    step(mask)  # compile
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss = step(mask)
        empty = step(torch.zeros_like(mask)) if masked else None
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(loss)
    if masked:
        assert torch.isnan(empty)

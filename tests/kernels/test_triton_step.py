"""The host side of a ``triton`` loss step, planned for an H100 (dry runs, no GPU needed).

A warm SupMPN or InfoNCE step at the benchmark's shapes issues at most 45 operations counted
strictly (every Triton launch and every ATen op that is not a view, allocations included;
``StepAccount.strict``), reads no device value on the host, allocates no
scratch (the launchers' buffers are cached per shape) and allocates nothing beyond its
outputs; a new batch size plans new buffers without retuning anything. Run in the
interpreter suite (``TRITON_INTERPRET=1``: the backend takes CPU tensors); the kernels are
recorded, not launched (``benchmarks.harness.launches``).
"""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("the Triton interpreter suite runs with TRITON_INTERPRET=1 in its own process", allow_module_level=True)
pytest.importorskip("triton")

import fastcl.losses as L  # noqa: E402
from benchmarks.harness.launches import account  # noqa: E402
from fastcl.kernels import configs, plan  # noqa: E402

MAX_LAUNCHES = 45
H100 = dict(dry_arch="sm90", sms=132)


def _inputs(shapes, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(*s, generator=gen).to(dtype).requires_grad_() for s in shapes]


def _supmpn(B=4096, P=5, Q=5, d=768, **kw):
    a, p, n = _inputs(((B, d), (B, P, d), (B, Q, d)))
    return (a, p, n), lambda: L.supmpn_loss(a, p, n, temperature=0.05, backend="triton", **kw)


def _infonce(B=16384, d=768):
    a, p = _inputs(((B, d), (B, d)))
    return (a, p), lambda: L.infonce_loss(a, p, temperature=0.05, backend="triton")


def _mnrl(B=4096, d=768):
    q, p, n = _inputs(((B, d), (B, d), (B, d)))
    return (q, p, n), lambda: L.mnrl_loss(q, p, n, temperature=0.05, backend="triton")


def _warm_step(leaves, loss_fn):
    """One step to warm the caches, then the accounted one (gradients set to None between,
    as an optimiser's ``zero_grad`` does); ``acct.new_scratch``: scratch buffers the second
    step allocated."""
    for _ in range(2):
        for x in leaves:
            x.grad = None
        before = plan.scratch_allocations()
        with account(**H100) as acct:
            loss_fn().backward()
    acct.new_scratch = plan.scratch_allocations() - before
    return acct


@pytest.mark.parametrize("case", [_supmpn, _infonce, _mnrl], ids=["supmpn-B4096-P5-Q5", "infonce-B16384", "mnrl-B4096"])
def test_a_step_issues_at_most_45_launches(case):
    leaves, loss_fn = case()
    acct = _warm_step(leaves, loss_fn)
    print(f"\n{case.__name__}: {acct.summary()}")
    assert acct.strict <= MAX_LAUNCHES, acct.summary()
    # the per-shape constants (tags, weights, a float temperature) are reused, not rebuilt:
    # what ATen work is left is autograd's seed
    assert acct.aten == ["ones_like"], acct.summary()
    assert acct.triton, "no Triton kernel was recorded: the step did not take the triton backend"
    assert "_head_kernel" in acct.triton and "_sum_kernel" in acct.triton  # the head is fused


def test_launch_count_is_a_real_count():
    """The accounting sees what a step does: the unfused path (a Matryoshka loss takes the
    primitive and the PyTorch head) issues many more launches, and those include the head's ops."""
    leaves, loss_fn = _supmpn(B=512, d=64, matryoshka_dims=(64, 32))
    acct = _warm_step(leaves, loss_fn)
    assert acct.launches > MAX_LAUNCHES and "logaddexp" in acct.aten, acct.summary()


@pytest.mark.parametrize("case", [_supmpn, _infonce, _mnrl], ids=["supmpn", "infonce", "mnrl"])
def test_a_warm_step_makes_no_host_sync(case):
    leaves, loss_fn = case()
    acct = _warm_step(leaves, loss_fn)
    assert acct.syncs == [], acct.syncs


def test_the_sync_check_catches_a_sync():
    (a, p), _ = _infonce(B=64, d=16)
    with account(**H100) as acct:
        bool((a > 0).any())
    assert acct.syncs == ["_local_scalar_dense"]


def test_a_warm_step_allocates_no_scratch_and_only_its_outputs():
    leaves, loss_fn = _supmpn()
    acct = _warm_step(leaves, loss_fn)
    assert acct.new_scratch == 0, "the second step allocated scratch"
    # what is left: the gradients (the inputs' size), per-row vectors (tags, weights, head
    # outputs, row scales) and scalars; nothing of the B x N logits' size
    B, N = 4096, 4096 * 10
    small = [(op, s, dt) for op, s, dt in acct.allocations if torch.Size(s).numel() <= 16 * (B + N)]
    big = [(op, s) for op, s, _ in acct.allocations if torch.Size(s).numel() > 16 * (B + N)]
    assert sorted(torch.Size(s).numel() for _, s in big) == sorted(x.numel() for x in leaves), big
    assert sum(torch.Size(s).numel() * torch.empty((), dtype=dt).element_size() for _, s, dt in small) <= 64 * (B + N)


def test_a_new_batch_size_plans_without_tuning(monkeypatch):
    """Configs come from the table: a step at a new batch size looks up the same entries
    (nothing is timed; the tuner is never imported) and only plans new buffers."""
    import sys

    looked = []
    real = configs.lookup
    monkeypatch.setattr(configs, "lookup", lambda *a: looked.append(a) or real(*a))
    for B in (1000, 1024):
        leaves, loss_fn = _supmpn(B=B, d=64)
        _warm_step(leaves, loss_fn)
    assert {a[0] for a in looked} >= {"rows", "fwd", "head", "ds", "mm"}
    assert all(a[1] == "sm90" for a in looked)
    assert "benchmarks.triton_tools.tune" not in sys.modules


def test_the_tuner_times_each_candidate_with_it_in_effect(tmp_path):
    """``python -m benchmarks.triton_tools.tune``'s loop, planned for an H100 with the kernels mocked:
    each candidate's step runs with that candidate's config (the recorded launches say so),
    the fastest by the timer wins, and the written table is what lookups then read."""
    from benchmarks.triton_tools import tune
    from fastcl.kernels._common import recording

    seen = []

    def timer(fn, rounds):
        with recording(dry=True, arch="sm90", sms=132) as rec:
            fn()
        ds = {x.config for x in rec if x.kernel == "_lse_ds_kernel"}
        assert len(ds) == 1
        (cfg,) = ds
        seen.append(cfg)
        return float(cfg["BN"] * 1000 + cfg["BM"] + cfg.num_stages)  # narrowest tiles "fastest"

    with recording(dry=True, arch="sm90", sms=132):
        winners = tune.tune(
            256, 64, torch.bfloat16, rounds=2, roles=("ds",), log=lambda *_: None, device="cpu", timer=timer
        )
    cands = configs.candidates("ds", "sm90", "16")
    assert set(seen) == set(cands)  # every candidate timed, with itself in effect
    ((key, best),) = winners.items()
    assert key == "ds/sm90/16/small"
    assert best == min(cands, key=lambda c: (c["BN"], c["BM"], c.num_stages))
    path = tmp_path / "sm90.json"
    configs.write_table(path, winners)
    assert configs.read_table(path)[key].meta == best.meta


def test_a_loss_without_masks_skips_the_padding_masks_and_gets_the_same_gradients():
    """No masks: the loss promises no padding tag (``LSEProblem.padded=False``) and the
    anchors' GEMM loads candidate rows unmasked (``PAD_K`` off, fully pipelined); all-true
    masks take the masked path. Same gradients, bitwise."""
    from fastcl.kernels._common import recording

    grads, flags = [], []
    for masks in (None, True):
        a, p, n = _inputs(((19, 40), (19, 3, 40), (19, 2, 40)), torch.float32)
        kw = {}
        if masks:
            kw = dict(pos_mask=torch.ones(19, 3, dtype=torch.bool), neg_mask=torch.ones(19, 2, dtype=torch.bool))
        with recording() as rec:
            L.supmpn_loss(a, p, n, temperature=0.1, backend="triton", **kw).backward()
        flags.append(
            {dict(x.constexprs)["PAD_K"] for x in rec if x.kernel == "_mm_kernel" and not dict(x.constexprs)["X_T"]}
        )
        grads.append([x.grad for x in (a, p, n)])
    assert flags == [{False}, {True}]
    for x, y in zip(*grads):
        assert torch.equal(x, y)

"""The ``"cpp"`` backend's fused Matryoshka ops (``lse_prefix_forward`` / ``lse_prefix_backward``
and the gradient-in-forward ``lse_prefix_fused``, both heads) beyond the shared contract test:
16-bit inputs, cosine and dot, padding and empty rows, non-finite and huge rows, dims orders
and counts, block edges, threads, determinism and opcheck.
Every value and gradient against the float64 oracle of tests/helpers/matryoshka.py."""

from __future__ import annotations

import pytest
import torch

from fastcl.ops import _cpp
from fastcl.ops.contract import TAG_PADDING, LSEProblem, poison_outputs
from fastcl.ops.head import HeadInputs, head_rows
from fastcl.testing import assert_roundoff
from tests.helpers.backends import require
from tests.helpers.matryoshka import check_backend, check_fused, check_roundoff, oracle, prefix_problem

TAU = 0.1


@pytest.fixture(autouse=True)
def _cpp_available():
    require("cpp")


def _check(prob, **kw):
    """The forward and backward ops, and the fused step (lse_prefix_fused) with either head,
    within the round-off of the problem's dtype (tests/helpers/matryoshka.py)."""
    with poison_outputs():  # every output element must be written
        check_backend(_cpp.BACKEND, prob, TAU, **kw)
        for kind in ("cross_entropy", "softplus"):
            check_fused(_cpp.BACKEND, prob, TAU, kind=kind, **kw)


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cosine", [True, False])
@pytest.mark.parametrize("own", [0, 2])
def test_sixteen_bit_inputs(dtype, cosine, own):
    """16-bit inputs run in float32 on the same (rounded) values the oracle reads."""
    prob = prefix_problem(9, 14, 6, 45, (45, 9, 30), dtype=dtype, cosine=cosine, own=own, generator=_gen(1))
    _check(prob)


@pytest.mark.parametrize("K", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("cosine", [True, False])
def test_dims_in_any_order_and_count(K, cosine):
    d = 53  # no multiple of a block or vector width
    dims = tuple(torch.randperm(d, generator=_gen(K))[:K].add(1).tolist())
    prob = prefix_problem(8, 12, 5, d, dims, cosine=cosine, own=1, generator=_gen(K))
    _check(prob)
    _check(prefix_problem(8, 12, 5, d, dims, dtype=torch.float32, cosine=cosine, generator=_gen(K)))


def test_one_prefix_is_the_plain_problem():
    prob = prefix_problem(7, 10, 4, 20, (20,), own=2, generator=_gen(3))
    plain = LSEProblem(prob.anchor, prob.blocks, prob.tags, prob.cosine, positives=prob.positives)
    tau = torch.tensor(TAU, dtype=torch.float64)
    lse, ml = _cpp.BACKEND.forward(prob, tau)
    want_lse, want_ml = _cpp.BACKEND.forward(plain, tau)
    check_roundoff("lse", lse[0], want_lse, prob, TAU, logits=True)
    check_roundoff("mean_logit", ml[0], want_ml, prob, TAU, logits=True)
    g, d_pos = torch.rand(1, 7, dtype=torch.float64), torch.randn(1, 7, 2, dtype=torch.float64)
    got = _cpp.BACKEND.backward(prob, tau, lse, g, d_pos)
    want = _cpp.BACKEND.backward(plain, tau, want_lse, g[0], d_pos[0])
    for i, (x, y) in enumerate(zip((got[0], *got[1]), (want[0], *want[1]))):
        check_roundoff(f"gradient {i}", x, y, prob, TAU, logits=False)


@pytest.mark.parametrize("kind", ["cross_entropy", "softplus"])
def test_fused_log_extra_per_prefix(kind):
    """``log_extra [K, B]`` (the ring's other blocks' ``lse`` per prefix, fastcl/ops/ring.py):
    prefix ``k``'s head reads row ``k``, whatever order the dims come in; each prefix equals
    the plain sweep on ``prefix(k)`` with that row, and the gradients are their sum."""
    g = _gen(7)
    dims = (12, 4, 8)
    prob = prefix_problem(6, 9, 5, 12, dims, generator=g)
    K, B, P = len(dims), 6, 2
    tau = torch.tensor(TAU, dtype=torch.float64)
    pos = torch.randn(K, B, P, generator=g, dtype=torch.float64)
    extra = torch.randn(K, B, generator=g, dtype=torch.float64)
    extra[1, 2] = float("-inf")  # no mass beyond this block for one row of one prefix
    weights = torch.rand(K, B, generator=g, dtype=torch.float64)
    with poison_outputs():
        got = _cpp.BACKEND.fused(prob, tau, HeadInputs(kind, pos, None, extra, weights))
    d_anchor = torch.zeros_like(prob.anchor)
    d_blocks = [torch.zeros_like(b) for b in prob.blocks]
    for k, m in enumerate(dims):
        want = _cpp.BACKEND.fused(prob.prefix(k), tau, HeadInputs(kind, pos[k], None, extra[k], weights[k]))
        check_roundoff("loss_rows", got.loss_rows[k], want.loss_rows, prob, TAU, logits=True)
        check_roundoff("lse", got.lse[k], want.lse, prob, TAU, logits=True)
        d_anchor[:, :m] += want.d_anchor
        for acc, w in zip(d_blocks, want.d_blocks):
            acc[:, :m] += w
    check_roundoff("d_anchor", got.d_anchor, d_anchor, prob, TAU, logits=False)
    for gb, wb in zip(got.d_blocks, d_blocks):
        check_roundoff("d_block", gb, wb, prob, TAU, logits=False)
    with pytest.raises(RuntimeError, match=r"log_extra must be \[B\]"):
        _cpp.BACKEND.fused(prob.prefix(0), tau, HeadInputs(kind, pos[0], None, extra, weights[0]))


@pytest.mark.parametrize("cosine", [True, False])
@pytest.mark.parametrize("all_padded", [False, True])
def test_empty_rows_and_all_padding(cosine, all_padded):
    """Rows without candidates get lse -inf, mean 0 and no gradient; padded candidates none."""
    B, N0, N1, d = 6, 4, 5, 19
    a, b0, b1 = (torch.randn(n, d, generator=_gen(4), dtype=torch.float64) for n in (B, N0, N1))
    t0 = torch.tensor([-2] * N0 if all_padded else [4, -2, 4, 4], dtype=torch.int32)  # row 4 loses all
    t1 = torch.full((N1,), TAG_PADDING, dtype=torch.int32)
    prob = LSEProblem(a, (b0, b1), (t0, t1), cosine, dims=(7, 19, 2))
    _check(prob)
    lse, _ = _cpp.BACKEND.forward(prob, torch.tensor(TAU, dtype=torch.float64))
    empty = torch.isneginf(lse)
    assert empty.all() if all_padded else (empty[:, 4].all() and empty.sum() == 3)


@pytest.mark.parametrize("B, N0, N1", [(0, 5, 3), (4, 0, 0), (1, 1, 0), (5, 0, 4)])
@pytest.mark.parametrize("cosine", [True, False])
def test_degenerate_shapes(B, N0, N1, cosine):
    """No anchors, no candidates, single rows; a prefix of one coordinate."""
    a, b0, b1 = (torch.randn(n, 6, generator=_gen(5), dtype=torch.float64) for n in (B, N0, N1))
    tags = (torch.full((N0,), -1, dtype=torch.int32), torch.full((N1,), -1, dtype=torch.int32))
    _check(LSEProblem(a, (b0, b1), tags, cosine, dims=(4, 1, 6)))


def _nan_outputs(prob):
    """The fused outputs, the oracle's values and the summed gradients of the K plain problems
    run one by one on the plain cpp ops (the non-finite rules of the plain path)."""
    K, B = prob.num_prefixes, prob.num_anchors
    g = torch.rand(K, B, generator=_gen(6), dtype=torch.float64)
    tau = torch.tensor(TAU, dtype=torch.float64)
    lse, ml = _cpp.BACKEND.forward(prob, tau)
    d_a, d_b = _cpp.BACKEND.backward(prob, tau, lse, g)
    plain = [torch.zeros_like(t) for t in (prob.anchor, *prob.blocks)]
    for k, m in enumerate(prob.prefixes):
        sub = prob.prefix(k)
        d_a_k, d_b_k = _cpp.BACKEND.backward(sub, tau, _cpp.BACKEND.forward(sub, tau)[0], g[k])
        for total, part in zip(plain, (d_a_k, *d_b_k)):
            total[:, :m] += part
    return (lse, ml), oracle(prob, TAU, g)[:2], (d_a, *d_b), plain


def test_nan_in_a_padded_row_reaches_nothing():
    prob = prefix_problem(7, 9, 8, 24, (24, 5, 12), generator=_gen(7))
    padded = int((prob.tags[1] == TAG_PADDING).nonzero()[0])
    prob.blocks[1][padded] = float("nan")
    prob.blocks[1][padded, 0] = float("inf")
    _check(prob)


@pytest.mark.parametrize("where", ["anchor", "candidate"])
@pytest.mark.parametrize("cosine", [True, False])
def test_nan_in_a_valid_row_reaches_the_prefixes_that_hold_it(where, cosine):
    """A NaN at coordinate 9 makes the prefixes longer than 9 NaN and leaves the shorter ones
    exact, as K separate problems would: values as the oracle's, gradients as the sum of the
    plain cpp ops' (which, unlike the oracle, also give NaN to candidates a NaN row excludes)."""
    prob = prefix_problem(7, 9, 8, 24, (24, 5, 12, 9), cosine=cosine, generator=_gen(8))
    row = prob.anchor[2] if where == "anchor" else prob.blocks[1][int((prob.tags[1] != TAG_PADDING).nonzero()[0])]
    row[9] = float("nan")
    values, want_values, grads, want_grads = _nan_outputs(prob)
    for i, (got, want) in enumerate(zip(values + grads, want_values + tuple(want_grads))):
        assert torch.equal(got.isnan(), want.isnan()), i
        check_roundoff(f"output {i}", got.nan_to_num(), want.nan_to_num(), prob, TAU, logits=i < len(values))
    lse = values[0]
    assert torch.isfinite(lse[[1, 3]]).all() and lse[[0, 2]].isnan().any(1).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_huge_rows(dtype):
    """Cosine rows with entries far beyond 2^40 (stored rescaled) in the prefixes and beyond them."""
    prob = prefix_problem(8, 10, 6, 30, (30, 6, 17), dtype=dtype, own=1, generator=_gen(9))
    prob.anchor[1] *= 1e18
    prob.anchor[2, 20] = 1e16  # beyond the short prefixes only (2^53 above them)
    prob.blocks[0][3] *= 1e30
    prob.blocks[1][0, :6] *= 1e15
    _check(prob)


def test_a_prefix_lost_to_a_huge_row_is_refused():
    """A prefix 2^60 below its row's largest entry would underflow in the GEMMs: an error."""
    prob = prefix_problem(5, 6, 3, 16, (16, 4), dtype=torch.float32, generator=_gen(10))
    prob.anchor[0, :4] = 0
    prob.anchor[0, 10] = 1e20
    with pytest.raises(RuntimeError, match="matryoshka prefix"):
        _cpp.BACKEND.forward(prob, torch.tensor(TAU))


@pytest.mark.parametrize("rows", [3, 1000])
@pytest.mark.parametrize("n_threads", [1, 2])
@pytest.mark.parametrize("cosine", [True, False])
def test_blocks_and_threads(fastcl_config, threads, rows, n_threads, cosine):
    """Many row blocks (forced short) or one, candidate chunks, one and two threads."""
    fastcl_config(cpp={"test_rows": rows, "test_chunk": 37})
    threads(n_threads)
    prob = prefix_problem(23, 150, 61, 70, (64, 7, 70, 33), cosine=cosine, own=2, generator=_gen(11))
    _check(prob)


def test_large_problem_two_threads(threads):
    """Default block heights, several blocks, both threads, float32."""
    threads(2)
    prob = prefix_problem(
        300, 1500, 700, 96, (96, 16, 48, 8), dtype=torch.float32, own=1, generator=_gen(12)
    )  # fmt: skip
    _check(prob)


def test_deterministic_for_a_thread_count(threads):
    threads(2)
    prob = prefix_problem(120, 260, 90, 40, (40, 10, 25), dtype=torch.float32, own=1, generator=_gen(13))
    tau = torch.tensor(TAU)
    g, d_pos = torch.rand(3, 120, generator=_gen(1)), torch.randn(3, 120, 1, generator=_gen(2))
    runs = []
    for _ in range(2):
        lse, ml = _cpp.BACKEND.forward(prob, tau)
        d_a, d_b = _cpp.BACKEND.backward(prob, tau, lse, g, d_pos)
        runs.append((lse, ml, d_a, *d_b))
    for u, v in zip(*runs):
        assert torch.equal(u, v)


def _prefix_op_cases(requires_grad):
    prob = prefix_problem(5, 6, 3, 8, (3, 8), dtype=torch.float32, own=1, generator=_gen(14))
    args = (prob.anchor.requires_grad_(requires_grad), *prob.blocks, *prob.tags, torch.tensor(0.1), True, 1e-8, [3, 8])
    yield "lse_prefix_forward", args, dict(lse=torch.empty(2, 5), mean_logit=torch.empty(2, 5))
    for d_pos in (None, torch.randn(2, 5, 1)):
        outs = dict(d_anchor=torch.empty(5, 8), d_block0=torch.empty(11, 8), d_block1=torch.empty(3, 8))
        yield "lse_prefix_backward", args + (torch.randn(2, 5), torch.rand(2, 5), d_pos, 0), outs
    for own in (False, True):  # own: the op writes the own positives' logits into pos_logits
        head = (
            "softplus",
            torch.empty(2, 5, 1) if own else torch.randn(2, 5, 1),
            None,
            torch.randn(5),
            torch.rand(2, 5),
        )
        outs = dict(
            lse=torch.empty(2, 5), mean_logit=torch.empty(2, 5), loss_rows=torch.empty(2, 5), d_pos=torch.empty(2, 5, 1),
            d_anchor=torch.empty(5, 8), d_block0=torch.empty(11, 8), d_block1=torch.empty(3, 8),
            g_dot_mean_logit=torch.empty(()),
        )  # fmt: skip
        yield "lse_prefix_fused", args + head + (0, True, own), outs


@pytest.mark.parametrize("requires_grad", [False, True])
def test_opcheck_prefix_ops(requires_grad):
    for name, args, kwargs in _prefix_op_cases(requires_grad):
        torch.library.opcheck(getattr(torch.ops.fastcl, name).default, args, kwargs)


def test_bad_prefix_arguments_raise():
    prob = prefix_problem(3, 4, 2, 6, (6, 3))
    args = (prob.anchor, *prob.blocks, *prob.tags, torch.tensor(0.1), True, 1e-8)
    out = dict(lse=torch.empty(2, 3, dtype=torch.float64), mean_logit=torch.empty(2, 3, dtype=torch.float64))
    for dims in ([6, 3], [3, 3], [0, 6], [3, 7], []):
        with pytest.raises(RuntimeError, match="matryoshka dims"):
            torch.ops.fastcl.lse_prefix_forward(*args, dims, **out)
    with pytest.raises(RuntimeError, match=r"\[2, 3\]"):
        torch.ops.fastcl.lse_prefix_forward(*args, [3], **out)


def prefix_step(B: int, N: int, d: int, dims: list[int]):
    """A cpp Matryoshka forward + backward at float32 (for the fresh-process memory probe)."""
    from fastcl.ops import _cpp

    assert _cpp.BACKEND.unavailable() is None
    prob = prefix_problem(B, N, 0, d, tuple(dims), dtype=torch.float32, own=1, generator=_gen(15))
    tau = torch.tensor(TAU)
    g, d_pos = torch.rand(len(dims), B), -torch.rand(len(dims), B, 1)

    def run():
        lse, _ = _cpp.BACKEND.forward(prob, tau)
        _cpp.BACKEND.backward(prob, tau, lse, g, d_pos)

    return run


def test_memory_has_no_bxn_buffer_and_does_not_grow_with_k():
    """Extra peak RSS of a fresh process: far below one [B, N] float32 buffer, about the same
    for one prefix and five (the tiles share one element budget).

    Two threads: the block budget has a floor of 2^21 elements (8 MiB) per thread, constant
    in B and N, which on a 16-thread host is 128 MiB, this shape's whole [B, N] (the H100
    machine's host failed this test unpinned, 129 MiB; docs/csrc.md)."""
    from benchmarks.harness.memory import cpu_extra_peak_bytes

    B, N, d = 2048, 14336, 32  # N = 16384 with the own positives
    bxn = B * (N + B) * 4
    extra = {
        K: cpu_extra_peak_bytes(f"{__name__}:prefix_step", dict(B=B, N=N, d=d, dims=[32, 16, 8, 4, 2][:K]), threads=2)
        for K in (1, 5)
    }
    assert extra[5] < bxn / 4, f"extra peak {extra[5] / 2**20:.0f} MiB against a B x N buffer of {bxn / 2**20:.0f}"
    assert extra[5] < 1.5 * extra[1] + 4 * 2**20, f"K = 5: {extra[5] / 2**20:.1f} MiB, K = 1: {extra[1] / 2**20:.1f}"


@pytest.mark.parametrize("cosine", [True, False])
def test_fused_step_keeps_the_nan_rules(cosine):
    """With a NaN at coordinate 9 of a valid row the fused step gives what forward, the head
    and backward give one after the other (the recompute strategy): NaN in the prefixes that
    hold it, exact values in the others."""
    prob = prefix_problem(7, 9, 8, 24, (24, 5, 12, 9), cosine=cosine, own=1, generator=_gen(15))
    prob.anchor[2, 9] = float("nan")
    K, B = prob.num_prefixes, prob.num_anchors
    tau = torch.tensor(TAU, dtype=torch.float64)
    weights = torch.rand(K, B, generator=_gen(16), dtype=torch.float64)
    out = _cpp.BACKEND.fused(prob, tau, HeadInputs("softplus", None, None, None, weights))
    lse, ml = _cpp.BACKEND.forward(prob, tau)
    _, dlse, dpos = head_rows(lse.reshape(K * B), out.pos_logits.reshape(K * B, 1), None, "softplus")
    g, d_pos = dlse.view(K, B) * weights, dpos.view(K, B, 1) * weights[..., None]
    d_a, d_b = _cpp.BACKEND.backward(prob, tau, lse, g, d_pos)
    for i, (got, want) in enumerate(
        zip((out.lse, out.mean_logit, out.d_pos, out.d_anchor, *out.d_blocks), (lse, ml, d_pos, d_a, *d_b))
    ):
        assert torch.equal(got.isnan(), want.isnan()), i
        check_roundoff(f"output {i}", got.nan_to_num(), want.nan_to_num(), prob, TAU, logits=i < 2)
    assert out.lse[:, 2].isnan().tolist() == [True, False, True, False]  # dims 24, 5, 12, 9


def test_the_losses_take_the_fused_step(fastcl_config, monkeypatch):
    """A Matryoshka loss on cpp runs the fused step (FASTCL_STRATEGY=fused is accepted and no
    backward op is called) and equals the recompute strategy."""
    import fastcl.losses as L

    g = _gen(17)
    a, p, n = (torch.randn(6, *s, 20, generator=g, dtype=torch.float64, requires_grad=True) for s in ((), (2,), (3,)))
    tau = torch.tensor(0.1, dtype=torch.float64, requires_grad=True)
    kw = dict(temperature=tau, backend="cpp", matryoshka_dims=(20, 4, 9), matryoshka_weights=(1.0, 0.5, 2.0))
    results = {}
    for strategy in ("recompute", "fused"):
        fastcl_config(strategy=strategy)
        loss = L.supmpn_loss(a, p, n, **kw)
        results[strategy] = (loss, *torch.autograd.grad(loss, (a, p, n, tau)))
    # float64 sums of d + N + B terms; logits of size 1/tau are an absolute error of the loss
    # and a relative one of the gradients; d tau = -(1/tau) sum_k w_k sum_i g_i (mean - pos
    # logit): terms of size (1/tau)^2 over the weights' sum 3.5, which may cancel
    terms = 20 + 6 * 6 + 6
    (loss, *grads), (want_loss, *want_grads) = results["fused"], results["recompute"]
    assert_roundoff(loss, want_loss, terms=terms, magnitude=10.0, msg="loss")
    for name, x, y in zip(("a", "p", "n", "tau"), grads, want_grads):
        scale = y.abs().max().item() * 10.0 if name != "tau" else 10.0 / 0.1 * 3.5
        assert_roundoff(x, y, terms=terms, magnitude=scale, msg=f"d {name}")
    calls = []
    fastcl_config(strategy="auto")
    monkeypatch.setattr(_cpp.CppLSE, "backward", lambda *args: calls.append(args))
    L.supmpn_loss(a, p, n, **kw).backward()
    assert not calls and a.grad is not None

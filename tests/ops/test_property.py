"""Property-based test of every available backend against the float64 oracles (docs/contracts.md).

`hypothesis <https://hypothesis.readthedocs.io>`_ draws the whole input space at once:

* shapes ``B, P, Q, d`` (``d`` includes 1 and values that are not multiples of any tile),
* masks: random, anchors with no valid positive, all-padded negative blocks,
* dtypes fp32 / bf16 / fp16 / fp64, temperatures (float or learnable 0-d tensor),
  ``similarity`` cos / dot, ``own_positives`` exclude / zero_logit, every reduction,
* strides: transposed, sliced and expanded (zero-stride) inputs,
* special values: NaN / +-Inf in a padded slot (or an anchor without a valid positive)
  or in a valid anchor / positive / negative.

and checks, for each backend of ``tests/helpers/backends.py`` plus ``reference``:

* finite inputs: value and gradients (inputs and temperature) match the float64 oracle
  (``fastcl.reference``) within ``fastcl.testing``; padded slots get exactly zero
  gradient;
* the non-finite contract (docs/losses.md, "Non-finite inputs"): a NaN/Inf in a padded
  slot changes nothing (the result equals the one with the slot zeroed, gradients finite,
  the slot's exactly 0); a NaN/Inf in a valid embedding makes every row that sees it NaN.

Profiles (``FASTCL_HYPOTHESIS_PROFILE``):

* ``ci`` (default): 40 examples per backend (8 under ``FASTCL_TEST_SMALL=1``, the Triton
  interpreter), no example database; well under two minutes for the CPU backends.
* ``long``: 2000 examples per backend, for a thorough local run before a release::

      FASTCL_HYPOTHESIS_PROFILE=long .venv/bin/python -m pytest tests/ops/test_property.py -q

A failure prints the falsifying example and a ``@reproduce_failure`` blob.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import fastcl.losses as L  # noqa: E402
from fastcl import reference as R  # noqa: E402
from fastcl.ops.contract import poison_outputs  # noqa: E402
from fastcl.testing import assert_close, assert_roundoff, loss_terms  # noqa: E402
from tests.helpers.backends import backends_under_test, device_under_test, require, small_only  # noqa: E402
from tests.helpers.roundoff import grad_term_size  # noqa: E402

_COMMON = dict(
    deadline=None,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("ci", max_examples=8 if small_only() else 40, **_COMMON)
settings.register_profile("long", max_examples=2000, **_COMMON)
PROFILE = os.environ.get("FASTCL_HYPOTHESIS_PROFILE", "ci")

BACKENDS = ["reference", *backends_under_test()]

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
# 1, primes and values one off the powers of two that tile sizes use
DIMS = [1, 2, 3, 5, 7, 15, 17, 31, 33, 63, 65, 100, 129]
LOSSES = {
    "supmpn": (L.supmpn_loss, R.supmpn),
    "supmpn_zero_logit": (
        functools.partial(L.supmpn_loss, own_positives="zero_logit"),
        functools.partial(R.supmpn, own_positives="zero_logit"),
    ),
    "supcon": (L.supcon_loss, R.supcon),
    "mnrl": (L.mnrl_loss, R.mnrl),
}
LAYOUTS = ["contiguous", "transposed", "sliced", "expanded"]
SPECIALS = [float("nan"), float("inf"), float("-inf")]


# ------------------------------------------------------------------------------ inputs


def _view(leaf: torch.Tensor, layout: str, shape: tuple[int, ...]) -> torch.Tensor:
    """``leaf`` (see :func:`_leaf_shape`) as a ``shape`` view with the given strides."""
    if layout == "transposed":
        return leaf.permute(*reversed(range(leaf.dim())))
    if layout == "sliced":
        return leaf[..., ::2]
    if layout == "expanded":
        return leaf.expand(*shape)
    return leaf


def _leaf_shape(layout: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    if layout == "transposed":
        return tuple(reversed(shape))
    if layout == "sliced":
        return (*shape[:-1], 2 * shape[-1])
    if layout == "expanded":
        return (1, *shape[1:])
    return shape


@st.composite
def cases(draw):
    loss = draw(st.sampled_from(list(LOSSES)))
    B = draw(st.integers(1, 9))
    P = 1 if loss == "mnrl" else draw(st.integers(1, 4))
    Q = draw(st.integers(0, 4))
    d = draw(st.sampled_from(DIMS))
    dtype = draw(st.sampled_from(DTYPES))
    similarity = draw(st.sampled_from(["cos", "dot"]))
    reduction = draw(st.sampled_from(["mean", "sum", "none"]))
    tau = draw(st.floats(0.03, 1.0) if similarity == "cos" else st.floats(0.5, 2.0))
    learn_tau = draw(st.booleans())

    # masks: None, random, with anchors that have no valid positive, all-padded negatives
    pos_mask = neg_mask = None
    if loss != "mnrl" and draw(st.booleans()):
        bits = draw(st.lists(st.booleans(), min_size=B * P, max_size=B * P))
        pos_mask = torch.tensor(bits).view(B, P)
        if not pos_mask.any():
            pos_mask[draw(st.integers(0, B - 1)), 0] = True
    if Q and draw(st.booleans()):
        neg_mask = (
            torch.zeros(B, Q, dtype=torch.bool)
            if draw(st.booleans())
            else torch.tensor(draw(st.lists(st.booleans(), min_size=B * Q, max_size=B * Q))).view(B, Q)
        )

    shapes = {"anchor": (B, d), "positives": (B, P, d), "negatives": (B, Q, d)}
    layouts = {
        "anchor": draw(st.sampled_from(["contiguous", "transposed", "sliced"])),
        "positives": draw(st.sampled_from(LAYOUTS)),
        "negatives": draw(st.sampled_from(LAYOUTS)),
    }
    # special values: none, in a padded slot, or in a valid embedding
    has_pos = torch.ones(B, dtype=torch.bool) if pos_mask is None else pos_mask.any(1)
    spots = {"padded": [], "valid": []}
    for i in range(B):
        spots["valid" if has_pos[i] else "padded"].append(("anchor", (i,)))
        for k in range(P):
            valid = pos_mask is None or bool(pos_mask[i, k])
            spots["valid" if valid else "padded"].append(("positives", (i, k)))
        for k in range(Q):
            valid = neg_mask is None or bool(neg_mask[i, k])
            spots["valid" if valid else "padded"].append(("negatives", (i, k)))
    kinds = ["none"] + [k for k in ("padded", "valid") if spots[k]]
    special = draw(st.sampled_from(kinds))
    spot = value = None
    whole_slot = False
    if special != "none":
        spot = draw(st.sampled_from(spots[special]))
        value = draw(st.sampled_from(SPECIALS))
        whole_slot = special == "padded" and draw(st.booleans())
        # an expanded input aliases its slots across anchors: keep the special one unaliased
        if layouts[spot[0]] == "expanded":
            layouts[spot[0]] = "contiguous"
    seed = draw(st.integers(0, 2**31 - 1))
    return dict(
        loss=loss,
        shapes=shapes,
        dtype=dtype,
        similarity=similarity,
        reduction=reduction,
        tau=tau,
        learn_tau=learn_tau,
        pos_mask=pos_mask,
        neg_mask=neg_mask,
        layouts=layouts,
        special=special,
        spot=spot,
        value=value,
        whole_slot=whole_slot,
        seed=seed,
        has_pos=has_pos,
    )


def _leaves(case, device) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(case["seed"])
    d = case["shapes"]["anchor"][1]
    scale = d**-0.5 if case["similarity"] == "dot" else 1.0  # keep dot logits O(1)
    out = {}
    for name, shape in case["shapes"].items():
        if name == "negatives" and shape[1] == 0:
            continue
        leaf_shape = _leaf_shape(case["layouts"][name], shape)
        out[name] = (torch.randn(*leaf_shape, generator=gen) * scale).to(device=device, dtype=case["dtype"])
    return out


def _put(leaves, case, value, whole_slot: bool) -> dict[str, torch.Tensor]:
    """Copies of ``leaves`` with ``value`` written into the case's special slot."""
    out = {k: v.clone() for k, v in leaves.items()}
    name, index = case["spot"]
    view = _view(out[name], case["layouts"][name], case["shapes"][name])
    if whole_slot:
        view[index] = value
    else:  # one element of the slot
        view[(*index, 0)] = value
    return out


def _run(fn, leaves, case, tau, **extra):
    """Loss and gradients w.r.t. the leaves (and a learnable temperature)."""
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in leaves.items()}
    views = {k: _view(v, case["layouts"][k], case["shapes"][k]) for k, v in leaves.items()}
    t = tau.detach().clone().requires_grad_(True) if isinstance(tau, torch.Tensor) else tau
    kw = dict(temperature=t, reduction=case["reduction"], similarity=case["similarity"], **extra)
    if case["loss"] == "mnrl":
        out = fn(views["anchor"], views["positives"][:, 0], views.get("negatives"), neg_mask=case["neg_mask"], **kw)
    else:
        out = fn(
            views["anchor"],
            views["positives"],
            views.get("negatives"),
            pos_mask=case["pos_mask"],
            neg_mask=case["neg_mask"],
            **kw,
        )
    wrt = list(leaves.values()) + ([t] if isinstance(t, torch.Tensor) else [])
    names = list(leaves) + (["temperature"] if isinstance(t, torch.Tensor) else [])
    grads = torch.autograd.grad(out.double().sum(), wrt)
    return out.detach(), dict(zip(names, grads))


def _tau(case, dtype):
    if not case["learn_tau"]:
        return case["tau"]
    return torch.tensor(case["tau"], dtype=torch.float64 if dtype == torch.float64 else torch.float32)


def _to_masks_device(case, device):
    for k in ("pos_mask", "neg_mask"):
        if case[k] is not None:
            case[k] = case[k].to(device)
    return case


# ------------------------------------------------------------------------------ checks


def _padded_grads_are_zero(case, grads) -> None:
    if "anchor" in grads and not case["has_pos"].all():
        g = _view(grads["anchor"], case["layouts"]["anchor"], case["shapes"]["anchor"])
        assert (g[~case["has_pos"].to(g.device)] == 0).all(), "an anchor without positives got a nonzero gradient"
    for name, mask in (("positives", case["pos_mask"]), ("negatives", case["neg_mask"])):
        if mask is None or name not in grads or case["layouts"][name] == "expanded":
            continue
        g = _view(grads[name], case["layouts"][name], case["shapes"][name])
        assert (g[~mask] == 0).all(), f"padded {name} got a nonzero gradient"


def _logit_scale(case, leaves) -> float:
    """The logits' size: ``1/tau`` for cosine, ``max |a| |c| / tau`` for dot products."""
    if case["similarity"] == "cos":
        return 1.0 / case["tau"]
    views = [_view(v, case["layouts"][k], case["shapes"][k]).double() for k, v in leaves.items()]
    return max(v.norm(dim=-1).max().item() for v in views if v.numel()) ** 2 / case["tau"]


def _check_against_oracle(case, backend, leaves, device) -> None:
    fn, oracle = LOSSES[case["loss"]]
    dtype = case["dtype"]
    with poison_outputs():
        got, got_g = _run(fn, leaves, case, _tau(case, dtype), backend=backend)
    ref, ref_g = _run(oracle, {k: v.double() for k, v in leaves.items()}, case, _tau(case, torch.float64))
    eager, eager_g = None, {}
    if dtype != torch.float64:
        eager, eager_g = _run(oracle, leaves, case, _tau(case, dtype))
    assert got.dtype == dtype
    (B, d), (_, P, _), (_, Q, _) = (case["shapes"][k] for k in ("anchor", "positives", "negatives"))
    logit_scale = _logit_scale(case, leaves)
    terms = loss_terms(B, B * (1 + P + Q), d)  # a row's candidates: at most every input row
    # d tau sums the rows' logit differences (size 1/tau each) times 1/tau, weighted by the
    # reduction (the test sums the per-row losses of "none"): total weight 1 (mean) or B
    weight = 1.0 if case["reduction"] == "mean" else float(B)
    # an embedding's gradient sums terms of one row's weight (1/rows for a mean) that may cancel
    rows = max(int(case["has_pos"].sum()), 1)
    views = [_view(v, case["layouts"][k], case["shapes"][k]) for k, v in leaves.items()]
    row_weight = 1.0 / rows if case["reduction"] == "mean" else 1.0
    term = grad_term_size(views, similarity=case["similarity"], tau=case["tau"], row_weight=row_weight)
    # a value sums logits (size logit_scale) and a log-sum-exp of normalised terms (size 1): a zero
    # logit or tiny dot-product logits leave the latter
    assert_close("loss", got, ref, dtype, eager, terms=terms, magnitude=logit_scale + 1.0)
    for name, g in ref_g.items():
        assert_close(
            f"d {name}",
            got_g[name],
            g,
            dtype,
            eager_g.get(name),
            terms=terms,
            # d tau: terms of size weight / tau^2, its 16-bit row weights stored; an embedding's
            # gradient: relative error eps / tau, or that of its terms where they cancel
            magnitude=weight * logit_scale**2 if name == "temperature" else term * logit_scale,
            logit_scale=1.0 if name == "temperature" else logit_scale,
            stored=weight * logit_scale**2 if name == "temperature" else 0.0,
        )
    _padded_grads_are_zero(case, got_g)


def _same_sums(name, got, want, case, *, logits: bool, scalar: bool = False) -> None:
    """Two runs of one backend whose inputs differ only in padded slots: at most the round-off
    of another order of the same sums (fastcl.testing.roundoff). A logit sums d terms of size
    1/tau, a row N candidates, a candidate's gradient B anchors; the logits' error is absolute
    in the loss and relative in the gradients (``logits=False``: scale by ``max |want|``);
    ``scalar``: d tau sums the B rows' logit differences, of size 1/tau^2 each. Below float32
    the sums run in float32 and the outputs are rounded to the dtype once."""
    (B, d), (_, P, _) = case["shapes"]["anchor"], case["shapes"]["positives"]
    Q = case["shapes"]["negatives"][1]
    inv_tau = 1.0 / case["tau"]
    size = want.detach().abs().max().item() if want.numel() else 0.0
    if case["dtype"] in (torch.float16, torch.bfloat16) and got.dtype == case["dtype"]:
        assert_roundoff(got, want, case["dtype"], magnitude=size, msg=name)
        return
    dt = torch.float64 if case["dtype"] == torch.float64 else torch.float32
    magnitude = inv_tau * inv_tau * B if scalar else inv_tau if logits else size * inv_tau
    assert_roundoff(got.double(), want.double(), dt, terms=d + B * (P + Q) + B, magnitude=magnitude, msg=name)


def _check_padded_special(case, backend, leaves) -> None:
    fn, _ = LOSSES[case["loss"]]
    bad = _put(leaves, case, case["value"], case["whole_slot"])
    clean = _put(leaves, case, 0.0, True)
    tau = _tau(case, case["dtype"])
    got, got_g = _run(fn, bad, case, tau, backend=backend)
    want, want_g = _run(fn, clean, case, tau, backend=backend)
    assert torch.isfinite(got).all(), f"a {case['value']} in a padded slot reached the loss: {got}"
    _same_sums("loss", got, want, case, logits=True)
    for name, g in want_g.items():
        assert torch.isfinite(got_g[name]).all(), f"a {case['value']} in a padded slot reached d {name}"
        _same_sums(f"d {name}", got_g[name], g, case, logits=name != "temperature", scalar=name == "temperature")
    _padded_grads_are_zero(case, got_g)


def _check_valid_special(case, backend, leaves) -> None:
    fn, _ = LOSSES[case["loss"]]
    bad = _put(leaves, case, case["value"], False)
    name, index = case["spot"]
    case = {**case, "reduction": "none"}
    rows, _ = _run(fn, bad, case, _tau(case, case["dtype"]), backend=backend)
    has_pos = case["has_pos"].to(rows.device)
    if name == "anchor":  # only its own row reads an anchor
        sees = torch.zeros_like(has_pos)
        sees[index[0]] = True
    else:  # a valid candidate is in every row (an own positive: through its own term)
        sees = has_pos
    assert torch.isnan(rows[sees]).all(), f"a {case['value']} in a valid {name} vanished: rows {rows}"
    assert torch.isfinite(rows[~sees]).all(), f"rows that do not see the {case['value']} are not finite: {rows}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_backend_properties(backend):
    require(backend)
    profile = settings.get_profile(PROFILE)
    device = device_under_test()

    @settings(profile)
    @given(case=cases())
    def check(case):
        case = _to_masks_device(case, device)
        leaves = _leaves(case, device)
        if case["special"] == "none":
            _check_against_oracle(case, backend, leaves, device)
        elif case["special"] == "padded":
            _check_padded_special(case, backend, leaves)
        else:
            _check_valid_special(case, backend, leaves)

    check()

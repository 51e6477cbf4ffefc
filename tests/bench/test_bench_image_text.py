"""The image–text and GIST rows of the loss grid: their peers are the real thing (open_clip's loss
module, sentence-transformers' ``GISTEmbedLoss.forward``), their float64 oracles are open_clip's
math and ``fastcl.reference.gist`` in row blocks, their floors do the work they name, and the
report and the grid show what they add (the symmetric floor, what ``eager`` is)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from benchmarks.harness import cases, floor, gist, image_text, metrics, peers, report
from fastcl import reference as R
from fastcl.testing import assert_roundoff, loss_terms
from tests.helpers.open_clip import require_open_clip


def _assert_f64(got, want, got_g: dict, want_g: dict, *, terms: int, size: float) -> None:
    """Two float64 computations of a loss and its gradients (blocked and whole, or another
    formula): within the round-off of ``terms`` terms of the logits' ``size``."""
    assert_roundoff(torch.as_tensor(got), torch.as_tensor(want), torch.float64, terms=terms, magnitude=size)
    for k in want_g:
        assert_roundoff(got_g[k], want_g[k], torch.float64, terms=terms, magnitude=size, msg=k)


def _f64(loss: str, B: int, d: int, Q: int = 0, seed: int = 0) -> dict:
    t = cases.make_inputs(loss, B, 1, Q, d, seed=seed)
    return {k: v.detach().double().requires_grad_(v.requires_grad) for k, v in t.items()}


def _grads(fn, t: dict) -> tuple[float, dict]:
    for v in t.values():
        v.grad = None
    value = fn(**t)
    value.backward()
    return float(value.detach()), {k: v.grad.clone() for k, v in t.items() if v.requires_grad}


@pytest.mark.parametrize("loss", cases.IMAGE_TEXT_LOSSES)
def test_image_text_oracle_is_open_clips_loss_in_float64(loss):
    """Blocks of 7 rows (B = 30: a short last block) give open_clip's value and gradients, the
    scale's and the bias's included; the harness's loader gives open_clip's own module."""
    module = require_open_clip()
    t = _f64(loss, 30, 12)
    theirs = module.ClipLoss() if loss == "clip" else module.SigLipLoss()  # the tests' own loader's
    want, want_g = _grads(image_text.open_clip_call(loss, theirs), t)
    got, got_g = _grads(lambda **x: cases.LOSSES[loss][1](**x, rows=7), t)
    # open_clip's logits: scale 1/0.07 (CLIP) or 10 with bias -10 (SigLIP) times unit cosines
    _assert_f64(got, want, got_g, want_g, terms=loss_terms(30, 30, 12), size=20.0)
    assert type(image_text.open_clip_module(loss)).__module__ == "benchmarks_open_clip_loss"


def test_gist_oracle_is_the_reference_in_blocks():
    t = _f64("gist", 21, 10, Q=1, seed=2)
    want, want_g = _grads(
        lambda anchor, positive, negatives, guide_anchor, guide_positive, guide_negative: R.gist(
            anchor, positive, negatives, guide=(guide_anchor, guide_positive, guide_negative), temperature=0.01
        ),
        t,
    )
    got, got_g = _grads(lambda **x: gist.gist_oracle(**x, rows=4), t)
    _assert_f64(got, want, got_g, want_g, terms=loss_terms(21, 4 * 21, 10), size=1 / 0.01)


def test_the_guide_filters_what_it_does_on_real_data():
    """Guide positives near their anchors: the aa and pp diagonals leave every row, few others."""
    t = cases.make_inputs("gist", 256, 1, 1, 16)
    ga, gp = (torch.nn.functional.normalize(t[k], dim=-1) for k in ("guide_anchor", "guide_positive"))
    pos = (ga * gp).sum(-1, keepdim=True)
    assert pos.min() > 0.5
    dropped = (ga @ gp.T > pos).float().mean()
    assert dropped < 0.01


def _st_loss(gist_embed, model, guide):
    """sentence-transformers' ``GISTEmbedLoss`` with its defaults, built without tokenizers."""
    loss = gist_embed.GISTEmbedLoss.__new__(gist_embed.GISTEmbedLoss)
    nn.Module.__init__(loss)
    loss.model, loss.guide = model, guide
    loss.temperature = gist.GIST_TEMPERATURE
    loss.similarity_fct = nn.CosineSimilarity(dim=-1)
    loss.must_retokenize = False
    loss.margin_strategy, loss.margin = "absolute", gist.GIST_MARGIN
    loss.contrast_anchors = loss.contrast_positives = True
    loss.gather_across_devices = False
    loss.cross_entropy_loss = nn.CrossEntropyLoss()
    return loss


@pytest.mark.parametrize("form", ["st", "gemm"])
def test_st_gist_is_sentence_transformers_forward(monkeypatch, form):
    """``eager`` (ST's computation written out) and ``st-gist-gemm`` against ST's own
    ``GISTEmbedLoss.forward``, its encoders replaced by the given embeddings."""
    gist_embed = pytest.importorskip("sentence_transformers.sentence_transformer.losses.gist_embed")
    t = _f64("gist", 17, 12, Q=1, seed=5)
    model, guide = nn.Identity(), nn.Identity()
    monkeypatch.setattr(
        gist_embed, "embed_columns", lambda m, feats: [f["model" if m is model else "guide"] for f in feats]
    )
    st = _st_loss(gist_embed, model, guide)

    def theirs(anchor, positive, negatives, guide_anchor, guide_positive, guide_negative):
        cols = [(anchor, guide_anchor), (positive, guide_positive), (negatives, guide_negative)]
        return st.forward([{"model": m, "guide": g} for m, g in cols], None)

    want, want_g = _grads(theirs, t)
    ours = gist.st_gist if form == "st" else gist.st_gist_gemm
    got, got_g = _grads(ours, t)
    B, d = t["anchor"].shape
    _assert_f64(got, want, got_g, want_g, terms=loss_terms(B, 4 * B, d), size=1 / gist.GIST_TEMPERATURE)


def test_floor_variants_do_the_work_they_name():
    plan = floor.plan_floor(40, 96, 8, max_elements=96 * 16)  # blocks of 16 rows, a short last one
    for kw in ({}, {"recompute": True}, {"guide_d": 6}):
        step = floor.floor_step(plan, "float64", **kw)
        da, dc = step()
        want_da, want_dc = floor.floor_reference(*step.inputs)
        torch.testing.assert_close(da, want_da)
        torch.testing.assert_close(dc, want_dc)
        if "guide_d" in kw:
            ag, cg, gs = step.guide
            torch.testing.assert_close(gs[: 40 - 32], (ag @ cg.T)[32:])  # the last block's guide product
    assert floor.floor_flops(4, 8, 2, recompute=True) == 8 * 4 * 8 * 2
    assert floor.floor_flops(4, 8, 2, guide_d=3) == 6 * 4 * 8 * 2 + 2 * 4 * 8 * 3
    assert list(floor.named_floor_plans(4096, 4096, 512, prefix="sym-floor")) == ["sym-floor", "sym-floor1"]


def test_candidates_and_flops_of_the_new_losses():
    assert metrics.num_candidates("clip", 64, 1, 0) == metrics.num_candidates("siglip", 64, 1, 0) == 64
    assert metrics.num_candidates("gist", 64, 1, 1) == 4 * 64  # ap, aa, pp, an
    assert metrics.loss_flops("gist", 64, 1, 1, 8) == 8 * 64 * 256 * 8 + 2 * 64 * 256 * gist.GUIDE_D


def test_what_runs_and_why_not():
    assert set(peers.IMPLS["eager"].losses) >= {"clip", "siglip", "gist"}
    assert "CUDA only" in peers.unavailable("siglip-kernel", "siglip", "cpu")
    assert "CUDA only" in peers.unavailable("inf-cl", "clip", "cpu")
    assert "does not compute" in peers.unavailable("st-gist-gemm", "clip", "cpu")
    assert peers.EAGER_IS["clip"] == "open_clip ClipLoss"
    from benchmarks import bench_losses as bl

    case = dict(loss="gist", backend="eager", B=4096, P=1, Q=1, d=768, dtype="float32", device="cpu")
    assert "broadcasts [B, B, d]" in bl.too_big(case)
    assert bl.too_big(dict(case, B=128)) is None
    assert bl.heavy(dict(case, loss="clip", Q=0, B=16384, d=512))
    assert not bl.heavy(dict(case, loss="clip", Q=0, B=4096, d=768))
    assert bl.heavy(case) and not bl.heavy(dict(case, B=128))
    assert not bl.heavy(dict(case, loss="supmpn", P=5, Q=5, B=8192, d=128))  # --bench-targets keeps its rounds
    settings = bl.timing_for(dict(case, loss="siglip", Q=0, B=16384))
    assert settings["min_rounds"] == settings["max_rounds"] == 2 and settings["budget_s"] == 0
    assert bl.timing_for(dict(case, B=128)) == bl.TIMING


def test_a_refusal_of_cpp_is_a_skip_with_dispatchs_reason():
    """On a branch whose cpp backend lacks the sigmoid reduction, SigLIP's cpp row is a skip."""
    from benchmarks import bench_losses as bl

    members = [
        dict(loss="siglip", backend=b, B=32, P=1, Q=0, d=8, dtype="float32", device="cpu") for b in ("torch", "cpp")
    ]
    run = bl.run_case(members, {}, disabled=True)
    assert run.outcomes["torch"][0] == "ok"
    kind, why = run.outcomes["cpp"]
    assert kind in ("ok", "skip"), why
    if kind == "skip":
        assert "cpp" in why and "sigmoid" in why
    assert run.case_info["eager_is"] == "open_clip SigLipLoss"


def test_clip_records_the_symmetric_floor_and_the_path():
    from benchmarks import bench_losses as bl

    members = [dict(loss="clip", backend=b, B=32, P=1, Q=0, d=8, dtype="float32", device="cpu") for b in ("torch",)]
    run = bl.run_case(members, {}, disabled=True)
    assert run.case_info["sym_floor_s"] > 0 and run.case_info["floor_kind"] == "3 GEMMs"
    assert run.info["torch"]["clip_path"] == "symmetric"
    assert run.info["torch"]["sym_floor_share_measured"] > 0


def _record(impl, family, B, seconds, **more):
    e = dict(
        workload=f"clip B={B} P=1 Q=0 d=8 float32 cpu",
        impl=impl,
        family=family,
        loss="clip",
        B=B,
        P=1,
        Q=0,
        d=8,
        dtype="float32",
        device="cpu",
        peak_mib=1.0,
        min_s=seconds,
        spread=0.01,
        noisy=False,
        floor_s=0.03,
        floor_spread=0.01,
        floor_share=0.03 / seconds,
        floor_share_problem=None,
        sym_floor_s=0.04,
        sym_floor_spread=0.01,
        sym_floor_share=0.04 / seconds,
        sym_floor_share_problem=None,
        floor_kind="3 GEMMs",
        eager_is="open_clip ClipLoss",
        **more,
    )
    return {"name": f"{impl}-{B}", "stats": {"median": seconds}, "extra_info": e}


def test_report_shows_the_symmetric_floor_and_what_eager_is(tmp_path):
    doc = {
        "machine_info": {"fastcl": {"torch_threads": 2}},
        "benchmarks": [
            _record("eager", "reference", 64, 0.2),
            _record("torch", "fastcl", 64, 0.05, clip_path="symmetric"),
            _record("cpp", "fastcl", 64, 0.08, clip_path="two directions"),
        ],
    }
    path = tmp_path / "run.json"
    path.write_text(json.dumps(doc))
    groups, machines = report.load([path])
    text = report.render(groups, machines, tmp_path / "plots", tmp_path / "RESULTS.md")
    assert "eager = open_clip ClipLoss." in text
    assert "| 64 | *floor: 3 GEMMs* | 30.0 |" in text and "| 64 | *symmetric floor: 4 GEMMs* | 40.0 |" in text
    assert "| 64 | **torch** | 50.0 | 1% | 4.00x | 60% / 80% |" in text
    assert "**cpp** (two directions)" in text

"""The losses' documentation runs and is complete: docstring examples (doctest), the Python
examples of docs/losses.md, and every parameter of every public loss documented."""

from __future__ import annotations

import doctest
import inspect
import re
from pathlib import Path

import pytest
import torch

import fastcl.losses as L
from fastcl import config
from fastcl.losses import clip, gclsr, gist, infonce, mnrl, supcon, supcon_labels, supmpn
from fastcl.ops import dispatch
from fastcl.ops.backend import MATRYOSHKA_BACKENDS, dims_reason
from fastcl.ops.contract import LSEProblem
from tests.helpers.roundoff import assert_loss_roundoff

DOC = Path(__file__).resolve().parents[2] / "docs" / "losses.md"
_BLOCK = re.compile(r"```python\n(?P<code>.*?)```", re.S)
PUBLIC = [getattr(L, name) for name in L.__all__ if callable(getattr(L, name))]


@pytest.mark.parametrize(
    "module", [supmpn, supcon, supcon_labels, mnrl, infonce, gclsr, clip, gist], ids=lambda m: m.__name__
)
def test_docstring_examples_run(module):
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE, verbose=False)
    assert result.attempted > 0, f"{module.__name__} has no docstring example"
    assert result.failed == 0


def test_every_public_function_has_an_example():
    missing = [f.__name__ for f in PUBLIC if inspect.isfunction(f) and ">>>" not in (f.__doc__ or "")]
    assert not missing


@pytest.mark.parametrize("obj", PUBLIC, ids=lambda f: f.__name__)
def test_every_argument_is_documented(obj):
    """Each parameter appears as ``name:`` in the docstring (shapes and dtypes live there), and no
    ``{shared}`` placeholder is left unfilled."""
    doc = obj.__doc__ or ""
    params = inspect.signature(obj.__init__ if inspect.isclass(obj) else obj).parameters
    names = [p for p in params if p not in ("self", "kw", "args", "kwargs")]
    undocumented = [p for p in names if not re.search(rf"^\s*{p}:", doc, re.M)]
    assert not undocumented, f"{obj.__name__}: {undocumented}"
    assert "{shared}" not in doc and "{returns}" not in doc


def test_every_module_documents_the_options_it_forwards():
    """A loss module takes its function's keyword options: those are documented on the class."""
    for cls in (L.SupMPNLoss, L.SupConLoss, L.MNRLoss, L.InfoNCELoss, L.EdaCSELoss):
        for name in ("temperature", "learn_temperature", "reduction", "backend", "similarity", "matryoshka_dims"):
            assert re.search(rf"^\s*{name}:", cls.__doc__ or "", re.M), (cls.__name__, name)


def _doc_blocks():
    return _BLOCK.findall(DOC.read_text(encoding="utf-8"))


def test_docs_have_examples():
    assert _doc_blocks(), "docs/losses.md has no ```python example"


@pytest.mark.parametrize("index", range(len(_doc_blocks())))
def test_docs_example_runs(index):
    code = _doc_blocks()[index]
    exec(compile(code, f"docs/losses.md example {index}", "exec"), {"__name__": "__docs__"})


# --------------------------------------------------------------------------- docs/losses.md's statements
# Each test quotes the statement it checks (so that editing one without the other fails);
# statements checked elsewhere name their test in a comment at the end of this file.


def _says(phrase: str) -> None:
    text = " ".join(DOC.read_text(encoding="utf-8").split())
    assert " ".join(phrase.split()) in text, f"docs/losses.md no longer says: {phrase}"


def _small(seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, 8, generator=g, dtype=dtype) for s in ((4,), (4, 2), (4, 3))]


def test_matryoshka_backends_are_the_ones_that_take_dims(monkeypatch):
    _says("Backends that take dims: `reference`, `torch`, `cpp`, `triton`")
    assert MATRYOSHKA_BACKENDS == ("reference", "torch", "cpp", "triton")
    a, p, n = _small()
    want = L.supmpn_loss(a, p, n, backend="reference") + L.supmpn_loss(a[:, :4], p[..., :4], n[..., :4])
    for name in MATRYOSHKA_BACKENDS:
        if dispatch.reasons(name):
            continue  # not runnable here (triton without a GPU): tests/kernels cover it
        got = L.supmpn_loss(a, p, n, backend=name, matryoshka_dims=(8, 4))
        # another backend, float64: a logit's 8 coordinates, a row's 4 x 6 candidates, 4 rows;
        # logits of size 1/tau = 20 (the default 0.05)
        assert_loss_roundoff(got, want, torch.float64, terms=8 + 24 + 4, logit_scale=20.0, msg=name)
    for name in set(dispatch.NAMES) - set(MATRYOSHKA_BACKENDS):
        assert dims_reason(name) in dispatch.get(name).unsupported(
            LSEProblem(a, (p.flatten(0, 1), n.flatten(0, 1)), (torch.zeros(8, dtype=torch.int32),) * 2, dims=(8, 4))
        ) or dispatch.reasons(name)


def test_fused_step_with_dims_only_on_cpp():
    _says("The fused gradient-in-forward step takes dims on `cpp`; the other backends run the recompute strategy")
    _says("forcing the fused one there raises `ValueError`")
    a, p, n = (t.requires_grad_() for t in _small(1))
    for name in ("reference", "torch"):
        with pytest.raises(ValueError, match="matryoshka dims"):
            L.supmpn_loss(a, p, n, backend=name, matryoshka_dims=(8, 4), strategy="fused")
        L.supmpn_loss(a, p, n, backend=name, matryoshka_dims=(8, 4)).backward()  # auto: recompute
    if not dispatch.reasons("cpp"):
        L.supmpn_loss(a, p, n, backend="cpp", matryoshka_dims=(8, 4), strategy="fused").backward()


def test_st6_options_do_not_take_neg_mask():
    _says("`neg_mask` is not taken with these options yet")
    a, p, n = _small(2)
    with pytest.raises(ValueError, match="neg_mask"):
        L.mnrl_loss(
            a, p[:, 0], n, neg_mask=torch.ones(4, 3, dtype=torch.bool), directions=("query_to_doc", "doc_to_query")
        )


def test_empty_denominator_gives_zero():
    _says("If `R_i` is empty (B = 1, Q = 0) the term is `softplus(−∞) = 0`")
    a, p, _ = _small(3)
    assert L.supmpn_loss(a[:1], p[:1]).item() == 0.0


def test_default_temperatures():
    _says("The default temperature of the labels form is PML's, 0.1, through every entry point")
    _says("the structured form keeps fastcl's 0.05")
    x, y = torch.randn(6, 8, dtype=torch.float64), torch.tensor([0, 1, 0, 1, 2, 2])
    want = L.supcon_labels_loss(x, y, temperature=0.1)
    for got in (L.supcon_labels_loss(x, y), L.supcon_loss(x, y), L.supcon_loss(x, labels=y), L.SupConLoss()(x, y)):
        torch.testing.assert_close(got, want)
    a, p, n = _small(4)
    torch.testing.assert_close(L.supcon_loss(a, p, n), L.supcon_loss(a, p, n, temperature=0.05))
    torch.testing.assert_close(L.SupConLoss()(a, p, n), L.supcon_loss(a, p, n, temperature=0.05))


def test_pml_shortcuts_fastcl_refuses():
    _says("PML accepts float labels and `ref_emb` without `ref_labels`")
    _says("fastcl refuses both with an error")
    x, y = torch.randn(6, 8), torch.tensor([0, 1, 0, 1, 2, 2])
    with pytest.raises(TypeError, match="integer"):
        L.supcon_labels_loss(x, y.float())
    with pytest.raises(ValueError, match="ref_emb and ref_labels together"):
        L.supcon_labels_loss(x, y, ref_emb=x)


def test_reference_set_does_not_combine_with_a_process_group():
    _says("`ref_emb` does not combine with it yet")
    x, y = torch.randn(6, 8), torch.tensor([0, 1, 0, 1, 2, 2])
    with pytest.raises(NotImplementedError, match="ref_emb with process_group"):
        L.supcon_labels_loss(x, y, ref_emb=x, ref_labels=y, process_group=object())


def test_group_size_must_divide_d():
    _says("`D % g ≠ 0` raises `ValueError`")
    with pytest.raises(ValueError, match="does not divide"):
        L.grouped_cosine_loss(torch.randn(2, 10), torch.randn(2, 10), group_size=4)


def test_matryoshka_is_every_lse_loss_and_not_grouped_cosine():
    _says("Every LSE loss (functions and modules: SupMPN, SupCon in both forms, `supcon_pool_loss`")
    _says("not GCLSR's grouped cosine")
    lse = (L.supmpn_loss, L.supcon_loss, L.supcon_labels_loss, L.supcon_pool_loss, L.mnrl_loss)
    for fn in (*lse, L.mnrl_directions_loss, L.infonce_loss, L.edacse_loss):
        assert {"matryoshka_dims", "matryoshka_weights"} <= set(inspect.signature(fn).parameters), fn.__name__
    for fn in (L.grouped_cosine_loss, L.gclsr_loss):
        assert "matryoshka_dims" not in inspect.signature(fn).parameters


def test_choices_are_checked_without_grad(monkeypatch):
    _says("`reduction`, `similarity`, `own_positives` and `strategy` are checked on every call, with or without grad")
    _says("an invalid `FASTCL_STRATEGY` is refused when `fastcl.config` reads it")
    a, p, n = _small(5)
    with torch.no_grad():
        for kw, name in [({"reduction": "avg"}, "reduction"), ({"similarity": "l2"}, "similarity"),
                         ({"own_positives": "keep"}, "own_positives"), ({"strategy": "bogus"}, "strategy")]:  # fmt: skip
            with pytest.raises(ValueError, match=name):
                L.supmpn_loss(a, p, n, **kw)
    monkeypatch.setenv("FASTCL_STRATEGY", "bogus")
    with pytest.raises(ValueError, match="FASTCL_STRATEGY='bogus'"):
        config.reload()
    assert config.get().strategy == "auto"  # the refused reading left the configuration as it was


def test_filters_backends_and_self_margin_rules(monkeypatch):
    _says('Backends that take filters: `reference`, `torch`, `cpp`, `triton` (`"auto"` passes over a')
    _says("an explicit one raises `BackendUnavailableError` with the reason")
    _says("with other `directions` or hardness it raises `ValueError`")
    takes = {name for name in dispatch.NAMES if getattr(dispatch.get(name), "takes_filter", False)}
    assert takes == set(dispatch.NAMES)
    a, p, n = _small(6)
    guide = (torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64))
    L.gist_loss(a, p[:, 0], guide=guide)  # auto: a backend that takes the filter
    # every backend takes it: the refusal on one that did not
    monkeypatch.setattr(dispatch.get("torch"), "takes_filter", False)
    with pytest.raises(dispatch.BackendUnavailableError, match="false-negative filter"):
        L.gist_loss(a, p[:, 0], guide=guide, backend="torch")
    with pytest.raises(ValueError, match="query_to_doc"):
        L.mnrl_loss(a, p[:, 0], false_negative_margin=0.1, directions=("query_to_doc", "doc_to_query"))


# Checked elsewhere: GIST and the self-margin filter against their oracles (tests/losses/test_gist.py);
# padded slots and non-finite inputs (tests/ops/test_robust.py,
# tests/ops/test_property.py); scale-free cosine (tests/ops/test_robust.py::test_cosine_is_scale_free,
# tests/losses/test_supcon_labels.py::test_cosine_is_scale_free); labels SupCon against PML and
# SupContrast, view-major rows, positional labels (tests/losses/test_supcon_labels.py); MNRL
# options against sentence-transformers (tests/integrations/test_st_api.py); Matryoshka values,
# NaN per prefix and the argument rules (tests/losses/test_matryoshka.py,
# tests/ops/test_matryoshka_contract.py); temperature rules and shapes (tests/ops/test_robust.py,
# tests/losses/test_validation.py); double backward (tests/ops/test_double_backward.py).

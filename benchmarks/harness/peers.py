"""Every implementation the benchmarks compare, on the same inputs: fastcl, the reference, peers.

An implementation turns the inputs of one loss (``benchmarks.harness.cases.make_inputs``: raw
embeddings, temperature :data:`TEMPERATURE`) into a zero-argument callable returning the
loss, so the benchmark can time ``fn().backward()`` and check ``fn()`` against the
float64 reference first (:func:`check_value`).

Families:

* ``reference``: ``eager`` (the oracle of ``fastcl.reference``, materialises ``[B, N]``)
  and ``compile`` (``torch.compile`` of the same loss written for compile to fuse,
  ``benchmarks.harness.fusable``; dynamic shapes, one compile per loss and process).
* ``fastcl``: the backends of ``fastcl.ops.dispatch`` (``torch``, ``cpp``, ``triton``); one that cannot run here is skipped with dispatch's reason. ``triton-graphs``
  is the ``triton`` backend under ``torch.compile(mode="reduce-overhead")``, whose CUDA
  graphs replay the step without Python or launch latency (CUDA only; static shapes, one
  compile per loss and shape); ``triton-cudagraph`` captures the same step by hand
  (``fastcl.graphs.capture_step``), no compiler involved.
* ``peer``: what a user would use instead, where it computes the same loss:

  - ``st-mnrl`` / ``st-cmnrl``: sentence-transformers ``MultipleNegativesRankingLoss`` and
    ``CachedMultipleNegativesRankingLoss`` (MNRL / InfoNCE; scale = 1 / temperature). The
    cached loss runs its full GradCache path around an identity "encoder" that looks the
    embeddings up, so its time is the chunked loss plus its two cheap re-embedding passes.
  - ``pml-ntxent`` / ``pml-supcon``: pytorch-metric-learning ``NTXentLoss`` / ``SupConLoss``
    with ``ref_emb``: anchors are the queries, the candidate set the references, labels say
    which candidates are an anchor's own positives. NT-Xent's denominator per positive pair
    is that positive plus every candidate of another label, which is SupMPN eq. 7 (also
    MNRL and InfoNCE with P = 1); SupCon's denominator is every candidate (``L_out``).
  - ``torch-lce``: PyTorch's chunked ``F.linear_cross_entropy`` (the logits never exist
    whole) on normalised embeddings with weight ``candidates / tau``: MNRL and InfoNCE.
  - ``inf-cl``: Inf-CL's ``cal_inf_loss`` (InfoNCE; CLIP as the mean of its two directions'
    calls; CUDA only, Triton kernels).
  - ``siglip-kernel``: siglip-kernel's ``fused_siglip_loss`` (SigLIP; its router's choice of
    kernel; it takes the log of open_clip's scale; CUDA only).
  - ``st-gist-gemm``: sentence-transformers' GIST computation with ``sim_matrix`` as one GEMM of
    normalised rows (``benchmarks.harness.gist``).

The image–text losses (``clip``, ``siglip``) and GIST have their own ``eager`` and ``compile``:
``eager`` is the peer a user runs today, open_clip's ``ClipLoss`` / ``SigLipLoss``
(``benchmarks.harness.image_text``) and sentence-transformers' ``GISTEmbedLoss`` computation
(``benchmarks.harness.gist``); ``compile`` is ``torch.compile`` of open_clip's loss, and of the
GEMM form of ST's GIST (the broadcast cosine of ST's own ``sim_matrix`` compiles into a
``B·N·d`` reduction loop). Their float64 references are open_clip's math and
``fastcl.reference.gist`` in row blocks (``cases.LOSSES``).
  - ``cce``: Apple's cut-cross-entropy ``linear_cross_entropy`` (LSE over a classifier
    without materialising the logits; its defaults, gradient filtering on) and
    ``liger-flce``: Liger-Kernel's ``LigerFusedLinearCrossEntropyLoss`` (chunked logits,
    cuBLAS products); both on MNRL/InfoNCE as cross-entropy of the normalised anchors against
    the normalised candidates scaled by 1/tau, normalised in the timed step (CUDA only).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from benchmarks.harness import gist, image_text
from benchmarks.harness.cases import IMAGE_TEXT_LOSSES, LOSSES, SENTENCE_LOSSES, TEMPERATURE, first, hyper
from fastcl.testing import value_tol

ALL_LOSSES = SENTENCE_LOSSES  # the sentence-embedding losses (every peer's layout)
EVERY_LOSS = (*SENTENCE_LOSSES, *IMAGE_TEXT_LOSSES, "gist")
FASTCL_BACKENDS = ("torch", "cpp", "triton")
# what "eager" is, per loss: the float64-exact oracle, or the peer a user runs today
EAGER_IS = {
    **{loss: "fastcl.reference oracle" for loss in SENTENCE_LOSSES},
    "clip": "open_clip ClipLoss",
    "siglip": "open_clip SigLipLoss",
    "gist": "sentence-transformers GISTEmbedLoss (its computation on given embeddings)",
}
CMNRL_MINI_BATCH = 512  # rows of the score matrix per chunk (ST's default is 32; 512 is kinder to GEMMs)


@dataclass(frozen=True)
class Impl:
    """One implementation: which losses it computes, what it needs, how to build it."""

    name: str
    family: str  # "reference" | "fastcl" | "peer"
    losses: tuple[str, ...]
    build: Callable[[str, dict], Callable[[], Tensor]]
    requires: str | None = None  # importable module needed
    cuda_only: bool = False
    backend: str | None = None  # family "fastcl": the dispatch backend it runs
    compiles: bool = False  # its first calls compile (the benchmark reports compile_s)
    dynamo: bool = False  # compiles through torch.compile (one graph per loss and process, reused)


# ---------------------------------------------------------------------------------------
# Candidate layout shared by the peers: anchors [B, d] against candidates [N, d]
# ---------------------------------------------------------------------------------------


def _columns(loss: str, t: dict) -> tuple[Tensor, list[Tensor], int]:
    """``(anchor, [candidate blocks], P)``: own positives first (anchor i's are rows
    ``i*P .. i*P+P-1``), then negatives; the blocks concatenate to ``[N, d]``."""
    anchor = t["anchor"]
    B, d = anchor.shape
    if loss in ("supmpn", "supcon"):
        P = t["positives"].shape[1]
        blocks = [t["positives"].reshape(B * P, d)]
        if t.get("negatives") is not None:
            blocks.append(t["negatives"].reshape(-1, d))
        return anchor, blocks, P
    blocks = [t["positive"]]
    if t.get("negatives") is not None:
        blocks.append(t["negatives"].reshape(-1, d))
    return anchor, blocks, 1


def _labels(B: int, P: int, N: int, device) -> tuple[Tensor, Tensor]:
    """Anchor labels ``0..B-1``; candidate labels: the owner for own positives, unique
    labels ``>= B`` for every other candidate (negatives are nobody's positive)."""
    owners = torch.arange(B, device=device).repeat_interleave(P)
    others = torch.arange(B, B + N - B * P, device=device)
    return torch.arange(B, device=device), torch.cat([owners, others])


# ---------------------------------------------------------------------------------------
# Builders
# ---------------------------------------------------------------------------------------


def _build_eager(loss: str, t: dict):
    if loss in IMAGE_TEXT_LOSSES:  # open_clip's own loss module
        call = image_text.open_clip_call(loss, image_text.open_clip_module(loss))
        return lambda: call(**t)
    if loss == "gist":  # sentence-transformers' computation, its broadcast sim_matrix included
        return lambda: gist.st_gist(**t)
    oracle = LOSSES[loss][1]
    return lambda: oracle(**t, temperature=TEMPERATURE)


_COMPILED: dict[str, Callable] = {}


def _build_compile(loss: str, t: dict):
    from benchmarks.harness import fusable

    if loss not in _COMPILED:  # one dynamic-shape graph per loss and process
        if loss in IMAGE_TEXT_LOSSES:  # open_clip's loss module, compiled
            target = image_text.open_clip_call(loss, image_text.open_clip_module(loss))
        elif loss == "gist":  # ST's computation with a GEMM sim_matrix (benchmarks.harness.gist)
            target = gist.st_gist_gemm
        else:
            # the formulation a user would write for compile to fuse (benchmarks.harness.fusable);
            # a loss without one compiles its oracle
            target = fusable.LOSSES.get(loss, LOSSES[loss][1])
        _COMPILED[loss] = torch.compile(target, dynamic=True)
    fn = _COMPILED[loss]
    kw = hyper(loss)
    return lambda: fn(**t, **kw)


def _graphs_builder(backend: str):
    """A fastcl backend under ``torch.compile(mode="reduce-overhead")``: on CUDA the step
    replays as CUDA graphs (the H100 profile of the old kernels: ~30 us per launch, ~100
    launches in a ~7 ms step). Static shapes: one compile per loss and shape."""

    def build(loss: str, t: dict):
        fused, kw = LOSSES[loss][0], hyper(loss)
        step = torch.compile(lambda **x: fused(**x, **kw, backend=backend), mode="reduce-overhead", dynamic=False)
        return lambda: step(**t)

    return build


class _Replayed:
    """The benchmark's ``fn().backward()`` for a captured step: calling the builder's function
    replays forward *and* backward (one CUDA graph), so ``backward`` here has nothing left to do."""

    def __init__(self, loss: Tensor):
        self.loss = loss

    def backward(self) -> None:
        pass

    def __float__(self) -> float:
        return float(self.loss)


def _build_cudagraph(loss: str, t: dict):
    """The ``triton`` backend's whole step captured with ``fastcl.graphs.capture_step``
    (``torch.cuda.CUDAGraph``; docs/triton.md, "CUDA graphs")."""
    from fastcl.graphs import capture_step

    fused, kw = LOSSES[loss][0], hyper(loss)
    leaves = [v for v in t.values() if isinstance(v, Tensor) and v.requires_grad]
    replay = capture_step(lambda: fused(**t, **kw, backend="triton"), leaves)
    return lambda: _Replayed(replay())


def _fastcl_builder(backend: str):
    def build(loss: str, t: dict):
        fused, kw = LOSSES[loss][0], hyper(loss)
        return lambda: fused(**t, **kw, backend=backend)

    return build


class _LookUp(nn.Module):
    """An "encoder" whose input is the embeddings themselves (for ST's cached loss)."""

    def forward(self, features: dict) -> dict:
        return {"sentence_embedding": features["sentence_embedding"]}


def _st_columns(loss: str, t: dict) -> list[Tensor]:
    # ST's input columns: anchors, positives, then one column per hard-negative slot
    cols = [t["anchor"], t["positive"]]
    if t.get("negatives") is not None:
        cols += list(t["negatives"].unbind(1))
    return cols


def _build_st_mnrl(loss: str, t: dict):
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

    module = MultipleNegativesRankingLoss(nn.Sequential(_LookUp()), scale=1 / TEMPERATURE)
    return lambda: module.compute_loss_from_embeddings(_st_columns(loss, t), None)


def _build_st_cmnrl(loss: str, t: dict):
    from sentence_transformers.sentence_transformer.losses import CachedMultipleNegativesRankingLoss

    module = CachedMultipleNegativesRankingLoss(
        nn.Sequential(_LookUp()), scale=1 / TEMPERATURE, mini_batch_size=CMNRL_MINI_BATCH
    )
    return lambda: module([{"sentence_embedding": c} for c in _st_columns(loss, t)], None)


def _pml_builder(cls_name: str):
    def build(loss: str, t: dict):
        from pytorch_metric_learning import losses as pml

        anchor, blocks, P = _columns(loss, t)
        module = getattr(pml, cls_name)(temperature=TEMPERATURE)

        def fn():
            cands = torch.cat(blocks)
            labels, ref_labels = _labels(anchor.shape[0], P, cands.shape[0], anchor.device)
            return module(anchor, labels, ref_emb=cands, ref_labels=ref_labels)

        return fn

    return build


def _build_torch_lce(loss: str, t: dict):
    anchor, blocks, _ = _columns(loss, t)
    target = torch.arange(anchor.shape[0], device=anchor.device)
    options = torch.nn.LinearCrossEntropyOptions()  # opt in to the chunked path

    def fn():
        a = F.normalize(anchor, dim=-1, eps=1e-8)
        c = F.normalize(torch.cat(blocks), dim=-1, eps=1e-8) / TEMPERATURE
        return F.linear_cross_entropy(a, c, target, options=options)

    return fn


def _build_inf_cl(loss: str, t: dict):
    from inf_cl import cal_inf_loss

    if loss == "clip":  # normalised features, open_clip's scale (its gradient through Inf-CL's product)
        x, y, s = t["image_features"], t["text_features"], t["logit_scale"]
        return lambda: 0.5 * (cal_inf_loss(x, y, scale=s) + cal_inf_loss(y, x, scale=s))
    # a tensor: Inf-CL routes the scale through its own autograd Function; mean over rows
    scale = torch.tensor(1 / TEMPERATURE, device=t["anchor"].device, dtype=torch.float32)

    def fn():
        q = F.normalize(t["anchor"], dim=-1, eps=1e-8)
        k = F.normalize(t["positive"], dim=-1, eps=1e-8)
        return cal_inf_loss(q, k, scale=scale)

    return fn


def _lce_inputs(loss: str, t: dict) -> tuple[Tensor, Tensor, Tensor]:
    """Cross-entropy form of MNRL/InfoNCE for the linear-cross-entropy peers, normalised inside
    the timed step: ``(embeddings [B, d], classifier [N, d] scaled by 1/tau, targets [B])``;
    anchor ``i``'s positive is candidate row ``i``."""
    anchor, blocks, _ = _columns(loss, t)
    e = F.normalize(anchor, dim=-1, eps=1e-8)
    c = F.normalize(torch.cat(blocks), dim=-1, eps=1e-8) / TEMPERATURE
    return e, c, torch.arange(anchor.shape[0], device=anchor.device)


def _build_siglip_kernel(loss: str, t: dict):
    from siglip_kernel import fused_siglip_loss

    x, y = t["image_features"], t["text_features"]
    # it takes log(t) (open_clip passes t = logit_scale.exp()): the log is part of the step
    return lambda: fused_siglip_loss(x, y, t["logit_scale"].log(), t["logit_bias"])


def _build_st_gist_gemm(loss: str, t: dict):
    return lambda: gist.st_gist_gemm(**t)


def _build_cce(loss: str, t: dict):
    from cut_cross_entropy import linear_cross_entropy

    # defaults as a user gets them (impl "cce", its gradient filter on)
    return lambda: linear_cross_entropy(*_lce_inputs(loss, t))


def _build_liger(loss: str, t: dict):
    from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

    module = LigerFusedLinearCrossEntropyLoss()

    def fn():
        e, c, target = _lce_inputs(loss, t)
        return module(c, e, target)  # (lin_weight [V, H], input [BT, H], target)

    return fn


IMPLS: dict[str, Impl] = {
    "eager": Impl("eager", "reference", EVERY_LOSS, _build_eager),
    "compile": Impl("compile", "reference", EVERY_LOSS, _build_compile, compiles=True, dynamo=True),
    **{b: Impl(b, "fastcl", EVERY_LOSS, _fastcl_builder(b), backend=b) for b in FASTCL_BACKENDS},
    "triton-graphs": Impl(
        "triton-graphs",
        "fastcl",
        ALL_LOSSES,
        _graphs_builder("triton"),
        cuda_only=True,
        backend="triton",
        compiles=True,
        dynamo=True,
    ),
    "triton-cudagraph": Impl(
        "triton-cudagraph", "fastcl", ALL_LOSSES, _build_cudagraph, cuda_only=True, backend="triton", compiles=True
    ),
    "st-mnrl": Impl("st-mnrl", "peer", ("mnrl", "infonce"), _build_st_mnrl, requires="sentence_transformers"),
    "st-cmnrl": Impl("st-cmnrl", "peer", ("mnrl", "infonce"), _build_st_cmnrl, requires="sentence_transformers"),
    "pml-ntxent": Impl(
        "pml-ntxent",
        "peer",
        ("supmpn", "mnrl", "infonce"),
        _pml_builder("NTXentLoss"),
        requires="pytorch_metric_learning",
    ),
    "pml-supcon": Impl(
        "pml-supcon",
        "peer",
        ("supcon", "mnrl", "infonce"),
        _pml_builder("SupConLoss"),
        requires="pytorch_metric_learning",
    ),
    "torch-lce": Impl("torch-lce", "peer", ("mnrl", "infonce"), _build_torch_lce),
    "inf-cl": Impl("inf-cl", "peer", ("infonce", "clip"), _build_inf_cl, requires="inf_cl", cuda_only=True),
    "siglip-kernel": Impl(
        "siglip-kernel", "peer", ("siglip",), _build_siglip_kernel, requires="siglip_kernel", cuda_only=True
    ),
    "st-gist-gemm": Impl("st-gist-gemm", "peer", ("gist",), _build_st_gist_gemm),
    "cce": Impl("cce", "peer", ("mnrl", "infonce"), _build_cce, requires="cut_cross_entropy", cuda_only=True),
    "liger-flce": Impl(
        "liger-flce", "peer", ("mnrl", "infonce"), _build_liger, requires="liger_kernel", cuda_only=True
    ),
}


def _torch_lce_missing() -> str | None:
    if not hasattr(F, "linear_cross_entropy"):
        return f"torch {torch.__version__} has no F.linear_cross_entropy (chunked cross-entropy)"
    return None


def unavailable(name: str, loss: str, device: str | torch.device) -> str | None:
    """Why ``name`` cannot run ``loss`` on ``device`` here (None: it can).

    fastcl backends are checked by dispatch (``fastcl.ops.dispatch.describe``); whether a
    backend takes the particular inputs is checked when it first runs (``build_checked``).
    """
    if name not in IMPLS:
        return f"unknown implementation {name!r}; choose from {sorted(IMPLS)}"
    impl = IMPLS[name]
    if loss not in impl.losses:
        return f"{name} does not compute {loss} (it computes {', '.join(impl.losses)})"
    device = torch.device(device)
    if impl.cuda_only and device.type != "cuda":
        return f"{name} runs on CUDA only"
    if impl.requires and importlib.util.find_spec(impl.requires) is None:
        return f"{name} needs the optional package {impl.requires!r} (not installed)"
    if loss in IMAGE_TEXT_LOSSES and name in ("eager", "compile"):
        why = image_text.open_clip_missing()
        if why:
            return why
    if name == "torch-lce":
        return _torch_lce_missing()
    if impl.family == "fastcl":
        from fastcl.ops import dispatch

        if impl.backend == "triton" and device.type == "cpu":
            return "fastcl backend 'triton' runs on CUDA (its CPU interpreter is for tests, not timing)"
        try:
            status = dispatch.describe()[impl.backend]
        except Exception as exc:  # a backend whose own check crashes must not take the suite down
            return f"fastcl backend check failed: {type(exc).__name__}: {exc}"
        return None if status == "available" else f"fastcl backend {impl.backend!r}: {status}"
    return None


def build(name: str, loss: str, inputs: dict) -> Callable[[], Tensor]:
    """The forward callable of implementation ``name`` on ``inputs`` (see the module docstring)."""
    why = unavailable(name, loss, first(inputs).device)
    if why:
        raise RuntimeError(why)
    return IMPLS[name].build(loss, inputs)


# ---------------------------------------------------------------------------------------
# Correctness before timing
# ---------------------------------------------------------------------------------------

# |value - reference| <= ATOL + RTOL * |reference| per input dtype; the reference runs in
# float64 on the same (already rounded) inputs.
# Largest B x N for which the float64 oracle's logits are built whole; beyond it the
# reference value comes from fastcl's chunked torch backend in float64 (memory-lean).
MAX_EAGER_REFERENCE_ELEMENTS = 2**28


class PeerMismatchError(AssertionError):
    """An implementation's loss value differs from the float64 reference."""


def reference_value(loss: str, inputs: dict) -> float:
    """The loss in float64 on the same inputs (oracle, or the chunked torch backend when big;
    the image–text and GIST oracles work in row blocks at any size)."""
    fused, oracle, _ = LOSSES[loss]
    t64 = {k: (None if v is None else v.detach().double()) for k, v in inputs.items()}
    if loss not in SENTENCE_LOSSES:
        with torch.no_grad():
            return float(oracle(**t64))
    anchor, blocks, _ = _columns(loss, t64)
    n = sum(b.shape[0] for b in blocks)
    with torch.no_grad():
        if anchor.shape[0] * n <= MAX_EAGER_REFERENCE_ELEMENTS:
            return float(oracle(**t64, temperature=TEMPERATURE))
        return float(fused(**t64, temperature=TEMPERATURE, backend="torch"))


def value_tolerance(loss: str, inputs: dict) -> tuple[float, float]:
    """``(atol, rtol)`` of ``loss``'s value on ``inputs``: ``fastcl.testing.value_tol`` of their
    dtype and sizes. ``B`` and ``d``: the first input's rows and width; ``N``: every input row
    (an upper bound of a row's candidates: GIST's guide rows are counted too); the logits' size:
    ``1 / TEMPERATURE`` (sentence losses, unit-scale inputs under cosine), open_clip's scale
    times the largest norms plus ``|bias|`` (CLIP, SigLIP), ``1 / GIST_TEMPERATURE`` (GIST)."""
    x = first(inputs)
    B, d = x.shape[0], x.shape[-1]
    mats = [v for v in inputs.values() if v is not None and v.dim() >= 2]
    N = sum(v.numel() // v.shape[-1] for v in mats)
    if loss in IMAGE_TEXT_LOSSES:
        norm = max(v.detach().double().norm(dim=-1).max().item() for v in mats) ** 2
        bias = inputs.get("logit_bias")
        logits = float(inputs["logit_scale"]) * norm + (0.0 if bias is None else abs(float(bias)))
    elif loss == "gist":
        logits = 1 / gist.GIST_TEMPERATURE
    else:
        logits = 1 / TEMPERATURE
    return value_tol(x.dtype, B=B, N=N, d=d, logit_scale=logits)


def check_value(name: str, loss: str, fn: Callable[[], Tensor], inputs: dict, expected: float | None = None) -> dict:
    """Run ``fn()`` once and assert its loss equals the float64 reference within
    :func:`value_tolerance` of the inputs; returns ``{"value", "reference", "abs_err"}``.

    Raises :class:`PeerMismatchError` naming the implementation when it does not.
    """
    ref = reference_value(loss, inputs) if expected is None else expected
    with torch.no_grad():
        got = float(fn())
    atol, rtol = value_tolerance(loss, inputs)
    err = abs(got - ref)
    if not err <= atol + rtol * abs(ref):  # also catches NaN
        raise PeerMismatchError(
            f"{name} computes {loss} = {got!r}, the float64 reference gives {ref!r} "
            f"(|diff| {err:.3g} > {atol} + {rtol} * |ref|): not the same loss, not timed"
        )
    return {"value": got, "reference": ref, "abs_err": err}

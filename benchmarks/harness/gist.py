"""GISTEmbed in the loss grid: inputs, sentence-transformers' computation as the peer, fastcl's
call and the float64 oracle.

The workload is ``GISTEmbedLoss`` of sentence-transformers 6.2 after its encoders ran: the
model's embeddings of anchors, positives and one hard negative each (``[B, d]`` leaves that
require grad) and the guide model's (``[B, GUIDE_D]``, no grad: ST embeds the guide under
``no_grad``). ST's defaults: ``temperature = 0.01``, absolute margin 0, anchor–anchor and
positive–positive blocks on, so every row has ``N = 4B`` candidates (ap, aa, pp, an). The
guide's positives lie near their anchors (cosine about 0.9), so the filter drops what it
drops on real data: the aa and pp diagonals and few others.

* ``eager`` (:func:`st_gist`) is ST's ``forward`` from its embeddings on, line for line:
  ``sim_matrix`` is ``nn.CosineSimilarity(dim=-1)`` of ``e1.unsqueeze(1)`` and
  ``e2.unsqueeze(0)``, which broadcasts to ``[B, N, d]`` before it reduces over ``d`` (and
  its backward does the same), then ``mask_false_negatives`` (``sim[mask] = -inf``) and
  ``CrossEntropyLoss`` with target ``i``. The broadcast is what ST runs: 2.3 GiB and seconds
  for one ``512 x 512 x 768`` block, ``B x B x d`` floats per block (48 GiB at B = 4096), so
  the grid runs ``eager`` only where that fits (``MAX_BROADCAST_ELEMENTS``).
* ``st-gist-gemm`` is the same computation with ``sim_matrix`` as one GEMM of normalised rows
  (:func:`gemm_sim`; equal values): ST's loss as it would cost with a dense ``[B, 4B]`` logit
  matrix, the baseline a fused loss has to beat once the broadcast is gone.
* ``compile`` is ``torch.compile`` of that GEMM form, the loss written for compile to fuse (as
  ``compile`` is for every loss of the grid, ``benchmarks.harness.fusable``): compiled as ST
  writes it, the broadcast becomes a ``B·N·d`` reduction loop, ~1 s per ``512 x 512`` block.
* the oracle (:func:`gist_oracle`) is ``fastcl.reference.gist`` in float64 in row blocks (no
  ``[B, N]`` or ``[B, N, d]``), checked equal to it in ``tests/bench``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

GUIDE_D = 384  # the guide's width (all-MiniLM-L6-v2's, ST's usual guide)
GIST_TEMPERATURE = 0.01  # ST's default
GIST_MARGIN = 0.0  # ST's default (absolute)
ORACLE_ROWS = 512
# eager ST materialises one [B, B, d] product per block (and more in backward): beyond this
# many elements (1 GiB in float32) the grid skips it
MAX_BROADCAST_ELEMENTS = 2**28


def make_inputs(B: int, Q: int, d: int, dt: torch.dtype, device, gen: torch.Generator) -> dict[str, Tensor]:
    """The model's ``anchor``, ``positive`` and ``negatives`` (``[B, d]`` with one hard
    negative, ``[B, Q, d]`` with more) that require grad, and the guide's embeddings."""

    def emb(*shape, grad=True, like=None):
        x = torch.randn(*shape, generator=gen, device=device, dtype=torch.float32)
        if like is not None:  # near ``like``: the guide's positives
            x = like + 0.5 * x
        return x.to(dt).requires_grad_(grad)

    anchor, positive = emb(B, d), emb(B, d)
    negatives = emb(B, d) if Q == 1 else emb(B, Q, d)
    with torch.no_grad():
        ga = torch.randn(B, GUIDE_D, generator=gen, device=device, dtype=torch.float32)
        gp = emb(B, GUIDE_D, grad=False, like=ga)
        gn = torch.randn(*negatives.shape[:-1], GUIDE_D, generator=gen, device=device, dtype=torch.float32)
    return {
        "anchor": anchor,
        "positive": positive,
        "negatives": negatives,
        "guide_anchor": ga.to(dt),
        "guide_positive": gp,
        "guide_negative": gn.to(dt),
    }


def fastcl_gist(
    anchor, positive, negatives, guide_anchor, guide_positive, guide_negative, *, backend: str = "auto"
) -> Tensor:
    from fastcl.losses import gist_loss

    return gist_loss(
        anchor,
        positive,
        negatives,
        guide=(guide_anchor, guide_positive, guide_negative),
        temperature=GIST_TEMPERATURE,
        margin=GIST_MARGIN,
        backend=backend,
    )


# ---------------------------------------------------------------------------------------
# sentence-transformers' computation (GISTEmbedLoss.forward after embed_columns)
# ---------------------------------------------------------------------------------------

_COSINE = nn.CosineSimilarity(dim=-1)


def st_sim(embed1: Tensor, embed2: Tensor) -> Tensor:
    """ST's ``GISTEmbedLoss.sim_matrix``: ``CosineSimilarity(dim=-1)`` of broadcast views."""
    return _COSINE(embed1.unsqueeze(1), embed2.unsqueeze(0))


def gemm_sim(embed1: Tensor, embed2: Tensor) -> Tensor:
    """The same cosines as one GEMM of normalised rows (``cosine_similarity``'s ``eps``)."""
    return F.normalize(embed1, dim=-1, eps=1e-8) @ F.normalize(embed2, dim=-1, eps=1e-8).T


def st_gist(
    anchor,
    positive,
    negatives,
    guide_anchor,
    guide_positive,
    guide_negative,
    *,
    sim_matrix=st_sim,
    temperature: float = GIST_TEMPERATURE,
    margin_strategy: str = "absolute",
    margin: float = GIST_MARGIN,
    contrast_anchors: bool = True,
    contrast_positives: bool = True,
) -> Tensor:
    """sentence-transformers 6.2 ``GISTEmbedLoss.forward`` on given embeddings, one process
    (``offset = 0``; ST's columns: anchor, positive, negative). Several hard negatives
    ``[B, Q, d]`` are ST's column-per-slot layout flattened to ``[B·Q, d]``."""
    negative, negative_guide = negatives, guide_negative
    if negative is not None and negative.dim() == 3:
        negative, negative_guide = (
            negative.reshape(-1, negative.shape[-1]),
            negative_guide.reshape(-1, negative_guide.shape[-1]),
        )
    anchor_guide, positive_guide = guide_anchor, guide_positive
    batch_size = anchor.size(0)
    offset = 0

    ap_sim = sim_matrix(anchor, positive)
    guided_ap_sim = sim_matrix(anchor_guide, positive_guide)
    guided_sim = guided_ap_sim.diagonal(offset=offset).view(-1, 1)

    def mask_false_negatives(guided_sim_mat, sim_mat, positive_mask: Tensor | None = None):
        if margin_strategy == "absolute":
            mask = guided_sim_mat > (guided_sim - margin)
        else:  # "relative"
            mask = guided_sim_mat > (guided_sim - guided_sim.abs() * margin)
        if positive_mask is not None:
            mask = mask & ~positive_mask
        sim_mat[mask] = -torch.inf
        return sim_mat

    positive_mask = torch.zeros_like(guided_ap_sim, dtype=torch.bool)
    rows = torch.arange(guided_ap_sim.size(0), device=guided_ap_sim.device)
    positive_mask[rows, offset + rows] = True
    ap_sim = mask_false_negatives(guided_ap_sim, ap_sim, positive_mask=positive_mask)
    scores = [ap_sim]
    if contrast_anchors:
        aa_sim = sim_matrix(anchor, anchor)
        guided_aa_sim = sim_matrix(anchor_guide, anchor_guide)
        scores.append(mask_false_negatives(guided_aa_sim, aa_sim))
    if contrast_positives:
        pp_sim = sim_matrix(positive[offset : offset + batch_size], positive)
        guided_pp_sim = sim_matrix(positive_guide[offset : offset + batch_size], positive_guide)
        scores.append(mask_false_negatives(guided_pp_sim, pp_sim))
    if negative is not None:
        an_sim = sim_matrix(anchor, negative)
        guided_an_sim = sim_matrix(anchor_guide, negative_guide)
        scores.append(mask_false_negatives(guided_an_sim, an_sim))
    scores = torch.cat(scores, dim=1) / temperature
    range_labels = torch.arange(offset, offset + batch_size, device=anchor.device)
    return F.cross_entropy(scores, range_labels)


def st_gist_gemm(*args, **kwargs) -> Tensor:
    """:func:`st_gist` with ``sim_matrix`` as a GEMM (:func:`gemm_sim`)."""
    return st_gist(*args, sim_matrix=gemm_sim, **kwargs)


def broadcast_elements(B: int, Q: int, d: int) -> int:
    """Elements of the largest ``[rows, cols, d]`` product ST's ``sim_matrix`` materialises."""
    return B * max(B, B * Q) * d


# ---------------------------------------------------------------------------------------
# float64 oracle: fastcl.reference.gist in row blocks
# ---------------------------------------------------------------------------------------


def gist_oracle(
    anchor,
    positive,
    negatives,
    guide_anchor,
    guide_positive,
    guide_negative,
    *,
    temperature: float = GIST_TEMPERATURE,
    margin: float = GIST_MARGIN,
    rows: int = ORACLE_ROWS,
) -> Tensor:
    """``fastcl.reference.gist`` (absolute margin, both contrast blocks, mean) over blocks of
    ``rows`` anchors: each row's candidates ``[ap | aa | pp | an]``, those the guide finds more
    similar than the positive (less the margin) dropped, the own positive never."""
    from fastcl.ops.contract import EPS

    neg, gn = negatives, guide_negative
    if neg.dim() == 3:
        neg, gn = neg.reshape(-1, neg.shape[-1]), gn.reshape(-1, gn.shape[-1])
    B = anchor.shape[0]

    def unit(x, eps=EPS):
        return x / x.norm(dim=-1, keepdim=True).clamp_min(eps)

    a, p, n = unit(anchor), unit(positive), unit(neg)
    ga, gp, gn = unit(guide_anchor, 1e-8), unit(guide_positive, 1e-8), unit(gn, 1e-8)
    total = anchor.new_zeros(())
    for r0 in range(0, B, rows):
        r1 = min(r0 + rows, B)
        own = torch.arange(r0, r1, device=anchor.device)
        g = (ga[r0:r1] * gp[r0:r1]).sum(-1, keepdim=True)  # the positive's guide cosine
        threshold = g - margin
        blocks = []
        for sims, guided, protect in (
            (a[r0:r1] @ p.T, ga[r0:r1] @ gp.T, True),
            (a[r0:r1] @ a.T, ga[r0:r1] @ ga.T, False),
            (p[r0:r1] @ p.T, gp[r0:r1] @ gp.T, False),
            (a[r0:r1] @ n.T, ga[r0:r1] @ gn.T, False),
        ):
            drop = guided > threshold
            if protect:
                drop[torch.arange(r1 - r0, device=anchor.device), own] = False
            blocks.append(sims.masked_fill(drop, float("-inf")))
        logits = torch.cat(blocks, dim=1) / temperature
        total = total + F.cross_entropy(logits, own, reduction="sum")
    return total / B

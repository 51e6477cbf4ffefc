"""Readable PyTorch oracles that define what is right (nothing here is fast on purpose): the
``"reference"`` backend and loss-level oracles straight from docs/losses.md that share no code
with the fused path; float64 for tests (docs/design.md, "The reference").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .ops.backend import Backend
from .ops.contract import (
    EPS,
    TAG_PADDING,
    LSEProblem,
    compute_dtype,
    excluded,
    filtered,
    finite_or_zero,
    own_positive_columns,
    sigmoid_terms,
)
from .ops.normalize import normalize_backward, normalize_rows

# --------------------------------------------------------------------------- the "reference" backend


def _rows(x: Tensor, cosine: bool, eps: float) -> Tensor:
    """``x / max(|x|, eps)`` (cosine) or ``x`` (dot) per row, ``|x|`` as ``m * |x / m|`` with
    ``m = max |x_k|`` (constant for autograd: no overflow or underflow). A row holding NaN or
    Inf comes out all NaN, for dot similarity too, so that no logit reading it is finite."""
    m = x.detach().abs().amax(dim=-1, keepdim=True)
    unit = torch.where(m > 0, m, torch.ones_like(m))  # NaN and Inf rows stay non-finite below
    if not cosine:
        return x + m * 0
    norm = torch.linalg.vector_norm(x / unit, dim=-1, keepdim=True) * unit
    return x / norm.clamp_min(eps)


def _similarity(x: Tensor, y: Tensor, cosine: bool, eps: float) -> Tensor:
    return _rows(x, cosine, eps) @ _rows(y, cosine, eps).T


def _safe_logsumexp(logits: Tensor, keep: Tensor) -> Tensor:
    """Row LSE over ``keep``; ``-inf`` for empty rows, with NaN-free gradients."""
    nonempty = keep.any(1)
    filled = logits.masked_fill(~keep, float("-inf"))
    filled = torch.where(nonempty[:, None], filled, torch.zeros_like(filled))
    lse = torch.logsumexp(filled, dim=1)
    return torch.where(nonempty, lse, torch.full_like(lse, float("-inf")))


class ReferenceLSE(Backend):
    """Masked LSE (or the sigmoid reduction) on the full logits matrix (``backend="reference"``)
    in plain out-of-place torch ops, so its backward is differentiable: the one exact double
    backward (``create_graph=True``). Filters are applied literally (docs/design.md, "Filters")."""

    name = "reference"
    double_backward = True
    fused = None
    takes_filter = True
    takes_sigmoid = True
    takes_columns = True

    @staticmethod
    def _logits(problem: LSEProblem, tau: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``(a, c, logits [B, N], keep [B, N])`` with ``a``, ``c`` the raw rows in the compute dtype
        (with a filter: non-finite rows read as zeros, their NaN added to the logits instead)."""
        cd, tags = compute_dtype(problem.dtype), torch.cat(problem.tags)
        a, c = problem.anchor.to(cd), torch.cat(problem.blocks).to(cd)
        # a padded candidate is read as zeros: whatever it holds (NaN, Inf) reaches no value
        # and no gradient (a masked NaN logit would still give NaN = 0 * NaN in backward)
        c = torch.where((tags != TAG_PADDING)[:, None], c, torch.zeros((), dtype=cd, device=c.device))
        f = problem.filter
        if f is not None:
            a, poison_a = finite_or_zero(a)
            c, poison_c = finite_or_zero(c)
        sim = _similarity(a, c, problem.cosine, problem.eps)
        if f is not None:
            sim = sim + poison_a[:, None] + poison_c[None, :]
        rows = torch.arange(problem.num_anchors, device=problem.device)
        keep = ~excluded(tags, rows)
        if f is not None:
            own = own_positive_columns(problem.positives, rows, c.shape[0])
            if f.guide_anchor is not None and f.guide_blocks is not None:
                guide = _similarity(f.guide_anchor.to(cd), torch.cat(f.guide_blocks).to(cd), True, problem.eps)
            else:
                guide = sim
            keep = keep & ~filtered(guide.detach(), f.threshold, own)
        return a, c, sim / tau.to(cd), keep

    @staticmethod
    def _softmax(logits: Tensor, keep: Tensor, lse: Tensor) -> Tensor:
        """Row softmax over ``keep``; all zeros for an empty row (``lse = -inf``), all NaN for a
        row whose lse is NaN or +inf (what autograd gives: never ``exp(logit)`` unnormalised)."""
        shift = torch.where(lse == -torch.inf, 0.0, torch.where(lse == torch.inf, torch.nan, lse))
        shifted = torch.where(keep, logits - shift[:, None], -torch.inf)
        return torch.where(keep, shifted.exp(), 0.0)

    @staticmethod
    def _sigmoid(problem: LSEProblem, logits: Tensor, keep: Tensor) -> tuple[Tensor, Tensor]:
        """``(terms, sigma)`` ``[B, N]`` of the sigmoid reduction, zero outside ``keep``."""
        assert problem.sigmoid is not None
        rows = torch.arange(problem.num_anchors, device=problem.device)
        z = torch.where(own_positive_columns(problem.positives, rows, logits.shape[1]), 1.0, -1.0).to(logits.dtype)
        # masked first: a dropped NaN logit never enters the elementwise functions (masking only
        # after them leaves 0 * NaN in their derivatives under autograd: the double backward)
        logits = torch.where(keep, logits, 0.0)
        terms, sigma = sigmoid_terms(logits, z, problem.sigmoid.bias.to(logits.dtype))
        return torch.where(keep, terms, 0.0), torch.where(keep, sigma, 0.0)

    def forward(self, problem: LSEProblem, tau: Tensor) -> tuple[Tensor, Tensor]:
        if problem.dims is not None:  # Matryoshka: the definition, one plain problem per prefix
            outs = [self.forward(problem.prefix(k), tau) for k in range(problem.num_prefixes)]
            stack_dim = 1 if problem.sigmoid is not None else 0  # sigmoid stats: [2, K, B]
            return torch.stack([v for v, _ in outs]), torch.stack([m for _, m in outs], dim=stack_dim)
        _, _, logits, keep = self._logits(problem, tau)
        if problem.columns:  # the columns' LSEs are the rows' of the transposed logits
            lse_r, ml_r = self._lse_rows(logits, keep)
            lse_c, ml_c = self._lse_rows(logits.T, keep.T)
            return torch.cat([lse_r, lse_c]), torch.cat([ml_r, ml_c])
        kept_logits = torch.where(keep, logits, 0.0)
        if problem.sigmoid is not None:
            terms, sigma = self._sigmoid(problem, logits, keep)
            return terms.sum(1), torch.stack([(sigma * kept_logits).sum(1), sigma.sum(1)])
        return self._lse_rows(logits, keep)

    def _lse_rows(self, logits: Tensor, keep: Tensor) -> tuple[Tensor, Tensor]:
        lse = _safe_logsumexp(logits, keep)
        p = self._softmax(logits, keep, lse)
        return lse, (p * torch.where(keep, logits, 0.0)).sum(1)

    def backward(self, problem: LSEProblem, tau: Tensor, lse: Tensor, g: Tensor, d_pos: Tensor | None = None):
        if problem.dims is not None:
            return self._prefix_backward(problem, tau, lse, g, d_pos)
        a, c, logits, keep = self._logits(problem, tau)
        if problem.sigmoid is not None:  # the own positives are inside the sum: nothing to fold
            d_logits = g[:, None].to(logits.dtype) * self._sigmoid(problem, logits, keep)[1]
        elif problem.columns:  # rows' softmax weighted by g_i plus the columns' by g_(B + j)
            B = problem.num_anchors
            g_r, g_c = g[:B, None].to(logits.dtype), g[B:, None].to(logits.dtype)
            d_logits = g_r * self._softmax(logits, keep, lse[:B]) + (g_c * self._softmax(logits.T, keep.T, lse[B:])).T
        else:
            d_logits = g[:, None].to(logits.dtype) * self._softmax(logits, keep, lse)
        if d_pos is not None and problem.positives is not None and problem.sigmoid is None:
            B, P = d_pos.shape  # fold the own positives' gradient
            rows = torch.arange(B, device=problem.device)[:, None].expand(B, P)
            cols = problem.positives.offset + rows * P + torch.arange(P, device=problem.device)
            d_logits = d_logits.index_put((rows, cols), d_pos.to(d_logits.dtype), accumulate=True)
        d_sim = d_logits / tau.to(logits.dtype)
        if not problem.cosine:
            d_a, d_c = d_sim @ c, d_sim.T @ a
        else:  # through x_hat = x / max(|x|, eps), the norm taken as in the forward
            a_hat, a_norm = normalize_rows(a, problem.eps, True)
            c_hat, c_norm = normalize_rows(c, problem.eps, True)
            d_a = normalize_backward(a_hat, a_norm, d_sim @ c_hat, problem.eps)
            d_c = normalize_backward(c_hat, c_norm, d_sim.T @ a_hat, problem.eps)
        padded = (torch.cat(problem.tags) == TAG_PADDING)[:, None]
        d_c = torch.where(padded, torch.zeros((), dtype=d_c.dtype, device=d_c.device), d_c)  # exactly zero
        n0 = problem.blocks[0].shape[0]
        return d_a, (d_c[:n0], d_c[n0:])

    def _prefix_backward(self, problem: LSEProblem, tau: Tensor, lse: Tensor, g: Tensor, d_pos: Tensor | None):
        """Sum of the prefixes' plain gradients, each zero-padded to the full ``d``."""
        total = None
        for k, m in enumerate(problem.prefixes):
            dp = None if d_pos is None else d_pos[k]
            d_a, d_b = self.backward(problem.prefix(k), tau, lse[k], g[k], dp)
            grads = [F.pad(t, (0, problem.dim - m)) for t in (d_a, *d_b)]  # out of place: differentiable
            total = grads if total is None else [t + u for t, u in zip(total, grads)]
        return total[0], (total[1], total[2])


BACKEND = ReferenceLSE()


# --------------------------------------------------------------------------- loss-level oracles


def _reduce(terms: Tensor, pos_mask: Tensor, reduction: str) -> Tensor:
    """Each anchor's mean over its valid positives' ``terms [B, P]``, then ``reduction``."""
    terms = torch.where(pos_mask, terms, torch.zeros_like(terms))
    per_anchor = terms.sum(1) / pos_mask.sum(1).clamp_min(1)
    has_pos = pos_mask.any(1)
    per_anchor = torch.where(has_pos, per_anchor, torch.zeros_like(per_anchor))
    if reduction == "none":
        return per_anchor
    if reduction == "sum":
        return per_anchor.sum()
    return per_anchor.sum() / has_pos.sum().clamp_min(1)


def _candidates(positives: Tensor, negatives: Tensor | None, pos_mask, neg_mask):
    """Flatten the batch's candidates; return (cands [N,d], valid [N], owner [N], is_pos [N])."""
    B, P, d = positives.shape
    dev = positives.device
    negatives = positives.new_zeros(B, 0, d) if negatives is None else negatives
    Q = negatives.shape[1]
    pos_mask = torch.ones(B, P, dtype=torch.bool, device=dev) if pos_mask is None else pos_mask
    neg_mask = torch.ones(B, Q, dtype=torch.bool, device=dev) if neg_mask is None else neg_mask
    cands = torch.cat([positives.reshape(B * P, d), negatives.reshape(B * Q, d)])
    valid = torch.cat([pos_mask.reshape(-1), neg_mask.reshape(-1)])
    rows = torch.arange(B, device=dev)
    owner = torch.cat([rows.repeat_interleave(P), rows.repeat_interleave(Q)])
    is_pos = torch.arange(B * (P + Q), device=dev) < B * P
    return cands, valid, owner, is_pos, pos_mask


def _own_positive_logits(logits: Tensor, B: int, P: int) -> Tensor:
    """``[B, P]``: anchor i's own positives are candidate columns ``i*P .. i*P + P - 1``."""
    rows = torch.arange(B, device=logits.device)[:, None]
    cols = rows * P + torch.arange(P, device=logits.device)[None, :]
    return logits[rows, cols]


def _logits(anchor: Tensor, cands: Tensor, temperature, similarity: str) -> Tensor:
    return _similarity(anchor, cands, similarity == "cos", EPS) / temperature


def supmpn(
    anchor,
    positives,
    negatives=None,
    *,
    pos_mask=None,
    neg_mask=None,
    temperature=0.05,
    reduction="mean",
    similarity="cos",
    own_positives="exclude",
):
    """SupMPN eq. 7: ``mean_k [-l_ik + log(exp(l_ik) + R_i)]``, ``R_i`` = every valid candidate
    except anchor i's own positives (``own_positives="zero_logit"``: those count exp(0) each)."""
    B, P, _ = positives.shape
    cands, valid, owner, is_pos, pos_mask = _candidates(positives, negatives, pos_mask, neg_mask)
    logits = _logits(anchor, cands, temperature, similarity)  # [B, N]
    rows = torch.arange(B, device=anchor.device)[:, None]
    own_pos = is_pos[None, :] & (owner[None, :] == rows)
    in_r = valid[None, :] & ~own_pos
    big_r = torch.where(in_r, logits.exp(), torch.zeros_like(logits)).sum(1)  # R_i
    if own_positives == "zero_logit":
        big_r = big_r + (pos_mask.sum(1) - 1).clamp_min(0).to(big_r.dtype)
    pos_l = _own_positive_logits(logits, B, P)
    return _reduce(-pos_l + torch.log(pos_l.exp() + big_r[:, None]), pos_mask, reduction)


def supcon(
    anchor,
    positives,
    negatives=None,
    *,
    pos_mask=None,
    neg_mask=None,
    temperature=0.05,
    reduction="mean",
    similarity="cos",
):
    """Supervised contrastive (L_out): ``mean_k [-l_ik + LSE_{c in C} l_ic]``, C = all valid candidates."""
    B, P, _ = positives.shape
    cands, valid, _, _, pos_mask = _candidates(positives, negatives, pos_mask, neg_mask)
    logits = _logits(anchor, cands, temperature, similarity)
    lse = torch.logsumexp(logits.masked_fill(~valid[None, :], float("-inf")), dim=1)
    pos_l = _own_positive_logits(logits, B, P)
    return _reduce(lse[:, None] - pos_l, pos_mask, reduction)


def mnrl(anchor, positive, negatives=None, *, neg_mask=None, temperature=0.05, reduction="mean", similarity="cos"):
    """Multiple negatives ranking / SimCSE supervised: cross-entropy of row i against
    ``[all positives, all negatives]`` with target i (the SBERT / SimCSE formulation)."""
    B = anchor.shape[0]
    cols = [positive]
    valid = [torch.ones(B, dtype=torch.bool, device=anchor.device)]
    if negatives is not None:
        negatives = negatives[:, None, :] if negatives.dim() == 2 else negatives
        Q = negatives.shape[1]
        cols.append(negatives.reshape(B * Q, -1))
        m = torch.ones(B, Q, dtype=torch.bool, device=anchor.device) if neg_mask is None else neg_mask
        valid.append(m.reshape(-1))
    logits = _logits(anchor, torch.cat(cols), temperature, similarity)
    logits = logits.masked_fill(~torch.cat(valid)[None, :], float("-inf"))
    target = torch.arange(B, device=anchor.device)
    return F.cross_entropy(logits, target, reduction=reduction)


def infonce(anchor, positive, *, temperature=0.05, symmetric=False, reduction="mean", similarity="cos"):
    """SimCSE unsupervised: ``CE(a_i . p_j / tau, target i)``; symmetric averages both directions."""
    target = torch.arange(anchor.shape[0], device=anchor.device)
    rows = F.cross_entropy(_logits(anchor, positive, temperature, similarity), target, reduction=reduction)
    if not symmetric:
        return rows
    cols = F.cross_entropy(_logits(positive, anchor, temperature, similarity), target, reduction=reduction)
    return 0.5 * (rows + cols)


def edacse(anchor, dropout_view, augmented_view, *, lam=0.6, temperature=0.05, reduction="mean", similarity="cos"):
    """EdaCSE eq. 2: ``InfoNCE(a, a') + lam * InfoNCE(a, a_aug)``."""
    kw = dict(temperature=temperature, reduction=reduction, similarity=similarity)
    return infonce(anchor, dropout_view, **kw) + lam * infonce(anchor, augmented_view, **kw)


def grouped_cosine(h, z, *, group_size, reduction="mean"):
    """GCLSR eq. 6: ``-mean_{i,g} cos(h_ig, stopgrad(z_ig))`` over groups of ``group_size`` features."""
    B, D = h.shape
    hg = F.normalize(h.reshape(B, D // group_size, group_size), dim=-1, eps=EPS)
    zg = F.normalize(z.detach().reshape(B, D // group_size, group_size), dim=-1, eps=EPS)
    per_sample = -(hg * zg).sum(-1).mean(-1)
    if reduction == "none":
        return per_sample
    return per_sample.sum() if reduction == "sum" else per_sample.mean()


def gclsr(h1, z1, h2, z2, *, group_size=16, reduction="mean"):
    """GCLSR eq. 7 (SimSiam-symmetric): ``0.5 * (L(h1, z2) + L(h2, z1))``."""
    kw = dict(group_size=group_size, reduction=reduction)
    return 0.5 * (grouped_cosine(h1, z2, **kw) + grouped_cosine(h2, z1, **kw))


def gist(
    anchor,
    positive,
    negatives=None,
    *,
    guide,
    margin_strategy="absolute",
    margin=0.0,
    contrast_anchors=True,
    contrast_positives=True,
    temperature=0.01,
    reduction="mean",
    similarity="cos",
):
    """GISTEmbed as sentence-transformers 6.2's ``GISTEmbedLoss`` computes it on given embeddings:
    the blocks ``[ap | aa | pp | an]``, a guide cosine above the anchor–positive one (less the
    margin) masked with ``-inf`` (the own positive never), cross-entropy with target ``i``."""
    ga, gp = guide[0], guide[1]
    gn = guide[2] if len(guide) > 2 else None
    B = anchor.shape[0]
    if negatives is not None and negatives.dim() == 3:
        negatives, gn = negatives.reshape(-1, negatives.shape[-1]), gn.reshape(-1, gn.shape[-1])

    def sim(x, y, cosine=similarity == "cos"):
        return _similarity(x, y, cosine, EPS)

    def guide_sim(x, y):
        return F.cosine_similarity(x[:, None, :], y[None, :, :], dim=-1)

    g_ap = guide_sim(ga, gp)
    g = g_ap.diagonal()[:, None]
    threshold = g - margin if margin_strategy == "absolute" else g - g.abs() * margin

    def masked(guided, s, protect=None):
        drop = guided > threshold
        if protect is not None:
            drop = drop & ~protect
        return s.masked_fill(drop, float("-inf"))

    eye = torch.eye(B, dtype=torch.bool, device=anchor.device)
    scores = [masked(g_ap, sim(anchor, positive), eye)]
    if contrast_anchors:
        scores.append(masked(guide_sim(ga, ga), sim(anchor, anchor)))
    if contrast_positives:
        scores.append(masked(guide_sim(gp, gp), sim(positive, positive)))
    if negatives is not None:
        scores.append(masked(guide_sim(ga, gn), sim(anchor, negatives)))
    logits = torch.cat(scores, dim=1) / temperature
    return F.cross_entropy(logits, torch.arange(B, device=anchor.device), reduction=reduction)


def self_margin_mnrl(anchor, positive, negatives=None, *, margin, temperature=0.05, reduction="mean", similarity="cos"):
    """MNRL whose candidates more similar to the anchor than its positive plus ``margin`` leave the
    row (the positive itself stays): the self-margin false-negative filter, written out."""
    B = anchor.shape[0]
    cols = [positive]
    if negatives is not None:
        negatives = negatives[:, None, :] if negatives.dim() == 2 else negatives
        cols.append(negatives.reshape(-1, negatives.shape[-1]))
    s = _similarity(anchor, torch.cat(cols), similarity == "cos", EPS)
    pos = s.diagonal()[:, None]
    drop = (s > pos.detach() + margin) & ~torch.eye(B, s.shape[1], dtype=torch.bool, device=s.device)
    logits = s.masked_fill(drop, float("-inf")) / temperature
    return F.cross_entropy(logits, torch.arange(B, device=anchor.device), reduction=reduction)

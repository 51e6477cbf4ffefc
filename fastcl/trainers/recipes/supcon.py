"""Liao (SupCon + CE): ``(1 - lam) * CE + lam * SCL`` on NLI with in-batch anchors.

CE is SBERT's softmax classifier on ``(u, v, |u - v|)`` (u = premise, v = hypothesis
embedding): Linear(3H -> 768) -> Linear(768 -> 3), no activation between (as released).
SCL: anchors are the premises of the batch's entailment rows, candidates the batch's
hypotheses (:func:`fastcl.data.liao_in_batch`). ``allpalln``: every hypothesis is in every
anchor's denominator -> :func:`fastcl.losses.supcon_pool_loss` (fused; cross-device with
DDP). ``3p3n``: each anchor has its own denominator (its <= 3 positives and 3 sampled
negatives), so the loss is formed on the small ``[A, <= 6]`` logits directly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fastcl.data import LIAO_CAPS, collate_liao, load_nli
from fastcl.losses import supcon_pool_loss
from fastcl.trainers.config import finite_float
from fastcl.trainers.hf import HFRecipe, split_rows, unwrap
from fastcl.trainers.model import SentenceEncoder, save_pretrained

SIMILARITIES = ("dot", "cos")


class SoftmaxHead(nn.Module):
    """SBERT's NLI classifier input ``(u, v, |u - v|)`` -> Linear(3H, inner) -> Linear(inner, 3)."""

    def __init__(self, hidden: int, inner: int = 768, classes: int = 3):
        super().__init__()
        self.proj = nn.Linear(3 * hidden, inner)
        self.out = nn.Linear(inner, classes)

    def forward(self, u: Tensor, v: Tensor) -> Tensor:
        return self.out(self.proj(torch.cat([u, v, (u - v).abs()], dim=-1)))


class LiaoModel(nn.Module):
    """The encoder (``forward`` = embeddings, so DDP and the gradient cache wrap it) + the CE head."""

    def __init__(self, encoder: SentenceEncoder, head: SoftmaxHead):
        super().__init__()
        self.encoder, self.head = encoder, head

    def forward(self, **inputs) -> Tensor:
        return self.encoder(**inputs)


def local_supcon(
    anchor: Tensor,
    candidates: Tensor,
    pos_index: Tensor,
    pos_mask: Tensor,
    neg_index: Tensor,
    neg_mask: Tensor,
    tau: float,
    cosine: bool,
) -> Tensor:
    """Per-anchor SupCon: ``mean_k [-l_ik + LSE_{c in pos_i u neg_i} l_ic]``, mean over anchors
    with a positive. anchor ``[A, d]``, candidates ``[N, d]``, index/mask ``[A, P]`` / ``[A, Q]``."""
    if cosine:
        anchor, candidates = (
            F.normalize(anchor.float(), dim=-1, eps=1e-8),
            F.normalize(candidates.float(), dim=-1, eps=1e-8),
        )
    index, mask = torch.cat([pos_index, neg_index], 1), torch.cat([pos_mask, neg_mask], 1)
    logits = torch.einsum("ad,akd->ak", anchor.float(), candidates.float()[index]) / tau
    logits = logits.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(logits, dim=1, keepdim=True)
    P = pos_index.shape[1]
    terms = torch.where(pos_mask, lse - logits[:, :P], torch.zeros_like(lse))
    counts = pos_mask.sum(1)
    has = counts > 0
    per_anchor = terms.sum(1)[has] / counts[has]
    return per_anchor.mean() if per_anchor.numel() else anchor.sum() * 0.0


def _pad_to_all_rows(batch, B: int) -> tuple[Tensor, Tensor]:
    """``pos_index/pos_mask`` as ``[B, B]``: row r = premise r (empty unless an entailment row)."""
    rows, index, mask = batch["anchor_rows"], batch["pos_index"], batch["pos_mask"]
    full_index = index.new_zeros(B, B)
    full_mask = mask.new_zeros(B, B)
    full_index[rows, : index.shape[1]] = index
    full_mask[rows, : mask.shape[1]] = mask
    return full_index, full_mask


class SupCon(HFRecipe):
    name = "supcon"
    help = "Liao: (1-lam) * CE (SBERT softmax head) + lam * supervised contrastive, 3p3n / allpalln"
    presets = {
        # code: AdamW 2e-5, batch 64, 1 epoch, 10 % warm-up then constant, SNLI in data order;
        # mean pooling over the tokens except [CLS] (a proper masked mean) at train and test
        "liao": {
            "batch_size": 64,
            "lr": 2e-5,
            "epochs": 1,
            "warmup_ratio": 0.1,
            "schedule": "constant",
            "pooling": "mean_no_cls",
            "mlp": "none",
            "lam": 0.3,
            "temperature": 1.0,
            "similarity": "dot",
            "cap": "allpalln",
            "shuffle": False,
            "max_length": 128,
        },
        "liao-transfer": {
            "batch_size": 64,
            "lr": 2e-5,
            "epochs": 1,
            "warmup_ratio": 0.1,
            "schedule": "constant",
            "pooling": "mean_no_cls",
            "mlp": "none",
            "lam": 0.1,
            "temperature": 1.0,
            "similarity": "dot",
            "cap": "allpalln",
            "shuffle": False,
            "max_length": 128,
        },
    }
    defaults = {"batch_size": 64, "lr": 2e-5, "warmup_ratio": 0.1, "schedule": "constant", "shuffle": False}

    def add_method_arguments(self, g) -> None:
        g.add_argument(
            "--lam", type=finite_float, help="weight of the contrastive term, in [0, 1] (0.3 STS, 0.1 transfer)"
        )
        g.add_argument("--cap", choices=LIAO_CAPS, help="in-batch positives/negatives: 3p3n or allpalln")
        g.add_argument("--similarity", choices=SIMILARITIES, help="dot (Liao's released code, tau 1) or cos")
        g.add_argument("--head-dim", type=int, help="inner width of the softmax head (768)")

    def option_defaults(self):
        return {
            **super().option_defaults(),
            "pooling": "mean_no_cls",
            "mlp": "none",
            "lam": 0.3,
            "cap": "allpalln",
            "similarity": "dot",
            "temperature": 1.0,
            "head_dim": 768,
            "max_length": 128,
        }

    def validate(self, cfg) -> None:
        if not 0.0 <= cfg.lam <= 1.0:
            raise ValueError(f"--lam must be in [0, 1], got {cfg.lam}")
        if cfg.head_dim < 1:
            raise ValueError(f"--head-dim must be >= 1, got {cfg.head_dim}")
        super().validate(cfg)

    def read_data(self, cfg):
        nli = load_nli(self.source(cfg), cfg.train_split)
        return [
            {"premise": p, "hypothesis": h, "label": lab}
            for p, h, lab in zip(nli["premise"], nli["hypothesis"], nli["label"])
        ]

    def build_model(self, cfg) -> nn.Module:
        enc = self.build_encoder(cfg)
        return LiaoModel(enc, SoftmaxHead(enc.backbone.config.hidden_size, cfg.head_dim))

    def sentence_encoder(self, model):
        return unwrap(model).encoder

    def collate(self, examples, ctx):
        return collate_liao(examples, self._tokenizer, ctx.cfg.max_length, ctx.cfg.cap, ctx.rng)

    def loss(self, model, batch, ctx):
        cfg, B = ctx.cfg, batch["batch_size"]
        u, v = split_rows(ctx.encode(model, **batch["inputs"]), B, B)
        ce = F.cross_entropy(unwrap(model).head(u, v).float(), batch["labels"])
        anchors, pos_index, pos_mask = u[batch["anchor_rows"]], batch["pos_index"], batch["pos_mask"]
        cosine = cfg.similarity == "cos"
        if cfg.cap == "allpalln" and ctx.process_group is not None:
            # every rank must pass the same shapes to the gathering loss: all B premises as
            # anchors (non-entailment rows fully masked), positive slots padded to B
            anchors, pos_index, pos_mask = u, *_pad_to_all_rows(batch, B)
        if cfg.cap == "allpalln" and (anchors.shape[0] or ctx.process_group is not None):
            scl = supcon_pool_loss(
                anchors,
                v,
                pos_index,
                pos_mask=pos_mask,
                temperature=cfg.temperature,
                similarity=cfg.similarity,
                **ctx.negatives(),
            ).float()
        elif anchors.shape[0] == 0:  # no entailment row in this batch: CE only
            scl = ce * 0.0
        else:
            scl = local_supcon(
                anchors,
                v,
                batch["pos_index"],
                batch["pos_mask"],
                batch["neg_index"],
                batch["neg_mask"],
                cfg.temperature,
                cosine,
            )
        loss = (1 - cfg.lam) * ce + cfg.lam * scl
        return loss, {"ce": float(ce.detach()), "scl": float(scl.detach())}

    def save_pretrained(self, model, path, cfg) -> None:
        inner = unwrap(model)
        out = save_pretrained(inner.encoder, self._tokenizer, path)
        torch.save(inner.head.state_dict(), out / "nli_softmax_head.pt")

"""GCLSR's network: word-importance attention, TextCNN backbone, projector and predictor.

Shapes: word vectors ``x [B, L, d]`` with ``mask [B, L]`` (True = real word) ->
backbone ``[B, len(region_sizes) * filters]`` (the sentence embedding) -> projector
``z [B, proj_dim]`` -> predictor ``h [B, proj_dim]``. All float32 (or the module dtype).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from fastcl.gclsr.conv import conv1d as gemm_conv1d

PADDING_SCORE = 1e-9


def word_importance(x: Tensor, mask: Tensor) -> Tensor:
    """GCLSR's parameter-free self-attention: ``S = X Xᵀ / sqrt(d)``; every entry that
    touches a padding position is set to ``1e-9`` (the authors' fill value); no softmax;
    word i's importance ``s_i = sum_j S_ij``; returns ``s_i * x_i`` ``[B, L, d]``.

    Padding rows come out as ``L * 1e-9 * x_i`` (zero for zero padding vectors).
    """
    if x.dim() != 3 or tuple(mask.shape) != tuple(x.shape[:2]) or mask.dtype != torch.bool:
        raise ValueError(f"x must be [B, L, d] and mask bool [B, L]; got {tuple(x.shape)} and {tuple(mask.shape)}")
    scores = torch.bmm(x, x.transpose(1, 2)) / math.sqrt(x.shape[-1])
    valid = mask.unsqueeze(2) & mask.unsqueeze(1)
    scores = scores.masked_fill(~valid, PADDING_SCORE)
    return x * scores.sum(-1, keepdim=True)


class TextCNN(nn.Module):
    """Kim-style CNN: one ``Conv1d(d, filters, k)`` per region size, ReLU, max over time,
    concatenated; no FC and no dropout at the end (GCLSR).

    Max over time runs over the windows that start at a real word and lie inside the
    sentence, or the first window when the sentence is shorter than ``k`` (that window
    holds the whole sentence and zero padding). The output therefore does not depend on
    how much padding the batch adds (plain TextCNN's max over every window does).

    Speed (same maths): regions of equal size run as one convolution (their filters
    concatenated: the paper's three ``k = 1`` regions are one 900-filter GEMM). On the CPU
    the weight gradient is one GEMM (:mod:`fastcl.gclsr.conv`), and the batch is cut into
    buckets of ``bucket_size`` sentences of similar length, each padded only to its own
    longest sentence. Since a sentence's output does not depend on the padding, this
    equals the padded batch; it only skips the convolutions over padding (wiki sentences
    average 17 words, but nearly every batch holds a 64-word one). ``bucket_size=0``
    turns bucketing off.
    """

    def __init__(
        self, dim: int, region_sizes: Sequence[int] = (1, 1, 1, 6, 15, 20), filters: int = 300, bucket_size: int = 32
    ):
        super().__init__()
        if not region_sizes or any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in region_sizes):
            raise ValueError(f"region_sizes must be positive ints, got {region_sizes!r}")
        if filters < 1 or dim < 1:
            raise ValueError(f"dim and filters must be positive, got {dim} and {filters}")
        if bucket_size < 0:
            raise ValueError(f"bucket_size must be >= 0, got {bucket_size}")
        self.region_sizes = tuple(region_sizes)
        self.convs = nn.ModuleList(nn.Conv1d(dim, filters, k) for k in self.region_sizes)
        self.out_dim = filters * len(self.region_sizes)
        self.bucket_size = bucket_size

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        B = x.shape[0]
        if not self.bucket_size or x.device.type != "cpu" or B <= self.bucket_size:
            return self._forward(x, mask)
        lengths = mask.sum(1)
        order = torch.argsort(lengths, stable=True)
        parts = []
        for rows in order.split(self.bucket_size):
            longest = max(int(lengths[rows].max()), 1)
            parts.append(self._forward(x[rows, :longest], mask[rows, :longest]))
        return torch.cat(parts)[torch.argsort(order)]

    def _forward(self, x: Tensor, mask: Tensor) -> Tensor:
        B, L, _ = x.shape
        longest = max(self.region_sizes)
        if L < longest:  # every region needs at least one window
            x = nn.functional.pad(x, (0, 0, 0, longest - L))
            mask = nn.functional.pad(mask, (0, longest - L))
        lengths = mask.sum(1, keepdim=True)  # [B, 1]
        xt = x.transpose(1, 2)  # [B, d, L]
        outs: list[Tensor | None] = [None] * len(self.convs)
        for k in dict.fromkeys(self.region_sizes):  # distinct sizes, first-seen order
            idx = [i for i, size in enumerate(self.region_sizes) if size == k]
            convs = [self.convs[i] for i in idx]
            # one convolution with the regions' filters stacked
            weight = torch.cat([c.weight for c in convs]) if len(convs) > 1 else convs[0].weight
            bias = torch.cat([c.bias for c in convs]) if len(convs) > 1 else convs[0].bias
            y = (gemm_conv1d if x.device.type == "cpu" else nn.functional.conv1d)(xt, weight, bias)
            y = torch.relu(y)  # [B, n * F, L - k + 1]
            starts = torch.arange(y.shape[-1], device=x.device).unsqueeze(0)
            ok = starts <= (lengths - k).clamp_min(0)  # [B, L - k + 1]; start 0 always ok
            # ReLU outputs are >= 0 and start 0 is always kept, so zeros never win the max
            pooled = (y * ok.unsqueeze(1).to(y.dtype)).amax(-1)
            for i, part in zip(idx, pooled.split([c.out_channels for c in convs], dim=1)):
                outs[i] = part
        return torch.cat(outs, 1)


def projector(in_dim: int, dim: int = 4096, layers: int = 3) -> nn.Sequential:
    """``layers`` x (Linear + BatchNorm1d), ReLU after all but the last (GCLSR keeps BN last)."""
    mods: list[nn.Module] = []
    for i in range(layers):
        mods += [nn.Linear(in_dim if i == 0 else dim, dim), nn.BatchNorm1d(dim)]
        if i < layers - 1:
            mods.append(nn.ReLU(inplace=True))
    return nn.Sequential(*mods)


def predictor(dim: int = 4096, hidden: int = 1024) -> nn.Sequential:
    """Linear(dim, hidden) + BN + ReLU -> Linear(hidden, dim) (SimSiam's bottleneck)."""
    return nn.Sequential(nn.Linear(dim, hidden), nn.BatchNorm1d(hidden), nn.ReLU(inplace=True), nn.Linear(hidden, dim))


class GCLSRModel(nn.Module):
    """Backbone + projector + predictor. ``encode`` gives the sentence embedding (the
    backbone output, no attention: the recipe applies attention in training only);
    ``forward(x1, x2, mask)`` gives ``(h1, z1, h2, z2)`` for two augmented views."""

    def __init__(
        self,
        dim: int,
        *,
        region_sizes: Sequence[int] = (1, 1, 1, 6, 15, 20),
        filters: int = 300,
        proj_dim: int = 4096,
        pred_hidden: int = 1024,
        attention: bool = True,
    ):
        super().__init__()
        self.backbone = TextCNN(dim, region_sizes, filters)
        self.projector = projector(self.backbone.out_dim, proj_dim)
        self.predictor = predictor(proj_dim, pred_hidden)
        self.attention = attention

    def encode(self, x: Tensor, mask: Tensor) -> Tensor:
        """Sentence embeddings ``[B, len(region_sizes) * filters]``."""
        return self.backbone(x, mask)

    def forward(self, x1: Tensor, x2: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        # both views through the backbone in one call (sentences are independent there, and
        # the CPU length buckets fill better); the heads run per view, since their BatchNorm
        # normalises over each view's batch, as SimSiam's two forward passes do
        x, both = torch.cat([x1, x2]), torch.cat([mask, mask])
        if self.attention:
            x = word_importance(x, both)
        out = []
        for e in self.backbone(x, both).chunk(2):
            z = self.projector(e)
            out += [self.predictor(z), z]
        return tuple(out)

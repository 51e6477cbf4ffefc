"""Cosine-similarity heatmap of a few sentences (like the SupMPN paper's figure 2).

Uses matplotlib's object-oriented API with the Agg canvas, so it never touches pyplot's
global backend and works on headless machines.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

MAX_SENTENCES = 60  # beyond this the labels are unreadable


def read_sentences(path: str | os.PathLike) -> list[str]:
    """One sentence per line; blank lines and lines starting with ``#`` are skipped."""
    text = Path(path).read_text(encoding="utf-8")
    sentences = [line.strip() for line in text.split("\n")]
    sentences = [s for s in sentences if s and not s.startswith("#")]
    if len(sentences) < 2:
        raise ValueError(f"{path}: need at least 2 sentences (one per line), found {len(sentences)}")
    return sentences


def cosine_matrix(embeddings: torch.Tensor) -> np.ndarray:
    """``(N, N)`` float64 cosine similarities of ``(N, H)`` embeddings (zero rows give 0)."""
    e = embeddings.double()
    e = e / e.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    return (e @ e.t()).numpy()


def _label(s: str, width: int) -> str:
    return s if len(s) <= width else s[: width - 1] + "…"


def plot_similarity(
    sentences: list[str],
    similarity: np.ndarray,
    out: str | os.PathLike,
    title: str | None = None,
    annotate: bool | None = None,
    label_chars: int = 48,
    dpi: int = 150,
) -> Path:
    """Write a heatmap of ``similarity`` ``(N, N)`` labelled by ``sentences`` to ``out``.

    ``annotate`` None writes the values into the cells when N <= 20. The file type follows
    ``out``'s suffix (png, pdf, svg, ...).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    n = len(sentences)
    sim = np.asarray(similarity, dtype=np.float64)
    if sim.shape != (n, n):
        raise ValueError(f"similarity must be ({n}, {n}) for {n} sentences, got {sim.shape}")
    if n > MAX_SENTENCES:
        raise ValueError(f"{n} sentences: at most {MAX_SENTENCES} fit a readable heatmap")
    if annotate is None:
        annotate = n <= 20
    labels = [_label(s, label_chars) for s in sentences]
    side = max(4.0, 0.45 * n + 3.0)
    fig = Figure(figsize=(side + 2.5, side))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    image = ax.imshow(sim, cmap="viridis", vmin=min(0.0, float(sim.min())), vmax=1.0)
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04, label="cosine similarity")
    ax.set_xticks(range(n), labels=[str(i + 1) for i in range(n)])
    ax.set_yticks(range(n), labels=[f"{lbl}  ({i + 1})" for i, lbl in enumerate(labels)], fontsize=8)
    if annotate:
        for i in range(n):
            for j in range(n):
                value = sim[i, j]
                ax.text(
                    j,
                    i,
                    f"{value:.2f}",
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="black" if value > 0.6 else "white",
                )
    if title:
        ax.set_title(title)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi, bbox_inches="tight")  # long labels stay inside the image
    return out

"""PWVA: GCLSR's per-word vector augmentation (Wang et al. 2023, sec. 3.2).

Each real word (``mask`` True) is selected with probability ``p``; a selected word gets one
operator, drawn by ``operators`` (a name -> probability mapping, normalised). Unselected
words and padding are returned bit-for-bit unchanged. Every random number comes from one
``torch.Generator``, so a seed reproduces the views exactly.

Two operator sets (docs/gclsr.md):

``"code"`` (default; the authors' released code, which produced the published numbers)
    zero_segments 0.2     zero one short random run of features (no rescaling)
    background_noise 0.2  add ``rms(w) * U(0, background_scale)`` noise
    mean_center 0.1       ``w - mean(w)`` (the code's "IFFT" operator)
    snr_gaussian 0.5      add Gaussian noise at a random SNR in ``snr_db`` dB
``"paper"`` (the paper's description, equal odds)
    gaussian              add ``rms(w) * N(0, gaussian_std)``
    dropout               zero each feature with probability ``dropout`` (no rescaling)
    fft                   ``real(IFFT(FFT(w)))`` — mathematically the identity; kept literal
    uniform               add ``U(0, 0.1)`` (absolute, as written in the paper)

Noise is scaled by the word's RMS where the source gives no absolute scale, so the
operators behave the same on 300-d word2vec and on 384-d MiniLM input embeddings.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import Tensor

from .. import _checks

CODE_OPERATORS = {"zero_segments": 0.2, "background_noise": 0.2, "mean_center": 0.1, "snr_gaussian": 0.5}
PAPER_OPERATORS = {"gaussian": 0.25, "dropout": 0.25, "fft": 0.25, "uniform": 0.25}
PRESETS = {"code": CODE_OPERATORS, "paper": PAPER_OPERATORS}


def _rms(x: Tensor) -> Tensor:
    return x.pow(2).mean(-1, keepdim=True).sqrt()


class PWVA:
    """Per-word vector augmentation; call it on ``x [B, L, d]`` and ``mask [B, L]``.

    Args:
        p: probability that a real word is augmented (unstated in the paper; 0.5, docs/gclsr.md).
        operators: ``"code"``, ``"paper"`` or a mapping operator -> weight (weights >= 0,
            normalised; names from :data:`CODE_OPERATORS` and :data:`PAPER_OPERATORS`).
        seed: seeds the generator used when ``__call__`` gets none.
        segment_frac: longest zeroed run as a fraction of ``d`` (zero_segments).
        background_scale, snr_db, gaussian_std, dropout: operator strengths (see module doc).
    """

    def __init__(
        self,
        p: float = 0.5,
        operators: str | Mapping[str, float] = "code",
        *,
        seed: int = 0,
        segment_frac: float = 0.1,
        background_scale: float = 0.1,
        snr_db: tuple[float, float] = (6.0, 11.0),
        gaussian_std: float = 0.1,
        dropout: float = 0.1,
    ):
        if not _checks.is_real_number(p) or not 0.0 <= p <= 1.0:
            raise ValueError(f"p must be a probability in [0, 1], got {p!r}")
        if isinstance(operators, str):
            if operators not in PRESETS:
                raise ValueError(f"operators={operators!r}; expected one of {tuple(PRESETS)} or a mapping")
            operators = PRESETS[operators]
        known = {**CODE_OPERATORS, **PAPER_OPERATORS}
        unknown = [k for k in operators if k not in known]
        if unknown:
            raise ValueError(f"unknown PWVA operator(s) {unknown}; expected some of {tuple(known)}")
        weights = [float(w) for w in operators.values()]
        if any(w < 0 or not math.isfinite(w) for w in weights) or sum(weights) <= 0:
            raise ValueError(f"operator weights must be finite, >= 0 and not all zero, got {dict(operators)}")
        if not 0.0 < segment_frac <= 1.0 or not 0.0 <= dropout < 1.0:
            raise ValueError("segment_frac must be in (0, 1] and dropout in [0, 1)")
        if not snr_db[0] <= snr_db[1]:
            raise ValueError(f"snr_db must be (low, high) with low <= high, got {snr_db}")
        total = sum(weights)
        self.p = float(p)
        self.operators = {k: w / total for k, w in zip(operators, weights)}
        self.segment_frac, self.background_scale = segment_frac, background_scale
        self.snr_db, self.gaussian_std, self.dropout = tuple(snr_db), gaussian_std, dropout
        self.generator = torch.Generator().manual_seed(int(seed))

    def __repr__(self) -> str:
        ops = ", ".join(f"{k}={v:.2f}" for k, v in self.operators.items())
        return f"PWVA(p={self.p}, {ops})"

    # each operator maps x [n, d] (the selected words) -> [n, d], drawing from g
    def _zero_segments(self, x: Tensor, g) -> Tensor:
        n, d = x.shape
        longest = max(1, int(round(self.segment_frac * d)))
        length = torch.randint(1, longest + 1, (n, 1), generator=g)
        start = (torch.rand(n, 1, generator=g) * (d - length + 1)).long()
        pos = torch.arange(d).unsqueeze(0)
        keep = (pos < start) | (pos >= start + length)
        return x * keep.to(x.dtype)

    def _background_noise(self, x: Tensor, g) -> Tensor:
        noise = torch.rand(x.shape, generator=g, dtype=x.dtype) * self.background_scale
        return x + _rms(x) * noise

    def _mean_center(self, x: Tensor, g) -> Tensor:
        return x - x.mean(-1, keepdim=True)

    def _snr_gaussian(self, x: Tensor, g) -> Tensor:
        lo, hi = self.snr_db
        snr = lo + (hi - lo) * torch.rand(x.shape[0], 1, generator=g, dtype=x.dtype)
        sigma = _rms(x) * torch.pow(10.0, -snr / 20.0)  # noise power = signal power / 10^(snr/10)
        return x + sigma * torch.randn(x.shape, generator=g, dtype=x.dtype)

    def _gaussian(self, x: Tensor, g) -> Tensor:
        return x + _rms(x) * self.gaussian_std * torch.randn(x.shape, generator=g, dtype=x.dtype)

    def _dropout(self, x: Tensor, g) -> Tensor:
        return x * (torch.rand(x.shape, generator=g) >= self.dropout).to(x.dtype)

    def _fft(self, x: Tensor, g) -> Tensor:
        return torch.fft.ifft(torch.fft.fft(x.float(), dim=-1), dim=-1).real.to(x.dtype)

    def _uniform(self, x: Tensor, g) -> Tensor:
        return x + 0.1 * torch.rand(x.shape, generator=g, dtype=x.dtype)

    def __call__(self, x: Tensor, mask: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """One augmented view of ``x [B, L, d]`` (float, CPU or GPU) under ``mask [B, L]``
        (bool, True = real word). Returns a new tensor; ``x`` is not modified."""
        if not isinstance(x, Tensor) or x.dim() != 3 or not x.is_floating_point():
            raise ValueError(f"x must be a float [B, L, d] tensor, got {getattr(x, 'shape', type(x))}")
        if not isinstance(mask, Tensor) or mask.dtype != torch.bool or tuple(mask.shape) != tuple(x.shape[:2]):
            raise ValueError(f"mask must be a bool [B, L] = {tuple(x.shape[:2])} tensor")
        g = generator if generator is not None else self.generator
        # draws on the CPU generator, then moved: the same seed gives the same views on any device
        B, L, d = x.shape
        selected = (torch.rand(B, L, generator=g) < self.p) & mask.cpu()
        probs = torch.tensor(list(self.operators.values()))
        choice = torch.multinomial(probs, B * L, replacement=True, generator=g).view(B, L)
        out = x.clone()
        flat_out, flat_x = out.view(B * L, d), x.reshape(B * L, d)
        for k, name in enumerate(self.operators):
            rows = torch.nonzero((selected & (choice == k)).view(-1)).squeeze(1)
            if rows.numel():
                words = flat_x[rows.to(x.device)].cpu()
                flat_out[rows.to(x.device)] = getattr(self, "_" + name)(words, g).to(x.device)
        return out

"""Logistic regression on frozen embeddings, trained the way SentEval's PyTorch classifier is.

Implemented with torch (scikit-learn only makes the folds), many models at once. Each
model is one (training rows, validation rows, L2) triple and follows SentEval's
``PyTorchClassifier`` (``nhid=0``): a Linear layer, cross-entropy (mean over the batch),
Adam or RMSprop with PyTorch's default hyper-parameters and ``weight_decay = L2`` (on
weight and bias), mini-batches in a fresh permutation every epoch, accuracy on the
validation rows after every ``epoch_size`` epochs, the best snapshot kept, and a stop after
``tenacity + 1`` non-improving checks (SentEval's counter is not reset by an improvement)
or ``max_epoch``. Without validation rows, a seeded 5 % of the training rows is held out.
SentEval's loss sets ``size_average = False`` on a CrossEntropyLoss built with the default
reduction, which PyTorch >= 1.0 ignores: the loss it trained with is the batch mean, as here.

Models run together: for S training sets and R L2 values the weights are stacked
``(S, D, R, C)``; each step gathers one batch per set (the R models of a set share it, as
SentEval reseeds every classifier alike) and updates all S x R models. A 10 x 10-fold x 4-L2
SentEval grid thus costs about as much as a few single fits. Each set draws its
permutations from its own ``numpy.random.RandomState(seed)``, so a model's result does not
depend on what it is trained with.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import Tensor
from tqdm.auto import tqdm

OPTIMIZERS = ("adam", "rmsprop")


@dataclass(frozen=True)
class ClassifierConfig:
    """SentEval classifier settings (``params['classifier']`` plus ``kfold`` and ``seed``)."""

    optim: str = "adam"
    batch_size: int = 64
    tenacity: int = 5
    epoch_size: int = 4
    max_epoch: int = 200
    kfold: int = 10
    l2_grid: tuple[float, ...] = (1e-5, 1e-4, 1e-3, 1e-2)  # SentEval: 10**t, t in -5..-2
    seed: int = 1111
    validation_split: float = 0.05

    def __post_init__(self):
        if self.optim not in OPTIMIZERS:
            raise ValueError(f"optim={self.optim!r}; expected one of {OPTIMIZERS}")
        for name in ("batch_size", "epoch_size", "max_epoch", "kfold"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.kfold < 2:
            raise ValueError(f"kfold must be >= 2, got {self.kfold}")
        if self.tenacity < 0:
            raise ValueError(f"tenacity must be >= 0, got {self.tenacity}")
        if not self.l2_grid or any(r < 0 for r in self.l2_grid):
            raise ValueError(f"l2_grid must be non-empty and >= 0, got {self.l2_grid}")


# SimCSE's evaluation.py: --mode test (full) and --mode dev/fasttest (fast).
PRESETS = {
    "full": ClassifierConfig(),
    "fast": ClassifierConfig(optim="rmsprop", batch_size=128, tenacity=3, epoch_size=2, kfold=5),
    # tests and smoke runs only: 2-fold, one L2 value, at most 6 epochs; not comparable
    "test": ClassifierConfig(
        optim="rmsprop", batch_size=128, tenacity=0, epoch_size=2, max_epoch=4, kfold=2, l2_grid=(1e-5,)
    ),
}


def classifier_config(preset: str | ClassifierConfig, **overrides) -> ClassifierConfig:
    """A preset by name (``full``, ``fast``, ``test``) or a config, with field overrides."""
    if isinstance(preset, ClassifierConfig):
        cfg = preset
    elif preset in PRESETS:
        cfg = PRESETS[preset]
    else:
        raise ValueError(f"classifier preset {preset!r}; expected one of {tuple(PRESETS)}")
    return replace(cfg, **overrides) if overrides else cfg


@dataclass
class TrainSet:
    """Rows to train on and rows to early-stop on (None: a seeded 5 % of ``train``)."""

    train: np.ndarray
    val: np.ndarray | None = None


@dataclass
class FitResult:
    """Per (set, L2): best validation accuracy (fraction) and that snapshot's weights."""

    val_accuracy: np.ndarray  # (S, R)
    weight: Tensor  # (S, D, R, C)
    bias: Tensor  # (S, R, C)

    def predict(self, x: Tensor, s: int, r: int) -> np.ndarray:
        """Class ids of rows ``x`` ``(N, D)`` under the model of set ``s``, L2 index ``r``."""
        x = x.to(self.weight.device, torch.float32)
        return (x @ self.weight[s, :, r] + self.bias[s, r]).argmax(-1).cpu().numpy()


def _pad(rows: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Ragged index lists -> ``(S, L)`` indices (padded with 0) and a 0/1 float mask."""
    width = max(1, max(len(r) for r in rows))
    idx = np.zeros((len(rows), width), dtype=np.int64)
    mask = np.zeros((len(rows), width), dtype=np.float32)
    for m, r in enumerate(rows):
        idx[m, : len(r)] = r
        mask[m, : len(r)] = 1.0
    return idx, mask


def fit_grid(
    x: Tensor, y, nclasses: int, sets: list[TrainSet], l2, cfg: ClassifierConfig, desc: str | None = None
) -> FitResult:
    """Train one logistic regression per (training set, L2 value).

    Args:
        x: ``(N, D)`` features (any float dtype; trained in float32 on ``x.device``).
        y: ``(N,)`` integer labels in ``[0, nclasses)``.
        sets: S training/validation row sets.
        l2: ``(S, R)`` L2 values (or a length-R sequence used for every set).
        cfg: optimiser, batch size, early stopping, seed.
        desc: show a progress bar (one tick per validation check) with this label.

    The R models of a set see the same batches (SentEval reseeds every model alike), so a
    batch is gathered once per set and the R models are one wider matrix product.
    """
    if not sets:
        raise ValueError("no training sets to fit")
    y = np.asarray(y)
    if y.ndim != 1 or len(y) != len(x):
        raise ValueError(f"y must be 1-D with one label per row of x ({len(x)}), got shape {y.shape}")
    if y.min() < 0 or y.max() >= nclasses:
        raise ValueError(f"labels must lie in [0, {nclasses}), got [{y.min()}, {y.max()}]")
    l2 = np.asarray(l2, dtype=np.float64)
    l2 = np.broadcast_to(l2, (len(sets), l2.shape[-1])) if l2.ndim == 1 else l2
    if l2.shape[0] != len(sets):
        raise ValueError(f"l2 must have one row per set ({len(sets)}), got shape {l2.shape}")
    threads = torch.get_num_threads()
    if x.device.type == "cpu":
        # these are many small kernels: with a busy machine, a second OpenMP thread mostly
        # waits at barriers (measured 10-20x slower per step here)
        torch.set_num_threads(1)
    try:
        return _fit_grid(x.to(torch.float32).contiguous(), y, nclasses, sets, l2, cfg, desc)
    finally:
        torch.set_num_threads(threads)


def _fit_grid(x, y, C, sets, l2_np, cfg, desc) -> FitResult:
    device = x.device
    n, d = x.shape
    S, R = l2_np.shape
    yt = torch.as_tensor(y, dtype=torch.long, device=device)

    # One RNG per set, seeded like a SentEval classifier; the validation split draws first.
    rngs, train_rows, val_rows = [], [], []
    for ts in sets:
        rng = np.random.RandomState(cfg.seed)
        train = np.asarray(ts.train, dtype=np.int64)
        if ts.val is None:
            perm = rng.permutation(len(train))
            cut = int(cfg.validation_split * len(train))
            val, train = train[perm[:cut]], train[perm[cut:]]
        else:
            val = np.asarray(ts.val, dtype=np.int64)
        if len(train) == 0 or len(val) == 0:
            raise ValueError("every training set needs training and validation rows")
        rngs.append(rng)
        train_rows.append(train)
        val_rows.append(val)
    val_idx, val_mask = (torch.from_numpy(a).to(device) for a in _pad(val_rows))
    val_count = val_mask.sum(1, keepdim=True).double()  # (S, 1)
    l2 = torch.tensor(np.array(l2_np), dtype=torch.float32, device=device)  # (S, R)

    # nn.Linear's default init, the same for every model (SentEval seeds torch per model)
    gen = torch.Generator().manual_seed(cfg.seed)
    bound = 1.0 / d**0.5
    w0 = ((torch.rand(C, d, generator=gen) * 2 - 1) * bound).t()  # (D, C)
    b0 = (torch.rand(C, generator=gen) * 2 - 1) * bound
    W = w0.to(device).reshape(1, d, 1, C).repeat(S, 1, R, 1)  # (S, D, R, C)
    b = b0.to(device).reshape(1, 1, C).repeat(S, R, 1)  # (S, R, C)
    opt = _Optimizer(cfg.optim, W, b, S)

    best_acc = np.full((S, R), -1.0)
    best_W, best_b = W.clone(), b.clone()
    stop_count = np.zeros((S, R), dtype=np.int64)
    stopped = np.zeros((S, R), dtype=bool)
    live = np.arange(S)  # sets with a model still training; W, b, l2, opt hold only these
    B = cfg.batch_size
    xb = torch.empty(S, B, d, device=device)  # reused batch buffer (fresh ones page-fault)
    nepoch = 0
    checks = cfg.max_epoch // cfg.epoch_size + 1
    bar = tqdm(total=checks, desc=desc, unit="check", leave=False, disable=desc is None)
    while live.size and nepoch <= cfg.max_epoch:
        L = live.size
        for _ in range(cfg.epoch_size):
            perms = [train_rows[s][rngs[s].permutation(len(train_rows[s]))] for s in live]
            for start in range(0, max(len(p) for p in perms), B):
                idx, mask = _pad([p[start : start + B] for p in perms])
                idx_t, mask_t = torch.from_numpy(idx).to(device), torch.from_numpy(mask).to(device)
                if idx.shape[1] == B:
                    batch = xb[:L]
                    torch.index_select(x, 0, idx_t.view(-1), out=batch.view(-1, d))
                else:  # the last, shorter batch of an epoch
                    batch = x[idx_t]
                _step(batch, yt[idx_t], mask_t, W, b, l2, opt)
        nepoch += cfg.epoch_size
        # validation accuracy of every live model: one (N, D) x (D, L*R*C) product
        logits = (x @ W.permute(1, 0, 2, 3).reshape(d, L * R * C)).view(n, L, R, C) + b[None]
        pred = logits.argmax(-1)  # (N, L, R)
        rows = val_idx[live]  # (L, V)
        hit = (pred[rows, torch.arange(L, device=device)[:, None]] == yt[rows][:, :, None]).double()
        acc = ((hit * val_mask[live][:, :, None]).sum(1) / val_count[live]).cpu().numpy()  # (L, R)
        improved = (acc > best_acc[live]) & ~stopped[live]
        for j, r in zip(*np.nonzero(improved)):
            best_W[live[j], :, r], best_b[live[j], r] = W[j, :, r], b[j, r]
        best_acc[live] = np.where(improved, acc, best_acc[live])
        waiting = ~improved & ~stopped[live]
        stopped[live] |= waiting & (stop_count[live] >= cfg.tenacity)  # SentEval: test, then count
        stop_count[live] += waiting
        keep = ~stopped[live].all(axis=1)
        if not keep.all():  # drop finished sets from the computation
            keep_t = torch.from_numpy(keep).to(device)
            W, b, l2 = W[keep_t], b[keep_t], l2[keep_t]
            opt.keep(keep_t)
            live = live[keep]
        bar.set_postfix(training=f"{int((~stopped).sum())}/{S * R} models")
        bar.update()
    bar.close()
    return FitResult(best_acc, best_W, best_b)


def _step(xb, yb, mask, W, b, l2, opt) -> None:
    """One optimiser step for every model; the cross-entropy gradient in closed form."""
    S, Bw, d = xb.shape
    R, C = W.shape[2], W.shape[3]
    count = mask.sum(1)  # (S,)
    logits = torch.bmm(xb, W.view(S, d, R * C)).view(S, Bw, R, C) + b[:, None]
    grad = torch.softmax(logits, dim=-1)
    grad.scatter_add_(-1, yb[:, :, None, None].expand(-1, -1, R, 1), torch.full((S, Bw, R, 1), -1.0, device=xb.device))
    grad *= (mask / count.clamp_min(1)[:, None])[:, :, None, None]  # mean over the real rows
    gW = torch.bmm(xb.transpose(1, 2), grad.view(S, Bw, R * C)).view(S, d, R, C)
    gW += l2[:, None, :, None] * W
    gb = grad.sum(1) + l2[:, :, None] * b
    opt.step(W, gW, b, gb, count > 0)


class _Optimizer:
    """``torch.optim.Adam`` / ``RMSprop`` with default settings, per-model step counts and
    an ``active`` mask (a set with no rows in the last, shorter batch does not step)."""

    def __init__(self, kind: str, W: Tensor, b: Tensor, S: int):
        self.kind = kind
        self.t = torch.zeros(S, device=W.device)
        self.mW, self.vW = torch.zeros_like(W), torch.zeros_like(W)
        self.mb, self.vb = torch.zeros_like(b), torch.zeros_like(b)

    def keep(self, rows: Tensor) -> None:
        """Keep the state of the sets selected by the bool mask ``rows``."""
        self.t, self.mW, self.vW, self.mb, self.vb = (a[rows] for a in (self.t, self.mW, self.vW, self.mb, self.vb))

    def step(self, W, gW, b, gb, active: Tensor) -> None:
        on = active.float()
        self.t += on
        for p, g, m1, m2 in ((W, gW, self.mW, self.vW), (b, gb, self.mb, self.vb)):
            a = on.view(-1, *([1] * (p.dim() - 1)))
            if self.kind == "adam":  # lr 1e-3, betas (0.9, 0.999), eps 1e-8
                lr, b1, b2, eps = 1e-3, 0.9, 0.999, 1e-8
                m1.add_(a * (1 - b1) * (g - m1))
                m2.add_(a * (1 - b2) * (g * g - m2))
                t = self.t.clamp_min(1).view_as(a)
                denom = m2.sqrt() / (1 - b2**t).sqrt() + eps
                p.sub_(a * (lr / (1 - b1**t)) * m1 / denom)
            else:  # RMSprop: lr 1e-2, alpha 0.99, eps 1e-8
                lr, alpha, eps = 1e-2, 0.99, 1e-8
                m2.add_(a * (1 - alpha) * (g * g - m2))
                p.sub_(a * lr * g / (m2.sqrt() + eps))

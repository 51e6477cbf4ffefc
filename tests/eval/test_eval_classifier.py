"""The SentEval-style logistic regression: against a plain PyTorch re-statement of
SentEval's PyTorchClassifier.fit, batching independence, and the three protocols."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from fastcl.eval import protocols
from fastcl.eval.classifier import ClassifierConfig, TrainSet, classifier_config, fit_grid
from fastcl.testing import assert_roundoff, roundoff


def _data(n=300, d=8, c=3, noise=1.2, seed=0):
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(c, d, generator=g) * 1.5
    y = torch.randint(0, c, (n,), generator=g)
    x = centers[y] + noise * torch.randn(n, d, generator=g)
    return x, y.numpy()


def _trajectory_terms(cfg: ClassifierConfig, n_train: int, d: int) -> int:
    """Weights trained two ways (the batched grid, one nn.Linear) differ by the round-off of every
    step's gradient (a logit's ``d`` coordinates, the batch's rows) summed over the trajectory:
    at most ``max_epoch + epoch_size`` epochs of ``ceil(n_train / batch_size)`` steps."""
    steps = (cfg.max_epoch + cfg.epoch_size) * -(-n_train // cfg.batch_size)
    return steps * (d + cfg.batch_size)


def senteval_fit(x, y, C, train, val, l2, cfg: ClassifierConfig):
    """SentEval's PyTorchClassifier (nhid=0) written plainly: nn.Linear, torch.optim, autograd."""
    rng = np.random.RandomState(cfg.seed)
    train = np.asarray(train)
    if val is None:
        perm = rng.permutation(len(train))
        cut = int(cfg.validation_split * len(train))
        val, train = train[perm[:cut]], train[perm[cut:]]
    gen = torch.Generator().manual_seed(cfg.seed)
    bound = 1.0 / x.shape[1] ** 0.5
    lin = torch.nn.Linear(x.shape[1], C)
    with torch.no_grad():
        lin.weight.copy_((torch.rand(C, x.shape[1], generator=gen) * 2 - 1) * bound)
        lin.bias.copy_((torch.rand(C, generator=gen) * 2 - 1) * bound)
    opt_cls = torch.optim.Adam if cfg.optim == "adam" else torch.optim.RMSprop
    opt = opt_cls(lin.parameters(), weight_decay=l2)
    yt = torch.as_tensor(y)
    best, snap, count, stop, nepoch = -1.0, None, 0, False, 0
    while not stop and nepoch <= cfg.max_epoch:
        for _ in range(cfg.epoch_size):
            p = rng.permutation(len(train))
            for i in range(0, len(train), cfg.batch_size):
                idx = torch.as_tensor(train[p[i : i + cfg.batch_size]])
                opt.zero_grad()
                torch.nn.functional.cross_entropy(lin(x[idx]), yt[idx]).backward()
                opt.step()
        nepoch += cfg.epoch_size
        with torch.no_grad():
            acc = (lin(x[val]).argmax(1) == yt[val]).double().mean().item()
        if acc > best:
            best, snap = acc, copy.deepcopy(lin)
        else:
            if count >= cfg.tenacity:
                stop = True
            count += 1
    return best, snap


@pytest.mark.parametrize("optim", ["adam", "rmsprop"])
def test_fit_grid_equals_sentevals_classifier(optim):
    x, y = _data()
    cfg = ClassifierConfig(optim=optim, batch_size=32, tenacity=2, epoch_size=2, max_epoch=30, kfold=2)
    rows = np.arange(len(y))
    sets = [TrainSet(rows[:200], rows[200:]), TrainSet(rows[50:251]), TrainSet(rows[::2], rows[1::2])]
    l2s = (1e-4, 1e-1)
    fit = fit_grid(x, y, 3, sets, l2s, cfg)
    assert fit.val_accuracy.shape == (3, 2) and fit.weight.shape == (3, 8, 2, 3)
    for s, ts in enumerate(sets):
        for r, l2 in enumerate(l2s):
            best, lin = senteval_fit(x, y, 3, ts.train, ts.val, l2, cfg)
            # the same count of correct rows over the same rows: one rounding of the ratio apart
            assert fit.val_accuracy[s, r] == pytest.approx(best, rel=roundoff(torch.float32), abs=0)
            terms = _trajectory_terms(cfg, len(ts.train), x.shape[1])
            size = lin.weight.detach().abs().max().item()  # the bias's terms are of the weights' size
            assert_roundoff(fit.weight[s, :, r], lin.weight.detach().t(), terms=terms, magnitude=size)
            assert_roundoff(fit.bias[s, r], lin.bias.detach(), terms=terms, magnitude=size)


def test_a_model_does_not_depend_on_its_batch_mates():
    x, y = _data(seed=1)
    cfg = classifier_config("fast", max_epoch=6)
    rows = np.arange(len(y))
    a = TrainSet(rows[:150], rows[150:])
    alone = fit_grid(x, y, 3, [a], [1e-3], cfg)
    together = fit_grid(x, y, 3, [TrainSet(rows[100:299]), a], [[1e-5], [1e-3]], cfg)
    assert together.val_accuracy[1, 0] == alone.val_accuracy[0, 0]
    assert_roundoff(together.weight[1], alone.weight[0], terms=_trajectory_terms(cfg, 150, x.shape[1]))


def test_separable_data_is_learned():
    x, y = _data(n=600, noise=0.2, seed=2)
    fit = fit_grid(x, y, 3, [TrainSet(np.arange(500))], [1e-5], classifier_config("fast"))
    assert fit.val_accuracy[0, 0] == 1.0
    assert (fit.predict(x[500:], 0, 0) == y[500:]).mean() > 0.98


def test_bad_inputs():
    x, y = _data()
    cfg = classifier_config("test")
    with pytest.raises(ValueError, match="labels"):
        fit_grid(x, y, 2, [TrainSet(np.arange(10))], [1e-3], cfg)
    with pytest.raises(ValueError, match="no training sets"):
        fit_grid(x, y, 3, [], [1e-3], cfg)
    with pytest.raises(ValueError, match="one row per set"):
        fit_grid(x, y, 3, [TrainSet(np.arange(50))], np.ones((2, 1)), cfg)
    with pytest.raises(ValueError, match="optim"):
        ClassifierConfig(optim="sgd")
    with pytest.raises(ValueError, match="kfold"):
        classifier_config("full", kfold=1)
    with pytest.raises(ValueError, match="preset"):
        classifier_config("quick")


def test_protocols_on_synthetic_features():
    sklearn = pytest.importorskip("sklearn.model_selection")
    x, y = _data(n=400, d=16, c=2, noise=1.0, seed=3)
    cfg = ClassifierConfig(optim="rmsprop", batch_size=64, tenacity=1, epoch_size=1, max_epoch=8, kfold=3)
    nested = protocols.inner_kfold(x, y, 2, cfg)
    assert 80 < nested["acc"] <= 100 and 80 < nested["devacc"] <= 100
    assert len(nested["l2"]) == 3 and set(nested["l2"]) <= set(cfg.l2_grid)
    # SentEval's outer folds: StratifiedKFold(shuffle=True, random_state=seed) over the given order
    ours = protocols._folds(y, 3, cfg.seed)
    ref = sklearn.StratifiedKFold(3, shuffle=True, random_state=1111).split(np.zeros(len(y)), y)
    assert all(np.array_equal(a[1], b[1]) for a, b in zip(ours, ref))

    kf = protocols.kfold(x[:300], y[:300], x[300:], y[300:], 2, cfg)
    assert kf["pred"].shape == (100,) and kf["acc"] == pytest.approx(100 * (kf["pred"] == y[300:]).mean(), abs=0.01)
    sp = protocols.split(x[:250], y[:250], x[250:320], y[250:320], x[320:], y[320:], 2, cfg)
    assert 80 < sp["acc"] <= 100 and sp["l2"] in cfg.l2_grid

"""GCLSR training: the loss against the reference, the SGD schedule, the recipe's steps."""

from __future__ import annotations

import argparse
import math
import random

import pytest
import torch

from fastcl import reference
from fastcl.gclsr import PWVA, GCLSRModel, two_view_loss
from fastcl.gclsr.optim import build_sgd, gclsr_scheduler, scaled_lr, set_momentum, warmup_cosine
from fastcl.gclsr.recipe import PAPER, GCLSRRecipe, load_pretrained
from fastcl.losses import gclsr_loss
from fastcl.trainers.recipe import StepContext
from tests.helpers.roundoff import assert_grad_roundoff, assert_loss_roundoff

SMALL = dict(region_sizes=(1, 2, 3), filters=8, proj_dim=64, pred_hidden=16)
# The sums behind a SMALL model's gradient on 9 tokens of dim 12: the loss's group of 16
# coordinates, 4 groups and 2 x 6 rows; back through the predictor (64, 16), the projector (64,
# the backbone's 3 x 8 filters), the convolutions (up to 3 x 12), max-pooling and word attention
# over 9 tokens. Cosines of size 1: no logit scale.
SMALL_TERMS = (16 + 4 + 12) + (64 + 16) + (64 + 3 * 8) + 3 * 12 + 2 * 9


def _params(model):
    return [p for p in model.parameters() if p.requires_grad]


def test_grouped_loss_on_model_outputs_equals_reference():
    """fastcl's gclsr_loss and the float64 oracle agree on the model's outputs, in value
    and in every parameter gradient (stop-gradient on z included)."""
    torch.manual_seed(0)
    model = GCLSRModel(12, **SMALL).double()
    x = torch.randn(6, 9, 12, dtype=torch.float64)
    mask = torch.arange(9).unsqueeze(0) < torch.tensor([9, 7, 5, 3, 2, 1]).unsqueeze(1)
    x1, x2 = x + 0.1 * torch.randn_like(x), x + 0.1 * torch.randn_like(x)
    grads, values = [], []
    for fn in (gclsr_loss, reference.gclsr):
        model.zero_grad()
        h1, z1, h2, z2 = model(x1, x2, mask)
        loss = fn(h1, z1, h2, z2, group_size=16)
        loss.backward()
        values.append(loss.detach())
        grads.append([p.grad.clone() for p in _params(model)])
    assert_loss_roundoff(values[0], values[1], torch.float64, terms=SMALL_TERMS, logit_scale=1.0)
    # a bias before a BatchNorm has a gradient ~0: a sum that cancels terms as large as the
    # model's largest gradient entries
    size = max(b.abs().max().item() for b in grads[1])
    for i, (a, b) in enumerate(zip(*grads)):
        assert_grad_roundoff(a, b, torch.float64, terms=SMALL_TERMS, logit_scale=1.0, term_size=size, msg=f"grad {i}")


def test_stop_gradient_on_projector_targets():
    h, z = torch.randn(4, 32, requires_grad=True), torch.randn(4, 32, requires_grad=True)
    gclsr_loss(h, z, h.detach().clone(), z, group_size=16).backward()
    assert z.grad is None or torch.equal(z.grad, torch.zeros_like(z))


def test_scaled_lr_and_schedule():
    assert scaled_lr(0.03, 512) == pytest.approx(0.12)
    with pytest.raises(ValueError):
        scaled_lr(0.0, 128)
    model = GCLSRModel(8, **SMALL)
    opt = build_sgd(model, 0.1, weight_decay=1e-3)
    names = [g["name"] for g in opt.param_groups]
    assert names == ["encoder", "predictor"]
    n_pred = sum(p.numel() for p in opt.param_groups[1]["params"])
    assert n_pred == sum(p.numel() for p in model.predictor.parameters())
    assert sum(p.numel() for g in opt.param_groups for p in g["params"]) == sum(p.numel() for p in model.parameters())
    assert all(g["nesterov"] and g["weight_decay"] == 1e-3 for g in opt.param_groups)
    total, warm = 20, 4
    sched = gclsr_scheduler(opt, total, warm)
    enc, pred, mom = [], [], []
    for step in range(total):
        enc.append(opt.param_groups[0]["lr"])
        pred.append(opt.param_groups[1]["lr"])
        mom.append(opt.param_groups[0]["momentum"])
        opt.step()
        sched.step()
        set_momentum(opt, step + 1, warm)
    assert pred == [1.0] * total  # the predictor keeps a constant 1.0 (paper sec. 5.3, Table 6)
    assert enc[:warm] == pytest.approx([0.1 * (s + 1) / warm for s in range(warm)])
    assert enc[warm] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(enc[warm:], enc[warm + 1 :]))  # cosine decay
    assert enc[-1] == pytest.approx(0.1 * 0.5 * (1 + math.cos(math.pi * (total - 1 - warm) / (total - warm))))
    assert mom[:warm] == [0.9] * warm and mom[warm:] == [0.8] * (total - warm)
    assert warmup_cosine(total, warm, total) == pytest.approx(0.0)


# ---------------------------------------------------------------- the recipe


WORDS = "the a man woman plays playing guitar music cat dog sits on mat runs in park child reads book".split()


@pytest.fixture()
def recipe_cfg(tmp_path):
    g = torch.Generator().manual_seed(0)
    vec = tmp_path / "vectors.txt"
    vec.write_text(
        "".join(f"{w} " + " ".join(f"{v:.5f}" for v in torch.randn(10, generator=g).tolist()) + "\n" for w in WORDS)
    )
    rng = random.Random(0)
    lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 12))).capitalize() + "." for _ in range(64)]
    corpus = tmp_path / "sentences.txt"
    corpus.write_text("\n".join(lines) + "\n")
    recipe = GCLSRRecipe()
    cfg = argparse.Namespace(
        **{
            **PAPER,
            **recipe.option_defaults(),
            "word_vectors": str(vec),
            "model": None,
            "train_file": str(corpus),
            "data_dir": None,
            "seed": 0,
            "chunk_size": None,
            "precision": "fp32",
            "max_examples": None,
        }
    )
    cfg.batch_size, cfg.region_sizes, cfg.filters, cfg.proj_dim, cfg.pred_hidden = 16, "1,2,3", 16, 64, 16
    cfg.warmup_ratio, cfg.lr = 0.2, 0.5
    return recipe, cfg


def test_recipe_steps_decrease_the_loss(recipe_cfg):
    recipe, cfg = recipe_cfg
    recipe.validate(cfg)
    torch.manual_seed(0)
    data = recipe.build_dataset(cfg)
    model = recipe.build_model(cfg)
    opt = recipe.build_optimizer(cfg, model)
    total = 40
    sched = recipe.build_scheduler(cfg, opt, total)
    assert opt.param_groups[0]["lr"] == pytest.approx(scaled_lr(0.5, 16) / math.ceil(0.2 * total))
    losses = []
    for step in range(total):
        ctx = StepContext(cfg=cfg, step=step, rng=random.Random(step))
        batch = recipe.collate(data[:16], ctx)  # one fixed batch: SimSiam pulls its views together
        loss, metrics = recipe.loss(model, batch, ctx)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        ctx.step = step + 1  # as the shared loop does: steps done
        recipe.on_step_end(model, opt, ctx)
        if step + 1 == math.ceil(0.2 * total) - 1:
            assert opt.param_groups[0]["momentum"] == 0.9
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses) and "std_z" in metrics
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 0.1, losses
    assert opt.param_groups[0]["momentum"] == 0.8


def test_recipe_collate_is_seeded(recipe_cfg):
    recipe, cfg = recipe_cfg
    data = recipe.build_dataset(cfg)
    a = recipe.collate(data[:8], StepContext(cfg=cfg, rng=random.Random(7)))
    b = recipe.collate(data[:8], StepContext(cfg=cfg, rng=random.Random(7)))
    c = recipe.collate(data[:8], StepContext(cfg=cfg, rng=random.Random(8)))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["x1"], a["x2"]) and not torch.equal(a["x1"], c["x1"])


def test_recipe_validation(recipe_cfg):
    recipe, cfg = recipe_cfg
    for key, value in [
        ("chunk_size", 4),
        ("group_size", 24),
        ("pwva_p", 1.5),
        ("region_sizes", "1,x"),
        ("precision", "fp16"),
        ("precision", "auto"),
        ("momentum", 1.0),
        ("pred_lr", 0.0),
    ]:
        bad = argparse.Namespace(**vars(cfg))
        setattr(bad, key, value)
        with pytest.raises(ValueError):
            recipe.validate(bad)
    missing = argparse.Namespace(**vars(cfg))
    missing.train_file, missing.data_dir = None, "/nonexistent"
    with pytest.raises(FileNotFoundError):
        recipe.validate(missing)


def test_save_and_reload(recipe_cfg, tmp_path):
    recipe, cfg = recipe_cfg
    recipe.build_dataset(cfg)
    model = recipe.build_model(cfg)
    sents = ["The man plays guitar.", "A cat sits on the mat", "zebra"]
    before = recipe.encoder(model).encode(sents)
    recipe.save_pretrained(model, tmp_path / "out", cfg)
    after = load_pretrained(tmp_path / "out", progress=False).encode(sents)
    torch.testing.assert_close(before, after)


def test_two_view_loss_helper():
    model = GCLSRModel(8, **SMALL)
    x = torch.randn(4, 5, 8)
    mask = torch.ones(4, 5, dtype=torch.bool)
    loss = two_view_loss(model, x, mask, PWVA(seed=0), generator=torch.Generator().manual_seed(1))
    assert loss.dim() == 0 and -1.0 <= loss.item() <= 1.0


def test_cli_train_gclsr_end_to_end(recipe_cfg, tmp_path):
    """``python -m fastcl train gclsr`` through the shared loop, then reload and encode."""
    from fastcl.__main__ import main

    _, cfg = recipe_cfg
    out = tmp_path / "run"
    rc = main(
        [
            "train",
            "gclsr",
            "--word-vectors",
            cfg.word_vectors,
            "--train-file",
            cfg.train_file,
            "--output-dir",
            str(out),
            "--batch-size",
            "8",
            "--max-steps",
            "3",
            "--eval-steps",
            "0",
            "--region-sizes",
            "1,2",
            "--filters",
            "8",
            "--proj-dim",
            "32",
            "--pred-hidden",
            "8",
            "--progress",
            "false",
            "--tensorboard",
            "false",
        ]
    )
    assert rc == 0
    enc = load_pretrained(out / "final", progress=False)
    assert enc.encode(["the man plays", "a dog runs"]).shape == (2, 16)
    assert (
        main(
            [
                "train",
                "gclsr",
                "--word-vectors",
                cfg.word_vectors,
                "--train-file",
                cfg.train_file,
                "--group-size",
                "5",
                "--output-dir",
                str(out),
            ]
        )
        == 2
    )  # validated before any compute

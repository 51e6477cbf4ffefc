"""The paper recipes as published (docs/training.md, "Presets"): each test pins one defect the audit found.

1. GCLSR's predictor lr is a constant 1.0 (not the scaled base lr, not scheduled).
2. GCLSR trains 20 epochs in all: 5 warm-up, cosine over the other 15.
3. Liao pools with a masked mean that excludes [CLS], at train and at test.
4. EdaCSE's weight decay is 0.01.
5. SupMPN fills negatives from other premises' entailments / contradictions, never neutral.
6. SimCSE and SupMPN presets: mixed precision on CUDA (bf16 where supported, else fp16),
   fp32 on the CPU (``precision="auto"``).
"""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from fastcl.cli.train import parse
from fastcl.data import supmpn_groups
from fastcl.gclsr import GCLSRModel
from fastcl.gclsr.optim import build_sgd, gclsr_scheduler, set_momentum
from fastcl.pooling import pool, without_first_token
from fastcl.trainers.config import resolve_precision
from tests.helpers.train import assert_embeddings_close, make_tiny_bert

# ---------------------------------------------------------------- 1, 2: GCLSR optimiser


def test_gclsr_predictor_lr_is_constant_one_whatever_the_batch_and_schedule():
    recipe, cfg = parse(["gclsr", "--preset", "paper"])
    assert cfg.pred_lr == 1.0
    model = GCLSRModel(8, region_sizes=(1, 2), filters=4, proj_dim=32, pred_hidden=8)
    opt = recipe.build_optimizer(cfg, model)
    enc, pred = opt.param_groups
    assert (enc["name"], pred["name"]) == ("encoder", "predictor")
    assert enc["lr"] == pytest.approx(0.03 * 512 / 128) and pred["lr"] == 1.0
    total = 40
    sched = recipe.build_scheduler(cfg, opt, total)
    seen = []
    for _ in range(total):
        seen.append((opt.param_groups[0]["lr"], opt.param_groups[1]["lr"]))
        opt.step()
        sched.step()
    assert all(p == 1.0 for _, p in seen)  # no warm-up, no decay
    assert seen[0][0] < seen[9][0] and seen[-1][0] < seen[10][0]  # the encoder's lr is scheduled
    # the optimiser-level API: default 1.0; None keeps SimSiam's fix_pred_lr (= lr)
    assert build_sgd(model, 0.05).param_groups[1]["lr"] == 1.0
    assert build_sgd(model, 0.05, pred_lr=None).param_groups[1]["lr"] == 0.05
    with pytest.raises(ValueError):
        build_sgd(model, 0.05, pred_lr=0.0)


def test_gclsr_schedule_is_20_epochs_with_5_warmup_then_cosine_over_15():
    _, cfg = parse(["gclsr", "--preset", "paper"])
    assert (cfg.epochs, cfg.warmup_ratio, cfg.schedule) == (20, 0.25, "cosine")
    assert cfg.warmup_ratio * cfg.epochs == 5
    # the paper's data: 10^4 sentences, batch 512 -> 19 steps an epoch
    steps_per_epoch = cfg.max_examples // cfg.batch_size
    total = cfg.epochs * steps_per_epoch
    warm = math.ceil(cfg.warmup_ratio * total)
    assert warm == 5 * steps_per_epoch
    model = GCLSRModel(8, region_sizes=(1,), filters=4, proj_dim=32, pred_hidden=8)
    opt = build_sgd(model, 1.0)
    sched = gclsr_scheduler(opt, total, warm)
    lrs, momenta = [], []
    for step in range(total):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
        set_momentum(opt, step + 1, warm)
        momenta.append(opt.param_groups[0]["momentum"])
    assert lrs[warm - 1] == pytest.approx(1.0) and lrs[warm] == pytest.approx(1.0)
    # cosine over the remaining 15 epochs: half-way at 5 + 7.5 epochs
    assert lrs[warm + (total - warm) // 2] == pytest.approx(0.5, abs=0.05)
    assert lrs[-1] < 0.01
    assert momenta[warm - 2] == 0.9 and momenta[warm - 1] == 0.8


# ---------------------------------------------------------------- 3: Liao pooling


def test_mean_no_cls_excludes_the_first_real_token_and_padding():
    g = torch.Generator().manual_seed(0)
    states = torch.randn(3, 6, 4, generator=g, dtype=torch.float64)
    right = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1], [1, 0, 0, 0, 0, 0]])
    got = pool({"last_hidden_state": states}, right, "mean_no_cls")
    torch.testing.assert_close(got[0], states[0, 1:4].mean(0))
    torch.testing.assert_close(got[1], states[1, 1:].mean(0))
    torch.testing.assert_close(got[2], torch.zeros(4, dtype=torch.float64))  # only [CLS]: nothing left
    assert not torch.allclose(got[0], pool({"last_hidden_state": states}, right, "mean")[0])
    left = torch.tensor([[0, 0, 1, 1, 1, 1]])  # left padding: [CLS] sits at position 2
    torch.testing.assert_close(pool({"last_hidden_state": states[:1]}, left, "mean_no_cls")[0], states[0, 3:].mean(0))
    assert torch.equal(without_first_token(right.bool()), without_first_token(right).bool())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_bert(tmp_path_factory.mktemp("fidelity") / "tiny", dropout=0.0)


def test_liao_preset_pools_without_cls_at_train_and_test(tiny, tmp_path):
    from transformers import AutoModel, AutoTokenizer

    from fastcl.eval import encode

    for preset in ("liao", "liao-transfer"):
        recipe, cfg = parse(["supcon", "--model", str(tiny), "--preset", preset])
        assert cfg.pooling == "mean_no_cls"
    model = recipe.build_model(cfg).eval()
    sentences = ["A man is playing a guitar .", "Two dogs run in the snow .", "x"]
    tok = AutoTokenizer.from_pretrained(tiny)
    batch = tok(sentences, padding=True, return_tensors="pt")
    with torch.no_grad():
        train_emb = model(**batch)  # what the loss sees
        states = model.encoder.backbone(**batch).last_hidden_state
    lengths = batch["attention_mask"].sum(1)
    manual = torch.stack([states[i, 1 : lengths[i]].mean(0) for i in range(len(sentences))])
    assert_embeddings_close(train_emb, manual)
    assert_embeddings_close(recipe.encoder(model).encode(sentences), manual)  # dev eval
    recipe.save_pretrained(model, tmp_path / "saved", cfg)
    info = json.loads((tmp_path / "saved" / "fastcl_model.json").read_text())
    assert info["pooling"] == info["train_pooling"] == "mean_no_cls"
    saved = encode(
        AutoModel.from_pretrained(tmp_path / "saved"), tok, sentences, pooling=info["pooling"], show_progress=False
    )
    assert_embeddings_close(saved, manual)


# ---------------------------------------------------------------- 4: EdaCSE weight decay


@pytest.mark.parametrize("preset", ["bert-base", "roberta-base", "roberta-large"])
def test_edacse_weight_decay_is_papers(tiny, preset):
    recipe, cfg = parse(["edacse", "--model", str(tiny), "--preset", preset])
    assert cfg.weight_decay == 0.01
    _, cfg = parse(["edacse", "--model", str(tiny)])  # the method's default follows the paper too
    assert cfg.weight_decay == 0.01


# ---------------------------------------------------------------- 5: SupMPN negative filling


def test_supmpn_negative_fill_never_samples_neutral_hypotheses():
    rows = [{"premise": "p0", "hypothesis": "p0 ent", "label": "entailment"}]  # needs 5 filled negatives
    for i in range(1, 4):
        rows += [
            {"premise": f"p{i}", "hypothesis": f"p{i} ent", "label": "entailment"},
            {"premise": f"p{i}", "hypothesis": f"p{i} con", "label": "contradiction"},
        ]
        rows += [{"premise": f"p{i}", "hypothesis": f"p{i} neutral {j}", "label": "neutral"} for j in range(20)]
    allowed = {f"p{i} {kind}" for i in range(1, 4) for kind in ("ent", "con")} | {"p0 ent"}
    for seed in range(20):
        groups = supmpn_groups(rows, 1, 5, "anchor", "sample", seed=seed)
        first = groups[0]
        assert first["anchor"] == "p0"
        filled = [n for n, ok in zip(first["negatives"], first["neg_mask"]) if ok]
        assert len(filled) == 5 and set(filled) <= allowed - {"p0 ent"}, filled
        for g in groups[1:]:  # one real contradiction, four fills from the other premises
            own = g["anchor"]
            assert g["negatives"][0] == f"{own} con"
            assert all(n in allowed and not n.startswith(own + " ") for n in g["negatives"][1:])


# ---------------------------------------------------------------- 6: precision


@pytest.mark.parametrize("cuda, bf16, expected", [(False, False, "fp32"), (True, True, "bf16"), (True, False, "fp16")])
def test_auto_precision_resolution(monkeypatch, cuda, bf16, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)
    assert resolve_precision("auto") == expected  # the loop's default device
    assert resolve_precision("auto", "cpu") == "fp32"  # --device cpu on a GPU machine
    if cuda:
        assert resolve_precision("auto", torch.device("cuda", 0)) == expected
    for explicit in ("fp32", "bf16", "fp16"):
        assert resolve_precision(explicit, "cpu") == explicit


@pytest.mark.parametrize(
    "method, presets",
    [
        ("simcse-unsup", ("bert-base", "bert-large")),
        ("simcse-sup", ("bert-base", "bert-large")),
        ("supmpn", ("bert-base", "bert-large")),
    ],
)
def test_simcse_and_supmpn_presets_use_mixed_precision_on_cuda(tiny, method, presets):
    for preset in presets:
        _, cfg = parse([method, "--model", str(tiny), "--preset", preset])
        assert cfg.precision == "auto"


def test_loop_resolves_auto_precision_on_the_cpu(tiny, tmp_path):
    from fastcl.trainers.loop import train

    corpus = tmp_path / "wiki.txt"
    rng = random.Random(0)
    corpus.write_text(
        "\n".join(" ".join(rng.choice("a man dog runs plays in the park".split()) for _ in range(6)) for _ in range(8))
        + "\n"
    )
    recipe, cfg = parse(
        [
            "simcse-unsup",
            "--model",
            str(tiny),
            "--train-file",
            str(corpus),
            "--precision",
            "auto",
            "--batch-size",
            "4",
            "--max-steps",
            "1",
            "--eval-steps",
            "0",
            "--save-steps",
            "0",
            "--device",
            "cpu",
            "--progress",
            "false",
            "--tensorboard",
            "false",
            "--output-dir",
            str(tmp_path / "run"),
        ]
    )
    train(recipe, cfg)
    assert json.loads((tmp_path / "run" / "config.json").read_text())["precision"] == "fp32"

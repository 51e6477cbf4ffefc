"""Trainers end to end on a tiny random BERT and samples of the staged SNLI / wiki data.

Every recipe trains from the CLI entry point, its loss decreases on a repeated batch, the
saved model loads with AutoModel (and sentence-transformers where the pooling allows) and
reproduces the training-time embedding; an interrupted run resumes bit-identically.
"""

from __future__ import annotations

import json

import pytest
import torch

from fastcl.__main__ import main as cli
from fastcl.cli.train import parse
from fastcl.trainers.loop import train
from tests.helpers.train import make_samples, make_tiny_bert

pytestmark = pytest.mark.data
NLI_METHODS = ("simcse-sup", "supmpn", "supcon")


@pytest.fixture(scope="module")
def setup(tmp_path_factory, data_dir):
    root = tmp_path_factory.mktemp("train")
    return {
        "model": make_tiny_bert(root / "tiny"),
        "model_no_dropout": make_tiny_bert(root / "tiny0", dropout=0.0),
        **make_samples(data_dir, root / "data"),
    }


def _source(setup, method):
    return setup["nli"] if method in NLI_METHODS else setup["wiki"]


def _options(setup, method, out, **extra):
    opts = dict(
        model=setup["model"],
        train_file=_source(setup, method),
        output_dir=out,
        batch_size=8,
        eval_steps=0,
        save_steps=0,
        log_steps=1,
        progress="false",
        tensorboard="false",
        seed=1,
    )
    opts.update(extra)
    return opts


def _argv(method, opts):
    out = [method]
    for k, v in opts.items():
        out += [f"--{k.replace('_', '-')}", str(v)]
    return out


def _losses(out):
    return [r["loss"] for r in map(json.loads, (out / "log.jsonl").read_text().splitlines()) if "loss" in r]


@pytest.mark.parametrize(
    "method, cap",
    [
        ("simcse-unsup", None),
        ("simcse-sup", None),
        ("supmpn", None),
        ("supcon", "allpalln"),
        ("supcon", "3p3n"),
        ("edacse", None),
    ],
)
def test_recipe_learns_and_saves(setup, tmp_path, method, cap):
    out = tmp_path / method
    # the same 8 examples every step (max_examples = batch), a large lr: the loss must fall
    # A random tiny BERT's [CLS] + a fresh MLP (SimCSE's default) is erratic at this lr; mean
    # pooling (still with the MLP head, train-only or kept) learns steadily. The [CLS] + MLP
    # save path is tested in test_mlp_head_saved_for_automodel_and_sentence_transformers.
    extra = {"pooling": "mean"} if method in ("simcse-unsup", "simcse-sup", "edacse") else {}
    if cap is not None:
        extra["cap"] = cap
    args = _argv(
        method, _options(setup, method, out, max_examples=8, max_steps=8, lr=3e-3, schedule="constant", **extra)
    )
    assert cli(["train", *args]) == 0
    losses = _losses(out)
    assert len(losses) == 8
    assert sum(losses[-2:]) / 2 < 0.8 * sum(losses[:2]) / 2, losses

    from transformers import AutoModel, AutoTokenizer

    from fastcl.eval import encode

    final = out / "final"
    info = json.loads((final / "fastcl_model.json").read_text())
    model = AutoModel.from_pretrained(final)
    tok = AutoTokenizer.from_pretrained(final)
    sentences = ["A man is playing a guitar .", "Two dogs run in the snow ."]
    emb = encode(model, tok, sentences, pooling=info["pooling"], show_progress=False)
    # the same embedding as the trained module's test-time encoder, from the last checkpoint
    recipe, cfg = parse(args)
    trained = recipe.build_model(cfg)
    state = torch.load(out / "checkpoint-8" / "state.pt", weights_only=False)["model"]
    trained.load_state_dict(state)
    expected = recipe.encoder(trained).encode(sentences)
    if info["mlp"] != "always":  # a kept head over mean pooling lives only in the ST Dense module
        torch.testing.assert_close(emb, expected, rtol=1e-5, atol=1e-5)
    if info["sentence_transformers"]:
        from sentence_transformers import SentenceTransformer

        st = SentenceTransformer(str(final), device="cpu")
        torch.testing.assert_close(torch.as_tensor(st.encode(sentences)), expected, rtol=1e-4, atol=1e-5)


def test_mlp_head_saved_for_automodel_and_sentence_transformers(setup, tmp_path):
    """simcse-sup default: [CLS] + MLP kept at test -> copied into BERT's pooler ("cls") and a
    sentence-transformers Dense(tanh); both reproduce the trained module's embedding."""
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel, AutoTokenizer

    from fastcl.eval import encode

    out = tmp_path / "sup"
    args = _argv("simcse-sup", _options(setup, "simcse-sup", out, max_examples=8, max_steps=1, lr=1e-3))
    recipe, cfg = parse(args)
    train(recipe, cfg)
    info = json.loads((out / "final" / "fastcl_model.json").read_text())
    assert (info["pooling"], info["mlp"], info["train_pooling"]) == ("cls", "in_pooler", "cls_before_pooler")
    sentences = ["A man is playing a guitar .", "Two dogs run in the snow .", "x"]
    trained = recipe.build_model(cfg)
    trained.load_state_dict(_state(out / "checkpoint-1")["model"])
    expected = recipe.encoder(trained).encode(sentences)
    with torch.no_grad():  # the raw module: [CLS] -> MLP
        tok = AutoTokenizer.from_pretrained(out / "final")
        direct = trained.eval()(**tok(sentences, padding=True, return_tensors="pt"))
    torch.testing.assert_close(expected, direct, rtol=1e-5, atol=1e-6)
    model = AutoModel.from_pretrained(out / "final")
    torch.testing.assert_close(
        encode(model, tok, sentences, pooling="cls", show_progress=False), expected, rtol=1e-5, atol=1e-6
    )
    st = SentenceTransformer(str(out / "final"), device="cpu")
    torch.testing.assert_close(torch.as_tensor(st.encode(sentences)), expected, rtol=1e-4, atol=1e-5)


def _state(folder):
    return torch.load(folder / "state.pt", map_location="cpu", weights_only=False)


def _assert_same_tensors(a, b, path="state"):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            _assert_same_tensors(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same_tensors(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


@pytest.mark.parametrize("method", ["supmpn", "edacse"])  # sampled negatives + dropout; random augmentation
def test_resume_after_interruption_is_bit_identical(setup, tmp_path, method):
    # 40 examples, batch 8: 5 steps per epoch, so 7 steps cross an epoch boundary (new order)
    opts = _options(setup, method, tmp_path / "full", max_examples=40, max_steps=7, save_steps=3)
    train(*parse(_argv(method, opts)))

    opts["output_dir"] = tmp_path / "cut"
    recipe, cfg = parse(_argv(method, opts))
    real_loss = recipe.loss

    def crash_at_step_4(model, batch, ctx):
        if ctx.step == 4:  # during the 5th step, after checkpoint-3
            raise KeyboardInterrupt("simulated interruption")
        return real_loss(model, batch, ctx)

    recipe.loss = crash_at_step_4
    with pytest.raises(KeyboardInterrupt):
        train(recipe, cfg)
    assert (tmp_path / "cut" / "checkpoint-3").is_dir() and not (tmp_path / "cut" / "checkpoint-6").exists()
    train(*parse(_argv(method, {**opts, "resume": "auto"})))

    full, resumed = _state(tmp_path / "full" / "checkpoint-7"), _state(tmp_path / "cut" / "checkpoint-7")
    _assert_same_tensors(full["model"], resumed["model"], "model")
    _assert_same_tensors(full["optimizer"], resumed["optimizer"], "optimizer")
    assert full["scheduler"] == resumed["scheduler"]

    # the crashed run logged step 4 before dying; the resumed run drops that record (it resumes
    # from step 3) and logs step 4 again, identically: each step appears once
    def by_step(out):
        return [(r["step"], r["loss"]) for r in map(json.loads, (out / "log.jsonl").read_text().splitlines())]

    assert by_step(tmp_path / "full") == by_step(tmp_path / "cut")


def test_gradient_cache_matches_full_batch(setup, tmp_path):
    """--chunk-size goes through fastcl.gradcache: same parameters as the uncached run."""
    # Plain SGD (a recipe may bring its own optimiser): parameter differences are lr x gradient
    # differences. (Adam would magnify float-rounding noise on near-zero embedding gradients.)
    # No dropout: chunks draw their own dropout masks, so only a deterministic encoder can be
    # compared with the full batch (the dropout replay itself is tested in test_gradcache.py).
    common = dict(max_examples=16, max_steps=2, lr=0.5, model=setup["model_no_dropout"])
    states = []
    for out, extra in ((tmp_path / "a", {}), (tmp_path / "b", {"chunk_size": 5})):
        recipe, cfg = parse(_argv("simcse-unsup", _options(setup, "simcse-unsup", out, **common, **extra)))
        recipe.build_optimizer = lambda cfg, model: torch.optim.SGD(
            [p for p in model.parameters() if p.requires_grad], lr=cfg.lr
        )
        train(recipe, cfg)
        states.append(_state(out / "checkpoint-2")["model"])
    a, b = states
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6, msg=k)


def test_bf16_autocast_dev_eval_and_best_checkpoint(setup, tmp_path):
    out = tmp_path / "bf16"
    summary = train(
        *parse(
            _argv(
                "supmpn",
                _options(
                    setup,
                    "supmpn",
                    out,
                    max_examples=16,
                    max_steps=2,
                    precision="bf16",
                    eval_steps=1,
                    max_grad_norm=1.0,
                ),
            )
        )
    )
    assert summary["best_stsb_dev"] is not None and summary["best_step"] in (1, 2)
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "stsb_dev" in r] == [1, 2]
    assert all("grad_norm" in r for r in records if "loss" in r)
    assert (out / "best" / "config.json").is_file()


def test_presets_and_precedence(setup):
    recipe, cfg = parse(_argv("supmpn", {"model": setup["model"], "preset": "bert-base", "lr": 1e-4}))
    assert cfg.lr == 1e-4 and cfg.batch_size == 256 and cfg.pooling == "avg_first_last" and cfg.num_positives == 5
    recipe, cfg = parse(["supcon", "--model", str(setup["model"]), "--preset", "liao"])
    assert (cfg.lam, cfg.temperature, cfg.similarity, cfg.cap, cfg.shuffle) == (0.3, 1.0, "dot", "allpalln", False)
    recipe, cfg = parse(["edacse", "--model", str(setup["model"])])
    assert (cfg.max_insertions, cfg.lam, cfg.mlp, cfg.schedule) == (3, 0.6, "train", "cosine")


@pytest.mark.parametrize(
    "args, message",
    [
        (["supmpn"], "--model PATH_OR_NAME is required"),
        (["supmpn", "--model", "/nonexistent/model"], "no Hugging Face model"),
        (["supmpn", "--preset", "huge"], "unknown preset"),
        (["supmpn", "--batch-size", "0"], "--batch-size must be"),
        (["supmpn", "--pos-fill", "drop", "--num-positives", "9"], "no premise of"),
        (["supmpn", "--train-file", "/nonexistent/snli.csv"], "not found"),
        (["supcon", "--lam", "1.5"], "--lam must be in"),
        (["edacse", "--max-insertions", "0"], "--max-insertions"),
        (["supmpn", "--cross-device", "ring"], "--cross-device ring passes the candidates between processes"),
    ],
)
def test_cli_errors_before_compute(setup, capsys, args, message):
    full = ["train", *args]
    if "--model" not in args and args != ["supmpn"]:
        full += ["--model", str(setup["model"])]
    if "--train-file" not in args:
        full += ["--train-file", str(_source(setup, args[0]))]
    assert cli(full) == 2
    assert message in capsys.readouterr().err


def test_cli_unknown_method(capsys):
    with pytest.raises(SystemExit):
        cli(["train", "simclr"])
    assert "invalid choice" in capsys.readouterr().err


@pytest.mark.slow
def test_ddp_two_processes_match_one(setup, tmp_path):
    """torchrun-style 2-process gloo run (cross-device negatives through the loss's
    process_group, DDP gradient averaging) equals one process on the global batch."""
    import contextlib
    import socket

    import torch.multiprocessing as mp

    from tests.train.ddp_worker import run_rank, sgd

    supmpn = dict(pos_fill="mask", neg_fill="mask", num_positives=2, num_negatives=2)
    cases = {  # name: (method, options, two-process options); deterministic data, no dropout
        "supmpn": ("supmpn", supmpn, {}),
        "supmpn-ring": ("supmpn", supmpn, dict(cross_device="ring")),  # candidates passed rank to rank
        "supcon": ("supcon", dict(pooling="mean"), {}),  # Liao allpalln: pool loss over every rank's hypotheses
    }
    argvs = []
    for name, (method, extra, two_extra) in cases.items():
        common = dict(max_examples=16, max_steps=2, lr=0.5, model=setup["model_no_dropout"], **extra)
        recipe, cfg = parse(_argv(method, _options(setup, method, tmp_path / name / "one", **common)))
        recipe.build_optimizer = sgd
        train(recipe, cfg)
        argvs.append(_argv(method, _options(setup, method, tmp_path / name / "two", **common, **two_extra)))
    with contextlib.ExitStack() as stack:  # distinct free ports, released before the ranks bind them
        socks = [stack.enter_context(socket.socket()) for _ in argvs]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        ports = [s.getsockname()[1] for s in socks]
    mp.spawn(run_rank, args=(2, ports, argvs), nprocs=2, join=True)
    from fastcl.trainers.checkpoint import MANIFEST, problem

    for method in cases:  # (the case's name)
        two_dir = tmp_path / method / "two" / "checkpoint-2"  # marked complete once both ranks wrote
        assert problem(two_dir) is None and json.loads((two_dir / MANIFEST).read_text())["world_size"] == 2
        run_id = json.loads((tmp_path / method / "two" / "run.json").read_text())["run_id"]  # rank 0's, for all
        assert json.loads((two_dir / MANIFEST).read_text())["run_id"] == run_id
        one = _state(tmp_path / method / "one" / "checkpoint-2")["model"]
        two = _state(tmp_path / method / "two" / "checkpoint-2")["model"]
        for k in one:  # float summation order differs
            torch.testing.assert_close(one[k], two[k], rtol=1e-5, atol=1e-5, msg=f"{method}: {k}")


@pytest.mark.parametrize("similarity", ["dot", "cos"])
def test_liao_3p3n_local_loss_equals_pool_loss_when_sets_cover_the_batch(similarity):
    """local_supcon (3p3n's per-anchor denominators) equals the fused supcon_pool_loss when
    every anchor's positives and negatives are the whole candidate pool (allpalln)."""
    import random

    from fastcl.data import liao_in_batch
    from fastcl.data.collate import _pad
    from fastcl.losses import supcon_pool_loss
    from fastcl.trainers.recipes.supcon import local_supcon

    rows = [
        {"premise": p, "hypothesis": f"{p}{i}", "label": lab}
        for p, i, lab in [
            ("A", 0, "entailment"),
            ("A", 1, "entailment"),
            ("A", 2, "neutral"),
            ("B", 3, "entailment"),
            ("B", 4, "contradiction"),
            ("C", 5, "contradiction"),
            ("D", 6, "entailment"),
        ]
    ]
    built = liao_in_batch(rows, "allpalln")
    pos_index, pos_mask = _pad(built["pos_index"])
    neg_index, neg_mask = _pad(built["neg_index"])
    anchors = torch.randn(len(built["anchor_rows"]), 16, dtype=torch.float64, requires_grad=True)
    cands = torch.randn(len(rows), 16, dtype=torch.float64, requires_grad=True)
    tau = 1.0 if similarity == "dot" else 0.1
    local = local_supcon(anchors, cands, pos_index, pos_mask, neg_index, neg_mask, tau, similarity == "cos")
    fused = supcon_pool_loss(
        anchors, cands, pos_index, pos_mask=pos_mask, temperature=tau, similarity=similarity, backend="reference"
    )
    torch.testing.assert_close(local.double(), fused)
    g_local = torch.autograd.grad(local, (anchors, cands))
    g_fused = torch.autograd.grad(fused, (anchors, cands))
    for a, b in zip(g_local, g_fused):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-6)  # local computes in float32
    # 3p3n trains end to end (sampled caps come from ctx.rng)
    out = liao_in_batch(rows, "3p3n", random.Random(0))
    assert all(len(p) <= 3 and len(n) <= 3 for p, n in zip(out["pos_index"], out["neg_index"]))

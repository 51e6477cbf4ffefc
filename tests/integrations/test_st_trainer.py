"""Each fastcl loss trains a tiny SentenceTransformer with SentenceTransformerTrainer.

A few optimizer steps on a small in-memory ``datasets.Dataset`` (column layout per loss):
the logged losses are finite, every encoder parameter moves, and the saved model loads
with ``SentenceTransformer(path)`` and encodes exactly like the trained one.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("sentence_transformers")
datasets = pytest.importorskip("datasets")

from sentence_transformers import (  # noqa: E402
    SentenceTransformer,
    SentenceTransformerTrainer,
    SentenceTransformerTrainingArguments,
)

from fastcl.integrations import sentence_transformers as fst  # noqa: E402
from tests.helpers import st as common  # noqa: E402

pytestmark = pytest.mark.timeout(120)

ROWS, BATCH, STEPS = 24, 6, 3


def _dataset(columns: list[str], seed: int):
    pool = common.sentences(ROWS * len(columns), seed=seed)
    return datasets.Dataset.from_dict({c: pool[i * ROWS : (i + 1) * ROWS] for i, c in enumerate(columns)})


# name -> (loss factory, dataset columns); InfoNCE is SimCSE-unsup: the same sentence twice.
CASES = {
    "mnrl": (lambda m: fst.MultipleNegativesRankingLoss(m), ["anchor", "positive", "negative"]),
    "mnrl_pairs": (lambda m: fst.MultipleNegativesRankingLoss(m, scale=10.0), ["anchor", "positive"]),
    "cached_mnrl": (
        lambda m: fst.CachedMultipleNegativesRankingLoss(m, mini_batch_size=4),
        ["anchor", "positive", "negative"],
    ),
    "mnrl_bf16_autocast": (lambda m: fst.MultipleNegativesRankingLoss(m), ["anchor", "positive", "negative"]),
    "infonce": (lambda m: fst.InfoNCELoss(m, symmetric=True), ["anchor", "positive"]),
    "supmpn": (lambda m: fst.SupMPNLoss(m, num_positives=2), ["anchor", "positive_1", "positive_2", "negative"]),
    "supmpn_cached": (
        lambda m: fst.SupMPNLoss(m, num_positives=2, mini_batch_size=4),
        ["anchor", "positive_1", "positive_2", "negative"],
    ),
    "supcon": (lambda m: fst.SupConLoss(m, temperature=0.1, num_positives=2), ["anchor", "positive_1", "positive_2"]),
    # the guide: another tiny BERT (same vocabulary), built by the test in its tmp_path
    "gist": (lambda m, g: fst.GISTEmbedLoss(m, g, margin=0.1), ["anchor", "positive", "negative"]),
    "gist_cached": (
        lambda m, g: fst.CachedGISTEmbedLoss(m, g, mini_batch_size=4, temperature=0.05),
        ["anchor", "positive"],
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_trainer_trains_saves_and_reloads(tmp_path, name):
    make_loss, columns = CASES[name]
    model = common.tiny_model(tmp_path)
    train = _dataset(columns, seed=len(name))
    if name == "infonce":
        train = train.map(lambda row: {"positive": row["anchor"]})
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = SentenceTransformerTrainingArguments(
        output_dir=str(tmp_path / "run"),
        per_device_train_batch_size=BATCH,
        max_steps=STEPS,
        learning_rate=1e-3,
        warmup_steps=0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        dataloader_drop_last=True,
        seed=0,
        bf16=name.endswith("bf16_autocast"),
    )
    if name.startswith("gist"):
        loss = make_loss(model, common.tiny_model(tmp_path / "guide", dropout=0.0, seed=1).eval())
    else:
        loss = make_loss(model)
    trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=train, loss=loss)
    trainer.train()

    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == STEPS and all(torch.isfinite(torch.tensor(v)) and v > 0 for v in logged), logged
    frozen = [n for n, p in model.named_parameters() if torch.equal(p.detach(), before[n])]
    assert not frozen, f"parameters that did not train: {frozen}"

    path = str(tmp_path / "saved")
    model.save(path)
    reloaded = SentenceTransformer(path, device="cpu")
    trained, loaded = model.state_dict(), reloaded.state_dict()
    # (the reloaded BERT gains an unused, freshly initialised pooler: sentence-transformers
    # does not store add_pooling_layer=False; mean pooling never reads it)
    assert set(trained) <= set(loaded), set(trained) - set(loaded)
    for k in trained:
        assert torch.equal(trained[k], loaded[k]), k
    # With bf16=True accelerate leaves the trained model's forward under autocast: the reloaded
    # model runs under it too. The same weights, shapes and sums in one process: bitwise.
    probe = common.sentences(3, seed=99)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
        got = reloaded.encode(probe, convert_to_tensor=True)
    torch.testing.assert_close(got, model.encode(probe, convert_to_tensor=True), rtol=0, atol=0)

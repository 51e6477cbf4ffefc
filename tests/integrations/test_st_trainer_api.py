"""SentenceTransformerTrainer smoke runs of the new options: labels-SupCon, ST-6 MNRL options, fused Matryoshka.

A few optimizer steps of a tiny offline BERT on a small in-memory dataset per option (as
``tests/integrations/test_st_trainer.py``): the logged losses are finite and positive, and every encoder
parameter moves.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("sentence_transformers")
datasets = pytest.importorskip("datasets")

from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments  # noqa: E402
from sentence_transformers.sentence_transformer import losses as st_losses  # noqa: E402

from fastcl.integrations import sentence_transformers as fst  # noqa: E402
from tests.helpers import st as common  # noqa: E402

pytestmark = pytest.mark.timeout(120)

ROWS, BATCH, STEPS = 24, 8, 3
GTE = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")
QPN = ["anchor", "positive", "negative"]

CASES = {
    "mnrl_gte_joint": (lambda m: fst.MultipleNegativesRankingLoss(m, directions=GTE), QPN),
    "mnrl_symmetric_per_direction": (
        lambda m: fst.MultipleNegativesRankingLoss(
            m, directions=("query_to_doc", "doc_to_query"), partition_mode="per_direction"
        ),
        ["anchor", "positive"],
    ),
    "mnrl_in_batch_hardness": (
        lambda m: fst.MultipleNegativesRankingLoss(m, hardness_mode="in_batch_negatives", hardness_strength=9.0),
        QPN,
    ),
    "mnrl_hard_negatives_hardness": (
        lambda m: fst.MultipleNegativesRankingLoss(m, hardness_mode="hard_negatives", hardness_strength=5.0),
        QPN,
    ),
    "cached_mnrl_gte_all_negatives": (
        lambda m: fst.CachedMultipleNegativesRankingLoss(
            m, mini_batch_size=3, directions=GTE, hardness_mode="all_negatives", hardness_strength=5.0
        ),
        QPN,
    ),
    "matryoshka_cached_mnrl": (
        lambda m: st_losses.MatryoshkaLoss(m, fst.CachedMultipleNegativesRankingLoss(m, mini_batch_size=3), [16, 8, 4]),
        QPN,
    ),
    "matryoshka_2d_mnrl_gte": (
        lambda m: st_losses.Matryoshka2dLoss(m, fst.MultipleNegativesRankingLoss(m, directions=GTE), [16, 8]),
        QPN,
    ),
    "fused_matryoshka_mnrl": (
        lambda m: fst.MultipleNegativesRankingLoss(m, matryoshka_dims=(16, 8, 4), matryoshka_weights=(1, 0.5, 0.5)),
        QPN,
    ),
    "fused_matryoshka_cached_mnrl_n_dims": (
        lambda m: fst.CachedMultipleNegativesRankingLoss(
            m, mini_batch_size=3, matryoshka_dims=(16, 8, 4), n_dims_per_step=2
        ),
        QPN,
    ),
    "fused_matryoshka_supmpn": (lambda m: fst.SupMPNLoss(m, matryoshka_dims=(16, 4)), QPN),
    "fused_matryoshka_supcon_labels": (
        lambda m: fst.SupConLabelsLoss(m, temperature=0.1, matryoshka_dims=(16, 8)),
        ["sentence", "label"],
    ),
    "fused_matryoshka_infonce_gte": (
        lambda m: fst.MultipleNegativesRankingLoss(m, directions=GTE, matryoshka_dims=(16, 8)),
        ["anchor", "positive"],
    ),
    "supcon_labels": (lambda m: fst.SupConLabelsLoss(m, temperature=0.1), ["sentence", "label"]),
    "supcon_labels_two_views_cached": (
        lambda m: fst.SupConLabelsLoss(m, temperature=0.1, mini_batch_size=3),
        ["view_1", "view_2", "label"],
    ),
}


def _dataset(columns: list[str], seed: int):
    texts = [c for c in columns if c != "label"]
    pool = common.sentences(ROWS * len(texts), seed=seed)
    data = {c: pool[i * ROWS : (i + 1) * ROWS] for i, c in enumerate(texts)}
    if "label" in columns:
        data["label"] = [i % 3 for i in range(ROWS)]  # 3 classes: every batch of 8 repeats labels
    return datasets.Dataset.from_dict(data)


@pytest.mark.parametrize("name", list(CASES))
def test_trainer_runs_new_options(tmp_path, name):
    make_loss, columns = CASES[name]
    model = common.tiny_model(tmp_path)
    train = _dataset(columns, seed=len(name))
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
    )
    trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=train, loss=make_loss(model))
    trainer.train()
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == STEPS and all(torch.isfinite(torch.tensor(v)) and v > 0 for v in logged), logged
    frozen = [n for n, p in model.named_parameters() if torch.equal(p.detach(), before[n])]
    assert not frozen, f"parameters that did not train: {frozen}"

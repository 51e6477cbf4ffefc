"""Training data: NLI and sentence readers, the papers' data recipes, collators.

    nli = load_nli(data_dir / "snli/sample20k/train.csv.gz")     # datasets.Dataset
    groups = supmpn_groups(nli, 5, 5, pos_fill="anchor", neg_fill="sample", seed=0)
    batch = collate_groups(groups[:8], tokenizer, max_length=32)

See docs/training.md.
"""

from fastcl.data.collate import LABEL_IDS, collate_groups, collate_liao, collate_triplets, collate_views, tokenize
from fastcl.data.nli import LABELS, load_nli, normalize_label, read_nli_csv, read_nli_jsonl, read_senteval_nli
from fastcl.data.recipes import (
    LIAO_CAPS,
    NEG_FILLS,
    POS_FILLS,
    PUNCTUATION,
    group_by_premise,
    insert_punctuation,
    liao_in_batch,
    simcse_triplets,
    supmpn_capacity,
    supmpn_groups,
)
from fastcl.data.sentences import read_sentences

__all__ = [
    "LABELS",
    "LABEL_IDS",
    "LIAO_CAPS",
    "NEG_FILLS",
    "POS_FILLS",
    "PUNCTUATION",
    "collate_groups",
    "collate_liao",
    "collate_triplets",
    "collate_views",
    "group_by_premise",
    "insert_punctuation",
    "liao_in_batch",
    "load_nli",
    "normalize_label",
    "read_nli_csv",
    "read_nli_jsonl",
    "read_senteval_nli",
    "read_sentences",
    "simcse_triplets",
    "supmpn_capacity",
    "supmpn_groups",
    "tokenize",
]

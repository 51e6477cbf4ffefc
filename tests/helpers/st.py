"""A tiny random BERT as a SentenceTransformer, built offline, and a toy sentence generator."""

from __future__ import annotations

import os
import random

WORDS = (
    "the a one cat dog bird man woman child sat ran flew ate saw on under over mat sky "
    "tree road red blue green small big fast slow today yesterday"
).split()
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
HIDDEN = 16
# float32 parameter gradients through a model: relative Frobenius error per tensor (the
# implementations sum in different orders; elementwise checks trip on tiny entries), or a
# tiny RMS error where the true gradient is 0 (attention key biases: softmax ignores them)
F32_GRAD_TOL = 2e-5


def tiny_model(directory, *, dropout: float = 0.1, seed: int = 0):
    """``SentenceTransformer([Transformer(tiny BERT), Pooling(mean)])`` saved under ``directory``.

    One layer, hidden 16, a 40-word vocabulary: no hub access, a few ms per step.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
    from transformers import BertConfig, BertModel, BertTokenizerFast

    path = os.path.join(str(directory), "tiny-bert")
    vocab = {w: i for i, w in enumerate(SPECIAL + WORDS)}
    BertTokenizerFast(vocab=vocab).save_pretrained(path)
    config = BertConfig(
        vocab_size=len(vocab),
        hidden_size=HIDDEN,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=32,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        BertModel(config, add_pooling_layer=False).save_pretrained(path)
    transformer = Transformer(path, max_seq_length=16, model_kwargs={"add_pooling_layer": False})
    return SentenceTransformer(modules=[transformer, Pooling(HIDDEN, "mean")], device="cpu")


def sentences(n: int, *, seed: int) -> list[str]:
    """``n`` distinct random sentences of 2..7 words."""
    rnd = random.Random(seed)
    out: list[str] = []
    while len(out) < n:
        s = " ".join(rnd.choice(WORDS) for _ in range(rnd.randint(2, 7)))
        if s not in out:
            out.append(s)
    return out


def assert_grads_close(grads: dict, ref: dict, what: str) -> None:
    """Same parameter names; each gradient within ``F32_GRAD_TOL`` (see above)."""
    import torch

    from fastcl.testing import ATOL_RMS, rel_err, rms_err

    assert grads.keys() == ref.keys(), what
    for k in ref:
        err, rms = rel_err(grads[k], ref[k]), rms_err(grads[k], ref[k])
        assert err <= F32_GRAD_TOL or rms <= ATOL_RMS[torch.float32], (
            f"{what}: {k}: relative error {err:.3g}, rms {rms:.3g}"
        )


# --------------------------------------------------------------------------- GIST stand-ins


def toy_tokenizer():
    """A word-level ``BertTokenizerFast`` over :data:`WORDS` (a ``PreTrainedTokenizerBase``)."""
    from transformers import BertTokenizerFast

    return BertTokenizerFast(vocab={w: i for i, w in enumerate(SPECIAL + WORDS)})


def lookup_model(table, *, tokenizer=None, trainable: bool = True, max_seq_length: int = 16):
    """A stand-in ``SentenceTransformer`` whose "text" ``r`` (``input_ids [[r]]``) has the
    embedding ``table[r]``: sentence-transformers' losses run on it unchanged (its
    ``tokenizer`` is a real one), so values and the table's gradient can be compared in
    float64 on chosen embeddings. :func:`row_features` builds a column's features."""
    import torch
    from torch import nn

    class LookupModel(nn.Module):
        def __init__(self):
            super().__init__()
            if trainable:
                self.table = nn.Parameter(table.clone())
            else:
                self.register_buffer("table", table.clone())
            self.tokenizer = tokenizer if tokenizer is not None else toy_tokenizer()
            self.max_seq_length = max_seq_length

        @property
        def device(self):
            return self.table.device

        def __getitem__(self, i):  # sentence-transformers looks at model[0] (StaticEmbedding?)
            return self

        def forward(self, features):
            features["sentence_embedding"] = self.table[features["input_ids"][:, 0]]
            return features

    with torch.no_grad():
        return LookupModel()


def row_features(rows) -> dict:
    """The features of a column whose texts are the table rows ``rows``."""
    import torch

    ids = torch.as_tensor(list(rows), dtype=torch.long)[:, None]
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


MODEL_OUTPUTS = ("token_embeddings", "sentence_embedding", "all_layer_embeddings")


def memoized(guide):
    """``guide`` (an eval-mode ``SentenceTransformer``) with its forward memoized on the exact
    input tensors: a test that runs many losses over the same texts encodes each guide batch
    once. The result is the guide's own (deterministic) embedding; other inputs are encoded."""
    import torch

    original = type(guide).forward
    memo: dict = {}

    def forward(features, **kw):
        # the inputs only: a cached loss hands the guide a mapping the model wrote into
        inputs = {k: v for k, v in features.items() if k not in MODEL_OUTPUTS}
        key = tuple(
            (k, tuple(v.shape), v.cpu().numpy().tobytes())
            for k, v in sorted(inputs.items())
            if isinstance(v, torch.Tensor)
        )
        if key not in memo:
            memo[key] = original(guide, inputs, **kw)["sentence_embedding"]
        features["sentence_embedding"] = memo[key]
        return features

    guide.forward = forward
    return guide

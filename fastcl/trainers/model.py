"""The trained module of the Hugging Face recipes: ``AutoModel`` + fastcl pooling (+ SimCSE MLP).

``SentenceEncoder(backbone, pooling, mlp)`` maps tokenised inputs ``[n, T]`` to sentence
embeddings ``[n, H]`` with :func:`fastcl.pooling.pool`; with ``mlp`` set it applies
SimCSE's head (Linear(H, H) + tanh) on top. Saving writes a folder that loads with
``AutoModel.from_pretrained`` and with ``sentence_transformers.SentenceTransformer``
(Transformer [+ WeightedLayerPooling for avg_first_last / avg_top2] + Pooling [+ Dense(tanh)]
modules reproducing the evaluation embedding), plus
``fastcl_model.json`` naming the pooling to use with :mod:`fastcl.eval`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import Tensor, nn

from fastcl.pooling import check_pooling, needs_hidden_states, pool

MLP_MODES = ("none", "train", "always")  # SimCSE: unsup "train" (dropped at test), sup "always"


class SentenceEncoder(nn.Module):
    """``forward(input_ids, attention_mask, **kw) -> [n, H]`` embeddings (MLP applied if present).

    Args:
        backbone: a transformers ``AutoModel``.
        pooling: one of :data:`fastcl.pooling.POOLINGS`. With any pooling but ``cls`` the
            backbone's own pooler is frozen (it gets no gradient, and DDP requires every
            trainable parameter to receive one).
        mlp: one of :data:`MLP_MODES`: ``none``, ``train`` (head used in training only),
            ``always`` (head part of the final embedding).
    """

    def __init__(self, backbone: nn.Module, pooling: str, mlp: str = "none"):
        super().__init__()
        check_pooling(pooling)
        if mlp not in MLP_MODES:
            raise ValueError(f"mlp={mlp!r}; expected one of {MLP_MODES}")
        self.backbone = backbone
        self.pooling = pooling
        self.mlp_mode = mlp
        hidden = backbone.config.hidden_size
        self.mlp = nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh()) if mlp != "none" else None
        pooler = getattr(backbone, "pooler", None)
        if pooling != "cls" and isinstance(pooler, nn.Module):
            pooler.requires_grad_(False)

    def forward(self, input_ids: Tensor, attention_mask: Tensor, **model_kwargs) -> Tensor:
        if needs_hidden_states(self.pooling):
            model_kwargs["output_hidden_states"] = True
        outputs = self.backbone(input_ids=input_ids, attention_mask=attention_mask, return_dict=True, **model_kwargs)
        emb = pool(outputs, attention_mask, self.pooling)
        return self.mlp(emb) if self.mlp is not None else emb


class EvalEncoder:
    """``encode(sentences, desc) -> [N, H]`` float32 CPU, with the test-time embedding of a
    :class:`SentenceEncoder` (its MLP only when ``mlp="always"``), via :func:`fastcl.eval.encode`."""

    def __init__(self, encoder: SentenceEncoder, tokenizer, batch_size: int = 128, max_length: int | None = None):
        self.encoder, self.tokenizer = encoder, tokenizer
        self.batch_size, self.max_length = batch_size, max_length

    def encode(self, sentences, desc: str = "encode") -> Tensor:
        from fastcl.eval import encode

        enc = self.encoder
        emb = encode(
            enc.backbone,
            self.tokenizer,
            sentences,
            pooling=enc.pooling,
            batch_size=self.batch_size,
            max_length=self.max_length,
            show_progress=False,
            desc=desc,
        )
        if enc.mlp is not None and enc.mlp_mode == "always":
            param = next(enc.mlp.parameters())
            with torch.no_grad():
                emb = enc.mlp(emb.to(param.device, param.dtype)).float().cpu()
        return emb


_ST_POOLING = {"cls": None, "cls_before_pooler": "cls", "mean": "mean"}


def _st_modules():
    try:
        from sentence_transformers.sentence_transformer import modules as m
    except ImportError:  # older sentence-transformers
        from sentence_transformers import models as m
    return m


def save_pretrained(
    encoder: SentenceEncoder, tokenizer, path: str | os.PathLike, sentence_transformers: bool = True
) -> Path:
    """Write ``path`` loadable by ``AutoModel`` and (where the embedding can be expressed with
    its modules) by ``SentenceTransformer``; returns the path.

    With ``mlp="always"`` and a BERT-style pooler of matching shape, the trained MLP is also
    copied into the backbone's pooler, so ``AutoModel``'s ``pooler_output`` is the embedding
    (SimCSE's convention: evaluate with ``pooling="cls"``).
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    backbone = encoder.backbone
    eval_pooling = encoder.pooling
    use_mlp = encoder.mlp is not None and encoder.mlp_mode == "always"
    if use_mlp:
        dense = getattr(getattr(backbone, "pooler", None), "dense", None)
        lin = encoder.mlp[0]
        if (
            encoder.pooling == "cls_before_pooler"
            and isinstance(dense, nn.Linear)
            and dense.weight.shape == lin.weight.shape
        ):
            with torch.no_grad():
                dense.weight.copy_(lin.weight)
                dense.bias.copy_(lin.bias)
            eval_pooling = "cls"
    backbone.save_pretrained(path)
    tokenizer.save_pretrained(path)
    info = {
        "pooling": eval_pooling,
        "mlp": "in_pooler" if eval_pooling == "cls" and use_mlp else encoder.mlp_mode,
        "train_pooling": encoder.pooling,
        "sentence_transformers": False,
    }
    if sentence_transformers:
        info["sentence_transformers"] = _save_st(encoder, path, use_mlp)
    (path / "fastcl_model.json").write_text(json.dumps(info, indent=2) + "\n")
    return path


def _save_st(encoder: SentenceEncoder, path: Path, use_mlp: bool) -> bool:
    """sentence-transformers modules beside the HF files; False when the pooling has no
    sentence-transformers equivalent (the folder still loads with AutoModel)."""
    layers = encoder.backbone.config.num_hidden_layers
    if encoder.pooling in _ST_POOLING:
        mode, layer_weights = _ST_POOLING[encoder.pooling], None
    elif encoder.pooling in ("avg_first_last", "avg_top2") and layers >= 2:
        # WeightedLayerPooling over hidden_states[start:] then a masked mean: weights 1 on the
        # two averaged layers, 0 elsewhere, reproduce fastcl.pooling exactly
        start = 1 if encoder.pooling == "avg_first_last" else layers - 1
        weights = [0.0] * (layers + 1 - start)
        weights[0] = weights[-1] = 1.0
        mode, layer_weights = "mean", (start, weights)
    else:
        mode = None
    if mode is None:
        return False
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError:
        return False
    m = _st_modules()
    hidden = encoder.backbone.config.hidden_size
    if layer_weights is None:
        modules = [m.Transformer(str(path))]
    else:  # the transformer must return every layer (saved as output_hidden_states in config.json)
        start, weights = layer_weights
        modules = [
            m.Transformer(str(path), config_kwargs={"output_hidden_states": True}),
            m.WeightedLayerPooling(
                hidden, num_hidden_layers=layers, layer_start=start, layer_weights=nn.Parameter(torch.tensor(weights))
            ),
        ]
    modules.append(m.Pooling(hidden, pooling_mode=mode))
    if use_mlp:
        lin = encoder.mlp[0]
        modules.append(
            m.Dense(
                hidden,
                hidden,
                activation_function=nn.Tanh(),
                init_weight=lin.weight.detach().float().cpu(),
                init_bias=lin.bias.detach().float().cpu(),
            )
        )
    SentenceTransformer(modules=modules, device="cpu").save(str(path))
    return True

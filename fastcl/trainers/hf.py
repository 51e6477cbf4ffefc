"""``HFRecipe``: the shared part of every Hugging Face recipe (model, tokenizer, eval, save)."""

from __future__ import annotations

import argparse
from pathlib import Path

from torch import Tensor, nn

from fastcl._paths import require_data_dir
from fastcl.pooling import POOLINGS
from fastcl.trainers.config import finite_float
from fastcl.trainers.model import MLP_MODES, EvalEncoder, SentenceEncoder, save_pretrained
from fastcl.trainers.recipe import Recipe

SNLI_TRAIN = "snli/sample20k/train.csv.gz"  # staged SNLI *train* pairs (the full set is not staged)
WIKI = "wiki/wiki1m_for_simcse.partial.txt.gz"


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside DDP (or the model itself)."""
    return getattr(model, "module", model)


def split_rows(emb: Tensor, *sizes: int) -> list[Tensor]:
    """Consecutive row blocks of ``emb`` (``[n, d]``) with the given sizes (must sum to n)."""
    if sum(sizes) != emb.shape[0]:
        raise ValueError(f"embedding rows {emb.shape[0]} != layout {sizes}")
    return list(emb.split(list(sizes)))


class HFRecipe(Recipe):
    """Any ``AutoModel`` + fastcl pooling (+ SimCSE MLP head); subclasses write data and loss."""

    default_source = SNLI_TRAIN

    def __init__(self):
        self._tokenizer = None
        self._data = None

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        g = parser.add_argument_group(f"{self.name} options")
        g.add_argument("--pooling", choices=POOLINGS, help="sentence embedding at train time (fastcl.pooling)")
        g.add_argument(
            "--mlp", choices=MLP_MODES, help="SimCSE MLP head over the pooled embedding: none / train only / always"
        )
        g.add_argument("--max-length", type=int, help="truncation length in tokens for training texts")
        g.add_argument("--temperature", type=finite_float, help="softmax temperature tau (logit = similarity / tau)")
        g.add_argument("--train-split", help="split of a SentEval-format NLI folder (s1.SPLIT) or hub dataset")
        self.add_method_arguments(g)

    def add_method_arguments(self, group) -> None:
        """Subclasses add their own options here."""

    def option_defaults(self) -> dict:
        return {
            "pooling": "cls_before_pooler",
            "mlp": "none",
            "max_length": 32,
            "temperature": 0.05,
            "train_split": "train",
        }

    # ------------------------------------------------------------------ validation
    def validate(self, cfg) -> None:
        if not cfg.model:
            raise ValueError(f"{self.name}: --model PATH_OR_NAME is required")
        looks_local = str(cfg.model).startswith((".", "/", "~")) or Path(cfg.model).expanduser().exists()
        if looks_local and not (Path(cfg.model).expanduser() / "config.json").is_file():
            raise FileNotFoundError(f"--model {cfg.model}: no Hugging Face model there (config.json missing)")
        if cfg.max_length < 2:
            raise ValueError(f"--max-length must be >= 2, got {cfg.max_length}")
        if not cfg.temperature > 0:
            raise ValueError(f"--temperature must be > 0, got {cfg.temperature}")
        if cfg.eval_steps:
            require_data_dir(cfg.data_dir)  # STS-B dev lives there
        self.data(cfg)  # read (and check) the training data now, before the model loads

    def source(self, cfg) -> Path | str:
        if cfg.train_file:
            return cfg.train_file
        return require_data_dir(cfg.data_dir) / self.default_source

    def read_data(self, cfg):
        raise NotImplementedError

    def data(self, cfg):
        """The prepared training examples (read once, cached)."""
        if self._data is None:
            self._data = self.read_data(cfg)
        return self._data

    def build_dataset(self, cfg):
        return self.data(cfg)

    # ------------------------------------------------------------------ model
    def tokenizer(self, cfg):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(str(cfg.model))
        return self._tokenizer

    def build_encoder(self, cfg) -> SentenceEncoder:
        from transformers import AutoModel

        backbone, info = AutoModel.from_pretrained(str(cfg.model), output_loading_info=True)
        missing_pooler = [k for k in info.get("missing_keys", []) if "pooler" in k]
        if cfg.pooling == "cls" and missing_pooler:
            raise ValueError(
                f"--model {cfg.model} has no trained pooler; pooling='cls' would start from random "
                "weights: use --pooling cls_before_pooler --mlp always (SimCSE's head)"
            )
        self.tokenizer(cfg)
        self._eval_batch = cfg.eval_batch_size
        return SentenceEncoder(backbone, cfg.pooling, cfg.mlp)

    def build_model(self, cfg) -> nn.Module:
        return self.build_encoder(cfg)

    def sentence_encoder(self, model: nn.Module) -> SentenceEncoder:
        return unwrap(model)

    def encoder(self, model: nn.Module):
        return EvalEncoder(self.sentence_encoder(model), self._tokenizer, batch_size=self._eval_batch)

    _eval_batch = 128

    def save_pretrained(self, model: nn.Module, path, cfg) -> None:
        save_pretrained(self.sentence_encoder(model), self._tokenizer, path)

"""EdaCSE (Liu et al. 2023): SimCSE-unsup + lam * InfoNCE against punctuation-augmented copies."""

from __future__ import annotations

from fastcl.data import PUNCTUATION, collate_views, insert_punctuation, read_sentences
from fastcl.losses import edacse_loss
from fastcl.trainers.config import finite_float
from fastcl.trainers.hf import WIKI, HFRecipe, split_rows

_PAPER = {
    "max_length": 32,
    "temperature": 0.05,
    "pooling": "cls_before_pooler",
    "mlp": "train",
    "schedule": "cosine",
    "warmup_ratio": 0.0,
    "epochs": 1,
    "max_examples": 10_000,
    "weight_decay": 0.01,
}  # paper Table 4


class EdaCSE(HFRecipe):
    name = "edacse"
    help = "EdaCSE: unsupervised SimCSE + lam * InfoNCE with 1..k inserted punctuation marks"
    default_source = WIKI
    presets = {
        "bert-base": {**_PAPER, "batch_size": 32, "lr": 3e-5, "max_insertions": 3, "lam": 0.6},
        "roberta-base": {**_PAPER, "batch_size": 32, "lr": 3e-5, "max_insertions": 2, "lam": 0.3},
        "roberta-large": {**_PAPER, "batch_size": 16, "lr": 5e-6, "max_insertions": 5, "lam": 0.6},
    }
    defaults = {"batch_size": 32, "lr": 3e-5, "schedule": "cosine", "weight_decay": 0.01}

    def add_method_arguments(self, g) -> None:
        g.add_argument("--lam", type=finite_float, help="weight of the augmented-view InfoNCE (bert-base 0.6)")
        g.add_argument("--max-insertions", type=int, help="k: insert 1..k marks (bert-base 3)")
        g.add_argument("--marks", help=f"punctuation marks to insert, as one string (default {''.join(PUNCTUATION)!r})")

    def option_defaults(self):
        return {
            **super().option_defaults(),
            "mlp": "train",
            "lam": 0.6,
            "max_insertions": 3,
            "marks": "".join(PUNCTUATION),
        }

    def validate(self, cfg) -> None:
        if cfg.max_insertions < 1:
            raise ValueError(f"--max-insertions must be >= 1, got {cfg.max_insertions}")
        if not cfg.marks or any(c.isspace() for c in cfg.marks):
            raise ValueError(f"--marks must be non-empty single characters without spaces, got {cfg.marks!r}")
        if cfg.lam < 0:
            raise ValueError(f"--lam must be >= 0, got {cfg.lam}")
        super().validate(cfg)

    def read_data(self, cfg):
        return read_sentences(self.source(cfg))

    def collate(self, examples, ctx):
        cfg, rng = ctx.cfg, ctx.rng
        marks = tuple(cfg.marks)
        return collate_views(
            examples,
            self._tokenizer,
            cfg.max_length,
            views=2,
            augment=lambda s: insert_punctuation(s, cfg.max_insertions, rng, marks),
        )

    def loss(self, model, batch, ctx):
        B = batch["batch_size"]
        a, a_drop, a_aug = split_rows(ctx.encode(model, **batch["inputs"]), B, B, B)
        return edacse_loss(a, a_drop, a_aug, lam=ctx.cfg.lam, temperature=ctx.cfg.temperature, **ctx.negatives()), {}

"""SimCSE (Gao et al. 2021): unsupervised (dropout views, InfoNCE) and supervised (NLI triplets, MNRL)."""

from __future__ import annotations

from fastcl.data import collate_triplets, collate_views, load_nli, read_sentences, simcse_triplets
from fastcl.losses import infonce_loss, mnrl_loss
from fastcl.trainers.hf import WIKI, HFRecipe, split_rows

# fp16 in the paper: "auto" = bf16/fp16 autocast on CUDA, fp32 on the CPU (config.resolve_precision)
_COMMON = {
    "max_length": 32,
    "temperature": 0.05,
    "pooling": "cls_before_pooler",
    "schedule": "linear",
    "warmup_ratio": 0.0,
    "weight_decay": 0.0,
    "max_grad_norm": 1.0,  # the released trainer clips at HF TrainingArguments' default 1.0
    "eval_steps": 125,
    "precision": "auto",
}


class SimCSEUnsup(HFRecipe):
    """Two dropout views of each sentence; InfoNCE over the B x B logits (diagonal target)."""

    name = "simcse-unsup"
    help = "unsupervised SimCSE on plain sentences (wiki), InfoNCE over dropout views"
    default_source = WIKI
    presets = {
        "bert-base": {**_COMMON, "batch_size": 64, "lr": 3e-5, "epochs": 1, "mlp": "train"},
        "bert-large": {**_COMMON, "batch_size": 64, "lr": 1e-5, "epochs": 1, "mlp": "train"},
    }
    defaults = {"batch_size": 64, "lr": 3e-5}

    def option_defaults(self):
        return {**super().option_defaults(), "mlp": "train"}

    def read_data(self, cfg):
        return read_sentences(self.source(cfg))

    def collate(self, examples, ctx):
        return collate_views(examples, self._tokenizer, ctx.cfg.max_length, views=2)

    def loss(self, model, batch, ctx):
        B = batch["batch_size"]
        a, b = split_rows(ctx.encode(model, **batch["inputs"]), B, B)
        return infonce_loss(a, b, temperature=ctx.cfg.temperature, **ctx.negatives()), {}


class SimCSESup(HFRecipe):
    """(premise, entailment, contradiction) triplets; MNRL over B x 2B logits."""

    name = "simcse-sup"
    help = "supervised SimCSE on NLI triplets (entailment positive, contradiction hard negative)"
    presets = {
        "bert-base": {**_COMMON, "batch_size": 512, "lr": 5e-5, "epochs": 3, "mlp": "always"},
        "bert-large": {**_COMMON, "batch_size": 512, "lr": 1e-5, "epochs": 3, "mlp": "always"},
    }
    defaults = {"batch_size": 128, "lr": 5e-5}

    def option_defaults(self):
        return {**super().option_defaults(), "mlp": "always"}

    def read_data(self, cfg):
        return simcse_triplets(load_nli(self.source(cfg), cfg.train_split))

    def collate(self, examples, ctx):
        return collate_triplets(examples, self._tokenizer, ctx.cfg.max_length)

    def loss(self, model, batch, ctx):
        B = batch["batch_size"]
        a, p, n = split_rows(ctx.encode(model, **batch["inputs"]), B, B, B)
        return mnrl_loss(a, p, n, temperature=ctx.cfg.temperature, **ctx.negatives()), {}

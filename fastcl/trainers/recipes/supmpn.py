"""SupMPN (Dehghan & Amasyali 2022): P entailments and Q contradictions per premise."""

from __future__ import annotations

from torch import Tensor

from fastcl.data import NEG_FILLS, POS_FILLS, collate_groups, load_nli, supmpn_capacity, supmpn_groups
from fastcl.losses import OWN_POSITIVES, supmpn_loss
from fastcl.trainers.hf import HFRecipe, split_rows

_PAPER = {
    "max_length": 32,
    "temperature": 0.05,
    "pooling": "avg_first_last",
    "mlp": "none",
    "epochs": 3,
    "num_positives": 5,
    "num_negatives": 5,
    "pos_fill": "anchor",
    "neg_fill": "sample",
    "schedule": "linear",
    "warmup_ratio": 0.0,
    "weight_decay": 0.0,
    "max_grad_norm": 1.0,  # SimCSE's trainer (HF default), which SupMPN's code reuses
    "eval_steps": 125,
    "precision": "auto",
}  # fp16 on GPUs as SimCSE: bf16/fp16 autocast on CUDA, fp32 on the CPU


class SupMPN(HFRecipe):
    name = "supmpn"
    help = "SupMPN: multiple positives and hard negatives per premise (eq. 7)"
    presets = {
        "bert-base": {**_PAPER, "batch_size": 256, "lr": 5e-5},
        "bert-large": {**_PAPER, "batch_size": 200, "lr": 1e-5},
    }
    defaults = {"batch_size": 64, "lr": 5e-5}

    def add_method_arguments(self, g) -> None:
        g.add_argument("--num-positives", type=int, help="P: positives per anchor (paper 5)")
        g.add_argument("--num-negatives", type=int, help="Q: hard negatives per anchor (paper 5)")
        g.add_argument(
            "--pos-fill",
            choices=POS_FILLS,
            help="premises with < P entailments: copy the anchor / repeat entailments / mask / drop the premise",
        )
        g.add_argument(
            "--neg-fill",
            choices=NEG_FILLS,
            help="premises with < Q contradictions: sample other premises' hypotheses / mask / drop",
        )
        g.add_argument("--min-positives", type=int, help="skip premises with fewer real entailments (default 1)")
        g.add_argument(
            "--own-positives", choices=OWN_POSITIVES, help="eq. 7 ('exclude') or the released code ('zero_logit')"
        )

    def option_defaults(self):
        return {
            **super().option_defaults(),
            "pooling": "avg_first_last",
            "mlp": "none",
            "num_positives": 5,
            "num_negatives": 5,
            "pos_fill": "anchor",
            "neg_fill": "sample",
            "min_positives": 1,
            "own_positives": "exclude",
        }

    def validate(self, cfg) -> None:
        if cfg.num_positives < 1 or cfg.num_negatives < 0 or cfg.min_positives < 0:
            raise ValueError("--num-positives must be >= 1, --num-negatives and --min-positives >= 0")
        super().validate(cfg)

    def read_data(self, cfg):
        nli = load_nli(self.source(cfg), cfg.train_split)
        max_pos, max_neg = supmpn_capacity(nli)
        if cfg.pos_fill == "drop" and cfg.num_positives > max_pos:
            raise ValueError(
                f"--num-positives {cfg.num_positives} but no premise of {self.source(cfg)} has more than "
                f"{max_pos} entailments; choose --pos-fill anchor/entailment_copy/mask"
            )
        if cfg.neg_fill == "drop" and cfg.num_negatives > max_neg:
            raise ValueError(
                f"--num-negatives {cfg.num_negatives} but no premise of {self.source(cfg)} has more than "
                f"{max_neg} contradictions; choose --neg-fill sample/mask"
            )
        return supmpn_groups(
            nli,
            cfg.num_positives,
            cfg.num_negatives,
            cfg.pos_fill,
            cfg.neg_fill,
            seed=cfg.seed,
            min_positives=cfg.min_positives,
        )

    def collate(self, examples, ctx):
        return collate_groups(examples, self._tokenizer, ctx.cfg.max_length)

    def loss(self, model, batch, ctx):
        B, pos_mask, neg_mask = batch["batch_size"], batch["pos_mask"], batch["neg_mask"]
        n_pos, n_neg = batch["n_pos"], batch["n_neg"]  # the collator's host counts: no device read
        emb = ctx.encode(model, **batch["inputs"])
        anchor, pos_flat, neg_flat = split_rows(emb, B, n_pos, n_neg)
        positives, pos_mask = slot_layout(pos_flat, pos_mask, n_pos)
        negatives, neg_mask = slot_layout(neg_flat, neg_mask, n_neg)
        loss = supmpn_loss(
            anchor,
            positives,
            negatives if negatives.shape[1] else None,
            pos_mask=pos_mask,
            neg_mask=neg_mask if negatives.shape[1] else None,
            temperature=ctx.cfg.temperature,
            own_positives=ctx.cfg.own_positives,
            **ctx.negatives(),
        )
        return loss, {}


def slot_layout(flat: Tensor, mask: Tensor, n_valid: int) -> tuple[Tensor, Tensor | None]:
    """The encoded valid texts ``flat [n_valid, d]`` (row-major over ``mask [B, S]``) in the
    ``[B, S, d]`` slot layout, and the mask the loss takes: None when every slot is valid (the
    same loss, and the fused kernels skip masking padded rows), else ``mask`` with the padded
    slots zero-filled."""
    if n_valid == mask.numel():
        return flat.view(*mask.shape, flat.shape[-1]), None
    slots = flat.new_zeros(*mask.shape, flat.shape[-1])
    return slots.masked_scatter(mask[..., None], flat), mask

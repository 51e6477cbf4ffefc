"""The ``Recipe`` interface: what a training method plugs into the shared loop.

The loop (:func:`fastcl.trainers.loop.train`) owns everything that is the same for every
method: seeding, the epoch order and data position, DDP, autocast and loss scaling,
gradient clipping, the optimiser step, checkpoints and exact resume, periodic dev
evaluation with best-checkpoint selection, logs and progress. A recipe owns what differs:

=========================  ================================================================
``name``, ``presets``      method name and paper hyper-parameters (``--preset``)
``defaults``               the method's defaults for the shared options (lr, batch size, ...)
``add_arguments(parser)``  method options (``--lam``, ``--num-positives``, ...)
``validate(cfg)``          raise ``ValueError``/``FileNotFoundError`` before any compute
``build_model(cfg)``       an ``nn.Module``; everything trainable lives in it
``build_dataset(cfg)``     a sequence of examples (``len`` + ``[i]``), the epoch unit
``num_examples(cfg)``      its length, before the model loads (default: ``len(build_dataset)``)
``collate(examples, ctx)`` one rank's batch (a dict of tensors); tokenise here, once
``loss(model, batch, ctx)`` ``(loss, {name: float})`` for one optimiser step
``build_optimizer``        default AdamW over parameters that require grad
``build_scheduler``        default warm-up then linear / cosine / constant
``on_step_end(ctx)``       optional hook after each optimiser step (e.g. momentum change)
``encoder(model)``         an object with ``encode(sentences, desc=...) -> (N, H)`` for STS
``save_pretrained``        write the final / best model (Hugging Face + sentence-transformers)
=========================  ================================================================

:class:`HFRecipe` implements the model, optimiser, evaluation and saving for any Hugging
Face ``AutoModel`` with fastcl's poolings (and SimCSE's optional MLP head); the SimCSE,
SupMPN, SupCon and EdaCSE recipes subclass it and only write data, collation and loss.
A method with its own model and optimiser (GCLSR: a TextCNN over word vectors, SGD) subclasses
:class:`Recipe` directly. Register a recipe in :data:`fastcl.trainers.registry.RECIPES`.
"""

from __future__ import annotations

import argparse
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn


@dataclass
class StepContext:
    """What the loop hands a recipe for one step (and to ``collate``).

    Attributes:
        cfg: the resolved configuration (``argparse.Namespace``: shared + recipe options).
        step: optimiser steps completed before this one (0-based).
        epoch: current epoch (0-based).
        rank, world_size: ``torch.distributed`` position (0 / 1 without DDP).
        device: where the model lives.
        process_group: pass to fastcl losses as ``process_group=`` for cross-device
            negatives (``None`` on one process); ``cross_device`` with it (``--cross-device``):
            ``ctx.negatives()`` gives both as keyword arguments.
        rng: ``random.Random`` seeded from (seed, step, rank): use it for every random
            choice in ``collate`` (augmentation, negative sampling) so resume is exact.
        encode: ``encode(module, **inputs) -> (n, d)``: runs ``module(**inputs)`` and, with
            ``--chunk-size``, through :class:`fastcl.gradcache.GradCache` (several calls may
            feed one loss). Use it for every encoder forward that needs gradients; pass the
            model the loop gave you (it may be wrapped in DDP).
    """

    cfg: argparse.Namespace
    step: int = 0
    epoch: int = 0
    rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    process_group: Any = None
    cross_device: str = "gather"
    rng: random.Random = field(default_factory=random.Random)
    encode: Callable[..., Tensor] | None = None

    def negatives(self) -> dict[str, Any]:
        """``process_group=`` and ``cross_device=`` for a fastcl loss (cross-device negatives)."""
        return {"process_group": self.process_group, "cross_device": self.cross_device}


class Recipe:
    """Base class of a training method. See the module docstring for the contract."""

    name: str = ""
    help: str = ""
    # preset name -> option values (paper hyper-parameters); explicit CLI options win.
    presets: dict[str, dict[str, Any]] = {}
    # this method's defaults for shared options (e.g. {"lr": 3e-5, "batch_size": 64}).
    defaults: dict[str, Any] = {}

    # ------------------------------------------------------------------ configuration
    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Add this method's options; give them ``default=None`` so presets can fill them."""

    def option_defaults(self) -> dict[str, Any]:
        """Defaults of this method's own options (applied after the preset)."""
        return {}

    def validate(self, cfg: argparse.Namespace) -> None:
        """Raise ``ValueError`` / ``FileNotFoundError`` for bad options or data, before compute."""

    # ------------------------------------------------------------------ components
    def build_model(self, cfg: argparse.Namespace) -> nn.Module:
        raise NotImplementedError

    def build_dataset(self, cfg: argparse.Namespace) -> Sequence:
        raise NotImplementedError

    def num_examples(self, cfg: argparse.Namespace) -> int:
        """How many training examples ``build_dataset`` gives (before ``--max-examples``),
        known before the model loads; override where building the dataset is costly."""
        return len(self.build_dataset(cfg))

    def collate(self, examples: list, ctx: StepContext) -> dict[str, Any]:
        raise NotImplementedError

    def loss(self, model: nn.Module, batch: dict[str, Any], ctx: StepContext) -> tuple[Tensor, dict[str, float]]:
        raise NotImplementedError

    def trainable_parameters(self, model: nn.Module):
        return [p for p in model.parameters() if p.requires_grad]

    def build_optimizer(self, cfg: argparse.Namespace, model: nn.Module) -> torch.optim.Optimizer:
        """AdamW(lr, weight_decay) over the parameters that require grad."""
        return torch.optim.AdamW(self.trainable_parameters(model), lr=cfg.lr, weight_decay=cfg.weight_decay)

    def build_scheduler(self, cfg: argparse.Namespace, optimizer: torch.optim.Optimizer, total_steps: int):
        """Linear warm-up over ``warmup_ratio * total_steps``, then ``cfg.schedule``."""
        return warmup_schedule(optimizer, total_steps, cfg.warmup_ratio, cfg.schedule)

    def on_step_end(self, model: nn.Module, optimizer: torch.optim.Optimizer, ctx: StepContext) -> None:
        """Called after every optimiser step (e.g. a momentum or temperature schedule)."""

    # ------------------------------------------------------------------ evaluation and saving
    def encoder(self, model: nn.Module):
        """An object with ``encode(sentences, desc=...) -> (N, H)`` float32 CPU embeddings."""
        raise NotImplementedError

    def save_pretrained(self, model: nn.Module, path, cfg: argparse.Namespace) -> None:
        raise NotImplementedError


SCHEDULES = ("linear", "cosine", "constant")


def warmup_schedule(optimizer, total_steps: int, warmup_ratio: float, schedule: str):
    """``LambdaLR``: linear warm-up from 0 over ``ceil(warmup_ratio * total_steps)`` steps,
    then linear decay to 0, cosine decay to 0, or constant."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r}; expected one of {SCHEDULES}")
    warmup = math.ceil(warmup_ratio * total_steps)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if schedule == "constant":
            return 1.0
        progress = (step - warmup) / max(1, total_steps - warmup)
        if schedule == "linear":
            return max(0.0, 1.0 - progress)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)

"""Shared training options, presets and their resolution.

Precedence for every option: explicit command-line value > ``--preset`` > the recipe's
defaults (``Recipe.defaults`` / ``Recipe.option_defaults()``) > :data:`SHARED_DEFAULTS`.
All options are added with ``default=None`` so that "not given" can be told apart.
"""

from __future__ import annotations

import argparse
import math
from typing import TYPE_CHECKING, Any

from fastcl._fsio import check_output_dir
from fastcl.trainers.recipe import SCHEDULES, Recipe

if TYPE_CHECKING:
    import torch

PRECISIONS = ("fp32", "bf16", "fp16", "auto")


class SetupError(ValueError):
    """Bad options, data or output folder, found before any model is loaded or anything is
    written. ``fastcl train`` prints its message as one line and exits with status 2."""


SHARED_DEFAULTS: dict[str, Any] = {
    "model": None,
    "data_dir": None,
    "train_file": None,
    "output_dir": "runs/fastcl",
    "batch_size": 64,
    "epochs": 1,
    "max_steps": None,
    "max_examples": None,
    "lr": 3e-5,
    "weight_decay": 0.0,
    "warmup_ratio": 0.0,
    "schedule": "linear",
    "max_grad_norm": None,
    "precision": "fp32",
    "chunk_size": None,
    "cross_device": "gather",
    "seed": 42,
    "shuffle": True,
    "eval_steps": 125,
    "eval_batch_size": 128,
    "save_steps": 500,
    "save_total_limit": 2,
    "log_steps": 10,
    "resume": None,
    "overwrite": False,
    "allow_config_change": False,
    "device": None,
    "progress": True,
    "tensorboard": True,
}


def _bool(text: str) -> bool:
    low = text.lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def finite_float(text: str) -> float:
    """argparse type: a float that is neither infinite nor NaN (``float`` accepts both)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def add_shared_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("shared training options")
    g.add_argument("--model", help="Hugging Face model path or hub id (AutoModel)")
    g.add_argument("--data-dir", help="staged data directory (default: $FASTCL_DATA_DIR)")
    g.add_argument("--train-file", help="training data: a file or folder overriding the method's default source")
    g.add_argument("--output-dir", help="where checkpoints, logs and the final model go")
    g.add_argument("--preset", help="paper hyper-parameters (see --list-presets)")
    g.add_argument("--batch-size", type=int, help="global batch (examples per optimiser step, all ranks)")
    g.add_argument("--epochs", type=int)
    g.add_argument("--max-steps", type=int, help="stop after this many optimiser steps")
    g.add_argument("--max-examples", type=int, help="use only the first N training examples")
    g.add_argument("--lr", type=finite_float)
    g.add_argument("--weight-decay", type=finite_float)
    g.add_argument("--warmup-ratio", type=finite_float)
    g.add_argument("--schedule", choices=SCHEDULES)
    g.add_argument("--max-grad-norm", type=finite_float, help="clip the gradient norm (off by default)")
    g.add_argument(
        "--precision",
        choices=PRECISIONS,
        help="autocast dtype (fp16 uses a GradScaler, CUDA only); "
        "auto: bf16 on a CUDA device that supports it, else fp16 on CUDA, fp32 on the CPU",
    )
    g.add_argument("--chunk-size", type=int, help="gradient cache: encode in chunks of this many texts")
    g.add_argument(
        "--cross-device",
        choices=("gather", "ring"),
        help="with DDP, how the losses see every rank's candidates: all-gathered (default) or passed "
        "rank to rank (ring: per-rank memory does not grow with the world; docs/distributed.md)",
    )
    g.add_argument("--seed", type=int)
    g.add_argument("--shuffle", type=_bool, help="shuffle each epoch (true/false)")
    g.add_argument("--eval-steps", type=int, help="STS-B dev evaluation every N steps (0 = off)")
    g.add_argument("--eval-batch-size", type=int)
    g.add_argument("--save-steps", type=int, help="checkpoint every N steps (0 = only at the end)")
    g.add_argument("--save-total-limit", type=int, help="keep the last N checkpoints")
    g.add_argument("--log-steps", type=int)
    g.add_argument(
        "--resume",
        help="'auto' (continue the run in --output-dir from its newest checkpoint) or a checkpoint folder",
    )
    g.add_argument(
        "--overwrite",
        action="store_true",
        default=None,
        help="replace the run already in --output-dir (its checkpoints, log, models); "
        "without it a fresh start there is refused",
    )
    g.add_argument(
        "--allow-config-change",
        action="store_true",
        default=None,
        help="resume even if method, batch size, lr, seed or other training options differ "
        "from the checkpoint's (they are refused by default)",
    )
    g.add_argument("--device", help="cpu / cuda / cuda:N (default: cuda when available)")
    g.add_argument("--progress", type=_bool, help="tqdm progress bar (true/false)")
    g.add_argument("--tensorboard", type=_bool, help="TensorBoard event files (true/false)")
    g.add_argument("--list-presets", action="store_true", help="print the method's presets and exit")


def resolve(args: argparse.Namespace, recipe: Recipe) -> argparse.Namespace:
    """Fill every ``None`` option from the preset, the recipe's defaults, then the shared ones."""
    preset: dict[str, Any] = {}
    name = getattr(args, "preset", None)
    if name is not None:
        if name not in recipe.presets:
            known = ", ".join(sorted(recipe.presets)) or "none"
            raise ValueError(f"unknown preset {name!r} for {recipe.name}; known presets: {known}")
        preset = recipe.presets[name]
    layers = [preset, recipe.option_defaults(), recipe.defaults, SHARED_DEFAULTS]
    cfg = argparse.Namespace(**vars(args))
    keys = set().union(*layers) | set(vars(args))
    for key in keys:
        if getattr(cfg, key, None) is not None:
            continue
        for layer in layers:
            if layer.get(key) is not None:
                setattr(cfg, key, layer[key])
                break
        else:
            setattr(cfg, key, None)
    cfg.method = recipe.name
    check_shared(cfg)
    return cfg


def resolve_precision(precision: str, device: torch.device | str | None = None) -> str:
    """The autocast setting actually used: ``auto`` becomes mixed precision on CUDA (bf16
    where the GPU supports it, else fp16 with loss scaling, as SimCSE and SupMPN trained)
    and fp32 on any other device; explicit values pass through. ``device=None`` means
    the loop's default device (CUDA when available)."""
    import torch

    if precision != "auto":
        return precision
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if torch.device(device).type != "cuda":
        return "fp32"
    return "bf16" if torch.cuda.is_bf16_supported() else "fp16"


def _positive_int(cfg, name: str, allow_none=False, allow_zero=False) -> None:
    value = getattr(cfg, name)
    if value is None and allow_none:
        return
    low = 0 if allow_zero else 1
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"--{name.replace('_', '-')} must be an integer >= {low}, got {value!r}")


def _finite(cfg, name: str) -> None:
    value = getattr(cfg, name)
    if value is not None and not math.isfinite(value):
        raise ValueError(f"--{name.replace('_', '-')} must be a finite number, got {value}")


def _nonempty_path(cfg, name: str) -> None:
    value = getattr(cfg, name, None)
    if value is not None and not str(value).strip():
        what = "the working directory" if name == "output_dir" else "a default"
        raise ValueError(f"--{name.replace('_', '-')} is empty (it would silently mean {what}): give a path")


def device_type(device: str | None) -> str:
    """``cpu`` / ``cuda``: where ``--device`` (None: CUDA when available) puts the model.
    Raises ``ValueError`` for a device this machine does not have."""
    import torch

    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise ValueError(f"--device {device!r}: not a device; use cpu, cuda or cuda:N") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {device!r}: fastcl trains on cpu or cuda / cuda:N")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {device}: no CUDA device here (torch {torch.__version__}); use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return dev.type


def check_shared(cfg: argparse.Namespace) -> None:
    """Validate the shared options (clear errors before any model or data is loaded)."""
    for name in ("batch_size", "epochs", "eval_batch_size", "log_steps", "seed"):
        _positive_int(cfg, name, allow_zero=name == "seed")
    for name in ("max_steps", "max_examples", "chunk_size"):
        _positive_int(cfg, name, allow_none=True)
    for name in ("eval_steps", "save_steps", "save_total_limit"):
        _positive_int(cfg, name, allow_zero=True)
    for name in ("lr", "weight_decay", "warmup_ratio", "max_grad_norm"):
        _finite(cfg, name)
    if not cfg.lr > 0:
        raise ValueError(f"--lr must be > 0, got {cfg.lr}")
    if cfg.weight_decay < 0:
        raise ValueError(f"--weight-decay must be >= 0, got {cfg.weight_decay}")
    if not 0 <= cfg.warmup_ratio < 1:
        raise ValueError(f"--warmup-ratio must be in [0, 1), got {cfg.warmup_ratio}")
    if cfg.max_grad_norm is not None and not cfg.max_grad_norm > 0:
        raise ValueError(f"--max-grad-norm must be > 0, got {cfg.max_grad_norm}")
    if cfg.precision not in PRECISIONS:
        raise ValueError(f"--precision must be one of {PRECISIONS}, got {cfg.precision!r}")
    if cfg.schedule not in SCHEDULES:
        raise ValueError(f"--schedule must be one of {SCHEDULES}, got {cfg.schedule!r}")
    for name in ("output_dir", "model", "train_file", "data_dir", "resume"):
        _nonempty_path(cfg, name)
    kind = device_type(getattr(cfg, "device", None))
    if cfg.precision == "fp16" and kind != "cuda":
        raise ValueError(
            "--precision fp16 needs a CUDA device (loss scaling with a GradScaler); on the CPU use bf16 or auto"
        )
    if getattr(cfg, "overwrite", False) and cfg.resume == "auto":
        raise ValueError(
            "--overwrite replaces the run in --output-dir and --resume auto continues it: give one of them"
        )
    check_output_dir(cfg.output_dir, "--output-dir")

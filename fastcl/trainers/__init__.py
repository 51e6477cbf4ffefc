"""Thin trainers: one shared loop (``loop.train``), a ``Recipe`` per method. See docs/training.md.

from fastcl.trainers import get_recipe, train_method
summary = train_method("supmpn", model="path/to/model", max_steps=100, output_dir="runs/x")
"""

from fastcl.trainers.recipe import Recipe, StepContext, warmup_schedule
from fastcl.trainers.registry import RECIPES, get_recipe

_FLAGS = frozenset({"overwrite", "allow_config_change"})


def train_method(method: str, **options) -> dict:
    """Python twin of ``fastcl train METHOD --option value ...``: resolve, validate, train."""
    from fastcl.cli.train import parse

    argv = [method]
    for key, value in options.items():
        flag = f"--{key.replace('_', '-')}"
        if key in _FLAGS:  # on/off switches without a value (overwrite=True -> --overwrite)
            argv += [flag] if value else []
        else:
            argv += [flag, str(value)]
    recipe, cfg = parse(argv)
    from fastcl.trainers.loop import train

    return train(recipe, cfg)


__all__ = ["RECIPES", "Recipe", "StepContext", "get_recipe", "train_method", "warmup_schedule"]

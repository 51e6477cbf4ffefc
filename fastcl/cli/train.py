"""``fastcl train METHOD --model PATH_OR_NAME [options]``: train with one of the recipes.

Options are validated (and the training data read) before the model loads; errors print
one line and exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys

from fastcl.trainers.config import add_shared_arguments, resolve
from fastcl.trainers.registry import RECIPES, get_recipe


def add_parser(sub) -> None:
    p = sub.add_parser(
        "train",
        help="train a sentence encoder (simcse-unsup, simcse-sup, supmpn, supcon, edacse, gclsr)",
        description="Train with one method's recipe; `fastcl train METHOD -h` lists its options.",
    )
    _add_methods(p)


def _add_methods(parser: argparse.ArgumentParser) -> None:
    methods = parser.add_subparsers(dest="method", required=True, metavar="METHOD")
    for name in RECIPES:
        recipe = get_recipe(name)
        m = methods.add_parser(name, help=recipe.help, description=recipe.help)
        add_shared_arguments(m)
        recipe.add_arguments(m)


def parse(argv: list[str]):
    """``(recipe, cfg)`` from ``METHOD --option ...`` (what follows ``fastcl train``)."""
    parser = argparse.ArgumentParser(prog="fastcl train")
    _add_methods(parser)
    args = parser.parse_args(argv)
    recipe = get_recipe(args.method)
    return recipe, resolve(args, recipe)


def _list_presets(recipe) -> None:
    print(json.dumps(recipe.presets, indent=2))


def run(args) -> int:
    recipe = get_recipe(args.method)
    if getattr(args, "list_presets", False):
        _list_presets(recipe)
        return 0
    try:
        cfg = resolve(args, recipe)
        recipe.validate(cfg)
    except (ValueError, FileNotFoundError, TypeError) as e:
        print(f"fastcl train {args.method}: error: {e}", file=sys.stderr)
        return 2
    from fastcl.trainers.checkpoint import CheckpointError
    from fastcl.trainers.loop import train

    try:
        summary = train(recipe, cfg)
    except CheckpointError as e:  # raised while choosing the checkpoint, before any compute
        print(f"fastcl train {args.method}: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary, indent=2))
    return 0

"""``fastcl train METHOD --model PATH_OR_NAME [options]``: train with one of the recipes.

Options, the training data, the devices and the output folder (which run it holds, which
checkpoint to continue) are checked before the model loads; each error prints one line on
stderr and exits with status 2 (docs/training.md, "Bad input").
"""

from __future__ import annotations

import argparse
import json
import sys

from fastcl.cli import OneLineErrorParser
from fastcl.trainers.config import SetupError, add_shared_arguments, resolve
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
    parser = OneLineErrorParser(prog="fastcl train")
    _add_methods(parser)
    args = parser.parse_args(argv)
    recipe = get_recipe(args.method)
    return recipe, resolve(args, recipe)


def _list_presets(recipe) -> None:
    print(json.dumps(recipe.presets, indent=2))


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())


def run(args) -> int:
    recipe = get_recipe(args.method)
    if getattr(args, "list_presets", False):
        _list_presets(recipe)
        return 0
    try:
        cfg = resolve(args, recipe)
        recipe.validate(cfg)
    except (ValueError, FileNotFoundError, TypeError) as e:
        print(f"fastcl train {args.method}: error: {_one_line(e)}", file=sys.stderr)
        return 2
    import torch.distributed as dist

    from fastcl.trainers.loop import train

    joined = dist.is_available() and dist.is_initialized()  # a caller's group is the caller's to end
    try:
        summary = train(recipe, cfg)
    except SetupError as e:  # raised by the checks before the model loads (or by a checkpoint's files)
        print(f"fastcl train {args.method}: error: {_one_line(e)}", file=sys.stderr)
        return 2
    if not joined and dist.is_available() and dist.is_initialized():
        _leave_together()
    print(json.dumps(summary, indent=2))
    return 0


def _leave_together() -> None:
    """End the process group the run started (torchrun): every rank waits for the others,
    then the group goes, and the process will leave without the interpreter's teardown, where
    gloo's threads (kept alive by DDP) can abort it (:func:`fastcl.cli.skip_teardown`)."""
    import torch.distributed as dist

    from fastcl.cli import skip_teardown

    dist.barrier()
    dist.destroy_process_group()
    skip_teardown()

"""Method name -> recipe class ("module:Class", imported on use). Add one line per method."""

from __future__ import annotations

import importlib

RECIPES = {
    "simcse-unsup": "fastcl.trainers.recipes.simcse:SimCSEUnsup",
    "simcse-sup": "fastcl.trainers.recipes.simcse:SimCSESup",
    "supmpn": "fastcl.trainers.recipes.supmpn:SupMPN",
    "supcon": "fastcl.trainers.recipes.supcon:SupCon",
    "edacse": "fastcl.trainers.recipes.edacse:EdaCSE",
    "gclsr": "fastcl.gclsr.recipe:GCLSRRecipe",
}


def get_recipe(name: str):
    """A fresh recipe instance for method ``name``."""
    if name not in RECIPES:
        raise ValueError(f"unknown method {name!r}; expected one of {sorted(RECIPES)}")
    module, cls = RECIPES[name].split(":")
    return getattr(importlib.import_module(module), cls)()

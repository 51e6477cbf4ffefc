"""The untrained (step-0) GCLSR model of a run, and how far training moved each layer.

    python examples/gclsr/init_model.py --run runs/gclsr-repro/full --output runs/gclsr-repro/full/init
    python examples/gclsr/sts.py --model runs/gclsr-repro/full/init      # STS of the random TextCNN

Rebuilds the model exactly as the training loop does (word vectors first, then
``torch.manual_seed(seed)`` and the constructor), saves it in the recipe's format and
prints, per backbone/head parameter, ``|W_best - W_init| / |W_init|`` (docs/gclsr.md uses it
to tell "training moved the TextCNN" from "the STS score is that of random filters").
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from fastcl.gclsr.model import GCLSRModel
from fastcl.gclsr.recipe import CONFIG_FILE, WEIGHTS_FILE, load_word_vectors


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", required=True, help="a training output dir holding best/")
    p.add_argument("--output", required=True, help="where to save the step-0 model")
    args = p.parse_args(argv)
    best = Path(args.run) / "best"
    config = json.loads((best / CONFIG_FILE).read_text())
    load_word_vectors(config["word_vectors"], seed=config["seed"])  # as the loop: vectors before the seed
    torch.manual_seed(config["seed"])
    init = GCLSRModel(
        config["dim"],
        region_sizes=config["region_sizes"],
        filters=config["filters"],
        proj_dim=config["proj_dim"],
        pred_hidden=config["pred_hidden"],
        attention=config["attention"],
    )
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    torch.save(init.state_dict(), out / WEIGHTS_FILE)
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    trained = torch.load(best / WEIGHTS_FILE, map_location="cpu")
    moved = {}
    for name, w0 in init.state_dict().items():
        if w0.is_floating_point() and w0.dim() > 1:
            moved[name] = round(float((trained[name] - w0).norm() / w0.norm()), 4)
    print(json.dumps({"relative_change": moved}, indent=2))
    (out / "relative_change.json").write_text(json.dumps(moved, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

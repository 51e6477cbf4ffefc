"""Train a tiny two-tower (image–text) model with fastcl's SigLipLoss on the CPU.

Synthetic paired data: each pair shares a hidden "concept" vector; the image tower sees it
through one random projection plus noise, the text tower through another. Two small MLP
towers learn to map both views to a shared, normalised space; open_clip's conventions are
kept: ``logit_scale`` is learned as a log and passed exponentiated, ``logit_bias`` is learned
(SigLIP initialises them at ``log 10`` and ``-10``). The loss is fastcl's fused SigLIP: the
``[B, B]`` logits are never built, so the batch can grow far beyond what fits as logits.

    python examples/clip_tiny.py                      # ~20 s on 2 cores: the loss falls
    python examples/clip_tiny.py --steps 40 --batch 256  # what the test runs
    python examples/clip_tiny.py --loss clip          # CLIP's symmetric InfoNCE instead

Prints the loss and the retrieval accuracy (image -> text, top-1 within a held-out batch)
before and after training.
"""

from __future__ import annotations

import argparse
import math
import time

import torch
from torch import nn

from fastcl.integrations.open_clip import ClipLoss, SigLipLoss


class Pairs:
    """An endless source of (image, text) pairs that share a concept."""

    def __init__(self, concepts: int = 32, image_dim: int = 96, text_dim: int = 64, noise: float = 0.3, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.to_image = torch.randn(concepts, image_dim, generator=g)
        self.to_text = torch.randn(concepts, text_dim, generator=g)
        self.concepts, self.noise, self.g = concepts, noise, g

    def batch(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        c = torch.randn(n, self.concepts, generator=self.g)
        image = c @ self.to_image + self.noise * torch.randn(n, self.to_image.shape[1], generator=self.g)
        text = c @ self.to_text + self.noise * torch.randn(n, self.to_text.shape[1], generator=self.g)
        return image, text


class TwoTowers(nn.Module):
    def __init__(self, image_dim: int, text_dim: int, width: int = 128, embed: int = 32):
        super().__init__()
        self.image = nn.Sequential(nn.Linear(image_dim, width), nn.GELU(), nn.Linear(width, embed))
        self.text = nn.Sequential(nn.Linear(text_dim, width), nn.GELU(), nn.Linear(width, embed))
        # SigLIP's initialisation: t = 10, b = -10 (open_clip keeps log t)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(10.0)))
        self.logit_bias = nn.Parameter(torch.tensor(-10.0))

    def forward(self, image, text):
        img = nn.functional.normalize(self.image(image), dim=-1)
        txt = nn.functional.normalize(self.text(text), dim=-1)
        return img, txt, self.logit_scale.exp(), self.logit_bias


@torch.no_grad()
def evaluate(model: TwoTowers, loss_fn, image, text) -> tuple[float, float]:
    img, txt, t, b = model(image, text)
    loss = float(loss_fn(img, txt, t, b))
    top1 = float(((img @ txt.T).argmax(dim=1) == torch.arange(len(img))).float().mean())
    return loss, top1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--loss", choices=("siglip", "clip"), default="siglip")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    data = Pairs(seed=args.seed)
    model = TwoTowers(data.to_image.shape[1], data.to_text.shape[1])
    loss_fn = SigLipLoss() if args.loss == "siglip" else ClipLoss()
    held_out = data.batch(256)
    before = evaluate(model, loss_fn, *held_out)
    print(f"{args.loss}: before training  held-out loss {before[0]:.4f}  image->text top-1 {before[1]:.3f}")

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    start = time.perf_counter()
    for step in range(args.steps):
        img, txt, t, b = model(*data.batch(args.batch))
        loss = loss_fn(img, txt, t, b)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % max(1, args.steps // 5) == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {loss.item():.4f}  t {t.item():6.2f}  b {b.item():7.2f}")
    elapsed = time.perf_counter() - start

    after = evaluate(model, loss_fn, *held_out)
    print(
        f"{args.loss}: after {args.steps} steps ({elapsed:.1f} s)  held-out loss {after[0]:.4f}  image->text top-1 {after[1]:.3f}"
    )
    print("the loss fell" if after[0] < before[0] else "the loss did NOT fall")


if __name__ == "__main__":
    main()

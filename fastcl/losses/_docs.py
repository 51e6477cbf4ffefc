"""The losses' shared argument docs, composed into each docstring by :func:`document` (one
definition; tests/losses/test_docs.py checks that every parameter of every public loss is
documented)."""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from typing import Any, TypeVar

# The text of every argument that several losses share, composed into each docstring by
# :func:`document` (one definition; tests/losses/test_docs.py checks that every parameter of
# every public loss is documented).
ARG_DOCS: dict[str, str] = {
    "pos_mask": "``[B, P]`` bool or None: ``False`` marks a padded positive slot, which takes part in "
    "nothing (no value, exactly zero gradient). None: every slot is valid.",
    "neg_mask": "``[B, Q]`` bool or None: ``False`` marks a padded negative slot. Needs ``negatives``.",
    "temperature": "float or 0-d floating tensor, > 0: ``logit = similarity / temperature`` "
    "(sentence-transformers' ``scale`` is ``1 / temperature``), finite with a finite reciprocal in "
    "the compute dtype. A tensor that requires grad receives its gradient.",
    "reduction": '``"mean"`` (over the anchors that have a valid positive), ``"sum"``, or ``"none"`` '
    "(one float row per anchor, 0 for an anchor without a valid positive).",
    "backend": '``"auto"`` (``FASTCL_BACKEND``, else the fastest available for the device), '
    '``"reference"``, ``"torch"``, ``"cpp"`` or ``"triton"``. An explicit backend that '
    "cannot take the inputs raises ``BackendUnavailableError`` saying why.",
    "strategy": '``"auto"`` (``fastcl.config``\'s ``strategy``, from ``FASTCL_STRATEGY``, whose own '
    '``"auto"`` runs the fused gradient-in-forward step where the backend has one and ``reduction`` '
    'is not ``"none"``), ``"fused"`` (raises ``ValueError`` where the backend cannot) or '
    '``"recompute"`` (forward keeps the LSE only, backward recomputes the logits). Same values and '
    "gradients either way; only speed and memory differ (docs/design.md).",
    "process_group": "``torch.distributed`` process group or None. With a group every rank's "
    "candidates join every anchor's denominator (all-gathered with gradient) and the loss is scaled "
    "so that DDP's gradient averaging gives exactly the gradient of the global batch's loss; every "
    "rank passes the same shapes (docs/distributed.md).",
    "cross_device": '``"gather"`` (default) or ``"ring"``: how a ``process_group``\'s candidates reach '
    "every anchor. ``gather`` all-gathers them (each rank holds ``W`` ranks' candidates and their "
    "gradients); ``ring`` passes them rank to rank (``fastcl.ops.ring``: per-rank memory constant in "
    "``W``, same values and gradients, first derivatives only). Ignored without a group "
    '(docs/distributed.md, "Gather or ring").',
    "similarity": '``"cos"`` (cosine of the raw embeddings, normalised inside) or ``"dot"`` (raw dot '
    "products, as Liao's released code).",
    "matryoshka_dims": "None, or distinct integers in ``1..d`` (Python's or NumPy's; any iterable): the loss becomes ``sum_k w_k * loss(embeddings[..., :dims[k]])``, sentence-transformers' "
    '``MatryoshkaLoss`` (each prefix normalised on its own with ``"cos"``), all prefixes in one '
    "fused pass over ``d``. The result keeps its shape.",
    "matryoshka_weights": "None (all 1) or one real weight ``w_k`` per dim (any iterable), finite in the "
    "compute dtype. Needs ``matryoshka_dims``.",
    "learn_temperature": "keep ``log(temperature)`` as a parameter (initialised from ``temperature``) "
    "so that it trains and stays > 0.",
}

RETURNS = (
    '0-d loss (``[B]`` rows with ``reduction="none"``) in the embeddings\' dtype, accumulated in '
    "float32 (float64 for float64 embeddings)."
)

# the shared keyword arguments of every LSE loss, in signature order
LSE_OPTIONS = (
    "temperature",
    "reduction",
    "backend",
    "strategy",
    "process_group",
    "similarity",
    "matryoshka_dims",
    "matryoshka_weights",
    "cross_device",
)

_F = TypeVar("_F", bound=Callable[..., Any])


def _wrapped(name: str, text: str, indent: str) -> str:
    return textwrap.fill(
        f"{name}: {text}", width=100, initial_indent=indent, subsequent_indent=indent + "    ", break_long_words=False
    )


def document(*names: str, extra: dict[str, str] | None = None) -> Callable[[_F], _F]:
    """Put the docs of ``names`` (:data:`ARG_DOCS`, or a family's own shared text in ``extra``)
    at the docstring's ``{shared}`` line, and the shared return value at a ``{returns}`` line."""
    docs = {**ARG_DOCS, **(extra or {})}

    def apply(obj: _F) -> _F:
        doc = obj.__doc__ or ""
        lines = doc.splitlines()
        for i, line in enumerate(lines):
            indent = line[: len(line) - len(line.lstrip())]
            if line.strip() == "{shared}":
                lines[i] = "\n".join(_wrapped(n, docs[n], indent) for n in names)
            elif line.strip() == "{returns}":
                lines[i] = textwrap.fill(RETURNS, width=100, initial_indent=indent, subsequent_indent=indent)
        obj.__doc__ = "\n".join(lines)
        return obj

    return apply

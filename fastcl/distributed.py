"""Cross-device negatives: every anchor sees the candidates of every rank of a process group.

Pass ``process_group=dist.group.WORLD`` (or any group) to an LSE loss of ``fastcl.losses``.
The candidate blocks are all-gathered *with gradient* before the fused primitive runs, so
every backend works unchanged; tags travel with their candidates (another rank's own
positive becomes a plain negative here). The losses scale their reductions so that DDP's
gradient averaging gives exactly the one-process gradient of the global batch (one rule:
``fastcl.losses._shared.row_weights``); the exact semantics, requirements and per-call cost
are in docs/distributed.md. With ``cross_device="ring"`` the candidates travel rank to rank
instead (``fastcl.ops.ring``), which uses this module's handshake and status helpers.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from .ops.contract import FLOAT_DTYPES, TAG_ALL

_FLOAT_CODES = FLOAT_DTYPES  # a dtype travels in the handshake as its index here
_MAX_SIZES = 6
_OK, _FAILED = 0, 1
_SETTINGS_BYTES = 480  # one rank's settings text, exchanged only when the ranks disagree

# Newer torch renames the tensor collectives; use whichever this build has.
_all_gather_single = getattr(dist, "all_gather_single", None) or getattr(dist, "all_gather_into_tensor", None)
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or getattr(dist, "reduce_scatter_tensor", None)


@dataclass(frozen=True)
class Gathered:
    """What the fused loss runs on after the gather (see the module docstring).

    ``blocks``: ``([W * N, d], [0, d])`` every rank's candidates, rank-major, in the input
    dtype, differentiable. ``tags``: int32 ``[W * N]`` and ``[0]``. ``offset``: the row of
    ``blocks[0]`` where this rank's own candidates start (``rank * N``). ``world``: ``W``.
    ``valid_anchors``: 0-d int32, the anchors with a valid positive on every rank together
    (what ``fastcl.losses``' scaling rule divides a mean by).
    """

    blocks: tuple[Tensor, Tensor]
    tags: tuple[Tensor, Tensor]
    offset: int
    world: int
    valid_anchors: Tensor


def all_gather_into(out: Tensor, local: Tensor, group) -> None:
    """``out [W * n, ...]`` = every rank's ``local [n, ...]``, rank-major (no gradient)."""
    _all_gather_single(out, local, group=group)


def check_group(group) -> None:
    """``TypeError``/``RuntimeError`` unless ``group`` is a usable process group of this rank."""
    if not dist.is_available():
        raise RuntimeError("process_group given but torch.distributed is not available in this build of torch")
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"process_group must be a torch.distributed.ProcessGroup this rank belongs to "
            f"(e.g. dist.group.WORLD), got {type(group).__name__}"
        )
    if not dist.is_initialized():
        raise RuntimeError("process_group given but torch.distributed is not initialised (call init_process_group)")


# --------------------------------------------------------------------------- handshake

# The outermost public loss call running with a process group (see ``agree_on_errors``).
_CALL: contextvars.ContextVar[dict | None] = contextvars.ContextVar("fastcl_distributed_call", default=None)


def handshake_device(group) -> torch.device:
    """Where the host-read handshakes of ``group`` run: CPU when the group has a CPU backend
    (no GPU sync), else its accelerator."""
    types = getattr(group, "_device_types", None)  # private; absent on old torch
    if types is None:
        cpu = dist.get_backend(group) in ("gloo", "mpi")
        types = [torch.device("cpu")] if cpu else [torch.device("cuda")]
    if not types or torch.device("cpu") in types:
        return torch.device("cpu")
    kind = types[0].type
    module = getattr(torch, kind, None)
    index = module.current_device() if hasattr(module, "current_device") else 0
    return torch.device(kind, index)


def _handshake(
    group, status: int, layout: int = 0, dtype_code: int = -1, sizes: tuple[int, ...] = ()
) -> list[list[int]]:
    """All-gather ``[status, settings, layout, dtype, sizes...]`` of every rank; read on the
    host. ``settings`` is the hash of the outermost public loss call's settings (0 outside one)."""
    call = _CALL.get()
    if call is not None:
        call["handshakes"] += 1
    settings = 0 if call is None else call["settings_hash"]
    values = [status, settings, layout, dtype_code, *sizes] + [0] * (_MAX_SIZES - len(sizes))
    device = handshake_device(group)
    local = torch.tensor(values, dtype=torch.int64)
    if device.type != "cpu":
        local = local.pin_memory().to(device, non_blocking=True)
    table = local.new_empty(dist.get_world_size(group) * len(values))  # flat: gloo wants the cat form
    _all_gather_single(table, local, group=group)
    return table.view(-1, len(values)).tolist()


def _check_handshake(table: list[list[int]], names: tuple[str, ...], group) -> None:
    failed = [r for r, row in enumerate(table) if row[0] != _OK]
    if failed:
        raise RuntimeError(
            f"fastcl: rank(s) {failed} rejected their inputs to a distributed loss (their own error "
            f"says why); every rank stops here instead of waiting in a collective"
        )
    if len({row[1] for row in table}) > 1:  # every rank sees this: all exchange their settings
        texts = _exchange_settings(group)
        got = "; ".join(f"rank {r}: {t}" for r, t in enumerate(texts))
        raise ValueError(
            "fastcl: the ranks called a distributed loss with different settings (the loss, its "
            f"options, fastcl.config's ring_pieces and strategy must agree on every rank); got {got}"
        )
    signatures = {tuple(row[2 : 4 + len(names)]) for row in table}
    if len(signatures) == 1:
        return

    def describe(row):
        if row[2] != table[0][2]:
            return "a different loss"
        sizes = ", ".join(f"{n}={v}" for n, v in zip(names, row[4:]))
        return f"{sizes}, {_FLOAT_CODES[row[3]]}"

    got = "; ".join(f"rank {r}: {describe(row)}" for r, row in enumerate(table))
    raise ValueError(
        f"fastcl: every rank of the process group must pass the same sizes ({', '.join(names)}) and "
        f"dtype to a distributed loss (masks may differ: pad to a common shape and mask); got {got}"
    )


def _settings_text(fn, args, kwargs) -> str:
    """What every rank must agree on in a call of the public loss ``fn``: its name, every
    argument that is not a tensor (options, defaults included; the process group left out)
    and the configuration that shapes the exchange (``ring_pieces``, ``strategy``)."""
    from . import config

    sig = inspect.signature(fn)
    bound = sig.bind(*args, **kwargs)
    bound.apply_defaults()
    parts = []
    for name, value in bound.arguments.items():
        # data (tensors, masks, a guide: may differ, e.g. a rank with masks) is not a setting
        data = "Tensor" in str(sig.parameters[name].annotation) or name in ("guide", "labels")
        if name == "process_group" or data or isinstance(value, torch.Tensor):
            continue
        if isinstance(value, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in value):
            continue
        parts.append(f"{name}={value!r}")
    cfg = config.get()
    parts += [f"ring_pieces={cfg.ring_pieces}", f"config.strategy={cfg.strategy!r}"]
    return f"{fn.__name__}({', '.join(parts)})"


def _exchange_settings(group) -> list[str]:
    """Every rank's settings text (see :func:`agree_on_errors`), for the error message."""
    call = _CALL.get()
    text = ("" if call is None else call["settings"]).encode()[: _SETTINGS_BYTES - 1]
    row = torch.zeros(_SETTINGS_BYTES, dtype=torch.uint8)
    row[: len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8) if text else row[:0]
    device = handshake_device(group)
    table = row.to(device).new_empty(dist.get_world_size(group) * _SETTINGS_BYTES)
    _all_gather_single(table, row.to(device), group=group)
    rows = table.view(-1, _SETTINGS_BYTES).cpu()
    return [bytes(r[r != 0].tolist()).decode(errors="replace") for r in rows]


def agree_on_errors(fn):
    """Decorator for the public losses: a rank that fails validation tells the others.

    Without it, one rank raising before its first collective leaves the others waiting in
    the handshake forever. With it, the failing rank joins that handshake with a failure
    flag before re-raising, and the other ranks raise a ``RuntimeError`` naming it. The
    handshake also carries a hash of the call's settings (:func:`_settings_text`): ranks
    that disagree (gather on one, ring on another; different ``ring_pieces``, dims, loss,
    reduction, ...) raise ``ValueError`` on every rank, naming each rank's settings, before
    any collective that could hang or abort. Errors
    after a rank's first handshake are raised identically on every rank by construction
    (size mismatch, no valid positive) or come from the backend (then, as with any
    collective, the other ranks wait until the process group's timeout).
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        group = kwargs.get("process_group")
        if group is None or _CALL.get() is not None:  # single process, or an outer call guards
            return fn(*args, **kwargs)
        settings = _settings_text(fn, args, kwargs)
        call = {"handshakes": 0, "settings": settings, "settings_hash": zlib.crc32(settings.encode())}
        token = _CALL.set(call)
        try:
            return fn(*args, **kwargs)
        except Exception:
            if (
                call["handshakes"] == 0
                and dist.is_available()
                and dist.is_initialized()
                and isinstance(group, dist.ProcessGroup)
            ):
                _handshake(group, _FAILED)
            raise
        finally:
            _CALL.reset(token)

    return wrapper


def check_same_sizes(group, sizes: dict[str, int], dtype: torch.dtype) -> None:
    """Every rank passes the same named ``sizes`` (at most six, e.g. ``{"B": B, "Q": Q, "d": d}``)
    and ``dtype`` to the same loss; else every rank raises ``ValueError`` naming each rank's
    sizes (a gather of unequal sizes would hang or mix rows). One small collective, the
    handshake :func:`agree_on_errors` counts; the names tell the losses apart."""
    names = tuple(sizes)
    layout = functools.reduce(lambda h, c: (h * 131 + ord(c)) % (1 << 31), ",".join(names), 7)
    table = _handshake(group, _OK, layout, _FLOAT_CODES.index(dtype), tuple(sizes.values()))
    _check_handshake(table, names, group)


# --------------------------------------------------------------------------- gather


class _AllGatherWithGrad(torch.autograd.Function):
    """``[n, ...]`` on each rank -> ``[W * n, ...]`` rank-major; backward: this rank's slice
    of the sum of every rank's gradient (a reduce-scatter)."""

    @staticmethod
    def forward(ctx, local: Tensor, group) -> Tensor:
        ctx.group = group
        out = local.new_empty((dist.get_world_size(group) * local.shape[0], *local.shape[1:]))
        _all_gather_single(out, local.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        world = dist.get_world_size(ctx.group)
        grad = grad.contiguous()
        out = grad.new_empty((grad.shape[0] // world, *grad.shape[1:]))
        _reduce_scatter_single(out, grad, group=ctx.group)
        return out, None


def all_gather_with_grad(local: Tensor, group) -> Tensor:
    """All-gather ``local`` (same shape on every rank) along dim 0, differentiably.

    Backward returns each rank ``sum over ranks of the gradient`` restricted to its slice,
    so every rank must call backward (a collective).
    """
    return _AllGatherWithGrad.apply(local, group)


def gather_candidates(
    blocks: tuple[Tensor, Tensor],
    tags: tuple[Tensor, Tensor],
    has_pos: Tensor,
    *,
    sizes: dict[str, int],
    check_positive: bool,
    group,
) -> Gathered:
    """Gather every rank's candidates and tags, and count the anchors with a valid positive.

    Args:
        blocks: this rank's candidate blocks ``[N0, d]``, ``[N1, d]`` (see ``ops.contract``).
        tags: their int32 tags ``[N0]``, ``[N1]`` (owner indices are local anchor rows).
        has_pos: ``[B]`` bool, anchors of this rank with a valid positive.
        sizes: the named sizes that must agree across ranks (:func:`check_same_sizes`).
        check_positive: read the global valid-anchor count and raise ``ValueError`` when it is
            0 (done where the single-process path checks: when ``pos_mask`` was given).
        group: the process group.
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    check_same_sizes(group, sizes, blocks[0].dtype)

    # Tags and this rank's valid-anchor count in one int32 collective.
    n0, n1 = blocks[0].shape[0], blocks[1].shape[0]
    count = has_pos.sum().to(torch.int32).reshape(1)
    local_tags = torch.cat([tags[0], tags[1], count])
    all_tags = local_tags.new_empty(world * (n0 + n1 + 1))
    _all_gather_single(all_tags, local_tags, group=group)
    all_tags = all_tags.view(world, n0 + n1 + 1)
    global_count = all_tags[:, -1].sum()
    if check_positive and int(global_count) == 0:
        raise ValueError(
            "no anchor of any rank has a valid positive (pos_mask is all False everywhere): the loss is undefined"
        )
    cand_tags = all_tags[:, :-1]
    foreign = torch.arange(world, device=cand_tags.device)[:, None] != rank
    cand_tags = torch.where(foreign & (cand_tags >= 0), torch.full_like(cand_tags, TAG_ALL), cand_tags)

    # One collective for both blocks: the contract only needs the candidate set and its tags.
    local = blocks[0] if n1 == 0 else torch.cat(blocks)
    gathered = all_gather_with_grad(local, group)

    empty = gathered.new_empty((0, gathered.shape[1]))
    empty_tags = cand_tags.new_empty((0,))
    tags_out = (cand_tags.reshape(-1).contiguous(), empty_tags)
    return Gathered((gathered, empty), tags_out, rank * (n0 + n1), world, global_count)

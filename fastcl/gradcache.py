"""Gradient caching: contrastive batches far beyond accelerator memory, with exact gradients.

An in-batch contrastive loss couples every embedding of the batch, so the encoder cannot
simply be run on micro-batches with gradient accumulation. Gradient caching (Gao et al.
2021, "Scaling Deep Contrastive Learning Batch Size under Memory Limited Setup") splits
the step in two:

1. ``emb = gc(**inputs)`` encodes the batch chunk by chunk **without** grad and returns
   the concatenated ``[n, d]`` embeddings, attached to autograd through a custom
   ``autograd.Function``. No encoder activation is kept.
2. ``loss_fn(emb, ...).backward()`` computes the loss and its gradient with respect to the
   embeddings (with fastcl's fused losses this needs no ``B x N`` memory either). The
   cached gradient then drives a second, chunked pass: each chunk is re-encoded **with**
   grad and backpropagated at once, so only one chunk's activations are alive at a time,
   and the encoder's parameter gradients accumulate in ``.grad``.

Exactness. The re-encoding replays, per chunk, the CPU and CUDA RNG states (dropout masks
are bit-identical to the first pass) and the autocast state of the first pass (backward
is usually called outside ``torch.autocast``). The parameter gradients therefore equal
those of encoding the same chunks with grad in one graph, up to float summation order.

Running statistics. Norm layers that track them (BatchNorm, tracked InstanceNorm) update
them once per chunk in the first pass, as one uncached forward per chunk would; the replay
restores them afterwards, so they are not updated twice (see ``_running_stats_kept``).

Several calls, one backward. Any number of ``gc(...)`` outputs (anchors, positives,
negatives) may feed one loss, and several forwards may precede one backward. Every output
hangs off one shared autograd node of this ``GradCache`` (the *flush* node). The autograd
engine runs a node only after every node of the current backward that feeds it, so the
flush node runs exactly once per backward, after each participating output has delivered
its embedding gradient, and outputs that take no part in this backward are not waited for.
All re-encoding happens there, in call order.

DDP. Pass the ``DistributedDataParallel`` module (or use it as ``encode_fn``): every chunk
but the very last of the flush re-encodes under ``ddp.no_sync()``, accumulating local
gradients in ``param.grad``; the last chunk's forward arms the reducer and its backward
all-reduces the buckets, which hold the whole accumulated ``param.grad`` -- one sync per
backward covering every chunk of every call. (A backward run inside the user's own
``ddp.no_sync()`` does not sync at all, as usual for gradient accumulation.) Every rank
must make the same calls with the same number of chunks: DDP forwards are collective when
it broadcasts buffers, and the reducer expects a matching backward on every rank.

Parameters must not change between ``gc(...)`` and ``backward()``. The cached embeddings
were computed with the weights of the first pass; re-encoding with other weights (an
``optimizer.step()``, ``load_state_dict`` or any in-place update in between) would give a
gradient of neither point. Each call records the version counter (``._version``) of every
parameter of ``encode_fn`` -- an ``nn.Module``'s ``parameters()``, or for a plain callable
the parameters of every module that ran inside it -- and the backward raises a
``RuntimeError`` naming the changed parameters before re-encoding anything (plain autograd
refuses the same sequence). Not seen: tensors used outside any module by a plain callable,
and writes through ``param.data``, which bypass the version counter.

Limitations. Parameter gradients are accumulated into ``.grad`` by a backward nested in
the outer one (like reentrant checkpointing), so ``torch.autograd.grad(loss, params)``
does not see them; tensors in ``inputs`` must not require grad.
"""

from __future__ import annotations

import bisect
import contextlib
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _NormBase

from .pooling import POOLINGS, check_pooling, needs_hidden_states, pool

__all__ = ["GradCache", "HFEncoder", "POOLINGS"]

_AUTOCAST_DEVICES = ("cpu", "cuda")


# --------------------------------------------------------------------------- state replay


def _capture_rng(cuda_devices: list[int]) -> tuple[Tensor, list[Tensor]]:
    """The CPU generator state and the default generator state of each CUDA device."""
    return torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in cuda_devices]


@contextlib.contextmanager
def _replayed_rng(state: tuple[Tensor, list[Tensor]], cuda_devices: list[int]):
    """Run with the captured RNG states, then restore the caller's (fork_rng)."""
    cpu_state, cuda_states = state
    with torch.random.fork_rng(devices=cuda_devices):
        torch.set_rng_state(cpu_state)
        for device, s in zip(cuda_devices, cuda_states):
            torch.cuda.set_rng_state(s, device)
        yield


def _capture_autocast() -> dict:
    return {dev: (torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev)) for dev in _AUTOCAST_DEVICES} | {
        "cache": torch.is_autocast_cache_enabled()
    }


def _replayed_autocast(state: dict) -> contextlib.ExitStack:
    """Re-enter the first pass's autocast state, whatever the state around backward is."""
    stack = contextlib.ExitStack()
    for dev in _AUTOCAST_DEVICES:
        enabled, dtype = state[dev]
        if enabled or torch.is_autocast_enabled(dev):
            stack.enter_context(
                torch.autocast(device_type=dev, dtype=dtype, enabled=enabled, cache_enabled=state["cache"])
            )
    return stack


# --------------------------------------------------------------------------- running statistics


def _tracks_running_stats(module: nn.Module) -> bool:
    """BatchNorm*, SyncBatchNorm and InstanceNorm* with ``track_running_stats=True``."""
    return isinstance(module, _NormBase) and module.track_running_stats


def _snapshot(module: nn.Module) -> list[tuple[Tensor, Tensor]]:
    return [(b, b.detach().clone()) for b in module.buffers(recurse=False)]


def _restore(saved) -> None:
    with torch.no_grad():
        for snaps in saved:
            for buf, copy in snaps:
                buf.copy_(copy)  # in place: DDP and user code hold these very tensors


@contextlib.contextmanager
def _running_stats_kept(roots: list[nn.Module] | None):
    """Undo every running-statistics update made inside the block.

    The first pass already ran each chunk once, updating the statistics exactly as one
    uncached forward per chunk; the replay (and any recomputation by gradient checkpointing
    during its backward) must not update them again. In train mode these layers normalise
    with the batch's own statistics, so restoring them changes no output or gradient.
    ``roots``: the modules to search; ``None`` (``encode_fn`` is a plain callable) finds the
    layers as they run, through a global forward pre-hook active only inside the block.
    """
    if roots is not None:
        saved = [_snapshot(m) for r in roots for m in r.modules() if _tracks_running_stats(m)]
        try:
            yield
        finally:
            _restore(saved)
        return
    seen: dict[int, list] = {}

    def record(module, _args):
        if _tracks_running_stats(module) and id(module) not in seen:
            seen[id(module)] = _snapshot(module)

    handle = torch.nn.modules.module.register_module_forward_pre_hook(record)
    try:
        yield
    finally:
        handle.remove()
        _restore(seen.values())


# --------------------------------------------------------------------------- parameter versions


@contextlib.contextmanager
def _modules_that_run(ran: dict[int, nn.Module]):
    """Collect into ``ran`` every module that runs inside the block, in order of first call
    (a plain-callable ``encode_fn`` does not say which modules it uses)."""

    def record(module, _args):
        ran.setdefault(id(module), module)

    handle = torch.nn.modules.module.register_module_forward_pre_hook(record)
    try:
        yield
    finally:
        handle.remove()


def _parameters_of(ran: list[nn.Module]) -> list[tuple[str, nn.Parameter]]:
    """The parameters of the modules that ran, named by their path from the outermost
    module that ran around them (an outer module's pre-hook fires before its children's)."""
    path: dict[int, str] = {}
    for module in ran:
        if id(module) not in path:  # not inside a module seen earlier: an outermost one
            for prefix, sub in module.named_modules():
                path.setdefault(id(sub), prefix)
    out, seen = [], set()
    for module in ran:
        for name, p in module.named_parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                out.append((f"{path[id(module)]}.{name}".lstrip("."), p))
    return out


def _changed(versions: list[tuple[str, Tensor, int]]) -> list[str]:
    return [name for name, p, v in versions if p._version != v]


@dataclass
class _EncoderState:
    """What the encoder was when a call encoded its chunks, beyond the version counters: the
    parameter objects by name, their dtypes and devices, and every module's training flag.
    Re-encoding under another state (a replaced parameter, ``model.double()``, ``model.eval()``)
    would give the gradient of another function; :meth:`changes` says what differs."""

    params: list[tuple[str, nn.Parameter, torch.dtype, torch.device]]
    modes: list[tuple[str, nn.Module, bool]]
    source: Callable[[], list[tuple[str, nn.Parameter]]]  # the parameters as they are now

    @classmethod
    def of(cls, named: list[tuple[str, nn.Parameter]], modules: list[tuple[str, nn.Module]], source) -> _EncoderState:
        return cls([(n, p, p.dtype, p.device) for n, p in named], [(n, m, m.training) for n, m in modules], source)

    def changes(self) -> list[str]:
        # position by position: the names of a plain callable's modules may repeat (two
        # top-level modules built alike), the order of the parameters does not change
        now = [p for _, p in self.source()]
        out = []
        if len(now) != len(self.params):
            out.append(f"encode_fn has {len(now)} parameters now, {len(self.params)} when it encoded")
        for (name, p, dtype, device), current in zip(self.params, now):
            if current is not p:
                out.append(f"parameter {name} was replaced by another object")
            elif p.dtype != dtype or p.device != device:
                out.append(
                    f"parameter {name} moved from {dtype}/{device} to {p.dtype}/{p.device} (e.g. .double(), .to())"
                )
        for name, module, training in self.modes:
            if module.training != training:
                mode = "train()" if module.training else "eval()"
                out.append(f"module {name or type(module).__name__} switched to {mode} (dropout would not replay)")
        return out


# --------------------------------------------------------------------------- one call


@dataclass
class _Call:
    """Everything one ``gc(**inputs)`` call needs to re-encode its chunks later."""

    index: int  # call order, so re-encoding order never depends on the engine
    tensor_keys: list[str]
    static: dict  # non-tensor keyword arguments, passed to every chunk as is
    devices: list[torch.device]  # where each cached tensor must go back to
    bounds: list[tuple[int, int]]
    cuda_devices: list[int]
    rng: list = field(default_factory=list)  # per chunk: (CPU state, [CUDA states]) before it ran
    autocast: dict = field(default_factory=dict)  # autocast state of the first pass
    # (name, parameter, its ._version) after the first pass: the weights the embeddings came from
    versions: list = field(default_factory=list)
    state: _EncoderState | None = None  # parameter objects, dtypes and module modes of the first pass
    flushed: bool = False  # its gradient was re-encoded once: a second backward would add it again
    # Filled by the backward of this call's output:
    tensors: tuple[Tensor, ...] = ()
    grad: Tensor | None = None
    grad_stream: object = None

    def chunk_inputs(self, tensors, i: int) -> dict:
        start, end = self.bounds[i]
        chunk = {
            k: t[start:end].to(dev, non_blocking=True) for k, t, dev in zip(self.tensor_keys, tensors, self.devices)
        }
        return chunk | self.static


def _check_chunk_output(out, rows: int, what: str) -> Tensor:
    if not isinstance(out, Tensor):
        raise TypeError(f"encode_fn must return a Tensor, got {type(out).__name__} ({what})")
    if out.dim() != 2 or out.shape[0] != rows:
        raise ValueError(
            f"encode_fn must return [n, d] = [{rows}, d] for a chunk of {rows}, got {tuple(out.shape)} ({what})"
        )
    return out


def _to_host(t: Tensor) -> Tensor:
    if t.device.type != "cuda":
        return t.to("cpu")
    # Pinned, so that the chunk-by-chunk copies back to the device can be asynchronous.
    return torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True).copy_(t)


class _Reencoder:
    """Owns the encoder side of the second pass; shared by a GradCache and its flush node."""

    def __init__(self, encode_fn: Callable[..., Tensor], ddp, progress: bool):
        self.encode_fn = encode_fn
        self.ddp = ddp
        # Where the norm layers whose running statistics the replay must leave alone live:
        # an nn.Module (DDP included) is searched; a plain callable is watched as it runs.
        self.stat_roots = [encode_fn] if isinstance(encode_fn, nn.Module) else None
        self.progress = progress
        self.pending: list[_Call] = []

    def _bar(self, total: int, desc: str):
        from tqdm.auto import tqdm

        return tqdm(total=total, desc=desc, unit="chunk", disable=not self.progress, leave=False)

    def encode_no_grad(self, call: _Call, tensors) -> Tensor:
        """First pass: each chunk without grad, recording its RNG state before it runs."""
        call.autocast = _capture_autocast()
        outs = []
        ran: dict[int, nn.Module] = {}
        watch = _modules_that_run(ran) if self.stat_roots is None else contextlib.nullcontext()
        with self._bar(len(call.bounds), "gradcache encode") as bar, warnings.catch_warnings(), watch:
            # Reentrant checkpointing inside the encoder warns that nothing requires grad: true
            # and intended in this pass, and a warning per chunk would bury real ones.
            warnings.filterwarnings("ignore", "None of the inputs have requires_grad", UserWarning)
            for i in range(len(call.bounds)):
                call.rng.append(_capture_rng(call.cuda_devices))
                out = self.encode_fn(**call.chunk_inputs(tensors, i))
                outs.append(_check_chunk_output(out, call.bounds[i][1] - call.bounds[i][0], f"chunk {i}").detach())
                bar.update()
        if self.stat_roots is not None:
            module = self.encode_fn
            assert isinstance(module, nn.Module)
            named, modules = list(module.named_parameters()), list(module.named_modules())
            source = module.named_parameters
        else:
            ran_modules = list(ran.values())
            named = _parameters_of(ran_modules)
            modules = [(type(m).__name__, m) for m in ran_modules]
            source = lambda: _parameters_of(ran_modules)  # noqa: E731
        call.versions = [(name, p, p._version) for name, p in named]
        call.state = _EncoderState.of(named, modules, lambda: list(source()))
        d = {o.shape[1] for o in outs}
        dtypes = {o.dtype for o in outs}
        if len(d) > 1 or len(dtypes) > 1:
            raise ValueError(
                f"encode_fn returned chunks of different widths or dtypes: {sorted(d)}, {sorted(map(str, dtypes))}"
            )
        return torch.cat(outs)

    def flush(self) -> None:
        """Second pass over every call that delivered a gradient in this backward."""
        calls, self.pending = sorted(self.pending, key=lambda c: c.index), []

        def refuse(message: str):
            for c in calls:  # free the cached inputs and gradients: this backward is over
                c.tensors, c.grad, c.grad_stream = (), None, None
            raise RuntimeError(message)

        for call in calls:  # before re-encoding anything: no partial gradient is accumulated
            if call.flushed:
                refuse(
                    "GradCache: a second backward through the same gc(...) output (retain_graph=True) would "
                    "re-encode it and add the encoder's gradient to .grad again; call gc(...) again for "
                    "another backward, or backward once through a loss that sums both terms"
                )
            changed = _changed(call.versions)
            if changed:
                shown = ", ".join(changed[:3]) + (f" and {len(changed) - 3} more" if len(changed) > 3 else "")
                refuse(
                    f"GradCache: {len(changed)} parameter(s) of encode_fn changed in place between gc(...) "
                    f"and backward() ({shown}), e.g. by optimizer.step() or load_state_dict: the cached "
                    "embeddings come from the old weights, and re-encoding with the new ones would give "
                    "the gradient of neither. Call backward() before changing the parameters."
                )
            other = call.state.changes() if call.state is not None else []
            if other:
                refuse(
                    f"GradCache: encode_fn changed between gc(...) and backward() ({'; '.join(other[:3])}): "
                    "re-encoding would not give the embeddings the loss saw. Call backward() first."
                )
        for call in calls:
            call.flushed = True
        total = sum(len(c.bounds) for c in calls)
        done = 0
        with self._bar(total, "gradcache re-encode") as bar:
            for call in calls:
                tensors, grad, stream = call.tensors, call.grad, call.grad_stream
                call.tensors, call.grad, call.grad_stream = (), None, None  # free as we go
                if stream is not None:  # re-encode after the stream that produced the gradient
                    torch.cuda.current_stream(grad.device).wait_stream(stream)
                for i, (start, end) in enumerate(call.bounds):
                    done += 1
                    last = done == total
                    # DDP arms its reducer in forward: all chunks but the last skip the sync and
                    # accumulate in param.grad; the last one all-reduces that whole sum.
                    sync = contextlib.nullcontext() if last or self.ddp is None else self.ddp.no_sync()
                    with sync, _running_stats_kept(self.stat_roots):
                        with _replayed_rng(call.rng[i], call.cuda_devices), _replayed_autocast(call.autocast):
                            with torch.enable_grad():
                                out = self.encode_fn(**call.chunk_inputs(tensors, i))
                        out = _check_chunk_output(out, end - start, f"re-encoding chunk {i}")
                        if not out.requires_grad:
                            raise RuntimeError("encode_fn's output does not require grad: no parameter to train?")
                        g = grad[start:end]
                        if out.dtype != g.dtype:
                            raise RuntimeError(
                                f"re-encoding gave {out.dtype} but the first pass gave {g.dtype}; "
                                "encode_fn must be deterministic apart from its RNG"
                            )
                        torch.autograd.backward(out, g)  # frees this chunk's activations
                    bar.update()


# --------------------------------------------------------------------------- autograd


class _Flush(torch.autograd.Function):
    """Shared root of every cached output: its backward runs once per backward pass, last."""

    @staticmethod
    def forward(ctx, reencoder: _Reencoder, anchor: Tensor) -> Tensor:
        ctx.reencoder = reencoder
        return anchor.new_empty(0)

    @staticmethod
    def backward(ctx, _grad: Tensor):
        ctx.reencoder.flush()
        return None, None


class _CachedEncode(torch.autograd.Function):
    """``[n, d]`` embeddings from the no-grad pass; backward hands the gradient to the flush."""

    @staticmethod
    def forward(ctx, reencoder: _Reencoder, call: _Call, link: Tensor, *tensors: Tensor) -> Tensor:
        emb = reencoder.encode_no_grad(call, tensors)
        # Saved tensors (not attributes): autograd frees them after backward, refuses a second
        # backward without retain_graph, and detects in-place edits of the inputs meanwhile.
        ctx.save_for_backward(*tensors)
        ctx.reencoder, ctx.call = reencoder, call
        return emb

    @staticmethod
    def backward(ctx, grad: Tensor):
        call = ctx.call
        call.tensors, call.grad = ctx.saved_tensors, grad
        call.grad_stream = torch.cuda.current_stream(grad.device) if grad.is_cuda else None
        ctx.reencoder.pending.append(call)
        return (None, None, grad.new_zeros(0, device="cpu", dtype=torch.float32)) + (None,) * len(call.tensor_keys)


# --------------------------------------------------------------------------- public API


class GradCache:
    """Chunked two-pass encoding with exact gradients (see the module docstring).

    Args:
        encode_fn: ``encode_fn(**chunk_inputs) -> [c, d]`` embeddings of a chunk of ``c``
            rows, any float dtype; typically an ``nn.Module`` such as :class:`HFEncoder`,
            possibly wrapped in ``DistributedDataParallel``. Apart from its RNG (dropout) it
            must be deterministic.
        chunk_size: rows per chunk (the last chunk may be smaller). Peak encoder memory is
            that of one chunk's forward and backward, whatever the batch size.
        chunk_tokens: pack chunks by tokens instead (sentence-transformers'
            ``mini_batch_num_tokens``): each chunk takes consecutive rows while their
            non-padding tokens (``attention_mask`` ``[n, L]`` summed per row, so a call must
            give it) stay within this budget; a longer row is a chunk of its own.
            ``chunk_size`` is then not used. Faster on variable-length data.
        offload_inputs: keep the cached input tensors on the CPU between the forward and
            the backward (copied back chunk by chunk). Saves accelerator memory when the
            caller does not keep its own copy of the inputs alive.
        ddp: the ``DistributedDataParallel`` module that ``encode_fn`` calls, so that all
            re-encoded chunks but the last skip the gradient all-reduce. Found
            automatically when ``encode_fn`` itself is the DDP module.
        progress: show tqdm bars over the chunks of each pass.

    Call ``gc(**inputs)``: every tensor in ``inputs`` shares the leading dimension ``n``
    (e.g. ``input_ids``, ``attention_mask`` ``[n, L]``) and is split into chunks; other
    values are passed to every chunk unchanged. Returns ``[n, d]`` embeddings in the
    encoder's output dtype, attached to autograd when grad is enabled (under
    ``torch.no_grad()`` it is plain chunked inference).

    Example::

        >>> gc = GradCache(HFEncoder(model, pooling="mean"), chunk_size=64)
        >>> a, p = gc(**anchor_batch), gc(**positive_batch)   # [4096, d] each
        >>> infonce_loss(a, p).backward()                     # re-encodes chunk by chunk
        >>> optimizer.step()
    """

    def __init__(
        self,
        encode_fn: Callable[..., Tensor],
        chunk_size: int,
        *,
        chunk_tokens: int | None = None,
        offload_inputs: bool = False,
        ddp: nn.Module | None = None,
        progress: bool = False,
    ):
        if not callable(encode_fn):
            raise TypeError(f"encode_fn must be callable, got {type(encode_fn).__name__}")
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
        if chunk_tokens is not None and (
            isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1
        ):
            raise ValueError(f"chunk_tokens must be a positive int or None, got {chunk_tokens!r}")
        if ddp is None and isinstance(encode_fn, torch.nn.parallel.DistributedDataParallel):
            ddp = encode_fn
        if ddp is not None and not hasattr(ddp, "no_sync"):
            raise TypeError(f"ddp must be a DistributedDataParallel module, got {type(ddp).__name__}")
        self.chunk_size = chunk_size
        self.chunk_tokens = chunk_tokens
        self.offload_inputs = offload_inputs
        self._reencoder = _Reencoder(encode_fn, ddp, progress)
        self._link: Tensor | None = None
        self._calls = 0

    def _flush_link(self) -> Tensor:
        if self._link is None:  # created once, with grad: the one node all outputs share
            with torch.enable_grad():
                self._link = _Flush.apply(self._reencoder, torch.empty(0, dtype=torch.float32, requires_grad=True))
        return self._link

    def _bounds(self, inputs: dict, n: int) -> list[tuple[int, int]]:
        """The chunks' row ranges ``[(begin, end), ...]`` covering the ``n`` rows."""
        if self.chunk_tokens is None:
            return [(s, min(s + self.chunk_size, n)) for s in range(0, n, self.chunk_size)]
        mask = inputs.get("attention_mask")
        if not isinstance(mask, Tensor) or mask.dim() != 2:
            raise ValueError(
                "chunk_tokens packs chunks by the non-padding tokens of attention_mask [n, L]: give "
                "attention_mask, or use chunk_size"
            )
        ends = mask.ne(0).sum(1).cumsum(0).tolist()  # tokens up to each row's end (one host read)
        bounds, begin = [], 0
        while begin < n:
            budget = (ends[begin - 1] if begin else 0) + self.chunk_tokens
            end = max(bisect.bisect_right(ends, budget), begin + 1)  # a row beyond the budget: alone
            bounds.append((begin, end))
            begin = end
        return bounds

    def __call__(self, **inputs) -> Tensor:
        tensor_keys = [k for k, v in inputs.items() if isinstance(v, Tensor)]
        if not tensor_keys:
            raise ValueError("GradCache needs at least one tensor input, e.g. gc(input_ids=..., attention_mask=...)")
        sizes = {k: inputs[k].shape[0] if inputs[k].dim() else None for k in tensor_keys}
        n = sizes[tensor_keys[0]]
        if n is None or any(s != n for s in sizes.values()):
            raise ValueError(f"every tensor input must share the leading dimension n, got {sizes}")
        if n == 0:
            raise ValueError("inputs have n = 0 rows")
        needs_grad = [k for k in tensor_keys if inputs[k].requires_grad]
        if needs_grad:
            raise ValueError(f"inputs {needs_grad} require grad; GradCache only trains encode_fn's parameters")

        # Calls only wait in `pending` between their backward and the flush of the same
        # backward pass; leftovers here come from an aborted backward and must not be replayed.
        self._reencoder.pending.clear()
        tensors = [inputs[k] for k in tensor_keys]
        devices = [t.device for t in tensors]
        if self.offload_inputs:
            tensors = [_to_host(t) for t in tensors]
        cuda_devices = sorted({d.index for d in devices if d.type == "cuda"})
        if torch.cuda.is_initialized():
            cuda_devices = sorted(set(cuda_devices) | {torch.cuda.current_device()})
        call = _Call(
            index=self._calls,
            tensor_keys=tensor_keys,
            static={k: v for k, v in inputs.items() if k not in tensor_keys},
            devices=devices,
            bounds=self._bounds(inputs, n),
            cuda_devices=cuda_devices,
        )
        self._calls += 1
        if not torch.is_grad_enabled():
            return self._reencoder.encode_no_grad(call, tensors)
        return _CachedEncode.apply(self._reencoder, call, self._flush_link(), *tensors)


# --------------------------------------------------------------------------- Hugging Face


class HFEncoder(nn.Module):
    """``encode_fn`` for :class:`GradCache` from any Hugging Face ``AutoModel`` plus pooling.

    Args:
        model: a transformers encoder, e.g. ``AutoModel.from_pretrained(...)``.
        pooling: ``"cls"`` (the model's ``pooler_output``: BERT's Linear + tanh on [CLS]),
            ``"cls_before_pooler"`` (the raw [CLS] state of the last layer), ``"mean"`` (mean
            of the last layer over the attention mask, as sentence-transformers) or
            ``"avg_first_last"`` (SimCSE / SupMPN: masked mean of the average of the first
            and the last transformer layer) or ``"avg_top2"``; see :mod:`fastcl.pooling`. Under DDP with ``find_unused_parameters=False``
            and any pooling but ``"cls"``, load BERT-style models with
            ``add_pooling_layer=False``: their pooler would receive no gradient.

    ``forward(input_ids, attention_mask=None, **model_kwargs)`` with ``[n, L]`` inputs
    returns ``[n, H]`` embeddings in the model's output dtype (no mask: every token counts).
    """

    def __init__(self, model: nn.Module, pooling: str):
        super().__init__()
        check_pooling(pooling)
        self.model = model
        self.pooling = pooling

    def forward(self, input_ids: Tensor | None = None, attention_mask: Tensor | None = None, **model_kwargs) -> Tensor:
        if attention_mask is None:
            ref = input_ids if input_ids is not None else model_kwargs["inputs_embeds"]
            attention_mask = torch.ones(ref.shape[:2], dtype=torch.long, device=ref.device)
        if needs_hidden_states(self.pooling):
            model_kwargs["output_hidden_states"] = True
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, **model_kwargs)
        return pool(outputs, attention_mask, self.pooling)

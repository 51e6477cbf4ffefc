"""What one loss step costs the host: kernel launches, host synchronisations, allocations.

:func:`account` runs a step under a ``TorchDispatchMode`` that sees every ATen op the step
dispatches, and, for the ``triton`` backend, under ``fastcl.kernels``' launch recording. On
CPU tensors with a *dry* recording planned for a GPU (``arch="sm90"``, ``sms=132``) nothing is
launched and the plan is the GPU's, so the counts are what an H100 step would issue; the
ATen ops still run, on the CPU. Structural facts of a step that need no GPU to check (the
tests assert them; docs/triton.md records them):

* **launches**: Triton kernels plus the ATen ops that launch a kernel on a GPU (every op but
  views, metadata and allocations); **strict**: Triton kernels plus every ATen op that is not
  a view, allocations and metadata included (the count issue [polish] asks to keep <= 45);
* **host syncs**: ops that read a device value on the host (``.item()``, ``bool(t)``,
  ``nonzero``, a copy to the CPU);
* **allocations**: op outputs that are new tensors (not views, not in-place), with their sizes.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# ops that read a device value on the host
SYNC_OPS = {"_local_scalar_dense", "is_nonzero", "nonzero", "equal", "item", "masked_select", "unique", "_unique2"}
# ops that launch no kernel: allocation, metadata, aliasing
NO_KERNEL = {
    "empty",
    "empty_strided",
    "new_empty",
    "new_empty_strided",
    "empty_like",
    "detach",
    "alias",
    "lift_fresh",
    "lift_fresh_copy",
    "set_",
    "resize_",
    "_reshape_alias",
    "_unsafe_view",
    "sym_size",
    "sym_stride",
    "sym_numel",
    "sym_storage_offset",
    "is_same_size",
    "result_type",
    "_has_compatible_shallow_copy_type",
    "resolve_conj",
    "resolve_neg",
    "_conj",
    "_neg_view",
    "record_stream",
}
ALLOCATING_FACTORIES = {"empty", "empty_strided", "new_empty", "new_empty_strided", "empty_like"}


@dataclass
class StepAccount:
    """What a step dispatched: ``aten`` (ATen ops launching a kernel, in order), ``no_kernel``
    (the other ATen ops that are not views: allocations, metadata), ``triton`` (kernel names, in
    order), ``syncs`` (op names) and ``allocations`` (``(op, shape, dtype)``)."""

    aten: list[str] = field(default_factory=list)
    no_kernel: list[str] = field(default_factory=list)
    triton: list[str] = field(default_factory=list)
    syncs: list[str] = field(default_factory=list)
    allocations: list[tuple[str, tuple[int, ...], torch.dtype]] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def launches(self) -> int:
        return len(self.aten) + len(self.triton)

    @property
    def strict(self) -> int:
        """Every Triton launch and every non-view ATen op (allocations and metadata too)."""
        return self.launches + len(self.no_kernel)

    def allocated_bytes(self) -> int:
        return sum(_numel(s) * torch.empty((), dtype=dt).element_size() for _, s, dt in self.allocations)

    def summary(self) -> str:
        from collections import Counter

        top = ", ".join(f"{k} x{v}" for k, v in Counter(self.triton + self.aten).most_common())
        rest = ", ".join(f"{k} x{v}" for k, v in Counter(self.no_kernel).most_common())
        return (
            f"{self.launches} launches ({len(self.triton)} Triton, {len(self.aten)} ATen): {top}; "
            f"strictly {self.strict} (non-view ATen ops without a kernel: {rest or 'none'})"
        )


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


class _Dispatch(TorchDispatchMode):
    def __init__(self, acct: StepAccount):
        super().__init__()
        self.acct = acct

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ns, name = func.namespace, func.overloadpacket.__name__
        if ns == "fastcl_triton":
            # run the launcher itself with this mode active, so that the ATen ops it issues
            # (outputs, conversions) are seen too; its kernels are recorded by name
            from fastcl.kernels import lse

            with self:
                return getattr(lse, "_" + name)(*args, **kwargs)
        out = func(*args, **kwargs)
        if ns == "fastcl_triton":
            return out
        if ns != "aten":
            return out
        if name in SYNC_OPS or (name in ("_to_copy", "copy_") and _to_host(func, args, kwargs)):
            self.acct.syncs.append(name)
        if func.is_view:
            return out
        if name in ALLOCATING_FACTORIES:
            self.acct.allocations.append((name, tuple(out.shape), out.dtype))
        if name in NO_KERNEL or name in SYNC_OPS:
            self.acct.no_kernel.append(name)
            return out
        self.acct.aten.append(name)
        if not name.endswith("_") and "out" not in kwargs:  # functional op: new outputs
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    self.acct.allocations.append((name, tuple(t.shape), t.dtype))
        return out


def _to_host(func, args, kwargs) -> bool:
    """A copy from a non-CPU tensor to the CPU (the caller's device is then not the CPU)."""
    src = args[0] if args else None
    dev = kwargs.get("device")
    if func.overloadpacket.__name__ == "copy_" and len(args) > 1:
        return args[0].device.type == "cpu" and args[1].device.type != "cpu"
    return (
        isinstance(src, torch.Tensor)
        and src.device.type != "cpu"
        and dev is not None
        and torch.device(dev).type == "cpu"
    )


@contextlib.contextmanager
def account(dry_arch: str | None = None, sms: int | None = None):
    """Yield a :class:`StepAccount` filled by everything run inside. ``dry_arch``: record the
    Triton launches without launching, planned for that arch and ``sms`` SMs (CPU tensors under
    ``TRITON_INTERPRET=1``); None: launch for real (and record, when the kernels are imported)."""
    acct = StepAccount()
    rec = contextlib.nullcontext([])
    if dry_arch is not None:
        from fastcl.kernels._common import recording

        rec = recording(dry=True, arch=dry_arch, sms=sms)
    start = time.perf_counter()
    with rec as launches, _Dispatch(acct):
        yield acct
    acct.seconds = time.perf_counter() - start
    acct.triton.extend(x.kernel for x in launches)


def host_overhead(loss: str = "supmpn", B: int = 4096, d: int = 768, steps: int = 20) -> dict:
    """Host time of a warm ``triton`` step planned for an H100 with every kernel launch mocked
    (the launchers run, the kernels do not), under ``TRITON_INTERPRET=1`` on CPU tensors:
    fastcl's Python (validation, dispatch, planning, launchers) plus the ATen glue ops, which
    here compute on the CPU (on a GPU they are asynchronous launches of a few us). Not timed:
    Triton's own launch path. ``launches`` is counted in a separate, accounted step."""
    import statistics
    import time

    import fastcl.losses as L
    from benchmarks.harness.cases import make_inputs
    from fastcl.kernels import INTERPRET
    from fastcl.kernels._common import recording

    if not INTERPRET:
        raise RuntimeError("host_overhead runs the triton backend on CPU tensors: set TRITON_INTERPRET=1")
    P, Q = {"supmpn": (5, 5), "infonce": (1, 0), "mnrl": (1, 1)}[loss]
    inputs = make_inputs(loss, B, P, Q, d, "bfloat16", "cpu")
    leaves = [t for t in inputs.values() if t is not None]
    fused = {"supmpn": L.supmpn_loss, "infonce": L.infonce_loss, "mnrl": L.mnrl_loss}[loss]

    def step():
        for t in leaves:
            t.grad = None
        fused(**inputs, temperature=0.05, backend="triton").backward()

    for _ in range(2):  # warm: the second step is the one counted
        with account(dry_arch="sm90", sms=132) as acct:
            step()
    times = []
    with recording(dry=True, arch="sm90", sms=132, record=False):
        for i in range(steps + 2):
            start = time.perf_counter()
            step()
            if i >= 2:
                times.append(time.perf_counter() - start)
    ms = statistics.median(times) * 1e3
    return {
        "loss": loss,
        "B": B,
        "d": d,
        "launches": acct.launches,
        "host_ms": ms,
        "us_per_launch": 1e3 * ms / acct.launches,
    }


if __name__ == "__main__":  # python -m benchmarks.harness.launches (under TRITON_INTERPRET=1)
    for case in ("supmpn", "infonce"):
        r = host_overhead(case, B=4096 if case == "supmpn" else 16384)
        print(
            f"{r['loss']} B={r['B']} d={r['d']}: {r['launches']} launches, host {r['host_ms']:.2f} ms per step "
            f"({r['us_per_launch']:.0f} us per launch, kernels mocked)"
        )

"""Ahead-of-time compilation of every kernel specialisation for sm_80 (A100) and sm_90 (H100).

``python -m fastcl.kernels.aot [--arch sm80,sm90] [--kernel NAME] [--jobs N]`` compiles every
``(specialisation, tuning config)`` pair the launchers can produce (:func:`all_specs`, the one
list; ``lse.py`` builds its launches from the same functions) and
prints one row per pair: registers, spilled bytes, local-memory loads/stores in the PTX,
shared memory against the device limit, and whether the PTX uses tensor-core MMA.

No GPU is needed: ``triton.compile`` with ``GPUTarget("cuda", 80|90, 32)`` runs the whole
pipeline to a cubin; registers and spill bytes come from the ``ptxas -v`` log of that
compile (Triton itself only learns them when a driver loads the binary). Run it in a
process *without* ``TRITON_INTERPRET=1``: the interpreter replaces the jit functions.

Two depths (``frontend_only``): a full compile (PTX, cubin, resources) takes seconds, so
the CI test compiles fully one spec per ``(kernel, dtype class, config, arch)`` (the one
with the most features on: :func:`representatives`) and runs every other specialisation
through the Triton frontend (type checking and code generation to TTIR).

What is compiled: the specialisation Triton picks for 16-byte aligned pointers (fresh torch
allocations) and integer arguments with no divisibility hint (any ``d``); a launch with
``d % 16 == 0`` specialises further (wider loads), which changes registers little.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

from ._common import INTERPRET, ARCHS, Cfg, Spec

# shared memory one block may use (opt-in maximum), bytes
SMEM_LIMIT = {"sm80": 163 * 1024, "sm90": 227 * 1024}
CAPABILITY = {"sm80": 80, "sm90": 90}
# Tensor-core instructions expected in the PTX of a kernel that calls tl.dot on 16-bit or
# tf32 data: mma.sync on sm_80; wgmma (or mma.sync for tiles wgmma cannot take) on sm_90.
MMA_PATTERNS = {"sm80": ("mma.sync",), "sm90": ("wgmma.mma_async", "mma.sync")}


def all_specs() -> list[Spec]:
    """Every specialisation of every launcher (the AOT test's list)."""
    from . import lse

    return lse.specialisations()


def uses_dot(spec: Spec) -> bool:
    """Kernels whose main loop is ``tl.dot`` (must compile to MMA), fp64 excepted (no fp64 MMA path)."""
    return spec.kernel_name in ("_lse_fwd_kernel", "_lse_ds_kernel", "_mm_kernel") and spec.dclass != "64"


@dataclass(frozen=True)
class Result:
    kernel: str
    spec: str
    arch: str
    config: str
    registers: int
    spill_bytes: int  # spill stores + loads reported by the cubin (0: no spills)
    local_ptx: int  # ld.local / st.local instructions in the PTX
    shared: int  # bytes
    shared_limit: int
    mma: str  # the tensor-core instruction found, "" if none
    needs_mma: bool
    error: str = ""

    @property
    def ok(self) -> bool:
        return (not self.error and self.shared <= self.shared_limit
                and (bool(self.mma) or not self.needs_mma))


def _ast_source(spec: Spec, cfg: Cfg):
    import triton
    from triton.compiler import ASTSource

    fn = spec.kernel.fn
    if not isinstance(fn, triton.runtime.jit.JITFunction):
        raise RuntimeError("fastcl.kernels.aot needs compiled Triton: unset TRITON_INTERPRET")
    types = dict(spec.signature)
    constexprs = {**dict(spec.flags), **cfg.kwargs}
    signature = {}
    for name in fn.arg_names:
        if name in types:
            signature[name] = types[name]
        elif name in constexprs:
            signature[name] = "constexpr"
        else:
            raise KeyError(f"{spec.kernel_name}: argument {name} is in neither the spec nor the config")
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
             if types.get(name, "").startswith("*")}
    return ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)


def _ptxas_usage(log: str) -> tuple[int, int]:
    """``(registers, spill store + load bytes)`` from a ``ptxas -v`` log (-1: not found)."""
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return (int(regs.group(1)) if regs else -1), (int(spills.group(1)) + int(spills.group(2)) if spills else -1)


def _compile(spec: Spec, arch: str, cfg: Cfg, frontend_only: bool):
    """``(compiled or None, ptxas log)``: the full pipeline, or only the frontend to TTIR."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget

    target = GPUTarget("cuda", CAPABILITY[arch], 32)
    backend = triton.compiler.make_backend(target)
    options = backend.parse_options({"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
    src = _ast_source(spec, cfg)
    if frontend_only:
        from triton._C.libtriton import ir

        context = ir.context()
        ir.load_dialects(context)
        backend.load_dialects(context)
        src.make_ir(target, options, backend.get_codegen_implementation(options), backend.get_module_map(),
                    context)
        return None, ""
    log = io.StringIO()
    # ptxas always runs with -v; its log is printed only on request, and only when the
    # kernel is not served from Triton's cache
    saved = knobs.nvidia.dump_ptxas_log, knobs.compilation.always_compile
    knobs.nvidia.dump_ptxas_log, knobs.compilation.always_compile = True, True
    try:
        with contextlib.redirect_stdout(log):
            compiled = triton.compile(src, target=target, options=options.__dict__)
    finally:
        knobs.nvidia.dump_ptxas_log, knobs.compilation.always_compile = saved
    return compiled, log.getvalue()


def compile_one(spec: Spec, arch: str, cfg: Cfg, frontend_only: bool = False) -> Result:
    """Compile one pair for one arch; compile errors come back in ``Result.error``."""
    common = dict(kernel=spec.kernel_name, spec=spec.describe(), arch=arch, config=str(cfg),
                  shared_limit=SMEM_LIMIT[arch], needs_mma=uses_dot(spec) and not frontend_only)
    try:
        compiled, log = _compile(spec, arch, cfg, frontend_only)
    except Exception as exc:  # reported per row; the test fails on any
        lines = [x for x in str(exc).strip().splitlines() if x.strip()]
        return Result(**common, registers=-1, spill_bytes=-1, local_ptx=-1, shared=0, mma="",
                      error=f"{type(exc).__name__}: {' | '.join(lines[:3])}"[:400])
    if compiled is None:
        return Result(**common, registers=-1, spill_bytes=-1, local_ptx=-1, shared=0, mma="")
    ptx = compiled.asm["ptx"]
    regs, spills = _ptxas_usage(log)
    local = len(re.findall(r"\b(?:ld|st)\.local\b", ptx))
    mma = next((p for p in MMA_PATTERNS[arch] if p in ptx), "")
    return Result(**common, registers=regs, spill_bytes=spills, local_ptx=local,
                  shared=compiled.metadata.shared, mma=mma)


def _features(spec: Spec) -> int:
    """How much code a spec generates, roughly: flags on plus pointers that are really read."""
    flags = sum(v is True for _, v in spec.flags)
    pointers = sum(t.startswith("*") and t != "*fp32" for _, t in spec.signature)
    return flags + pointers


def representatives(specs: list[Spec] | None = None) -> list[Spec]:
    """One spec per ``(kernel, dtype class)``: the one with the most flags on and typed
    pointers (the most code, so the most registers), preferring 16-bit over fp32 within
    the ``"16"`` class."""
    best: dict[tuple[str, str], Spec] = {}
    for spec in specs if specs is not None else all_specs():
        key = (spec.kernel_name, spec.dclass)
        if key not in best or _features(spec) > _features(best[key]):
            best[key] = spec
    return list(best.values())


def jobs(archs=ARCHS, kernel: str | None = None) -> list[tuple[Spec, str, Cfg]]:
    """Every ``(spec, arch, config)`` to compile."""
    out = []
    for spec in all_specs():
        if kernel and spec.kernel_name != kernel:
            continue
        for arch in archs:
            for cfg in spec.kernel.configs(arch, spec.dclass):
                out.append((spec, arch, cfg))
    return out


def _run_key(key: tuple[str, str, int, bool]) -> Result:
    # worker processes rebuild the job list (Spec holds a jit function: not picklable)
    spec_key, arch, index, frontend_only = key
    spec = next(s for s in all_specs() if s.key == spec_key)
    return compile_one(spec, arch, spec.kernel.configs(arch, spec.dclass)[index], frontend_only)


def job_keys(pairs, frontend_only: bool = False) -> list[tuple[str, str, int, bool]]:
    """Picklable keys of ``(spec, arch, cfg)`` triples."""
    return [(spec.key, arch, spec.kernel.configs(arch, spec.dclass).index(cfg), frontend_only)
            for spec, arch, cfg in pairs]


def run_keys(keys, workers: int = 1, progress: bool = True) -> list[Result]:
    """Run :func:`job_keys` keys, in ``workers`` processes, in order."""
    from tqdm import tqdm

    keys = list(keys)
    bar = tqdm(total=len(keys), desc="triton aot", disable=not progress, file=sys.stderr)
    results = []
    if workers <= 1:
        for k in keys:
            results.append(_run_key(k))
            bar.update()
    else:
        with ProcessPoolExecutor(workers) as pool:
            for r in pool.map(_run_key, keys):
                results.append(r)
                bar.update()
    bar.close()
    return results


def compile_all(archs=ARCHS, kernel: str | None = None, workers: int = 1, progress: bool = True,
                every_spec: bool = False) -> list[Result]:
    """Fully compile every config of :func:`representatives` (or of every spec) for each arch,
    and run every other spec through the frontend; one :class:`Result` each."""
    pairs = jobs(archs, kernel)
    reps = {s.key for s in representatives()}
    full = [p for p in pairs if every_spec or p[0].key in reps]
    rest = [p for p in pairs if not (every_spec or p[0].key in reps) and p[2] == p[0].kernel.configs(p[1], p[0].dclass)[0]]
    return run_keys(job_keys(full) + job_keys(rest, frontend_only=True), workers, progress)


def table(results: list[Result]) -> str:
    """Markdown table of the results."""
    head = "| kernel | specialisation | arch | config | regs | spill B | ld/st.local | smem KiB (limit) | mma | status |"
    rows = [head, "|" + "---|" * 10]
    results = [r for r in results if r.registers >= 0 or r.error]  # frontend-only rows have no facts
    for r in results:
        status = "ok" if r.ok else ("ERROR " + r.error if r.error else "FAIL")
        rows.append(f"| {r.kernel} | {r.spec} | {r.arch} | {r.config} | {r.registers} | {r.spill_bytes} | "
                    f"{r.local_ptx} | {r.shared / 1024:.1f} ({r.shared_limit // 1024}) | {r.mma or '-'} | {status} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fastcl.kernels.aot", description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default=",".join(ARCHS), help="comma list of sm80, sm90")
    parser.add_argument("--kernel", default=None, help="only this kernel (e.g. _lse_fwd_kernel)")
    parser.add_argument("--jobs", type=int, default=1, help="compile in this many processes")
    parser.add_argument("--every-spec", action="store_true",
                        help="fully compile every specialisation x config (hours on a small CPU), "
                             "not only one representative spec per kernel and dtype class")
    args = parser.parse_args(argv)
    if INTERPRET:
        parser.error("unset TRITON_INTERPRET: the interpreter replaces the kernels AOT compiles")
    archs = tuple(a for a in args.arch.split(",") if a)
    unknown = set(archs) - set(ARCHS)
    if unknown:
        parser.error(f"unknown arch {sorted(unknown)}; choose from {ARCHS}")
    results = compile_all(archs, args.kernel, args.jobs, every_spec=args.every_spec)
    print(table(results))
    bad = [r for r in results if not r.ok]
    print(f"\n{len(results)} compiled, {len(bad)} failed", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

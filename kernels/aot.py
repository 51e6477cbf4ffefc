"""Ahead-of-time compilation of the recorded kernel launches for sm_80 (A100) and sm_90 (H100).

``python -m fastcl.kernels.aot [--arch sm80,sm90] [--kernel NAME] [--jobs N]`` prints registers,
spills, local memory, shared memory and MMA use per ``(launch, config)``; no GPU needed (run it
without ``TRITON_INTERPRET=1``). What it compiles and the results: docs/triton.md, "Compile facts".
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import re
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import torch

from fastcl.ops.contract import TAG_ALL

from ._common import ARCHS, INTERPRET, Kernel, Launch, recording

# shared memory one block may use (opt-in maximum), bytes
SMEM_LIMIT = {"sm80": 163 * 1024, "sm90": 227 * 1024}
CAPABILITY = {"sm80": 80, "sm90": 90}
# Tensor-core instructions expected in the PTX of a kernel that calls tl.dot on 16-bit or
# tf32 data: mma.sync on sm_80; wgmma (or mma.sync for tiles wgmma cannot take) on sm_90.
MMA_PATTERNS = {"sm80": ("mma.sync",), "sm90": ("wgmma.mma_async", "mma.sync")}


def all_launches(dtypes=(torch.bfloat16, torch.float16, torch.float32, torch.float64)) -> list[Launch]:
    """Every distinct launch the LSE launchers make (dry runs on CPU tensors, interpreter plan:
    32-column chunks, so a 70-row block gives first, middle and last chunks, with and
    without own positives, and an 8-row block a first-and-last one)."""
    from .lse_bwd import _lse_backward
    from .lse_fwd import _lse_forward
    from .lse_prefixes import _lse_backward_prefixes, _lse_forward_prefixes
    from .own_logits import _own_logits

    out: dict[str, Launch] = {}
    with recording(dry=True, arch="interp") as launches:
        for dt, (sizes, B, P) in itertools.product(dtypes, (((70, 5), 5, 2), ((8, 0), 2, 0))):
            gen = torch.Generator().manual_seed(0)
            anchor, c0, c1 = (torch.randn(n, 8, generator=gen).to(dt) for n in (B, *sizes))
            t0, t1 = (torch.full((n,), TAG_ALL, dtype=torch.int32) for n in sizes)
            t0[3 : 3 + B * P] = torch.arange(B, dtype=torch.int32).repeat_interleave(P)  # own positives from row 3
            tau = torch.tensor(0.1)
            for cosine in (True, False):
                lse, _ = _lse_forward(anchor, c0, c1, t0, t1, tau, cosine, 1e-8)
                for mask in (None, torch.ones(B, P, dtype=torch.bool)) if P else ():
                    _own_logits(anchor, c0, mask, tau, 3, P, cosine, 1e-8)
                d_pos = torch.zeros(B, P) if P else None
                for fp32_ds in (True, False):
                    _lse_backward(
                        anchor, c0, c1, t0, t1, tau, torch.zeros(B), torch.ones(B), d_pos, 3, cosine, 1e-8, fp32_ds
                    )
                # Matryoshka (lse_prefixes): the same chunks, three unsorted prefixes
                dims = [5, 8, 3]
                _lse_forward_prefixes(anchor, c0, c1, t0, t1, tau, dims, cosine, 1e-8)
                d_pos = torch.zeros(3, B, P) if P else None
                ones = torch.ones(3, B)
                _lse_backward_prefixes(anchor, c0, c1, t0, t1, tau, 0 * ones, ones, d_pos, 3, dims, cosine, 1e-8)
    for launch in launches:
        out.setdefault(launch.key, launch)
    return list(out.values())


def configs(launch: Launch, arch: str):
    return Kernel.registry[launch.kernel].configs(arch, launch.dclass)


def uses_dot(launch: Launch) -> bool:
    """Kernels whose main loop is ``tl.dot`` (must compile to MMA), fp64 excepted (no fp64 MMA path)."""
    tiles = ("_lse_fwd_kernel", "_lse_ds_kernel", "_mm_kernel", "_prefix_fwd_kernel", "_prefix_ds_kernel")
    return launch.kernel in tiles and launch.dclass != "64"


@dataclass(frozen=True)
class Result:
    kernel: str
    spec: str
    arch: str
    config: str
    shared_limit: int
    needs_mma: bool
    registers: int = -1  # -1: not compiled to a cubin (frontend only, or an error)
    spill_bytes: int = -1  # spill stores + loads reported by the cubin (0: no spills)
    local_ptx: int = -1  # ld.local / st.local instructions in the PTX
    shared: int = 0  # bytes
    mma: str = ""  # the tensor-core instruction found, "" if none
    error: str = ""
    aligned: bool = False  # compiled with every integer argument a multiple of 16

    @property
    def ok(self) -> bool:
        return not self.error and self.shared <= self.shared_limit and (bool(self.mma) or not self.needs_mma)


def _ast_source(launch: Launch, cfg, aligned: bool = False):
    """The launch's source for ``triton.compile``. Pointers are 16-byte aligned (torch's
    allocations are). ``aligned``: every integer argument too is a multiple of 16, as Triton
    specialises them at run time when they are (d = 768, B and N multiples of 16). Only then
    can the loads be multi-buffered, so registers and shared memory differ: unaligned is the
    worst case for registers, aligned for shared memory."""
    import triton
    from triton.compiler import ASTSource

    fn = Kernel.registry[launch.kernel].fn
    if not isinstance(fn, triton.runtime.jit.JITFunction):
        raise RuntimeError("fastcl.kernels.aot needs compiled Triton: unset TRITON_INTERPRET")
    types = dict(launch.signature)
    constexprs = {**dict(launch.constexprs), **cfg.kwargs}
    for name in fn.arg_names:
        if name not in types and name not in constexprs:
            raise KeyError(f"{launch.kernel}: argument {name} is in neither the launch nor the config")
    signature = {name: types.get(name, "constexpr") for name in fn.arg_names}
    divisible = ("*", "i32", "i64") if aligned else ("*",)
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, name in enumerate(fn.arg_names)
        if types.get(name, "").startswith(divisible)
    }
    return ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)


def _ptxas_usage(log: str) -> tuple[int, int]:
    """``(registers, spill store + load bytes)`` from a ``ptxas -v`` log (-1: not found)."""
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return (int(regs.group(1)) if regs else -1), (int(spills.group(1)) + int(spills.group(2)) if spills else -1)


def _compile(launch: Launch, arch: str, cfg, frontend_only: bool, aligned: bool = False):
    """``(compiled or None, ptxas log)``: the full pipeline, or only the frontend to TTIR."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget

    target = GPUTarget("cuda", CAPABILITY[arch], 32)
    backend = triton.compiler.make_backend(target)
    options = backend.parse_options({"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
    src = _ast_source(launch, cfg, aligned)
    if frontend_only:
        from triton._C.libtriton import ir

        context = ir.context()
        ir.load_dialects(context)
        backend.load_dialects(context)
        module = src.make_ir(
            target, options, backend.get_codegen_implementation(options), backend.get_module_map(), context
        )
        return None, str(module)
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


def compile_one(launch: Launch, arch: str, cfg, frontend_only: bool = False, aligned: bool = False) -> Result:
    """Compile one pair for one arch (``aligned``: see :func:`_ast_source`); compile errors
    come back in ``Result.error``."""
    config = " ".join(f"{k}={v}" for k, v in cfg.kwargs.items()) + f" w{cfg.num_warps} s{cfg.num_stages}"
    common = dict(
        kernel=launch.kernel,
        spec=launch.describe(),
        arch=arch,
        config=config.strip(),
        shared_limit=SMEM_LIMIT[arch],
        needs_mma=uses_dot(launch) and not frontend_only,
        aligned=aligned,
    )
    try:
        compiled, log = _compile(launch, arch, cfg, frontend_only, aligned)
    except Exception as exc:  # reported per row; the test fails on any
        lines = [x for x in str(exc).strip().splitlines() if x.strip()]
        return Result(**common, error=f"{type(exc).__name__}: {' | '.join(lines[:3])}"[:400])
    if compiled is None:
        return Result(**common)
    ptx = compiled.asm["ptx"]
    regs, spills = _ptxas_usage(log)
    local = len(re.findall(r"\b(?:ld|st)\.local\b", ptx))
    mma = next((p for p in MMA_PATTERNS[arch] if p in ptx), "")
    return Result(
        **common, registers=regs, spill_bytes=spills, local_ptx=local, shared=compiled.metadata.shared, mma=mma
    )


def ttir(launch: Launch, arch: str) -> str:
    """The Triton IR of a launch (first config), for checks on the generated arithmetic."""
    return _compile(launch, arch, configs(launch, arch)[0], frontend_only=True)[1]


def _features(launch: Launch) -> int:
    """How much code a launch generates, roughly: flags on plus pointers that are really read."""
    flags = sum(v is True for _, v in launch.constexprs)
    pointers = sum(t.startswith("*") and t != "*fp32" for _, t in launch.signature)
    return flags + pointers


def representatives(launches: list[Launch] | None = None) -> list[Launch]:
    """One launch per ``(kernel, dtype class)``: the one with the most flags on and typed
    pointers (the most code, so the most registers)."""
    best: dict[tuple[str, str], Launch] = {}
    for launch in launches if launches is not None else all_launches():
        key = (launch.kernel, launch.dclass)
        if key not in best or _features(launch) > _features(best[key]):
            best[key] = launch
    return list(best.values())


def _run_job(job) -> Result:
    launch, arch, index, frontend_only, aligned = job
    return compile_one(launch, arch, configs(launch, arch)[index], frontend_only, aligned)


def compile_all(
    archs=ARCHS,
    kernel: str | None = None,
    workers: int = 1,
    progress: bool = True,
    every_spec: bool = False,
    alignments=(False, True),
) -> list[Result]:
    """Fully compile every config of :func:`representatives` (or of every launch) for each
    arch and each of ``alignments`` (:func:`_ast_source`), and run every other launch's first
    config through the frontend, in ``workers`` processes; one :class:`Result` each, in order."""
    from tqdm import tqdm

    launches = all_launches()
    full = set(launches if every_spec else representatives(launches))
    todo = [
        (launch, arch, i, launch not in full, aligned)
        for launch in launches
        if not kernel or launch.kernel == kernel
        for arch in archs
        for i in range(len(configs(launch, arch)) if launch in full else 1)
        for aligned in (alignments if launch in full else alignments[:1])
    ]
    with ProcessPoolExecutor(workers) if workers > 1 else contextlib.nullcontext() as pool:
        results = pool.map(_run_job, todo) if pool else map(_run_job, todo)
        return list(tqdm(results, total=len(todo), desc="triton aot", disable=not progress, file=sys.stderr))


def table(results: list[Result]) -> str:
    """Markdown table of the results."""
    head = "| kernel | specialisation | arch | sizes | config | regs | spill B | ld/st.local | smem KiB (limit) | mma | status |"
    rows = [head, "|" + "---|" * 11]
    results = [r for r in results if r.registers >= 0 or r.error]  # frontend-only rows have no facts
    for r in results:
        status = "ok" if r.ok else ("ERROR " + r.error if r.error else "FAIL")
        rows.append(
            f"| {r.kernel} | {r.spec} | {r.arch} | {'x16' if r.aligned else 'any'} | {r.config} | {r.registers} | "
            f"{r.spill_bytes} | "
            f"{r.local_ptx} | {r.shared / 1024:.1f} ({r.shared_limit // 1024}) | {r.mma or '-'} | {status} |"
        )
    return "\n".join(rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fastcl.kernels.aot", description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default=",".join(ARCHS), help="comma list of sm80, sm90")
    parser.add_argument("--kernel", default=None, help="only this kernel (e.g. _lse_fwd_kernel)")
    parser.add_argument("--jobs", type=int, default=1, help="compile in this many processes")
    every = "fully compile every specialisation, not one per kernel and dtype class (hours on a small CPU)"
    parser.add_argument("--every-spec", action="store_true", help=every)
    sizes = "integer arguments of any value (worst case for registers), multiples of 16 (x16: pipelined loads, "
    parser.add_argument("--sizes", choices=("any", "x16", "both"), default="both", help=sizes + "most shared memory)")
    args = parser.parse_args(argv)
    if INTERPRET:
        parser.error("unset TRITON_INTERPRET: the interpreter replaces the kernels AOT compiles")
    archs = tuple(a for a in args.arch.split(",") if a)
    unknown = set(archs) - set(ARCHS)
    if unknown:
        parser.error(f"unknown arch {sorted(unknown)}; choose from {ARCHS}")
    alignments = {"any": (False,), "x16": (True,), "both": (False, True)}[args.sizes]
    results = compile_all(archs, args.kernel, args.jobs, every_spec=args.every_spec, alignments=alignments)
    print(table(results))
    bad = [r for r in results if not r.ok]
    print(f"\n{len(results)} compiled, {len(bad)} failed", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

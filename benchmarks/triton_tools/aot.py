"""Ahead-of-time compilation of the recorded kernel launches for sm_80 (A100) and sm_90 (H100).

``python -m benchmarks.triton_tools.aot [--arch sm80,sm90] [--kernel NAME] [--jobs N] [--json FILE]`` prints
registers, spills, local memory, shared memory, pipelining, the CTAs per SM the registers and
shared memory allow, and the tensor-core instruction of every ``(launch, config)``; no GPU
needed (run it without ``TRITON_INTERPRET=1``). The launches are exactly what the launchers
make (dry runs of ``kernels/lse.py`` planned for each arch, recorded by
``_common.recording``), each with the config the table gives it. Results: docs/triton.md,
"Compile facts".
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import re
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass

import torch

from fastcl.kernels._common import ARCHS, INTERPRET, Kernel, Launch, recording
from fastcl.ops.contract import TAG_ALL, TAG_PADDING

# shared memory one block may use (opt-in maximum) and registers per SM
SMEM_LIMIT = {"sm80": 163 * 1024, "sm90": 227 * 1024}
REGISTERS = 65536
CAPABILITY = {"sm80": 80, "sm90": 90}
# Tensor-core instructions expected in the PTX of a kernel that calls tl.dot on 16-bit or
# tf32 data: mma.sync on sm_80; warpgroup MMA on sm_90 for the 16-bit tile kernels.
MMA_PATTERNS = {"sm80": ("mma.sync",), "sm90": ("wgmma.mma_async", "mma.sync")}
TILE_KERNELS = ("_lse_fwd_kernel", "_lse_ds_kernel", "_mm_kernel")
PLAN_SMS = {"sm80": 108, "sm90": 132, "interp": 3}


def _problem(dt, B, sizes, d, P, gen):
    anchor, c0, c1 = (torch.randn(n, d, generator=gen).to(dt) for n in (B, *sizes))
    t0, t1 = (torch.full((n,), TAG_ALL, dtype=torch.int32) for n in sizes)
    if P:
        t0[3 : 3 + B * P] = torch.arange(B, dtype=torch.int32).repeat_interleave(P)  # own positives from row 3
        t0[4] = TAG_PADDING
    return anchor, c0, c1, t0, t1


def dry_runs(arch: str, dtypes=(torch.bfloat16, torch.float16, torch.float32, torch.float64)) -> list[Launch]:
    """Every distinct launch the launchers make when planning for ``arch`` (dry runs on CPU
    tensors: nothing is launched). The shapes reach every flag value: ``d`` 40 (a masked ``k``
    edge) and 768, anchors 256 and 300 (whole and partial GEMM ``k`` steps), several dS
    chunks with and without own positives, both similarities, every head option, and
    Matryoshka prefixes."""
    from fastcl.kernels import lse

    wide = arch != "interp"
    out: dict[tuple, Launch] = {}
    gen = torch.Generator().manual_seed(0)
    # (a short first block then a long one: a first dS chunk with a partial k step)
    shapes = [(256, (4096 + 700, 300), 2), (300, (700, 0), 1), (300, (700, 2500), 1), (256, (4096, 2048), 2)]
    if not wide:
        shapes = [(5, (70, 5), 2), (8, (8, 0), 0), (5, (13, 36), 2)]
    with recording(dry=True, arch=arch, sms=PLAN_SMS[arch]) as launches:
        for dt, (B, sizes, P), d, cosine in itertools.product(
            dtypes, shapes, (40, 768) if wide else (8, 40), (True, False)
        ):
            anchor, c0, c1, t0, t1 = _problem(dt, B, sizes, d, P, gen)
            tau = torch.tensor(0.1)
            lse_, _ = lse._lse_forward(anchor, c0, c1, t0, t1, tau, cosine, 1e-8)
            d_pos = torch.zeros(B, P) if P else None
            for fp32_ds in (True, False):
                lse._lse_backward(
                    anchor, c0, c1, t0, t1, tau, lse_, torch.ones(B), d_pos, cosine, 1e-8, fp32_ds, pos_offset=3
                )
            if P:
                w = torch.full((B,), 1.0 / B)
                mask = torch.ones(B, P, dtype=torch.bool)
                extra = torch.zeros(B)
                for kind, given, m, x, rows in (
                    ("softplus", False, None, None, False),
                    ("cross_entropy", True, mask, extra, True),
                ):
                    pos = torch.zeros(B, P) if given else None
                    _, *saved = lse._head_forward(
                        anchor, c0, c1, t0, t1, tau, cosine, 1e-8, kind, 3, P, pos, m, x, w, rows
                    )
                    go = torch.ones(B if rows else (), dtype=dt)
                    lse._head_backward(
                        anchor, c0, c1, t0, t1, tau, saved[4], saved[0], saved[1], saved[2], saved[3], w, go, 3, not given,
                        cosine, dt == torch.float16, not given,
                    )  # fmt: skip
            dims = [16, d, 8] if wide else [5, 8, 3]
            lse._lse_forward(anchor, c0, c1, t0, t1, tau, cosine, 1e-8, dims)
            ones = torch.ones(3, B)
            dp = torch.zeros(3, B, P) if P else None
            lse._lse_backward(anchor, c0, c1, t0, t1, tau, 0 * ones, ones, dp, cosine, 1e-8, True, dims, pos_offset=3)
            _extension_runs(lse, dt, (anchor, c0, c1, t0, t1), P, d, dims, cosine, wide, gen)
    for launch in launches:
        out.setdefault((launch.key, launch.config), launch)
    return list(out.values())


def _extension_runs(lse, dt, inputs, P, d, dims, cosine, wide, gen) -> None:
    """The primitive's extensions (docs/triton.md, "Extensions"): the sigmoid reduction, the
    self and the guide filter (guide width off every tile edge; an fp32 guide beside 16-bit
    inputs), alone and together, plain and Matryoshka, and the fused head with a filter."""
    anchor, c0, c1, t0, t1 = inputs
    B = anchor.shape[0]
    tau, cd = torch.tensor(0.1), torch.float64 if dt == torch.float64 else torch.float32
    g = 40 if d == 40 else 384 if wide else 24
    gdt = torch.float32 if dt in (torch.bfloat16, torch.float16) and cosine else dt
    guide = dict(zip(("guide_anchor", "guide_block0", "guide_block1"),
                     (torch.randn(n, g, generator=gen).to(gdt) for n in (B, *(c.shape[0] for c in (c0, c1))))))  # fmt: skip
    thr = torch.zeros(B, dtype=cd)
    bias = dict(bias=torch.tensor(-1.0, dtype=cd))
    cases = [bias, dict(threshold=thr), dict(threshold=thr, **bias), dict(threshold=thr, **guide),
             dict(threshold=thr, **guide, **bias)]  # fmt: skip
    d_pos = torch.zeros(B, P) if P else None
    for ext in cases:
        lse._lse_forward(anchor, c0, c1, t0, t1, tau, cosine, 1e-8, **ext, pos_offset=3, pos_count=P)
        dp = None if "bias" in ext else d_pos
        for fp32_ds in (True, False):
            lse._lse_backward(
                anchor, c0, c1, t0, t1, tau, torch.zeros(B), torch.ones(B), dp, cosine, 1e-8, fp32_ds, **ext,
                pos_offset=3, pos_count=P,
            )  # fmt: skip
        self_filter = "threshold" in ext and "guide_anchor" not in ext  # one threshold row per prefix
        pext = dict(ext, threshold=torch.zeros(len(dims), B, dtype=cd)) if self_filter else ext
        lse._lse_forward(anchor, c0, c1, t0, t1, tau, cosine, 1e-8, dims, **pext, pos_offset=3, pos_count=P)
        ones = torch.ones(len(dims), B)
        dp = None if "bias" in ext or not P else torch.zeros(len(dims), B, P)
        lse._lse_backward(
            anchor, c0, c1, t0, t1, tau, 0 * ones, ones, dp, cosine, 1e-8, True, dims, **pext, pos_offset=3, pos_count=P
        )
        if P and "bias" not in ext:  # the fused head with a filter (GIST)
            w = torch.full((B,), 1.0 / B)
            _, *saved = lse._head_forward(
                anchor, c0, c1, t0, t1, tau, cosine, 1e-8, "softplus", 3, P, None, None, None, w, False, **ext
            )
            lse._head_backward(
                anchor, c0, c1, t0, t1, tau, saved[4], saved[0], saved[1], saved[2], saved[3], w,
                torch.ones((), dtype=dt), 3, True, cosine, dt == torch.float16, True, **ext,
            )  # fmt: skip


def uses_dot(launch: Launch) -> bool:
    """Kernels whose main loop is ``tl.dot`` (must compile to MMA), fp64 excepted (no fp64 MMA path)."""
    return launch.kernel in TILE_KERNELS and launch.dclass != "64"


@dataclass(frozen=True)
class Result:
    kernel: str
    spec: str
    arch: str
    config: str
    shared_limit: int
    needs_mma: bool
    num_warps: int = 4
    num_stages: int = 1
    occupancy: int = 1  # programs per SM the launcher sizes its grid for
    registers: int = -1  # -1: not compiled to a cubin (frontend only, or an error)
    spill_bytes: int = -1  # spill stores + loads reported by ptxas (0: no spills)
    local_ptx: int = -1  # ld.local / st.local instructions in the PTX
    shared: int = 0  # bytes
    operand_bytes: int = 0  # one stage of the main loop's operand tiles (16-bit: bytes per element 2)
    mma: str = ""  # the tensor-core instruction found, "" if none
    error: str = ""
    aligned: bool = False  # compiled with every integer argument a multiple of 16
    triton: str = ""

    @property
    def ctas_per_sm(self) -> int:
        """Programs per SM the registers and shared memory allow (0: unknown)."""
        if self.registers <= 0:
            return 0
        by_regs = REGISTERS // (max(self.registers, 1) * 32 * self.num_warps)
        by_smem = self.shared_limit // self.shared if self.shared else 64
        return min(by_regs, by_smem)

    @property
    def buffers(self) -> float:
        """Shared memory over one stage of operand tiles: >= 2 means the loads are multi-buffered."""
        return self.shared / self.operand_bytes if self.operand_bytes else 0.0

    @property
    def ok(self) -> bool:
        return (
            not self.error
            and self.shared <= self.shared_limit
            and (bool(self.mma) or not self.needs_mma)
            and self.spill_bytes <= 0
            and self.local_ptx <= 0
        )


def _ast_source(launch: Launch, aligned: bool = False):
    """The launch's source for ``triton.compile``. Pointers are 16-byte aligned (torch's
    allocations are) and so are the feature width ``d`` and the row strides (a multiple of 16
    features, as 384, 768 and 1024 are: Triton specialises integer arguments on that at run
    time, and only then can row loads be vectorised and multi-buffered). ``aligned``: the row
    counts too (B and N multiples of 16, the benchmark's shapes); unaligned row counts are
    the case of an odd batch."""
    import triton
    from triton.compiler import ASTSource

    fn = Kernel.registry[launch.kernel].fn
    if not isinstance(fn, triton.runtime.jit.JITFunction):
        raise RuntimeError("benchmarks.triton_tools.aot needs compiled Triton: unset TRITON_INTERPRET")
    types = dict(launch.signature)
    constexprs = {**dict(launch.constexprs), **launch.config.kwargs}
    for name in fn.arg_names:
        if name not in types and name not in constexprs:
            raise KeyError(f"{launch.kernel}: argument {name} is in neither the launch nor the config")
    signature = {name: types.get(name, "constexpr") for name in fn.arg_names}

    def divisible(name: str) -> bool:
        t = types.get(name, "")
        return t.startswith("*") or (t in ("i32", "i64") and (aligned or name == "d" or name.startswith("stride")))

    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names) if divisible(name)}
    return ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)


def _ptxas_usage(log: str) -> tuple[int, int]:
    """``(registers, spill store + load bytes)`` from a ``ptxas -v`` log (-1: not found)."""
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return (int(regs.group(1)) if regs else -1), (int(spills.group(1)) + int(spills.group(2)) if spills else -1)


def _compile(launch: Launch, arch: str, frontend_only: bool, aligned: bool = False):
    """``(compiled or None, ptxas log or TTIR)``: the full pipeline, or only the frontend."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget

    cfg = launch.config
    target = GPUTarget("cuda", CAPABILITY[arch], 32)
    backend = triton.compiler.make_backend(target)
    options = backend.parse_options({"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
    src = _ast_source(launch, aligned)
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


def _operand_bytes(launch: Launch) -> int:
    k = launch.config.kwargs
    if "BK" not in k:
        return 0
    elt = {"16": 2, "32": 4, "64": 8}[launch.dclass]
    return (k["BM"] + k["BN"]) * k["BK"] * elt


def compile_one(launch: Launch, arch: str, frontend_only: bool = False, aligned: bool = False) -> Result:
    """Compile one launch for ``arch`` with its config; compile errors come back in ``Result.error``."""
    import triton

    cfg = launch.config
    common = dict(
        kernel=launch.kernel,
        spec=launch.describe(),
        arch=arch,
        config=cfg.describe(),
        shared_limit=SMEM_LIMIT[arch],
        needs_mma=uses_dot(launch) and not frontend_only,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        occupancy=cfg.occupancy,
        operand_bytes=_operand_bytes(launch),
        aligned=aligned,
        triton=triton.__version__,
    )
    try:
        compiled, log = _compile(launch, arch, frontend_only, aligned)
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
    """The Triton IR of a launch, for checks on the generated arithmetic."""
    return _compile(launch, arch, frontend_only=True)[1]


def _features(launch: Launch) -> int:
    """How much code a launch generates, roughly: flags on plus pointers that are really read."""
    flags = sum(v is True or (name == "FILTER" and v > 0) for name, v in launch.constexprs)
    pointers = sum(t.startswith("*") and t != "*fp32" for _, t in launch.signature)
    return flags + pointers


# flags that change a kernel's main loop (its pipelining), not only its epilogue: each
# value gets its own representative (PREFIXES: the Matryoshka segment loop, against the
# plain one-pass loop)
LOOP_FLAGS = ("X_T", "SPLIT_X", "PAD_K", "Y_KSCALE", "SCALE_ON_LOAD", "PREFIXES")


def extension(launch: Launch) -> str:
    """Which of the primitive's forms a launch computes: ``plain``, or its extensions' flags
    (``FILTER=1 SIGMOID=True``; the row pass's clean copies, the head's poison). Each form has
    its own representatives: the extensions' epilogues differ in registers more than their
    flag counts tell, and the plain kernels' facts must not hide behind an extension's."""
    flags = dict(launch.constexprs)
    on = [f"{k}={flags[k]}" for k in ("FILTER", "SIGMOID", "CLEAN", "POISONED") if flags.get(k)]
    return " ".join(on) or "plain"


def representatives(launches: list[Launch]) -> list[Launch]:
    """One launch per ``(kernel, dtype class, config, main-loop flags, extension)``: the one with
    the most flags on and typed pointers (the most code, so the most registers)."""
    best: dict[tuple, Launch] = {}
    for launch in launches:
        flags = dict(launch.constexprs)
        key = (launch.kernel, launch.dclass, launch.config, tuple(flags.get(f) for f in LOOP_FLAGS), extension(launch))
        if key not in best or _features(launch) > _features(best[key]):
            best[key] = launch
    return list(best.values())


def _run_job(job) -> Result:
    launch, arch, frontend_only, aligned = job
    return compile_one(launch, arch, frontend_only, aligned)


def compile_all(archs=ARCHS, kernel: str | None = None, workers: int = 1, progress: bool = True,
                every_spec: bool = False, alignments=(False, True), dtypes=None) -> list[Result]:  # fmt: skip
    """Fully compile :func:`representatives` (or every launch) of each arch for each of
    ``alignments`` (:func:`_ast_source`) and run every other launch through the frontend,
    in ``workers`` processes; one :class:`Result` each, in order."""
    from tqdm import tqdm

    todo = []
    for arch in archs:
        launches = dry_runs(arch, **({"dtypes": dtypes} if dtypes else {}))
        full = set(launches if every_spec else representatives(launches))
        todo += [
            (launch, arch, launch not in full, aligned)
            for launch in launches
            if not kernel or launch.kernel == kernel
            for aligned in (alignments if launch in full else alignments[:1])
        ]
    with ProcessPoolExecutor(workers) if workers > 1 else contextlib.nullcontext() as pool:
        results = pool.map(_run_job, todo) if pool else map(_run_job, todo)
        return list(tqdm(results, total=len(todo), desc="triton aot", disable=not progress, file=sys.stderr))


def table(results: list[Result]) -> str:
    """Markdown table of the fully compiled results."""
    head = (
        "| kernel | specialisation | arch | sizes | config | regs | spill B | ld/st.local | smem KiB (limit) "
        "| stages in smem | CTAs/SM | mma | status |"
    )
    rows = [head, "|" + "---|" * 13]
    for r in (r for r in results if r.registers >= 0 or r.error):
        status = "ok" if r.ok else ("ERROR " + r.error if r.error else "FAIL")
        rows.append(
            f"| {r.kernel} | {r.spec} | {r.arch} | {'x16' if r.aligned else 'any'} | {r.config} | {r.registers} | "
            f"{r.spill_bytes} | {r.local_ptx} | {r.shared / 1024:.1f} ({r.shared_limit // 1024}) | "
            f"{r.buffers:.1f} | {r.ctas_per_sm} | {r.mma or '-'} | {status} |"
        )
    return "\n".join(rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.triton_tools.aot", description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default=",".join(ARCHS), help="comma list of sm80, sm90")
    parser.add_argument("--kernel", default=None, help="only this kernel (e.g. _lse_fwd_kernel)")
    parser.add_argument("--jobs", type=int, default=1, help="compile in this many processes")
    parser.add_argument("--dtypes", default=None, help="comma list of bfloat16,float16,float32,float64 (default: all)")
    every = "fully compile every specialisation, not one per kernel, dtype class and config"
    parser.add_argument("--every-spec", action="store_true", help=every)
    sizes = "integer arguments of any value (worst case for registers), multiples of 16 (x16: pipelined loads, "
    parser.add_argument("--sizes", choices=("any", "x16", "both"), default="both", help=sizes + "most shared memory)")
    parser.add_argument("--json", default=None, help="also write the results as JSON to this file")
    args = parser.parse_args(argv)
    if INTERPRET:
        parser.error("unset TRITON_INTERPRET: the interpreter replaces the kernels AOT compiles")
    archs = tuple(a for a in args.arch.split(",") if a)
    unknown = set(archs) - set(ARCHS)
    if unknown:
        parser.error(f"unknown arch {sorted(unknown)}; choose from {ARCHS}")
    dtypes = tuple(getattr(torch, x) for x in args.dtypes.split(",")) if args.dtypes else None
    alignments = {"any": (False,), "x16": (True,), "both": (False, True)}[args.sizes]
    results = compile_all(
        archs, args.kernel, args.jobs, every_spec=args.every_spec, alignments=alignments, dtypes=dtypes
    )
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                [asdict(r) | {"ctas_per_sm": r.ctas_per_sm, "buffers": r.buffers, "ok": r.ok} for r in results], f
            )
    bad = [r for r in results if not r.ok and (r.registers >= 0 or r.error)]
    print(f"\n{len(results)} compiled, {len(bad)} failed", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

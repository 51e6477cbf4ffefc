#!/usr/bin/env bash
# Everything the GPU-speed work asks of a lent GPU, in one call of the device tool (~6 min).
#
#   OUT=/path scripts/gpu_lease.sh                  # on the GPU machine (the device tool sets $OUT)
#   DRY_RUN=1 OUT=/tmp/lease scripts/gpu_lease.sh   # the same steps on the CPU, tiny sizes
#
# Carried with the call (ignored by git; scripts/gpu_data.sh makes them):
#   .whl/  wheels the GPU image lacks (datasets, dill, multiprocess, pytorch-metric-learning,
#          inf-cl, cut-cross-entropy, liger-kernel, open-clip-torch, siglip-kernel)
# Steps, each under its own time limit, all together under DEADLINE seconds (default 390: a
# rerun still fits 15 minutes of device time with the machine's start), logs straight into
# $OUT (what was written comes back even when the call is cut off; at most 8 files):
#   1. install; fastcl.info                                           -> checks.txt
#   2. the GradCache CUDA test that once died of SIGSEGV, alone (3x), under gdb if it
#      crashes; CUDA-graph capture; the not-slow CUDA tests            -> checks.txt
#   3. tune the config table on this card (<= 8 configs per tile role) -> measure.txt, tuned.json
#   4. each kernel against cuBLAS at its GEMM shape, eager and graphed step -> measure.txt, kernels.json
#   5. the headline cases, every implementation interleaved (>= 10 rounds): fastcl triton (eager,
#      CUDA graph, reduce-overhead), eager, compile, Inf-CL, cut-cross-entropy, Liger, the
#      floor; and the image-text rows, CLIP and SigLIP at B = 65536 bf16: open_clip's loss
#      (eager), torch.compile of it, fastcl triton, Inf-CL (CLIP), siglip-kernel (SigLIP; a
#      skip with the reason where its wheel does not install)     -> bench.json, bench.txt
#   6. where the step spends its time (profile); correctness at B = 2048 -> measure.txt, correctness.json
#   7. the ring's per-block primitive against one call (W = 8 simulated)  -> measure.txt
#   8. the primitive's extensions: a SigLIP-shaped sigmoid loss (B = 16384, d = 768, bf16) and a
#      GIST-filtered SupMPN (B = 4096, fp32 guide of width 384), triton against torch
#                                                                      -> measure.txt, extensions.json
# PARTS picks the steps (default "checks tune kernels bench profile correctness ring extensions");
# T_* are their time limits.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:?set OUT}
mkdir -p "$OUT"
DRY=${DRY_RUN:-0}
# the GPU machine's own Python; a rehearsal here takes the project's .venv when there is one
if [[ $DRY == 1 && -z ${PYTHON:-} && -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=${PYTHON:-python3}; fi
T0=$(date +%s)
say() { echo "[$(($(date +%s) - T0)) s] $*"; }
# a step's time limit: its own (T_*), cut to what is left before DEADLINE. A rehearsal on a
# shared 2-core machine checks the plumbing, not the lease's clock: its limits are 4x as long.
if [[ $DRY == 1 ]]; then STRETCH=${STRETCH:-4}; else STRETCH=1; fi
DEADLINE=${DEADLINE:-$((390 * STRETCH))}
lim() {
  local want=$(($1 * STRETCH)) left=$((DEADLINE - ($(date +%s) - T0)))
  echo $((left < want ? (left > 5 ? left : 5) : want))
}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TQDM_DISABLE=1
# the harness (benchmarks.harness) and the Triton tools (benchmarks.triton_tools) import from the
# repository root, wherever a step's process starts
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
CHECKS=$OUT/checks.txt
MEASURE=$OUT/measure.txt

say "setup"
{
  if [[ $DRY != 1 ]]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    "$PY" -m pip install -q --no-deps --no-build-isolation -e . || "$PY" -m pip install -q --no-deps --no-build-isolation .
    nvidia-smi
  fi
} >"$CHECKS" 2>&1
[[ $DRY != 1 ]] && export PYTHONPATH=$PYTHONPATH:/tmp/site
"$PY" -m fastcl.info >>"$CHECKS" 2>&1
say "setup done"

PARTS=${PARTS:-checks tune kernels bench profile correctness ring extensions}
has() { [[ " $PARTS " == *" $1 "* ]]; }
if [[ $DRY == 1 ]]; then
  DEV=cpu SCALE=0.0078125 B=64 BI=128 D=32 SMOKE=(--B 64 --d 32)
  # the image-text rows at the grid's smallest CPU case; the CUDA-only peers rehearse their skips
  BENCH_K="cpu-infonce-B1024 or cpu-clip-B4096-P1-Q0-d512 or cpu-siglip-B4096-P1-Q0-d512"
  IMPLS=eager,torch,inf-cl,siglip-kernel
else
  DEV=cuda SCALE=0.5 B=4096 BI=16384 D=768 SMOKE=()
  BENCH_K="bfloat16 and (supmpn-B4096-P5-Q5-d768 or infonce-B16384-P1-Q0-d768 or clip-B65536-P1-Q0-d768 or siglip-B65536-P1-Q0-d768)"
  IMPLS=${IMPLS:-eager,compile,triton,triton-cudagraph,triton-graphs,inf-cl,cce,liger-flce,torch-lce,siglip-kernel}
fi

if has checks; then
  say "checks"
  {
    # a worker died of SIGSEGV in this test on the H100 (2026-11-27), inside the own-logits
    # launcher that the fused head replaced: alone and repeated, faulthandler on
    for i in 1 2 3; do
      FASTCL_TEST_DEVICE=$DEV timeout -k 5 $(lim 40) "$PY" -X faulthandler -m pytest tests/train/test_gradcache_cuda.py \
        -q -p no:cacheprovider -rfE
      rc=$?
      echo "gradcache cuda run $i: exit $rc"
      if ((rc > 128)) && command -v gdb >/dev/null; then
        FASTCL_TEST_DEVICE=$DEV timeout -k 5 $(lim 90) gdb -q -batch -ex run -ex bt -ex "info threads" \
          --args "$PY" -m pytest tests/train/test_gradcache_cuda.py -q -p no:cacheprovider
        break
      fi
    done
    timeout -k 5 $(lim 60) "$PY" -m pytest tests/ops/test_cuda_graphs.py -q -p no:cacheprovider -rfE
    echo "cuda graphs: exit $?"
    FASTCL_TEST_DEVICE=$DEV FASTCL_TEST_BACKENDS=torch,triton FASTCL_REQUIRE_BACKENDS=$([[ $DEV == cuda ]] && echo triton) \
      timeout -s INT -k 10 $(lim ${T_TESTS:-70}) "$PY" -m pytest tests/losses tests/ops/test_backend_matrix.py \
      -m "not slow" -q -x -p no:cacheprovider ${WORKERS:+-n $WORKERS} -rfE 2>&1 | tail -n 25
    echo "tests: exit ${PIPESTATUS[0]}"
  } >>"$CHECKS" 2>&1
  say "checks: $(grep -E '^(gradcache cuda run [0-9]+|cuda graphs|tests): exit' "$CHECKS" | tr '\n' ' ')"
fi

if has tune && [[ $DEV == cuda ]]; then
  say "tune"
  timeout -s INT -k 10 $(lim ${T_TUNE:-100}) "$PY" -m benchmarks.triton_tools.tune --B $B --d $D --write --out "$OUT/tuned.json" \
    >>"$MEASURE" 2>&1
  say "tune: exit $?"
  [[ -s $OUT/tuned.json ]] && export FASTCL_TRITON_TABLE=$OUT/tuned.json
fi

if has kernels && [[ $DEV == cuda ]]; then
  say "kernels vs cuBLAS"
  {
    timeout -s INT -k 10 $(lim ${T_KERNELS:-40}) "$PY" scripts/gpu_kernels.py --B $B --d $D --json "$OUT/kernels.json"
    timeout -s INT -k 10 $(lim 25) "$PY" scripts/gpu_kernels.py --loss infonce --B $BI --P 1 --Q 0 --d $D
  } >>"$MEASURE" 2>&1
  say "kernels: exit $?"
fi

if has bench; then
  say "benchmark"
  FASTCL_BENCH_IMPLS=$IMPLS FASTCL_BENCH_BUDGET_S=${BUDGET:-1.0} \
    timeout -s INT -k 15 $(lim ${T_BENCH:-210}) "$PY" -m pytest benchmarks/bench_losses.py --benchmark-only -k "$BENCH_K" \
    --bench-min-rounds ${ROUNDS:-10} -p no:cacheprovider --benchmark-json "$OUT/bench.json" >"$OUT/bench.txt" 2>&1
  say "benchmark: exit $?"
fi

if has profile && [[ $DEV == cuda ]]; then
  say "profile"
  timeout -s INT -k 10 $(lim ${T_PROFILE:-30}) "$PY" scripts/gpu_profile.py --backends triton,compile --top 8 >>"$MEASURE" 2>&1
  say "profile: exit $?"
fi

if has correctness; then
  say "correctness"
  timeout -s INT -k 15 $(lim ${T_CORRECT:-60}) "$PY" -m benchmarks.harness correctness --device $DEV --scale $SCALE \
    --losses supmpn,infonce,mnrl,supcon --dtypes bfloat16,float16,float32 --impls triton,torch \
    --out "$OUT/correctness.json" >>"$CHECKS" 2>&1
  say "correctness: exit $?"
fi

if has ring; then
  say "ring blocks"
  timeout -s INT -k 10 $(lim ${T_RING:-25}) "$PY" -m benchmarks.harness.ring_blocks --B $B --P 5 --Q 5 --d $D --world 8 \
    --dtype $([[ $DEV == cuda ]] && echo bfloat16 || echo float32) --device $DEV --budget-s 1 >>"$MEASURE" 2>&1
  say "ring blocks: exit $?"
fi
if has extensions; then
  say "extensions"
  if [[ $DEV == cuda ]]; then EXT_ARGS=(--B 16384 --gist-B 4096 --d 768 --dtype bfloat16 --impls triton,torch)
  else EXT_ARGS=(--B 256 --gist-B 64 --d 32 --dtype float32 --impls torch --reps 1); fi
  timeout -s INT -k 10 $(lim ${T_EXT:-40}) "$PY" scripts/gpu_extensions.py "${EXT_ARGS[@]}" --device $DEV \
    --json "$OUT/extensions.json" >>"$MEASURE" 2>&1
  say "extensions: exit $?"
fi
say "done"

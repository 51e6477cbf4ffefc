#!/usr/bin/env bash
# One command for a lent H100/H200: correctness at scale, the GPU benchmark grid, the report.
#
#   scripts/gpu_bench.sh [OUT_DIR]        # default: benchmarks/results/gpu-<UTC date>
#   DRY_RUN=1 scripts/gpu_bench.sh OUT    # same steps on the CPU at tiny sizes (plumbing check)
#
# Writes under OUT_DIR: info.txt (versions, device, backends), correctness.json/.txt
# (every implementation's loss and gradients vs float64 at scale), bench.json
# (pytest-benchmark, GPU grid of benchmarks/bench_losses.py), pytest.txt (its log with the
# ratio table), RESULTS.md and plots/*.png (python -m benchmarks.harness report).
# PYTHON=... picks the interpreter (default: .venv/bin/python if present, else python).
# The whole GPU grid takes about 10 minutes; where one command is limited to less, run it
# in parts into the same folder (the report reads every bench*.json there):
#   SKIP_CORRECTNESS=1 PART=infonce scripts/gpu_bench.sh OUT   # pytest -k infonce -> bench-infonce.json
#   SKIP_CORRECTNESS=1 PART="supmpn or supcon" scripts/gpu_bench.sh OUT
# Exit status: non-zero if the correctness check or the benchmark run failed; the report
# is written either way from whatever was measured.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-benchmarks/results/gpu-$(date -u +%Y%m%dT%H%MZ)}
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python; fi
fi
mkdir -p "$OUT"
status=0

"$PYTHON" -m fastcl.info | tee "$OUT/info.txt"
if [[ "${DRY_RUN:-0}" == 1 ]]; then
  CORRECTNESS=(--device cpu --scale 0.0078125)
  BENCH=(benchmarks/bench_losses.py --benchmark-only
    -k "(cpu-infonce-B1024 or cpu-clip-B4096-P1-Q0-d512) and (eager or torch or st-mnrl or triton or inf-cl)")
else
  "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device: use DRY_RUN=1')" || exit 2
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv | tee -a "$OUT/info.txt"
  CORRECTNESS=(--device cuda)
  BENCH=(benchmarks/bench_losses.py -m gpu --benchmark-only)
fi

if [[ "${SKIP_CORRECTNESS:-0}" != 1 ]]; then
  echo "== correctness at scale"
  "$PYTHON" -m benchmarks.harness correctness "${CORRECTNESS[@]}" --out "$OUT/correctness.json" 2>&1 | tee "$OUT/correctness.txt"
  (( PIPESTATUS[0] == 0 )) || status=1
fi

echo "== benchmark grid"
NAME=bench
if [[ -n "${PART:-}" ]]; then
  BENCH+=(-k "${PART}")
  NAME="bench-$(echo "$PART" | tr -c 'A-Za-z0-9\n' '_')"
fi
"$PYTHON" -m pytest "${BENCH[@]}" -p no:cacheprovider --benchmark-json "$OUT/$NAME.json" 2>&1 | tee "$OUT/$NAME.txt"
(( PIPESTATUS[0] == 0 )) || status=1

echo "== report"
"$PYTHON" -m benchmarks.harness report "$OUT"/bench*.json --out "$OUT/RESULTS.md" --plots "$OUT/plots" || status=1
echo "results in $OUT (exit status $status)"
exit $status

#!/usr/bin/env bash
# Thread scaling of every implementation: the loss grid at 1 thread, then at all cores.
#
#   scripts/bench_threads.sh [OUT_DIR] [pytest args...]   # default OUT_DIR: benchmarks/results/threads-<UTC date>
#   THREADS="1 2 4" scripts/bench_threads.sh OUT            # other thread counts
#   scripts/bench_threads.sh OUT -k "supmpn"                # a slice of the grid
#
# One run of benchmarks/bench_losses.py per thread count (--bench-threads N), each
# in its own process: torch.compile bakes the thread count into the code it generates,
# so counts cannot be switched inside one process. Writes OUT/threads-N.json and
# OUT/threads-N.txt (the pytest log), then OUT/RESULTS.md from all of them: one section
# per thread count and a "Thread scaling" table (time at each count, speed-up from the
# fewest). Memory probes are skipped (--bench-no-memory; MEMORY=1 keeps them): memory is the
# default run's business. Exit status: non-zero if a run or the report failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-benchmarks/results/threads-$(date -u +%Y%m%dT%H%MZ)}
shift || true
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python; fi
fi
# default: 1 and PyTorch's own default (all cores), whatever OMP_NUM_THREADS says here
ALL=$(env -u OMP_NUM_THREADS -u MKL_NUM_THREADS "$PYTHON" -c 'import torch; print(torch.get_num_threads())')
THREADS=${THREADS:-$(printf '%s\n' 1 "$ALL" | sort -nu | tr '\n' ' ')}
mkdir -p "$OUT"
status=0
for n in $THREADS; do
  echo "== $n thread(s)"
  memory=(--bench-no-memory)
  [[ ${MEMORY:-0} == 1 ]] && memory=()
  "$PYTHON" -m pytest benchmarks/bench_losses.py --benchmark-only -p no:cacheprovider \
    --bench-threads "$n" "${memory[@]}" \
    --benchmark-json "$OUT/threads-$n.json" "$@" 2>&1 | tee "$OUT/threads-$n.txt"
  (( PIPESTATUS[0] == 0 )) || status=1
done
"$PYTHON" -m benchmarks.harness report "$OUT"/threads-*.json --out "$OUT/RESULTS.md" --plots "$OUT/plots" || status=1
echo "results in $OUT (exit status $status)"
exit $status

#!/usr/bin/env bash
# GCLSR reproduction: the paper's recipe, the ablation rows of its Table 2 that
# matter most, and the averaged word vectors of the same vectors; writes one results table.
#
#   FASTCL_DATA_DIR=/path/to/data HF_HUB_OFFLINE=1 examples/gclsr/repro.sh            # the full run
#   OUT=runs/x examples/gclsr/repro.sh --epochs 10 --batch-size 256                   # shorter, documented
#   OUT=/tmp/smoke STS_SPLIT=dev examples/gclsr/repro.sh --max-examples 1024 --max-steps 2   # smoke test
#
# Rows (each trains `fastcl train gclsr --preset paper` plus the row's switches; extra
# arguments go to every training run, after the preset, so they win):
#   full  GCLSR_base + PWVA + self-att. + GP: the paper preset as published (20 epochs,
#         batch 512, TextCNN 1,1,1,6,15,20 x 300, projector 3 x 4096, predictor 1024,
#         groups of 16, PWVA p 0.5 (code operators), attention, predictor lr 1.0)
#   base  GCLSR_base: no PWVA (p = 0: the two views are identical), no attention, no grouping
#         (one group of all 4096 features = SimSiam's loss)
# Each run selects its checkpoint on STS-B dev (once an epoch) and is scored on STS12-16,
# STS-B and SICK-R test (SentEval protocol, "all", Spearman x 100); the averaged word
# vectors use the same vectors, tokenisation and word limit. Word vectors: --word-vectors
# FILE (word2vec / GloVe text) or, by default, all-MiniLM-L6-v2's static input embeddings.
#
# Environment: OUT (default runs/gclsr-repro), PYTHON (default python), STS_SPLIT (test;
# "dev" scores STS-B / SICK-R dev only, for smoke runs), ROWS (default "full base").
# Threads: torch uses every core unless OMP_NUM_THREADS says otherwise.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)  # sts.py and table.py live beside this script

OUT=${OUT:-runs/gclsr-repro}
PYTHON=${PYTHON:-python}
STS_SPLIT=${STS_SPLIT:-test}
ROWS=${ROWS:-full base}
mkdir -p "$OUT"

row_args() {
  case "$1" in
    full) echo "" ;;
    base) echo "--pwva-p 0 --attention false --group-size 4096" ;;
    *) echo "unknown row $1 (expected full or base)" >&2; return 2 ;;
  esac
}

vectors=()
for ((i = 1; i <= $#; i++)); do  # the word-vector source must reach the STS script too
  if [[ "${!i}" == "--word-vectors" ]]; then j=$((i + 1)); vectors=(--word-vectors "${!j}"); fi
done

for row in $ROWS; do
  dir="$OUT/$row"
  mkdir -p "$dir"
  echo "== $row: training into $dir" >&2
  { echo "start $(date -u +%FT%TZ) $(uptime)"; echo "threads OMP_NUM_THREADS=${OMP_NUM_THREADS:-unset} cores=$(nproc --all)"; } > "$dir/machine.txt"
  start=$(date +%s)
  $PYTHON -m fastcl train gclsr --preset paper $(row_args "$row") --output-dir "$dir" \
    --save-steps 0 --progress false "$@" > "$dir/train.out"
  train_s=$(( $(date +%s) - start ))
  echo "end $(date -u +%FT%TZ) $(uptime)" >> "$dir/machine.txt"
  echo "== $row: STS ($STS_SPLIT) of $dir/best" >&2
  start=$(date +%s)
  $PYTHON "$HERE/sts.py" --model "$dir/best" --split "$STS_SPLIT" "${vectors[@]}" --output "$dir/sts.json" > /dev/null
  echo "{\"train_s\": $train_s, \"sts_s\": $(( $(date +%s) - start )), \"args\": \"$(row_args "$row") $*\"}" > "$dir/timing.json"
done

$PYTHON "$HERE/table.py" "$OUT" $ROWS

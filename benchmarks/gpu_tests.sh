#!/usr/bin/env bash
# The GPU tests on the device machine: `pytest -m gpu tests` with the carried wheels, the log
# under $OUT. Env: TESTS (paths or -k expressions; default: all of tests/), LIMIT (seconds).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" | tee -a "$OUT/gpu.txt"
timeout -k 10 "${LIMIT:-400}" python3 -m pytest -q -m gpu -p no:cacheprovider \
  ${TESTS:-tests} 2>&1 | tee "$OUT/gpu-tests.log" | tail -n 60

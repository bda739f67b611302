#!/usr/bin/env bash
# Issue 2 evidence on the GPU: `pipeline profile` for the reference models and workloads,
# each timed end to end (model build included). Run on the device machine from the repo root.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/traceinsight-*.whl .whl/plotly-*.whl .whl/pydot-*.whl
  export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1 PIPELINE_RUNS=/tmp/runs
mkdir -p /tmp/runs
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
for spec in "llama-3.2-1b 8 1024" "llama-3.2-1b 1 128" "qwen2.5-0.5b 8 1024" "qwen2.5-0.5b 1 128"; do
  set -- $spec
  dir=/tmp/runs/$1-b$2-s$3
  start=$(date +%s.%N)
  python3 -m pipeline profile "$1" --batch "$2" --seq "$3" --dtype bf16 --run-dir "$dir" --top 12 \
    > "$dir.log" 2>&1; rc=$?
  end=$(date +%s.%N)
  echo "=== $1 b$2 s$3: rc=$rc wall_s=$(python3 -c "print(round($end-$start,1))")"
  tail -n 60 "$dir.log"
done
tar -czf "$OUT/gpu_profiles.tgz" -C /tmp/runs .

#!/usr/bin/env bash
# Issue 6 evidence on the H200: `pipeline optimize` end to end on Llama-3.2-1B shapes, then
# torch.compile and Liger-Kernel against eager, each in its own process, in the same call.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/runs
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PIPELINE_RUNS=/tmp/runs
M=${M:-llama-3.2-1b} B=${B:-8} S=${S:-1024}
run=/tmp/runs/$M
t0=$(date +%s)
python3 -m pipeline profile $M --batch $B --seq $S --dtype bf16 --run-dir $run --top 8 \
  > $OUT/profile.log 2>&1; echo "profile rc=$? $(( $(date +%s) - t0 ))s"
t1=$(date +%s)
python3 -m pipeline optimize $run --top 3 --max-configs 4 --pairs 20 > $OUT/optimize.log 2>&1
echo "optimize rc=$? $(( $(date +%s) - t1 ))s"; tail -n 25 $OUT/optimize.log
tar -czf $OUT/run-$B-$S.tgz --exclude='*.json.gz' -C /tmp/runs $M
[ -n "${SKIP_CONTENDERS:-}" ] || for c in liger compile; do
  timeout 120 python3 benchmarks/contenders.py $c $M 8 1024 $OUT/$c.json 2>&1 | tail -n 2
done

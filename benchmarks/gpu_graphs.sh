#!/usr/bin/env bash
# Issue 25 evidence on the H200: `pipeline profile` and `pipeline optimize --top 5` for one model
# and workload, then head_to_head.py with every variant in one process (eager, ours, compile,
# compile-reduce-overhead, the unpatched and the patched model as CUDA graphs, and for decode
# eager over the static cache), then one tarball of what it made.
# Env: M (model), B, S (workload), MODE (prefill or decode), TOP, FAMILIES (instead of TOP:
# exactly these, comma-separated), RESUME (a carried run folder to continue with
# `optimize --resume` instead of profiling anew; REDO: families that resume searches again), MAXC (configs per case; "all":
# the default exhaustive search), PAIRS, BACKEND, ROUNDS, VARIANTS, and the limits in seconds
# T_PROFILE, T_OPTIMIZE, T_H2H (0: no head_to_head; the optimize's graphs stage still times
# the graphed step). Each step runs under `timeout`, which (without --foreground)
# puts itself and the step in one process group and signals the whole group on expiry, TERM
# then KILL 15 s later: workers and compile subprocesses go with the step.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/runs
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PIPELINE_RUNS=/tmp/runs
M=${M:-llama-3.2-1b} B=${B:-1} S=${S:-128} MODE=${MODE:-prefill} TOP=${TOP:-5} MAXC=${MAXC:-4}
PAIRS=${PAIRS:-20} BACKEND=${BACKEND:-triton} ROUNDS=${ROUNDS:-30}
VARIANTS=${VARIANTS:-eager,ours,compile,compile-reduce-overhead,graph,ours-graphs,eager-static}
# defaults sum to 550 s: the lent machine runs one command for 600 s at most
T_PROFILE=${T_PROFILE:-90} T_OPTIMIZE=${T_OPTIMIZE:-240} T_H2H=${T_H2H:-220}
case $MODE in prefill|decode) ;; *) echo "MODE must be prefill or decode, got $MODE" >&2; exit 2;; esac
tag=$M-$MODE-b$B-s$S
run=/tmp/runs/$tag
logs=$OUT/logs-$tag; mkdir -p $logs

source benchmarks/gpu_step.sh

python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU')"
maxc="--max-configs $MAXC"; [ "$MAXC" != all ] || maxc=""
choice="--top $TOP"; [ -z "${FAMILIES:-}" ] || choice="--families $FAMILIES"
if [ -n "${RESUME:-}" ]; then
  # RESUME: a run folder carried from an earlier call (its traces included), put back where
  # its artifacts say it lives; optimize continues it with its own options
  mkdir -p $run && cp -r "$RESUME"/. $run/
  step optimize $T_OPTIMIZE python3 -X faulthandler -m pipeline optimize $run --resume \
    ${REDO:+--redo $REDO}
else
  step profile $T_PROFILE python3 -m pipeline profile $M --batch $B --seq $S --dtype bf16 \
    --mode $MODE --run-dir $run --top 8
  [ -f $run/profile.json ] && step optimize $T_OPTIMIZE python3 -X faulthandler -m pipeline \
    optimize $run $choice $maxc --pairs $PAIRS --backend $BACKEND
fi
# a run cut off at its limit keeps what it verified: both tarballs below hold enough to go on
[ -f $run/report.md ] || [ ! -f $run/profile.json ] || echo "optimize did not finish: untar" \
  "graphs-$tag.tgz and traces-$tag.tgz into one folder, carry it and rerun with RESUME=DIR/$tag"
# without an optimize run, head_to_head skips ours and ours-graphs and says why
[ -f $run/profile.json ] && [ "$T_H2H" != 0 ] && step h2h $T_H2H python3 benchmarks/head_to_head.py $run \
  $logs/h2h.json --rounds $ROUNDS --variants $VARIANTS
tar -czf $OUT/graphs-$tag.tgz --exclude='*.json.gz' -C /tmp/runs $tag -C $OUT logs-$tag
# the traces apart (tens of MB): enough to re-project a run offline (profiling.replay)
(cd /tmp/runs && find $tag -name '*.json.gz' | tar -czf $OUT/traces-$tag.tgz -T -)

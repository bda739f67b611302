#!/usr/bin/env bash
# Issue 6 evidence on the H200: `pipeline optimize` end to end on one model and workload, then
# eager, ours and torch.compile in one process (head_to_head.py) and Liger-Kernel against eager
# in its own, in the same call.
# Env: M (model), B, S (workload), MODE (prefill, decode or prefill,decode), TOP, FAMILIES
# (instead of TOP: exactly these), MAXC (configs per case; "all": the default exhaustive
# search a user gets), PAIRS, BACKEND, SKIP_CONTENDERS.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/runs
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PIPELINE_RUNS=/tmp/runs
M=${M:-llama-3.2-1b} B=${B:-8} S=${S:-1024} TOP=${TOP:-3} MAXC=${MAXC:-4} PAIRS=${PAIRS:-20}
BACKEND=${BACKEND:-triton} MODE=${MODE:-prefill}
choice="--top $TOP"; [ -z "${FAMILIES:-}" ] || choice="--families $FAMILIES"
tag=$M-b$B-s$S
run=/tmp/runs/$tag
t0=$(date +%s)
python3 -m pipeline profile $M --batch $B --seq $S --dtype bf16 --mode $MODE --run-dir $run --top 8 \
  > $OUT/profile-$tag.log 2>&1; echo "profile $tag rc=$? $(( $(date +%s) - t0 ))s"
t1=$(date +%s)
maxc="--max-configs $MAXC"; [ "$MAXC" != all ] || maxc=""
python3 -X faulthandler -m pipeline optimize $run $choice $maxc --pairs $PAIRS \
  --backend $BACKEND > $OUT/optimize-$tag.log 2>&1 &
opt=$!
# Run 7's first call: the report was written, then the process had not exited about 45 s later,
# when the call's timeout killed it (TEARDOWN_CUPTI=1 was set then). A run still alive 15 s
# after its report gets its process tree logged and a Python traceback (SIGABRT,
# faulthandler) instead of eating the call's time.
( while kill -0 $opt 2>/dev/null; do
    if grep -q '^report:' $OUT/optimize-$tag.log; then
      sleep 15; kill -0 $opt 2>/dev/null || exit 0
      echo "optimize $tag alive 15 s after its report" >&2
      ps -eo pid,ppid,etimes,stat,cmd --forest > $OUT/ps-$tag.log; kill -ABRT $opt; exit 0
    fi; sleep 2
  done ) &
wait $opt
echo "optimize $tag rc=$? $(( $(date +%s) - t1 ))s"; tail -n 30 $OUT/optimize-$tag.log
tar -czf $OUT/run-$tag.tgz --exclude='*.json.gz' -C /tmp/runs $tag
(cd /tmp/runs && find $tag -name '*.json.gz' | tar -czf $OUT/traces-$tag.tgz -T -)
tar -czf $OUT/trace-$tag.tgz -C /tmp/runs $tag/trace $tag/profile.json  # for offline replay work
# compile against eager and ours in one process (head_to_head.py); Liger in its own, since it
# patches module-level code
[ -n "${SKIP_CONTENDERS:-}" ] || {
  timeout 200 python3 benchmarks/head_to_head.py $run $OUT/h2h-$tag.json 2>&1 | tail -n 25
  timeout 150 python3 benchmarks/contenders.py liger $M $B $S $OUT/liger-$tag.json 2>&1 | tail -n 2
}

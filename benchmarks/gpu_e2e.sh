#!/usr/bin/env bash
# Generation end to end on the GPU (issue 59): `pipeline profile --generation`, `pipeline
# optimize`, then `pipeline e2e` with every variant in one process, and one tarball of what it
# made. Env: M (model), G (generations, BxP+N,...), MODE (decode: the generation's decode steps
# only, its prefill unpatched; or both), TOP, MAXC, PAIRS, ROUNDS, and the limits in seconds
# T_PROFILE, T_OPTIMIZE, T_E2E (each step under `timeout`, which signals its whole process
# group). Without an optimized run, e2e still times the transformers variants and the graph.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/runs
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PIPELINE_RUNS=/tmp/runs
M=${M:-llama-3.2-1b} G=${G:-1x1024+128,8x128+128} MODE=${MODE:-decode} TOP=${TOP:-5}
MAXC=${MAXC:-4} PAIRS=${PAIRS:-12} ROUNDS=${ROUNDS:-3}
T_PROFILE=${T_PROFILE:-100} T_OPTIMIZE=${T_OPTIMIZE:-280} T_E2E=${T_E2E:-200}
tag=$M-e2e
run=/tmp/runs/$tag
logs=$OUT/logs-$tag; mkdir -p $logs

TAIL=${TAIL:-30}
source benchmarks/gpu_step.sh

python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU')"
step profile $T_PROFILE python3 -m pipeline profile $M --generation $G --mode $MODE \
  --dtype bf16 --run-dir $run --top 8
[ -f $run/profile.json ] && step optimize $T_OPTIMIZE python3 -X faulthandler -m pipeline \
  optimize $run --top $TOP --max-configs $MAXC --pairs $PAIRS
[ -f $run/profile.json ] && step e2e $T_E2E python3 -X faulthandler -m pipeline e2e $run \
  --rounds $ROUNDS
tar -czf $OUT/e2e-$tag.tgz --exclude='*.json.gz' -C /tmp/runs $tag -C $OUT logs-$tag
(cd /tmp/runs && find $tag -name '*.json.gz' | tar -czf $OUT/traces-$tag.tgz -T -)

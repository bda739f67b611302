#!/usr/bin/env bash
# Issue 63's evidence on a GPU, one PART per device call (each fits the 600 s a call may run):
#   PART=prefill  profile + `optimize --top 5` of M at b8 s1024 (bf16), `pipeline export` of
#                 the run, then head_to_head.py with eager, ours, compile, ours-compile and
#                 ours-kernels (the package kernelized into a fresh twin through `kernels`):
#                 ours-compile against compile and ours; ours-kernels against ours
#                 (~9.5 min: profile 90 s, optimize 240 s, export 30 s, h2h 200 s)
#   PART=e2e      gpu_e2e.sh for G=1x1024+128: every `pipeline e2e` variant, ours-static-compile
#                 (transformers' static-cache generate compiling its step with our ops) beside
#                 hf-static and ours-graphs (~9.5 min)
#   PART=tests    `pytest -m gpu` of the compile tests (Inductor and reduce-overhead on CUDA)
#                 (~2 min)
# About 21 device minutes for the three. A run left in /tmp/runs by an earlier PART=prefill
# on the same warm machine is reused (RESUME=DIR: a carried run folder instead, such as the
# run folder of the last call's export-$tag.tgz unpacked into the repository; then profile
# and optimize are skipped and the call takes ~5 min: export 30 s, h2h ~200 s). Env as
# gpu_graphs.sh: M, TOP, MAXC, PAIRS, ROUNDS, T_PROFILE, T_OPTIMIZE, T_EXPORT, T_H2H.
# h2h.log carries dynamo's graph breaks and recompiles with their reasons (TORCH_LOGS), and
# h2h.json each compiled variant's graph and graph-break counts (`dynamo`).
# `kernels` must be importable for ours-kernels (pip wheel in .whl/ otherwise); without it
# the variant is skipped with the reason and the rest runs.
# Afterwards, on this machine: python3 benchmarks/results_table.py --h2h OUT/logs-*/h2h.json
#   --model M --commit C (and --e2e RUN --commit C for PART=e2e).
set -uo pipefail
PART=${PART:-prefill}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/runs
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PIPELINE_RUNS=/tmp/runs
M=${M:-llama-3.2-1b} TOP=${TOP:-5} MAXC=${MAXC:-4} PAIRS=${PAIRS:-20} ROUNDS=${ROUNDS:-30}
T_PROFILE=${T_PROFILE:-90} T_OPTIMIZE=${T_OPTIMIZE:-240} T_EXPORT=${T_EXPORT:-40}
T_H2H=${T_H2H:-200}
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU')"
python3 -c "import kernels; print('kernels', kernels.__version__)" || echo "no kernels library"

case $PART in
  e2e) M=$M G=1x1024+128 exec bash benchmarks/gpu_e2e.sh ;;
  tests) exec timeout -k 15 300 python3 -m pytest -q -m gpu tests/codegen/test_compile.py ;;
  prefill) ;;
  *) echo "PART must be prefill, e2e or tests, got $PART" >&2; exit 2 ;;
esac

tag=$M-prefill-b8-s1024
run=/tmp/runs/$tag pkg=/tmp/runs/$tag-kernels
logs=$OUT/logs-export-$tag; mkdir -p $logs
source benchmarks/gpu_step.sh

if [ -n "${RESUME:-}" ]; then
  mkdir -p $run && cp -r "$RESUME"/. $run/
fi
if [ ! -f $run/integration.json ]; then
  [ -f $run/profile.json ] || step profile $T_PROFILE python3 -m pipeline profile $M \
    --batch 8 --seq 1024 --dtype bf16 --run-dir $run --top 8
  [ -f $run/profile.json ] && step optimize $T_OPTIMIZE python3 -X faulthandler -m pipeline \
    optimize $run --top $TOP --max-configs $MAXC --pairs $PAIRS --resume
fi
rm -rf $pkg
[ -f $run/integration.json ] && step export $T_EXPORT python3 -m pipeline export $run $pkg
[ -f $run/integration.json ] && TORCH_LOGS=${TORCH_LOGS:-graph_breaks,recompiles} \
  step h2h $T_H2H python3 benchmarks/head_to_head.py $run \
  $logs/h2h.json --rounds $ROUNDS --variants eager,ours,compile,ours-compile,ours-kernels \
  --export $pkg
[ -f $logs/h2h.json ] && python3 - $logs/h2h.json <<'EOF'
import json, sys
h = json.load(open(sys.argv[1]))
print("kept", h["kept"], "compiled", h.get("compiled_families"), "skipped", h["skipped"])
print("dynamo", h.get("dynamo"), "recompile_limit", h.get("recompile_limit"))
print("kernels per pass", h.get("kernels_per_pass"))
for k, v in h["over_eager"].items():
    print(f"{k} over eager {v['speedup']:.3f}x {v['ci']}")
for k, v in h["pairs"].items():
    print(f"{k} {v['speedup']:.3f}x {v['ci']}")
for k, rows in (h.get("top_kernels") or {}).items():
    print(k, "; ".join(f"{n[:48]} x{c} {ms:.2f}ms" for n, c, ms in rows[:8]))
EOF
tar -czf $OUT/export-$tag.tgz --exclude='*.json.gz' -C /tmp/runs $tag $tag-kernels \
  -C $OUT logs-export-$tag

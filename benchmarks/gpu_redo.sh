#!/usr/bin/env bash
# A changed decode kernel measured in one call (about 9 minutes at the defaults), on a run
# folder carried from an earlier call (RESUME, with its traces): `pytest -m gpu` of the kernels'
# GPU tests (TESTS; a failed prefetch test drops the prefetch variant), then
# `optimize --resume --redo REDO` and head_to_head.py through gpu_graphs.sh (VARIANTS, ROUNDS),
# the graphed step's anatomy (decode-step.md), and `pipeline e2e` at B x P + N over the same
# run (E2E_VARIANTS; T_E2E=0 skips it). TRITON_CACHE (a .tgz holding `decode-triton/`) seeds
# Triton's cache. Env: RESUME (required), M, B, S (as the run was profiled), REDO (none: finish
# the carried run without searching again), VARIANTS,
# ROUNDS, P, N, E2E_VARIANTS, TESTS, and the limits T_TESTS (0 skips the tests), T_OPTIMIZE, T_H2H, T_E2E.
set -uo pipefail
: "${RESUME:?RESUME=<carried run folder> is required}"
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/cache
if [ -n "${TRITON_CACHE:-}" ]; then
  tar -xzf "$TRITON_CACHE" -C /tmp/cache decode-triton && export TRITON_CACHE_DIR=/tmp/cache/decode-triton
fi
export M=${M:-llama-3.2-1b} B=${B:-1} S=${S:-1024} MODE=decode
REDO=${REDO:-decode_attention,gemv,norm_qkv,norm_gate_up,qkv_proj,matmul_epilogue}
[ "$REDO" != none ] || REDO=
VARIANTS=${VARIANTS:-graph,ours-graphs,ours-graphs-pdl,ours-graphs-nopdl,ours-graphs-pdl-prefetch}
P=${P:-1024} N=${N:-128} E2E_VARIANTS=${E2E_VARIANTS:-hf-static,graph,ours,ours-graphs,ours-static-compile}
TESTS=${TESTS:-tests/codegen/test_pdl.py tests/codegen/test_gemv.py tests/codegen/test_decode_attention.py}
T_TESTS=${T_TESTS:-80} T_OPTIMIZE=${T_OPTIMIZE:-235} T_H2H=${T_H2H:-85} T_E2E=${T_E2E:-120}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PIPELINE_RUNS=/tmp/runs
tag=$M-decode-b$B-s$S run=/tmp/runs/$tag logs=$OUT/logs-redo; mkdir -p $logs
source benchmarks/gpu_step.sh
[ "$T_TESTS" = 0 ] || TAIL=15 step gputests $T_TESTS python3 -m pytest -m gpu -q -p no:cacheprovider $TESTS \
  -k "fused or pdl"
if grep -qsE "FAILED.*(prefetch|norm_fused_chain)" $logs/gputests.log; then
  echo "a prefetch test failed: no ours-graphs-pdl-prefetch"
  VARIANTS=$(echo "$VARIANTS" | sed 's/,ours-graphs-pdl-prefetch//')
fi
REDO=$REDO RESUME=$RESUME T_OPTIMIZE=$T_OPTIMIZE T_H2H=$T_H2H ROUNDS=${ROUNDS:-20} \
  VARIANTS=$VARIANTS bash benchmarks/gpu_graphs.sh
timeout 40 python3 - $run > $OUT/decode-step.md 2>&1 <<'PY'
import json, sys
from pathlib import Path
for key, w in json.loads((Path(sys.argv[1]) / "integration.json").read_text())["workloads"].items():
    g = w.get("graphs") or {}
    print(key, "families:", g.get("families"), "kernels:", g.get("kernels_per_pass"),
          "medians:", g.get("medians"))
    print("PDL:", g.get("pdl"))
    if g.get("decode_step"):
        from pipeline.decode_step import blocks
        from pipeline.report_plots import to_markdown
        print(to_markdown(blocks(g["decode_step"])))
PY
head -40 $OUT/decode-step.md
[ "$T_E2E" != 0 ] && step e2e $T_E2E python3 -X faulthandler -m pipeline e2e $run --batch $B \
  --prompt $P --new $N --variants $E2E_VARIANTS --rounds 3
tar -czf $OUT/redo-$tag.tgz --exclude='*.json.gz' -C /tmp/runs $tag -C $OUT logs-redo

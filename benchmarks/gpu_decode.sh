#!/usr/bin/env bash
# Issue 61 evidence in one call (about 8.5 minutes at the defaults): the decode step of M
# (Llama-3.2-1B) at batch B (1), KV S (1024) through `gpu_graphs.sh` (profile, `pipeline
# optimize` with FAMILIES, matmul_epilogue's gate/up GEMV among them, then head_to_head.py with
# the graph and ours-graphs, kernels per pass in its JSON; the graphs stage records the step's
# anatomy, `decode_step`, printed below), then the decode GEMV table (codegen/gemv/bench.py:
# GB/s per projection shape of TABLE_MODELS at TABLE_ROWS beside the copy bandwidth). QWEN=1
# runs Qwen2.5-0.5B's decode step the same way last (it needs about 4 more minutes: lower the
# limits or give it a call of its own).
# WARM=1 (issue 64): the optimize above starts from empty caches (Triton's, the search memory,
# calibrate's); then the same optimize runs again on a copy of the profiled run with those
# caches warm, and both wall times are printed and kept in warm.json (T_WARM limits it).
# T_TABLE=0 skips the GEMV table.
# Env: M, B, S, FAMILIES, MAXC, PAIRS, ROUNDS, VARIANTS, PDL, TABLE_MODELS, TABLE_ROWS,
# TABLE_MAXC, QWEN, WARM and the limits in seconds T_PROFILE, T_OPTIMIZE, T_H2H, T_TABLE,
# T_WARM. Every step runs under
# `timeout` in its own process group (benchmarks/gpu_step.sh); outputs under $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export M=${M:-llama-3.2-1b} B=${B:-1} S=${S:-1024} MODE=decode
export FAMILIES=${FAMILIES:-gemv,qkv_proj,matmul_epilogue,decode_attention,kv_cache,rope,rmsnorm,add_rmsnorm}
export MAXC=${MAXC:-4} PAIRS=${PAIRS:-12} ROUNDS=${ROUNDS:-20}
# PDL=1: also time ours-graphs captured with PDL forced on and off, and on without the weight
# streamers' L2 prefetch (head_to_head.py)
export VARIANTS=${VARIANTS:-graph,ours-graphs$([ "${PDL:-0}" = 1 ] && echo ,ours-graphs-pdl,ours-graphs-nopdl,ours-graphs-pdl-prefetch)}
export T_PROFILE=${T_PROFILE:-70} T_OPTIMIZE=${T_OPTIMIZE:-270} T_H2H=${T_H2H:-80}
TABLE_MODELS=${TABLE_MODELS:-llama-3.2-1b,llama-3.1-8b,qwen2.5-0.5b} TABLE_ROWS=${TABLE_ROWS:-1,8}
TABLE_MAXC=${TABLE_MAXC:-3} T_TABLE=${T_TABLE:-70} QWEN=${QWEN:-0} WARM=${WARM:-0}
T_WARM=${T_WARM:-200}
if [ "$WARM" = 1 ]; then  # cold: nothing cached from an earlier call on a warm machine
  export TRITON_CACHE_DIR=/tmp/decode-triton XDG_CACHE_HOME=/tmp/decode-cache
  rm -rf $TRITON_CACHE_DIR $XDG_CACHE_HOME
fi

anatomy() {  # the graphs stage's decode_step record of a run, as the report prints it
  PYTHONPATH=/tmp/site:$PWD timeout 60 python3 - "$1" <<'EOF'
import json, sys
from pathlib import Path
p = Path(sys.argv[1]) / "integration.json"
if not p.exists():
    sys.exit(f"no {p}")
for key, w in json.loads(p.read_text())["workloads"].items():
    g = w.get("graphs") or {}
    print(key, "families in the graph:", g.get("families"), "kernels per pass:",
          g.get("kernels_per_pass"), "medians:", g.get("medians"))
    pd = g.get("pdl") or {}
    print("PDL:", pd.get("why"), "medians off/on:", pd.get("off_ms"), pd.get("on_ms"))
    if g.get("decode_step"):
        from pipeline.decode_step import blocks
        from pipeline.report_plots import to_markdown
        print(to_markdown(blocks(g["decode_step"])))
    else:
        print("no decode_step:", g.get("decode_step_error") or g.get("decision"))
EOF
}

bash benchmarks/gpu_graphs.sh
anatomy /tmp/runs/$M-decode-b$B-s$S > $OUT/decode-step-$M.md 2>&1; cat $OUT/decode-step-$M.md

if [ "$WARM" = 1 ]; then
  tag=$M-decode-b$B-s$S logs=$OUT/logs-$M-decode-b$B-s$S
  export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PIPELINE_RUNS=/tmp/runs
  source benchmarks/gpu_step.sh
  cold=/tmp/runs/$tag warm=/tmp/runs/$tag-warm; rm -rf $warm; mkdir -p $warm
  cp -r $cold/profile.json $cold/trace $warm/ 2>/dev/null
  choice="--families $FAMILIES"; [ -n "$FAMILIES" ] || choice="--top ${TOP:-5}"
  step optimize-warm $T_WARM python3 -m pipeline optimize $warm $choice --max-configs $MAXC \
    --pairs $PAIRS
  python3 benchmarks/warm_optimize.py $cold $warm --cold-log $logs/optimize.log \
    --warm-log $logs/optimize-warm.log > $OUT/warm.json; cat $OUT/warm.json
fi

[ "$T_TABLE" = 0 ] && exit 0
tag=gemv-table logs=$OUT/logs-gemv-table; mkdir -p $logs
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
source benchmarks/gpu_step.sh
TAIL=40 step table $T_TABLE python3 -m codegen.gemv.bench --models $TABLE_MODELS \
  --rows $TABLE_ROWS --max-configs $TABLE_MAXC --out $OUT/gemv-table

if [ "$QWEN" = 1 ]; then
  M=qwen2.5-0.5b bash benchmarks/gpu_graphs.sh
  anatomy /tmp/runs/qwen2.5-0.5b-decode-b$B-s$S > $OUT/decode-step-qwen2.5-0.5b.md 2>&1
  cat $OUT/decode-step-qwen2.5-0.5b.md
fi

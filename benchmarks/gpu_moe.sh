#!/usr/bin/env bash
# Issue 66's evidence on an H100, in ONE device call (~8 min at the default limits, which sum
# to 480 s; each step stops at its own):
#   table    benchmarks/moe_table.py: OLMoE-1B-7B's experts block (router, experts, top-k
#            sum) at prefill b8 s1024 (8192 tokens) and decode b1: ours (best config) against
#            every experts_implementation of the installed transformers         T_TABLE  70 s
#   prefill  profile M b8 s1024, `optimize --families moe_experts`, head_to_head with eager,
#            ours, ours-graphs, hf-best-experts          T_PROFILE 60 + T_OPTIMIZE 100 + T_H2H 60
#   decode   the same at b1 with a KV cache of 1024       T_PROFILE_D 45 + T_OPTIMIZE_D 80
#                                                         + T_H2H_D 65
# The model is built from the zoo's config (random weights: the machine has no network), so its
# router is random and spreads tokens about evenly over the experts (the report says so, with
# the tokens per expert it saw). PART=table|prefill|decode runs one part; the default, all.
# Env: M (default olmoe-1b-7b), FAMILIES (default moe_experts; TOP=N instead ranks and takes
# the top N), MAXC (configs per case, default 3), PAIRS (default 10), ROUNDS (default 15), and
# the limits above. Outputs under $OUT: moe-table/ (moe.json, moe.md), logs-<tag>/ (each
# step's log, h2h.json) and moe-<tag>.tgz (the run folders without traces).
# Afterwards, on this machine, the rows for benchmarks/results/latest-h100.json:
#   python3 benchmarks/results_table.py benchmarks/results/latest-h100.json \
#     --h2h OUT/logs-<tag>/h2h.json --model M --commit C        (once per tag)
set -uo pipefail
PART=${PART:-all}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/runs
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PIPELINE_RUNS=/tmp/runs
M=${M:-olmoe-1b-7b} MAXC=${MAXC:-3} PAIRS=${PAIRS:-10} ROUNDS=${ROUNDS:-15}
T_TABLE=${T_TABLE:-70} T_PROFILE=${T_PROFILE:-60} T_OPTIMIZE=${T_OPTIMIZE:-100}
T_H2H=${T_H2H:-60} T_PROFILE_D=${T_PROFILE_D:-45} T_OPTIMIZE_D=${T_OPTIMIZE_D:-80}
T_H2H_D=${T_H2H_D:-65}
choice="--families ${FAMILIES:-moe_experts}"; [ -z "${TOP:-}" ] || choice="--top $TOP"
case $PART in all|table|prefill|decode) ;;
  *) echo "PART must be all, table, prefill or decode, got $PART" >&2; exit 2 ;; esac
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU')"
source benchmarks/gpu_step.sh

if [ $PART = all ] || [ $PART = table ]; then
  tag=$M-experts logs=$OUT/logs-$tag; mkdir -p $logs
  TAIL=40 step table $T_TABLE python3 benchmarks/moe_table.py --out $OUT/moe-table --model $M \
    --workloads prefill:8x1024,decode:1x1024
fi

# one workload: profile, optimize the chosen families, head_to_head, a tarball
workload() {  # MODE B LIMIT_PROFILE LIMIT_OPTIMIZE LIMIT_H2H
  local mode=$1 b=$2
  tag=$M-$mode-b$b-s1024 run=/tmp/runs/$M-$mode-b$b-s1024 logs=$OUT/logs-$M-$mode-b$b-s1024
  mkdir -p $logs
  step profile $3 python3 -m pipeline profile $M --batch $b --seq 1024 --dtype bf16 \
    --mode $mode --run-dir $run --top 8
  [ -f $run/profile.json ] && step optimize $4 python3 -X faulthandler -m pipeline optimize \
    $run $choice --max-configs $MAXC --pairs $PAIRS
  grep -h "Mixture of experts" $run/report.md 2>/dev/null  # the experts' share and load
  # without an optimize run, head_to_head skips ours and ours-graphs and says why
  [ -f $run/profile.json ] && TAIL=12 step h2h $5 python3 benchmarks/head_to_head.py $run \
    $logs/h2h.json --rounds $ROUNDS --alone-rounds 0 \
    --variants eager,ours,ours-graphs,hf-best-experts
  [ -f $logs/h2h.json ] && python3 - $logs/h2h.json <<'EOF'
import json, sys
h = json.load(open(sys.argv[1]))
print("kept", h["kept"], "graphed", h.get("graph_families"), "skipped", h["skipped"])
print("hf-best-experts:", h.get("hf_best_experts"))
for k, v in h["median_ms"].items():
    print(f"{k} {v:.3f} ms")
for k, v in {**h["over_eager"], **h["pairs"]}.items():
    print(f"{k} {v['speedup']:.3f}x {v['ci']}")
EOF
  tar -czf $OUT/moe-$tag.tgz --exclude='*.json.gz' -C /tmp/runs $tag -C $OUT logs-$tag
}

if [ $PART = all ] || [ $PART = prefill ]; then
  workload prefill 8 $T_PROFILE $T_OPTIMIZE $T_H2H
fi
if [ $PART = all ] || [ $PART = decode ]; then
  workload decode 1 $T_PROFILE_D $T_OPTIMIZE_D $T_H2H_D
fi

"""Which kernels run slower inside a CUDA graph of a prefill pass than eagerly (GPU)?

    python benchmarks/probes/graph_kernels.py MODEL BATCH SEQ [OUT.json] [RUN_DIR WORKLOAD]

Issues 25 and 29: at b8 s1024 the unpatched Llama-3.2-1B pass ran 0.948x of eager once
captured (52.2 against 49.5 ms, with about 3 ms of host gaps removed), Qwen2.5-0.5B 0.972x, so
the GPU work itself took longer in the graph; the replay projection, which keeps each kernel's
traced duration, said 1.05x. One eager pass and one replay (models.graphs.GraphedPrefill) of
the same inputs, each under torch.profiler after warm-up (unpatched, or with RUN_DIR's kept
set for WORKLOAD patched in): per kernel name, count and total time both ways, the GPU time
and the device span of each pass, the SM clock before and after (nvidia-smi), slowest-grown
first.
"""

from __future__ import annotations

import json
import subprocess
import sys

import torch
from decode_kernels import kernels  # this folder's: run as a script, it is on sys.path

from models.graphs import GraphedPrefill
from profiling.loader import build, resolve


def sm_clock() -> str | None:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw",
                               "--format=csv,noheader"], capture_output=True, text=True,
                              timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def main() -> None:
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    model_id, batch, seq = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    out = sys.argv[4] if len(sys.argv) > 4 else None
    model = build(resolve(model_id), torch.bfloat16, "cuda")
    if len(sys.argv) > 6:
        from pipeline.api import apply_kernels

        apply_kernels(model, sys.argv[5], sys.argv[6])
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), device="cuda")

    def eager():
        with torch.no_grad():
            model(ids, use_cache=False)

    graph = GraphedPrefill(model, ids)
    result = {"model": model_id, "batch": batch, "seq": seq, "clock_before": sm_clock(),
              "eager": kernels(eager, 3), "graph": kernels(lambda: graph(ids), 3)}
    result["clock_after"] = sm_clock()
    graph.close()
    e, g = result["eager"], result["graph"]
    print(f"eager: {e['gpu_us_per_step'] / 1e3:.2f} ms GPU, span "
          f"{(e['span_us_per_step'] or 0) / 1e3:.2f} ms; graph: {g['gpu_us_per_step'] / 1e3:.2f} "
          f"ms GPU, span {(g['span_us_per_step'] or 0) / 1e3:.2f} ms; clock "
          f"{result['clock_before']} -> {result['clock_after']}")
    us = {side: {r["name"]: r for r in result[side].pop("by_name")} for side in ("eager", "graph")}
    names = sorted(set(us["eager"]) | set(us["graph"]), key=lambda n: -(
        us["graph"].get(n, {}).get("us_per_step", 0.0)
        - us["eager"].get(n, {}).get("us_per_step", 0.0)))
    rows = [{"name": n, **{f"{side}_{k}": us[side].get(n, {}).get(k, 0)
                           for side in ("eager", "graph") for k in ("us_per_step", "per_step")}}
            for n in names]
    for r in rows[:20]:
        print(f"  {r['eager_us_per_step']:9.1f} -> {r['graph_us_per_step']:9.1f} us  "
              f"x{r['graph_per_step']:.0f}  {r['name'][:100]}")
    result["by_name"] = rows
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

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
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from models.graphs import GraphedPrefill
from profiling.loader import build, resolve


def sm_clock() -> str | None:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw",
                               "--format=csv,noheader"], capture_output=True, text=True,
                              timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def kernels(fn, passes: int = 3) -> dict:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(passes):
            fn()
        torch.cuda.synchronize()
    by_name: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    starts, ends = [], []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time > 0:
            by_name[e.name] += e.device_time / passes
            count[e.name] += 1
            starts.append(e.time_range.start)
            ends.append(e.time_range.end)
    return {"gpu_us": sum(by_name.values()), "span_us": (max(ends) - min(starts)) / passes
            if starts else None, "us": dict(by_name),
            "count": {k: v / passes for k, v in count.items()}}


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
              "eager": kernels(eager), "graph": kernels(lambda: graph(ids))}
    result["clock_after"] = sm_clock()
    graph.close()
    e, g = result["eager"], result["graph"]
    print(f"eager: {e['gpu_us'] / 1e3:.2f} ms GPU, span {(e['span_us'] or 0) / 1e3:.2f} ms; "
          f"graph: {g['gpu_us'] / 1e3:.2f} ms GPU, span {(g['span_us'] or 0) / 1e3:.2f} ms; "
          f"clock {result['clock_before']} -> {result['clock_after']}")
    names = sorted(set(e["us"]) | set(g["us"]),
                   key=lambda n: -(g["us"].get(n, 0.0) - e["us"].get(n, 0.0)))
    rows = [{"name": n[:160], "eager_us": round(e["us"].get(n, 0.0), 1),
             "graph_us": round(g["us"].get(n, 0.0), 1), "eager_count": e["count"].get(n, 0),
             "graph_count": g["count"].get(n, 0)} for n in names]
    for r in rows[:20]:
        print(f"  {r['eager_us']:9.1f} -> {r['graph_us']:9.1f} us  x{r['graph_count']:.0f}  "
              f"{r['name'][:100]}")
    result["by_name"] = rows
    for side in ("eager", "graph"):
        result[side].pop("us")
        result[side].pop("count")
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

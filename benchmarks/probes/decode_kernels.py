"""Where one static-cache decode step spends its GPU time, kernel by kernel (GPU).

    python benchmarks/probes/decode_kernels.py [MODEL] [KV] [OUT.json] [RUN_DIR WORKLOAD]

One eager step and one graph replay of the model over transformers' StaticCache (unpatched, or
with RUN_DIR's graph set for WORKLOAD patched in, `apply_kernels(graph_set=True)`)
(models.graphs.StaticDecoder), each under torch.profiler: kernels per step, GPU time per step,
the device span per step (first kernel's start to last's end over back-to-back steps) and
the kernels grouped by name (count, total us). The answer says which kernels a fused
decode path would have to remove; the graph's own count is what a replay launches.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from models.graphs import StaticDecoder
from profiling.loader import build, resolve


def kernels(fn, steps: int = 5) -> dict:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    by_name: dict[str, list[float]] = defaultdict(list)
    starts, ends = [], []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time > 0:
            by_name[e.name].append(e.device_time)
            starts.append(e.time_range.start)
            ends.append(e.time_range.end)
    total = sum(sum(v) for v in by_name.values()) / steps
    count = sum(len(v) for v in by_name.values()) / steps
    # the steps run back to back on the device (one synchronize after the last): the span
    # per step against the kernels' own time is what the device idles between kernels, the
    # node and launch cost a graph replay adds that the projection models
    span = (max(ends) - min(starts)) / steps if starts else None
    rows = sorted(((n, len(v) / steps, sum(v) / steps) for n, v in by_name.items()),
                  key=lambda r: -r[2])
    return {"kernels_per_step": count, "gpu_us_per_step": total, "span_us_per_step": span,
            "by_name": [{"name": n[:160], "per_step": c, "us_per_step": round(t, 2)}
                        for n, c, t in rows]}


def main() -> None:
    model_id = sys.argv[1] if len(sys.argv) > 1 else "llama-3.2-1b"
    kv = int(sys.argv[2]) if len(sys.argv) > 2 else 1024
    out = sys.argv[3] if len(sys.argv) > 3 else None
    model = build(resolve(model_id), torch.bfloat16, "cuda")
    if len(sys.argv) > 5:
        from pipeline.api import apply_kernels

        apply_kernels(model, sys.argv[4], sys.argv[5], graph_set=True)
    ids = torch.randint(0, model.config.vocab_size, (1, kv), device="cuda")
    result = {"model": model_id, "kv": kv}
    for name, graph in (("eager_static", False), ("graph", True)):
        dec = StaticDecoder(model, 1, kv + 16, graph=graph)
        dec.prefill(ids)
        tok = ids[:, -1:]

        def step(dec=dec, tok=tok):
            dec.rewind(kv)
            dec.step(tok)
        result[name] = kernels(step)
        dec.close()
        r = result[name]
        print(f"{name}: {r['kernels_per_step']:.0f} kernels, {r['gpu_us_per_step']:.0f} us GPU "
              f"and {r['span_us_per_step'] or 0:.0f} us from first kernel to last, per step")
        for row in r["by_name"][:25]:
            print(f"  {row['per_step']:6.1f} x {row['us_per_step']:8.1f} us  {row['name'][:110]}")
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

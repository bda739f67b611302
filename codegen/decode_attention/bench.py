"""GPU timing of the decode-attention kernel against HF's own path at one decode shape, with a
correctness check; one JSON line per config and a summary. Default: Llama-3.2-1B's step (batch
1, 32 query heads over 8 kv heads, head_dim 64, a static cache of 1040 slots, length 1024,
bf16); HF's path is `sdpa_attention_forward` on the static buffers with the bool mask
(repeat_kv + SDPA on transformers 5.17, pack_gqa + SDPA on 5.2x), as the model runs it.

    python -m codegen.decode_attention.bench [--slots 1040 --length 1024 --dtype bfloat16]

Every config of the family's search space is timed: the FUSED ones launch one kernel (the split
kernel, whose last split program per (batch, kv head) merges the partials), the others the split
kernel and then the combine kernel, SPLITS 1 one kernel and no partials. Each timing is the
median of CUDA-event timings after warm-up (triton.testing.do_bench), and also inside one CUDA
graph of 20 calls (what a graphed decode step pays: no launch gaps). A config's error is
checked after its first call and again after the graph's replays (a FUSED config's counters
must be back at zero after each call for the next to merge right).
"""

from __future__ import annotations

import argparse
import json

import torch

from codegen.decode_attention.reference import decode_attention, make_case, make_inputs

GRAPH_CALLS = 20


def graph_us(calls) -> float:
    """Per-call device time of `calls` (functions of no argument) captured one after another
    in one CUDA graph: the median of 20 replays over the number of calls."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for fn in calls[:3]:
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    times = []
    for _ in range(20):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    return sorted(times)[len(times) // 2]


def _graph_us(fn) -> float:
    """Per-call device time of `fn` captured GRAPH_CALLS times in one CUDA graph."""
    return graph_us([fn] * GRAPH_CALLS)


def run(batch: int, heads: int, kv_heads: int, head_dim: int, slots: int, length: int,
        dtype: str) -> dict:
    import tempfile
    from pathlib import Path

    import triton

    from codegen.decode_attention.kernel import render, search_space
    from core.source import load_forward

    case = {**make_case(batch, heads, kv_heads, head_dim, slots, dtype), "exact_slots": slots,
            "length": length}
    q, k, v, n, mask = make_inputs(case, "cuda", torch.Generator("cuda").manual_seed(0))
    scale = case["scale"]
    want = decode_attention(q.double(), k.double(), v.double(), n, mask, scale=scale)
    hf_out = decode_attention(q, k, v, n, mask, scale=scale)
    hf_err = (hf_out.double() - want).abs().max().item()
    hf = {"us": triton.testing.do_bench(lambda: decode_attention(q, k, v, n, mask, scale=scale))
          * 1e3, "graph_us": _graph_us(lambda: decode_attention(q, k, v, n, mask, scale=scale))}
    kv_bytes = 2 * batch * kv_heads * length * head_dim * q.element_size()
    rows = []
    tmp = Path(tempfile.mkdtemp(prefix="decode_attention_bench_"))
    for i, config in enumerate(search_space(case)):
        # the rendered candidate, as the search writes and times it
        path = tmp / f"cand_{i}.py"
        path.write_text(render(config, case))
        forward = load_forward(path)
        out = torch.empty_like(hf_out)

        def call(forward=forward, out=out):
            forward(q, k, v, n, mask, out=out, scale=scale)

        call()
        err = (out.double() - want).abs().max().item()
        us = triton.testing.do_bench(call) * 1e3
        graph_us = _graph_us(call)
        out.fill_(float("nan"))
        call()  # after the graph's replays
        err_after = (out.double() - want).abs().max().item()
        bound = max(2 * hf_err, 1e-2 if dtype != "float32" else 1e-5)
        row = {"config": config, "kernels": 1 if config.get("FUSED") or config["SPLITS"] == 1
               else 2, "us": us, "graph_us": graph_us, "max_abs_err": err,
               "max_abs_err_after_graph": err_after,
               "ok": err <= bound and err_after <= bound,
               "GBps_graph": kv_bytes / graph_us / 1e3}
        rows.append(row)
        print(json.dumps(row))
    best = min(rows, key=lambda r: r["graph_us"])
    summary = {"case": case, "hf_us": hf["us"], "hf_graph_us": hf["graph_us"],
               "hf_max_abs_err": hf_err, "best": best,
               "speedup_graph": hf["graph_us"] / best["graph_us"],
               "all_ok": all(r["ok"] for r in rows), "kv_bytes": kv_bytes}
    print(json.dumps(summary))
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--slots", type=int, default=1040)
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--dtype", default="bfloat16")
    a = ap.parse_args()
    run(a.batch, a.heads, a.kv_heads, a.head_dim, a.slots, a.length, a.dtype)


if __name__ == "__main__":
    main()

"""Does one GEMM over [Wq; Wk; Wv], in place of the attention's three projections, make a graphed
decode step (and a graphed b1 prefill) faster, and by how much (GPU)?

    python benchmarks/probes/qkv_grouping.py MODEL [OUT.json] [--mode decode|prefill]
        [--seq 1024] [--rounds 30] [--run-dir RUN_DIR --workload KEY]

Why: once a decode step is one CUDA graph, its projections decide it. Llama-3.2-1B b1 KV 1024
graphed with the shipped set takes 1.46 ms against a weight-read floor near 0.59 ms, and the
verified kernel times put its q, k and v projections at 9.5, 7.9 and 7.9 us per layer: 12.6 MB
of weight read at 0.5 TB/s, where one read of the same bytes as a single GEMV runs at 2 TB/s or
more (gate/up's 33.5 MB in 17 us). Grouping removes two kernels per layer and lets one launch
stream all three weights. Llama, Qwen2, Mistral and Gemma keep q/k/v as three Linears; Phi-3 and
GPT-2 already fuse them.

What it runs: the model (random weights, bf16) captured as a CUDA graph twice, as HF builds it
and with `group(model)`, side by side in rotating rounds: per-round ratio with its bootstrap
CI, kernels per step, and the largest logits difference against the ungrouped eager step.
`--run-dir` patches that run's graph set in first (`apply_kernels(graph_set=True)`), so the
answer is about what ships. codegen/qkv_proj groups the three in one Triton launch without a
copy; this asks what cuBLAS over a concatenated copy gives, the candidate that family does not
search (it costs the copy's memory), so the two can be set side by side.

`group` is the probe's own adapter: per attention module, one concatenated copy of
the three weights (and biases: Qwen2) built once, `extra_bytes` of memory; q_proj runs the one
GEMM and hands k_proj and v_proj their column slices of its output, keyed by the identity and
version of the input tensor, so a call with any other input runs the module's own code.
Column slices are a layout the run's rope and kv_cache kernels were not verified on: with
`--run-dir` they may run HF's code there, which the kernels-per-step count shows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from codegen.qkv_proj.patch import attentions
from models.patching import wrap_instance_forward

NAMES = ("q_proj", "k_proj", "v_proj")


def group(model: nn.Module):
    """Group the projections of every attention qkv_proj would take
    (`codegen.qkv_proj.patch.attentions`); returns the undo (with `extra_bytes`)."""
    undos, extra = [], 0
    for m in attentions(model):
        lins = [getattr(m, n) for n in NAMES]
        with torch.no_grad():
            w = torch.cat([li.weight for li in lins]).contiguous()
            b = None if lins[0].bias is None else torch.cat([li.bias for li in lins])
        extra += w.nbytes + (0 if b is None else b.nbytes)
        widths = [li.weight.shape[0] for li in lins]
        pending: dict[str, tuple] = {}

        def lead(below, w=w, b=b, widths=widths, pending=pending):
            def forward(x):
                if torch.is_grad_enabled() or x.dtype != w.dtype or x.device != w.device:
                    return below(x)
                q, k, v = F.linear(x, w, b).split(widths, dim=-1)
                pending["k_proj"] = (x, x._version, k)
                pending["v_proj"] = (x, x._version, v)
                return q
            return forward

        def follow(name, pending=pending):
            def wrap(below):
                def forward(x):
                    hit = pending.pop(name, None)
                    if hit is not None and hit[0] is x and hit[1] == x._version:
                        return hit[2]
                    return below(x)
                return forward
            return wrap

        undos.append(wrap_instance_forward(lins[0], lead))
        undos += [wrap_instance_forward(li, follow(n)) for li, n in zip(lins[1:], NAMES[1:])]

    def undo() -> None:
        for u in reversed(undos):
            u()
        undos.clear()

    undo.extra_bytes = extra
    return undo


def _variant(model, mode: str, seq: int):
    """(call, logits of one step, close) for the model as it is now, captured as a graph."""
    from models.graphs import GraphedPrefill, StaticDecoder

    gen = torch.Generator("cuda").manual_seed(0)
    if mode == "prefill":
        ids = torch.randint(0, model.config.vocab_size, (1, seq), device="cuda", generator=gen)
        g = GraphedPrefill(model, ids)

        def call():
            g(ids)
        return call, g(ids).float().clone(), g.close
    ids = torch.randint(0, model.config.vocab_size, (1, seq), device="cuda", generator=gen)
    dec = StaticDecoder(model, 1, seq + 16, graph=True)
    dec.prefill(ids)
    tok = ids[:, -1:]

    def step():
        dec.rewind(seq)
        return dec.step(tok)
    return step, step().float().clone(), dec.close


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from head_to_head import kernels_per_pass

    from profiling.loader import build, resolve
    from verify.stats import bootstrap_ci

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("out", nargs="?")
    ap.add_argument("--mode", choices=("decode", "prefill"), default="decode")
    ap.add_argument("--seq", type=int, default=None, help="KV length (decode) or prompt length")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--run-dir")
    ap.add_argument("--workload")
    a = ap.parse_args()
    seq = a.seq or (1024 if a.mode == "decode" else 128)
    model = build(resolve(a.model), torch.bfloat16, "cuda")
    if a.run_dir:
        from pipeline.api import apply_kernels

        apply_kernels(model, a.run_dir, a.workload, graph_set=True)
    result = {"model": a.model, "mode": a.mode, "seq": seq, "run_dir": a.run_dir,
              "groups": len(attentions(model))}
    with torch.no_grad():
        plain, ref, close_plain = _variant(model, a.mode, seq)
        undo = group(model)
        grouped, got, close_grouped = _variant(model, a.mode, seq)
        result["extra_bytes"] = undo.extra_bytes
        result["max_abs_logits_diff"] = (got - ref).abs().max().item()
        result["ref_abs_max"] = ref.abs().max().item()
        calls = {"graph": plain, "graph-qkv": grouped}
        times: dict[str, list[float]] = {k: [] for k in calls}
        for call in calls.values():  # warm both before the first timed round
            for _ in range(20):
                call()
        torch.cuda.synchronize()
        for i in range(a.rounds):
            order = list(calls)[i % 2:] + list(calls)[:i % 2]
            for name in order:
                torch.cuda.synchronize()
                t = time.perf_counter()
                for _ in range(10):
                    calls[name]()
                torch.cuda.synchronize()
                times[name].append((time.perf_counter() - t) * 100)  # ms per call
        result["kernels_per_step"] = {k: kernels_per_pass(c)[0] for k, c in calls.items()}
        close_grouped()
        undo()
        close_plain()
    est, lo, hi = bootstrap_ci([p / g for p, g in zip(times["graph"], times["graph-qkv"])])
    result["median_ms"] = {k: statistics.median(v) for k, v in times.items()}
    result["grouped_over_plain"] = {"speedup": est, "ci": [lo, hi]}
    result["times_ms"] = times
    print(json.dumps({k: v for k, v in result.items() if k != "times_ms"}, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

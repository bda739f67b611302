"""Every decode_attention config at Llama-3.2-1B's decode step, timed in CUDA graphs (GPU).

    PYTHONPATH=. python3 benchmarks/probes/decode_attention_configs.py [--out OUT.json]

The family's search space, beside the SDPA path HF runs. The case: batch 1, 32 query heads over
8 kv heads, head_dim 64, a static cache of 1280 slots with 1025 valid (the first step after a
1024-token prompt), bf16, the bool mask row HF passes. Each config is rendered as the search
renders it and compiled once; its time per call is a CUDA graph of 20 back-to-back calls
replayed (replay time over 20, median of 20 replays), with the same cache in every call (K and V
stay in L2), and again over as many distinct caches as cover twice the L2 (each call's K and V
come from DRAM, as in a decode step, where the layers' weights stream through L2 between two
attention calls). GB/s: the valid slots' K and V bytes over the time. Each config's result is
checked against the float64 reference after its first call and after the graph replays (a FUSED
config's counters must be back at zero each call). A config that fails to compile or run is
reported in its row. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

BATCH, HEADS, KV_HEADS, HEAD_DIM, SLOTS, LENGTH, DTYPE = 1, 32, 8, 64, 1280, 1025, "bfloat16"
DEVICE = "cuda"  # the CPU test runs the probe's own code under the interpreter, in fp32
WARM_CALLS = 20
MAX_COLD_CALLS = 64  # a cold graph's calls at most (40 cover twice an H100's 50 MiB of L2)
TOL = 2e-2  # bf16, the family's tolerance (tests/codegen/test_decode_attention.py)


def _label(config: dict) -> str:
    kind = "fused" if config.get("FUSED") else "one split" if config["SPLITS"] == 1 else \
        "+combine"
    return (f"{config['SPLITS']} x {config['BLOCK_N']}, {config['num_warps']} warps, "
            f"{config['num_stages']} stages, {kind}")


def _timings(fn, caches, want, out) -> dict:
    """`fn(k, v)` timed warm (one cache) and cold (every cache in turn), its error against
    `want` after the first call and after the replays."""
    from codegen.decode_attention.bench import graph_us

    k, v = caches[0]
    fn(k, v)
    _sync()
    err = (out.double() - want).abs().max().item() if out is not None else 0.0
    warm = graph_us([lambda: fn(k, v)] * WARM_CALLS)
    cold = graph_us([lambda k=k, v=v: fn(k, v) for k, v in caches])
    if out is not None:
        out.fill_(float("nan"))
        fn(k, v)
        _sync()
        err = max(err, (out.double() - want).abs().max().item())
    return {"warm_us": warm, "cold_us": cold, "max_abs_err": err}


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def run() -> dict:
    from codegen.decode_attention.kernel import render, search_space
    from codegen.decode_attention.reference import decode_attention, make_case, make_inputs
    from core.source import load_forward

    case = {**make_case(BATCH, HEADS, KV_HEADS, HEAD_DIM, SLOTS, DTYPE), "exact_slots": SLOTS,
            "length": LENGTH}
    q, k, v, n, mask = make_inputs(case, DEVICE, torch.Generator(DEVICE).manual_seed(0))
    scale = case["scale"]
    want = decode_attention(q.double(), k.double(), v.double(), n, mask, scale=scale)
    cache_bytes = 2 * k.numel() * k.element_size()
    props = torch.cuda.get_device_properties(0) if DEVICE == "cuda" else None
    l2 = getattr(props, "L2_cache_size", 0) or 50 * 2**20
    copies = min(MAX_COLD_CALLS, max(WARM_CALLS, math.ceil(2 * l2 / cache_bytes)))
    caches = [(k, v)] + [(k.clone(), v.clone()) for _ in range(copies - 1)]
    kv_bytes = 2 * BATCH * KV_HEADS * LENGTH * HEAD_DIM * k.element_size()
    rows = []

    def row(label, kernels, timing):
        r = {"config": label, "kernels": kernels, **timing}
        for key in ("warm", "cold"):
            if f"{key}_us" in r:
                r[f"{key}_GBps"] = kv_bytes / r[f"{key}_us"] / 1e3
        rows.append(r)
        print(f"  {label}: " + (f"{r['warm_us']:.2f} us warm, {r['cold_us']:.2f} us cold"
                                if "warm_us" in r else r["error"]), file=sys.stderr, flush=True)

    started = time.monotonic()
    sdpa = decode_attention(q, k, v, n, mask, scale=scale)
    row("HF sdpa_attention_forward (SDPA)", None,
        _timings(lambda k, v: decode_attention(q, k, v, n, mask, scale=scale), caches, want,
                 None) | {"max_abs_err": (sdpa.double() - want).abs().max().item()})
    folder = Path(tempfile.mkdtemp(prefix="decode_attention_configs_"))
    for i, config in enumerate(search_space(case)):
        kernels = 1 if config.get("FUSED") or config["SPLITS"] == 1 else 2
        try:
            path = folder / f"cand_{i}.py"
            path.write_text(render(config, case))
            forward = load_forward(path)
            out = torch.empty_like(sdpa)
            timing = _timings(lambda k, v, f=forward, o=out: f(q, k, v, n, mask, out=o,
                                                               scale=scale),
                              caches, want, out)
        except Exception as e:  # a config that fails is a row of the table, not the end
            row(_label(config), kernels, {"error": f"{type(e).__name__}: "
                                                  f"{str(e).strip().splitlines()[0][:200]}"})
            continue
        row(_label(config), kernels, {**timing, "ok": timing["max_abs_err"] <= TOL,
                                      "config_dict": config})
    return {"device": props.name if props else DEVICE, "case": case, "kv_bytes": kv_bytes,
            "cold_caches": copies, "l2_bytes": l2, "seconds": time.monotonic() - started,
            "rows": rows}


def table(result: dict) -> str:
    rows = result["rows"]
    timed = [r for r in rows[1:] if "warm_us" in r and r.get("ok")]
    best = {key: min((r[f"{key}_us"] for r in timed), default=None) for key in ("warm", "cold")}
    lines = [f"decode_attention configs, {result['device']}: batch {BATCH}, {HEADS}/{KV_HEADS} "
             f"heads, head_dim {HEAD_DIM}, {SLOTS} slots, length {LENGTH}, {DTYPE}, bool mask; "
             f"K+V read {result['kv_bytes'] / 1e6:.2f} MB; per call inside a CUDA graph; "
             f"cold: {result['cold_caches']} caches in turn "
             f"(L2 {result['l2_bytes'] / 2**20:.0f} MiB); * fastest", "",
             "| config | kernels | us/call warm L2 | GB/s | us/call cold | GB/s | max abs err |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "warm_us" not in r:
            lines.append(f"| {r['config']} | {r['kernels']} | failed: {r['error']} | | | | |")
            continue
        cells = []
        for key in ("warm", "cold"):
            mark = "*" if r in timed and r[f"{key}_us"] == best[key] else ""
            cells += [f"{r[f'{key}_us']:.2f}{mark}", f"{r[f'{key}_GBps']:.0f}"]
        err = f"{r['max_abs_err']:.2e}" + ("" if r.get("ok", True) else " (over tolerance)")
        lines.append(f"| {r['config']} | {r['kernels'] or '-'} | " + " | ".join(cells)
                     + f" | {err} |")
    lines.append("")
    lines.append(f"{len(rows) - 1} configs in {result['seconds']:.0f} s")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="also write the rows as JSON here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("decode_attention_configs: needs a CUDA GPU (torch.cuda.is_available() is "
                 "False)")
    result = run()
    print(table(result))
    if args.out:
        from core.artifacts import write_json

        write_json(args.out, result)


if __name__ == "__main__":
    main()

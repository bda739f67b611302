"""The decode GEMV table: every projection shape of a decode step, cuBLAS against the gemv
family's rendered configs (and the gate/up pair against matmul_epilogue's GEMV with the gated
epilogue), timed inside CUDA graphs with cold weights, each with its achieved GB/s beside the
copy bandwidth `pipeline calibrate` measures; one JSON line per shape, a markdown table at the
end.

    python -m codegen.gemv.bench [--models llama-3.2-1b,llama-3.1-8b,qwen2.5-0.5b]
        [--rows 1,8] [--max-configs N] [--out DIR]

GB/s: the bytes a GEMV must move (weights, x, the output; gpt-fast's "achieved bandwidth")
over its time. Weights are cold: each graph cycles over copies of them worth more than three
L2s (an H100's 50 MB would otherwise hold Llama's k/v projection and overstate it), as a
decode step finds them, each layer's weights read once per token. Every config of
`search_space` (or its first `--max-configs`: cuBLAS and the best guesses, for the tall
projections the FUSED split guess first), rendered as the search writes it, is checked against
the float64 product first; the fastest verified one is "ours", whichever kind it is.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

GRAPH_CALLS = 24  # calls per graph at least; one per weight copy where there are more
COLD_BYTES = 160 << 20  # weights cycled per graph: over three L2s of an H100 or H200
MAX_COPIES = 1024  # Qwen2.5-0.5B's k/v projection (224 KiB) needs 732

SHAPES = {  # model: {name: (k, n, bias)}; q/o share a shape where heads x head_dim == hidden
    "llama-3.2-1b": {"q/o": (2048, 2048, False), "k/v": (2048, 512, False),
                     "gate/up": (2048, 8192, False), "down": (8192, 2048, False),
                     "lm_head": (2048, 128256, False)},
    "llama-3.1-8b": {"q/o": (4096, 4096, False), "k/v": (4096, 1024, False),
                     "gate/up": (4096, 14336, False), "down": (14336, 4096, False),
                     "lm_head": (4096, 128256, False)},
    "qwen2.5-0.5b": {"q": (896, 896, True), "k/v": (896, 128, True),
                     "o": (896, 896, False), "gate/up": (896, 4864, False),
                     "down": (4864, 896, False), "lm_head": (896, 151936, False)},
}


def gemv_bytes(rows: int, k: int, n: int, bias: bool, element: int, weights: int = 1) -> int:
    """What the call must move: `weights` (n, k) weights, x, the output (and the bias)."""
    return (weights * n * k + rows * k + rows * n + (n if bias else 0)) * element


def gbps(nbytes: int, us: float) -> float:
    return round(nbytes / us / 1e3, 1)


def copies_for(weight_bytes: int) -> int:
    return max(1, min(MAX_COPIES, math.ceil(COLD_BYTES / weight_bytes)))


def graph_us(calls: list) -> float:
    """Per-call device time of `calls` (cycled to GRAPH_CALLS where fewer) in one CUDA graph
    (median of 20 replays, CUDA events)."""
    n = max(GRAPH_CALLS, len(calls))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm outside the capture
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(n):
            calls[i % len(calls)]()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    times = []
    for _ in range(20):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / n)
    return sorted(times)[len(times) // 2]


def first(configs: list, budget: int | None) -> list:
    """The first `budget` configs (all: None): the spaces list cuBLAS, then their best
    guesses, last the interpreter's cheapest."""
    return list(configs[:budget] if budget else configs)


def _rendered(family, config: dict, case: dict, tmp: Path, tag: str):
    from core.source import load_forward

    path = tmp / f"{tag}.py"
    path.write_text(family.render(config, case))
    return load_forward(path)


def run_shape(model: str, name: str, k: int, n: int, bias: bool, rows: int, dtype: str,
              tmp: Path, budget: int | None) -> dict:
    from codegen.gemv import FAMILY
    from codegen.gemv.reference import make_case, make_inputs

    case = make_case(rows, k, n, dtype, bias, (rows, 1))
    gen = torch.Generator("cuda").manual_seed(0)
    sets = [make_inputs(case, "cuda", gen) for _ in range(copies_for(n * k * 2))]
    x, w, *b = sets[0]
    exact = F.linear(x.double(), w.double(), *(t.double() for t in b))
    tol = 1e-5 if dtype == "float32" else 1e-2
    scale = exact.abs().max().item()
    nbytes = gemv_bytes(rows, k, n, bias, x.element_size())
    cublas_us = graph_us([lambda s=s: F.linear(*s) for s in sets])
    results = []
    for i, config in enumerate(first(FAMILY.search_space(case), budget)):
        tag = f"{model}_{name.replace('/', '_')}_{rows}_{i}".replace(".", "_").replace("-", "_")
        forward = _rendered(FAMILY, config, case, tmp, tag)
        outs = [torch.empty((rows, 1, n), dtype=x.dtype, device="cuda") for _ in sets]

        def call(s, o, forward=forward):
            forward(*s, out=o, n=n, layout="linear")

        call(sets[0], outs[0])
        torch.cuda.synchronize()
        err = (outs[0].double() - exact).abs().max().item()
        us = graph_us([lambda s=s, o=o: call(s, o) for s, o in zip(sets, outs)])
        results.append({"config": config, "us": us, "ok": err <= tol * max(1.0, scale)})
    best = min((r for r in results if r["ok"]), key=lambda r: r["us"], default=None)
    line = {"model": model, "shape": name, "rows": rows, "k": k, "n": n, "bias": bias,
            "bytes": nbytes, "cublas_us": round(cublas_us, 2),
            "cublas_GBps": gbps(nbytes, cublas_us), "all_ok": all(r["ok"] for r in results),
            "configs": [{"config": r["config"], "us": round(r["us"], 2), "ok": r["ok"]}
                        for r in results]}
    if best is not None:
        line.update(best_us=round(best["us"], 2), best_GBps=gbps(nbytes, best["us"]),
                    best_config=best["config"], speedup=round(cublas_us / best["us"], 3))
    return line


def run_gate_up(model: str, k: int, n: int, rows: int, dtype: str, tmp: Path,
                budget: int | None) -> dict:
    """The gate/up pair with SiLU-and-multiply: HF's chain (two cuBLAS GEMVs, silu, mul)
    against matmul_epilogue's GEMV kernel (one launch)."""
    from codegen.matmul_epilogue import FAMILY
    from codegen.matmul_epilogue.reference import make_case, make_inputs

    case = make_case(rows, k, n, dtype, "silu", lead=(rows, 1))
    gen = torch.Generator("cuda").manual_seed(0)
    sets = [make_inputs(case, "cuda", gen) for _ in range(copies_for(2 * n * k * 2))]
    x = sets[0][0]
    exact = FAMILY.reference(*(t.double() for t in sets[0]))
    nbytes = gemv_bytes(rows, k, n, False, x.element_size(), weights=2)
    hf_us = graph_us([lambda s=s: FAMILY.reference(*s) for s in sets])
    results = []
    gemvs = [c for c in FAMILY.search_space(case) if c.get("GEMV")]
    for i, config in enumerate(first(gemvs, budget)):
        tag = f"{model}_gate_up_{rows}_{i}".replace(".", "_").replace("-", "_")
        forward = _rendered(FAMILY, config, case, tmp, tag)
        outs = [FAMILY.make_out(case, s) for s in sets]
        forward(*sets[0], out=outs[0], act="silu")
        torch.cuda.synchronize()
        err = (outs[0].double() - exact).abs().max().item()
        us = graph_us([lambda s=s, o=o, f=forward: f(*s, out=o, act="silu")
                       for s, o in zip(sets, outs)])
        results.append({"config": config, "us": us,
                        "ok": err <= 2.5e-2 * max(1.0, exact.abs().max().item())})
    best = min((r for r in results if r["ok"]), key=lambda r: r["us"], default=None)
    line = {"model": model, "shape": "gate+up+silu*mul", "rows": rows, "k": k, "n": n,
            "bias": False, "bytes": nbytes, "cublas_us": round(hf_us, 2),
            "cublas_GBps": gbps(nbytes, hf_us), "all_ok": all(r["ok"] for r in results),
            "configs": [{"config": r["config"], "us": round(r["us"], 2), "ok": r["ok"]}
                        for r in results]}
    if best is not None:
        line.update(best_us=round(best["us"], 2), best_GBps=gbps(nbytes, best["us"]),
                    best_config=best["config"], speedup=round(hf_us / best["us"], 3))
    return line


def config_words(config: dict | None) -> str:
    """A config in a table cell: cuBLAS, or BLOCK_N x BLOCK_K, its splits and how they are
    summed (a second kernel, or FUSED: in the split kernel's last program), "dot" for DOT's
    tensor-core step."""
    if not config:
        return "-"
    if config.get("impl") == "cublas":
        return "cuBLAS"
    words = f"{config['BLOCK_N']}x{config['BLOCK_K']}"
    splits = config.get("SPLIT_K", 1)
    if splits > 1:
        words += f" split {splits}" + (" fused" if config.get("FUSED") else " + sum kernel")
    return words + (" dot" if config.get("DOT") else "")


def markdown(lines: list[dict], copy_gbps: float | None, device: str) -> str:
    ref = f"{copy_gbps:.0f} GB/s" if copy_gbps else "not measured"
    out = [f"# Decode GEMVs on {device}", "",
           f"Copy bandwidth (`pipeline calibrate`): {ref}. Weights cold (copies cycled over "
           f"{COLD_BYTES >> 20} MiB or more), at least {GRAPH_CALLS} calls per CUDA graph. "
           "cuBLAS: F.linear (gate+up+silu*mul: HF's chain of four kernels); ours: the best "
           "verified config (its tile, splits and how they are summed: a second kernel, or "
           "fused into the split kernel).", "",
           "| model | shape | rows | k | n | MB | cuBLAS us | cuBLAS GB/s | ours us | ours GB/s "
           "| of copy | speedup | ours config |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in lines:
        best = r.get("best_GBps")
        frac = f"{best / copy_gbps:.0%}" if best and copy_gbps else "-"
        out.append(f"| {r['model']} | {r['shape']} | {r['rows']} | {r['k']} | {r['n']} | "
                   f"{r['bytes'] / 1e6:.1f} | {r['cublas_us']} | {r['cublas_GBps']} | "
                   f"{r.get('best_us', '-')} | {best or '-'} | {frac} | "
                   f"{r.get('speedup', '-')} | {config_words(r.get('best_config'))} |")
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="llama-3.2-1b,llama-3.1-8b,qwen2.5-0.5b")
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-configs", type=int, default=None,
                    help="configs per shape: the first N of the space (cuBLAS, best guesses)")
    ap.add_argument("--out", default=None, help="folder for gemv_table.json and .md")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("codegen.gemv.bench: no CUDA GPU here")
    from profiling.roofline import ceilings

    copy = ceilings("cuda").get("bandwidth_GBps")
    models = a.models.split(",")
    unknown = [m for m in models if m not in SHAPES]
    if unknown:
        raise SystemExit(f"unknown model {unknown[0]!r}; known: {', '.join(SHAPES)}")
    tmp = Path(tempfile.mkdtemp(prefix="gemv_bench_"))
    device = torch.cuda.get_device_name(0)
    lines = []

    def done(line: dict) -> None:
        """One shape measured: its line printed, the table rewritten (a run cut off at its
        time limit keeps every shape it finished)."""
        lines.append(line)
        print(json.dumps({key: v for key, v in line.items() if key != "configs"}), flush=True)
        if a.out:
            from core.artifacts import write_json, write_text

            out = Path(a.out)
            out.mkdir(parents=True, exist_ok=True)
            write_json(out / "gemv_table.json", {"device": device, "copy_GBps": copy,
                                                 "lines": lines})
            write_text(out / "gemv_table.md", markdown(lines, copy, device))

    for model in models:
        for rows in (int(r) for r in a.rows.split(",")):
            for name, (k, n, bias) in SHAPES[model].items():
                done(run_shape(model, name, k, n, bias, rows, a.dtype, tmp, a.max_configs))
            k, n, _ = SHAPES[model]["gate/up"]
            done(run_gate_up(model, k, n, rows, a.dtype, tmp, a.max_configs))
    print(markdown(lines, copy, device))


if __name__ == "__main__":
    main()

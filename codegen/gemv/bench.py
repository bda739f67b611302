"""GPU timing of the rendered GEMV candidates against cuBLAS (F.linear) inside CUDA graphs, at a
model's decode projection shapes, with a correctness check; one JSON line per shape.

    python -m codegen.gemv.bench [--model llama-3.2-1b|qwen2.5-0.5b] [--rows 1,8] [--out F.json]

Every config of `search_space`, rendered as the search writes it, is timed as GRAPH_CALLS calls
captured in one graph (what a graphed decode step pays per projection) and checked against the
float64 product. Each line gives cuBLAS's and the best config's time and TB/s of weight read,
and where the best sits in the search order (`best_rank`: the search measures the first
--max-configs of it, 4 in benchmarks/gpu_graphs.sh).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from codegen.decode_attention.bench import _graph_us
from codegen.gemv.reference import make_case, make_inputs

SHAPES = {  # model: {name: (k, n, bias)}
    "llama-3.2-1b": {"q/o": (2048, 2048, False), "k/v": (2048, 512, False),
                     "gate/up": (2048, 8192, False), "down": (8192, 2048, False),
                     "lm_head": (2048, 128256, False)},
    "qwen2.5-0.5b": {"q": (896, 896, True), "k/v": (896, 128, True),
                     "o": (896, 896, False), "gate/up": (896, 4864, False),
                     "down": (4864, 896, False), "lm_head": (896, 151936, False)},
}


def run_shape(name: str, k: int, n: int, bias: bool, rows: int, dtype: str, tmp: Path) -> dict:
    from codegen.gemv.kernel import render, search_space
    from core.source import load_forward

    case = make_case(rows, k, n, dtype, bias, (rows, 1))
    inputs = make_inputs(case, "cuda", torch.Generator("cuda").manual_seed(0))
    x, w, *b = inputs
    exact = F.linear(x.double(), w.double(), *(t.double() for t in b))
    tol = 1e-5 if dtype == "float32" else 1e-2
    scale = exact.abs().max().item()
    cublas_us = _graph_us(lambda: F.linear(x, w, *b))
    results = []
    for i, config in enumerate(search_space(case)):
        path = tmp / f"{name.replace('/', '_')}_{rows}_{i}.py"
        path.write_text(render(config, case))
        forward = load_forward(path)
        out = torch.empty((rows, 1, n), dtype=x.dtype, device="cuda")

        def call(forward=forward, out=out):
            forward(*inputs, out=out, n=n, layout="linear")

        call()
        torch.cuda.synchronize()
        err = (out.double() - exact).abs().max().item()
        results.append({"rank": i, "config": config, "graph_us": _graph_us(call),
                        "max_abs_err": err, "ok": err <= tol * max(1.0, scale)})
    best = min(results, key=lambda r: r["graph_us"])
    weight = n * k * x.element_size()
    return {"shape": name, "rows": rows, "k": k, "n": n, "bias": bias,
            "cublas_us": round(cublas_us, 2), "cublas_TBps": round(weight / cublas_us / 1e6, 2),
            "best_us": round(best["graph_us"], 2),
            "best_TBps": round(weight / best["graph_us"] / 1e6, 2),
            "speedup": round(cublas_us / best["graph_us"], 3), "best_rank": best["rank"],
            "best_config": best["config"], "all_ok": all(r["ok"] for r in results),
            "configs": [{"rank": r["rank"], "us": round(r["graph_us"], 2), "ok": r["ok"]}
                        for r in results]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3.2-1b", choices=sorted(SHAPES))
    ap.add_argument("--rows", default="1")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="gemv_bench_"))
    lines = []
    for rows in (int(r) for r in a.rows.split(",")):
        for name, (k, n, bias) in SHAPES[a.model].items():
            line = run_shape(name, k, n, bias, rows, a.dtype, tmp)
            print(json.dumps({key: v for key, v in line.items() if key != "configs"}),
                  flush=True)
            lines.append(line)
    if a.out:
        Path(a.out).write_text(json.dumps(lines, indent=1))


if __name__ == "__main__":
    main()

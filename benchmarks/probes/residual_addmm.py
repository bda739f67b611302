"""Probe: is the residual add worth folding into the o/down projection's GEMM epilogue?

A pre-norm decoder layer ends with `hidden = residual + down_proj(x)`: the GEMM writes its
output, and an elementwise add reads it back with the residual and writes the sum (three
passes over a (tokens, hidden) tensor). cuBLAS can add C in its epilogue (beta = 1): in place
on a residual the layer owns (`residual.addmm_(x, W.t())`) the GEMM reads C once and writes
the sum in place of its output, so one pass replaces the add's three. Out of place
(`torch.addmm(residual, ...)`) torch copies C into the output first, which costs what it saves.

Times, at the prefill shapes (8192 tokens, bf16) of the b8 s1024 models, for the o and down
projections: HF's linear then add, torch.addmm out of place, and addmm_ in place; the error of
each against an fp32 reference next to the HF form's own. CUDA graphs of 40 calls, median of
20 replays (gemv.graphed_us; the GEMMs' inputs fit no L2, so no flush).

GPU only. Usage: python3 benchmarks/probes/residual_addmm.py OUT.json
"""

from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F
from gemv import graphed_us  # benchmarks/probes/gemv.py, beside this file

# (model, hidden, intermediate): the o projection is hidden x hidden (heads x head_dim is the
# hidden size in all four), the down projection intermediate -> hidden
MODELS = (("llama-3.2-1b", 2048, 8192), ("qwen2.5-0.5b", 896, 4864),
          ("gemma-2b", 2048, 16384), ("phi-3-mini", 3072, 8192))
TOKENS = 8192


def one(k: int, n: int) -> dict:
    torch.manual_seed(0)
    x = torch.randn(TOKENS, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    res = torch.randn(TOKENS, n, device="cuda", dtype=torch.bfloat16)
    ref = (res.float() + x.float() @ w.float().t())
    hf = res + F.linear(x, w)
    r2 = res.clone()
    r2.addmm_(x, w.t())
    err = {"hf": (hf.float() - ref).abs().max().item(),
           "addmm_": (r2.float() - ref).abs().max().item()}
    scratch = res.clone()
    out = {
        "linear": graphed_us(lambda: F.linear(x, w)),
        "linear+add": graphed_us(lambda: res + F.linear(x, w)),
        "addmm": graphed_us(lambda: torch.addmm(res, x, w.t())),
        # in place on a scratch copy: its values drift over the replays, the work does not
        "addmm_": graphed_us(lambda: scratch.addmm_(x, w.t())),
    }
    return {"k": k, "n": n, "us": out, "max_abs_error": err,
            "saved_us": out["linear+add"] - out["addmm_"]}


def main(path: str) -> None:
    rows = {}
    for model, hidden, inter in MODELS:
        rows[model] = {"o_proj": one(hidden, hidden), "down_proj": one(inter, hidden)}
        for proj, r in rows[model].items():
            print(model, proj, {k: round(v, 1) for k, v in r["us"].items()},
                  "saved", round(r["saved_us"], 1), "err", r["max_abs_error"], flush=True)
    result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "tokens": TOKENS, "rows": rows}
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    if len(sys.argv) != 2 or not torch.cuda.is_available():
        raise SystemExit("usage (GPU only): python3 benchmarks/probes/residual_addmm.py OUT.json")
    main(sys.argv[1])

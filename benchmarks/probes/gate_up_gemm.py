"""One [gate; up] GEMM or two (GPU): from how many tokens does gated_act's GateUp fusion cost
GEMM time? Issue 29: at b8 s1024 (8192 tokens) the patched pass's fused gate/up GEMM ran in
another cuBLAS kernel and took 3.6 % (Llama-3.2-1B) and 10.1 % (Gemma-2B) longer than the two
GEMMs it replaced (the re-profiles of optimize --top 5).

    python benchmarks/probes/gate_up_gemm.py [OUT.json]

Per MLP shape (hidden, intermediate) and token count: two F.linear calls against one on the
concatenated weight, timed with `verify.timing.bench` (CUDA events, L2 flushed, medians).
"""

from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F

from verify.timing import bench

SHAPES = {"llama-3.2-1b": (2048, 8192), "qwen2.5-0.5b": (896, 4864), "gemma-2b": (2048, 16384)}
TOKENS = (1, 16, 128, 512, 1024, 2048, 4096, 8192)


def timed(fn) -> float:
    return bench(fn, device="cuda").median_ms * 1e3


def main() -> None:
    rows = []
    for model, (hidden, inter) in SHAPES.items():
        wg = torch.randn(inter, hidden, device="cuda", dtype=torch.bfloat16) * 0.02
        wu = torch.randn(inter, hidden, device="cuda", dtype=torch.bfloat16) * 0.02
        wgu = torch.cat([wg, wu])
        for n in TOKENS:
            x = torch.randn(n, hidden, device="cuda", dtype=torch.bfloat16)
            two = timed(lambda x=x, wg=wg, wu=wu: (F.linear(x, wg), F.linear(x, wu)))
            one = timed(lambda x=x, wgu=wgu: F.linear(x, wgu))
            rows.append({"model": model, "hidden": hidden, "inter": inter, "tokens": n,
                         "two_us": round(two, 2), "fused_us": round(one, 2),
                         "fused_over_two": round(one / two, 3)})
            print(f"{model:13s} tokens {n:5d}: two {two:8.1f} us, fused {one:8.1f} us, "
                  f"fused/two {one / two:.3f}")
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

"""The board power and SM clock of each kind of GPU work, run alone back to back (GPU).
Issue 29: a patched pass that fuses the memory-bound kernels between its GEMMs away draws the
board to its power cap and runs every compute-bound kernel at a lower clock
(probes/gemm_clocks.py: Phi-3-mini 1830 MHz unpatched, 1545 MHz patched). An energy model of
the pass needs what each kind of work draws; this measures it.

    python benchmarks/probes/power_classes.py [OUT.json]

Phases of about 2.5 s each: idle, a square 8192^3 bf16 GEMM, an LLM-shaped GEMM (8192 tokens
x 2048 -> 8192), a 256 MiB copy, an in-place elementwise multiply (memory-bound), and the
LLM GEMM interleaved with copies at four ratios (the GEMM's share of the time, from the pure
phases: about 0.9, 0.75, 0.5, 0.25), while
nvidia-smi samples the SM clock and the board power every 20 ms (`gemm_clocks.sampler`). Per
phase: the median clock and power of the samples inside it, the samples with the software
power cap active, and the work's own rate (TFLOP/s or GB/s) from the loop's wall time.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gemm_clocks import sampler, samples, summarise  # noqa: E402

SECONDS = 2.5


def phases() -> dict:
    """name -> (the work of one iteration, its FLOPs, its bytes moved)."""
    d, bf = "cuda", torch.bfloat16
    a, b = torch.randn(8192, 8192, device=d, dtype=bf), torch.randn(8192, 8192, device=d, dtype=bf)
    x, w = torch.randn(8192, 2048, device=d, dtype=bf), torch.randn(2048, 8192, device=d, dtype=bf)
    src = torch.empty(1 << 27, device=d, dtype=bf)  # 256 MiB
    dst = torch.empty_like(src)
    llm, copy = 2 * 8192 * 2048 * 8192, 2 * src.numel() * 2

    def mix(g: int, c: int):
        def fn():
            for _ in range(g):
                torch.mm(x, w)
            for _ in range(c):
                dst.copy_(src)
        return fn, g * llm, c * copy

    return {
        "idle": (lambda: time.sleep(0.01), 0, 0),
        "gemm_8192": (lambda: torch.mm(a, b), 2 * 8192 ** 3, 0),
        "gemm_llm": (lambda: torch.mm(x, w), llm, 0),
        "copy_256mib": (lambda: dst.copy_(src), 0, copy),
        "mul_inplace": (lambda: src.mul_(1.0), 0, copy),
        # GEMM and copy interleaved at the scale of a model's kernels: the GEMM's share of
        # the time follows from the two pure phases' times (`gemm_share`)
        **{f"mix_g{g}_c{c}": mix(g, c) for g, c in ((3, 1), (1, 1), (1, 3), (1, 10))},
    }


def run_phase(fn) -> tuple[float, float, int]:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.time()
    n = 0
    while time.time() - t0 < SECONDS:
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
        n += 10
    return t0, time.time(), n


def main() -> None:
    out = sys.argv[1] if len(sys.argv) > 1 else None
    limits = subprocess.run(["nvidia-smi", "--query-gpu=name,power.limit,enforced.power.limit,"
                             "clocks.max.sm", "--format=csv,noheader"],
                            capture_output=True, text=True).stdout.strip()
    print("device:", limits)
    work = phases()
    log = "/tmp/power_classes_smi.csv"
    smi = sampler(log)
    time.sleep(1.0)
    rec = []
    try:
        for name, (fn, flops, nbytes) in work.items():
            t0, t1, n = run_phase(fn)
            per = (t1 - t0) / n
            rec.append({"phase": name, "t0": t0, "t1": t1, "iters": n, "s_per_iter": per,
                        "tflops": flops / per / 1e12 if flops else None,
                        "gbps": nbytes / per / 1e9 if nbytes else None})
    finally:
        smi.terminate()
        smi.wait()
    rows = samples(log)
    pure = {p["phase"]: p["s_per_iter"] for p in rec}
    for p in rec:
        if p["phase"].startswith("mix_"):
            g, c = (int(v[1:]) for v in p["phase"].split("_")[1:])
            t_g, t_c = g * pure["gemm_llm"], c * pure["copy_256mib"]
            p["gemm_share"] = t_g / (t_g + t_c)
        summarise(p, rows, skip_s=0.3)
        rate = (f"share {p['gemm_share']:.2f}" if "gemm_share" in p else
                f"{p['tflops']:.0f} TFLOP/s" if p["tflops"] else
                f"{p['gbps']:.0f} GB/s" if p["gbps"] else "-")
        print(f"{p['phase']:12s} {rate:>14s}  SM {p['sm_mhz']} MHz  {p['power_w']} W  "
              f"{p['temp_c']} C  power-cap samples {p['power_cap']}/{p['samples']}")
    if out:
        with open(out, "w") as f:
            json.dump({"device": limits, "phases": rec}, f, indent=1)


if __name__ == "__main__":
    main()

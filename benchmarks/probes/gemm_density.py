"""Does a pass's GEMMs slow down when the memory-bound work between them shrinks (GPU)?

    python benchmarks/probes/gemm_density.py RUN_DIR [OUT.json] [--scales 1,0.5,0.3,0.15]

Issue 29: the patched b8 pass runs the same cuBLAS GEMMs as the unpatched one, with the same
inputs, yet each takes 5-11 % longer on Llama-3.2-1B and Phi-3-mini (0 on Qwen2.5-0.5B), and
the SM clock reads 1545-1650 MHz against 1755-1845 unpatched under the 700 W cap. If that is
the GEMM-denser pass drawing the board to its cap, a synthetic pass made of the profile's own
GEMMs (and SDPA calls), in order and at their shapes, with device copies standing in for every
other op's profiled time, should reproduce it: scale the copies by k (1: the unpatched pass;
the patched pass's memory-bound time over the unpatched one's: its k) and the GEMMs should
slow as they did. Each pass is captured as one CUDA graph and replayed for `--seconds` before
one profiled replay (the cap acts over hundreds of ms), the SM clock read from nvidia-smi
while it runs. Prints, per k, the compute kernels' time per pass and their ratio to k=1.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from decode_kernels import kernels  # this folder's: run as a script, it is on sys.path

GEMM_OPS = {"aten::linear", "aten::mm", "aten::addmm"}
SDPA = ("aten::scaled_dot_product_attention", "aten::_scaled_dot_product")


def plan(ops: list[dict]) -> list[tuple]:
    """The pass as ("gemm", m, k, n) / ("sdpa", b, h, s, d, kv_h) / ("fill", us) steps, runs of
    other ops merged into one fill."""
    steps, fill = [], 0.0
    for op in ops:
        name, shapes = op["name"], op.get("shapes") or []
        compute = None
        if name in GEMM_OPS and len(shapes) >= 2:
            x, w = (shapes[1], shapes[2]) if name == "aten::addmm" else (shapes[0], shapes[1])
            if x and w and len(w) == 2:
                m = 1
                for d in x[:-1]:
                    m *= d
                n = w[0] if name == "aten::linear" else w[1]
                compute = ("gemm", m, x[-1], n)
        elif name.startswith(SDPA) and len(shapes) >= 2 and len(shapes[0]) == 4:
            b, h, s, d = shapes[0]
            compute = ("sdpa", b, h, s, d, shapes[1][1])
        if compute and op.get("device_us"):
            if fill:
                steps.append(("fill", fill))
                fill = 0.0
            steps.append(compute)
        else:
            fill += op.get("device_us") or 0.0
    if fill:
        steps.append(("fill", fill))
    return steps


def build(steps: list[tuple], scale: float, gbps: float):
    """A callable running `steps` with every fill's copy sized to take `scale` x its time."""
    dev, bf = "cuda", torch.bfloat16
    cache: dict = {}

    def tensor(shape):
        if shape not in cache:
            cache[shape] = torch.randn(shape, device=dev, dtype=bf) / 32
        return cache[shape]

    biggest = max((s[1] for s in steps if s[0] == "fill"), default=0.0) * scale
    # a copy reads and writes its bytes: us * GB/s * 1e3 bytes move per us, half each way
    src = torch.empty(max(1, int(biggest * gbps * 1e3 / 2)), dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    calls = []
    for s in steps:
        if s[0] == "gemm":
            _, m, k, n = s
            x, w = tensor((m, k)), tensor((n, k))
            calls.append(lambda x=x, w=w: F.linear(x, w))
        elif s[0] == "sdpa":
            _, b, h, sq, d, kvh = s
            q, kv = tensor((b, h, sq, d)), tensor((b, kvh, sq, d))
            calls.append(lambda q=q, kv=kv, g=h != kvh: F.scaled_dot_product_attention(
                q, kv, kv, is_causal=True, enable_gqa=g))
        else:
            nbytes = int(s[1] * scale * gbps * 1e3 / 2)
            if nbytes:
                calls.append(lambda nb=nbytes: dst[:nb].copy_(src[:nb]))
    return lambda: [c() for c in calls]


def clock() -> str | None:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw",
                               "--format=csv,noheader"], capture_output=True, text=True,
                              timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("out", nargs="?")
    ap.add_argument("--scales", default="1,0.6,0.4,0.25,0.15")
    ap.add_argument("--seconds", type=float, default=2.0)
    a = ap.parse_args()
    prof = json.loads((a.run_dir / "profile.json").read_text())
    gbps = prof["ceilings"]["bandwidth_GBps"]
    result = {"run": str(a.run_dir), "model": prof["model"], "rows": []}
    for w in prof["workloads"]:
        steps = plan(w["ops"])
        compute = sum(1 for s in steps if s[0] != "fill")
        fill = sum(s[1] for s in steps if s[0] == "fill")
        print(f"{w['key']}: {compute} compute calls, {fill / 1e3:.2f} ms of other ops")
        base = None
        for scale in (float(x) for x in a.scales.split(",")):
            fn = build(steps, scale, gbps)
            g = torch.cuda.CUDAGraph()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn()
            torch.cuda.current_stream().wait_stream(side)
            with torch.cuda.graph(g):
                fn()
            read: list = []
            probe = threading.Timer(a.seconds / 2, lambda read=read: read.append(clock()))
            probe.start()  # read while the replays below run: the clock under this pass
            t0 = time.time()
            while time.time() - t0 < a.seconds:
                g.replay()
                torch.cuda.synchronize()  # no queue of replays running on after the loop
            probe.join()
            mid = read[0] if read else None
            k = kernels(g.replay, 3)
            rows = k.pop("by_name")
            copy_us = sum(r["us_per_step"] for r in rows if "copy" in r["name"].lower()
                          or "memcpy" in r["name"].lower())
            comp = k["gpu_us_per_step"] - copy_us
            base = base or comp
            row = {"workload": w["key"], "scale": scale, "compute_us": comp, "copy_us": copy_us,
                   "compute_share": comp / k["gpu_us_per_step"], "compute_ratio": comp / base,
                   "clock": mid, "span_us": k["span_us_per_step"]}
            result["rows"].append(row)
            print(f"  k={scale:.2f}: compute {comp / 1e3:.2f} ms ({row['compute_ratio']:.3f}x), "
                  f"copies {copy_us / 1e3:.2f} ms, share {row['compute_share']:.2f}, "
                  f"clock/power {mid}")
            del g
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    sys.exit(main())

"""Is the patched pass's slower GEMM work the GPU's clock (GPU)? Issue 29: in Phi-3-mini's
re-profile at b8 s1024 every untouched cuBLAS GEMM ran 10-11 % longer patched than unpatched,
with the same kernel names and the same input layouts (probes/gemm_inputs.py).

    python benchmarks/probes/gemm_clocks.py RUN_DIR WORKLOAD [OUT.json]

Alternating phases of unpatched and patched passes (RUN_DIR's kept set, `apply_kernels`), and
the patched pass replayed as a CUDA graph where graphs shipped for WORKLOAD, while
nvidia-smi samples the SM clock, the board power and the throttle reasons every 20 ms. Per
phase: median pass time, and the median clock and power of the samples inside it. A patched
pass with the memory-bound kernels between its GEMMs fused away runs its GEMMs back to back;
if that draws the board to its power cap, the clock drops and every GEMM slows by as much.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from datetime import datetime
from statistics import median

import torch

from core.artifacts import read_json
from profiling.loader import build, resolve

FIELDS = ("timestamp,clocks.sm,power.draw,temperature.gpu,"
          "clocks_throttle_reasons.sw_power_cap,clocks_throttle_reasons.hw_slowdown,"
          "clocks_throttle_reasons.sw_thermal_slowdown")


def sampler(path: str) -> subprocess.Popen:
    return subprocess.Popen(["nvidia-smi", f"--query-gpu={FIELDS}", "--format=csv,noheader",
                             "-lms", "20"], stdout=open(path, "w"), stderr=subprocess.STDOUT)


def samples(path: str) -> list[tuple[float, list[str]]]:
    out = []
    for line in open(path):
        parts = [p.strip() for p in line.split(",")]
        try:
            t = datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
        except ValueError:
            continue
        out.append((t, parts[1:]))
    return out


def summarise(phase: dict, rows: list, skip_s: float = 0.0) -> None:
    """Into `phase` (with "t0", "t1"): its sample count, the median SM clock, power and
    temperature of the nvidia-smi `rows` inside it (the first `skip_s` left out, a ramp), and
    how many of those samples had each throttle reason active."""
    inside = [v for t, v in rows if phase["t0"] + skip_s <= t <= phase["t1"]]
    phase["samples"] = len(inside)
    for i, name in enumerate(("sm_mhz", "power_w", "temp_c")):
        vals = [x for x in (number(v[i]) for v in inside if len(v) > i) if x is not None]
        phase[name] = median(vals) if vals else None
    for i, name in ((3, "power_cap"), (4, "hw_slowdown"), (5, "thermal")):
        phase[name] = sum(1 for v in inside if len(v) > i and "Active" in v[i]
                          and "Not" not in v[i])


def number(s: str) -> float | None:
    try:
        return float(s.split()[0])
    except (ValueError, IndexError):
        return None


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    run_dir, key = sys.argv[1], sys.argv[2]
    out = sys.argv[3] if len(sys.argv) > 3 else None
    from pipeline.api import apply_kernels

    measured = read_json(f"{run_dir}/integration.json", "integration")["workloads"][key]
    spec = measured["workload"]
    profile = read_json(f"{run_dir}/profile.json", "profile")
    model = build(resolve(profile["model"]["id"]), torch.bfloat16, "cuda")
    ids = torch.randint(0, model.config.vocab_size, (spec["batch"], spec["seq"]), device="cuda")
    handle = None
    graphed = bool((measured.get("graphs") or {}).get("shipped"))
    variants = ("unpatched", "patched") + (("patched-graph",) if graphed else ())

    def run(n: int, call=None) -> list[float]:
        ms = []
        with torch.no_grad():
            for _ in range(n):
                t0 = time.perf_counter()
                call(ids) if call is not None else model(ids, use_cache=False)
                torch.cuda.synchronize()
                ms.append((time.perf_counter() - t0) * 1e3)
        return ms

    run(3)
    log = "/tmp/gemm_clocks_smi.csv"
    smi = sampler(log)
    time.sleep(1.0)
    phases = []
    try:
        for rnd in range(3):
            for variant in variants:
                if variant != "unpatched":
                    handle = apply_kernels(model, run_dir, key,
                                           graphs=variant == "patched-graph")
                call = handle if variant == "patched-graph" else None
                run(1, call)
                t0 = time.time()
                ms = run(8, call)
                phases.append({"round": rnd, "variant": variant, "t0": t0, "t1": time.time(),
                               "pass_ms": ms})
                if handle is not None:
                    handle.undo()
                    handle = None
    finally:
        smi.terminate()
        smi.wait()
    rows = samples(log)
    for p in phases:
        summarise(p, rows)
        print(f"round {p['round']} {p['variant']:13s} {median(p['pass_ms']):8.2f} ms  "
              f"SM {p['sm_mhz']} MHz  {p['power_w']} W  {p['temp_c']} C  power-cap samples "
              f"{p['power_cap']}/{p['samples']}")
    if out:
        with open(out, "w") as f:
            json.dump({"run_dir": str(run_dir), "workload": key, "phases": phases,
                       "smi_first_lines": open(log).read().splitlines()[:3]}, f, indent=1)


if __name__ == "__main__":
    main()

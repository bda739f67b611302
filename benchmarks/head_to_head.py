"""Ours against eager and torch.compile in one process, interleaved, no profiler (GPU).

    python benchmarks/head_to_head.py RUN_DIR OUT.json [--workload KEY] [--rounds 30]

`pipeline optimize` measures ours against eager in its process; benchmarks/contenders.py
measures compile against eager in another, minutes later. On the lent H200 the host's speed
moves within a call, and a patched set that waits on the host moves with it (Qwen2.5-0.5B b8,
run 7: 21.5 ms in one call, 16.7 ms in another, against compile's 21.0 ms), so the two ratios
can disagree by more than either CI. Here one process holds the model as built (eager), a twin
patched with the run's kept kernels for the workload (`pipeline.api.apply_kernels`) and
`torch.compile` of another twin (default mode). Each round times the three, synchronised, in
an order that rotates; the per-round ratios get bootstrap CIs (`verify.stats`). Liger-Kernel
patches module-level code, so it cannot share the process (contenders.py times it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from core.artifacts import read_json
from core.workload import Workload
from pipeline.api import apply_kernels
from pipeline.patching import twin
from profiling.capture import make_runner, sync
from profiling.loader import build, resolve
from verify.stats import bootstrap_ci

VARIANTS = ("eager", "ours", "compile")
FAST_HOST = 1.1  # a round within 10 % of eager's fastest host time counts as a fast host


def timed(call, device: str) -> tuple[float, float]:
    """(wall ms, ms until the call returned: its host time, the GPU's wait aside)."""
    sync(device)
    t = time.perf_counter()
    call()
    returned = time.perf_counter()
    sync(device)
    return (time.perf_counter() - t) * 1e3, (returned - t) * 1e3


def by_host_speed(times: dict, host: dict) -> dict:
    """The rounds split by eager's host time, at FAST_HOST times its fastest round: where ours
    and compile stand when the host ran at its best and when it did not. On the lent H200 the
    host's speed moves within one run, and a host-bound variant moves with it (run 12,
    Qwen2.5-0.5B b8: ours 1.18x of compile in the 4 fast rounds, 0.83x in the other 26), so
    the overall median hides which regime decided it. A split at the median would not have
    shown that: a fast stretch can be a few rounds."""
    cut = FAST_HOST * min(host["eager"])
    out = {}
    for label, fast in (("fast_host", True), ("slow_host", False)):
        idx = [i for i, h in enumerate(host["eager"]) if (h <= cut) == fast]
        if not idx:
            continue
        out[label] = {
            "rounds": len(idx),
            "eager_host_ms": statistics.median(host["eager"][i] for i in idx),
            "median_ms": {k: statistics.median(v[i] for i in idx) for k, v in times.items()},
            "ours_over_compile": statistics.median(times["compile"][i] / times["ours"][i]
                                                   for i in idx),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--workload", help="workload key [default: the run's first]")
    ap.add_argument("--rounds", type=int, default=30)
    args = ap.parse_args()
    profile = read_json(args.run_dir / "profile.json", "profile")
    entry = next(w for w in profile["workloads"]
                 if args.workload in (None, w["key"]))
    workload = Workload.from_dict(entry["workload"])
    model = build(resolve(profile["model"]["id"]), workload.torch_dtype(), workload.device)
    ours = twin(model)
    handle = apply_kernels(ours, args.run_dir, workload=workload.key)
    compiled = torch.compile(twin(model))
    runners = {"eager": make_runner(model, workload), "ours": make_runner(ours, workload),
               "compile": make_runner(compiled, workload)}

    def call(name):
        def run():
            with torch.no_grad():
                runners[name].call()
            runners[name].reset()
        return run

    calls = {name: call(name) for name in VARIANTS}
    t = time.perf_counter()
    for _ in range(3):  # compiles, autotunes, warms the caching allocator
        for name in VARIANTS:
            calls[name]()
    warm_s = time.perf_counter() - t
    times = {name: [] for name in VARIANTS}
    host = {name: [] for name in VARIANTS}
    for i in range(args.rounds):
        order = VARIANTS[i % 3:] + VARIANTS[:i % 3]
        for name in order:
            wall, returned = timed(calls[name], workload.device)
            times[name].append(wall)
            host[name].append(returned)
    handle.undo()

    def ratio(a, b):  # speedup of b over a, per round
        est, lo, hi = bootstrap_ci([x / y for x, y in zip(times[a], times[b])])
        return {"speedup": est, "ci": [lo, hi]}

    result = {
        "run_dir": str(args.run_dir), "workload": workload.key, "kept": handle.families,
        "torch": torch.__version__, "device": torch.cuda.get_device_name(0)
        if workload.device.startswith("cuda") else "cpu",
        "rounds": args.rounds, "warmup_s": warm_s,
        "note": None if workload.device.startswith("cuda") else
        "CPU: our kernels ran in the Triton interpreter; not a GPU timing",
        "median_ms": {k: statistics.median(v) for k, v in times.items()},
        # at about the wall time, that variant's GPU waits on the host
        "median_host_ms": {k: statistics.median(v) for k, v in host.items()},
        "ours_over_eager": ratio("eager", "ours"),
        "compile_over_eager": ratio("eager", "compile"),
        "ours_over_compile": ratio("compile", "ours"),
        "by_host_speed": by_host_speed(times, host),
        "method": "one process, rounds of eager / ours / compile in rotating order, each call "
                  "synchronised; per-round ratios, median and percentile bootstrap 95 % CI",
        "times_ms": times, "host_ms": host,
    }
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k not in ("times_ms", "host_ms")},
                     indent=1))


if __name__ == "__main__":
    main()

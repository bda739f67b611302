"""Does a finished torch.profiler session leave the host slower? (GPU only.)

Kineto leaves CUPTI attached after a session unless TEARDOWN_CUPTI=1 (pytorch/pytorch#144455),
and the issue reports later CUDA calls paying for it. `pipeline optimize` profiles the patched
model (patch_took_effect) in the process that then times baseline against patched, and at
batch 1 the pass is host-bound, so that would tilt the measurement. This times one process's
launch cost and whole pass before and after one profiler session.

    python benchmarks/probes/cupti_probe.py llama-3.2-1b OUT.json [--set-late]

TEARDOWN_CUPTI comes from the environment; --set-late sets it to 1 only just before the
session (after torch was imported and CUDA initialised), to learn when Kineto reads it.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from core.workload import Workload
from profiling.capture import capture, make_runner, wall_time
from profiling.loader import build, resolve


def launch_us(n: int = 2000, reps: int = 7) -> float:
    """Median host microseconds per launch of a one-element add (no sync inside)."""
    x = torch.zeros(1, device="cuda")
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            x.add_(1)
        times.append((time.perf_counter() - t) * 1e6 / n)
        torch.cuda.synchronize()
    return statistics.median(times)


def state(runner, label: str) -> dict:
    w = wall_time(runner, "cuda", warmup=3, reps=30)
    return {"at": label, "launch_us": launch_us(), "wall_ms": w["median_ms"],
            "enqueue_ms": w["enqueue_ms"]}


def main(model_id: str, out: str, set_late: bool) -> None:
    env = os.environ.get("TEARDOWN_CUPTI")
    model = build(resolve(model_id), torch.bfloat16, "cuda")
    runner = make_runner(model, Workload(1, 128, "bfloat16", "cuda"))
    rows = [state(runner, "before any profiler")]
    if set_late:
        os.environ["TEARDOWN_CUPTI"] = "1"
    with tempfile.TemporaryDirectory() as tmp:
        capture(runner, "cuda", Path(tmp) / "t.json.gz")
    rows.append(state(runner, "after one session"))
    time.sleep(2)
    rows.append(state(runner, "2 s later"))
    with tempfile.TemporaryDirectory() as tmp:
        capture(runner, "cuda", Path(tmp) / "t.json.gz")
    rows.append(state(runner, "after a second session"))
    result = {"model": model_id, "workload": "prefill b1 s128 bf16", "TEARDOWN_CUPTI": env,
              "set_late": set_late, "torch": torch.__version__,
              "gpu": torch.cuda.get_device_name(0), "rows": rows}
    Path(out).write_text(json.dumps(result, indent=1))
    for r in rows:
        print(f"{env=} late={set_late} {r['at']:24s} launch {r['launch_us']:.2f} us  "
              f"wall {r['wall_ms']:.2f} ms  enqueue {r['enqueue_ms']:.2f} ms")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], "--set-late" in sys.argv)

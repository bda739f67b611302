"""Reading Chrome/Perfetto traces written by torch.profiler.

Event categories used: `cpu_op` (aten ops), `python_function` (Python frames and
`nn.Module: Class_N` module events, with_stack=True), `cuda_runtime`/`cuda_driver` (launches),
`kernel`/`gpu_memcpy`/`gpu_memset` (device work), `cuda_sync`, `user_annotation`
(`ProfilerStep#N`). Launch and device events share `args.correlation`; a kernel's
`args["External id"]` equals the External id of the cpu_op that launched it.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")


def load_trace(path: str | Path) -> dict:
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


def events(trace: dict, *cats: str) -> list[dict]:
    """Complete ('X') events of the given categories, sorted by start time."""
    evs = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") in cats]
    evs.sort(key=lambda e: (e["ts"], -e.get("dur", 0)))
    return evs


def profiler_steps(trace: dict) -> list[dict]:
    """The host-side ProfilerStep#N spans, in order."""
    return [e for e in events(trace, "user_annotation") if e["name"].startswith("ProfilerStep#")]


def device_events(trace: dict) -> list[dict]:
    """Device work with a real duration (the profiler reports 0 or -1 for a few)."""
    return [e for e in events(trace, *DEVICE_CATS) if e.get("dur", 0) > 0]


def indexed_events(trace: dict, *cats: str) -> list[tuple[int, dict]]:
    """Like `events`, paired with each event's index in `trace["traceEvents"]`.

    The index is a stable id for one loaded file (JSON keeps list order), unlike
    `args.correlation`, which a CUDA graph launch shares among many kernels.
    """
    evs = [
        (i, e)
        for i, e in enumerate(trace["traceEvents"])
        if e.get("ph") == "X" and e.get("cat") in cats
    ]
    evs.sort(key=lambda p: (p[1]["ts"], -p[1].get("dur", 0)))
    return evs

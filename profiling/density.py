"""How a pass's compute-bound kernels slow down as the pass gets denser in them (the power cap).

A fused pass runs the same GEMMs as the unpatched one with less memory-bound work between them.
Under a 700 W cap that draws the board to its limit at a lower SM clock, and every
compute-bound kernel slows by as much: the same cuBLAS GEMMs run up to about a tenth longer in
a patched pass, less on models whose narrow GEMMs draw less (benchmarks/probes/README.md,
`gemm_clocks.py`, `gemm_density.py`, `power_classes.py`). A projection that keeps untouched
work at its profiled time misses by that much.

`measure` prices it on the device for one workload: a synthetic pass of the profile's own GEMMs
and attention calls, in order and at their shapes, with device copies standing in for every
other op's profiled time scaled by k, captured as one CUDA graph and replayed in steady state
(the cap acts over hundreds of ms) for several k. Each point is the compute kernels' time
relative to k = 1 (and their share of the synthetic pass). `slowdown` reads the curve at a
pass's k, its other work per unit of compute over the profiled pass's; the rank stage applies
it to the compute kernels of every projected pass (`pipeline.projection.replay.clocked`).
"""

from __future__ import annotations

import time

GEMM_OPS = ("aten::linear", "aten::mm", "aten::addmm")
SDPA_OPS = ("aten::scaled_dot_product_attention", "aten::_scaled_dot_product")
SCALES = (1.0, 0.5, 0.25, 0.12)
ALIGN = 128  # the floor's GEMM columns, rounded up to this (`floor`)
STEADY_S = 1.5


def compute_step(op: dict) -> tuple | None:
    """("gemm", m, k, n) or ("sdpa", b, h, s, d, kv_heads) for a compute-bound op; None else."""
    name, shapes = op["name"], op.get("shapes") or []
    if name in GEMM_OPS and len(shapes) >= 2:
        x, w = (shapes[1], shapes[2]) if name == "aten::addmm" else (shapes[0], shapes[1])
        if x and w and len(w) == 2 and all(isinstance(d, int) for d in x + w):
            m = 1
            for d in x[:-1]:
                m *= d
            return ("gemm", m, x[-1], w[0] if name == "aten::linear" else w[1])
    if name.startswith(SDPA_OPS) and len(shapes) >= 2 and len(shapes[0]) == 4 \
            and len(shapes[1]) == 4:
        b, h, s, d = shapes[0]
        return ("sdpa", b, h, s, d, shapes[1][1])
    return None


def plan(ops: list[dict]) -> list[tuple]:
    """The pass as compute steps and ("fill", us) steps, runs of other ops merged into one."""
    steps, fill = [], 0.0
    for op in ops:
        step = compute_step(op) if op.get("device_us") else None
        if step is None:
            fill += op.get("device_us") or 0.0
            continue
        if fill:
            steps.append(("fill", fill))
            fill = 0.0
        steps.append(step)
    if fill:
        steps.append(("fill", fill))
    return steps


def compute_correlations(ops: list[dict]) -> set:
    """Kernel correlations of the profile's compute-bound ops (what `slowdown` scales)."""
    return {k["correlation"] for op in ops if compute_step(op) for k in op.get("kernels", [])
            if k.get("correlation") is not None}


def slowdown(curve: list[dict] | None, scale: float) -> float:
    """Compute time of a pass whose other work takes `scale` x the profiled pass's, over the
    profiled pass's (scale 1): the curve read piecewise linearly in its copies' scale, held
    flat beyond its ends; 1.0 without a curve. Read by scale rather than by compute share: the
    synthetic pass's copies run longer than the time they stand for, so its compute share
    sits under the profiled pass's."""
    if not curve:
        return 1.0
    pts = sorted((p["scale"], p["compute_ratio"]) for p in curve)

    def at(k: float) -> float:
        if k <= pts[0][0]:
            return pts[0][1]
        for (k0, r0), (k1, r1) in zip(pts, pts[1:]):
            if k <= k1:
                return r0 + (r1 - r0) * (k - k0) / (k1 - k0) if k1 > k0 else r1
        return pts[-1][1]

    return at(scale) / at(1.0)


def measure(ops: list[dict], gbps: float, scales=SCALES, seconds: float = STEADY_S) -> list[dict]:
    """The density curve of one workload on the current CUDA device (module docstring)."""
    steps = plan(ops)
    points, base = [], None
    for scale in scales:
        g = _steady(_synthetic(steps, scale, gbps), seconds)
        comp, copies = _profiled(g.replay)
        del g
        base = base or comp
        points.append({"scale": scale, "compute_share": comp / (comp + copies),
                       "compute_ratio": comp / base, "compute_us": comp, "copy_us": copies})
    return points


def floor(ops: list[dict], seconds: float = STEADY_S, reps: int = 20) -> dict:
    """The pass with nothing but its compute-bound kernels: its GEMMs and attention, in order and
    at its shapes, back to back in one CUDA graph, timed in steady state. While they run at the
    library's rate, no fusion can make the pass shorter than this, and it is measured
    at the clock such a pass runs at under the power cap, which a FLOPs-over-peak floor is not
    (that reads several milliseconds short on a b8 pass). Being the densest pass, it runs at
    the lowest clock the cap allows, so a pass that keeps a little memory-bound work between its
    GEMMs can come out level with it, not under it by much. `wall_ms`: one replay, launch gaps
    included; `kernel_ms`: its kernels' profiled time (the profiler slows a dense pass, so
    this can read longer than the replay)."""
    from profiling.roofline import median_time

    g = _steady(_synthetic(floor_steps(ops), 0.0, 0.0), seconds)
    wall_s = median_time(g.replay, True, reps)
    comp, _ = _profiled(g.replay)
    return {"wall_ms": wall_s * 1e3, "kernel_ms": comp / 1e3}


def floor_steps(ops: list[dict]) -> list[tuple]:
    """The floor's steps: the pass's compute steps, each GEMM's columns rounded up to a multiple
    of `ALIGN`, as the matmul family pads an odd vocabulary (GPT-2's LM head at 50257 columns
    runs cuBLAS at a fraction of its rate: unrounded, the floor would sit above what the
    family's padded GEMM and a graph reach)."""
    return [("gemm", s[1], s[2], -(-s[3] // ALIGN) * ALIGN) if s[0] == "gemm" else s
            for s in plan(ops) if s[0] != "fill"]


def _steady(fn, seconds: float):
    """`fn` as one CUDA graph, replayed for `seconds` first: the cap acts over hundreds of ms."""
    import torch

    from profiling.roofline import graph_of

    g = graph_of(fn, "cuda")
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        g.replay()
        torch.cuda.synchronize()  # no queue of replays running on past the loop
    return g


def _synthetic(steps: list[tuple], scale: float, gbps: float):
    """A callable running `steps`, every fill a copy sized to take `scale` x its time."""
    import torch
    import torch.nn.functional as F

    cache: dict = {}

    def tensor(shape):
        if shape not in cache:
            cache[shape] = torch.randn(shape, device="cuda", dtype=torch.bfloat16) / 32
        return cache[shape]

    def nbytes(us: float) -> int:  # a copy reads and writes: half the traffic each way
        return int(us * scale * gbps * 1e3 / 2)

    biggest = max((nbytes(s[1]) for s in steps if s[0] == "fill"), default=0)
    src = torch.zeros(max(1, biggest), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    calls = []
    for s in steps:
        if s[0] == "gemm":
            x, w = tensor((s[1], s[2])), tensor((s[3], s[2]))
            calls.append(lambda x=x, w=w: F.linear(x, w))
        elif s[0] == "sdpa":
            _, b, h, sq, d, kvh = s
            q, kv = tensor((b, h, sq, d)), tensor((b, kvh, sq, d))
            if h != kvh:  # the profile's grouped heads, as HF's repeat_kv hands them over
                kv = kv.repeat_interleave(h // kvh, dim=1) if h % kvh == 0 else tensor(
                    (b, h, sq, d))
            calls.append(lambda q=q, kv=kv: F.scaled_dot_product_attention(
                q, kv, kv, is_causal=True))
        elif n := nbytes(s[1]):
            calls.append(lambda n=n: dst[:n].copy_(src[:n]))
    return lambda: [c() for c in calls]


def _profiled(fn) -> tuple[float, float]:
    """(compute, copy) kernel time of one call of `fn`, in us."""
    from profiling.roofline import kernel_events

    events = kernel_events(fn)
    copies = sum(us for name, us in events if "copy" in name.lower() or "memcpy" in name.lower())
    return sum(us for _, us in events) - copies, copies

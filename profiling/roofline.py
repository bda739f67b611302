"""Roofline: measured ceilings of the device in use, and bytes/FLOPs of recorded ops.

Ceilings come from `measure_ceilings` on the machine itself (a device-to-device copy counting
bytes read + written, a large matmul, an empty launch), cached per device name in the user
cache folder; never from a datasheet.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from pathlib import Path

from core.artifacts import write_json

ELEM_BYTES = {"float": 4, "c10::BFloat16": 2, "c10::Half": 2, "double": 8, "long int": 8,
              "int": 4, "bool": 1, "unsigned char": 1, "signed char": 1, "short int": 2}
MATMUL_OPS = {"aten::mm": (0, 1), "aten::linear": (0, 1), "aten::addmm": (1, 2),
              "aten::matmul": (0, 1), "aten::bmm": (0, 1)}


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kernel-pipeline"


def device_name(device: str) -> str:
    import torch

    if device.startswith("cuda"):
        return torch.cuda.get_device_name(0)
    import platform

    return f"cpu-{platform.machine()}-{os.cpu_count()}cores"


def ceilings(device: str, refresh: bool = False) -> dict:
    """Cached ceilings of this device; measured on first use."""
    name = device_name(device)
    path = cache_dir() / f"ceilings-{name.replace(' ', '_').replace('/', '_')}.json"
    if path.exists() and not refresh:
        cached = json.loads(path.read_text())
        # a cache from before the node cost was measured over a chain of real kernels is
        # re-measured (CPU caches have no graph costs at all)
        if "graph_node_us" not in cached or "graph_chain_kernels" in cached:
            return cached
    result = measure_ceilings(device)
    write_json(path, result)
    return result


def measure_ceilings(device: str) -> dict:
    import torch

    cuda = device.startswith("cuda")
    n_copy = (1 << 30) if cuda else (1 << 26)  # 1 GiB on a GPU (>> L2), 64 MiB on a CPU
    n_mm = 8192 if cuda else 1024
    dtype = torch.bfloat16 if cuda else torch.float32
    src = torch.empty(n_copy, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    copy_s = median_time(lambda: dst.copy_(src), cuda)
    a = torch.randn(n_mm, n_mm, device=device, dtype=dtype)
    b = torch.randn(n_mm, n_mm, device=device, dtype=dtype)
    mm_s = median_time(lambda: a @ b, cuda)
    tiny = torch.zeros(1, device=device)

    def launches():
        for _ in range(100):
            tiny.add_(1)

    # back-to-back launches: the per-launch cost a fused kernel saves, not one launch's latency
    launch_s = median_time(launches, cuda) / 100
    graph = graph_costs(device) if cuda else {}
    return {
        "device": device_name(device),
        "bandwidth_GBps": 2 * n_copy / copy_s / 1e9,
        "matmul_TFLOPs": 2 * n_mm**3 / mm_s / 1e12,
        "matmul_dtype": str(dtype).replace("torch.", ""),
        "launch_us": launch_s * 1e6,
        **graph,
        "method": f"median of timed runs after warm-up: copy of {n_copy} bytes (read+write "
                  f"counted), {n_mm}^3 matmul on random data, 100 back-to-back 1-element adds"
                  + (f"; CUDA graphs of 1 and {GRAPH_NODES} 1-element adds and of {CHAIN_REPS} "
                     f"layers of short kernels ({CHAIN_TOKENS}x{CHAIN_HIDDEN}) replayed, wall "
                     "time to the synchronise" if graph else ""),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


GRAPH_NODES = 201
# the chain: what a batch-1 prefill layer launches between its GEMMs, at GPT-2/Llama-like width
CHAIN_TOKENS, CHAIN_HIDDEN, CHAIN_REPS = 128, 1024, 50


def graph_costs(device: str, nodes: int = GRAPH_NODES) -> dict:
    """The two costs a pass replayed as one CUDA graph pays beyond its kernels' own time:
    `graph_node_us` per node and `graph_launch_us` once (the single-kernel graph's wall time,
    launch to synchronise, less one node's slope). Wall time, not device events: the launch is
    host work.

    The replay adds the node cost to the kernel durations an eager pass's profile holds, so it
    is measured that way: a chain of the short kernels a batch-1 layer runs (layer norm, a
    GEMM, gelu, a residual add; `chain_node_us`), replayed as one graph, less the launch and
    the durations the same chain's kernels have when profiled eagerly, per kernel. Priced
    from `nodes` 1-element adds instead (the slope less the tiny kernel's own run, kept as
    `graph_node_tiny_us`), the node cost comes out a fraction of what real graphs of short
    kernels imply: the 1-element add is the one kernel whose profiled run is nearly all
    launch."""
    import torch

    tiny = torch.zeros(1, device=device)
    walls = []
    for n in (1, nodes):
        g = graph_of(lambda n=n: [tiny.add_(1) for _ in range(n)], device)
        walls.append(_wall(g.replay, reps=50))
        if n == nodes:
            tiny_us = _kernel_us(g.replay)
        del g
    node_s = (walls[1] - walls[0]) / (nodes - 1)
    launch_us = max(0.0, (walls[0] - node_s) * 1e6)
    chain = chain_node_us(device, launch_us)
    return {"graph_node_us": chain["node_us"],
            "graph_node_tiny_us": max(0.0, node_s * 1e6 - tiny_us),
            "graph_node_slope_us": node_s * 1e6, "graph_tiny_kernel_us": tiny_us,
            "graph_launch_us": launch_us,
            "graph_chain_kernels": chain["kernels"], "graph_chain_wall_us": chain["wall_us"],
            "graph_chain_eager_kernel_us": chain["eager_kernel_us"]}


def chain_node_us(device: str, launch_us: float) -> dict:
    """Per-kernel cost of a graph of `CHAIN_REPS` layers of short kernels, over the sum of the
    same kernels' durations in an eager profile (`graph_costs` says why). Can be negative: a
    kernel may run faster back to back in a graph than after an idle gap."""
    import torch
    import torch.nn.functional as F

    gen = torch.Generator(device=device).manual_seed(0)
    x0 = torch.randn(CHAIN_TOKENS, CHAIN_HIDDEN, device=device, dtype=torch.bfloat16,
                     generator=gen)
    w = torch.randn(CHAIN_HIDDEN, CHAIN_HIDDEN, device=device, dtype=torch.bfloat16,
                    generator=gen) / CHAIN_HIDDEN**0.5

    def chain():
        x = x0
        for _ in range(CHAIN_REPS):
            x = x + F.gelu(F.layer_norm(x, (CHAIN_HIDDEN,)) @ w, approximate="tanh")
        return x

    for _ in range(3):
        chain()
    durs = _kernel_durations(chain)
    g = graph_of(chain, device)
    wall_us = _wall(g.replay, reps=50) * 1e6
    del g
    eager_us = sum(durs)
    return {"node_us": (wall_us - launch_us - eager_us) / len(durs), "kernels": len(durs),
            "wall_us": wall_us, "eager_kernel_us": eager_us}


def graph_of(fn, device: str):
    """`fn` captured as one CUDA graph (models.graphs.capture_graph: warmed up off the capture)."""
    import torch

    from models.graphs import capture_graph

    return capture_graph(fn, torch.device(device), warmup=1)[0]


def _kernel_us(fn) -> float:
    """Mean profiled duration of the kernels one call of `fn` runs on the GPU."""
    durs = _kernel_durations(fn)
    return sum(durs) / len(durs) if durs else 0.0


def _kernel_durations(fn) -> list[float]:
    """Profiled durations (us) of the kernels one call of `fn` runs on the GPU."""
    return [us for _, us in kernel_events(fn)]


def kernel_events(fn) -> list[tuple[str, float]]:
    """(name, profiled us) of each kernel one call of `fn` runs on the GPU."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [(e.name, e.device_time) for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time > 0]


def _wall(fn, reps: int = 50) -> float:
    import torch

    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def median_time(fn, cuda: bool, reps: int = 20) -> float:
    """Median seconds of one call of `fn` after three warm-up calls: CUDA events on a GPU."""
    import torch

    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def tensor_bytes(dims, dtype: str) -> int:
    if not isinstance(dims, list) or any(not isinstance(d, int) for d in dims):
        return 0
    # the profiler records non-tensor arguments (None, Scalar, ScalarList) with dims []: no bytes
    if not dtype or dtype.startswith("Scalar"):
        return 0
    return math.prod(dims) * ELEM_BYTES.get(dtype, 2)


def op_cost(op: dict) -> tuple[int, int]:
    """(bytes, flops) of one unfused op: every tensor input read, one output of the largest
    input's size written; matmuls count 2*M*N*K."""
    ins = [tensor_bytes(d, t) for d, t in zip(op.get("shapes", []), op.get("dtypes", []))]
    ins = [b for b in ins if b]
    name = op["name"]
    if name in MATMUL_OPS:
        ia, ib = MATMUL_OPS[name]
        shapes = op.get("shapes", [])
        if len(shapes) > ib and shapes[ia] and shapes[ib]:
            a, b = shapes[ia], shapes[ib]
            k = a[-1]
            m = math.prod(a[:-1])
            n = b[0] if name == "aten::linear" else b[-1]
            es = ELEM_BYTES.get(op["dtypes"][ia], 2)
            return sum(ins) + m * n * es, 2 * m * n * k
    if name == "aten::scaled_dot_product_attention":
        q, k = op["shapes"][0], op["shapes"][1]
        if q and k:
            flops = 4 * math.prod(q[:-1]) * k[-2] * q[-1]
            return sum(ins) + ins[0], flops // (2 if q[-2] == k[-2] else 1)
    return sum(ins) + (max(ins) if ins else 0), 0


def roofline_us(nbytes: int, flops: int, ceil: dict, launches: int = 1) -> float:
    """The floor of one fused kernel: bytes over bandwidth or FLOPs over peak, plus launch."""
    t_mem = nbytes / (ceil["bandwidth_GBps"] * 1e9)
    t_math = flops / (ceil["matmul_TFLOPs"] * 1e12)
    return max(t_mem, t_math) * 1e6 + launches * ceil.get("launch_us", 0.0)


def input_bytes(op: dict, i: int = 0) -> int:
    """Bytes of the i-th recorded input of a profiled op (0 when not a tensor)."""
    shapes, dtypes = op.get("shapes", []), op.get("dtypes", [])
    return tensor_bytes(shapes[i], dtypes[i]) if i < len(shapes) and i < len(dtypes) else 0


def streaming_cost(tensors: int, op_name: str | None = None):
    """Cost model of a fused elementwise/row kernel: `tensors` full-size tensors moved once
    (inputs read + outputs written), sized by the largest input of `op_name` (or of any op)."""

    def cost(ops: list[dict]) -> tuple[int, int]:
        pool = [o for o in ops if op_name is None or o["name"] == op_name] or ops
        size = max((input_bytes(o, i) for o in pool for i in range(len(o.get("shapes", [])))),
                   default=0)
        return tensors * size, 0

    return cost

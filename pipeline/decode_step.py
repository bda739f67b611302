"""The anatomy of a graphed decode step: its kernels, each one's share of the step, the step's
multiple of its weight-read floor, and which lever is next.

Once a decode step is one CUDA graph, the host is gone and three things are left between the
step and its floor (every weight read once at the copy bandwidth `pipeline calibrate`
measures): kernels that read no weights (norms, rotary, cache appends, activations, residual
adds: each a launch a fused projection would absorb), weight-reading kernels slower than their
bytes (GEMVs short of the bandwidth), and the GPU idling between kernels (each graph node's
fixed cost; programmatic dependent launch or fewer nodes). `anatomy` weighs the three in
milliseconds of the step and names the largest; the graphs stage records it for a graphed
decode workload (`decode_step` in its record, `core.records.DecodeStep`) and the report
prints it.

The floor counts the weights alone (`weight_bytes`: each parameter storage once, a tied LM head
read once, a mixture of experts' routed experts only as far as the step's tokens reach them);
the KV cache a step reads is left out (Llama-3.2-1B at 1024 positions: 34 MB beside 2.5 GB).
"""

from __future__ import annotations

import re
from collections.abc import Callable

from core.records import DecodeStep

# Kernels that stream weights or the KV cache: GEMVs and GEMMs (ours, cuBLAS's including its
# nvjet kernels, the norm-fused projections), their split-K sums, attention (flash-decoding's
# split and combine), the experts. Everything else a decode step runs is glue a fusion would
# absorb: the fusion lever must not count a projection because its name starts with a norm.
STREAMING = re.compile(r"gemv|gemm|xmma|cutlass|cublas|nvjet|matmul|splitk|split_sum|"
                       r"attention|attn|flash|fmha|sdpa|_qkv_|gate_up|_decode_split|"
                       r"_decode_combine|expert|moe", re.IGNORECASE)
TOP = 12  # kernels listed in the record, by time; the rest summed as "other"
LEVERS = ("fusion", "bandwidth", "launch gaps")


def short(name: str, width: int = 72) -> str:
    """A kernel's name without its template arguments, at most `width` characters."""
    base = name.split("<", 1)[0].split("(", 1)[0].strip() or name
    return base if len(base) <= width else base[:width - 3] + "..."


def weight_bytes(model, batch: int = 1) -> int:
    """Bytes of the weights a decode step of `batch` sequences reads: each parameter storage
    once (a tied LM head is read once), the input embedding left out unless the LM head reads
    it (a step gathers one row of it per sequence), and a mixture of experts' expert weights
    scaled to the experts the step's tokens reach (`active_fraction`): the active-weight floor,
    not the whole model's."""
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    skip = set()
    if emb is not None and (head is None or head.weight is not emb.weight):
        skip.add(emb.weight.untyped_storage().data_ptr())
    config = getattr(model, "config", None)
    experts = _expert_params(model, config)
    fraction = active_fraction(config, batch) if experts else 1.0
    seen, total = set(), 0.0
    for p in model.parameters():
        storage = p.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        if key in seen or key[0] in skip:
            continue
        seen.add(key)
        total += storage.nbytes() * (fraction if id(p) in experts else 1.0)
    return int(total)


def active_fraction(config, batch: int) -> float:
    """The expected share of a layer's experts that `batch` tokens reach, each routed to top_k
    of E experts as a uniform router would (a model built from its config has one; a trained
    router concentrates, which reads fewer): 1 - (1 - top_k / E) ** batch."""
    e = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    k = getattr(config, "num_experts_per_tok", None)
    if not e or not k:
        return 1.0
    return 1.0 - (1.0 - min(k, e) / e) ** max(batch, 1)


def _expert_params(model, config) -> set[int]:
    """ids of the routed experts' parameters (a module named `experts` holding one stacked
    tensor per projection, [E, ...]); a shared expert is read in full and is not among them."""
    e = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    if not e:
        return set()
    return {id(p) for name, m in model.named_modules() if name.rsplit(".", 1)[-1] == "experts"
            for p in m.parameters(recurse=True) if p.dim() >= 1 and p.shape[0] == e}


def anatomy(kernels: list[tuple[str, float]], step_ms: float | None, weights: int,
            copy_gbps: float | None, layers: int) -> dict:
    """The step's record from its kernels ((name, device us) per launch, in order), its
    measured time (None: the kernels' own span, gaps unknown), its weight bytes, the copy
    bandwidth and the decoder layers."""
    busy_ms = sum(us for _, us in kernels) / 1e3
    step = step_ms if step_ms else busy_ms
    by_name: dict[str, list] = {}
    for name, us in kernels:
        entry = by_name.setdefault(short(name), [0, 0.0])
        entry[0] += 1
        entry[1] += us
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][1])
    rows = [{"kernel": name, "calls": calls, "ms": round(us / 1e3, 4),
             "share": round(us / 1e3 / step, 4) if step else 0.0}
            for name, (calls, us) in ranked[:TOP]]
    rest = ranked[TOP:]
    if rest:
        us = sum(v[1] for _, v in rest)
        rows.append({"kernel": f"other ({len(rest)} kernels)", "calls": sum(v[0] for _, v in rest),
                     "ms": round(us / 1e3, 4), "share": round(us / 1e3 / step, 4) if step else 0.0})
    glue = [(n, us) for n, us in kernels if not STREAMING.search(n)]
    stream_ms = busy_ms - sum(us for _, us in glue) / 1e3
    floor_ms = weights / (copy_gbps * 1e6) if copy_gbps else None
    levers = {"fusion": sum(us for _, us in glue) / 1e3,
              "bandwidth": max(0.0, stream_ms - floor_ms) if floor_ms is not None else 0.0,
              "launch gaps": max(0.0, step - busy_ms) if step_ms else 0.0}
    lever = max(LEVERS, key=lambda k: levers[k])
    return {"kernels_per_step": len(kernels),
            "kernels_per_layer": round(len(kernels) / layers, 2) if layers else None,
            "step_ms": round(step, 4), "busy_ms": round(busy_ms, 4),
            "floor_ms": round(floor_ms, 4) if floor_ms is not None else None,
            "floor_multiple": round(step / floor_ms, 3) if floor_ms else None,
            "weight_bytes": weights, "copy_GBps": copy_gbps,
            "kernels": rows, "levers_ms": {k: round(v, 4) for k, v in levers.items()},
            "verdict": verdict(lever, levers, len(kernels), len(glue), step, floor_ms)}


def verdict(lever: str, levers: dict, n: int, n_glue: int, step: float,
            floor_ms: float | None) -> str:
    ms = levers[lever]
    head = f"next lever: {lever} ({ms:.3f} ms of the {step:.3f} ms step"
    if ms <= 0:
        return f"no lever left: the step sits at its floor ({step:.3f} ms)"
    if lever == "fusion":
        return (f"{head}): {n_glue} of its {n} kernels read no weights (norms, rotary, cache "
                "appends, activations, adds); fold them into the projections' prologues and "
                "epilogues")
    if lever == "bandwidth":
        return (f"{head}): the weight-reading kernels take that much over the weights' "
                f"floor of {floor_ms:.3f} ms; GEMVs short of the copy bandwidth")
    return (f"{head}): the GPU idles between the step's {n} kernels; fewer kernels or "
            "programmatic dependent launch")


def step_kernels(call: Callable[[], object]) -> list[tuple[str, float]]:
    """(name, device us) of each kernel one synchronised call launches, in order (GPU;
    torch.profiler, whose CUPTI reports a graph replay's kernels one by one)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
              and not e.name.startswith(("Memcpy", "Memset"))]
    events.sort(key=lambda e: e.time_range.start)
    return [(e.name, e.time_range.elapsed_us()) for e in events]


def blocks(step: DecodeStep | dict) -> list[tuple]:
    """The record as report blocks (pipeline.report_plots' ("p", text) and ("table", ...))."""
    step = DecodeStep.of(step)
    floor = (f"{step.floor_multiple:.2f}x its weight-read floor of {step.floor_ms:.3f} ms"
             if step.floor_multiple else "its floor not known")
    levers = ", ".join(f"{k} {v:.3f} ms" for k, v in step.levers_ms.items())
    return [("p", f"Graphed decode step: {step.step_ms:.3f} ms, "
                  f"{step.kernels_per_step} kernels ({step.kernels_per_layer} per layer), "
                  f"kernels busy {step.busy_ms:.3f} ms; {floor}. Levers: {levers}. "
                  f"Verdict: {step.verdict}."),
            ("table", ["kernel", "calls", "ms", "share of step"],
             [(r.kernel, r.calls, f"{r.ms:.4f}", f"{r.share:.1%}") for r in step.kernels])]

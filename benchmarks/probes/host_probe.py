"""Where the host time of a patched forward goes, on the GPU machine.

For one model and workload: the unpatched forward against each family patched alone and all
together, interleaved pairs, timing both the wall (synchronised) and the enqueue time (until
`model()` returns, before the synchronise: the host's own cost of the pass). The enqueue
difference per patched call is what an adapter plus its kernel launch costs the host beyond
the HF ops it replaces; the projection's host deltas come from kernel-level calls instead.
Then a cProfile of the fully patched forward, to name the functions the host time goes to.

    python benchmarks/probes/host_probe.py MODEL --batch B --seq S [--mode prefill|decode]
        [--pairs N] [--out FILE.json]

Meant for a GPU (`--device cpu` runs it on a tiny model under the interpreter, to check
it). Kernels are rendered with the first config of each family's search space (host cost does
not depend on the block shape).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import tempfile
import time
from pathlib import Path

import torch

FAMILIES = ("rmsnorm", "add_rmsnorm", "rope", "gated_act", "kv_cache")


def chooser_for(family, tmp: Path, calls: dict):
    from core.source import load_forward

    cache = {}

    def chooser(case):
        key = tuple(sorted(case.items()))
        if key not in cache:
            path = Path(tempfile.mkdtemp(dir=tmp)) / "kernel.py"
            path.write_text(family.render(family.search_space(case)[0], case))
            fwd = load_forward(path)

            def counted(*a, **k):
                calls[family.name] = calls.get(family.name, 0) + 1
                return fwd(*a, **k)
            cache[key] = counted
        return cache[key]
    return chooser


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(run) -> tuple[float, float]:
    sync()
    t0 = time.perf_counter()
    run()
    t1 = time.perf_counter()
    sync()
    t2 = time.perf_counter()
    return (t1 - t0) * 1e6, (t2 - t0) * 1e6


def paired(base, variant, pairs: int) -> dict:
    for _ in range(3):
        base()
        variant()
    eb, wb, ev, wv = [], [], [], []
    for i in range(pairs):
        order = (base, variant) if i % 2 == 0 else (variant, base)
        r = {fn: timed(fn) for fn in order}
        eb.append(r[base][0])
        wb.append(r[base][1])
        ev.append(r[variant][0])
        wv.append(r[variant][1])
    med = statistics.median
    return {"enqueue_base_us": med(eb), "enqueue_us": med(ev), "wall_base_us": med(wb),
            "wall_us": med(wv), "enqueue_delta_us": med([v - b for v, b in zip(ev, eb)]),
            "wall_ratio": med([b / v for v, b in zip(wv, wb)])}


def host_us(fn, n: int = 50, rounds: int = 20) -> float:
    """Median host us per call of `fn` over `rounds` blocks of `n`, synchronised between
    blocks only (what the host pays while the GPU queue absorbs the work)."""
    for _ in range(5):
        fn()
    sync()
    samples = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        samples.append((time.perf_counter() - t) * 1e6 / n)
        sync()
    return statistics.median(samples)


def launch_micro(tmp: Path, dtype: str, device: str) -> dict:
    """Host us per call, no synchronise: an aten op, a generated RMSNorm candidate (direct
    launch) and the same kernel through Triton's JIT, on a 128 x 2048 input."""
    from codegen.rmsnorm import FAMILY as RMSNORM
    from codegen.rmsnorm.kernel import rms_norm_forward
    from core.source import load_forward

    case = {"rows": 128, "hidden": 2048, "dtype": dtype, "eps": 1e-5, "offset": 0.0,
            "cast_first": True}
    path = tmp / "micro_rmsnorm.py"
    path.write_text(RMSNORM.render(RMSNORM.search_space(case)[0], case))
    fwd = load_forward(path)
    x = torch.randn(128, 2048, device=device, dtype=getattr(torch, dtype))
    w = torch.ones(2048, device=device, dtype=x.dtype)
    out = torch.empty_like(x)
    calls = {"aten_neg": lambda: torch.neg(x, out=out),
             "candidate_direct": lambda: fwd(x, w, out=out, eps=1e-5, offset=0.0,
                                              cast_first=True),
             "triton_jit": lambda: rms_norm_forward(x, w, out=out, eps=1e-5)}
    res = {name: host_us(fn, rounds=30) for name, fn in calls.items()}
    print("host us per call: " + ", ".join(f"{k} {v:.1f}" for k, v in res.items()), flush=True)
    return res


def mlp_micro(model, tmp: Path, w) -> dict:
    """Host us of one MLP call, HF against patched, and of the pieces of the patched call."""
    from codegen.gated_act import FAMILY as GATED
    from codegen.gated_act.patch import find_gated_mlps

    mlp = find_gated_mlps(model)[0].module
    x = torch.randn(w.batch, w.seq if w.mode == "prefill" else 1, mlp.gate_proj.in_features,
                    device=w.device, dtype=getattr(torch, w.dtype))
    res = {}
    with torch.no_grad():
        res["hf_mlp"] = host_us(lambda: mlp(x))
        gate = mlp.gate_proj(x)
        res["linear_gate"] = host_us(lambda: mlp.gate_proj(x))
        res["act_module"] = host_us(lambda: mlp.act_fn(gate))
        res["mul"] = host_us(lambda: gate * gate)
        undo = GATED.patch(model, chooser_for(GATED, tmp, {}))
        res["patched_mlp"] = host_us(lambda: mlp(x))
        wgu = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
        res["linear_fused"] = host_us(lambda: torch.nn.functional.linear(x, wgu))
        res["empty"] = host_us(lambda: torch.empty(gate.shape, dtype=gate.dtype,
                                                   device=gate.device))
        gu = torch.nn.functional.linear(x, wgu)
        cols = gate.shape[-1]
        res["two_slices"] = host_us(lambda: (gu[..., :cols], gu[..., cols:]))
        case = GATED.cases_from_model(model, w)[0]
        path = Path(tempfile.mkdtemp(dir=tmp)) / "kernel.py"
        path.write_text(GATED.render(GATED.search_space(case)[0], case))
        from core.source import load_forward
        kern = load_forward(path)
        g, u, out = gu[..., :cols], gu[..., cols:], torch.empty_like(gate)
        res["kernel_call"] = host_us(lambda: kern(g, u, out=out))
        undo()
    print("mlp host us: " + ", ".join(f"{k} {v:.1f}" for k, v in res.items()), flush=True)
    return res


def syncs_inside(run) -> str | None:
    """The first synchronising call a forward makes, if any (CUDA sync debug mode)."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        run()
        return None
    except RuntimeError as e:
        return str(e).splitlines()[0][:200]
    finally:
        torch.cuda.set_sync_debug_mode("default")


def main() -> None:
    from codegen.registry import get_family
    from core.workload import Workload
    from pipeline.patching import twin
    from profiling.capture import make_runner
    from profiling.loader import build, resolve

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--mode", default="prefill")
    ap.add_argument("--pairs", type=int, default=30)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out")
    args = ap.parse_args()
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    w = Workload(args.batch, args.seq, dtype, args.device, args.mode)
    model = build(resolve(args.model), getattr(torch, dtype), args.device)
    tmp = Path(tempfile.mkdtemp())

    def runner(m):
        return make_runner(m, w).once

    base = runner(model)
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else None
    result = {"model": args.model, "workload": w.key, "torch": torch.__version__, "gpu": gpu,
              "variants": {}}
    import triton
    result["triton"] = triton.__version__
    if args.device == "cuda":  # the interpreter would time itself
        result["launch_micro_us"] = launch_micro(tmp, dtype, args.device)
        result["mlp_micro_us"] = mlp_micro(model, tmp, w)
        result["baseline_syncs"] = syncs_inside(base)
    for names in [[f] for f in FAMILIES] + [list(FAMILIES)]:
        variant, calls = twin(model), {}
        undos = [get_family(n).patch(variant, chooser_for(get_family(n), tmp, calls))
                 for n in names]
        run = runner(variant)
        run()
        sync()
        calls.clear()
        run()
        per_pass = dict(calls)
        if args.device == "cuda":
            r_sync = syncs_inside(run)
        r = paired(base, run, args.pairs)
        n = sum(per_pass.values())
        r["calls_per_pass"] = per_pass
        if args.device == "cuda":
            r["syncs"] = r_sync
            print(f"  syncs inside the patched forward: {r_sync}", flush=True)
        r["enqueue_delta_per_call_us"] = r["enqueue_delta_us"] / n if n else None
        label = "+".join(names) if len(names) == 1 else "all"
        result["variants"][label] = r
        print(f"{label:12s} calls {n:4d}  enqueue {r['enqueue_base_us']:9.1f} -> "
              f"{r['enqueue_us']:9.1f} us (per call {r['enqueue_delta_per_call_us'] or 0:+.1f})"
              f"  wall {r['wall_base_us']:9.1f} -> {r['wall_us']:9.1f} us "
              f"(x{r['wall_ratio']:.3f})", flush=True)
        if label == "all":
            prof = cProfile.Profile()
            sync()
            prof.enable()
            for _ in range(10):
                run()
            prof.disable()
            sync()
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
            result["cprofile_all"] = s.getvalue()
            print(s.getvalue()[:6000])
        for undo in reversed(undos):
            undo()
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

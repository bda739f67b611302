"""Where a patched forward spends its host time: cProfile of the unpatched and the patched
pass, function by function, per family.

Why: the in-model host deltas (pipeline/stages/host.py) say how much host time a family's patch
adds or saves per call (kv_cache and matmul_epilogue cost Qwen2.5-0.5B b8 about 75 and 33 us
per call on the H200 host), not where. A pass that waits on the host is as fast as its
Python, so that is what decides batch 1 and a slow host at batch 8.

    python3 benchmarks/host_profile.py OUT.json [--model qwen2.5-0.5b] [--batch 8] [--seq 1024]
        [--mode prefill] [--families rmsnorm,rope,...] [--pairs 15] [--passes 5]

Per family alone, then all of them: each kernel is the family's middle search config for the
model's cases (no search). Records (1) the median over interleaved pairs of each pass's time to
return (unpatched minus patched, per patched call; no synchronise inside a pass) and (2) the
cProfile of `--passes` passes per side: per function, total own time per pass and calls per
pass, and the functions whose own time differs most between the sides. cProfile slows Python
down, so its absolute times are inflated; read its differences as where, (1) as how much.
First, and alone with `--keys-only`: per family, what finding the compiled kernel costs the
host on the arguments its launcher got in the model, through `spec_key` and the exact key.
`--device cpu` runs the flow on a zoo model under TRITON_INTERPRET=1, to check it.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(1, str(ROOT))

FAMILIES = "rmsnorm,rope,matmul_epilogue,kv_cache,add_rmsnorm"


def _label(key: tuple) -> str:
    path, line, name = key
    for marker in ("site-packages/", str(ROOT) + "/"):
        if marker in path:
            path = path.split(marker, 1)[1]
    return f"{path}:{line}({name})" if line else name


def _project_code(key: tuple) -> bool:
    """A function of this checkout or a rendered kernel file: not a builtin, not stdlib or an
    installed package."""
    return key[0] != "~" and "/lib/python3" not in key[0]


def _profile(run, passes: int, device: str) -> dict[str, tuple[float, float, bool]]:
    """label -> (own us per pass, calls per pass, project code)."""
    from profiling.capture import sync

    prof = cProfile.Profile()
    for _ in range(passes):
        sync(device)
        prof.enable()
        run()
        prof.disable()
    stats = pstats.Stats(prof).stats
    return {_label(k): (v[2] * 1e6 / passes, v[1] / passes, _project_code(k))
            for k, v in stats.items()}


def middle_config_choosers(model, workload, names: list[str], tmp: Path) -> dict:
    """Per family, case -> the forward of its middle search config, rendered into `tmp`."""
    from codegen.registry import get_family
    from core.source import load_forward

    choosers = {}
    for name in names:
        fam = get_family(name)
        forwards = {}
        for case in fam.cases_from_model(model, workload):
            space = fam.search_space(case)
            path = tmp / name / f"{len(forwards)}.py"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(fam.render(space[len(space) // 2], case))
            forwards[json.dumps(case, sort_keys=True)] = load_forward(path)
        choosers[name] = lambda c, f=forwards: f.get(json.dumps(c, sort_keys=True))
    return choosers


def compare(model, workload, choosers: dict, names: list[str], pairs: int, passes: int) -> dict:
    from codegen.registry import get_family
    from pipeline.patching import counting_chooser, twin
    from profiling.capture import make_runner, sync

    variant = twin(model)
    calls = {n: 0 for n in names}
    undos = [get_family(n).patch(variant, counting_chooser(choosers[n], calls, n))
             for n in names]
    try:
        base, patched = (make_runner(m, workload).once for m in (model, variant))
        for run in (base, patched, base, patched):
            run()
        sync(workload.device)
        per_pass = sum(calls.values()) / 2
        deltas = []
        for _ in range(pairs):
            times = []
            for run in (base, patched):
                sync(workload.device)
                t = time.perf_counter()
                run()
                times.append(time.perf_counter() - t)
            deltas.append((times[0] - times[1]) * 1e6)
        sync(workload.device)
        prof_base = _profile(base, passes, workload.device)
        prof_patched = _profile(patched, passes, workload.device)
    finally:
        for u in reversed(undos):
            u()
    diff = []
    for label in set(prof_base) | set(prof_patched):
        b = prof_base.get(label, (0.0, 0.0, False))
        p = prof_patched.get(label, (0.0, 0.0, False))
        diff.append({"function": label, "own_us_base": round(b[0], 1),
                     "own_us_patched": round(p[0], 1), "calls_base": b[1],
                     "calls_patched": p[1], "delta_us": round(p[0] - b[0], 1),
                     "project_code": b[2] or p[2]})
    diff.sort(key=lambda d: -abs(d["delta_us"]))
    # what the patch brought in of this project's code, and what it took out of the pass
    added = [d for d in diff if d["project_code"] and not d["calls_base"] and d["calls_patched"]]
    removed = [d for d in diff if d["calls_base"] and not d["calls_patched"]]
    top_patched = sorted(prof_patched.items(), key=lambda kv: -kv[1][0])[:25]
    return {"calls_per_pass": per_pass,
            "saved_us_per_pass_median": statistics.median(deltas),
            "saved_us_per_call": statistics.median(deltas) / max(per_pass, 1),
            "saved_us_per_pass_all": [round(d, 1) for d in deltas],
            "profile_base_us_per_pass": round(sum(v[0] for v in prof_base.values()), 1),
            "profile_patched_us_per_pass": round(sum(v[0] for v in prof_patched.values()), 1),
            "largest_differences": diff[:30],
            "added": sorted(added, key=lambda d: -d["own_us_patched"])[:15],
            "removed": sorted(removed, key=lambda d: -d["own_us_base"])[:15],
            "patched_top_own_time": [{"function": k, "own_us": round(v[0], 1), "calls": v[1]}
                                     for k, v in top_patched]}


def _first_launch_args(model, workload, name: str, chooser) -> tuple | None:
    """The arguments one patched pass hands the launcher of the family's first kernel."""
    from codegen.registry import get_family
    from profiling.capture import make_runner

    forwards = list(chooser.__defaults__[0].values())
    scope = forwards[0].__globals__ if forwards else {}
    names = [k for k, v in scope.items() if hasattr(v, "compiled")]  # made by launcher()
    if not names:
        return None
    site, seen = scope[names[0]], []
    scope[names[0]] = lambda grid, *a: seen.append(a) or site(grid, *a)
    undo = get_family(name).patch(model, chooser)
    try:
        with torch.no_grad():
            make_runner(model, workload).call()
    finally:
        undo()
        scope[names[0]] = site
    return seen[0] if seen else None


def _key_costs(args: tuple, reps: int) -> dict:
    from codegen import launch as ln

    tensor_pos = tuple(i for i, a in enumerate(args) if hasattr(a, "data_ptr"))
    scalars_of = ln._picker(tuple(i for i in range(len(args)) if i not in tensor_pos))
    compiled, exact = {}, {}

    def old():
        key, values = ln.spec_key(args)
        return compiled.get((0, *key))

    def new():  # what codegen.launch's launch does before its exact lookup
        values, sig = list(args), [0, scalars_of(args)]
        for i in tensor_pos:
            t = args[i]
            p = values[i] = t.data_ptr()
            sig.append((t.dtype, t.is_cuda, p & 15))
        return exact.get(tuple(sig))

    blocks = {"spec_key_us": [], "exact_us": []}
    for _ in range(7):
        for label, fn in (("spec_key_us", old), ("exact_us", new)):
            t = time.perf_counter()
            for _ in range(reps):
                fn()
            blocks[label].append((time.perf_counter() - t) * 1e6 / reps)
    return {"args": len(args), "tensors": len(tensor_pos),
            **{k: round(statistics.median(v), 2) for k, v in blocks.items()}}


def launch_keys(model, workload, choosers: dict, reps: int = 2000) -> dict:
    """Per family, on the arguments its first kernel's launcher got in one patched pass: host
    us to find the compiled kernel through `spec_key` (before the exact key) and
    through the exact key (now), medians of 7 interleaved blocks of `reps` calls each."""
    out = {}
    for name, chooser in choosers.items():
        args = _first_launch_args(model, workload, name, chooser)
        if args is not None:
            out[name] = _key_costs(args, reps)
    return out


def main() -> None:
    from core.workload import Workload
    from profiling.loader import build, resolve

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--mode", default="prefill")
    ap.add_argument("--families", default=FAMILIES)
    ap.add_argument("--pairs", type=int, default=15)
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--keys-only", action="store_true", help="only the launch-key timings")
    ap.add_argument("--device", default="cuda",
                    help="cpu: a dry run of the flow (TRITON_INTERPRET=1)")
    args = ap.parse_args()
    names = args.families.split(",")
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = build(resolve(args.model), dtype, args.device)
    w = Workload(batch=args.batch, seq=args.seq, dtype=str(dtype).split(".")[1], device=args.device,
                 mode=args.mode)
    choosers = middle_config_choosers(model, w, names, Path(tempfile.mkdtemp()))
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    result = {"gpu": gpu, "torch": torch.__version__,
              "model": args.model, "workload": w.key,
              "command": " ".join(sys.argv), "sets": {}}
    result["launch_keys"] = launch_keys(model, w, choosers)
    print(json.dumps(result["launch_keys"]))
    if args.keys_only:
        names = []
    for group in [[n] for n in names] + ([names] if len(names) > 1 else []):
        r = compare(model, w, choosers, group, args.pairs, args.passes)
        result["sets"]["+".join(group)] = r
        print(f"{'+'.join(group):50s} saved {r['saved_us_per_pass_median']:8.0f} us/pass "
              f"{r['saved_us_per_call']:+7.1f} us/call; cProfile "
              f"{r['profile_base_us_per_pass']:.0f} -> {r['profile_patched_us_per_pass']:.0f}")
        for d in r["largest_differences"][:8]:
            print(f"    {d['delta_us']:+8.1f} us  {d['calls_base']:6.0f} -> "
                  f"{d['calls_patched']:6.0f} calls  {d['function']}")
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

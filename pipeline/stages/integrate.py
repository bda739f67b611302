"""Integrate stage: whole-model check, paired timings per workload, the per-workload decision
(pipeline.integrate holds the mechanics)."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path

from core.artifacts import write_json
from pipeline.patching import for_compile, patch_memory, workload_cases
from pipeline.policy import fallbacks, integrable


def integrate_stage(run_dir: Path, spec, workloads, summary: dict, families: list[str],
                    say: Callable[[str], None], pairs: int, built: dict | None = None) -> dict:
    """`built`: models already built, keyed by (dtype, device), reused instead of rebuilt."""
    import torch

    from core.env import environment
    from pipeline import integrate as ig
    from profiling.loader import build
    from verify.timing import paired_ratio

    # on a GPU, up to twice the pairs while an interval is wide (a host slowing down for a
    # stretch); CPU interpreter timings mean nothing, so more of them would only cost time
    timer = partial(paired_ratio, max_n=2 * pairs) if workloads[0].device.startswith("cuda") \
        else paired_ratio
    accepted = summary["accepted"]
    fams, skipped = integrable(accepted, families, workloads[0].device)
    spare = fallbacks(accepted, families, workloads[0].device)
    for fam, why in skipped.items():
        say(f"{fam}: {why}")
    result = {"stage": "integrate", "families": fams, "chosen": families, "environment":
              environment(workloads[0].device), "workloads": {}}
    by_dtype: dict[tuple, list] = {}
    for w in workloads:
        by_dtype.setdefault((w.dtype, w.device), []).append(w)
    for (dtype, device), ws in by_dtype.items():
        model = (built or {}).pop((dtype, device), None)
        if model is None:
            say(f"building {spec.model_id} ({dtype}) for integration")
            model = build(spec, ws[0].torch_dtype(), device)
        ref = ig.fp32_reference(model)
        say("whole-model check")
        # on the first workload of each mode: a decode step's families act on no prefill
        check = ig.check_and_bisect(model, ref, accepted, fams, ws)
        # a family set aside is checked in the set it could ship in: the checked set without
        # the family it was set aside for; here, before any timing shows whether it will be
        # tried, because the fp32 reference is freed before the timing
        spare_checks = {f: ig.check_and_bisect(
            model, ref, accepted, [k for k in check["kept"] if k != instead] + [f], ws)
            for f, instead in spare.items()}
        usable = {f: instead for f, instead in spare.items() if f in spare_checks[f]["kept"]}
        del ref
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
        kept = check["kept"]
        measured = {}
        for w in ws:
            say(f"measure {w.key}")
            cases = workload_cases(model, w, fams + list(usable))
            allowed = {f: set(v) for f, v in cases.items()}
            m = ig.measure(model, w, accepted, kept, allowed, pairs, timer)
            for f, instead in usable.items():
                if instead not in m["kept"]:
                    say(f"{f}: {instead} does not ship on {w.key}; trying {f} in its place")
                    ig.fall_back(model, w, accepted, m, f, instead, allowed, pairs, timer)
            for f, why in m.get("unreached", {}).items():
                say(f"{f} on {w.key}: {why}")
            for f, keys in m.get("declined", {}).items():
                say(f"{f} on {w.key}: {ig.DECLINED.format(n=len(keys))}: {', '.join(keys)}")
            measured[w.key] = (cases, allowed, m)
        # after the timing: its GPU re-profile is a profiler session, which leaves CUPTI
        # attached, and later launches of this process may cost more (profiling.capture;
        # benchmarks/probes/README.md, `cupti_probe.py`), so time first.
        # the families some workload's set calls (`integrate.reach`); the others were not timed
        reached = [k for k in kept if any(k not in m.get("unreached", {})
                                          for _, _, m in measured.values())]
        effect = ig.patch_took_effect(model, accepted, reached, ws[0]) if reached else None
        shipped = {f: instead for f, instead in usable.items()
                   if any(f in m["kept"] for _, _, m in measured.values())}
        for f, instead in shipped.items():  # proven in the set it ships in, without its rival
            effect = ig.with_effect_of(f, effect, ig.patch_took_effect(
                model, accepted, [k for k in kept if k != instead] + [f], ws[0]))
        for w in ws:
            cases, allowed, m = measured[w.key]
            if device.startswith("cuda") and m["kept"]:
                say(f"re-profile {w.key}")
                m["reprofile"] = ig.reprofile(model, accepted, m["kept"], w, allowed)
            result["workloads"][w.key] = {
                "workload": w.to_dict(), "check": check, "patch_effect": effect, "cases": cases,
                "patch_memory": patch_memory(model, m["kept"]),
                # what `apply_kernels(..., compiled=True)` and `pipeline export` offer
                "compiled": for_compile(m["kept"]),
                # a family tried in place of another has its measurement, not a reason
                "skipped": {f: why for f, why in skipped.items() if f not in m["per_family"]},
                **({"fallback_checks": spare_checks} if spare_checks else {}), **m}
        del model
    write_json(run_dir / "integration.json", result)
    return result

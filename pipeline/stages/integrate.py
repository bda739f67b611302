"""Integrate stage: whole-model check, paired timings per workload, the per-workload decision
(pipeline.integrate holds the mechanics)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from core.artifacts import write_json
from core.integration_records import Check, IntegratedWorkload, Integration, PatchEffect
from core.records import Accepted, VerificationSummary
from pipeline.patching import for_compile, patch_memory, workload_cases
from pipeline.policy import fallbacks, integrable


@dataclass
class _Plan:
    """What one run integrates: the accepted kernels, the families integrated, those set aside
    (why), and those set aside for a rival that are tried where it does not ship."""

    accepted: dict[str, Accepted]
    families: list[str]
    skipped: dict[str, str]
    spare: dict[str, str]  # family set aside -> the family it was set aside for
    pairs: int
    timer: Callable
    say: Callable[[str], None]


def integrate_stage(run_dir: Path, spec, workloads, summary: VerificationSummary | dict,
                    families: list[str], say: Callable[[str], None], pairs: int,
                    built: dict | None = None) -> Integration:
    """`built`: models already built, keyed by (dtype, device), reused instead of rebuilt."""
    from core.env import environment
    from profiling.loader import build
    from verify.timing import paired_ratio

    device = workloads[0].device
    # on a GPU, up to twice the pairs while an interval is wide (a host slowing down for a
    # stretch); CPU interpreter timings mean nothing, so more of them would only cost time
    timer = partial(paired_ratio, max_n=2 * pairs) if device.startswith("cuda") \
        else paired_ratio
    accepted = VerificationSummary.of(summary).accepted
    fams, skipped = integrable(accepted, families, device)
    plan = _Plan(accepted, fams, skipped, fallbacks(accepted, families, device), pairs, timer,
                 say)
    for fam, why in skipped.items():
        say(f"{fam}: {why}")
    result = Integration(stage="integrate", families=fams, chosen=families,
                         environment=environment(device), workloads={})
    by_dtype: dict[tuple, list] = {}
    for w in workloads:
        by_dtype.setdefault((w.dtype, w.device), []).append(w)
    for (dtype, device), ws in by_dtype.items():
        model = (built or {}).pop((dtype, device), None)
        if model is None:
            say(f"building {spec.model_id} ({dtype}) for integration")
            model = build(spec, ws[0].torch_dtype(), device)
        result.workloads.update(_integrate_model(model, ws, plan))
        del model
    write_json(run_dir / "integration.json", result)
    return result


def _integrate_model(model, ws: list, plan: _Plan) -> dict[str, IntegratedWorkload]:
    """The workloads of one model: checked, measured, proven, re-profiled, recorded."""
    from pipeline import integrate as ig

    check, spare_checks, usable = _checks(model, ws, plan)
    kept = check.kept
    measured = {w.key: _measure(model, w, plan, kept, usable) for w in ws}
    # after the timing: its GPU re-profile is a profiler session, which leaves CUPTI
    # attached, and later launches of this process may cost more (profiling.capture;
    # benchmarks/probes/README.md, `cupti_probe.py`), so time first.
    effect = _effect(model, ws[0], plan, kept, usable, [m for _, _, m in measured.values()])
    out = {}
    for w in ws:
        cases, allowed, m = measured[w.key]
        if w.device.startswith("cuda") and m.kept:
            plan.say(f"re-profile {w.key}")
            m.reprofile = ig.reprofile(model, plan.accepted, m.kept, w, allowed)
        out[w.key] = IntegratedWorkload(
            workload=w.to_dict(), check=check, patch_effect=effect, cases=cases,
            patch_memory=patch_memory(model, m.kept),
            # what `apply_kernels(..., compiled=True)` and `pipeline export` offer
            compiled=for_compile(m.kept),
            # a family tried in place of another has its measurement, not a reason
            skipped={f: why for f, why in plan.skipped.items() if f not in m.per_family},
            **({"fallback_checks": spare_checks} if spare_checks else {}), **m.to_dict())
    return out


def _checks(model, ws: list, plan: _Plan) -> tuple[Check, dict[str, Check], dict[str, str]]:
    """The whole-model check of the set (`integrate.check_and_bisect`), and of each family set
    aside in the set it could ship in: the checked set without the family it was set aside for;
    here, before any timing shows whether it will be tried, because the fp32 reference is
    freed before the timing. The families set aside that passed theirs are `usable`."""
    import torch

    from pipeline import integrate as ig

    ref = ig.fp32_reference(model)
    plan.say("whole-model check")
    # on the first workload of each mode: a decode step's families act on no prefill
    check = Check.of(ig.check_and_bisect(model, ref, plan.accepted, plan.families, ws))
    spare_checks = {f: Check.of(ig.check_and_bisect(
        model, ref, plan.accepted, [k for k in check.kept if k != instead] + [f], ws))
        for f, instead in plan.spare.items()}
    usable = {f: instead for f, instead in plan.spare.items() if f in spare_checks[f].kept}
    del ref
    if ws[0].device.startswith("cuda"):
        torch.cuda.empty_cache()
    return check, spare_checks, usable


def _measure(model, w, plan: _Plan, kept: list[str], usable: dict[str, str]
             ) -> tuple[dict, dict, IntegratedWorkload]:
    """One workload's paired timings (`integrate.measure`), a family set aside tried where
    its rival did not ship (`integrate.fall_back`): (its cases, the cases allowed, the
    measurement)."""
    from pipeline import integrate as ig

    plan.say(f"measure {w.key}")
    cases = workload_cases(model, w, plan.families + list(usable))
    allowed = {f: set(v) for f, v in cases.items()}
    m = IntegratedWorkload.of(ig.measure(model, w, plan.accepted, kept, allowed, plan.pairs,
                                         plan.timer))
    for f, instead in usable.items():
        if instead not in m.kept:
            plan.say(f"{f}: {instead} does not ship on {w.key}; trying {f} in its place")
            ig.fall_back(model, w, plan.accepted, m, f, instead, allowed, plan.pairs,
                         plan.timer)
    for f, why in m.unreached.items():
        plan.say(f"{f} on {w.key}: {why}")
    for f, keys in m.declined.items():
        plan.say(f"{f} on {w.key}: {ig.DECLINED.format(n=len(keys))}: {', '.join(keys)}")
    return cases, allowed, m


def _effect(model, w, plan: _Plan, kept: list[str], usable: dict[str, str],
            measured: list[IntegratedWorkload]) -> PatchEffect | None:
    """The patch-took-effect proof of the families some workload's set calls (those the
    others' passes never called were not timed), and of each family set aside that ships
    somewhere, in the set it ships in, without its rival."""
    from pipeline import integrate as ig

    reached = [k for k in kept if any(k not in m.unreached for m in measured)]
    effect = PatchEffect.of(ig.patch_took_effect(model, plan.accepted, reached, w)) \
        if reached else None
    shipped = {f: instead for f, instead in usable.items()
               if any(f in m.kept for m in measured)}
    for f, instead in shipped.items():
        effect = ig.with_effect_of(f, effect, ig.patch_took_effect(
            model, plan.accepted, [k for k in kept if k != instead] + [f], w))
    return effect

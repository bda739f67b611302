"""The run's frozen projections carried to a generation: Amdahl over its prefill and its steps.

A generation of N tokens is one prefill (time to the first token) and N - 1 decode steps. The
run froze, before integration, a projection per profiled workload from kernel numbers alone
(`pipeline.projection`): the eager pass's replay with the kernels in, and the CUDA-graph
projection of the step. Composed over hf-eager's measured call:

- prefill: the profiled pass saves wall * (1 - 1 / S) of the time to the first token, S the
  replay gain of the prefill workload's kernels (1 where the run has no prefill workload of
  that batch and prompt length, or no kernel of it served the call);
- a step of `ours` (transformers' loop, eager) saves wall * (1 - 1 / S) of hf-eager's mean
  time per output token (its call less its first token, over N - 1), the rest of the loop's
  work unchanged; a step of `graph` and `ours-graphs` (our loop: the host queues the next
  replay while the GPU runs this one) takes the projected graphed step, the graph
  projection's pass time;
- end to end: the first token and N - 1 steps; the speedup is hf-eager's call over that.

`ours-graphs` prefills through our loop, not transformers' `generate`, whose own set-up
(logits processors, cache, stopping criteria) is part of hf-eager's time to the first token
and none of ours: its first token is composed over `graph`'s measured one (the same loop,
unpatched), where the grid timed `graph`, as `ours` is composed over hf-eager's.

A family whose kernel did not serve every call of the generation (a case it had no kernel for
ran the original code, `e2e_variants.Ledger`, prefill and steps apart) or was never called
is priced at the original code's time: the projection is re-run for the families that did
(`project_set`, `project_graphs`, the same frozen kernel numbers that `project_kept` uses).
"""

from __future__ import annotations

from pathlib import Path

from core.artifacts import load
from core.records import (
    GenerationProjection,
    Integration,
    Profile,
    Projection,
    Ranking,
    TokenTimes,
)
from pipeline.projection.host import host_of
from pipeline.projection.workload import project_graphs, project_set


def compose(run_dir: Path, variant: str, base: TokenTimes, new: int,
            prefill_key: str | None, decode_key: str | None,
            prefill_served: set[str], steps_served: set[str],
            loop_base: TokenTimes | None = None) -> GenerationProjection | None:
    """The projection of `variant` for one grid point, or None where the run cannot give one
    (a CPU run, no decode workload of this batch, no trace). `loop_base`: `graph`'s measured
    times, the unpatched first token of our loop, for `ours-graphs`."""
    profile = load(run_dir / "profile.json", Profile, "profile")
    walls = {w.key: w.wall.median_ms for w in profile.workloads}
    if decode_key is None or base.tpot_p50 is None:
        return None
    proj = load(run_dir / "projection.json", Projection, "projection")
    integ = load(run_dir / "integration.json", Integration, "integration")
    ranked = {w.key: w for w in load(run_dir / "ranking.json", Ranking, "ranking").workloads}
    notes = []

    def set_for(key: str, graphed: bool) -> list[str]:
        w = integ.workloads[key]
        fams = w.kept
        if graphed and w.graphs is not None and w.graphs.has("families"):
            fams = w.graphs.families
        served = steps_served if key == decode_key else prefill_served
        missing = sorted(set(fams) - served)
        if missing:
            notes.append(f"{key}: {', '.join(missing)} priced at the original code (its "
                         "kernel did not serve every call of the generation's "
                         f"{'steps' if key == decode_key else 'prefill'})")
        return [f for f in fams if f in served]

    def replay(key: str, only: list[str]) -> float | None:
        if not only:
            return 1.0
        return project_set(run_dir, ranked[key], proj.kernel_speedups, host_of(proj, key),
                           True, only=only, cases=proj.case_speedups).replay

    s_pre = 1.0
    if variant != "graph" and prefill_key is not None:
        s_pre = replay(prefill_key, set_for(prefill_key, False))
    elif variant != "graph":
        notes.append("no prefill workload of this batch and prompt in the run: the prefill is "
                     "priced at the original code")
    # hf-eager's mean time per token over the call, not its median: its loop's host work
    # stalls some steps (p99 several times p50), and the call pays for every one of them
    step = (base.e2e_p50 - base.ttft_p50) / (new - 1)
    if variant == "ours":
        s_step = replay(decode_key, set_for(decode_key, False))
        if s_step is None or s_pre is None:
            return None
        tpot = step - walls[decode_key] * (1 - 1 / s_step)
    else:
        only = [] if variant == "graph" else set_for(decode_key, True)
        g = project_graphs(run_dir, ranked[decode_key], proj.graph_kernel_speedups
                           or proj.kernel_speedups, True, only=only,
                           cases=proj.graph_case_speedups)
        pass_us = g.unpatched_pass_us if variant == "graph" else g.kept_pass_us
        if pass_us is None or s_pre is None:
            return None
        tpot = pass_us / 1e3
    first = first_token_base(variant, base, loop_base)
    if first != base.ttft_p50:
        notes.append("the first token composed over graph's measured one (our loop, unpatched)")
    ttft = first - walls.get(prefill_key, 0.0) * (1 - 1 / s_pre) if prefill_key else first
    e2e = ttft + (new - 1) * tpot
    return GenerationProjection(
        ttft_ms=ttft, tpot_ms=tpot, e2e_ms=e2e, speedup=base.e2e_p50 / e2e,
        prefill_speedup=first / ttft, decode_speedup=step / tpot,
        prefill_share=min(1.0, walls.get(prefill_key, 0.0) / first)
        if prefill_key else 0.0,
        step_share=min(1.0, walls[decode_key] / step), notes=notes)


def first_token_base(variant: str, base: TokenTimes, loop_base: TokenTimes | None) -> float:
    """The measured first token a variant's prefill projection starts from: `graph`'s for
    `ours-graphs` where the grid timed it, hf-eager's otherwise."""
    if variant == "ours-graphs" and loop_base is not None and loop_base.ttft_p50 is not None:
        return loop_base.ttft_p50
    return base.ttft_p50

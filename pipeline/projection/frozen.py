"""The projection, frozen before integration: Amdahl and the trace replay per workload, from
kernel-level numbers and in-model host deltas alone (no whole-model timing enters it)."""

from __future__ import annotations

from pathlib import Path

from core.artifacts import load, write_json
from core.integration_records import IntegratedWorkload, Integration, TimingHost
from core.records import (
    ProjectedWorkload,
    Projection,
    RankedWorkload,
    Ranking,
    VerificationSummary,
)
from pipeline.policy import fallbacks, integrable
from pipeline.projection.host import host_of, rescaled_host, spread_set_share
from pipeline.projection.workload import project_graphs, project_set


def kernel_speedups(summary: VerificationSummary | dict, key: str = "speedup"
                    ) -> dict[str, float]:
    """family -> median over its accepted cases of `key` (kernel speedup, or host_us)."""
    import statistics

    by_family: dict[str, list[float]] = {}
    for acc in VerificationSummary.of(summary).accepted.values():
        if getattr(acc, key) is not None:
            by_family.setdefault(acc.family, []).append(getattr(acc, key))
    return {f: statistics.median(v) for f, v in by_family.items()}


def in_graph_speedups(summary: VerificationSummary | dict,
                      speed: dict[str, float]) -> dict[str, float]:
    """family -> the speedup the graph projection uses: the median over the family's cases of
    `graph_speedup` (both sides timed inside a CUDA graph, `verify.timing.bench_graphed`),
    else its `speedup` (`bench`), for the families in `speed`."""
    graphed = kernel_speedups(summary, "graph_speedup")
    return {f: graphed.get(f, v) for f, v in speed.items()}


def in_graph_case_speedups(summary: VerificationSummary | dict,
                           speed: dict[str, float]) -> dict[str, list]:
    """family -> [(case, speedup inside a graph, else by events)] of its accepted cases, for
    the families in `speed`: the graph projection matches occurrences to cases with them
    (`RankHooks.occurrence_case`)."""
    return case_speedups(summary, speed, graphed=True)


def case_speedups(summary: VerificationSummary | dict, speed: dict[str, float],
                  graphed: bool = False) -> dict[str, list]:
    """family -> [(case, kernel speedup by events; `graphed`: inside a graph where timed so)]
    of its accepted cases, for the families in `speed`. The replays speed up each occurrence
    by its own case and leave an occurrence no accepted case covers alone, as the patch does:
    a family's median applied to occurrences it never patches over-projects
    (benchmarks/results/README.md, "Per-case speedups in the replay")."""
    out: dict[str, list] = {}
    for acc in VerificationSummary.of(summary).accepted.values():
        if acc.family in speed and acc.case is not None:
            sp = (acc.graph_speedup if graphed else None) or acc.speedup
            out.setdefault(acc.family, []).append([acc.case, sp])
    return out


def freeze_projection(run_dir: Path, summary: VerificationSummary | dict, families: list[str],
                      on_gpu: bool, in_model: dict | None = None,
                      in_model_set: dict | None = None) -> Projection:
    """Re-rank with measured kernel times (not rooflines) and freeze the projection.
    `in_model`: per workload, the host deltas measured in the model (`host_stage`); they
    replace the search's per-kernel ones for that workload. `in_model_set`: per workload, the
    host share the families save together (`stages.host.set_host_share`); what it saves beyond
    their own deltas is spread over their calls (`projection.host.spread_set_share`)."""
    summary = VerificationSummary.of(summary)
    ranking = load(run_dir / "ranking.json", Ranking, "ranking")
    # only what will reach the model: a family skipped before any measurement (one that
    # cannot win, or one superseded by another replacing the same ops) is not projected
    device = "cuda" if on_gpu else "cpu"
    fams, _ = integrable(summary.accepted, families, device)
    # a family set aside may still ship where the one it was set aside for does not: its
    # numbers are kept for the projection of the set that ships (`project_kept`)
    known = fams + list(fallbacks(summary.accepted, families, device))
    speed = {f: v for f, v in kernel_speedups(summary).items() if f in known} if on_gpu else {}
    host = {f: v for f, v in kernel_speedups(summary, "host_delta_us").items()
            if f in known} if on_gpu else {}
    graph_speed = in_graph_speedups(summary, speed)
    graph_cases = in_graph_case_speedups(summary, speed)
    cases = case_speedups(summary, speed)
    workloads = {}
    for w in ranking.workloads:
        measured = (in_model or {}).get(w.key) or {}
        together = (in_model_set or {}).get(w.key)
        host_w, extra = spread_set_share({**host, **rescaled_host(w, measured)}, measured,
                                         together, w.enqueue_ms)
        if extra is not None:
            together = {**together, "extra_us_per_call": extra}
        workloads[w.key] = ProjectedWorkload(
            **project_set(run_dir, w, speed, host_w, on_gpu, only=fams, cases=cases).to_dict(),
            host_delta_us=host_w, host_in_model=measured, host_set=together,
            graphs=project_graphs(run_dir, w, graph_speed, on_gpu, only=fams,
                                  cases=graph_cases),
            note=None if on_gpu else "CPU/interpreter run: kernel times are not GPU timings, "
                                     "so no speedup is projected")
    out = Projection(stage="projection", kernel_speedups=speed, host_delta_us=host,
                     case_speedups=cases, graph_kernel_speedups=graph_speed,
                     graph_case_speedups=graph_cases, families=families, workloads=workloads)
    write_json(run_dir / "projection.json", out)
    return out


def project_kept(run_dir: Path, on_gpu: bool) -> None:
    """After integration: the projection for the set each workload shipped, computed from the
    kernel numbers frozen in projection.json before integration (kernel speedups and host
    deltas), so a rollback does not leave the report comparing the measurement with a set
    that never ran. Written into integration.json; projection.json stays as frozen."""
    proj = load(run_dir / "projection.json", Projection, "projection")
    integ = load(run_dir / "integration.json", Integration, "integration")
    ranking = {w.key: w for w in load(run_dir / "ranking.json", Ranking, "ranking").workloads}
    changed = False
    for key, w in integ.workloads.items():
        if key in ranking and set(w.kept) != set(proj.families):
            w.projection_for_kept = {"families": w.kept, **project_set(
                run_dir, ranking[key], proj.kernel_speedups, host_of(proj, key),
                on_gpu, only=w.kept, cases=proj.case_speedups).to_dict()}
            changed = True
        at_host = timing_host_projection(run_dir, ranking.get(key), proj, key, w, on_gpu)
        if at_host is not None:
            w.projection_at_timing_host = at_host
            changed = True
        g = w.graphs
        if key in ranking and g is not None and g.captured:
            # the graphs stage chooses its own set: the kernels + graph projection of the set
            # the graph ran, same numbers
            in_graph = g.families if g.has("families") else w.kept
            if set(in_graph) != set(proj.families):
                g.projected_for_kept = project_graphs(
                    run_dir, ranking[key], proj.graph_kernel_speedups or proj.kernel_speedups,
                    on_gpu, only=in_graph, cases=proj.graph_case_speedups)
                changed = True
    if changed:
        write_json(run_dir / "integration.json", integ)


def timing_host_projection(run_dir: Path, ranked: RankedWorkload | None, proj: Projection,
                           key: str, w: IntegratedWorkload, on_gpu: bool) -> TimingHost | None:
    """The shipped set's replay with the host chain at the speed the whole-model timing found
    the host: the unpatched pass's host time there (median over its calls, `combined.bound`)
    over the profile's (`enqueue_ms`). Not the projection, which stays frozen at the profile's
    moment: a reading of how much of its error is the host's drift between the two. A
    device-bound pass does not feel it; one that the kernels leave waiting on the host does.
    The families' host deltas stay at the profile's speed: scaled with the chain they land
    further from the measurement (benchmarks/results/README.md, "Timing-host replay"). None off
    the GPU, with nothing kept, or where either host time is missing (records from before they
    were kept)."""
    kept = w.kept
    then = ranked.enqueue_ms if ranked is not None else None
    bound = w.combined.bound if w.combined is not None else None
    now = bound.unpatched.host_ms if bound is not None else None
    if not (on_gpu and kept and then and now):
        return None
    drift = now / then
    replay = project_set(run_dir, ranked, proj.kernel_speedups, host_of(proj, key), on_gpu,
                         only=kept, cases=proj.case_speedups, host_scale=drift).replay
    return TimingHost(families=kept, host_drift=drift, profile_host_ms=then, timing_host_ms=now,
                      replay=replay)

"""The projection of one profiled workload with a set of patterns at measured kernel speedups:
Amdahl over their shares, the trace replay (eager), and the replay as one CUDA graph. From
kernel-level numbers alone: no whole-model timing enters it."""

from __future__ import annotations

from pathlib import Path

from core.artifacts import load
from core.integration_records import GraphsProjection, ProjectedSet
from core.record import Record
from core.records import Ceilings, Profile, ProfiledWorkload, RankedRow, RankedWorkload
from pipeline.pattern_rows import pattern_rows
from pipeline.projection.replay import (
    graph_projection,
    replay_gain,
    row_times,
    workload_graph,
)


class Replayed(Record):
    """The eager replay of a pass with rows replaced: its gain, each row's GPU time (us)."""
    gain: float
    row_us: dict[str, float] = {}


def amdahl(parts: list[tuple[float, float]]) -> float:
    """Whole-model speedup when each share p runs s times faster: 1/((1-sum p)+sum p/s)."""
    rest = 1.0 - sum(p for p, _ in parts)
    return 1.0 / (rest + sum(p / max(s, 1e-12) for p, s in parts))


def static_graph(w: ProfiledWorkload | dict, run_dir: Path | None,
                 ceil: Ceilings | dict | None = None):
    """The replay graph of a decode workload's static-cache step trace, None without one; with
    `ceil` and a profile that attributed that step (`w.static`), its pattern rows by pattern,
    as `graph.graph["pattern_rows"]`."""
    w = ProfiledWorkload.of(w)
    rel = w.static_trace
    if not rel or run_dir is None or w.time_basis != "device" or not (run_dir / rel).exists():
        return None
    from profiling.replay import build_graph
    from profiling.trace import load_trace

    step = w.static
    graph = build_graph(load_trace(run_dir / rel), step.step_index if step else -1)
    if step and ceil is not None:
        graph.graph["pattern_rows"] = {r.pattern: r for r in pattern_rows(step, ceil)
                                       if r.family}
    return graph


def _rows(ranked: RankedWorkload, speed: dict, only: list[str] | None) -> list[RankedRow]:
    return [r for r in ranked.rows if r.family in speed and (only is None or r.family in only)]


def project_set(run_dir: Path, ranked: RankedWorkload | dict, speed: dict, host: dict,
                on_gpu: bool, only: list[str] | None = None,
                cases: dict[str, list] | None = None, host_scale: float = 1.0) -> ProjectedSet:
    """Amdahl and replay projection of one workload for the families in `speed` (or `only`),
    from kernel-level numbers alone: no whole-model measurement enters it. `cases`
    (`case_speedups`): the replay speeds up each occurrence by its own case where the family
    matches occurrences to cases; without it (projections frozen before it was) every
    occurrence takes the family's median. `host_scale`: as in `project_with`."""
    ranked = RankedWorkload.of(ranked)
    rows = _rows(ranked, speed, only)
    parts = [(r.share, speed[r.family]) for r in rows]
    replayed = replay_projection(
        run_dir, ranked.key, {r.pattern: speed[r.family] for r in rows},
        {r.pattern: host.get(r.family) for r in rows},
        {r.pattern: (cases or {}).get(r.family) for r in rows},
        host_scale) if on_gpu and rows else None
    replayed = Replayed.of(replayed) if replayed is not None else None
    if not on_gpu:
        replay = None
    elif not rows:
        replay = 1.0
    else:  # None without a trace to replay
        replay = replayed.gain if replayed else None
    return ProjectedSet(
        amdahl=amdahl(parts) if parts else 1.0,
        replay=replay,
        # each pattern's GPU time as the replay gives it (ms): the report's per-family table
        row_ms={k: v / 1e3 for k, v in replayed.row_us.items()} if replayed else None,
        patterns=[r.pattern for r in rows])


def project_graphs(run_dir: Path, ranked: RankedWorkload | dict, speed: dict, on_gpu: bool,
                   only: list[str] | None = None,
                   cases: dict[str, list] | None = None) -> GraphsProjection:
    """The CUDA-graph projection of one workload, frozen with the families' (kernel numbers
    alone): `unpatched`, the unpatched model replayed as one graph, and `kept`, the families in
    `speed` (or `only`) at their measured kernel speedups, then graphed ("kernels + graph");
    gains over the eager unpatched pass (`project_graphs_with`)."""
    if not on_gpu:
        return GraphsProjection(unpatched=None, kept=None, patterns=[],
                                note="CPU run: no GPU trace to replay")
    ranked = RankedWorkload.of(ranked)
    rows = _rows(ranked, speed, only)
    return GraphsProjection.of(project_graphs_with(
        run_dir, ranked.key, {r.pattern: speed[r.family] for r in rows},
        {r.pattern: (cases or {}).get(r.family) for r in rows}))


def _profiled(run_dir: Path, key: str) -> tuple[ProfiledWorkload, Ceilings]:
    """The workload `key` of the run's profile, and the ceilings it was profiled under."""
    profile = load(run_dir / "profile.json", Profile, "profile")
    return next(x for x in profile.workloads if x.key == key), profile.ceilings or Ceilings()


def _sped_up(w: ProfiledWorkload, ceil: Ceilings, speedups: dict[str, float],
             case_speedups: dict | None, host_delta_us: dict | None = None) -> list[RankedRow]:
    """The workload's pattern rows in `speedups`, each at its time over its speedup."""
    rows = [r for r in pattern_rows(w, ceil) if r.pattern in speedups]
    for r in rows:
        r.target_us = r.time_us / speedups[r.pattern]
        r.case_speedups = (case_speedups or {}).get(r.pattern)
        if host_delta_us is not None:
            r.host_delta_us = host_delta_us.get(r.pattern)
    return rows


def project_graphs_with(run_dir: Path, key: str, speedups: dict[str, float],
                        case_speedups: dict[str, list] | None = None) -> GraphsProjection:
    """The frozen "graphs" projection of one profiled workload: the unpatched model graphed,
    and the patterns in `speedups` sped up (measured kernel speedups) then graphed. Gains over
    the replayed eager pass; None with a note where there is no trace or no calibration.
    `case_speedups`: per pattern, [(case, speedup)] of its accepted cases; a pattern whose
    family matches occurrences to cases (`RankHooks.occurrence_case`) is sped up per case."""
    w, ceil = _profiled(run_dir, key)
    graph = workload_graph(w, run_dir / w.trace if w.trace else None)
    static = static_graph(w, run_dir, ceil)
    rows = _sped_up(w, ceil, speedups, case_speedups)
    alone = graph_projection(graph, ceil, static=static)
    kept = (graph_projection(graph, ceil, rows, static=static) if rows and graph is not None
            else alone)
    return GraphsProjection(unpatched=alone.gain, kept=kept.gain, patterns=sorted(speedups),
                            note=alone.note, basis=alone.basis,
                            unpatched_pass_us=alone.pass_us, kept_pass_us=kept.pass_us)


def project_with(run_dir: Path, key: str, speedups: dict[str, float],
                 host_delta_us: dict[str, float | None] | None = None,
                 case_speedups: dict[str, list | None] | None = None,
                 host_scale: float = 1.0) -> float | None:
    """Replay gain of one profiled workload with the given patterns sped up (measured), each
    fused call saving (or adding) its measured host time when given; `case_speedups` as in
    `project_graphs_with`. `host_scale`: the host chain, as calibrated to the profile, taken
    that many times as long (a host that ran slower, > 1, at another moment)."""
    out = replay_projection(run_dir, key, speedups, host_delta_us, case_speedups, host_scale)
    return out.gain if out else None


def replay_projection(run_dir: Path, key: str, speedups: dict[str, float],
                      host_delta_us: dict[str, float | None] | None = None,
                      case_speedups: dict[str, list | None] | None = None,
                      host_scale: float = 1.0) -> Replayed | None:
    """`project_with`'s gain, and `row_us`: each pattern's GPU time as the replay gives it
    (`replay.row_times`), for the report's per-family table."""
    w, ceil = _profiled(run_dir, key)
    graph = workload_graph(w, run_dir / w.trace if w.trace else None)
    if graph is None:
        return None
    if host_scale != 1.0:
        from profiling.replay import scale_host

        graph = scale_host(graph, host_scale)
        graph.graph["host_scale"] *= host_scale
    rows = _sped_up(w, ceil, speedups, case_speedups, host_delta_us or {})
    return Replayed(gain=replay_gain(graph, rows), row_us=row_times(graph, rows))


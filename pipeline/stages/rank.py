"""The rank stage: profile.json -> ranking.json (patterns, shares, attainable speedups, and the
whole-model projection both ways: the Amdahl formula and a trace replay).

Each row is a pattern aggregated over its occurrences (a kernel family replaces all of them);
unrecognised ops keep rows of their own. A row's attainable speedup comes from the roofline
of a fused kernel (or, once one exists, from its measured time), and its whole-model gain is
what replacing that row alone would do to the pass. Rows are ranked by the replay gain where
a GPU trace exists, else by the Amdahl gain.
"""

from __future__ import annotations

from pathlib import Path

from core.artifacts import load, write_json
from core.records import (
    Ceilings,
    CurvePoint,
    Floor,
    NoRemedy,
    Profile,
    ProfiledWorkload,
    RankedRow,
    RankedWorkload,
    Ranking,
)
from pipeline.pattern_rows import pattern_rows
from pipeline.projection.replay import (
    LAUNCH_BOUND_BUSY,
    graph_gains,
    graph_projection,
    replay_gain,
    workload_graph,
)
from pipeline.projection.workload import amdahl, static_graph
from pipeline.summary import console

RANKING = "ranking.json"
# A device-bound pass lists the CUDA-graph row only when the replay projects more than this:
# below it the graph's own node and launch costs are within the replay's error of its saving.
GRAPH_MIN_GAIN = 1.02
GRAPH_PATTERN = "host: CUDA graph capture"


NO_REMEDY_MIN = 1.2  # attainable speedup from which a row nothing acts on is reported


def no_remedy(rows: list[RankedRow | dict]) -> list[NoRemedy]:
    """Rows with headroom (attainable >= NO_REMEDY_MIN) that no family acts on: listed so the
    gap is visible rather than silent, with why (a family declined it, or none replaces it)."""
    out = []
    for r in RankedRow.list_of(rows):
        # the CUDA-graph row is itself a remedy (for the rest row's host time)
        if r.family or r.remedy or (r.attainable_speedup or 1.0) < NO_REMEDY_MIN:
            continue
        why = (f"{r.declined.family}: {r.declined.reason}" if r.declined
               else "no kernel family replaces it")
        out.append(NoRemedy(pattern=r.pattern, share=r.share,
                            attainable_speedup=r.attainable_speedup, why=why))
    return sorted(out, key=lambda x: -x.share)


ORDER = ("rank_gain: the whole-model gain of replacing the row with a kernel family ({key}); "
         "1.000x for ops no family replaces; ties by share")
# graph_gain: launch-bound passes, where the graph ships and what a row saves inside it decides


def group_alternatives(rows: list[RankedRow]) -> None:
    """Mark each row that replaces the same ops as another (`alternative_to`) as an option of
    the top-level row it extends (`option_of`), and list the options on that row (`options`).
    The top-level rows partition the pass's ops: their shares and the rest row sum to 1."""
    by_pattern = {r.pattern: r for r in rows}
    options: dict[str, list[str]] = {r.pattern: [] for r in rows}
    for r in rows:
        primary = r.extends if r.extends in by_pattern else next(
            (p for p in r.alternative_to if p in by_pattern), None)
        seen = {r.pattern}
        while primary is not None and by_pattern[primary].alternative_to:
            seen.add(primary)
            primary = next((p for p in by_pattern[primary].alternative_to
                            if p in by_pattern and p not in seen), None)
        r.option_of = primary
    for r in rows:
        if r.option_of:
            options[r.option_of].append(r.pattern)
    for r in rows:
        r.options = options[r.pattern]


def top_level(rows: list[RankedRow | dict]) -> list[tuple[RankedRow, list[RankedRow]]]:
    """(row, its options) for each top-level row, ordered by the best rank_gain among the row
    and its options (then share): the order the tables show."""
    rows = RankedRow.list_of(rows)
    if any(not r.has("option_of") for r in rows):  # a ranking.json from before the grouping
        rows = [r.model_copy() for r in rows]
        group_alternatives(rows)
    by_pattern = {r.pattern: r for r in rows}
    groups = [(r, [by_pattern[o] for o in r.options or () if o in by_pattern])
              for r in rows if not r.option_of]

    def key(g):
        members = [g[0], *g[1]]
        return (-max(_gain(m) for m in members), -g[0].share)
    return sorted(groups, key=key)


def _gain(r: RankedRow) -> float:
    """The row's rank_gain; 1.0 where the ranking has none (written before it existed)."""
    return r.rank_gain if r.has("rank_gain") else 1.0


def project(w: ProfiledWorkload, rows: list[RankedRow], graph=None) -> None:
    """Fill each row's whole-model gain alone (Amdahl, and replay when a graph is given)."""
    for r in rows:
        r.amdahl_gain = amdahl([(r.share, r.attainable_speedup)])
        r.replay_gain = None
        # a family row is replayed even at its roofline: fusing still removes launches and
        # host dispatch, which is what decides a launch-bound pass
        if graph is not None and r.kernel_correlations and r.family:
            r.replay_gain = replay_gain(graph, [r])


def graph_row(w: ProfiledWorkload, graph, ceil: Ceilings, candidates: list[RankedRow],
              static=None) -> RankedRow | None:
    """The host's remedy row: CUDA graph capture of the whole pass. Its share is the rest
    row's (host, launches, idle over the wall time), its gain the replay with every host edge
    removed. Never a family (the family chooser passes it by): the graphs stage applies it
    after integration. A device-bound pass lists it only when the replay says it helps more
    than GRAPH_MIN_GAIN; a launch-bound one always does, with its projection or why there is
    none. A CPU pass never does: no graph is captured there, and its rest row (host time,
    which on a CPU is all of the time) is not what a graph would remove."""
    if w.time_basis != "device":
        return None
    busy = w.gpu_busy_share
    launch_bound = busy is not None and busy < LAUNCH_BOUND_BUSY
    alone = graph_projection(graph, ceil, static=static)
    with_kernels = (graph_projection(graph, ceil, candidates, static=static) if candidates
                    else alone)
    gain = alone.gain
    if not launch_bound and (gain is None or gain <= GRAPH_MIN_GAIN):
        return None
    wall_us = w.wall.median_ms * 1e3
    share = w.rest_share
    rest_us = share * wall_us
    attainable = amdahl_gain = None
    if alone.pass_us is not None:
        # what is left of the rest once graphed: the projected pass minus the device work kept
        left = max(alone.pass_us - (wall_us - rest_us), 1e-3)
        attainable = rest_us / left if rest_us > 0 else 1.0
        amdahl_gain = amdahl([(share, attainable)])
    why = (f"{'launch-bound' if launch_bound else 'device-bound'} pass: GPU busy "
           f"{busy:.0%} of wall; a CUDA graph replays the pass's kernels in their order "
           "without the host's dispatch and launches")
    return RankedRow(
        pattern=GRAPH_PATTERN, family=None, remedy="cuda_graph", occurrences=1,
        modules=[], time_us=rest_us, share=share, host_us=0.0, launches=0,
        op_calls=0, min_bytes=0, flops=0, roofline_us=0.0,
        target_us=rest_us / attainable if attainable else None,
        target_source="replay, host removed",
        attainable_speedup=attainable, achieved_GBps=None, host_share=share,
        alternative_to=[], amdahl_gain=amdahl_gain, replay_gain=gain,
        graphed_pass_us=alone.pass_us, graph_with_kernels_gain=with_kernels.gain,
        graph_with_kernels_pass_us=with_kernels.pass_us,
        with_kernels=[r.pattern for r in candidates], why=why,
        note=alone.note, graph_basis=alone.basis)


def rank_workload(w: ProfiledWorkload | dict, ceil: Ceilings | dict, trace_path: Path | None,
                  kernel_times: dict[str, float] | None = None, static=None) -> RankedWorkload:
    """`static`: the replay graph of a decode step over a static KV cache (`static_graph`),
    which the CUDA-graph row's projection replays."""
    w, ceil = ProfiledWorkload.of(w), Ceilings.of(ceil)
    rows = pattern_rows(w, ceil, kernel_times)
    graph = workload_graph(w, trace_path)
    project(w, rows, graph)
    key = "replay_gain" if graph is not None else "amdahl_gain"
    candidates = exclusive(sorted([r for r in rows if r.family], key=lambda r: (
        -(getattr(r, key) or 1.0), -r.share)))
    host = graph_row(w, graph, ceil, candidates, static if graph is not None else None)
    if host is not None:
        rows.append(host)
    if graph_gains(w, rows, graph, ceil, static, host):
        key = "graph_gain"
    for r in rows:
        if r.remedy:
            r.rank_gain = r.replay_gain or 1.0
        else:
            r.rank_gain = (getattr(r, key) or 1.0) if r.family else 1.0
    rows.sort(key=lambda r: (-r.rank_gain, -r.share))
    group_alternatives(rows)
    curve = _curve(graph, exclusive([r for r in rows if r.family]))
    busy = w.gpu_busy_share
    launch_bound = busy is not None and busy < LAUNCH_BOUND_BUSY
    rows = [r.without("kernel_correlations", "occurrence_cases") for r in rows]
    return RankedWorkload(
        key=w.key, workload=w.workload, wall_ms=w.wall.median_ms,
        enqueue_ms=w.wall.enqueue_ms, time_basis=w.time_basis,
        gpu_busy_share=busy, launch_bound=launch_bound,
        regime=_regime(w, rows, launch_bound), ranked_by=key,
        ordered_by=ORDER.format(key=key), rest_share=w.rest_share, rows=rows,
        no_remedy=no_remedy(rows), cumulative=curve,
        ceiling_amdahl=curve[-1].amdahl if curve else 1.0,
        ceiling_replay=curve[-1].replay if curve else None,
        floor=_floor(w))


def _curve(graph, candidates: list[RankedRow]) -> list[CurvePoint]:
    """The cumulative projection: the top 1, 2, ... candidate families replaced."""
    curve = []
    for n in range(1, len(candidates) + 1):
        top = candidates[:n]
        curve.append(CurvePoint(
            n=n, pattern=top[-1].pattern, family=top[-1].family,
            amdahl=amdahl([(r.share, r.attainable_speedup) for r in top]),
            replay=replay_gain(graph, top) if graph is not None else None))
    return curve


def _floor(w: ProfiledWorkload) -> Floor | None:
    """The profile's floor pass (`profiling.density.floor`) with what it allows over the wall."""
    f = w.floor
    if not f or not f.wall_ms:
        return None
    return f.model_copy(update={"over_wall": w.wall.median_ms / f.wall_ms})


def floor_line(w) -> str | None:
    """The floor, said once for the terminal and the report (`w`: a ranked workload, or the
    report's view of one)."""
    if isinstance(w, dict):
        w = RankedWorkload.of(w)
    f, wall_ms = w.floor, w.wall_ms
    if not f:
        return None
    return (f"floor: the pass's GEMMs and attention alone, back to back in one CUDA graph, take "
            f"{f.wall_ms:.2f} ms (kernels {f.kernel_ms:.2f}): at most "
            f"{f.over_wall:.2f}x over this pass's {wall_ms:.2f} ms while they run at "
            "cuBLAS's and SDPA's rate")


def exclusive(rows: list[RankedRow]) -> list[RankedRow]:
    """`rows` in their order without any row that overlaps one before it (`alternative_to`):
    replacing both would count the ops they share twice."""
    kept: list[RankedRow] = []
    for r in rows:
        alt = set(r.alternative_to)
        if any(k.pattern in alt or r.pattern in k.alternative_to for k in kept):
            continue
        kept.append(r)
    return kept


def _regime(w: ProfiledWorkload, rows: list[RankedRow], launch_bound: bool) -> str:
    if w.time_basis != "device":
        return ("CPU profile: shares are host time of aten ops; GPU projections need a GPU "
                "profile")
    if not launch_bound:
        msg = f"device-bound: the GPU is busy {w.gpu_busy_share:.0%} of the wall time"
        curve = sorted(w.density or [], key=lambda p: p.compute_share)
        if len(curve) > 1:  # profiling.density: what the projections price compute kernels at
            lo, hi = curve[0], curve[-1]
            ratio = hi.compute_ratio / lo.compute_ratio
            msg += (f"; its GEMMs and attention run {ratio:.2f}x "
                    f"as long at {hi.compute_share:.0%} of a pass as at "
                    f"{lo.compute_share:.0%} (power cap), and the projections say so")
        return msg
    host_rows = sorted(rows, key=lambda r: -r.host_us)[:3]
    spread = sum(r.host_us for r in host_rows) / max(1e-9, sum(r.host_us for r in rows))
    msg = (f"launch-bound: the GPU is busy only {w.gpu_busy_share:.0%} of the wall time, so "
           f"faster kernels gain little; the critical path is host time")
    if spread < 0.5:
        msg += (" spread thinly over many ops: the remedy is outside kernel work (CUDA graphs, "
                "or torch.compile(mode='reduce-overhead') which uses them)")
    else:
        msg += "; the largest host costs: " + ", ".join(r.pattern for r in host_rows)
    return msg


def run_rank(run_dir: Path, kernel_times: dict[str, dict] | None = None) -> Ranking:
    profile = load(run_dir / "profile.json", Profile, "profile")
    ceil = profile.ceilings or Ceilings()
    workloads = []
    for w in profile.workloads:
        trace = run_dir / w.trace if w.trace else None
        workloads.append(rank_workload(w, ceil, trace, (kernel_times or {}).get(w.key),
                                       static_graph(w, run_dir, ceil)))
    ranking = Ranking(stage="rank", model=profile.model.id, ceilings=ceil, workloads=workloads)
    write_json(run_dir / RANKING, ranking)
    return ranking


def print_ranking(ranking: Ranking | dict, top: int = 8) -> None:
    for w in Ranking.of(ranking).workloads:
        console.print(f"[bold]ranking[/bold] {w.key}: {w.regime}")
        console.print(_rows_table(w, top))
        for g in w.no_remedy or []:
            console.print(f"  no remedy yet: {g.pattern} ({g.share:.1%} of the pass, "
                          f"attainable {g.attainable_speedup:.2f}x): {g.why}")
        if w.cumulative and w.time_basis == "device":
            last = w.cumulative[-1]
            rp = f", replay {last.replay:.3f}x" if last.replay else ""
            console.print(f"  replacing all {last.n} candidate families: Amdahl "
                          f"{last.amdahl:.3f}x{rp} (projected ceiling of kernel work)")
        if line := floor_line(w):
            console.print(f"  {line}")


def _rows_table(w: RankedWorkload, top: int):
    from rich.table import Table

    t = Table(title=f"patterns, ordered by {w.ordered_by or w.ranked_by}; "
                    f"options (replacing the same ops) indented beneath their row")
    for c in ("pattern", "family", "occ", "share", "attainable", "amdahl", "replay",
              "rank_gain"):
        t.add_column(c, justify="left" if c in ("pattern", "family") else "right",
                     overflow="fold")

    def cells(r, name):
        return (name, r.family or r.remedy or "-", str(r.occurrences),
                f"{r.share:.1%}", _x(r.attainable_speedup, 2),
                _x(r.amdahl_gain, 3), _x(r.replay_gain, 3), f"{_gain(r):.3f}x")
    for r, options in top_level(w.rows)[:top]:
        t.add_row(*cells(r, r.pattern))
        for o in options:
            also = [x for x in o.overlaps if x != r.pattern]
            t.add_row(*cells(o, "  or " + o.pattern + (
                f" (also holds ops of {', '.join(also)})" if also else "")))
    if w.rest_share is not None:
        t.add_row("rest: host/launch/idle", "", "", f"{w.rest_share:.1%}", "", "", "", "")
    return t


def _x(v: float | None, digits: int) -> str:
    return f"{v:.{digits}f}x" if v else "-"

"""The rank stage's trace-replay projections: what a set of rows saves when the profiled pass is
replayed with their kernels at their target times, eagerly (`replay_gain`) or captured as one
CUDA graph (`graph_projection`), and the replay graph of a profiled pass (`workload_graph`).

A row here is a rank-stage row (`rank.pattern_rows`) that still carries its occurrences'
kernel correlations and, where its family matches occurrences to cases, their cases.
"""

from __future__ import annotations

from pathlib import Path

from core.record import Record
from core.records import Ceilings, ProfiledWorkload, RankedRow

LAUNCH_BOUND_BUSY = 0.5  # below this GPU-busy share of the wall time a pass is launch-bound
NOT_CALIBRATED = ("CUDA graph costs not calibrated on this device (ceilings measured before "
                  "`graph_node_us`/`graph_launch_us` existed): run `pipeline calibrate` again; "
                  "no projection")


class GraphPass(Record):
    """A pass replayed as one CUDA graph (`graph_projection`): its length, and its gain over
    the replayed eager pass; None with a note where it cannot be projected."""
    pass_us: float | None = None
    gain: float | None = None
    note: str | None = None
    base_us: float | None = None
    basis: str | None = None
    in_static_step: list[str] | None = None


def replay_gain(graph, rows: list[RankedRow | dict]) -> float:
    """Whole-model gain from replaying the trace with `rows` replaced.

    Each occurrence's kernels become one kernel of the target time and its launch calls merge
    into one. The Python-side dispatch a fused call saves or adds is only known once a kernel
    exists: a row may carry `host_delta_us` (measured, unprofiled: the baseline call's host
    time minus the candidate's, per occurrence; negative when the kernel costs the host more,
    as Triton's launcher can), else none is assumed. Profiled host times are inflated by the
    profiler, so they never stand in for it.
    """
    from profiling.replay import Replacement, kernel_durations, what_if

    dur = kernel_durations(graph)
    reps = []
    for r, corrs, scales in disjoint(rows):
        # a measured kernel may be slower than the code it replaces: project that too, not 1.00x
        kept = [(c, f) for c, f in zip(corrs, scales) if any(x in dur for x in c)]
        occ = [c for c, _ in kept]
        # Each row's saving stays on its own removed launches: spread over every row's
        # launches, a saving the row's own segments cannot hold (capped at their length)
        # moves onto other patterns' launches and over-projects the set.
        # The measured delta (per call, one call per occurrence) already pays for the launch
        # calls the fused call removes: their nodes leave the replay with their own traced
        # durations, and only the rest of the occurrence's delta comes off the host segments
        # before them, pooled over those segments (a row's launches can be shorter than the
        # pass's mean launch, and some segments shorter than one launch's share).
        # Evidence for both: benchmarks/results/README.md, "Host savings per row".
        removed = max(0, r.launches - len(occ))
        total = None
        if occ and r.host_delta_us is not None and removed:
            total = r.host_delta_us
        for corr, scale in kept:
            present = [c for c in corr if c in dur]
            reps.append(Replacement(frozenset(present), sum(dur[c] for c in present) * scale,
                                    host_saving_total_us=total))
    if not reps:
        return 1.0
    base, us = clocked(graph, reps, what_if(graph, reps))
    return base / us


def clocked(graph, reps: list, pass_us: float) -> tuple[float, float]:
    """The profiled pass and `pass_us` (the pass with `reps` applied) as they run beside each
    other in a paired timing, their compute-bound kernels (the profile's GEMMs and attention)
    slowed as the workload's density curve says (`profiling.density`); both unchanged without
    a curve (a launch-bound or CPU profile, or one from before the curve was measured).

    A paired timing alternates the two passes pass by pass, so both are priced at the clock
    their mix would set: the curve is read at the mix's other work per unit of compute,
    against the profiled pass's: priced as if each ran alone, the patched pass matches in
    absolute time while the ratio misses, because the eager pass beside it runs slower too
    (benchmarks/results/README.md, "The power cap in the replay"). A replacement of compute
    kernels counts as compute, its fused memory work included."""
    from profiling.density import slowdown
    from profiling.replay import kernel_durations

    base = replayed_once(graph)
    curve, compute = graph.graph.get("density"), graph.graph.get("compute")
    if not curve or not compute:
        return base, pass_us
    dur = kernel_durations(graph)
    before = sum(d for c, d in dur.items() if c in compute)
    after = before
    for r in reps:
        hit = [c for c in r.device if c in compute]
        if hit:
            after += r.new_duration_us - sum(dur.get(c, 0.0) for c in hit)
    other, other_after = base - before, max(0.0, pass_us - after)
    if before <= 0 or other <= 0 or after <= 0:
        return base, pass_us
    scale = (other + other_after) / (before + after) * before / other
    s = slowdown(curve, scale)
    return base + before * (s - 1.0), pass_us + after * (s - 1.0)


def replacements(graph, rows: list[RankedRow | dict]) -> list:
    """Each row's occurrences as replacements at the row's target time, no host saving (the
    graph projections remove the host anyway)."""
    from profiling.replay import Replacement, kernel_durations

    dur = kernel_durations(graph)
    reps = []
    for _, corrs, scales in disjoint(rows):
        for corr, scale in zip(corrs, scales):
            present = [c for c in corr if c in dur]
            if present:
                reps.append(Replacement(frozenset(present), sum(dur[c] for c in present) * scale))
    return reps


def disjoint(rows: list[RankedRow | dict]
             ) -> list[tuple[RankedRow, list[list[int]], list[float]]]:
    """Each row with the occurrences (kernel correlations) it replaces, none twice, and each
    one's time scale (`scales`; an occurrence without one is not replaced). Where two rows
    replace the same kernels (GPT-2's c_fc GEMM is in `linear`, which the matmul family
    patches, and in mlp_gemm_gelu, which matmul_gelu patches with its activation), the fused
    alternative (`extends`) takes the occurrence, as its patch does in the model, and the
    other row keeps the rest of its occurrences."""
    taken: set[int] = set()
    out = []
    for r in sorted(RankedRow.list_of(rows), key=lambda r: r.extends is None):
        keep = [(c, f) for c, f in zip(r.kernel_correlations, scales(r))
                if f is not None and not taken.intersection(c)]
        for c, _ in keep:
            taken.update(c)
        out.append((r, [c for c, _ in keep], [f for _, f in keep]))
    return out


def row_times(graph, rows: list[RankedRow | dict]) -> dict[str, float]:
    """Each row's GPU time (us) with the occurrences it replaces at their target: an
    occurrence no accepted case covers, or one a fused alternative takes (`disjoint`), keeps
    its time, as the patch leaves it (benchmarks/results/README.md, "Per-case speedups in the
    replay")."""
    from profiling.replay import kernel_durations

    dur = kernel_durations(graph)
    return {r.pattern: r.time_us - sum(
        sum(dur.get(c, 0.0) for c in corr) * (1.0 - f) for corr, f in zip(corrs, fs))
        for r, corrs, fs in disjoint(rows)}


def scales(row: RankedRow | dict) -> list[float | None]:
    """Per occurrence, its target over its time: the row's, or where the row carries measured
    speedups per case (`case_speedups`: [(case, speedup)], with `occurrence_cases`) the
    speedup of the first case whose keys the occurrence's match; None where none does: the
    family's patch leaves that module alone, so it is not replaced (a family's median applied
    to occurrences it never patches over-projects: benchmarks/results/README.md, "Per-case
    speedups in the replay")."""
    row = RankedRow.of(row)
    n = len(row.kernel_correlations)
    by_case, cases = row.case_speedups, row.occurrence_cases
    if by_case is None or cases is None or len(cases) != n:
        return [target_ratio(row)] * n

    def scale(keys: dict | None) -> float | None:
        if keys:
            for case, sp in by_case:
                if all(case.get(k) == v for k, v in keys.items()):
                    return 1.0 / sp
        return None

    return [scale(c) for c in cases]


def graph_projection(graph, ceil: Ceilings | dict, rows: list[RankedRow | dict] | None = None,
                     static=None) -> GraphPass:
    """The pass replayed as one CUDA graph (`profiling.replay.graphed`): `pass_us` and the
    gain over the replayed eager pass, for the unpatched model or (`rows`) with those rows'
    kernels at their target times first ("kernels + graph"). None with a note where the
    device's graph costs were never measured.

    `static`: for decode, the replay graph of the step over a static KV cache, which is what
    the graph captures (`profiling.capture.make_static_runner`); the pass is then that step
    graphed. The static cache reads and masks all its slots, so the dynamic step's device work
    undercounts the graph's. A row is replaced where the static step has its pattern
    (`static_graph` attributes that step), at the row's own target over time: there HF's
    attention runs repeat_kv's copies and cuDNN's SDPA over every slot, several times its
    dynamic step's time, and crediting decode_attention with the dynamic step's saving
    over-projects (benchmarks/results/README.md, "Static-cache decode graphs"). A row the
    static step lacks saves
    what it saves in the dynamic step graphed. The gain stays over the user's eager call, the
    dynamic step."""
    from profiling.replay import graphed_with

    ceil = Ceilings.of(ceil)
    node, launch = ceil.graph_node_us, ceil.graph_launch_us
    if graph is None:
        return GraphPass(note="no GPU trace: no replay projection")
    if node is None or launch is None:
        return GraphPass(note=NOT_CALIBRATED)
    base = replayed_once(graph)
    rows = RankedRow.list_of(rows)
    plain = graphed_once(graph, node, launch)
    if static is None:
        reps = replacements(graph, rows)
        base, us = clocked(graph, reps, graphed_with(graph, reps, node, launch) if reps
                           else plain)
        return GraphPass(pass_us=us, gain=base / us, base_us=base, basis="the profiled step")
    there = static.graph.get("pattern_rows") or {}
    moved = [as_row_of(r, there[r.pattern]) for r in rows if r.pattern in there]
    rest = [r for r in rows if r.pattern not in there]
    reps = replacements(static, moved)
    us = graphed_with(static, reps, node, launch) if reps else graphed_once(static, node, launch)
    if rest:
        us -= plain - graphed_with(graph, replacements(graph, rest), node, launch)
    return GraphPass(pass_us=us, gain=base / us, base_us=base,
                     basis="the step over a static KV cache",
                     in_static_step=sorted(r.pattern for r in moved))


def as_row_of(row: RankedRow, there: RankedRow) -> RankedRow:
    """The static step's row of `row`'s pattern, sped up by `row`'s target over its time, or
    by `row`'s speedups per case, matched to the static step's own occurrences."""
    return there.model_copy(update={"target_us": there.time_us * target_ratio(row),
                                    "case_speedups": row.case_speedups})


def target_ratio(row: RankedRow) -> float:
    """A row's target over its profiled time: the time scale of each of its occurrences."""
    return row.target_us / row.time_us if row.time_us else 1.0


def replayed_once(graph) -> float:
    """The eager replay's length, kept on the graph (a setdefault would replay every time)."""
    from profiling.replay import replay

    if "_base_len" not in graph.graph:
        graph.graph["_base_len"] = replay(graph)
    return graph.graph["_base_len"]


def graphed_once(graph, node: float, launch: float) -> float:
    """The plain graphed replay, kept on the graph: `graph_gains` asks for it once per row."""
    from profiling.replay import graphed

    key = ("_graphed", node, launch)
    if key not in graph.graph:
        graph.graph[key] = graphed(graph, node, launch)
    return graph.graph[key]


def workload_graph(w: ProfiledWorkload | dict, trace_path: Path | None):
    """The replay graph of the profiled step, host time calibrated to the unprofiled wall."""
    w = ProfiledWorkload.of(w)
    if trace_path is None or w.time_basis != "device" or not trace_path.exists():
        return None
    from profiling.replay import build_graph, calibrate_host, scale_host
    from profiling.trace import load_trace

    traced = build_graph(load_trace(trace_path), w.step_index)
    graph, factor = calibrate_host(traced, w.wall.median_ms * 1e3)
    # calibrate_host gives the slowest host consistent with the wall time; a device-bound pass
    # hides how fast its host really is, which the profile's host-bound probe measured. A
    # launch-bound pass hides nothing: its wall is its host chain, and the probe (another,
    # tiny pass, timed minutes before its capture) may only misread it, and would make the
    # projection depend on another moment's host speed (benchmarks/probes/README.md,
    # `probe_rule_ab.py`). What batch 1 still missed is the set's host saving, which
    # projection.host.spread_set_share accounts for.
    probe = w.host_factor
    launch_bound = (w.gpu_busy_share or 1.0) < LAUNCH_BOUND_BUSY
    if probe is not None and probe < factor and not launch_bound:
        graph, factor = scale_host(traced, probe), probe
    # the host's own unprofiled time for the pass, when the profile timed it: the call returns
    # after its last launch, so it bounds the host chain directly, where a device-bound wall
    # only bounds it from above (a device-bound pass's host chain can be two thirds of its wall)
    enqueue = enqueue_factor(traced, w.wall.enqueue_ms)
    if enqueue is not None and enqueue < factor:
        graph, factor = scale_host(traced, enqueue), enqueue
    graph.graph["host_scale"] = factor
    # what `clocked` reads: the density curve the profile measured, and which kernels it scales
    from profiling.density import compute_correlations

    graph.graph["density"] = w.density
    graph.graph["compute"] = compute_correlations(w.ops)
    return graph


def enqueue_factor(traced, enqueue_ms: float | None) -> float | None:
    """Host scale that makes the traced host chain take the unprofiled `enqueue_ms`."""
    from profiling.replay import host_chain_us

    if not enqueue_ms:
        return None
    host_us = host_chain_us(traced)
    return min(1.0, enqueue_ms * 1e3 / host_us) if host_us > 0 else None


def graph_gains(w: ProfiledWorkload, rows: list[RankedRow], graph, ceil: Ceilings, static,
                host: RankedRow | None) -> bool:
    """On a launch-bound pass with a graph projection, each family row's `graph_gain`: the
    graphed pass over the graphed pass with that row's kernels at their target, the gain the
    row brings once the graphs stage has removed the host (which it does on such a pass). Eager
    replay gains there are host savings of a few percent, which would rank the kernels of a
    decode step (attention, KV cache, norms) below rows the graph makes irrelevant. True when
    the rows were given one (the ranking then orders by it)."""
    busy = w.gpu_busy_share
    if (host is None or host.graphed_pass_us is None or busy is None
            or busy >= LAUNCH_BOUND_BUSY):
        return False
    plain = host.graphed_pass_us
    for r in rows:
        if r.family:
            with_row = graph_projection(graph, ceil, [r], static=static).pass_us
            r.graph_gain = plain / with_row if with_row else None
    return True

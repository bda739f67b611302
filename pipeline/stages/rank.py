"""The rank stage: profile.json -> ranking.json (patterns, shares, attainable speedups, and the
whole-model projection both ways: the Amdahl formula and a trace replay).

Each row is a pattern aggregated over its occurrences (a kernel family replaces all of them);
unrecognised ops keep rows of their own. A row's attainable speedup comes from the roofline
of a fused kernel (or, once one exists, from its measured time), and its whole-model gain is
what replacing that row alone would do to the pass. Rows are ranked by the replay gain where
a GPU trace exists, else by the Amdahl gain.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from core.artifacts import read_json, write_json
from pipeline.summary import console, module_pattern
from profiling.patterns import BASE_PATTERNS, Occurrence, alternatives, match
from profiling.roofline import op_cost, roofline_us

RANKING = "ranking.json"
LAUNCH_BOUND_BUSY = 0.5  # below this GPU-busy share of the wall time a pass is launch-bound
# A device-bound pass lists the CUDA-graph row only when the replay projects more than this:
# below it the graph's own node and launch costs are within the replay's error of its saving.
GRAPH_MIN_GAIN = 1.02
GRAPH_PATTERN = "host: CUDA graph capture"
NOT_CALIBRATED = ("CUDA graph costs not calibrated on this device (ceilings measured before "
                  "`graph_node_us`/`graph_launch_us` existed): run `pipeline calibrate` again; "
                  "no projection")


def amdahl(parts: list[tuple[float, float]]) -> float:
    """Whole-model speedup when each share p runs s times faster: 1/((1-sum p)+sum p/s)."""
    rest = 1.0 - sum(p for p, _ in parts)
    return 1.0 / (rest + sum(p / max(s, 1e-12) for p, s in parts))


def _patterns():
    from codegen.registry import family_patterns

    return list(BASE_PATTERNS) + family_patterns()


def _occurrence_case(family: str | None):
    from codegen.registry import get_family

    return get_family(family).occurrence_case if family else None


def launch_ceilings(w: dict, ceil: dict) -> dict:
    """The ceilings a fused kernel's floor is priced with: on a launch-bound pass, where the
    graphs stage captures the pass, a launch costs what a tiny kernel takes inside a graph
    (`graph_tiny_kernel_us`, about 1 us on the H200) rather than an eager launch (10.7 us),
    which capped every decode GEMM's floor at its profiled time (gemv's row 1.00x on Llama-3.2-1B
    decode, where the family took the graphed step from 1.62 to 1.37 ms)."""
    busy = w.get("gpu_busy_share")
    tiny = ceil.get("graph_tiny_kernel_us")
    if busy is None or busy >= LAUNCH_BOUND_BUSY or tiny is None:
        return ceil
    return {**ceil, "launch_us": tiny + (ceil.get("graph_node_us") or 0.0)}


def pattern_rows(w: dict, ceil: dict, kernel_times: dict[str, float] | None = None) -> list[dict]:
    """Aggregate one workload's ops into pattern rows with roofline numbers."""
    ceil = launch_ceilings(w, ceil)
    ops = w["ops"]
    pats = _patterns()
    by_name = {p.name: p for p in pats}
    occ, unclaimed = match(ops, pats)
    groups: dict[str, dict] = defaultdict(lambda: {"occ": [], "extends": set()})
    owner = {i: o.pattern for o in occ for i in o.ops}
    for o in occ + alternatives(occ, pats):
        g = groups[o.pattern]
        g["family"], g["occ"] = o.family, g["occ"] + [o]
        if o.extends:
            g["primary"] = o.extends  # the row it is shown beneath, an option of
            # every row whose ops it repeats, the absorbed children's (a gated MLP's gate and
            # up `linear` occurrences) as well as the extended pattern's
            g["extends"].update({o.extends} | {owner[i] for i in o.ops if i in owner}
                                - {o.pattern})
    for i in unclaimed:
        op = ops[i]
        key = f"op:{op['name']} @ {op['module_class'] or '(top)'}"
        g = groups[key]
        g["family"] = None
        g["occ"].append(Occurrence(key, None, op["module"], op["module_class"], [i]))
    gpu = w["time_basis"] == "device"
    wall_us = w["wall"]["median_ms"] * 1e3
    op_sets = {name: {i for o in g["occ"] for i in o.ops} for name, g in groups.items()}
    rows = []
    for name, g in groups.items():
        pat = by_name.get(name)
        time_us = share = host = 0.0
        nbytes = flops = launches = n_ops = 0
        floor_us = 0.0
        corr: list[list[int]] = []
        cases: list[dict | None] = []
        case_of = _occurrence_case(g["family"])
        modules = set()
        for o in g["occ"]:
            o_ops = [ops[i] for i in o.ops]
            n_ops += len(o_ops)
            t = sum(op["time_us"] for op in o_ops)
            time_us += t
            share += sum(op["share"] for op in o_ops)
            host += sum(op["cpu_us"] for op in o_ops)
            n_launch = sum(op.get("launches", 0) for op in o_ops)
            launches += n_launch
            if pat is not None and pat.cost is not None:
                b, f = pat.cost(o_ops)
                fused = roofline_us(b, f, ceil, launches=1 if n_launch else 0)
            else:  # no fused model: each op at its own roofline, launches kept
                b = f = 0
                fused = 0.0
                for op in o_ops:
                    ob, of = op_cost(op)
                    b, f = b + ob, f + of
                    fused += roofline_us(ob, of, ceil, launches=1 if op.get("launches") else 0)
            nbytes, flops = nbytes + b, flops + f
            floor_us += min(fused, t) if t > 0 else 0.0
            corr.append([k["correlation"] for op in o_ops for k in op.get("kernels", [])])
            if case_of is not None:
                cases.append(case_of(o_ops))
            modules.add(module_pattern(o.module))
        measured_kernel = (kernel_times or {}).get(name)
        target = measured_kernel if measured_kernel is not None else floor_us
        if not gpu:  # host time of aten ops has no roofline: rank CPU profiles by share alone
            target = time_us
        rows.append({
            "pattern": name, "family": g["family"], "occurrences": len(g["occ"]),
            "modules": sorted(modules)[:6], "time_us": time_us, "share": share,
            "host_us": host, "launches": launches, "op_calls": n_ops, "min_bytes": nbytes,
            "flops": flops,
            "roofline_us": floor_us, "target_us": target,
            "target_source": "measured kernel" if measured_kernel is not None else "roofline",
            "attainable_speedup": (time_us / target) if target > 0 else 1.0,
            "achieved_GBps": nbytes / time_us / 1e3 if time_us > 0 else None,
            "kernel_correlations": corr if gpu else [],
            # per occurrence, the case keys its ops give (`Family.occurrence_case`)
            "occurrence_cases": cases if gpu and case_of is not None else None,
            "host_share": host / wall_us,
            # the rows this one overlaps (same ops): at most one of them is ever replaced
            "alternative_to": sorted(g["extends"]),
            "extends": g.get("primary"),
            # the rows of the partition whose ops an alternative holds too (gated_mlp_gemm:
            # swiglu_mlp and the gate/up GEMMs of `linear`)
            "overlaps": sorted(n for n, ops_n in op_sets.items() if n != name
                               and not groups[n]["extends"] and ops_n & op_sets[name])
            if g["extends"] else [],
        })
    for r in rows:
        _apply_decline(r)
    return rows


def _apply_decline(row: dict) -> None:
    """A family that declines its row (`Family.declines`: GEMMs already at their roofline,
    a kernel measured slower than the library everywhere) leaves it without a family, so it is
    never chosen or generated; the row says which family and why."""
    from codegen.registry import families

    fam = families().get(row["family"]) if row["family"] else None
    reason = fam.declines(row) if fam is not None and fam.declines is not None else None
    if reason:
        row["declined"] = {"family": row["family"], "reason": reason}
        row["family"] = None


NO_REMEDY_MIN = 1.2  # attainable speedup from which a row nothing acts on is reported


def no_remedy(rows: list[dict]) -> list[dict]:
    """Rows with headroom (attainable >= NO_REMEDY_MIN) that no family acts on: listed so the
    gap is visible rather than silent, with why (a family declined it, or none replaces it)."""
    out = []
    for r in rows:
        # the CUDA-graph row is itself a remedy (for the rest row's host time)
        if r["family"] or r.get("remedy") or (r["attainable_speedup"] or 1.0) < NO_REMEDY_MIN:
            continue
        declined = r.get("declined")
        why = (f"{declined['family']}: {declined['reason']}" if declined
               else "no kernel family replaces it")
        out.append({"pattern": r["pattern"], "share": r["share"],
                    "attainable_speedup": r["attainable_speedup"], "why": why})
    return sorted(out, key=lambda x: -x["share"])


ORDER = ("rank_gain: the whole-model gain of replacing the row with a kernel family ({key}); "
         "1.000x for ops no family replaces; ties by share")
# graph_gain: launch-bound passes, where the graph ships and what a row saves inside it decides


def group_alternatives(rows: list[dict]) -> None:
    """Mark each row that replaces the same ops as another (`alternative_to`) as an option of
    the top-level row it extends (`option_of`), and list the options on that row (`options`).
    The top-level rows partition the pass's ops: their shares and the rest row sum to 1."""
    by_pattern = {r["pattern"]: r for r in rows}
    for r in rows:
        r["options"] = []
        primary = r.get("extends") if r.get("extends") in by_pattern else next(
            (p for p in r.get("alternative_to") or () if p in by_pattern), None)
        seen = {r["pattern"]}
        while primary is not None and by_pattern[primary].get("alternative_to"):
            seen.add(primary)
            primary = next((p for p in by_pattern[primary]["alternative_to"]
                            if p in by_pattern and p not in seen), None)
        r["option_of"] = primary
    for r in rows:
        if r["option_of"]:
            by_pattern[r["option_of"]]["options"].append(r["pattern"])


def top_level(rows: list[dict]) -> list[tuple[dict, list[dict]]]:
    """(row, its options) for each top-level row, ordered by the best rank_gain among the row
    and its options (then share): the order the tables show."""
    if any("option_of" not in r for r in rows):  # a ranking.json from before the grouping
        rows = [dict(r) for r in rows]
        group_alternatives(rows)
    by_pattern = {r["pattern"]: r for r in rows}
    groups = [(r, [by_pattern[o] for o in r["options"] if o in by_pattern])
              for r in rows if not r["option_of"]]

    def key(g):
        members = [g[0], *g[1]]
        return (-max(m.get("rank_gain", 1.0) for m in members), -g[0]["share"])
    return sorted(groups, key=key)


def project(w: dict, rows: list[dict], graph=None) -> None:
    """Fill each row's whole-model gain alone (Amdahl, and replay when a graph is given)."""
    for r in rows:
        r["amdahl_gain"] = amdahl([(r["share"], r["attainable_speedup"])])
        r["replay_gain"] = None
        # a family row is replayed even at its roofline: fusing still removes launches and
        # host dispatch, which is what decides a launch-bound pass
        if graph is not None and r["kernel_correlations"] and r["family"]:
            r["replay_gain"] = _replay_gain(graph, [r])


def _replay_gain(graph, rows: list[dict]) -> float:
    """Whole-model gain from replaying the trace with `rows` replaced.

    Each occurrence's kernels become one kernel of the target time and its launch calls merge
    into one. The Python-side dispatch a fused call saves or adds is only known once a kernel
    exists: a row may carry `host_delta_us` (measured, unprofiled: the baseline call's host
    time minus the candidate's, per occurrence; negative when the kernel costs the host more,
    as Triton's launcher can), else none is assumed. Profiled host times are inflated by the
    profiler, so they never stand in for it.
    """
    from profiling.replay import Replacement, kernel_table, what_if

    dur = {k["correlation"]: k["dur_us"] for k in kernel_table(graph)}
    reps = []
    for r, corrs, scales in _disjoint(rows):
        # a measured kernel may be slower than the code it replaces: project that too (our
        # attention at 0.19x of SDPA replayed as 1.00x, and measured 0.85x)
        kept = [(c, f) for c, f in zip(corrs, scales) if any(x in dur for x in c)]
        occ = [c for c, _ in kept]
        # Each row's saving stays on its own removed launches. Spread over every row's
        # launches, a saving the row's own segments cannot hold (capped at their length)
        # moved onto other patterns' launches and over-projected the set (Qwen2.5-0.5B b1
        # prefill: 1.423x projected for four families, 1.314x measured).
        # The measured delta (per call, one call per occurrence) already pays for the launch
        # calls the fused call removes: their nodes leave the replay with their own traced
        # durations, and only the rest of the occurrence's delta comes off the host segments
        # before them, pooled over those segments. (Subtracting the mean launch of the whole
        # pass from each removed launch, and capping the rest at the one segment before it,
        # lost 7 % of the delta on Llama-3.2-1B b1 prefill: its rows' launches are shorter
        # than the mean, and some of their segments shorter than one launch's share.)
        removed = max(0, r["launches"] - len(occ))
        total = None
        if occ and r.get("host_delta_us") is not None and removed:
            total = r["host_delta_us"]
        for corr, scale in kept:
            present = [c for c in corr if c in dur]
            reps.append(Replacement(frozenset(present), sum(dur[c] for c in present) * scale,
                                    host_saving_total_us=total))
    if not reps:
        return 1.0
    base = _replayed_once(graph)
    return base / what_if(graph, reps)


def _replacements(graph, rows: list[dict]) -> list:
    """Each row's occurrences as replacements at the row's target time, no host saving (the
    graph projections remove the host anyway)."""
    from profiling.replay import Replacement, kernel_table

    dur = {k["correlation"]: k["dur_us"] for k in kernel_table(graph)}
    reps = []
    for _, corrs, scales in _disjoint(rows):
        for corr, scale in zip(corrs, scales):
            present = [c for c in corr if c in dur]
            if present:
                reps.append(Replacement(frozenset(present), sum(dur[c] for c in present) * scale))
    return reps


def _disjoint(rows: list[dict]) -> list[tuple[dict, list[list[int]], list[float]]]:
    """Each row with the occurrences (kernel correlations) it replaces, none twice, and each
    one's time scale (`_scales`; an occurrence without one is not replaced). Where two rows
    replace the same kernels (GPT-2's c_fc GEMM is in `linear`, which the matmul family
    patches, and in mlp_gemm_gelu, which matmul_gelu patches with its activation), the fused
    alternative (`extends`) takes the occurrence, as its patch does in the model, and the
    other row keeps the rest of its occurrences."""
    taken: set[int] = set()
    out = []
    for r in sorted(rows, key=lambda r: r.get("extends") is None):
        keep = [(c, f) for c, f in zip(r["kernel_correlations"], _scales(r))
                if f is not None and not taken.intersection(c)]
        for c, _ in keep:
            taken.update(c)
        out.append((r, [c for c, _ in keep], [f for _, f in keep]))
    return out


def _scales(row: dict) -> list[float | None]:
    """Per occurrence, its target over its time: the row's, or where the row carries measured
    speedups per case (`case_speedups`: [(case, speedup)], with `occurrence_cases`) the
    speedup of the first case whose keys the occurrence's match; None where none does: the
    family's patch leaves that module alone, so it is not replaced (GPT-2 decode's matmul
    patched only the LM head while its 1.27x was applied to every Conv1D, projecting 0.451 ms
    for a measured 0.538)."""
    n = len(row["kernel_correlations"])
    by_case, cases = row.get("case_speedups"), row.get("occurrence_cases")
    if by_case is None or cases is None or len(cases) != n:
        return [_target_ratio(row)] * n

    def scale(keys: dict | None) -> float | None:
        if keys:
            for case, sp in by_case:
                if all(case.get(k) == v for k, v in keys.items()):
                    return 1.0 / sp
        return None

    return [scale(c) for c in cases]


def graph_projection(graph, ceil: dict, rows: list[dict] | None = None,
                     static=None) -> dict:
    """The pass replayed as one CUDA graph (`profiling.replay.graphed`): `pass_us` and the
    gain over the replayed eager pass, for the unpatched model or (`rows`) with those rows'
    kernels at their target times first ("kernels + graph"). None with a note where the
    device's graph costs were never measured.

    `static`: for decode, the replay graph of the step over a static KV cache, which is what
    the graph captures (`profiling.capture.make_static_runner`); the pass is then that step
    graphed. The static cache reads and masks all its slots, so the dynamic step's device work
    undercounts the graph's (Llama-3.2-1B b1 KV 1024 on the H200: projected 2.92 ms from the
    dynamic trace, measured 3.31). A row is replaced where the static step has its pattern
    (`static_graph` attributes that step), at the row's own target over time: there HF's
    attention runs repeat_kv's copies and cuDNN's SDPA over every slot, 274 us of Llama's
    step against 72 us in the dynamic step, and crediting decode_attention with the dynamic
    step's saving projected 1.648 ms for a measured 1.374. A row the static step lacks saves
    what it saves in the dynamic step graphed. The gain stays over the user's eager call, the
    dynamic step."""
    from profiling.replay import graphed_with

    node, launch = ceil.get("graph_node_us"), ceil.get("graph_launch_us")
    if graph is None:
        return {"pass_us": None, "gain": None, "note": "no GPU trace: no replay projection"}
    if node is None or launch is None:
        return {"pass_us": None, "gain": None, "note": NOT_CALIBRATED}
    base = _replayed_once(graph)
    rows = rows or []
    plain = _graphed_once(graph, node, launch)
    if static is None:
        reps = _replacements(graph, rows)
        us = graphed_with(graph, reps, node, launch) if reps else plain
        return {"pass_us": us, "gain": base / us, "base_us": base, "note": None,
                "basis": "the profiled step"}
    there = static.graph.get("pattern_rows") or {}
    moved = [_as_row_of(r, there[r["pattern"]]) for r in rows if r["pattern"] in there]
    rest = [r for r in rows if r["pattern"] not in there]
    reps = _replacements(static, moved)
    us = graphed_with(static, reps, node, launch) if reps else _graphed_once(static, node, launch)
    if rest:
        us -= plain - graphed_with(graph, _replacements(graph, rest), node, launch)
    return {"pass_us": us, "gain": base / us, "base_us": base, "note": None,
            "basis": "the step over a static KV cache",
            "in_static_step": sorted(r["pattern"] for r in moved)}


def _as_row_of(row: dict, there: dict) -> dict:
    """The static step's row of `row`'s pattern, sped up by `row`'s target over its time, or
    by `row`'s speedups per case, matched to the static step's own occurrences."""
    return {**there, "target_us": there["time_us"] * _target_ratio(row),
            "case_speedups": row.get("case_speedups")}


def _target_ratio(row: dict) -> float:
    """A row's target over its profiled time: the time scale of each of its occurrences."""
    return row["target_us"] / row["time_us"] if row["time_us"] else 1.0


def _replayed_once(graph) -> float:
    """The eager replay's length, kept on the graph (a setdefault would replay every time)."""
    from profiling.replay import replay

    if "_base_len" not in graph.graph:
        graph.graph["_base_len"] = replay(graph)
    return graph.graph["_base_len"]


def _graphed_once(graph, node: float, launch: float) -> float:
    """The plain graphed replay, kept on the graph: `graph_gains` asks for it once per row."""
    from profiling.replay import graphed

    key = ("_graphed", node, launch)
    if key not in graph.graph:
        graph.graph[key] = graphed(graph, node, launch)
    return graph.graph[key]


def static_graph(w: dict, run_dir: Path | None, ceil: dict | None = None):
    """The replay graph of a decode workload's static-cache step trace, None without one; with
    `ceil` and a profile that attributed that step (`w["static"]`), its pattern rows by
    pattern, as `graph.graph["pattern_rows"]`."""
    rel = w.get("static_trace")
    if not rel or run_dir is None or w["time_basis"] != "device" or not (run_dir / rel).exists():
        return None
    from profiling.replay import build_graph
    from profiling.trace import load_trace

    step = w.get("static")
    graph = build_graph(load_trace(run_dir / rel), (step or {}).get("step_index", -1))
    if step and ceil is not None:
        graph.graph["pattern_rows"] = {r["pattern"]: r for r in pattern_rows(step, ceil)
                                       if r["family"]}
    return graph


def graph_row(w: dict, graph, ceil: dict, candidates: list[dict], static=None) -> dict | None:
    """The host's remedy row: CUDA graph capture of the whole pass. Its share is the rest
    row's (host, launches, idle over the wall time), its gain the replay with every host edge
    removed. Never a family (the family chooser passes it by): the graphs stage applies it
    after integration. A device-bound pass lists it only when the replay says it helps more
    than GRAPH_MIN_GAIN; a launch-bound or CPU one always does, with its projection or why
    there is none."""
    busy = w.get("gpu_busy_share")
    launch_bound = busy is not None and busy < LAUNCH_BOUND_BUSY
    alone = graph_projection(graph, ceil, static=static)
    with_kernels = (graph_projection(graph, ceil, candidates, static=static) if candidates
                    else alone)
    gain = alone["gain"]
    if w["time_basis"] == "device" and not launch_bound and (gain is None
                                                              or gain <= GRAPH_MIN_GAIN):
        return None
    wall_us = w["wall"]["median_ms"] * 1e3
    share = w["rest_share"]
    rest_us = share * wall_us
    attainable = amdahl_gain = None
    if alone["pass_us"] is not None:
        # what is left of the rest once graphed: the projected pass minus the device work kept
        left = max(alone["pass_us"] - (wall_us - rest_us), 1e-3)
        attainable = rest_us / left if rest_us > 0 else 1.0
        amdahl_gain = amdahl([(share, attainable)])
    if w["time_basis"] != "device":
        why = "CPU profile: no GPU trace to replay; graphs are decided on a GPU run"
    else:
        why = (f"{'launch-bound' if launch_bound else 'device-bound'} pass: GPU busy "
               f"{busy:.0%} of wall; a CUDA graph replays the pass's kernels in their order "
               "without the host's dispatch and launches")
    return {
        "pattern": GRAPH_PATTERN, "family": None, "remedy": "cuda_graph", "occurrences": 1,
        "modules": [], "time_us": rest_us, "share": share, "host_us": 0.0, "launches": 0,
        "op_calls": 0, "min_bytes": 0, "flops": 0, "roofline_us": 0.0,
        "target_us": rest_us / attainable if attainable else None,
        "target_source": "replay, host removed",
        "attainable_speedup": attainable, "achieved_GBps": None, "host_share": share,
        "alternative_to": [], "amdahl_gain": amdahl_gain, "replay_gain": gain,
        "graphed_pass_us": alone["pass_us"], "graph_with_kernels_gain": with_kernels["gain"],
        "graph_with_kernels_pass_us": with_kernels["pass_us"],
        "with_kernels": [r["pattern"] for r in candidates], "why": why,
        "note": alone["note"], "graph_basis": alone.get("basis"),
    }


def workload_graph(w: dict, trace_path: Path | None):
    """The replay graph of the profiled step, host time calibrated to the unprofiled wall."""
    if trace_path is None or w["time_basis"] != "device" or not trace_path.exists():
        return None
    from profiling.replay import build_graph, calibrate_host, scale_host
    from profiling.trace import load_trace

    traced = build_graph(load_trace(trace_path), w.get("step_index", -1))
    graph, factor = calibrate_host(traced, w["wall"]["median_ms"] * 1e3)
    # calibrate_host gives the slowest host consistent with the wall time; a device-bound pass
    # hides how fast its host really is, which the profile's host-bound probe measured. A
    # launch-bound pass hides nothing: its wall is its host chain, and the probe (another,
    # tiny pass, timed minutes before its capture) may only misread it. Qwen2.5-0.5B b1
    # prefill on the H200: the probe's factor 0.275 against the wall's 0.464 replayed
    # the unpatched 16.1 ms pass in 9.6 ms and projected 1.496x for a measured 1.371x; from
    # the wall, 1.375x. Over the 34 committed workloads (benchmarks/probes/probe_rule_ab.py) the
    # mean error is 4.3 % either way; the batch-1 errors, both ways before, then sat about 3 %
    # under the measurement (18 of 20 rows), which the set's host saving now accounts for
    # (host_delta.spread_set_share).
    probe = w.get("host_factor")
    launch_bound = (w.get("gpu_busy_share") or 1.0) < LAUNCH_BOUND_BUSY
    if probe is not None and probe < factor and not launch_bound:
        graph, factor = scale_host(traced, probe), probe
    # the host's own unprofiled time for the pass, when the profile timed it: the call returns
    # after its last launch, so it bounds the host chain directly, where a device-bound wall
    # only bounds it from above (Qwen2.5-0.5B b8 on the H200: 17.8 ms of a 26.6 ms wall)
    enqueue = enqueue_factor(traced, (w.get("wall") or {}).get("enqueue_ms"))
    if enqueue is not None and enqueue < factor:
        graph, factor = scale_host(traced, enqueue), enqueue
    graph.graph["host_scale"] = factor
    return graph


def enqueue_factor(traced, enqueue_ms: float | None) -> float | None:
    """Host scale that makes the traced host chain take the unprofiled `enqueue_ms`."""
    from profiling.replay import HOST_KINDS

    if not enqueue_ms:
        return None
    host_us = sum(a["dur"] for _, a in traced.nodes(data=True) if a["kind"] in HOST_KINDS)
    return min(1.0, enqueue_ms * 1e3 / host_us) if host_us > 0 else None


def project_graphs_with(run_dir: Path, key: str, speedups: dict[str, float],
                        case_speedups: dict[str, list] | None = None) -> dict:
    """The frozen "graphs" projection of one profiled workload: the unpatched model graphed,
    and the patterns in `speedups` sped up (measured kernel speedups) then graphed. Gains over
    the replayed eager pass; None with a note where there is no trace or no calibration.
    `case_speedups`: per pattern, [(case, speedup)] of its accepted cases; a pattern whose
    family matches occurrences to cases (`Family.occurrence_case`) is sped up per case."""
    profile = read_json(run_dir / "profile.json", "profile")
    w = next(x for x in profile["workloads"] if x["key"] == key)
    graph = workload_graph(w, run_dir / w["trace"] if w.get("trace") else None)
    ceil = profile["ceilings"]
    static = static_graph(w, run_dir, ceil)
    rows = [r for r in pattern_rows(w, ceil) if r["pattern"] in speedups]
    for r in rows:
        r["target_us"] = r["time_us"] / speedups[r["pattern"]]
        r["case_speedups"] = (case_speedups or {}).get(r["pattern"])
    alone = graph_projection(graph, ceil, static=static)
    kept = (graph_projection(graph, ceil, rows, static=static) if rows and graph is not None
            else alone)
    return {"unpatched": alone["gain"], "kept": kept["gain"], "patterns": sorted(speedups),
            "note": alone["note"], "basis": alone.get("basis"),
            "unpatched_pass_us": alone["pass_us"], "kept_pass_us": kept["pass_us"]}


def project_with(run_dir: Path, key: str, speedups: dict[str, float],
                 host_delta_us: dict[str, float | None] | None = None) -> float | None:
    """Replay gain of one profiled workload with the given patterns sped up (measured), each
    fused call saving (or adding) its measured host time when given."""
    profile = read_json(run_dir / "profile.json", "profile")
    w = next(x for x in profile["workloads"] if x["key"] == key)
    graph = workload_graph(w, run_dir / w["trace"] if w.get("trace") else None)
    if graph is None:
        return None
    rows = [r for r in pattern_rows(w, profile["ceilings"]) if r["pattern"] in speedups]
    for r in rows:
        r["target_us"] = r["time_us"] / speedups[r["pattern"]]
        r["host_delta_us"] = (host_delta_us or {}).get(r["pattern"])
    return _replay_gain(graph, rows)


def rank_workload(w: dict, ceil: dict, trace_path: Path | None,
                  kernel_times: dict[str, float] | None = None, static=None) -> dict:
    """`static`: the replay graph of a decode step over a static KV cache (`static_graph`),
    which the CUDA-graph row's projection replays."""
    rows = pattern_rows(w, ceil, kernel_times)
    graph = workload_graph(w, trace_path)
    project(w, rows, graph)
    key = "replay_gain" if graph is not None else "amdahl_gain"
    candidates = exclusive(sorted([r for r in rows if r["family"]], key=lambda r: (
        -(r[key] or 1.0), -r["share"])))
    host = graph_row(w, graph, ceil, candidates, static if graph is not None else None)
    if host is not None:
        rows.append(host)
    in_graph = graph_gains(w, rows, graph, ceil, static, host)
    if in_graph:
        key = "graph_gain"
    for r in rows:
        if r.get("remedy"):
            r["rank_gain"] = r["replay_gain"] or 1.0
        else:
            r["rank_gain"] = (r.get(key) or 1.0) if r["family"] else 1.0
    rows.sort(key=lambda r: (-r["rank_gain"], -r["share"]))
    group_alternatives(rows)
    candidates = exclusive([r for r in rows if r["family"]])
    curve = []
    for n in range(1, len(candidates) + 1):
        top = candidates[:n]
        point = {"n": n, "pattern": top[-1]["pattern"], "family": top[-1]["family"],
                 "amdahl": amdahl([(r["share"], r["attainable_speedup"]) for r in top])}
        point["replay"] = _replay_gain(graph, top) if graph is not None else None
        curve.append(point)
    busy = w.get("gpu_busy_share")
    launch_bound = busy is not None and busy < LAUNCH_BOUND_BUSY
    for r in rows:
        r.pop("kernel_correlations", None)
        r.pop("occurrence_cases", None)
    return {
        "key": w["key"], "workload": w["workload"], "wall_ms": w["wall"]["median_ms"],
        "enqueue_ms": w["wall"].get("enqueue_ms"), "time_basis": w["time_basis"],
        "gpu_busy_share": busy, "launch_bound": launch_bound,
        "regime": _regime(w, rows, launch_bound), "ranked_by": key,
        "ordered_by": ORDER.format(key=key), "rest_share": w.get("rest_share"), "rows": rows,
        "no_remedy": no_remedy(rows),
        "cumulative": curve,
        "ceiling_amdahl": curve[-1]["amdahl"] if curve else 1.0,
        "ceiling_replay": curve[-1]["replay"] if curve else None,
    }


def graph_gains(w: dict, rows: list[dict], graph, ceil: dict, static, host: dict | None) -> bool:
    """On a launch-bound pass with a graph projection, each family row's `graph_gain`: the
    graphed pass over the graphed pass with that row's kernels at their target, the gain the
    row brings once the graphs stage has removed the host (which it does on such a pass). Eager
    replay gains there are host savings of a few percent, which ranked Llama-3.2-1B decode's
    decode_attention, kv_cache and add_rmsnorm below the top 5 though they are part of the
    1.37 ms graphed step. True when the rows were given one (the ranking then orders by it)."""
    busy = w.get("gpu_busy_share")
    if (host is None or host.get("graphed_pass_us") is None or busy is None
            or busy >= LAUNCH_BOUND_BUSY):
        return False
    plain = host["graphed_pass_us"]
    for r in rows:
        if r["family"]:
            with_row = graph_projection(graph, ceil, [r], static=static)["pass_us"]
            r["graph_gain"] = plain / with_row if with_row else None
    return True


def exclusive(rows: list[dict]) -> list[dict]:
    """`rows` in their order without any row that overlaps one before it (`alternative_to`):
    replacing both would count the ops they share twice."""
    kept: list[dict] = []
    for r in rows:
        alt = set(r.get("alternative_to") or ())
        if any(k["pattern"] in alt or r["pattern"] in (k.get("alternative_to") or ())
               for k in kept):
            continue
        kept.append(r)
    return kept


def _regime(w: dict, rows: list[dict], launch_bound: bool) -> str:
    if w["time_basis"] != "device":
        return ("CPU profile: shares are host time of aten ops; GPU projections need a GPU "
                "profile")
    if not launch_bound:
        return f"device-bound: the GPU is busy {w['gpu_busy_share']:.0%} of the wall time"
    host_rows = sorted(rows, key=lambda r: -r["host_us"])[:3]
    spread = sum(r["host_us"] for r in host_rows) / max(1e-9, sum(r["host_us"] for r in rows))
    msg = (f"launch-bound: the GPU is busy only {w['gpu_busy_share']:.0%} of the wall time, so "
           f"faster kernels gain little; the critical path is host time")
    if spread < 0.5:
        msg += (" spread thinly over many ops: the remedy is outside kernel work (CUDA graphs, "
                "or torch.compile(mode='reduce-overhead') which uses them)")
    else:
        msg += "; the largest host costs: " + ", ".join(r["pattern"] for r in host_rows)
    return msg


def run_rank(run_dir: Path, kernel_times: dict[str, dict] | None = None) -> dict:
    profile = read_json(run_dir / "profile.json", "profile")
    ceil = profile["ceilings"]
    workloads = []
    for w in profile["workloads"]:
        trace = run_dir / w["trace"] if w.get("trace") else None
        workloads.append(rank_workload(w, ceil, trace, (kernel_times or {}).get(w["key"]),
                                       static_graph(w, run_dir, ceil)))
    ranking = {"stage": "rank", "model": profile["model"]["id"], "ceilings": ceil,
               "workloads": workloads}
    write_json(run_dir / RANKING, ranking)
    return ranking


def print_ranking(ranking: dict, top: int = 8) -> None:
    from rich.table import Table

    for w in ranking["workloads"]:
        console.print(f"[bold]ranking[/bold] {w['key']}: {w['regime']}")
        t = Table(title=f"patterns, ordered by {w.get('ordered_by') or w['ranked_by']}; "
                        f"options (replacing the same ops) indented beneath their row")
        for c in ("pattern", "family", "occ", "share", "attainable", "amdahl", "replay",
                  "rank_gain"):
            t.add_column(c, justify="left" if c in ("pattern", "family") else "right",
                         overflow="fold")

        def cells(r, name):
            return (name, r["family"] or r.get("remedy") or "-", str(r["occurrences"]),
                    f"{r['share']:.1%}", _x(r["attainable_speedup"], 2),
                    _x(r["amdahl_gain"], 3), _x(r["replay_gain"], 3),
                    f"{r.get('rank_gain', 1.0):.3f}x")
        groups = top_level(w["rows"])
        for r, options in groups[:top]:
            t.add_row(*cells(r, r["pattern"]))
            for o in options:
                also = [x for x in o.get("overlaps") or () if x != r["pattern"]]
                t.add_row(*cells(o, "  or " + o["pattern"] + (
                    f" (also holds ops of {', '.join(also)})" if also else "")))
        rest = w.get("rest_share")
        if rest is not None:
            t.add_row("rest: host/launch/idle", "", "", f"{rest:.1%}", "", "", "", "")
        console.print(t)
        for g in w.get("no_remedy") or []:
            console.print(f"  no remedy yet: {g['pattern']} ({g['share']:.1%} of the pass, "
                          f"attainable {g['attainable_speedup']:.2f}x): {g['why']}")
        if w["cumulative"] and w["time_basis"] == "device":
            last = w["cumulative"][-1]
            rp = f", replay {last['replay']:.3f}x" if last["replay"] else ""
            console.print(f"  replacing all {last['n']} candidate families: Amdahl "
                          f"{last['amdahl']:.3f}x{rp} (projected ceiling of kernel work)")


def _x(v: float | None, digits: int) -> str:
    return f"{v:.{digits}f}x" if v else "-"

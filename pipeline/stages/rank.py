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
from pipeline.stages.rank_replay import (
    LAUNCH_BOUND_BUSY,
    graph_gains,
    graph_projection,
    replay_gain,
    workload_graph,
)
from pipeline.summary import console, module_pattern
from profiling.patterns import BASE_PATTERNS, Occurrence, alternatives, match
from profiling.roofline import op_cost, roofline_us

RANKING = "ranking.json"
# A device-bound pass lists the CUDA-graph row only when the replay projects more than this:
# below it the graph's own node and launch costs are within the replay's error of its saving.
GRAPH_MIN_GAIN = 1.02
GRAPH_PATTERN = "host: CUDA graph capture"


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
    for o in occ + alternatives(occ, pats, ops):
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
            r["replay_gain"] = replay_gain(graph, [r])


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
    than GRAPH_MIN_GAIN; a launch-bound one always does, with its projection or why there is
    none. A CPU pass never does: no graph is captured there, and its rest row (host time,
    which on a CPU is all of the time) is not what a graph would remove."""
    if w["time_basis"] != "device":
        return None
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
                 host_delta_us: dict[str, float | None] | None = None,
                 case_speedups: dict[str, list | None] | None = None,
                 host_scale: float = 1.0) -> float | None:
    """Replay gain of one profiled workload with the given patterns sped up (measured), each
    fused call saving (or adding) its measured host time when given; `case_speedups` as in
    `project_graphs_with`. `host_scale`: the host chain, as calibrated to the profile, taken
    that many times as long (a host that ran slower, > 1, at another moment)."""
    out = replay_projection(run_dir, key, speedups, host_delta_us, case_speedups, host_scale)
    return out["gain"] if out else None


def replay_projection(run_dir: Path, key: str, speedups: dict[str, float],
                      host_delta_us: dict[str, float | None] | None = None,
                      case_speedups: dict[str, list | None] | None = None,
                      host_scale: float = 1.0) -> dict | None:
    """`project_with`'s gain, and `row_us`: each pattern's GPU time as the replay gives it
    (`rank_replay.row_times`), for the report's per-family table."""
    from pipeline.stages.rank_replay import row_times

    profile = read_json(run_dir / "profile.json", "profile")
    w = next(x for x in profile["workloads"] if x["key"] == key)
    graph = workload_graph(w, run_dir / w["trace"] if w.get("trace") else None)
    if graph is None:
        return None
    if host_scale != 1.0:
        from profiling.replay import scale_host

        graph = scale_host(graph, host_scale)
        graph.graph["host_scale"] *= host_scale
    rows = [r for r in pattern_rows(w, profile["ceilings"]) if r["pattern"] in speedups]
    for r in rows:
        r["target_us"] = r["time_us"] / speedups[r["pattern"]]
        r["host_delta_us"] = (host_delta_us or {}).get(r["pattern"])
        r["case_speedups"] = (case_speedups or {}).get(r["pattern"])
    return {"gain": replay_gain(graph, rows), "row_us": row_times(graph, rows)}


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
        point["replay"] = replay_gain(graph, top) if graph is not None else None
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
        "floor": _floor(w),
    }


def _floor(w: dict) -> dict | None:
    """The profile's floor pass (`profiling.density.floor`) with what it allows over the wall."""
    f = w.get("floor")
    if not f or not f.get("wall_ms"):
        return None
    return {**f, "over_wall": w["wall"]["median_ms"] / f["wall_ms"]}


def floor_line(w: dict) -> str | None:
    """The floor, said once for the terminal and the report."""
    f = w.get("floor")
    if not f:
        return None
    return (f"floor: the pass's GEMMs and attention alone, back to back in one CUDA graph, take "
            f"{f['wall_ms']:.2f} ms (kernels {f['kernel_ms']:.2f}): at most "
            f"{f['over_wall']:.2f}x over this pass's {w['wall_ms']:.2f} ms while they run at "
            "cuBLAS's and SDPA's rate")


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
        msg = f"device-bound: the GPU is busy {w['gpu_busy_share']:.0%} of the wall time"
        curve = sorted(w.get("density") or [], key=lambda p: p["compute_share"])
        if len(curve) > 1:  # profiling.density: what the projections price compute kernels at
            lo, hi = curve[0], curve[-1]
            ratio = hi["compute_ratio"] / lo["compute_ratio"]
            msg += (f"; its GEMMs and attention run {ratio:.2f}x "
                    f"as long at {hi['compute_share']:.0%} of a pass as at "
                    f"{lo['compute_share']:.0%} (power cap), and the projections say so")
        return msg
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
        if line := floor_line(w):
            console.print(f"  {line}")


def _x(v: float | None, digits: int) -> str:
    return f"{v:.{digits}f}x" if v else "-"

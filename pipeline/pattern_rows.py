"""Pattern rows of one profiled workload: its ops aggregated by pattern (a kernel family
replaces every occurrence of its pattern; unrecognised ops keep rows of their own), each with
its share of the pass and the roofline time of a fused kernel. The rank stage orders them; the
projection replays them with their kernels at measured speedups."""

from __future__ import annotations

from collections import defaultdict

from pipeline.projection.replay import LAUNCH_BOUND_BUSY
from pipeline.summary import module_pattern
from profiling.patterns import BASE_PATTERNS, Occurrence, alternatives, match
from profiling.roofline import op_cost, roofline_us


def _patterns():
    from codegen.registry import family_patterns

    return list(BASE_PATTERNS) + family_patterns()


def _occurrence_case(family: str | None):
    from codegen.registry import get_family

    return get_family(family).rank.occurrence_case if family else None


def launch_ceilings(w: dict, ceil: dict) -> dict:
    """The ceilings a fused kernel's floor is priced with: on a launch-bound pass, where the
    graphs stage captures the pass, a launch costs what a tiny kernel takes inside a graph
    (`graph_tiny_kernel_us`, about a tenth of an eager launch) rather than an eager launch,
    which would cap every decode GEMM's floor at its profiled time and hide what a GEMV
    saves inside the graph."""
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
            # per occurrence, the case keys its ops give (`RankHooks.occurrence_case`)
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
    """A family that declines its row (`RankHooks.declines`: GEMMs already at their roofline,
    a kernel measured slower than the library everywhere) leaves it without a family, so it is
    never chosen or generated; the row says which family and why."""
    from codegen.registry import families

    fam = families().get(row["family"]) if row["family"] else None
    reason = fam.rank.declines(row) if fam is not None and fam.rank.declines is not None else None
    if reason:
        row["declined"] = {"family": row["family"], "reason": reason}
        row["family"] = None

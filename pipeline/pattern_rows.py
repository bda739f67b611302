"""Pattern rows of one profiled workload: its ops aggregated by pattern (a kernel family
replaces every occurrence of its pattern; unrecognised ops keep rows of their own), each with
its share of the pass and the roofline time of a fused kernel. The rank stage orders them; the
projection replays them with their kernels at measured speedups."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from core.records import Ceilings, ProfiledOp, ProfiledStep, RankedRow
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


def launch_ceilings(w: ProfiledStep, ceil: Ceilings) -> Ceilings:
    """The ceilings a fused kernel's floor is priced with: on a launch-bound pass, where the
    graphs stage captures the pass, a launch costs what a tiny kernel takes inside a graph
    (`graph_tiny_kernel_us`, about a tenth of an eager launch) rather than an eager launch,
    which would cap every decode GEMM's floor at its profiled time and hide what a GEMV
    saves inside the graph."""
    busy, tiny = w.gpu_busy_share, ceil.graph_tiny_kernel_us
    if busy is None or busy >= LAUNCH_BOUND_BUSY or tiny is None:
        return ceil
    return ceil.model_copy(update={"launch_us": tiny + (ceil.graph_node_us or 0.0)})


@dataclass
class _Group:
    """The occurrences of one pattern (or of one unclaimed op), which become its row."""

    family: str | None = None
    occ: list[Occurrence] = field(default_factory=list)
    primary: str | None = None  # the row it is shown beneath, an option of
    # every row whose ops it repeats, the absorbed children's (a gated MLP's gate and up
    # `linear` occurrences) as well as the extended pattern's
    extends: set[str] = field(default_factory=set)


def _groups(ops: list[ProfiledOp], pats: list) -> dict[str, _Group]:
    occ, unclaimed = match(ops, pats)
    groups: dict[str, _Group] = defaultdict(_Group)
    owner = {i: o.pattern for o in occ for i in o.ops}
    for o in occ + alternatives(occ, pats, ops):
        g = groups[o.pattern]
        g.family, g.occ = o.family, g.occ + [o]
        if o.extends:
            g.primary = o.extends
            g.extends.update({o.extends} | {owner[i] for i in o.ops if i in owner} - {o.pattern})
    for i in unclaimed:
        op = ops[i]
        key = f"op:{op.name} @ {op.module_class or '(top)'}"
        groups[key].family = None
        groups[key].occ.append(Occurrence(key, None, op.module, op.module_class, [i]))
    return groups


@dataclass
class _Sums:
    """One row's ops summed over its occurrences, each occurrence's fused roofline beside."""

    time_us: float = 0.0
    share: float = 0.0
    host: float = 0.0
    nbytes: int = 0
    flops: int = 0
    launches: int = 0
    n_ops: int = 0
    floor_us: float = 0.0
    corr: list[list[int]] = field(default_factory=list)
    cases: list[dict | None] = field(default_factory=list)
    modules: set[str] = field(default_factory=set)

    def add(self, o: Occurrence, o_ops: list[ProfiledOp], pat, ceil: Ceilings, case_of) -> None:
        self.n_ops += len(o_ops)
        t = sum(op.time_us for op in o_ops)
        self.time_us += t
        self.share += sum(op.share for op in o_ops)
        self.host += sum(op.cpu_us for op in o_ops)
        n_launch = sum(op.launches for op in o_ops)
        self.launches += n_launch
        if pat is not None and pat.cost is not None:
            b, f = pat.cost(o_ops)
            fused = roofline_us(b, f, ceil, launches=1 if n_launch else 0)
        else:  # no fused model: each op at its own roofline, launches kept
            b = f = 0
            fused = 0.0
            for op in o_ops:
                ob, of = op_cost(op)
                b, f = b + ob, f + of
                fused += roofline_us(ob, of, ceil, launches=1 if op.launches else 0)
        self.nbytes, self.flops = self.nbytes + b, self.flops + f
        self.floor_us += min(fused, t) if t > 0 else 0.0
        self.corr.append([k.correlation for op in o_ops for k in op.kernels])
        if case_of is not None:
            self.cases.append(case_of(o_ops))
        self.modules.add(module_pattern(o.module))


def pattern_rows(w: ProfiledStep | dict, ceil: Ceilings | dict,
                 kernel_times: dict[str, float] | None = None) -> list[RankedRow]:
    """Aggregate one workload's ops into pattern rows with roofline numbers."""
    w = ProfiledStep.of(w)
    ceil = launch_ceilings(w, Ceilings.of(ceil))
    ops = w.ops
    pats = _patterns()
    by_name = {p.name: p for p in pats}
    groups = _groups(ops, pats)
    gpu = w.time_basis == "device"
    wall_us = w.wall.median_ms * 1e3
    op_sets = {name: {i for o in g.occ for i in o.ops} for name, g in groups.items()}
    rows = []
    for name, g in groups.items():
        case_of = _occurrence_case(g.family)
        sums = _Sums()
        for o in g.occ:
            sums.add(o, [ops[i] for i in o.ops], by_name.get(name), ceil, case_of)
        measured_kernel = (kernel_times or {}).get(name)
        target = measured_kernel if measured_kernel is not None else sums.floor_us
        if not gpu:  # host time of aten ops has no roofline: rank CPU profiles by share alone
            target = sums.time_us
        time_us = sums.time_us
        rows.append(RankedRow(
            pattern=name, family=g.family, occurrences=len(g.occ),
            modules=sorted(sums.modules)[:6], time_us=time_us, share=sums.share,
            host_us=sums.host, launches=sums.launches, op_calls=sums.n_ops,
            min_bytes=sums.nbytes, flops=sums.flops, roofline_us=sums.floor_us,
            target_us=target,
            target_source="measured kernel" if measured_kernel is not None else "roofline",
            attainable_speedup=(time_us / target) if target > 0 else 1.0,
            achieved_GBps=sums.nbytes / time_us / 1e3 if time_us > 0 else None,
            kernel_correlations=sums.corr if gpu else [],
            # per occurrence, the case keys its ops give (`RankHooks.occurrence_case`)
            occurrence_cases=sums.cases if gpu and case_of is not None else None,
            host_share=sums.host / wall_us,
            # the rows this one overlaps (same ops): at most one of them is ever replaced
            alternative_to=sorted(g.extends),
            extends=g.primary,
            # the rows of the partition whose ops an alternative holds too (gated_mlp_gemm:
            # swiglu_mlp and the gate/up GEMMs of `linear`)
            overlaps=sorted(n for n, ops_n in op_sets.items() if n != name
                            and not groups[n].extends and ops_n & op_sets[name])
            if g.extends else [],
        ))
    for r in rows:
        _apply_decline(r)
    return rows


def _apply_decline(row: RankedRow) -> None:
    """A family that declines its row (`RankHooks.declines`: GEMMs already at their roofline,
    a kernel measured slower than the library everywhere) leaves it without a family, so it is
    never chosen or generated; the row says which family and why."""
    from codegen.registry import families

    fam = families().get(row.family) if row.family else None
    reason = fam.rank.declines(row) if fam is not None and fam.rank.declines is not None else None
    if reason:
        row.declined = {"family": row.family, "reason": reason}
        row.family = None

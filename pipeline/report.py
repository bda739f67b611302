"""The report stage: whatever artifacts a run directory holds -> report.md, report.html,
report.json, plots/*.png and acceptance/<family>.md (one acceptance record per verified family).

Any subset of artifacts renders (after `pipeline profile` only profile.json and ranking.json
exist). Words as DESIGN.md defines them. Measured whole-model speedup = 1 / (paired ratio
time(patched) / time(baseline)), its CI the inverted ratio CI; projection error =
|projected - measured| / measured, for the Amdahl and the replay projection alike. Timings
labelled not meaningful (CPU, Triton interpreter) are shown as such, never as speedups.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

from core.artifacts import read_json, write_json, write_text
from core.errors import UserError
from core.record import Record
from core.records import (
    Bound,
    Check,
    CheckRun,
    Graphs,
    IntegratedWorkload,
    Integration,
    Profile,
    ProfiledWorkload,
    Projection,
    RankedRow,
    RankedWorkload,
    Ranking,
    Ratio,
    SearchLog,
    Timing,
    TimingHost,
    VerificationSummary,
    Wall,
)
from pipeline import e2e_report
from pipeline import report_plots as rp
from pipeline.projection.gap import gap
from pipeline.projection.replay import LAUNCH_BOUND_BUSY
from pipeline.report_acceptance import (  # noqa: F401 - the report's public names
    ROLLBACK_RULE,
    acceptance_fields,
    acceptance_record,
    kernel_path,
)
from pipeline.report_render import NOT_MEANINGFUL, host_drift_told, more_rows
from pipeline.report_search import search_blocks
from pipeline.report_sources import source_tables
from pipeline.report_view import (
    Projected,
    RatioView,
    ReportView,
    Shipped,
    TableRow,
    WorkloadView,
    view,
)
from pipeline.stages.rank import floor_line, top_level

ARTIFACTS = {"profile": "profile.json", "ranking": "ranking.json",
             "search": "candidates/search_log.json", "verification": "verification/summary.json",
             "projection": "projection.json", "integration": "integration.json"}
FLAT = {"search": "search_log.json", "verification": "verification_summary.json"}
TIMING_KEYS = ("median_ms", "p20_ms", "p80_ms", "min_ms", "max_ms", "n", "method", "meaningful",
               "reason", "gbps", "tflops")
TOP = 12
LM_HEAD_SUGGEST = 0.05
# A shipped pass this close to its floor (`profiling.density.floor`) has little left for fusion:
# within 10 % of it, what remains is the GEMMs' and attention's own rate
FLOOR_NEAR = 1.10


def write_report(run_dir: Path) -> dict:
    """Write every report file for `run_dir`; returns their paths and the data behind them."""
    run_dir = Path(run_dir)
    arts = {}
    for k, p in ARTIFACTS.items():
        # a committed results folder keeps the search log and the summary under flat names
        found = next((run_dir / x for x in (p, FLAT.get(k)) if x and (run_dir / x).exists()),
                     None)
        if found is not None:
            arts[k] = read_json(found, k)
    if "profile" not in arts and "ranking" not in arts:
        raise UserError(f"{run_dir} has neither profile.json nor ranking.json: nothing to report")
    read = Artifacts.of(arts)
    data = collect(read)
    v = view(data)
    plots = rp.make_plots(run_dir, v)
    acceptance = {}
    for fam in verified_families(v):
        text = acceptance_record(fam, v, lambda p, f=fam: _record(run_dir, f, p), run_dir)
        acceptance[fam] = write_text(run_dir / "acceptance" / f"{fam}.md", (
            f"# Acceptance record: {fam}\n\n```text\n{text}\n```\n"))
    v.plots = data["plots"] = {k: str(p.relative_to(run_dir)) for k, p in plots.items()}
    v.acceptance = data["acceptance"] = {k: str(p.relative_to(run_dir))
                                         for k, p in acceptance.items()}
    blocks = (rp.document(v) + search_blocks(read.search)
              + source_tables(read.search, read.verification, v))
    generation = e2e_report.read(run_dir)
    if generation is not None:
        data["e2e"] = generation.model_dump()
        blocks = _with_generation(blocks, e2e_report.verdict_lines(generation),
                                  e2e_report.blocks(run_dir, generation))
    md = write_text(run_dir / "report.md", rp.to_markdown(blocks))
    html = write_text(run_dir / "report.html",
                      rp.to_html(blocks, f"Kernel report: {v.model.name or v.model.id}"))
    js = write_json(run_dir / "report.json", data)
    return {"markdown": md, "html": html, "json": js, "plots": list(plots.values()),
            "acceptance": list(acceptance.values())}


def _with_generation(blocks: list[tuple], lines: list[str], section: list[tuple]
                     ) -> list[tuple]:
    """The downstream result first: its lines lead the verdict, its section follows it."""
    out = []
    for b in blocks:
        if b[0] == "ul" and out and out[-1] == ("h", 2, "Verdict"):
            out.append(("ul", lines + list(b[1])))
            out += section
        else:
            out.append(b)
    return out


class Artifacts(NamedTuple):
    """A run directory's artifacts as their records; None where the run has none."""
    profile: Profile | None = None
    ranking: Ranking | None = None
    search: SearchLog | None = None
    verification: VerificationSummary | None = None
    projection: Projection | None = None
    integration: Integration | None = None

    @classmethod
    def of(cls, read: dict[str, dict]) -> Artifacts:
        """`read`: artifact kind (ARTIFACTS) -> its data."""
        return cls(**{k: RECORDS[k].of(d) for k, d in read.items()})

    def names(self) -> list[str]:
        return sorted(k for k, a in self._asdict().items() if a is not None)


RECORDS = dict(zip(Artifacts._fields, (Profile, Ranking, SearchLog, VerificationSummary,
                                       Projection, Integration), strict=True))


def plain(x: Any) -> Any:
    """A part of an artifact as report.json passes it on: as the artifact wrote it (records
    `as_written`, in lists and dicts alike)."""
    if isinstance(x, Record):
        return x.as_written()
    if isinstance(x, list):
        return [plain(v) for v in x]
    if isinstance(x, dict):
        return {k: plain(v) for k, v in x.items()}
    return x


def collect(arts: Artifacts) -> dict:
    """The numbers the report shows (report.json), from whatever artifacts were read."""
    prof, rank, integ, proj = arts.profile, arts.ranking, arts.integration, arts.projection
    pw = {w.key: w for w in (prof.workloads if prof else [])}
    rw = {w.key: w for w in (rank.workloads if rank else [])}
    iw = integ.workloads if integ else {}
    keys = list(dict.fromkeys([*pw, *rw, *iw]))
    fam_of = {r.pattern: r.family for w in (rank.workloads if rank else []) for r in w.rows}
    kernels = _kernels(arts.verification, arts.search)
    model = plain(prof.model) if prof and prof.model else {"id": rank.model if rank else None}
    return {
        "stage": "report", "artifacts": arts.names(),
        "model": {k: model.get(k) for k in ("id", "name", "source", "weights", "model_type",
                                            "revision", "num_layers", "hidden_size", "notes")},
        "environment": plain(prof and prof.environment) or plain(
            integ and integ.environment) or {},
        "ceilings": plain(prof and prof.ceilings) or plain(rank and rank.ceilings) or {},
        "kernel_speedups": proj.kernel_speedups if proj else None,
        "chosen_families": proj.families if proj else None,
        "kernels": kernels,
        "workloads": [_workload(k, pw.get(k), rw.get(k), proj, iw.get(k), fam_of) for k in keys],
    }


def _pass_fields(key: str, p: ProfiledWorkload | None, r: RankedWorkload | None,
                 iw: IntegratedWorkload | None) -> dict:
    """The workload's pass as profiled and ranked: its wall, regime and table rows."""
    base = p or r
    label = (plain(base.workload) if base else plain(iw.workload if iw else None)) or {}
    basis = base.time_basis if base else None
    ranked = bool(r and r.rows)
    rows = _rows(p, r)
    rest = p.rest_share if p else None
    rest = max(0.0, 1 - sum(x.share for x in _own(rows))) if rest is None else rest
    busy = base.gpu_busy_share if base else None
    launch_bound = bool(r and r.launch_bound) or (busy is not None and busy < LAUNCH_BOUND_BUSY)
    wall = p.wall if p and p.wall else Wall.of({"median_ms": r.wall_ms if r else None})
    return {
        "key": key, "workload": label, "time_basis": basis,
        "timing_meaningful": basis == "device", "wall_ms": wall.median_ms,
        "wall_p10_ms": wall.p10_ms, "wall_p90_ms": wall.p90_ms,
        "enqueue_ms": wall.enqueue_ms,
        "profiled_ms_per_step": p.profiled_ms_per_step if p else None,
        "gpu_busy_share": busy, "gpu_idle_share": base.gpu_idle_share if base else None,
        "launch_bound": launch_bound, "regime": (r and r.regime) or _regime(basis, busy),
        "rest_share": rest, "ranked_by": r.ranked_by if r else None,
        "ordered_by": r.ordered_by if r else None,
        **_table_rows(rows, ranked, rest),
        "cumulative": plain(r.cumulative) if r else [],
        "ceiling_amdahl": r.ceiling_amdahl if r else None,
        "ceiling_replay": r.ceiling_replay if r else None,
        "floor": plain(r.floor) if r else None}


def _rows(p: ProfiledWorkload | None, r: RankedWorkload | None) -> list[RankedRow]:
    """The ranking's rows; before a ranking, the profile's ops by name."""
    if r and r.rows:
        return r.rows
    return [RankedRow.of({"pattern": o.op, "family": None, "share": o.share,
                          "time_us": o.time_us, "occurrences": o.calls})
            for o in (p.by_op if p else [])]


def _workload(key, p: ProfiledWorkload | None, r: RankedWorkload | None,
              proj: Projection | None, iw: IntegratedWorkload | None, fam_of) -> dict:
    w = _pass_fields(key, p, r, iw)
    rows = r.rows if r else []
    w["floor_text"] = floor_line(w)
    w["graph_row"] = plain(next((x for x in rows if x.remedy), None))
    w["graphs"] = plain(iw.graphs) if iw else None
    projected = _projected(key, proj, fam_of)
    w["projected"] = projected
    w.update(_integration(iw, projected, proj.kernel_speedups if proj else None))
    seen = WorkloadView.of(w)
    basis = seen.compared_projection or seen.projected or Projected()
    w["gap"] = gap(rows, proj.kernel_speedups if proj else {}, iw.reprofile if iw else None,
                   {"wall_ms": seen.wall_ms, "busy_share": seen.gpu_busy_share},
                   basis.replay, iw.combined if iw else None, basis.row_ms)
    # the CPU projects nothing, so no error of a projection to put down to the machine
    w["conditions"] = _conditions(seen.wall_ms, iw) if seen.time_basis == "device" else None
    w["host_bound_note"] = _host_bound_note(seen.bound)
    w["suggestions"] = _suggestions(seen, p)
    w["experts_note"] = _experts_note(rows, p)
    w.update(headroom(r, iw))
    w["verdict"] = verdict(w)
    return w


def verdict(w: WorkloadView | dict) -> str:
    """One line: what ships, what it measured (95 % CI) against what was projected, the
    regime, and what would help next."""
    w = WorkloadView.of(w)
    speed, ci = rp.speed, rp.ci
    regime = ("CPU (interpreter timings: no speedup measured)" if w.time_basis != "device"
              else "launch-bound" if w.launch_bound else "device-bound")
    shipped = w.shipped
    if shipped is None:
        ceiling = speed(w.ceiling_replay or w.ceiling_amdahl)
        return (f"{w.key}: not optimized yet; {regime}; next: `pipeline optimize` "
                f"(ceiling of kernel work {ceiling})")
    fams = ", ".join(shipped.families) or "nothing"
    if w.time_basis != "device":
        return (f"{w.key}: ships {fams}; a CPU run (Triton interpreter): nothing is measured "
                f"or projected as a speedup; next: profile and optimize on a GPU for timings "
                f"that decide")
    m = w.measured or RatioView()
    if shipped.families and shipped.speedup is not None and shipped.ci:
        meas = f"measured {speed(shipped.speedup)} {ci(shipped.ci)}"
    else:
        meas = "measured: not meaningful here" if shipped.families else "nothing measured"
    proj = _projected_text(w, bool(m.meaningful))
    g = w.graphs or Graphs()
    if g.shipped:
        fams += " + CUDA graph"
        meas += f"; as one CUDA graph {speed(g.measured_speedup)}"
    nxt = _next_step(w, g, shipped)
    return f"{w.key}: ships {fams}; {meas}; {proj}; {regime}; next: {nxt}"


def _projected_text(w: WorkloadView, meaningful: bool) -> str:
    """The verdict's projection: the replay's (or Amdahl's), its error where the timing means
    something, and the replay at the timing's host speed."""
    speed, pct = rp.speed, rp.pct
    p = w.compared_projection or w.projected or Projected()
    if p.note or (p.replay is None and p.amdahl is None):
        return "projected: n/a without GPU kernel times"
    err = w.projection_error.replay if w.projection_error else None
    proj = (f"projected {speed(p.replay or p.amdahl)} "
            f"({'replay' if p.replay else 'Amdahl'}"
            + (f", error {pct(err)}" if err is not None and meaningful else "")
            + ")")
    host = w.at_timing_host
    if host and meaningful:
        proj += (f"; {speed(host.replay)} at the timing's host speed (error "
                 f"{pct(host.error)}; the host took {host.host_drift:.2f}x the "
                 f"profile's time)")
    return proj


def _next_step(w: WorkloadView, g: Graphs, shipped: Shipped) -> str:
    """What would help next: fusion once a graph took the host away, CUDA graphs where the host
    bounds the pass, faster GEMMs and attention near the floor, else more families."""
    speed, pct = rp.speed, rp.pct
    if g.shipped:
        nxt = "fewer kernels per pass (fusion), now that the host is gone"
    elif w.host_bound_note or w.launch_bound:
        nxt = "less host work per pass (CUDA graphs), not faster kernels"
    else:
        nxt = "the next families of the ranking, or faster kernels for the shipped ones"
    floor_x = w.floor.over_wall if w.floor else None
    best = g.measured_speedup if g.shipped else shipped.speedup
    if w.time_basis == "device" and floor_x and best and best * FLOOR_NEAR >= floor_x:
        nxt = (f"faster GEMMs or attention, not more fusion: the pass is within "
               f"{pct(max(0.0, floor_x / best - 1))} of its floor ({speed(floor_x)}: its GEMMs "
               "and attention alone at cuBLAS's and SDPA's rate)")
    return nxt


def headroom(r: RankedWorkload | None, iw: IntegratedWorkload | None) -> dict:
    """What the kernels leave: rows with headroom no family acts on ("no remedy yet", from the
    ranking; rankings written before it existed are filled from their rows), and the memory
    the kept patches hold beyond the model's weights (padded copies), per family."""
    from pipeline.stages.rank import no_remedy

    rows = r.rows if r else []
    listed = plain(r.no_remedy) if r and "no_remedy" in r else no_remedy(
        [x for x in rows if x.attainable_speedup is not None])
    return {"no_remedy": listed, "patch_memory": (iw.patch_memory if iw else None) or {}}


# The unpatched pass measured beside the patched one, against the profile's wall time: beyond
# this the machine ran at another speed, and the report says so next to the error.
DRIFT = 0.10


def _conditions(profile_ms: float | None, iw: IntegratedWorkload | None) -> str | None:
    """A note when the unpatched model ran at another speed during the measurement than when it
    was profiled. The projection assumes the profile's machine, and a lent host's speed moves
    enough between the two to turn a device-bound pass host-bound (benchmarks/results/README.md,
    "Host speed moves")."""
    import statistics

    times = iw.combined.times_a_ms if iw and iw.combined else None
    if not profile_ms or not times:
        return None
    now = statistics.median(times)
    if abs(now / profile_ms - 1) <= DRIFT:
        return None
    return (f"Measurement conditions: the unpatched pass took {now:.1f} ms here (median of "
            f"{len(times)}) against {profile_ms:.1f} ms when profiled ({now / profile_ms - 1:+.0%})"
            f". The projection assumes the profiled machine (host and device speed), so part of "
            f"its error is the machine's, not the model's.")


def _host_bound_note(bound: Bound | None) -> str | None:
    """Said plainly when the measured set leaves the pass waiting on the host."""
    if not bound or not bound.patched.host_bound:
        return None
    p, u = bound.patched, bound.unpatched
    times = (f"the forward returns to Python after {u.host_ms:.1f} of its "
             f"{u.wall_ms:.1f} ms unpatched, {p.host_ms:.1f} of {p.wall_ms:.1f} ms "
             f"with all kept kernels (medians; a forward that synchronises inside would read "
             f"the same)")
    if u.host_bound:
        return (f"Host-bound before and after patching: {times}. The speedup here comes from "
                f"fewer launches and less Python per pass, not from faster kernels; beyond it, "
                f"only less host work per pass helps (CUDA graphs, torch.compile).")
    return (f"Host-bound after patching: {times}. The kernels moved the limit from the GPU to "
            f"the host, so faster kernels cannot shorten this pass further; less Python and "
            f"fewer launches per pass can (torch.compile, CUDA graphs).")


def _regime(basis, busy) -> str:
    if basis != "device":
        return "CPU profile: shares are host time of aten ops"
    bound = "launch" if busy is not None and busy < LAUNCH_BOUND_BUSY else "device"
    return f"{bound}-bound: the GPU is busy {busy or 0:.0%} of the wall time"


def _own(rows: list[RankedRow]) -> list[RankedRow]:
    """The rows whose ops no other row holds: shares of these sum to 1 with the rest row."""
    # the CUDA-graph row's share is the rest row's: a remedy for it, not more time
    return [x for x in rows if not x.alternative_to and not x.option_of and not x.remedy]


# the ranking row's fields the "Top patterns" table shows
TABLE_FIELDS = ("pattern", "family", "remedy", "occurrences", "share", "time_us", "launches",
                "attainable_speedup", "target_source", "achieved_GBps", "amdahl_gain",
                "replay_gain", "rank_gain", "option_of", "overlaps")


def _table_rows(rows: list[RankedRow], ranked: bool, rest: float) -> dict:
    """The rows the "Top patterns" table and the "where the time goes" plot both show, in the
    ranking's order: the first TOP top-level rows, each followed by its options, then one row
    for the top-level rows beyond them and the rest row. The numbered rows, that row and the
    rest row sum to 1; an option (`option_of`) holds ops of the row above it again, and the
    CUDA-graph row's share is the rest row's, so neither adds to the sum (`kind` "option").
    One list for both, so a family that ships as an option (matmul_epilogue) is on the plot,
    and nothing is on the plot that the table leaves out."""
    groups = top_level(rows) if ranked else [(x, []) for x in rows]
    top = [{k: x.as_written().get(k) for k in TABLE_FIELDS}
           for g, opts in groups[:TOP] for x in (g, *opts)]
    beyond = [g for g, _ in groups[TOP:] if not g.remedy]
    shares = [{"label": f"or {x.pattern}" if x.option_of else x.pattern, "share": x.share,
               "kind": "option" if x.option_of or x.remedy else
               "family" if x.family else "other"} for x in TableRow.list_of(top)]
    if beyond:
        shares.append({"label": more_rows(len(beyond)), "share": sum(
            g.share for g in beyond), "kind": "other"})
    shares.append({"label": "rest: host/launch/idle", "share": rest, "kind": "rest"})
    return {"top_patterns": top, "shares": shares, "more_rows": len(beyond)}


def _projected(key: str, proj: Projection | None, fam_of: dict) -> dict | None:
    pw = proj.workloads.get(key) if proj else None
    if pw is None:
        return None
    speed = proj.kernel_speedups or {}
    fams = sorted({fam_of.get(p) or p for p in pw.patterns or []} & set(speed))
    return {"amdahl": None if pw.note else pw.amdahl,
            "replay": None if pw.note else pw.replay, "families": fams,
            "patterns": pw.patterns or [], "note": pw.note,
            "kernel_speedups": {f: speed[f] for f in fams},
            "host_in_model": plain(pw.host_in_model) or {},
            "host_set": plain(pw.host_set),
            "host_used": pw.host_delta_us or {}, "row_ms": pw.row_ms}


def _ratio(d: Ratio, families: list[str], scope: str) -> dict:
    ok = bool(d.meaningful) and bool(d.estimate)
    lo, hi = d.ci_low, d.ci_high
    return {"families": families, "scope": scope, "ratio": d.estimate,
            "ratio_ci": [lo, hi], "meaningful": ok,
            "reason": None if ok else (d.reason or NOT_MEANINGFUL),
            "verdict": d.verdict, "decision": d.decision, "pairs": len(d.ratios or []),
            "speedup": 1 / d.estimate if ok else None,
            "ci": [1 / hi, 1 / lo] if ok and lo and hi else None, "note": None}


def _rolled_back(d: Ratio | None) -> bool:
    return str((d.decision if d else None) or "").startswith("rolled back")


def _integration(iw: IntegratedWorkload | dict | None, projected: dict | None,
                 speeds: dict | None = None) -> dict:
    """`speeds`: every kernel speedup frozen in projection.json, including those of
    families set aside, which a workload may ship in place of another."""
    speeds = speeds or {}
    if iw is None:
        return {"measured": None, "shipped": None, "projection_error": None,
                "compared_projection": None, "per_family": [], "set_aside": {},
                "rollbacks": [], "kept": None, "check": None, "fallback_checks": {},
                "patch_effect": None, "declined": {}}
    iw = IntegratedWorkload.of(iw)
    per, comb, check = iw.per_family or {}, iw.combined, iw.check or Check()
    in_comb = [f for f, d in per.items() if not _rolled_back(d)]
    pv = Projected.of(projected) if projected is not None else None
    measured = _measured(per, comb, in_comb, pv)
    for_kept = _for_kept(iw, measured, pv, speeds)
    basis = Projected.of(for_kept) if for_kept is not None else pv
    error = None
    m = RatioView.of(measured).speedup if measured else None
    if m and pv and not pv.note:
        error = {"amdahl": None if basis.amdahl is None else abs(basis.amdahl - m) / m,
                 "replay": None if basis.replay is None else abs(basis.replay - m) / m}
    kept = list(iw.kept or [])
    return {"measured": measured, "shipped": _shipped(kept, comb), "projection_error": error,
            "at_timing_host": _at_timing_host(iw.projection_at_timing_host, measured),
            "bound": plain(comb.bound) if comb else None,
            "compared_projection": for_kept if for_kept is not None and not (pv and pv.note)
            else None,
            "per_family": [{"family": f, **_ratio(d, [f], "alone"),
                            "in_set": _ratio(d.in_set, [f], "in the set, with / without")
                            if d.in_set else None, "fallback_for": d.fallback_for}
                           for f, d in per.items()],
            "rollbacks": _rollbacks(iw, per, comb, check, in_comb),
            "set_aside": dict(iw.skipped or {}), "kept": kept,
            **_checks_of(iw, check, kept),
            "patch_effect": plain(iw.patch_effect),
            # signatures the pass asked for that no accepted kernel covers (integrate.reach)
            "declined": {f: keys for f, keys in (iw.declined or {}).items() if f in kept}}


def _measured(per: dict[str, Ratio], comb: Ratio | None, in_comb: list[str],
              projected: Projected | None) -> dict | None:
    """The timing to hold the projection against: the combined set's where it is the set
    projected, else the one projected family's alone, else the combined set's, noted."""
    want = projected.families if projected is not None and "families" in projected else None
    measured = None
    if comb and (want is None or set(in_comb) == set(want)):
        measured = _ratio(comb, in_comb, "all kept kernels together")
    elif want and len(want) == 1 and want[0] in per:
        measured = _ratio(per[want[0]], want, f"{want[0]} alone")
    elif comb:
        measured = _ratio(comb, in_comb, "all kept kernels together")
    said = RatioView.of(measured) if measured else None
    if said and want is not None and not projected.note and set(said.families) != set(want):
        measured["note"] = (f"the measured set ({', '.join(said.families) or 'none'}) "
                            f"differs from the projected set ({', '.join(want) or 'none'})")
    return measured


def _for_kept(iw: IntegratedWorkload, measured: dict | None, projected: Projected | None,
              speeds: dict) -> dict | None:
    """The projection frozen for the set that ran, where it was projected again (noted on
    `measured`): the one the measurement is compared with; None: `projected` is."""
    want = projected.families if projected is not None else None
    for_kept = iw.projection_for_kept
    said = RatioView.of(measured) if measured else None
    if not (said and for_kept and set(for_kept.families) == set(said.families)):
        return None
    # projected again for the set that ran, from the kernel numbers frozen beforehand
    extra = [f for f in for_kept.families if f not in (want or []) and f in speeds]
    line = ("projected for that set" + (
        " (" + ", ".join(f"{f} at {rp.speed(speeds[f])}" for f in extra) + ", frozen with "
        "the others)" if extra else "") + f": {rp.speed(for_kept.amdahl)} "
            f"(Amdahl), {rp.speed(for_kept.replay)} (replay)")
    measured["note"] = f"{said.note}; {line}" if said.note else line
    return plain(for_kept)


def _shipped(kept: list[str], comb: Ratio | None) -> dict:
    if kept and comb:
        c = RatioView.of(_ratio(comb, kept, "shipped"))
        return {"families": kept, "speedup": c.speedup, "ci": c.ci,
                "note": None if c.meaningful else c.reason}
    return {"families": [], "speedup": 1.0, "ci": None,
            "note": "nothing kept: the model runs its original code on this workload"}


def _rollbacks(iw: IntegratedWorkload, per: dict[str, Ratio], comb: Ratio | None,
               check: Check, in_comb: list[str]) -> list[dict]:
    """Each family taken out, where and why. `skipped` (set aside before integration:
    superseded by a rival, or slower at kernel level with no host time saved) was never
    patched in, so it is not rolled back."""
    rollbacks = [{"family": f, "stage": "in the model", "reason": why}
                 for f, why in (iw.unreached or {}).items()]
    rollbacks += [{"family": f, "stage": "whole-model check", "reason": _check_reason(res)}
                  for f, res in (check.rejected or {}).items()]
    rollbacks += [_timing_rollback(f, d) for f, d in per.items() if _rolled_back(d)]
    if _rolled_back(comb):
        r = RatioView.of(_ratio(comb, in_comb, "combined"))
        rollbacks.append({"family": ", ".join(in_comb), "stage": "combined", "reason": (
            f"{comb.decision} ({rp.speed(r.speedup)} {rp.ci(r.ci)}); every kernel "
            f"rolled back here")})
    return rollbacks


def _timing_rollback(f: str, d: Ratio) -> dict:
    if d.combined_with_it:  # a fallback (integrate.fall_back)
        r = RatioView.of(_ratio(d.combined_with_it, [f], "the set with it"))
        return {"family": f, "stage": "combined", "reason": (
            f"the set with it against the baseline {rp.speed(r.speedup)} "
            f"{rp.ci(r.ci)}: the 95% CI shows a slowdown; the set without it ships")}
    if d.in_set:  # in_set: timed in the set, kept alone
        r = RatioView.of(_ratio(d.in_set, [f], "in the set"))
        alone = RatioView.of(_ratio(d, [f], "alone"))
        return {"family": f, "stage": "timing in the set", "reason": (
            f"the set with it against the set without it {rp.speed(r.speedup)} "
            f"{rp.ci(r.ci)}: the 95% CI shows a slowdown (alone "
            f"{rp.speed(alone.speedup)})")}
    r = RatioView.of(_ratio(d, [f], "alone"))
    return {"family": f, "stage": "timing", "reason": (
        f"alone {rp.speed(r.speedup)} {rp.ci(r.ci)}: the 95% CI of the paired "
        f"ratio shows a slowdown")}


def _checks_of(iw: IntegratedWorkload, check: Check, kept: list[str]) -> dict:
    return {"check": {**_check_summary(check.set),
                      "rejected": sorted(check.rejected or {})} if check else None,
            # the check of each family tried in place of another, in the set it ships in
            "fallback_checks": {f: _check_summary(c.set)
                                for f, c in (iw.fallback_checks or {}).items()
                                if f in kept}}


def _at_timing_host(reading: TimingHost | None, measured: dict | None) -> dict | None:
    """The replay at the timing's host speed (`projection.timing_host_projection`) with its
    error, where it was read for the set measured and the host drifted enough to tell."""
    said = RatioView.of(measured) if measured else None
    if not said or not said.speedup or not host_drift_told(reading, said.families):
        return None
    m = said.speedup
    return {**plain(reading), "error": abs(reading.replay - m) / m}


def _check_summary(res: CheckRun | None) -> dict:
    written = res.as_written() if res is not None else {}
    return {"families": res.families if res else None, "passed": res.passed if res else None,
            "trials": plain(res.trials) if res else [],
            "reference": written.get("reference", "fp32 copy")}


def _check_reason(res: CheckRun) -> str:
    t = next((t for t in res.trials if not t.passed), None)
    if t is None:
        return "whole-model check failed"
    return (f"whole-model check failed: patched logits error {t.error_patched:.3g} > limit "
            f"{t.limit:.3g} (1.5x the unpatched error {t.error_unpatched:.3g}, "
            f"seed {t.seed})")


def _experts_note(rows: list[RankedRow], p: ProfiledWorkload | None) -> str | None:
    """The experts blocks' share of the pass and the tokens per expert the profile saw."""
    from profiling.expert_load import describe

    load = p.expert_load if p else None
    if not load:
        return None
    share = sum(x.share for x in _own(rows) if x.family == "moe_experts") or None
    return describe(load, share)


def _suggestions(w: WorkloadView, p: ProfiledWorkload | None) -> list[str]:
    out = []
    wl = w.workload
    if p and (wl.mode if "mode" in wl else "prefill") == "prefill":
        lm = sum(o.share for o in p.ops
                 if str(o.module or "").split(".")[-1] == "lm_head")
        seq = max(1, int(wl.seq or 1))
        if lm >= LM_HEAD_SUGGEST:
            gain = 1 / (1 - lm + lm / seq)
            out.append(f"lm_head takes {lm:.1%} of the prefill wall time: when generating, "
                       f"compute logits for the last position only (logits_to_keep=1); up to "
                       f"{gain:.2f}x by Amdahl. This changes what model() returns, so it is a "
                       f"model-level suggestion, not counted as a kernel gain.")
    if w.launch_bound and w.time_basis == "device":
        out.append("The pass is launch-bound: capture the step in a CUDA graph (e.g. "
                   "torch.compile(mode='reduce-overhead')) or batch more tokens per call; host "
                   "dispatch, not kernel time, sets the pace. Not counted as a kernel gain.")
    return out


def _timing(t: Timing | None) -> dict | None:
    written = t.as_written() if t is not None else None
    return {k: written.get(k) for k in TIMING_KEYS} if written else None


def _kernels(summ: VerificationSummary | None, log: SearchLog | None) -> dict:
    searches = {f"{s.family}/{s.case_key}": s for s in (log.searches if log else [])
                if s.case_key}

    def search(key):
        cands = searches[key].candidates if key in searches else None
        return None if cands is None else {
            "configs": len(cands), "passed_screen": sum(c.screen == "pass" for c in cands)}

    accepted = []
    for key, a in (summ.accepted if summ else {}).items():
        k, b = _timing(a.kernel), _timing(a.baseline)
        ok = bool(k and Timing.of(k).meaningful and b and Timing.of(b).meaningful)
        entry = next((c for c in (searches[key].candidates or [] if key in searches else [])
                      if c.path == a.source), None)
        accepted.append({"key": key, "family": a.family, "case_key": key.split("/", 1)[-1],
                         "case": a.case, "config": a.config,
                         "origin": entry.origin if entry else None, "source": a.source,
                         "record": a.record, "kernel": k, "baseline": b,
                         "meaningful": ok, "speedup": a.speedup if ok else None,
                         "search": search(key)})
    rejected = [{"key": r.key, "family": r.family, "reason": r.reason,
                 "case": searches[r.key].case if r.key in searches else None,
                 "tried": [{"candidate": t.candidate, "verdict": t.verdict,
                            "reasons": (t.reasons or [])[:3], "record": t.record}
                           for t in r.tried], "search": search(r.key)}
                for r in (summ.rejected if summ else [])]
    no_call = [f"{s.family}: {s.note}" for s in (log.searches if log else []) if not s.case_key]
    return {"accepted": accepted, "rejected": rejected, "not_applicable": no_call}


def verified_families(data: ReportView) -> list[str]:
    k = data.kernels
    return list(dict.fromkeys(e.family for e in [*k.accepted, *k.rejected]))


def _record(run_dir: Path, family: str, path: str | None) -> dict | None:
    """A verification record, found where it was written or under this run directory."""
    if not path:
        return None
    p = Path(path)
    for c in (p, run_dir / p, run_dir / "verification" / family / p.name):
        if c.is_file():
            try:
                return read_json(c, "verification record")
            except UserError:
                return None
    return None

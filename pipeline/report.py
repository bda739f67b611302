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

from core.artifacts import read_json, write_json, write_text
from core.errors import UserError
from core.records import ProfiledWorkload
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
from pipeline.report_view import ReportView, view
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
    data = collect(arts)
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
    blocks = rp.document(v) + search_blocks(arts.get("search")) + source_tables(arts, v)
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


def collect(arts: dict) -> dict:
    """The numbers the report shows (report.json), from whatever artifacts were read."""
    prof, rank = arts.get("profile") or {}, arts.get("ranking") or {}
    pw = {w["key"]: w for w in prof.get("workloads", [])}
    rw = {w["key"]: w for w in rank.get("workloads", [])}
    iw = (arts.get("integration") or {}).get("workloads", {})
    keys = list(dict.fromkeys([*pw, *rw, *iw]))
    fam_of = {r["pattern"]: r.get("family") for w in rank.get("workloads", []) for r in w["rows"]}
    kernels = _kernels(arts.get("verification"), arts.get("search"))
    proj = arts.get("projection")
    model = prof.get("model") or {"id": rank.get("model")}
    return {
        "stage": "report", "artifacts": sorted(arts),
        "model": {k: model.get(k) for k in ("id", "name", "source", "weights", "model_type",
                                            "revision", "num_layers", "hidden_size", "notes")},
        "environment": prof.get("environment") or (arts.get("integration") or {}).get(
            "environment") or {},
        "ceilings": prof.get("ceilings") or rank.get("ceilings") or {},
        "kernel_speedups": (proj or {}).get("kernel_speedups"),
        "chosen_families": (proj or {}).get("families"),
        "kernels": kernels,
        "workloads": [_workload(k, pw.get(k), rw.get(k), proj, iw.get(k), fam_of) for k in keys],
    }


def _pass_fields(key, p, r: dict, iw) -> dict:
    """The workload's pass as profiled and ranked: its wall, regime and table rows."""
    base = p or r or {"workload": (iw or {}).get("workload", {}), "time_basis": None}
    basis = base.get("time_basis")
    rows = r.get("rows") or [
        {"pattern": o["op"], "family": None, "share": o["share"], "time_us": o["time_us"],
         "occurrences": o["calls"]} for o in (p or {}).get("by_op", [])]
    rest = (p or {}).get("rest_share")
    rest = max(0.0, 1 - sum(x["share"] for x in _own(rows))) if rest is None else rest
    busy = base.get("gpu_busy_share")
    launch_bound = bool(r.get("launch_bound")) or (busy is not None and busy < LAUNCH_BOUND_BUSY)
    wall = (p or {}).get("wall") or {"median_ms": r.get("wall_ms")}
    w = {
        "key": key, "workload": base.get("workload", {}), "time_basis": basis,
        "timing_meaningful": basis == "device", "wall_ms": wall.get("median_ms"),
        "wall_p10_ms": wall.get("p10_ms"), "wall_p90_ms": wall.get("p90_ms"),
        "enqueue_ms": wall.get("enqueue_ms"),
        "profiled_ms_per_step": (p or {}).get("profiled_ms_per_step"),
        "gpu_busy_share": busy, "gpu_idle_share": base.get("gpu_idle_share"),
        "launch_bound": launch_bound, "regime": r.get("regime") or _regime(basis, busy),
        "rest_share": rest, "ranked_by": r.get("ranked_by"), "ordered_by": r.get("ordered_by"),
        **_table_rows(rows, bool(r.get("rows")), rest),
        "cumulative": r.get("cumulative") or [], "ceiling_amdahl": r.get("ceiling_amdahl"),
        "ceiling_replay": r.get("ceiling_replay"), "floor": r.get("floor")}
    return w


def _workload(key, p, r, proj, iw, fam_of) -> dict:
    r = r or {}
    w = _pass_fields(key, p, r, iw)
    busy = w["gpu_busy_share"]
    w["floor_text"] = floor_line(w)
    w["graph_row"] = next((x for x in r.get("rows") or [] if x.get("remedy")), None)
    w["graphs"] = (iw or {}).get("graphs")
    w["projected"] = _projected(key, proj, fam_of)
    w.update(_integration(iw, w["projected"], (proj or {}).get("kernel_speedups")))
    basis = w["compared_projection"] or w["projected"] or {}
    w["gap"] = gap(r.get("rows") or [], (proj or {}).get("kernel_speedups") or {},
                   (iw or {}).get("reprofile"), {"wall_ms": w["wall_ms"], "busy_share": busy},
                   basis.get("replay"), (iw or {}).get("combined"), basis.get("row_ms"))
    # the CPU projects nothing, so no error of a projection to put down to the machine
    w["conditions"] = _conditions(w["wall_ms"], iw) if w["time_basis"] == "device" else None
    w["host_bound_note"] = _host_bound_note(w.get("bound"))
    w["suggestions"] = _suggestions(w, p)
    w["experts_note"] = _experts_note(r.get("rows") or [], p)
    w.update(headroom(r, iw))
    w["verdict"] = verdict(w)
    return w


def verdict(w: dict) -> str:
    """One line: what ships, what it measured (95 % CI) against what was projected, the
    regime, and what would help next."""
    speed, ci = rp.speed, rp.ci
    regime = ("CPU (interpreter timings: no speedup measured)" if w["time_basis"] != "device"
              else "launch-bound" if w["launch_bound"] else "device-bound")
    shipped = w.get("shipped")
    if shipped is None:
        ceiling = speed(w.get("ceiling_replay") or w.get("ceiling_amdahl"))
        return (f"{w['key']}: not optimized yet; {regime}; next: `pipeline optimize` "
                f"(ceiling of kernel work {ceiling})")
    fams = ", ".join(shipped["families"]) or "nothing"
    if w["time_basis"] != "device":
        return (f"{w['key']}: ships {fams}; a CPU run (Triton interpreter): nothing is measured "
                f"or projected as a speedup; next: profile and optimize on a GPU for timings "
                f"that decide")
    m = w.get("measured") or {}
    if shipped["families"] and shipped.get("speedup") is not None and shipped.get("ci"):
        meas = f"measured {speed(shipped['speedup'])} {ci(shipped['ci'])}"
    else:
        meas = "measured: not meaningful here" if shipped["families"] else "nothing measured"
    proj = _projected_text(w, bool(m.get("meaningful")))
    g = w.get("graphs") or {}
    if g.get("shipped"):
        fams += " + CUDA graph"
        meas += f"; as one CUDA graph {speed(g.get('measured_speedup'))}"
    nxt = _next_step(w, g, shipped)
    return f"{w['key']}: ships {fams}; {meas}; {proj}; {regime}; next: {nxt}"


def _projected_text(w: dict, meaningful: bool) -> str:
    """The verdict's projection: the replay's (or Amdahl's), its error where the timing means
    something, and the replay at the timing's host speed."""
    speed, pct = rp.speed, rp.pct
    p = w.get("compared_projection") or w.get("projected") or {}
    if p.get("note") or (p.get("replay") is None and p.get("amdahl") is None):
        return "projected: n/a without GPU kernel times"
    err = (w.get("projection_error") or {}).get("replay")
    proj = (f"projected {speed(p.get('replay') or p.get('amdahl'))} "
            f"({'replay' if p.get('replay') else 'Amdahl'}"
            + (f", error {pct(err)}" if err is not None and meaningful else "")
            + ")")
    host = w.get("at_timing_host")
    if host and meaningful:
        proj += (f"; {speed(host['replay'])} at the timing's host speed (error "
                 f"{pct(host['error'])}; the host took {host['host_drift']:.2f}x the "
                 f"profile's time)")
    return proj


def _next_step(w: dict, g: dict, shipped: dict) -> str:
    """What would help next: fusion once a graph took the host away, CUDA graphs where the host
    bounds the pass, faster GEMMs and attention near the floor, else more families."""
    speed, pct = rp.speed, rp.pct
    if g.get("shipped"):
        nxt = "fewer kernels per pass (fusion), now that the host is gone"
    elif w.get("host_bound_note") or w["launch_bound"]:
        nxt = "less host work per pass (CUDA graphs), not faster kernels"
    else:
        nxt = "the next families of the ranking, or faster kernels for the shipped ones"
    floor_x = (w.get("floor") or {}).get("over_wall")
    best = g.get("measured_speedup") if g.get("shipped") else shipped.get("speedup")
    if w["time_basis"] == "device" and floor_x and best and best * FLOOR_NEAR >= floor_x:
        nxt = (f"faster GEMMs or attention, not more fusion: the pass is within "
               f"{pct(max(0.0, floor_x / best - 1))} of its floor ({speed(floor_x)}: its GEMMs "
               "and attention alone at cuBLAS's and SDPA's rate)")
    return nxt


def headroom(r: dict, iw: dict | None) -> dict:
    """What the kernels leave: rows with headroom no family acts on ("no remedy yet", from the
    ranking; rankings written before it existed are filled from their rows), and the memory
    the kept patches hold beyond the model's weights (padded copies), per family."""
    from pipeline.stages.rank import no_remedy

    rows = r.get("rows") or []
    listed = r["no_remedy"] if "no_remedy" in r else no_remedy(
        [x for x in rows if x.get("attainable_speedup") is not None])
    return {"no_remedy": listed, "patch_memory": (iw or {}).get("patch_memory") or {}}


# The unpatched pass measured beside the patched one, against the profile's wall time: beyond
# this the machine ran at another speed, and the report says so next to the error.
DRIFT = 0.10


def _conditions(profile_ms: float | None, iw: dict | None) -> str | None:
    """A note when the unpatched model ran at another speed during the measurement than when it
    was profiled. The projection assumes the profile's machine, and a lent host's speed moves
    enough between the two to turn a device-bound pass host-bound (benchmarks/results/README.md,
    "Host speed moves")."""
    import statistics

    times = ((iw or {}).get("combined") or {}).get("times_a_ms")
    if not profile_ms or not times:
        return None
    now = statistics.median(times)
    if abs(now / profile_ms - 1) <= DRIFT:
        return None
    return (f"Measurement conditions: the unpatched pass took {now:.1f} ms here (median of "
            f"{len(times)}) against {profile_ms:.1f} ms when profiled ({now / profile_ms - 1:+.0%})"
            f". The projection assumes the profiled machine (host and device speed), so part of "
            f"its error is the machine's, not the model's.")


def _host_bound_note(bound: dict | None) -> str | None:
    """Said plainly when the measured set leaves the pass waiting on the host."""
    if not bound or not bound["patched"]["host_bound"]:
        return None
    p, u = bound["patched"], bound["unpatched"]
    times = (f"the forward returns to Python after {u['host_ms']:.1f} of its "
             f"{u['wall_ms']:.1f} ms unpatched, {p['host_ms']:.1f} of {p['wall_ms']:.1f} ms "
             f"with all kept kernels (medians; a forward that synchronises inside would read "
             f"the same)")
    if u["host_bound"]:
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


def _own(rows: list[dict]) -> list[dict]:
    """The rows whose ops no other row holds: shares of these sum to 1 with the rest row."""
    # the CUDA-graph row's share is the rest row's: a remedy for it, not more time
    return [x for x in rows if not x.get("alternative_to") and not x.get("option_of")
            and not x.get("remedy")]


def _table_rows(rows: list[dict], ranked: bool, rest: float) -> dict:
    """The rows the "Top patterns" table and the "where the time goes" plot both show, in the
    ranking's order: the first TOP top-level rows, each followed by its options, then one row
    for the top-level rows beyond them and the rest row. The numbered rows, that row and the
    rest row sum to 1; an option (`option_of`) holds ops of the row above it again, and the
    CUDA-graph row's share is the rest row's, so neither adds to the sum (`kind` "option").
    One list for both, so a family that ships as an option (matmul_epilogue) is on the plot,
    and nothing is on the plot that the table leaves out."""
    groups = top_level(rows) if ranked else [(x, []) for x in rows]
    top = [{k: x.get(k) for k in (
        "pattern", "family", "remedy", "occurrences", "share", "time_us", "launches",
        "attainable_speedup", "target_source", "achieved_GBps", "amdahl_gain", "replay_gain",
        "rank_gain", "option_of", "overlaps")} for g, opts in groups[:TOP] for x in (g, *opts)]
    beyond = [g for g, _ in groups[TOP:] if not g.get("remedy")]
    shares = [{"label": f"or {x['pattern']}" if x.get("option_of") else x["pattern"],
               "share": x["share"],
               "kind": "option" if x.get("option_of") or x.get("remedy") else
               "family" if x.get("family") else "other"} for x in top]
    if beyond:
        shares.append({"label": more_rows(len(beyond)), "share": sum(
            g["share"] for g in beyond), "kind": "other"})
    shares.append({"label": "rest: host/launch/idle", "share": rest, "kind": "rest"})
    return {"top_patterns": top, "shares": shares, "more_rows": len(beyond)}


def _projected(key, proj, fam_of) -> dict | None:
    pw = (proj or {}).get("workloads", {}).get(key)
    if pw is None:
        return None
    speed = proj.get("kernel_speedups") or {}
    fams = sorted({fam_of.get(p) or p for p in pw.get("patterns", [])} & set(speed))
    return {"amdahl": None if pw.get("note") else pw.get("amdahl"),
            "replay": None if pw.get("note") else pw.get("replay"), "families": fams,
            "patterns": pw.get("patterns", []), "note": pw.get("note"),
            "kernel_speedups": {f: speed[f] for f in fams},
            "host_in_model": pw.get("host_in_model") or {},
            "host_set": pw.get("host_set"),
            "host_used": pw.get("host_delta_us") or {}, "row_ms": pw.get("row_ms")}


def _ratio(d: dict, families: list[str], scope: str) -> dict:
    ok = bool(d.get("meaningful")) and bool(d.get("estimate"))
    lo, hi = d.get("ci_low"), d.get("ci_high")
    return {"families": families, "scope": scope, "ratio": d.get("estimate"),
            "ratio_ci": [lo, hi], "meaningful": ok,
            "reason": None if ok else (d.get("reason") or NOT_MEANINGFUL),
            "verdict": d.get("verdict"), "decision": d.get("decision"), "pairs": len(
                d.get("ratios") or []),
            "speedup": 1 / d["estimate"] if ok else None,
            "ci": [1 / hi, 1 / lo] if ok and lo and hi else None, "note": None}


def _rolled_back(d: dict | None) -> bool:
    return str((d or {}).get("decision", "")).startswith("rolled back")


def _integration(iw: dict | None, projected: dict | None,
                 speeds: dict | None = None) -> dict:
    """`speeds`: every kernel speedup frozen in projection.json, including those of
    families set aside, which a workload may ship in place of another."""
    speeds = speeds or {}
    if iw is None:
        return {"measured": None, "shipped": None, "projection_error": None,
                "compared_projection": None, "per_family": [], "set_aside": {},
                "rollbacks": [], "kept": None, "check": None, "fallback_checks": {},
                "patch_effect": None, "declined": {}}
    per, comb, check = iw.get("per_family") or {}, iw.get("combined"), iw.get("check") or {}
    in_comb = [f for f, d in per.items() if not _rolled_back(d)]
    measured = _measured(per, comb, in_comb, projected)
    basis = _basis_for_measured(iw, measured, projected, speeds)
    error = None
    if measured and measured["speedup"] and projected and not projected["note"]:
        m = measured["speedup"]
        error = {k: abs(basis[k] - m) / m if basis.get(k) is not None else None
                 for k in ("amdahl", "replay")}
    kept = list(iw.get("kept") or [])
    return {"measured": measured, "shipped": _shipped(kept, comb), "projection_error": error,
            "at_timing_host": _at_timing_host(iw.get("projection_at_timing_host"), measured),
            "bound": (comb or {}).get("bound"),
            "compared_projection": basis if basis is not projected and not projected.get("note")
            else None,
            "per_family": [{"family": f, **_ratio(d, [f], "alone"),
                            "in_set": _ratio(d["in_set"], [f], "in the set, with / without")
                            if d.get("in_set") else None, "fallback_for": d.get("fallback_for")}
                           for f, d in per.items()],
            "rollbacks": _rollbacks(iw, per, comb, check, in_comb),
            "set_aside": dict(iw.get("skipped") or {}), "kept": kept,
            **_checks_of(iw, check, kept),
            "patch_effect": iw.get("patch_effect"),
            # signatures the pass asked for that no accepted kernel covers (integrate.reach)
            "declined": {f: keys for f, keys in (iw.get("declined") or {}).items()
                         if f in kept}}


def _measured(per: dict, comb: dict | None, in_comb: list[str],
              projected: dict | None) -> dict | None:
    """The timing to hold the projection against: the combined set's where it is the set
    projected, else the one projected family's alone, else the combined set's, noted."""
    want = (projected or {}).get("families")
    measured = None
    if comb and (want is None or set(in_comb) == set(want)):
        measured = _ratio(comb, in_comb, "all kept kernels together")
    elif want and len(want) == 1 and want[0] in per:
        measured = _ratio(per[want[0]], want, f"{want[0]} alone")
    elif comb:
        measured = _ratio(comb, in_comb, "all kept kernels together")
    if measured and want is not None and not projected["note"] and \
            set(measured["families"]) != set(want):
        measured["note"] = (f"the measured set ({', '.join(measured['families']) or 'none'}) "
                            f"differs from the projected set ({', '.join(want) or 'none'})")
    return measured


def _basis_for_measured(iw: dict, measured: dict | None, projected: dict | None,
                        speeds: dict) -> dict | None:
    """The projection the measurement is compared with: the one frozen for the set that ran,
    where it was projected again (noted on `measured`), else `projected`."""
    want = (projected or {}).get("families")
    for_kept = iw.get("projection_for_kept")
    if not (measured and for_kept and set(for_kept["families"]) == set(measured["families"])):
        return projected
    # projected again for the set that ran, from the kernel numbers frozen beforehand
    extra = [f for f in for_kept["families"] if f not in (want or []) and f in speeds]
    said = ("projected for that set" + (
        " (" + ", ".join(f"{f} at {rp.speed(speeds[f])}" for f in extra) + ", frozen with "
        "the others)" if extra else "") + f": {rp.speed(for_kept['amdahl'])} "
            f"(Amdahl), {rp.speed(for_kept['replay'])} (replay)")
    measured["note"] = f"{measured['note']}; {said}" if measured["note"] else said
    return for_kept


def _shipped(kept: list[str], comb: dict | None) -> dict:
    if kept and comb:
        c = _ratio(comb, kept, "shipped")
        return {"families": kept, "speedup": c["speedup"], "ci": c["ci"],
                "note": None if c["meaningful"] else c["reason"]}
    return {"families": [], "speedup": 1.0, "ci": None,
            "note": "nothing kept: the model runs its original code on this workload"}


def _rollbacks(iw: dict, per: dict, comb: dict | None, check: dict,
               in_comb: list[str]) -> list[dict]:
    """Each family taken out, where and why. `skipped` (set aside before integration:
    superseded by a rival, or slower at kernel level with no host time saved) was never
    patched in, so it is not rolled back."""
    rollbacks = [{"family": f, "stage": "in the model", "reason": why}
                 for f, why in (iw.get("unreached") or {}).items()]
    rollbacks += [{"family": f, "stage": "whole-model check", "reason": _check_reason(res)}
                  for f, res in (check.get("rejected") or {}).items()]
    rollbacks += [_timing_rollback(f, d) for f, d in per.items() if _rolled_back(d)]
    if _rolled_back(comb):
        r = _ratio(comb, in_comb, "combined")
        rollbacks.append({"family": ", ".join(in_comb), "stage": "combined", "reason": (
            f"{comb['decision']} ({rp.speed(r['speedup'])} {rp.ci(r['ci'])}); every kernel "
            f"rolled back here")})
    return rollbacks


def _timing_rollback(f: str, d: dict) -> dict:
    if d.get("combined_with_it"):  # a fallback (integrate.fall_back)
        r = _ratio(d["combined_with_it"], [f], "the set with it")
        return {"family": f, "stage": "combined", "reason": (
            f"the set with it against the baseline {rp.speed(r['speedup'])} "
            f"{rp.ci(r['ci'])}: the 95% CI shows a slowdown; the set without it ships")}
    if d.get("in_set"):  # in_set: timed in the set, kept alone
        r = _ratio(d["in_set"], [f], "in the set")
        return {"family": f, "stage": "timing in the set", "reason": (
            f"the set with it against the set without it {rp.speed(r['speedup'])} "
            f"{rp.ci(r['ci'])}: the 95% CI shows a slowdown (alone "
            f"{rp.speed(_ratio(d, [f], 'alone')['speedup'])})")}
    r = _ratio(d, [f], "alone")
    return {"family": f, "stage": "timing", "reason": (
        f"alone {rp.speed(r['speedup'])} {rp.ci(r['ci'])}: the 95% CI of the paired "
        f"ratio shows a slowdown")}


def _checks_of(iw: dict, check: dict, kept: list[str]) -> dict:
    return {"check": {**_check_summary(check.get("set")),
                      "rejected": sorted(check.get("rejected") or {})} if check else None,
            # the check of each family tried in place of another, in the set it ships in
            "fallback_checks": {f: _check_summary(c.get("set"))
                                for f, c in (iw.get("fallback_checks") or {}).items()
                                if f in kept}}


def _at_timing_host(reading: dict | None, measured: dict | None) -> dict | None:
    """The replay at the timing's host speed (`projection.timing_host_projection`) with its
    error, where it was read for the set measured and the host drifted enough to tell."""
    if not measured or not measured.get("speedup") \
            or not host_drift_told(reading, measured["families"]):
        return None
    m = measured["speedup"]
    return {**reading, "error": abs(reading["replay"] - m) / m}


def _check_summary(res: dict | None) -> dict:
    res = res or {}
    return {"families": res.get("families"), "passed": res.get("passed"),
            "trials": res.get("trials") or [], "reference": res.get("reference", "fp32 copy")}


def _check_reason(res: dict) -> str:
    t = next((t for t in res.get("trials", []) if not t.get("passed")), None)
    if t is None:
        return "whole-model check failed"
    return (f"whole-model check failed: patched logits error {t['error_patched']:.3g} > limit "
            f"{t['limit']:.3g} (1.5x the unpatched error {t['error_unpatched']:.3g}, "
            f"seed {t['seed']})")


def _experts_note(rows: list[dict], p: dict | None) -> str | None:
    """The experts blocks' share of the pass and the tokens per expert the profile saw."""
    from profiling.expert_load import describe

    load = ProfiledWorkload.of(p).expert_load if p else None
    if not load:
        return None
    share = sum(x["share"] for x in _own(rows) if x.get("family") == "moe_experts") or None
    return describe(load, share)


def _suggestions(w: dict, p: dict | None) -> list[str]:
    out = []
    wl = w["workload"]
    if p and wl.get("mode", "prefill") == "prefill":
        lm = sum(o.get("share", 0.0) for o in p.get("ops", [])
                 if str(o.get("module") or "").split(".")[-1] == "lm_head")
        seq = max(1, int(wl.get("seq") or 1))
        if lm >= LM_HEAD_SUGGEST:
            gain = 1 / (1 - lm + lm / seq)
            out.append(f"lm_head takes {lm:.1%} of the prefill wall time: when generating, "
                       f"compute logits for the last position only (logits_to_keep=1); up to "
                       f"{gain:.2f}x by Amdahl. This changes what model() returns, so it is a "
                       f"model-level suggestion, not counted as a kernel gain.")
    if w["launch_bound"] and w["time_basis"] == "device":
        out.append("The pass is launch-bound: capture the step in a CUDA graph (e.g. "
                   "torch.compile(mode='reduce-overhead')) or batch more tokens per call; host "
                   "dispatch, not kernel time, sets the pace. Not counted as a kernel gain.")
    return out


def _timing(t: dict | None) -> dict | None:
    return {k: t.get(k) for k in TIMING_KEYS} if t else None


def _kernels(summ: dict | None, log: dict | None) -> dict:
    searches = {f"{s['family']}/{s['case_key']}": s for s in (log or {}).get("searches", [])
                if s.get("case_key")}

    def search(key):
        cands = searches.get(key, {}).get("candidates")
        return None if cands is None else {
            "configs": len(cands), "passed_screen": sum(c.get("screen") == "pass" for c in cands)}

    accepted = []
    for key, a in (summ or {}).get("accepted", {}).items():
        k, b = _timing(a.get("kernel")), _timing(a.get("baseline"))
        ok = bool(k and k["meaningful"] and b and b["meaningful"])
        entry = next((c for c in searches.get(key, {}).get("candidates", [])
                      if c.get("path") == a.get("source")), {})
        accepted.append({"key": key, "family": a["family"], "case_key": key.split("/", 1)[-1],
                         "case": a.get("case"), "config": a.get("config"),
                         "origin": entry.get("origin"), "source": a.get("source"),
                         "record": a.get("record"), "kernel": k, "baseline": b,
                         "meaningful": ok, "speedup": a.get("speedup") if ok else None,
                         "search": search(key)})
    rejected = [{"key": r["key"], "family": r["family"], "reason": r.get("reason"),
                 "case": searches.get(r["key"], {}).get("case"),
                 "tried": [{"candidate": t.get("candidate"), "verdict": t.get("verdict"),
                            "reasons": (t.get("reasons") or [])[:3], "record": t.get("record")}
                           for t in r.get("tried", [])], "search": search(r["key"])}
                for r in (summ or {}).get("rejected", [])]
    no_call = [f"{s['family']}: {s.get('note')}" for s in (log or {}).get("searches", [])
               if not s.get("case_key")]
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

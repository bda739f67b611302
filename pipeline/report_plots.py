"""The report's document: report.py's numbers as blocks (headings, tables, notes, plots),
rendered by `report_render`; plots in `report_figures`. Nothing here decides what a number
means.
"""

from __future__ import annotations

from pathlib import Path

from core.records import (
    Compiled,
    Graphs,
    GraphsProjection,
    GraphVerification,
    HostDelta,
    HostSet,
    KernelsPerPass,
    Medians,
    PatchEffect,
    Ratio,
)
from pipeline.projection.gap import Gap
from pipeline.report_acceptance import kernel_path
from pipeline.report_figures import (  # noqa: F401 - the report's entry points use them here
    COLORS,
    _short,
    comparison_plot,
    cumulative_plot,
    make_plots,
    share_plot,
)
from pipeline.report_render import (  # noqa: F401
    case_text,
    ci,
    config_text,
    kernel_label,
    more_rows,
    ms,
    pct,
    speed,
    to_html,
    to_markdown,
)
from pipeline.report_view import (
    CheckView,
    FamilyTiming,
    ProjectionError,
    RatioView,
    ReportView,
    Shipped,
    WorkloadView,
)


def _host_cell(family: str, d: HostDelta | dict, used: float | None) -> str:
    d = HostDelta.of(d)
    if "us_per_call" not in d:
        return f"{family} not measured ({d.error})"
    at = (f", {used:+.1f} us at the profile's host speed"
          if used is not None and abs(used - d.us_per_call) > 0.05 else "")
    tries = d.attempts_ms or []
    again = (f"; measured {len(tries)} times, the unpatched pass at "
             f"{', '.join(f'{t:.1f}' for t in tries)} ms, the nearest the profile's kept"
             if len(tries) > 1 else "")
    if d.us_per_call < 0:  # the fused call's host side is slower than the code it replaces
        return (f"{family} costs {-d.us_per_call:.1f} us per call{at} "
                f"({d.calls_per_pass} calls/pass{again})")
    return f"{family} {d.us_per_call:+.1f} us{at} ({d.calls_per_pass} calls/pass{again})"


def _proj_cells(w: WorkloadView | dict) -> tuple[str, str]:
    w = WorkloadView.of(w)
    p = w.projected
    if p is None:
        a, r = w.ceiling_amdahl, w.ceiling_replay
        return ((f"ceiling {speed(a)}" if a else "-"), (f"ceiling {speed(r)}" if r else "-"))
    if p.note:
        return "n/a (CPU: no GPU kernel times)", "n/a (CPU: no GPU kernel times)"
    # the projection the error is taken against: that of the set measured, after rollbacks
    p = w.compared_projection or p
    return speed(p.amdahl), speed(p.replay)


def _measured_cell(m: RatioView | None) -> str:
    if m is None:
        return "not measured"
    return speed(m.speedup) if m.meaningful else "not meaningful (CPU timing)"


def _in_set_cell(m: RatioView | dict | None) -> str:
    """The set with the family against the set without it (integrate.prune_set); "-" where
    it was not timed that way: rolled back alone, the only family or the last one left, a
    combined set that regressed, or a CPU run."""
    m = None if m is None else RatioView.of(m)
    if m is None or not m.meaningful:
        return "-"
    return f"{speed(m.speedup)} {ci(m.ci)}, {m.verdict}"


def _host_set_cell(together: HostSet | dict, alone: dict[str, HostDelta]) -> str:
    from pipeline.projection.host import summed_share

    together = HostSet.of(together)
    fams = together.families or []
    if together.error:
        return f"{', '.join(fams)}: not measured ({together.error})"
    summed = summed_share(alone, fams)
    return (f"{pct(together.share)} of the unpatched pass ({', '.join(fams)}; median of "
            f"{together.pairs} pairs, the unpatched pass at {together.base_enqueue_ms:.1f}"
            f" ms)" + (f"; their own deltas add up to {pct(summed)}" if summed is not None
                       else "") + (f"; {together.extra_us_per_call:+.1f} us per call added"
                                   if together.extra_us_per_call is not None else ""))


def _decision_cell(f: FamilyTiming | dict) -> str:
    f = FamilyTiming.of(f)
    if f.fallback_for and str(f.decision).startswith("kept"):
        return f"{f.decision}, in place of {f.fallback_for}"
    return f.decision


def _check_words(c: CheckView) -> str:
    worst = max((t.error_patched / t.limit for t in c.trials if t.limit),
                default=None)
    return f"{'passed' if c.passed else 'failed'}; worst patched error {pct(worst)} of its limit"


def _shipped_cell(s: Shipped | None) -> str:
    if s is None:
        return "-"
    return speed(s.speedup) if s.speedup is not None else "not meaningful (CPU timing)"


def document(data: ReportView) -> list[tuple]:
    """The report as blocks, rendered by to_markdown and to_html alike. The first screen holds
    the verdict, the whole-model table and the kernels table; how the numbers were made, the
    model, the machine and each workload's detail follow."""
    m, env, c, plots = data.model, data.environment, data.ceilings, data.plots
    title = m.name or m.id  # a local folder's name, not its whole path
    b: list[tuple] = [("h", 1, f"Kernel report: {title}"), ("h", 2, "Verdict"),
                      ("ul", [w.verdict for w in data.workloads])]
    if not {"verification", "projection", "integration"} & set(data.artifacts):
        b.append(("note", ("Only profiling and ranking have run: the projections are roofline "
                          "ceilings from before any kernel exists. Run `pipeline optimize` to "
                          "generate, verify, integrate and measure kernels.")))
    b += [("h", 2, "Whole-model speedup per workload"), ("table", [
        "workload", "regime", "wall", "projected (Amdahl)", "projected (replay)", "measured",
        "95% CI", "error (Amdahl)", "error (replay)", "shipped"], [
        [w.key, "CPU" if w.time_basis != "device" else
         ("launch-bound" if w.launch_bound else "device-bound"), ms(w.wall_ms),
         *_proj_cells(w), _measured_cell(w.measured),
         ci(w.measured.ci if w.measured else None) or "-",
         pct(w.projection_error.amdahl if w.projection_error else None),
         pct(w.projection_error.replay if w.projection_error else None),
         _shipped_cell(w.shipped)]
        for w in data.workloads])]
    b += _kernel_blocks(data)
    b.append(("p", ("Projected: frozen before integration from the profile and the verified "
                   "kernel times (Amdahl over shares, and a replay of the trace's critical "
                   "path). Measured: 1 / the median paired ratio time(patched) / time(baseline) "
                   "of interleaved whole-model runs, with its bootstrap 95% CI. Projection "
                   "error = |projected - measured| / measured. Shipped: what the patched model "
                   "runs after rollbacks.")))
    if "comparison" in plots:
        b.append(("img", plots["comparison"], "projected vs measured speedup per workload"))
    weights = str(m.weights)
    if weights == "random":
        weights += " (timing does not depend on weight values; outputs are not meaningful text)"
    rows = [("model", m.id), ("source", m.source), ("weights", weights),
            ("model type", m.model_type),
            ("layers / hidden size", f"{m.num_layers} / {m.hidden_size}")]
    rows += [(k, env[k]) for k in ("gpu", "driver", "cuda", "torch", "triton", "transformers",
                                   "python", "cpu", "cpu_threads", "device")
             if env.get(k) is not None]
    b += [("h", 2, "Model and environment"), ("table", ["", "value"], rows),
          ("p", "Artifacts read: " + ", ".join(data.artifacts) + ".")]
    if c:
        b += [("h", 2, "Ceilings (measured on this machine)"), ("table", ["ceiling", "value"], [
            ("copy bandwidth", f"{c.bandwidth_GBps or 0:.0f} GB/s"),
            ("matmul peak", f"{c.matmul_TFLOPs or 0:.1f} TFLOP/s ({c.matmul_dtype})"),
            ("launch cost", f"{c.launch_us or 0:.2f} us"), ("device", c.device),
            ("measured at", c.measured_at)]),
            ("p", (f"How: {c.method}. Measured by `pipeline calibrate` on the device in "
                  "use (cached per device name), never taken from a datasheet."))]
    for w in data.workloads:
        b += _workload_blocks(w, plots)
    if data.acceptance:
        b += [("h", 2, "Acceptance records"), ("p", (
            "One per verified kernel family: the workload and environment it was judged in, "
            "the comparison, correctness, measurements and the decision.")),
            ("links", [(f"{f}: {path}", path) for f, path in data.acceptance.items()])]
    return b


def _workload_blocks(w: WorkloadView, plots: dict[str, str]) -> list[tuple]:
    k = w.key
    b = _pass_blocks(w, plots)
    b += _pattern_blocks(w)
    if w.experts_note:
        b.append(("note", w.experts_note))
    b += _headroom_blocks(w)
    b += _cumulative_blocks(w, plots, k)
    b += _projection_blocks(w)
    if w.per_family or w.check:
        b += _kernel_workload_blocks(w)
    b += graphs_blocks(w)
    if w.suggestions:
        b += [("h", 3, "Model-level suggestions (not counted as kernel gains)"),
              ("ul", w.suggestions)]
    return b


def _pass_blocks(w: WorkloadView, plots: dict[str, str]) -> list[tuple]:
    """The workload's pass: shape, wall, GPU busy, regime, the share plot."""
    wl, k = w.workload, w.key
    b = [("h", 2, f"Workload {k}"), ("p", (
        f"batch {wl.batch}, seq {wl.seq}, {wl.dtype}, {wl.mode} on "
        f"{wl.device}. Wall time {ms(w.wall_ms)} median (p10 {ms(w.wall_p10_ms)}, "
        f"p90 {ms(w.wall_p90_ms)}), timed without the profiler; profiled step "
        f"{ms(w.profiled_ms_per_step)}."))]
    if w.time_basis == "device":
        enqueue = (f" The call returns to the host after {ms(w.enqueue_ms)}, before the "
                   "synchronise: the host's time for the pass, unless the forward synchronises "
                   "inside." if w.enqueue_ms else "")
        b.append(("p", (f"GPU busy {pct(w.gpu_busy_share)}, idle {pct(w.gpu_idle_share)} "
                       f"of the wall time.{enqueue}")))
    else:
        b.append(("note", ("CPU run: shares are host time of top-level aten ops, and every "
                          "timing here is a CPU / Triton-interpreter timing: not meaningful, "
                          "never shown as a speedup.")))
    if w.launch_bound:
        b.append(("note", (f"Launch-bound: the GPU is busy only {pct(w.gpu_busy_share)} of "
                          "the wall time, so faster kernels cannot help much here; the host "
                          "(dispatch and launches) sets the pace. Fusion helps only by removing "
                          f"launches (see the replay projection). Ranking: {w.regime}")))
    elif w.time_basis == "device":  # the CPU's regime is the note above
        b.append(("p", f"Regime: {w.regime}."))
    if f"share/{k}" in plots:
        b.append(("img", plots[f"share/{k}"], f"time share by pattern, {k}"))
    return b


def _pattern_blocks(w: WorkloadView) -> list[tuple]:
    """The top patterns table, options beneath their row, the rest row last."""
    rows, n = [], 0
    for r in w.top_patterns:
        option = bool(r.option_of)
        remedy = bool(r.remedy)  # the host's remedy: its share is the rest row's
        n += 0 if option or remedy else 1
        also = [x for x in r.overlaps or () if x != r.option_of]
        name = (f"or {r.pattern}" + (f" (also holds ops of {', '.join(also)})" if also
                                         else "")) if option else r.pattern
        if remedy:
            name = f"{r.pattern} (remedy for the rest row)"
        rows.append(["" if option or remedy else n, name, r.family or r.remedy
                     or "-", r.occurrences,
                     f"({pct(r.share)})" if option or remedy else pct(r.share),
                     ms((r.time_us or 0) / 1e3), speed(r.attainable_speedup),
                     speed(r.amdahl_gain), speed(r.replay_gain),
                     speed(r.rank_gain), r.target_source or "-"])
    if w.more_rows:
        more = next(x for x in w.shares if x.label == more_rows(w.more_rows))
        rows.append(["", more.label, "", "", pct(more.share), "", "", "", "", "", ""])
    rows.append(["", "rest: host/launch/idle", "", "", pct(w.rest_share), "", "", "", "", "",
                 ""])
    order = w.ordered_by or w.ranked_by or "share"
    return [("h", 3, "Top patterns"), ("p", (
        f"Ordered by {order}. A row starting with \"or\" is an option for the row above it: "
        "it replaces the same ops (and more), so at most one of them is ever used; its share "
        "(in parentheses) is not added again, nor is the CUDA-graph row's, which removes the rest "
        "row's host time. The numbered rows, the row for those past the table's end and the rest "
        "row sum to 1; the plot above shows the same rows.")),
        ("table", ["#", "pattern", "family", "occ", "share", "time", "attainable",
                   "gain (Amdahl)", "gain (replay)", "rank_gain", "target"], rows)]


def _cumulative_blocks(w: WorkloadView, plots: dict[str, str], k: str) -> list[tuple]:
    b = []
    if f"cumulative/{k}" in plots:
        last = w.cumulative[-1]
        b += [("img", plots[f"cumulative/{k}"], f"cumulative projection, {k}"),
              ("p", (f"Replacing all {last.n} candidate families: Amdahl "
                    f"{speed(last.amdahl)}, replay {speed(last.replay)}."))]
    elif w.cumulative and w.time_basis != "device":
        b.append(("p", "No cumulative projection on the CPU: without GPU kernel times every "
                       "family projects 1.000x, so its curve would be a flat line."))
    if w.floor_text:
        b.append(("p", w.floor_text[0].upper() + w.floor_text[1:] + "."))
    return b


def _projection_blocks(w: WorkloadView) -> list[tuple]:
    """Projected against measured: the frozen projection, the timing, the error."""
    p, m, err = w.projected, w.measured, w.projection_error or ProjectionError()
    b = [("h", 3, "Projected vs measured")]
    if p is None and m is None:
        b.append(("p", "Not optimized yet: no projection frozen, nothing measured."))
    else:
        a_cell, r_cell = _proj_cells(w)
        rows = [("kernel speedups projected", ", ".join(
                    f"{f} {speed(s)}" for f, s in (p.kernel_speedups if p else {}).items())
                 or "none"), ("projected (Amdahl)", a_cell), ("projected (replay)", r_cell)]
        host = p.host_in_model if p else {}
        if host:
            rows.insert(1, ("host time saved per kernel call, measured in the model", ", ".join(
                _host_cell(f, d, (p.host_used if p else {}).get(f)) for f, d in host.items())))
        together = p.host_set if p else None
        if together:
            rows.insert(2, ("host time the families save together, measured in the model "
                            "(what it saves beyond their own deltas is spread over their calls)",
                            _host_set_cell(together, host)))
        if m:
            rows += [(f"measured ({m.scope})", _measured_cell(m) + (
                f" {ci(m.ci)}, {m.pairs} pairs, {m.verdict}" if m.meaningful else
                ""))]
        bound = w.bound
        if bound:
            rows.append(("host time of the pass (until the forward returns) / wall time, "
                         "all kept kernels together", (
                "unpatched {:.1f} / {:.1f} ms, patched {:.1f} / {:.1f} ms".format(
                    *(bound[k][x] for k in ("unpatched", "patched")
                      for x in ("host_ms", "wall_ms"))))))
        rows += [("projection error (Amdahl)", pct(err.amdahl)),
                 ("projection error (replay)", pct(err.replay))]
        host = w.at_timing_host
        if host:
            rows.append(("projected (replay) at the host speed of the timing: the frozen "
                         "replay with its host chain scaled to what the timing's unpatched pass "
                         "took, a reading of the error, not the projection", (
                             f"{speed(host.replay)} (error {pct(host.error)}): host "
                             f"{host.timing_host_ms:.2f} ms per unpatched pass at the timing "
                             f"against {host.profile_host_ms:.2f} at the profile "
                             f"({host.host_drift:.2f}x)")))
        shipped = w.shipped or Shipped()
        rows.append(("shipped", _shipped_cell(w.shipped) + (
            f" ({shipped.note})" if shipped.note and shipped.speedup is not None
            else "")))
        b.append(("table", ["", "value"], rows))
        for note in (p.note if p else None, m.note if m else None, w.conditions,
                     w.host_bound_note):
            if note:
                b.append(("note", note))
    return b


def _kernel_workload_blocks(w: WorkloadView) -> list[tuple]:
    """Each family's whole-model timing and decision, the checks, the re-profile's parts,
    the rollbacks."""
    b = [("h", 3, "Kernels on this workload"), ("table", [
        "family", "whole-model speedup alone", "95% CI", "verdict",
        "in the set, with / without it", "decision"], [
        [f.family, _measured_cell(f), ci(f.ci) or "-",
         f.verdict if f.meaningful else "-", _in_set_cell(f.in_set),
         _decision_cell(f)]
        for f in w.per_family])]
    chk, eff = w.check, w.patch_effect
    if chk:
        b.append(("p", (f"Whole-model check ({chk.reference} "
                       f"reference, {len(chk.trials)} trials): "
                       f"{_check_words(chk)}. Kept: {', '.join(w.kept) or 'none'}.")))
    if w.kept:
        b.append(("p", _compiled_words(w.kept)))
    for fam, c in (w.fallback_checks or {}).items():
        b.append(("p", (f"Whole-model check of {fam} in the set it ships in "
                       f"({', '.join(c.families or [])}): {_check_words(c)}.")))
    if eff:
        b.append(("p", patch_effect_text(eff)))
    for fam, keys in (w.declined or {}).items():
        b.append(("note", f"{fam} did not reach every call: the pass asked for "
                          f"{len(keys)} case(s) no accepted kernel covers, and the original "
                          f"code ran there ({', '.join(keys)}); its measured gain is "
                          f"smaller than its ranking row's."))
    b += _gap_blocks(w.gap)
    b.append(("p", "Rollbacks: none." if not w.rollbacks else "Rollbacks:"))
    if w.rollbacks:
        b.append(("ul", [f"{r.family} ({r.stage}): {r.reason}"
                         for r in w.rollbacks]))
    if w.set_aside:
        b += [("p", "Set aside before integration (never patched in, so not a rollback):"),
              ("ul", [f"{f}: {why}" for f, why in w.set_aside.items()])]
    return b


def patch_effect_text(eff: PatchEffect) -> str:
    """The patch-took-effect check in one paragraph: the kernel calls per pass of each family,
    then the aten ops whose count the set changed, each once (the counts are of the whole
    pass, the same under every family that replaces the op), and the GPU kernels seen, by
    their short names."""
    counts: dict[str, tuple[int, int]] = {}
    bare = []
    for fam, ops in (eff.aten_ops_before_after or {}).items():
        changed = {op: tuple(n) for op, n in ops.items() if n[0] != n[1]}
        counts.update(changed)
        if not changed:
            bare.append(fam)
    calls = eff.kernel_calls or {}
    text = ("Patch took effect: " + ("yes" if eff.passed else "NO") + ". Kernel calls "
            "per pass: " + (", ".join(f"{f} {n}" for f, n in calls.items()) or "none") + ". ")
    if counts:
        text += ("Aten ops per pass, unpatched -> patched: " + ", ".join(
            f"{op.removeprefix('aten::')} {a}->{b}" for op, (a, b) in counts.items()) + ". ")
    if bare:
        text += (f"{', '.join(bare)}: no aten op to count (its kernel runs library ops), "
                 "proven by its kernel calls. ")
    kernels = sorted({kernel_label(k) for k in eff.new_kernels or []})
    return text + f"GPU kernels seen: {', '.join(kernels) or 'none (CPU)'}."


def _headroom_blocks(w: WorkloadView) -> list[tuple]:
    """No silent headroom: every ranked row with attainable >= 1.2x that no family acts on,
    and the memory the kept patches hold (padded weights)."""
    b: list[tuple] = []
    if w.no_remedy:
        b += [("h", 3, "No remedy yet (headroom no kernel family acts on)"), ("table", [
            "pattern", "share", "attainable", "why"], [
            [g.pattern, pct(g.share), speed(g.attainable_speedup), g.why]
            for g in w.no_remedy])]
    held = w.patch_memory or {}
    if held:
        b.append(("p", "Memory the patches hold beyond the model's weights: " + ", ".join(
            f"{f} {n / 2**20:.1f} MiB" for f, n in held.items()) + "."))
    return b


def graphs_blocks(w: WorkloadView | dict) -> list[tuple]:
    """The host's remedy on this workload: its ranking row, then what the graphs stage did
    (captured or why not, the four timings, decision, projected vs measured, pool memory,
    kernels per pass)."""
    w = WorkloadView.of(w)
    row, g = w.graph_row, w.graphs
    if row is None and g is None:
        return []
    b: list[tuple] = [("h", 3, "CUDA graphs (the host's remedy)")]
    if row is not None:
        b.append(("p", (f"Ranked as '{row.pattern}': share {pct(row.share)} (the rest "
                        f"row: host, launches, idle), projected {speed(row.replay_gain)} "
                        "by the replay with every host edge removed, "
                        f"{speed(row.graph_with_kernels_gain)} with the candidate "
                        f"kernels first. {row.why or ''}."
                        + (f" {row.note}." if row.note else ""))))
    if g is None:
        return b + [("p", "Not run here: optimized before the graphs stage existed, or not "
                          "optimized yet.")]
    if g.skipped:
        return b + [("note", f"Skipped: {g.skipped}.")]
    if not g.captured:
        return b + [("note", f"Not captured ({g.reason or g.error}): this "
                             f"workload stays eager. {g.decision or ''}")]
    med = g.medians or Medians()

    def vs(key):
        r = g.get(key) or Ratio()
        if not r.estimate:
            return "-"
        band = ci((1 / r.ci_high, 1 / r.ci_low)) if r.ci_low else ""
        return f"{speed(1 / r.estimate)} {band}".strip()
    rows = [("eager (the user's call)", ms(med.eager_ms), "1.000x"),
            ("graphed, unpatched", ms(med.graphed_ms), vs("graphed_unpatched_vs_eager")),
            ("eager, kept kernels", ms(med.eager_kept_ms), "-"),
            ("graphed, kept kernels", ms(med.graphed_kept_ms), vs("graphed_vs_eager"))]
    if "eager_static_ms" in med:
        rows.insert(1, ("eager over the static cache", ms(med.eager_static_ms),
                        vs("eager_static_vs_eager")))
    b.append(("table", ["variant", "median", "speedup vs eager [95% CI]"], rows))
    proj, ver = g.projected or GraphsProjection(), g.verification or GraphVerification()
    pool = g.pool_bytes or {}
    kpp = g.kernels_per_pass
    trials = ver.trials or []
    b.append(("table", ["", "value"], [
        ("decision", g.decision),
        ("graphed kept kernels vs eager kept kernels", vs("graphed_vs_eager_kept")),
        ("projected (frozen): unpatched graphed / kernels + graph",
         f"{speed(proj.unpatched)} / {speed(proj.kept)}"),
        *([("projected for the set that shipped: kernels + graph",
            speed(g.projected_for_kept.kept))] if g.projected_for_kept else []),
        ("measured: graphed kept kernels vs eager", speed(g.measured_speedup)),
        *pass_time_rows(g),
        ("verification (graph vs eager, fp32 rule)",
         f"{sum(t.passed for t in trials)}/{len(trials)} trials passed"),
        ("graph pool memory", " / ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in pool.items()
                                         if v is not None) or "-"),
        *_kernels_per_pass_rows(kpp)]))
    return b + _sets_blocks(g) + _decode_step_blocks(g)


def _kernels_per_pass_rows(kpp: KernelsPerPass | None) -> list[tuple]:
    rows = [("kernels per pass (eager, unpatched -> kept)",
             f"{kpp.unpatched} -> {kpp.kept}" if kpp else "-")]
    if kpp and "graphed" in kpp:
        before = "-" if kpp.graphed_unpatched is None else kpp.graphed_unpatched
        rows.append(("kernels per pass (graphed, unpatched -> in the graph)",
                     f"{before} -> {kpp.graphed}"))
    return rows


def _sets_blocks(g: Graphs) -> list[tuple]:
    """The two sets the graph was chosen between, where the stage tried both."""
    sets = g.sets
    if not sets:
        return []
    return [("p", f"Kernels in the graph: {', '.join(g.families or []) or 'none'}; "
                  f"chosen between the eager shipped set and the integrable set: "
                  f"{sets.why}."),
            ("table", ["set", "families", "graphed median", "kernels per pass"], [
                (name, ", ".join(s.families) or "none", ms(s.graphed_ms),
                 "-" if s.kernels_per_pass is None else s.kernels_per_pass) for name, s in
                (("eager shipped", sets.kept), ("integrable", sets.integrable))])]


def _decode_step_blocks(g) -> list[tuple]:
    """The graphed decode step's anatomy (`pipeline.decode_step`), or why it failed."""
    rec = Graphs.of(g)
    if rec.decode_step is not None:
        from pipeline.decode_step import blocks

        return blocks(rec.decode_step)
    if rec.decode_step_error:
        return [("note", f"Decode step anatomy failed: {rec.decode_step_error}")]
    return []


def pass_time_rows(g: Graphs | dict) -> list[tuple]:
    """The graph projection read as pass times beside the measured medians: once the host is
    gone a graphed pass does not move with the host's speed, while a speedup over eager does
    (the eager pass it divides moved 20-30 % between the profile and the timing on the H200)."""
    g = Graphs.of(g)
    proj = g.projected_for_kept or g.projected or GraphsProjection()
    med = g.medians or Medians()
    rows = []
    for what, key, measured in (("unpatched", "unpatched_pass_us", med.graphed_ms),
                                ("kernels + graph", "kept_pass_us", med.graphed_kept_ms)):
        us = proj.get(key)
        if us is None or measured is None:
            continue
        err = abs(us / 1e3 - measured) / measured
        rows.append((f"graphed pass, {what}: projected (frozen) / measured",
                     f"{ms(us / 1e3)} / {ms(measured)} ({err:.1%} apart; projected from "
                     f"{proj.basis or 'the profiled step'})"))
        if what == "kernels + graph" and med.eager_ms:
            rows.append(("kernels + graph over the eager timed here: projected / measured",
                         f"{speed(med.eager_ms / (us / 1e3))} / "
                         f"{speed(med.eager_ms / measured)} (the frozen pass time over "
                         "this eager median)"))
    return rows


def _gap_blocks(g: Gap | None) -> list[tuple]:
    if not g:
        return []
    if g.error:
        return [("p", f"The re-profile after the timing failed ({g.error}); the decisions "
                      "above do not depend on it.")]

    def over(p):
        a, b = p.patched_ms, p.projected_ms
        return "-" if a is None or b is None else f"{a - b:+.3f} ms"
    rows = [[p.part + (f" ({', '.join(map(kernel_label, p.kernels))})"
                          if p.kernels else ""),
             ms(p.profiled_ms), ms(p.projected_ms), ms(p.patched_ms), over(p)]
            for p in g.parts]
    now = ms(g.unpatched_busy_now_ms)
    return [("p", "Where the shipped set's time goes: GPU time per part of one profiled pass "
                  "after integration, against the profile and the projection. The unpatched "
                  f"pass, profiled again beside it, kept the GPU busy {now}. The projected "
                  "wall is the unpatched pass timed beside the patched one, over the "
                  "projected speedup."),
            ("table", ["part", "profiled (unpatched)", "projected", "patched, re-profiled",
                       "patched - projected"], rows)] + ([("p", (
                "Kernels both passes ran that took longer patched: " + "; ".join(
                    f"{kernel_label(k.kernel)} {ms(k.unpatched_ms)} -> "
                    f"{ms(k.patched_ms)}" for k in g.slower_in_both) + "."))]
        if g.slower_in_both else [])


def _kernel_blocks(data: ReportView) -> list[tuple]:
    k = data.kernels
    if not (k.accepted or k.rejected or k.not_applicable):
        return []
    b = [("h", 2, "Kernels")]

    # a run whose timings all mean nothing (the CPU interpreter's) says so once, in the
    # header, instead of in three cells of every row
    gpu = any(a.meaningful for a in k.accepted)

    def t(x):
        return "-" if not x else (f"{x.median_ms:.4f} ms [{x.p20_ms:.4f}-{x.p80_ms:.4f}]"
                                  + ("" if x.meaningful or not gpu else " (CPU timing)"))
    if k.accepted:
        head = ["family", "case", "config", "kernel (median [p20-p80])", "baseline",
                "kernel speedup", "GB/s"] if gpu else [
            "family", "case", "config", "kernel (median [p20-p80]), CPU interpreter: not "
            "meaningful, no speedup derived", "baseline (CPU)"]
        b += [("h", 3, "Accepted (verified)"), ("table", head + [
            "configs tried / passed screen"], [
            [a.family, case_text(a.case, a.case_key), config_text(a.config),
             t(a.kernel), t(a.baseline),
             *([speed(a.speedup) if a.meaningful else "not meaningful (CPU timing)",
                f"{a.kernel.gbps:.0f}" if a.meaningful and a.kernel.gbps else "-"]
               if gpu else []),
             f"{a.search.configs} / {a.search.passed_screen}" if a.search else "-"]
            for a in k.accepted])]
        shipped = {f for w in data.workloads for f in w.kept or ()}
        links = [(f"{a.family}, {case_text(a.case, a.case_key)}: kernel.py",
                  kernel_path(a.source, None)) for a in k.accepted
                 if a.family in shipped and a.source]
        if links:
            b += [("p", "The shipped kernels (readable Triton; edit one and rerun with "
                        "--resume to verify your edit as is):"), ("links", links)]
    if k.rejected:
        b += [("h", 3, "Rejected"), ("table", ["family/case", "reason", "candidates tried"], [
            [r.key, r.reason, "; ".join(
                f"{Path(str(x.candidate)).parent.name}: {x.verdict}"
                + (f" ({x.reasons[0]})" if x.reasons else "") for x in r.tried) or "-"]
            for r in k.rejected])]
    if k.not_applicable:
        b += [("p", "Families chosen but not applicable:"), ("ul", k.not_applicable)]
    return b


def _compiled_words(kept: list[str]) -> str:
    """What a torch.compile user of the kept set gets (`apply_kernels(..., compiled=True)`)."""
    from pipeline.patching import for_compile

    offer = Compiled.of(for_compile(kept))
    out = (f"Under torch.compile (`apply_kernels(..., compiled=True)`, each kernel call one "
           f"custom op): {', '.join(offer.families) or 'none'}")
    if offer.left_out:
        out += f"; left out, not traceable: {', '.join(offer.left_out)}"
    return out + "."

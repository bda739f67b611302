"""Terminal summaries (rich tables) of the profile and the ranking."""

from __future__ import annotations

import re
import sys

from rich.console import Console
from rich.table import Table

from core.records import Profile, ProfiledWorkload

# Piped into a log, rich would wrap tables at 80 columns and cut workload keys and CIs short;
# a log is read later, in full, so it gets room (a terminal keeps its own width).
console = Console(stderr=False, highlight=False,
                  width=None if sys.stdout.isatty() else 140)

_LAYER = re.compile(r"\.(\d+)(?=\.|$)")


def module_pattern(path: str) -> str:
    """`model.layers.3.mlp.act_fn` -> `model.layers.*.mlp.act_fn`."""
    return _LAYER.sub(".*", path)


def print_profile(profile: Profile | dict, top: int = 10) -> None:
    profile = Profile.of(profile)
    model = profile.model
    for w in profile.workloads:
        gpu = w.time_basis == "device"
        console.print(f"[bold]{model.name or model.id}[/bold] {w.key} on "
                      f"{w.workload.device} ({model.weights} weights)")
        console.print(f"  wall {w.wall.median_ms:.3f} ms per pass (p10 "
                      f"{w.wall.p10_ms:.3f}, p90 {w.wall.p90_ms:.3f}), timed without "
                      f"the profiler: shares are of this time")
        console.print(f"  profiled {w.profiled_ms_per_step:.3f} ms per pass: the same pass "
                      f"under the profiler, which adds its own cost to every op")
        if gpu:
            console.print(f"  GPU busy {w.gpu_busy_share:.1%} of the wall time, idle "
                          f"{w.gpu_idle_share:.1%}; {w.kernel_count} kernels, "
                          f"{w.unattributed_us:.1f} us unattributed")
        console.print(_ops_table(w, gpu, top))
        console.print(_modules_table(w, gpu, top))


def _ops_table(w: ProfiledWorkload, gpu: bool, top: int) -> Table:
    t = Table(title=f"top ops by {'device' if gpu else 'CPU'} time", caption=_ops_caption(w))
    cols = ("op", "calls", "device ms", "share", "host ms") if gpu else \
        ("op", "calls", "ms", "share")
    for c in cols:
        t.add_column(c, justify="right" if c != "op" else "left")
    for r in w.by_op[:top]:
        cells = [r.op, str(r.calls), f"{r.time_us / 1e3:.3f}", f"{r.share:.1%}"]
        t.add_row(*cells, *([f"{r.cpu_us / 1e3:.3f}"] if gpu else []))
    t.add_row("(rest: host/launch/idle)", "", "", f"{w.rest_share:.1%}", *([""] if gpu else []))
    return t


def _modules_table(w: ProfiledWorkload, gpu: bool, top: int) -> Table:
    mods: dict[str, list] = {}
    for path, row in w.modules.items():
        agg = mods.setdefault(module_pattern(path), [row.module_class, 0, 0.0, 0.0])
        agg[1] += row.calls
        agg[2] += row.device_us
        agg[3] += row.host_us
    leaves = sorted(mods.items(), key=lambda kv: -(kv[1][2] if gpu else kv[1][3]))
    t = Table(title="modules (children included)",
              caption="host ms: CPU time under the profiler, as traced (not scaled)")
    cols = ("module", "class", "calls") + (("device ms",) if gpu else ()) + ("host ms",)
    for c in cols:
        t.add_column(c, justify="left" if c in ("module", "class") else "right")
    for path, (cls, calls, dev, host) in leaves[:top]:
        cells = [path, cls, str(calls)] + ([f"{dev / 1e3:.3f}"] if gpu else [])
        t.add_row(*cells, f"{host / 1e3:.3f}")
    return t


def _ops_caption(w: ProfiledWorkload) -> str:
    """What the op table's times are: on a GPU its kernels' device time and its call's host
    time under the profiler; on the CPU one time, the traced one scaled to the wall."""
    if w.time_basis == "device":
        return ("device ms: the op's kernels on the GPU; host ms: its call on the CPU, under "
                "the profiler")
    scale = w.time_scale or 1.0
    return ("ms: the op's CPU time under the profiler" + (
        f", scaled by {scale:.3f} so that the ops and the rest sum to the wall" if scale < 1
        else ""))


OPTIMIZE_COLUMNS = ("workload", "kept kernels", "projected (replay)", "projected (Amdahl)",
                    "measured", "95% CI", "note")


def optimize_rows(run_dir) -> list[list[str]]:
    """Per workload: projected next to measured whole-model speedup, and the decision."""
    from pathlib import Path

    from core.artifacts import load
    from core.records import Integration, Projection, Ranking

    run_dir = Path(run_dir)
    proj = load(run_dir / "projection.json", Projection, "projection")
    integ = load(run_dir / "integration.json", Integration, "integration")
    ranking = run_dir / "ranking.json"
    floors = {w.key: w.floor.over_wall for w in (
        load(ranking, Ranking, "ranking").workloads if ranking.exists() else []) if w.floor}
    rows = []
    for key, w in integ.workloads.items():
        p = proj.workloads.get(key)
        kept = w.projection_for_kept
        if kept and set(kept.families) == set(w.kept) and not (p and p.note):
            p = kept  # the projection of the set that ran, which the measurement compares to
        measured, ci, note = _measured_cells(w, floors.get(key))
        frozen_note = getattr(p, "note", None)
        if frozen_note:  # a CPU run projects nothing; said once, in full (rich wraps it)
            note = frozen_note if measured == "-" and w.combined else f"{frozen_note}; {note}"
        replay, amdahl = (p.replay, p.amdahl) if p is not None else (None, None)
        rows.append([key, ", ".join(w.kept) or "none",
                     f"{replay:.3f}x" if replay else "-",
                     f"{amdahl:.3f}x" if amdahl and replay is not None else "-",
                     measured, ci, note])
    return rows


def _measured_cells(w, floor: float | None) -> tuple[str, str, str]:
    """(measured speedup, its CI, the note) of one integrated workload."""
    from pipeline.report_render import host_drift_told

    comb = w.combined
    if not (comb and comb.meaningful):
        return "-", "-", (comb.reason if comb else None) or "nothing kept"
    note = comb.decision if comb.has("decision") else ""
    if comb.bound and comb.bound.patched and comb.bound.patched.host_bound:
        note += "; host-bound after patching"
    at = w.projection_at_timing_host
    if host_drift_told(at, w.kept):
        note += (f"; {at.replay:.3f}x projected at the timing's host speed (the host "
                 f"took {at.host_drift:.2f}x the profile's time)")
    if floor is not None:
        note += f"; floor {floor:.3f}x (its GEMMs and attention alone)"
    return f"{1 / comb.estimate:.3f}x", f"{1 / comb.ci_high:.3f}-{1 / comb.ci_low:.3f}", note


def print_optimize(run_dir, console: Console = console) -> None:
    """The final table. Family names are one per line and never cut (the column is as wide
    as the longest); the other cells fold onto more lines at 80 columns instead of being cut
    with an ellipsis."""
    rows = optimize_rows(run_dir)
    t = Table(title="whole-model speedup per workload")
    longest = max((len(f) for r in rows for f in r[1].split(", ")), default=4)
    for c in OPTIMIZE_COLUMNS:
        if c == "kept kernels":
            t.add_column(c, no_wrap=True, min_width=longest)
        else:
            t.add_column(c, overflow="fold")
    for row in rows:
        t.add_row(row[0], "\n".join(row[1].split(", ")), *row[2:])
    console.print(t)

"""Terminal summaries (rich tables) of the profile and the ranking."""

from __future__ import annotations

import re
import sys

from rich.console import Console
from rich.table import Table

# Piped into a log, rich would wrap tables at 80 columns and cut workload keys and CIs short;
# a log is read later, in full, so it gets room (a terminal keeps its own width).
console = Console(stderr=False, highlight=False,
                  width=None if sys.stdout.isatty() else 140)

_LAYER = re.compile(r"\.(\d+)(?=\.|$)")


def module_pattern(path: str) -> str:
    """`model.layers.3.mlp.act_fn` -> `model.layers.*.mlp.act_fn`."""
    return _LAYER.sub(".*", path)


def print_profile(profile: dict, top: int = 10) -> None:
    model = profile["model"]
    for w in profile["workloads"]:
        gpu = w["time_basis"] == "device"
        console.print(f"[bold]{model.get('name') or model['id']}[/bold] {w['key']} on "
                      f"{w['workload']['device']} ({model['weights']} weights)")
        console.print(f"  wall {w['wall']['median_ms']:.3f} ms per pass (p10 "
                      f"{w['wall']['p10_ms']:.3f}, p90 {w['wall']['p90_ms']:.3f}), timed without "
                      f"the profiler: shares are of this time")
        console.print(f"  profiled {w['profiled_ms_per_step']:.3f} ms per pass: the same pass "
                      f"under the profiler, which adds its own cost to every op")
        if gpu:
            console.print(f"  GPU busy {w['gpu_busy_share']:.1%} of the wall time, idle "
                          f"{w['gpu_idle_share']:.1%}; {w['kernel_count']} kernels, "
                          f"{w['unattributed_us']:.1f} us unattributed")
        t = Table(title=f"top ops by {'device' if gpu else 'CPU'} time", caption=_ops_caption(w))
        cols = ("op", "calls", "device ms", "share", "host ms") if gpu else \
            ("op", "calls", "ms", "share")
        for c in cols:
            t.add_column(c, justify="right" if c != "op" else "left")
        for r in w["by_op"][:top]:
            cells = [r["op"], str(r["calls"]), f"{r['time_us'] / 1e3:.3f}", f"{r['share']:.1%}"]
            t.add_row(*cells, *([f"{r['cpu_us'] / 1e3:.3f}"] if gpu else []))
        t.add_row("(rest: host/launch/idle)", "", "", f"{w['rest_share']:.1%}",
                  *([""] if gpu else []))
        console.print(t)
        mods: dict[str, list] = {}
        for path, row in w["modules"].items():
            agg = mods.setdefault(module_pattern(path), [row["class"], 0, 0.0, 0.0])
            agg[1] += row["calls"]
            agg[2] += row["device_us"]
            agg[3] += row["host_us"]
        leaves = sorted(mods.items(), key=lambda kv: -(kv[1][2] if gpu else kv[1][3]))
        t = Table(title="modules (children included)",
                  caption="host ms: CPU time under the profiler, as traced (not scaled)")
        cols = ("module", "class", "calls") + (("device ms",) if gpu else ()) + ("host ms",)
        for c in cols:
            t.add_column(c, justify="left" if c in ("module", "class") else "right")
        for path, (cls, calls, dev, host) in leaves[:top]:
            cells = [path, cls, str(calls)] + ([f"{dev / 1e3:.3f}"] if gpu else [])
            t.add_row(*cells, f"{host / 1e3:.3f}")
        console.print(t)


def _ops_caption(w: dict) -> str:
    """What the op table's times are: on a GPU its kernels' device time and its call's host
    time under the profiler; on the CPU one time, the traced one scaled to the wall."""
    if w["time_basis"] == "device":
        return ("device ms: the op's kernels on the GPU; host ms: its call on the CPU, under "
                "the profiler")
    scale = w.get("time_scale") or 1.0
    return ("ms: the op's CPU time under the profiler" + (
        f", scaled by {scale:.3f} so that the ops and the rest sum to the wall" if scale < 1
        else ""))


OPTIMIZE_COLUMNS = ("workload", "kept kernels", "projected (replay)", "projected (Amdahl)",
                    "measured", "95% CI", "note")


def optimize_rows(run_dir) -> list[list[str]]:
    """Per workload: projected next to measured whole-model speedup, and the decision."""
    from pathlib import Path

    from core.artifacts import read_json
    from pipeline.report_render import host_drift_told

    run_dir = Path(run_dir)
    proj = read_json(run_dir / "projection.json", "projection")
    integ = read_json(run_dir / "integration.json", "integration")
    ranking = run_dir / "ranking.json"
    floors = {w["key"]: w["floor"]["over_wall"] for w in (
        read_json(ranking, "ranking")["workloads"] if ranking.exists() else [])
        if w.get("floor")}
    rows = []
    for key, w in integ["workloads"].items():
        p = proj["workloads"].get(key, {})
        kept = w.get("projection_for_kept")
        if kept and set(kept["families"]) == set(w["kept"]) and not p.get("note"):
            p = kept  # the projection of the set that ran, which the measurement compares to
        comb = w.get("combined")
        if comb and comb.get("meaningful"):
            measured = f"{1 / comb['estimate']:.3f}x"
            ci = f"{1 / comb['ci_high']:.3f}-{1 / comb['ci_low']:.3f}"
            note = comb.get("decision", "")
            if ((comb.get("bound") or {}).get("patched") or {}).get("host_bound"):
                note += "; host-bound after patching"
            at = w.get("projection_at_timing_host")
            if host_drift_told(at, w["kept"]):
                note += (f"; {at['replay']:.3f}x projected at the timing's host speed (the host "
                         f"took {at['host_drift']:.2f}x the profile's time)")
            if key in floors:
                note += f"; floor {floors[key]:.3f}x (its GEMMs and attention alone)"
        else:
            measured, ci = "-", "-"
            note = (comb or {}).get("reason") or "nothing kept"
        if p.get("note"):  # a CPU run projects nothing; said once, in full (rich wraps it)
            note = p["note"] if measured == "-" and comb else f"{p['note']}; {note}"
        rows.append([key, ", ".join(w["kept"]) or "none",
                     f"{p['replay']:.3f}x" if p.get("replay") else "-",
                     f"{p['amdahl']:.3f}x" if p.get("amdahl") and p.get("replay") is not None
                     else "-", measured, ci, note])
    return rows


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

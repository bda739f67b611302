"""e2e.json as the terminal's table, the report's "Generation end to end" section and plot,
and the verdict line that leads the report. It reads the typed record and decides nothing."""

from __future__ import annotations

from pathlib import Path

from core.artifacts import load
from core.records import E2E, GenerationPoint, GenerationVariant

COLUMNS = ["variant", "TTFT p50", "TPOT p50", "TPOT p99", "tok/s", "over hf-eager",
           "x floor", "projected (error)", "first call", "same tokens"]
CONTENDER = "hf-static"  # what a user already has: transformers' static-cache generate
OURS = ("ours-graphs", "ours")


def read(run_dir: Path) -> E2E | None:
    path = Path(run_dir) / "e2e.json"
    return load(path, E2E, "e2e") if path.exists() else None


def _ms(v: float | None, digits: int = 3) -> str:
    return "-" if v is None else f"{v:.{digits}f} ms"


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def row(v: GenerationVariant) -> list[str]:
    if v.skipped:
        return [v.name, f"skipped: {v.skipped}"] + [""] * (len(COLUMNS) - 2)
    t, p = v.times, v.projected
    proj = "-" if p is None else (f"{p.speedup:.2f}x" + (f" ({p.error:.1%})"
                                                         if p.error is not None else ""))
    return [v.name, _ms(t.ttft_p50, 2), _ms(t.tpot_p50), _ms(t.tpot_p99), f"{t.tok_s:.1f}",
            _x(v.over_eager), _x(v.floor_multiple), proj,
            "-" if v.first_call_s is None else f"{v.first_call_s:.1f} s",
            "-" if v.same_tokens is None else f"{v.same_tokens:.0%}"]


def headline(point: GenerationPoint, device: str) -> str | None:
    """The downstream result of one point: our fastest variant's tokens/s against the static-
    cache generate a user already has (hf-eager where that was not measured)."""
    by = {v.name: v for v in point.variants if v.times is not None}
    ours = [by[n] for n in OURS if n in by]
    rival = by.get(CONTENDER) or by.get("hf-eager")
    if not ours or rival is None:
        return None
    best = max(ours, key=lambda v: v.times.tok_s)
    cpu = "" if device.startswith("cuda") else " (CPU, Triton interpreter: not a GPU timing)"
    what = ("transformers' static-cache generate" if rival.name == CONTENDER
            else "transformers' generate")
    return (f"generation b{point.batch}, {point.prompt} + {point.new} tokens: {best.name} "
            f"{best.times.tok_s / rival.times.tok_s:.2f}x tokens/s over {what} ({rival.name}; "
            f"TPOT {best.times.tpot_p50 or 0:.3f} against {rival.times.tpot_p50 or 0:.3f} ms)"
            + cpu)


def verdict_lines(result: E2E | None) -> list[str]:
    if result is None:
        return []
    return [h for p in result.points if not p.skipped and (h := headline(p, result.device))]


def print_e2e(result: E2E) -> None:
    from rich.table import Table

    from pipeline.summary import console

    for point in result.points:
        title = f"{point.key}" + (f" (floor {point.floor_ms:.3f} ms per step)"
                                  if point.floor_ms else "")
        if point.skipped:
            console.print(f"{title}: skipped ({point.skipped})")
            continue
        t = Table(title=title)
        for c in COLUMNS:
            t.add_column(c, overflow="fold")
        for v in point.variants:
            if not v.skipped:
                t.add_row(*row(v))
        console.print(t)
        for v in point.variants:
            if v.skipped:
                console.print(f"  {v.name}: skipped ({v.skipped})")
    for line in verdict_lines(result):
        console.print(line)


def plot(run_dir: Path, result: E2E) -> Path | None:
    """TPOT p50 per variant, one group per grid point."""
    from pipeline.report_figures import _figure, _save

    points = [p for p in result.points if not p.skipped and p.variants]
    names = [n for n in dict.fromkeys(v.name for p in points for v in p.variants
                                      if v.times is not None and v.times.tpot_p50)]
    if not points or not names:
        return None
    fig = _figure(8, 3.6)
    ax = fig.subplots()
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        xs, ys = [], []
        for j, p in enumerate(points):
            v = next((v for v in p.variants if v.name == name and v.times), None)
            if v is not None and v.times.tpot_p50:
                xs.append(j + i * width)
                ys.append(v.times.tpot_p50)
        ax.bar(xs, ys, width, label=name)
    for j, p in enumerate(points):
        if p.floor_ms:
            ax.hlines(p.floor_ms, j - width / 2, j + 0.8 - width / 2, colors="black",
                      linestyles="dashed", label="weight-read floor" if j == 0 else None)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(points))],
                  [f"b{p.batch} {p.prompt}+{p.new}" for p in points])
    ax.set_ylabel("time per output token, p50 (ms)")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.set_title(f"{result.model}: generation, {result.dtype} on {result.device}")
    return _save(fig, Path(run_dir) / "plots" / "e2e_tpot.png")


def blocks(run_dir: Path, result: E2E) -> list[tuple]:
    """The report's section."""
    b: list[tuple] = [("h", 2, "Generation end to end"), ("p", (
        f"`pipeline e2e`: {result.rounds} timed call(s) per variant and grid point after one "
        "untimed call, in rotating order, one process, the same weights. TTFT: time to the "
        "first token; TPOT: time between tokens (p50 and p99 over calls and steps); x floor: "
        "TPOT over the decode step's weight-read floor (weight bytes over the measured copy "
        "bandwidth); projected: the run's frozen prefill and decode projections composed over "
        "hf-eager's call, with the error against the measured speedup; first call: the "
        "untimed call's wall (compiling, capturing, first kernel launches)."))]
    b += [("note", n) for n in result.notes]
    image = plot(run_dir, result)
    if image is not None:
        b.append(("img", str(image.relative_to(run_dir)), "time per output token per variant"))
    for p in result.points:
        b.append(("h", 3, p.key))
        if p.skipped:
            b.append(("p", f"skipped: {p.skipped}"))
            continue
        served = [f"{v.name}, {phase}: " + (", ".join(
            f"{f} ({v.kernel_calls.get(phase, {}).get(f) or 'in the graph'} calls)"
            for f in v.served.get(phase, [])) or "no kernel") + ("; original code for "
            + "; ".join(f"{f} {', '.join(c)}" for f, c in v.declined[phase].items())
            if v.declined.get(phase) else "")
            for v in p.variants if v.families for phase in ("prefill", "steps")]
        b.append(("p", f"kernels from {p.prefill_workload or 'no prefill workload'} and "
                       f"{p.decode_workload or 'no decode workload'}"
                  + (f"; floor {p.floor_ms:.3f} ms per step "
                     f"({(p.weight_bytes or 0) / 1e9:.2f} GB)" if p.floor_ms else "")))
        b.append(("table", COLUMNS, [row(v) for v in p.variants]))
        if served:
            b.append(("ul", ["which kernels ran, per generation: " + s for s in served]))
        notes = [n for v in p.variants if v.projected for n in v.projected.notes]
        notes += [f"{v.name}: {v.note}" for v in p.variants if v.note]
        if notes:
            b.append(("ul", notes))
    return b

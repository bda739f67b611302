"""The report's plots: matplotlib on the Agg canvas (no display, no pyplot state), written
atomically. They draw the numbers report.json holds and decide nothing."""

from __future__ import annotations

import io
from pathlib import Path
from typing import NamedTuple

from core.artifacts import write_text
from core.records import CurvePoint
from pipeline.report_render import pct
from pipeline.report_view import Projected, RatioView, ReportView, ShareRow

COLORS = {"family": "#4c72b0", "other": "#8da0cb", "option": "#c9d3e6", "rest": "#b0b0b0",
          "amdahl": "#4c72b0", "replay": "#dd8452", "measured": "#55a868"}


def _figure(width: float, height: float):
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=100, layout="constrained")


def _save(fig, path: Path) -> Path:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    write_text(path, buf.getvalue())
    return path


def _short(text: str, n: int = 46) -> str:
    return text if len(text) <= n else text[: n - 1] + "\u2026"


def share_plot(path: Path, key: str, rows: list[ShareRow], basis: str) -> Path:
    """Horizontal bars of the wall-time share per pattern, top to bottom in the table's order;
    rows: {label, share, kind}, where kind is "family" (a kernel family can replace it),
    "option" (replaces the ops of the row above it again: hatched, its share in parentheses),
    "other" or "rest"."""
    fig = _figure(8.0, 0.38 * len(rows) + 1.4)
    ax = fig.add_subplot()
    rows = list(reversed(rows))
    y = range(len(rows))
    bars = ax.barh(list(y), [r.share * 100 for r in rows],
                   color=[COLORS.get(r.kind, COLORS["other"]) for r in rows])
    for bar, r in zip(bars, rows, strict=True):
        if r.kind == "option":
            bar.set_hatch("//")
    ax.set_yticks(list(y), [_short(r.label) for r in rows], fontsize=8)
    top = max([r.share * 100 for r in rows] + [1.0])
    for i, r in enumerate(rows):
        text = pct(r.share)
        ax.text(r.share * 100 + top * 0.01, i, f"({text})" if r.kind == "option" else text,
                va="center", fontsize=7)
    ax.set_xlim(0, top * 1.15)
    what = "device time" if basis == "device" else "host (CPU) time"
    ax.set_xlabel(f"share of the wall time (%) - {what}\ndark bars: a kernel family applies; "
                  "hatched: an option of the row above (its ops again)", fontsize=9)
    ax.set_title(f"{key}: where the time goes", fontsize=10)
    return _save(fig, path)


def cumulative_plot(path: Path, key: str, curve: list[CurvePoint], basis_note: str,
                    shipped: frozenset = frozenset()) -> Path:
    """Projected whole-model speedup when the top n candidate families are replaced, in the
    ranking's order; the families that shipped on the workload are marked."""
    fig = _figure(8.0, 4.2)
    ax = fig.add_subplot()
    n = [p.n for p in curve]
    ax.plot(n, [p.amdahl for p in curve], marker="o", color=COLORS["amdahl"],
            label="Amdahl over shares")
    replay = [(p.n, p.replay) for p in curve if p.replay is not None]
    if replay:
        ax.plot([x for x, _ in replay], [v for _, v in replay], marker="s",
                color=COLORS["replay"], label="trace replay (critical path)")
    ax.axhline(1.0, color="#666", lw=0.8, ls="--")
    labels = [_short(f"+{p.family or p.pattern}", 24)
              + (" (shipped)" if (p.family or p.pattern) in shipped else "")
              for p in curve]
    ax.set_xticks(n, labels, rotation=30, ha="right", fontsize=8)
    for tick, p in zip(ax.get_xticklabels(), curve, strict=True):
        if (p.family or p.pattern) in shipped:
            tick.set_fontweight("bold")
    ax.set_ylabel("projected whole-model speedup (x)")
    ax.set_title(f"{key}: cumulative projection ({basis_note})", fontsize=10)
    ax.legend(fontsize=8)
    return _save(fig, path)


class Compared(NamedTuple):
    """A workload's bars in the comparison plot; a value that is None is not drawn."""
    key: str
    amdahl: float | None
    replay: float | None
    measured: float | None
    ci: list | None


def comparison_plot(path: Path, entries: list[Compared]) -> Path:
    """Per workload: projected (Amdahl, replay) next to the measured speedup with its 95 % CI,
    bars drawn from 1.0 so a slowdown points down."""
    fig = _figure(max(6.0, 1.9 * len(entries) + 2), 4.4)
    ax = fig.add_subplot()
    width, seen = 0.26, [1.0]
    for j, (name, label) in enumerate((("amdahl", "projected: Amdahl"),
                                       ("replay", "projected: replay"),
                                       ("measured", "measured (95% CI)"))):
        pts = [(i + (j - 1) * width, getattr(e, name), e.ci if name == "measured" else None)
               for i, e in enumerate(entries) if getattr(e, name) is not None]
        if not pts:
            continue
        err = [[max(0.0, v - c[0]) if c else 0.0 for _, v, c in pts],
               [max(0.0, c[1] - v) if c else 0.0 for _, v, c in pts]]
        ax.bar([x for x, _, _ in pts], [v - 1.0 for _, v, _ in pts], width, bottom=1.0,
               label=label, color=COLORS[name], yerr=err, capsize=3 if name == "measured" else 0)
        for x, v, c in pts:
            seen += [v, *(c or ())]
            y = (c[1] if v >= 1 else c[0]) if c else v  # beyond the CI, clear of its caps
            ax.text(x, y, f"{v:.3f}", ha="center", va="bottom" if v >= 1 else "top", fontsize=7)
    span = max(seen) - min(seen) or 0.05
    ax.set_ylim(min(seen) - 0.25 * span, max(seen) + 0.25 * span)
    ax.axhline(1.0, color="#666", lw=0.8)
    ax.set_xticks(range(len(entries)), [_short(e.key, 28) for e in entries], fontsize=8)
    ax.set_ylabel("whole-model speedup (x); 1.0 = unchanged")
    ax.set_title("projected vs measured whole-model speedup per workload", fontsize=10)
    ax.legend(fontsize=8)
    return _save(fig, path)


def make_plots(run_dir: Path, data: ReportView) -> dict[str, Path]:
    """Every plot the data supports; keys name them in report.json."""
    out: dict[str, Path] = {}
    for w in data.workloads:
        k = w.key
        if w.shares:
            out[f"share/{k}"] = share_plot(run_dir / "plots" / f"share_{k}.png", k,
                                           w.shares, w.time_basis or "cpu")
        # on the CPU every family projects 1.000x (no GPU kernel times): a flat line says
        # nothing, and the report says why it is not drawn
        if w.cumulative and w.time_basis == "device":
            measured = any(r.target_source == "measured kernel"
                           for r in w.top_patterns if r.family)
            basis = "measured kernel times" if measured else "roofline targets"
            out[f"cumulative/{k}"] = cumulative_plot(
                run_dir / "plots" / f"cumulative_{k}.png", k, w.cumulative, basis,
                frozenset(w.kept or ()))
    entries = []
    for w in data.workloads:
        p, m = w.compared_projection or w.projected or Projected(), w.measured or RatioView()
        entries.append(Compared(w.key, p.amdahl, p.replay, m.speedup, m.ci))
    if len(entries) > 1 and any(v is not None for e in entries
                                for v in (e.amdahl, e.replay, e.measured)):
        out["comparison"] = comparison_plot(run_dir / "plots" / "comparison.png", entries)
    return out



"""A small, JSON-serialisable summary of Holistic Trace Analysis (HTA) on one trace file.

HTA is optional (package `traceinsight`, `import hta`). Its own dependency list brings
JupyterLab and the notebook stack, which the analyses below never import: the `hta` extra
installs what they do import (plotly, PyYAML, psutil, besides the project's pandas, numpy and
networkx), and traceinsight goes in with `--no-deps` (INSTALL). Without it a GPU profile
records why and says so in one line. Each analysis runs on
its own: on real traces some of them fail inside HTA (traceinsight 0.6.1's temporal breakdown
trips `assert non_compute_time >= 0` on the prefill fixture), and one failure must not cost
the others. A failure is recorded as one line, never raised. HTA logs and prints a lot while
parsing; all of it is silenced here, since the pipeline writes its own report.

HTA reads every trace file in a directory, so the file is copied alone into a temporary
directory; `.json` and `.json.gz` both work.
"""

from __future__ import annotations

import contextlib
import io
import logging
import math
import shutil
import tempfile
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

TOP_KERNELS = 10
INSTALL = "pip install 'kernel-pipeline[hta]' && pip install --no-deps 'traceinsight>=0.6'"


def _num(x: Any) -> float | int | None:
    """A plain Python number for JSON (numpy scalars are not serialisable; NaN is not JSON)."""
    if x is None:
        return None
    x = float(x)
    if math.isnan(x) or math.isinf(x):
        return None
    return int(x) if x.is_integer() else round(x, 3)


def _reason(exc: BaseException) -> str:
    """One line: the exception, and where HTA raised it when the message says nothing
    (HTA's internal assertions carry no message)."""
    msg = " ".join(str(exc).split())
    where = ""
    frames = traceback.extract_tb(exc.__traceback__)
    if frames:
        f = frames[-1]
        where = f" at {Path(f.filename).name}:{f.lineno}"
        if not msg and f.line:
            msg = f.line.strip()
    line = f"{type(exc).__name__}{where}: {msg}" if msg else f"{type(exc).__name__}{where}"
    return line[:300]


@contextlib.contextmanager
def _quiet():
    loggers = [logging.getLogger("hta")] + [
        lg for name, lg in logging.root.manager.loggerDict.items()
        if name.startswith("hta.") and isinstance(lg, logging.Logger)
    ]
    before = [lg.disabled for lg in loggers]
    for lg in loggers:
        lg.disabled = True
    sink = io.StringIO()
    try:
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink), \
                warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, was in zip(loggers, before, strict=True):
            lg.disabled = was


def _stats(series) -> dict:
    s = series.dropna()
    if s.empty:
        return {"count": 0}
    return {"count": int(s.size), "mean": _num(s.mean()), "median": _num(s.median()),
            "p90": _num(s.quantile(0.9)), "max": _num(s.max())}


def _kernel_breakdown(ta, top: int) -> dict:
    by_type, per_kernel = ta.get_gpu_kernel_breakdown(visualize=False, num_kernels=top)
    total = float(by_type["sum"].sum())
    # "sum (us)" is the kernel's total over the trace; HTA's mean/max/min are across ranks.
    rows = per_kernel.sort_values("sum (us)", ascending=False)
    return {
        "by_type": [{"kernel_type": r["kernel_type"], "sum_us": _num(r["sum"]),
                     "percentage": _num(r["percentage"])} for _, r in by_type.iterrows()],
        "total_us": _num(total),
        "top_kernels": [{"name": r["name"], "kernel_type": r["kernel_type"],
                         "sum_us": _num(r["sum (us)"]),
                         "share": _num(r["sum (us)"] / total) if total else None}
                        for _, r in rows.head(top).iterrows()],
    }


def _idle_time(ta) -> dict:
    idle, _ = ta.get_idle_time_breakdown(visualize=False)
    per_cat = idle.groupby("idle_category")["idle_time"].sum()
    return {
        "idle_us_by_category": {str(k): _num(v) for k, v in per_cat.items()},
        "idle_us": _num(per_cat.sum()),
        "streams": sorted(int(s) for s in idle["stream"].unique()),
    }


def _launch_stats(ta) -> dict:
    frames = ta.get_cuda_kernel_launch_stats(visualize=False)
    df = next(iter(frames.values()))
    return {
        "launches": len(df),
        "cpu_duration_us": _stats(df["cpu_duration"]),
        "gpu_duration_us": _stats(df["gpu_duration"]),
        "launch_delay_us": _stats(df["launch_delay"]),
        # A kernel shorter than its own launch call: the host, not the GPU, sets the pace.
        "gpu_shorter_than_launch": int((df["gpu_duration"] < df["cpu_duration"]).sum()),
        # The profiler reports 0 or -1 for a few kernels; counted, not trusted.
        "nonpositive_gpu_duration": int((df["gpu_duration"] <= 0).sum()),
    }


def _temporal(ta) -> dict:
    row = ta.get_temporal_breakdown(visualize=False).iloc[0]
    return {str(k): _num(v) for k, v in row.items() if k != "rank"}


def _critical_path(ta, instance: int) -> dict:
    graph, ok = ta.critical_path_analysis(rank=0, annotation="ProfilerStep", instance_id=instance)
    if not ok:
        raise RuntimeError("critical_path_analysis returned success=False")
    edges = graph.get_critical_path_breakdown()
    total = float(edges["duration"].sum())
    bound = edges.groupby("bound_by")["duration"].sum()
    return {
        "annotation": "ProfilerStep", "instance_id": instance, "length_us": _num(total),
        "bound_by_pct": {str(k): _num(100.0 * v / total) for k, v in bound.items()
                         if k and total},
    }


def hta_summary(trace_path: str | Path, *, top: int = TOP_KERNELS,
               cp_instance: int | None = None) -> dict:
    """Run each HTA analysis on `trace_path` separately and summarise what worked.

    `cp_instance` picks the ProfilerStep for the critical path; by default the second one
    when there are several (HTA's own advice: the first step often misses events).
    Returns {"available": False, "reason": ...} when HTA cannot be imported.
    """
    try:
        with _quiet():
            from hta.trace_analysis import TraceAnalysis
    except Exception as exc:  # noqa: BLE001 - ImportError, or a broken install at import
        return {"available": False, "reason": f"{_reason(exc)}; to install: {INSTALL}"}

    trace_path = Path(trace_path)
    out: dict[str, Any] = {"available": True, "trace": trace_path.name, "failures": {}}
    with tempfile.TemporaryDirectory(prefix="hta-") as tmp, _quiet():
        shutil.copy(trace_path, Path(tmp) / trace_path.name)
        try:
            # Without include_last_profiler_step HTA silently drops the last step.
            ta = TraceAnalysis(trace_dir=tmp, include_last_profiler_step=True)
        except Exception as exc:  # noqa: BLE001 - any HTA failure is reported, not raised
            out["failures"]["load"] = _reason(exc)
            return out
        try:
            steps = [int(s) for s in ta.get_profiler_steps()]
        except Exception as exc:  # noqa: BLE001 - as above
            steps = []
            out["failures"]["profiler_steps"] = _reason(exc)
        out["profiler_steps"] = steps
        instance = cp_instance if cp_instance is not None else (1 if len(steps) > 1 else 0)

        analyses: dict[str, Callable[[], dict]] = {
            "kernel_breakdown": lambda: _kernel_breakdown(ta, top),
            "idle_time": lambda: _idle_time(ta),
            "launch_stats": lambda: _launch_stats(ta),
            "temporal_breakdown": lambda: _temporal(ta),
            "critical_path": lambda: _critical_path(ta, instance),
        }
        for name, run in analyses.items():
            try:
                out[name] = run()
            except Exception as exc:  # noqa: BLE001 - one failure must not cost the others
                out["failures"][name] = _reason(exc)

    kernel_us = out.get("kernel_breakdown", {}).get("total_us")
    idle_us = out.get("idle_time", {}).get("idle_us")
    if kernel_us is not None and idle_us is not None and kernel_us + idle_us > 0:
        # Idle over idle + busy on the GPU's streams (HTA's temporal breakdown's definition),
        # computed here too because that analysis is the one that tends to fail.
        out["idle_time"]["idle_share"] = _num(idle_us / (idle_us + kernel_us))
    return out

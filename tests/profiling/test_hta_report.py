"""HTA summary: each analysis separately, failures reported as one line, never raised."""

import json
import logging
import sys
from pathlib import Path

import pytest

from profiling.hta_report import hta_summary

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
PREFILL = FIXTURES / "prefill_b8_s1024_2layer.json.gz"


@pytest.fixture(scope="module")
def prefill_report():
    pytest.importorskip("hta.trace_analysis")
    return hta_summary(PREFILL)


def test_prefill_summary_has_what_works_and_is_json(prefill_report):
    rep = prefill_report
    assert rep["available"] is True
    json.dumps(rep, allow_nan=False)  # plain, small, serialisable
    assert rep["profiler_steps"] == [3, 4, 5]
    kb = rep["kernel_breakdown"]
    assert kb["top_kernels"] and kb["total_us"] > 0
    assert kb["top_kernels"][0]["name"].startswith("nvjet")  # the big matmuls lead prefill
    ls = rep["launch_stats"]
    assert ls["launches"] > 100 and ls["launch_delay_us"]["median"] is not None
    assert 0.0 < rep["idle_time"]["idle_share"] < 0.5
    cp = rep["critical_path"]
    assert cp["bound_by_pct"]["gpu_compute_bound"] > 50.0  # GPU bound, as FACTS.md measured


def test_prefill_temporal_breakdown_failure_is_reported_not_raised(prefill_report):
    failures = prefill_report["failures"]
    # traceinsight 0.6.1 trips `assert non_compute_time >= 0` on this trace (FACTS.md); a
    # later HTA that fixes it may return the breakdown instead, which is fine too.
    assert ("temporal_breakdown" in failures) != ("temporal_breakdown" in prefill_report)
    for reason in failures.values():
        assert isinstance(reason, str) and reason and "\n" not in reason
    if "temporal_breakdown" in failures:
        assert failures["temporal_breakdown"].startswith("AssertionError")


def test_each_analysis_fails_alone_and_output_is_silenced(monkeypatch, capfd):
    hta_ta = pytest.importorskip("hta.trace_analysis")

    def boom(self, *args, **kwargs):
        raise RuntimeError("synthetic failure\nsecond line")

    monkeypatch.setattr(hta_ta.TraceAnalysis, "get_cuda_kernel_launch_stats", boom)
    rep = hta_summary(PREFILL)
    assert rep["failures"]["launch_stats"].startswith("RuntimeError")
    assert "\n" not in rep["failures"]["launch_stats"]
    assert "launch_stats" not in rep and "kernel_breakdown" in rep
    out, err = capfd.readouterr()
    assert "Parsed" not in out + err  # HTA's parsing chatter does not reach the user
    assert not logging.getLogger("hta").disabled  # and its logger is restored afterwards


def test_missing_hta_returns_unavailable(monkeypatch):
    monkeypatch.setitem(sys.modules, "hta.trace_analysis", None)  # import now raises
    rep = hta_summary(PREFILL)
    assert rep["available"] is False and "hta.trace_analysis" in rep["reason"]
    # the one line names the install without the notebook stack
    assert rep["reason"].endswith("to install: pip install 'kernel-pipeline[hta]' && pip "
                                  "install --no-deps 'traceinsight>=0.6'")
    assert "\n" not in rep["reason"]

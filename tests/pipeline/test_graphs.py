"""The graphs stage on the CPU, with fakes of models.graphs (tests/pipeline/fake_graphs.py):
the decision rule, capture failure falling back with a one-line reason, stale inputs and stale
positions failing verification, the records written, and the API's graph handle."""

from __future__ import annotations

import sys

import pytest
import torch

from core.artifacts import read_json, write_json
from core.workload import Workload
from pipeline.stages import graphs as gs
from tests.pipeline import fake_graphs
from verify.timing import PairedRatio

PREFILL = Workload(2, 8, "float32", "cpu", "prefill")
DECODE = Workload(1, 8, "float32", "cpu", "decode")


@pytest.fixture(scope="module")
def tiny():
    from pipeline.integrate import fp32_reference
    from profiling.loader import build, resolve

    torch.manual_seed(0)
    model = build(resolve("tiny-llama"), torch.float32, "cpu").eval()
    return model, fp32_reference(model)


@pytest.fixture
def fakes(monkeypatch):
    def use(**kw):
        monkeypatch.setitem(sys.modules, "models.graphs", fake_graphs.module(**kw))
    use()
    return use


def ratio(verdict: str, estimate: float = None, meaningful: bool = True) -> PairedRatio:
    est = estimate or {"faster": 0.5, "slower": 1.5, "same": 1.0}[verdict]
    low, high = {"faster": (est - 0.05, est + 0.05), "slower": (est - 0.05, est + 0.05),
                 "same": (0.9, 1.1)}[verdict]
    return PairedRatio(ratios=[est] * 4, statistic="median", estimate=est, ci_low=low,
                       ci_high=high, confidence=0.95, verdict=verdict, meaningful=meaningful,
                       reason=None if meaningful else "CPU", times_a_ms=[2.0] * 4,
                       times_b_ms=[2.0 * est] * 4)


def timer_of(*verdicts):
    """A paired timer answering in call order (graphed_kept vs eager, vs eager_kept, graphed
    unpatched vs eager, eager static vs eager); it runs each side once, as a real one would."""
    calls = []

    def timer(fn_a, fn_b, n, device):
        fn_a()
        fn_b()
        calls.append(n)
        return verdicts[len(calls) - 1] if len(calls) <= len(verdicts) else ratio("same")
    timer.calls = calls
    return timer


def run(tiny, workload, timer, **kw):
    model, ref = tiny
    return gs.graph_workload(model, ref, workload, {}, [], {}, 3, timer, **kw)


def test_decision_ships_only_where_faster_than_eager_and_the_shipped_set():
    fast = ratio("faster").to_dict()
    assert gs.decide(fast, fast) == ("graphs ship", True)
    for main, kept in ((fast, ratio("same").to_dict()), (ratio("same").to_dict(), fast),
                       (fast, ratio("slower").to_dict()), (ratio("slower").to_dict(), fast),
                       (fast, ratio("faster", meaningful=False).to_dict())):
        why, shipped = gs.decide(main, kept)
        assert shipped is False and why.startswith("eager:")
    assert "shipped set" in gs.decide(fast, ratio("slower").to_dict())[0]


def test_prefill_graph_is_captured_verified_timed_and_shipped(tiny, fakes):
    timer = timer_of(ratio("faster", 0.4), ratio("faster", 0.6), ratio("faster", 0.45))
    rec = run(tiny, PREFILL, timer, projected={"unpatched": 2.0, "kept": 2.5})
    assert rec["captured"] is True and rec["reason"] is None
    assert rec["pool_bytes"]["kept"] > 0 and rec["pool_bytes"]["unpatched"] > 0
    trials = rec["verification"]["trials"]
    assert len(trials) == gs.TRIALS and rec["verification"]["passed"]
    assert all(t["graph_vs_eager"] <= gs.GRAPH_TOL and t["error_graphed"] <= t["limit"]
               for t in trials)
    assert len(timer.calls) == 3  # graphed-patched vs eager, vs eager-patched, unpatched graphed
    med = rec["medians"]
    assert med["eager_ms"] == 2.0 and med["graphed_kept_ms"] == pytest.approx(0.8)
    assert med["eager_kept_ms"] == 2.0 and med["graphed_ms"] == pytest.approx(0.9)
    assert rec["decision"] == "graphs ship" and rec["shipped"] is True
    assert rec["measured_speedup"] == pytest.approx(2.5)
    assert rec["projected"] == {"unpatched": 2.0, "kept": 2.5}


def test_graph_not_faster_than_the_eager_shipped_set_stays_eager(tiny, fakes):
    rec = run(tiny, PREFILL, timer_of(ratio("faster"), ratio("same")))
    assert rec["verification"]["passed"] and rec["shipped"] is False
    assert "eager shipped set" in rec["decision"]


def test_capture_failure_falls_back_to_eager_with_one_line_reason(tiny, fakes):
    fakes(prefill=fake_graphs.FailingPrefill)
    timer = timer_of()
    rec = run(tiny, PREFILL, timer)
    assert rec["captured"] is False and rec["shipped"] is False
    assert rec["reason"] == "aten::nonzero synchronises the host during capture"
    assert "\n" not in rec["decision"] and rec["reason"] in rec["decision"]
    assert timer.calls == []  # nothing timed for a graph that does not exist


def test_stale_input_graph_fails_verification(tiny, fakes):
    fakes(prefill=fake_graphs.StalePrefill)
    timer = timer_of(ratio("faster"), ratio("faster"))
    rec = run(tiny, PREFILL, timer)
    assert rec["verification"]["passed"] is False and rec["shipped"] is False
    trials = rec["verification"]["trials"]
    assert all(t["graph_vs_eager"] > gs.GRAPH_TOL for t in trials)
    assert all(t["error_graphed"] > t["limit"] for t in trials)  # the fp32 rule catches it too
    assert timer.calls == []


def test_decode_steps_at_successive_positions_and_records_static_eager(tiny, fakes):
    timer = timer_of(ratio("faster"), ratio("faster"), ratio("faster"), ratio("same"))
    rec = run(tiny, DECODE, timer)
    trials = rec["verification"]["trials"]
    assert [t["position"] for t in trials] == [DECODE.seq + i for i in range(gs.TRIALS)]
    assert rec["verification"]["passed"]
    assert len(timer.calls) == 4 and rec["medians"]["eager_static_ms"] == 2.0
    assert rec["shipped"] is True


def test_stale_position_decoder_fails_verification(tiny, fakes):
    fakes(decoder=fake_graphs.StaleDecoder)
    rec = run(tiny, DECODE, timer_of(ratio("faster"), ratio("faster")))
    trials = rec["verification"]["trials"]
    assert trials[0]["passed"]  # the first step is at the prompt's position: right by luck
    assert not all(t["passed"] for t in trials[1:])
    assert rec["verification"]["passed"] is False and rec["shipped"] is False


def _integration(tmp_path, workloads):
    write_json(tmp_path / "integration.json", {"stage": "integrate", "families": [],
               "workloads": {w.key: {"workload": w.to_dict(), "kept": [], "cases": {}}
                             for w in workloads}})


def test_stage_on_the_cpu_records_why_it_skipped(tmp_path):
    from profiling.loader import resolve

    _integration(tmp_path, [PREFILL])
    gs.graphs_stage(tmp_path, resolve("tiny-llama"), [PREFILL], {"accepted": {}}, print, 3)
    integ = read_json(tmp_path / "integration.json", "integration")
    assert integ["workloads"][PREFILL.key]["graphs"] == {"skipped": gs.NO_GPU}


def test_stage_writes_records_and_a_failing_workload_does_not_end_the_run(tmp_path, fakes,
                                                                        monkeypatch):
    from profiling.loader import resolve

    monkeypatch.setattr(gs, "can_graph", lambda device: True)
    real = gs.graph_workload

    def flaky(model, ref, workload, *args, **kw):
        if workload.mode == "decode":
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing\n"
                               "  more lines of traceback")
        return real(model, ref, workload, *args, **kw)
    monkeypatch.setattr(gs, "graph_workload", flaky)
    write_json(tmp_path / "projection.json", {"kernel_speedups": {}, "families": [],
               "workloads": {PREFILL.key: {"amdahl": 1.0, "replay": 1.0, "patterns": [],
                                           "graphs": {"unpatched": 3.0, "kept": 3.0}}}})
    _integration(tmp_path, [PREFILL, DECODE])
    gs.graphs_stage(tmp_path, resolve("tiny-llama"), [PREFILL, DECODE], {"accepted": {}},
                    lambda _: None, 3, timer=timer_of(ratio("faster"), ratio("faster")))
    integ = read_json(tmp_path / "integration.json", "integration")
    pre, dec = (integ["workloads"][w.key]["graphs"] for w in (PREFILL, DECODE))
    assert pre["shipped"] is True and pre["projected"] == {"unpatched": 3.0, "kept": 3.0}
    assert dec["shipped"] is False and dec["captured"] is False
    assert dec["error"] == "RuntimeError: CUDA error: operation not permitted when stream is " \
                           "capturing"

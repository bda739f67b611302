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


def test_replay_may_differ_from_eager_by_the_dtypes_own_rounding_not_more():
    """Phi-3-mini b8 s1024 bf16 on the H200: the replay 0.034 from eager, the unpatched model
    0.053 from fp32, the replay 0.049 from fp32; that is a rounding of its own and passes. A
    stale replay (the logits' own scale off) fails, and an fp32 model keeps GRAPH_TOL."""
    phi3 = gs.trial_verdict(0.0340, 0.0494, 0.0527)
    assert phi3["passed"] and phi3["graph_limit"] == 0.0527
    assert not gs.trial_verdict(0.9, 0.9, 0.0527)["passed"]
    assert not gs.trial_verdict(0.06, 0.05, 0.0527)["passed"]  # beyond the dtype's own error
    assert not gs.trial_verdict(0.034, 0.09, 0.0527)["passed"]  # the fp32 rule still holds
    fp32 = gs.trial_verdict(2e-3, 1e-7, 1e-7)
    assert fp32["passed"] and fp32["graph_limit"] == gs.GRAPH_TOL
    assert not gs.trial_verdict(2e-2, 1e-7, 1e-7)["passed"]


def test_stale_input_graph_fails_verification(tiny, fakes):
    fakes(prefill=fake_graphs.StalePrefill)
    timer = timer_of(ratio("faster"), ratio("faster"))
    rec = run(tiny, PREFILL, timer)
    assert rec["verification"]["passed"] is False and rec["shipped"] is False
    trials = rec["verification"]["trials"]
    assert all(t["graph_vs_eager"] > t["graph_limit"] >= gs.GRAPH_TOL for t in trials)
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


# the graph's own set: the eager shipped set or the integrable one ---------------------------

def test_integrable_set_adds_the_checked_families_rolled_back_in_eager_but_no_rival():
    rec = {"kept": ["rmsnorm"], "check": {"kept": ["rmsnorm", "matmul_epilogue", "add_rmsnorm"]}}
    assert gs.integrable_set(rec) == ["rmsnorm", "matmul_epilogue", "add_rmsnorm"]
    # gated_act shipped in place of matmul_epilogue: both patch one MLP, only one goes in
    rec = {"kept": ["gated_act"], "check": {"kept": ["rope", "matmul_epilogue"]}}
    assert gs.integrable_set(rec) == ["gated_act", "rope"]
    assert gs.integrable_set({"kept": []}) == []


def test_graph_takes_the_integrable_set_where_its_graph_is_faster(tiny, fakes):
    # integrable graph vs kept graph first, then the three timings of the chosen graph
    timer = timer_of(ratio("faster", 0.8), ratio("faster"), ratio("faster"), ratio("faster"))
    rec = run(tiny, PREFILL, timer, integrable=["rmsnorm"])
    sets = rec["sets"]
    assert sets["chosen"] == "integrable" and rec["families"] == ["rmsnorm"]
    assert rec["kept"] == [] and sets["kept"]["families"] == []
    assert sets["integrable"]["families"] == ["rmsnorm"] and sets["integrable"]["captured"]
    assert sets["kept"]["graphed_ms"] == 2.0
    assert sets["integrable"]["graphed_ms"] == pytest.approx(1.6)
    assert sets["integrable_vs_kept"]["estimate"] == 0.8 and "faster" in sets["why"]
    assert len(timer.calls) == 4 and rec["shipped"] is True
    assert rec["verification"]["passed"] and len(rec["verification"]["trials"]) == gs.TRIALS


@pytest.mark.parametrize("verdict", ["same", "slower"])
def test_graph_keeps_the_eager_set_unless_the_integrable_one_is_faster(tiny, fakes, verdict):
    timer = timer_of(ratio(verdict), ratio("faster"), ratio("faster"), ratio("faster"))
    rec = run(tiny, PREFILL, timer, integrable=["rmsnorm"])
    assert rec["sets"]["chosen"] == "kept" and rec["families"] == []
    assert verdict in rec["sets"]["why"] and len(timer.calls) == 4


def test_same_sets_cost_no_extra_capture_or_timing(tiny, fakes):
    timer = timer_of(ratio("faster"), ratio("faster"), ratio("faster"))
    rec = run(tiny, PREFILL, timer, integrable=[])
    assert "sets" not in rec and len(timer.calls) == 3 and rec["families"] == []


def test_integrable_capture_failure_keeps_the_eager_set_with_its_reason(tiny, fakes,
                                                                        monkeypatch):
    monkeypatch.setattr(fake_graphs.ThirdFails, "made", 0)
    fakes(prefill=fake_graphs.ThirdFails)
    timer = timer_of(ratio("faster"), ratio("faster"), ratio("faster"))
    rec = run(tiny, PREFILL, timer, integrable=["rmsnorm"])
    sets = rec["sets"]
    assert sets["chosen"] == "kept" and sets["integrable"]["captured"] is False
    assert "aten::item" in sets["why"] and rec["shipped"] is True and len(timer.calls) == 3


# programmatic dependent launch: captured again with it, kept only where faster -------------

@pytest.fixture
def pdl_here(monkeypatch):
    """PDL as on a Hopper GPU: available, and `enabled` turning it on inside the capture."""
    from codegen import launch, pdl

    monkeypatch.setattr(launch, "pdl_hardware_reason", lambda: None)
    monkeypatch.delenv(pdl.NO_PDL_ENV, raising=False)
    monkeypatch.delenv(pdl.PREFETCH_ENV, raising=False)
    return pdl


def test_pdl_is_off_without_an_extra_capture_where_it_cannot_run(tiny, fakes):
    timer = timer_of(ratio("faster"), ratio("faster"), ratio("faster"))
    rec = run(tiny, PREFILL, timer)
    assert rec["pdl"]["on"] is False and rec["pdl"]["tried"] is False
    assert rec["pdl"]["why"].startswith("off: ") and "interpreter" in rec["pdl"]["why"]
    assert len(timer.calls) == 3  # no PDL timing


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_pdl_graph_is_kept_where_the_paired_timing_says_faster(tiny, fakes, pdl_here, mode):
    workload = PREFILL if mode == "prefill" else DECODE
    # PDL graph vs plain graph first, then the timings of the graph kept
    timer = timer_of(ratio("faster", 0.9), ratio("faster"), ratio("faster"), ratio("faster"),
                     ratio("faster"))
    seen = []
    real_time = gs._Sides.time

    def time(sides, timer, pairs):
        seen.append(sides.graph_kept)
        return real_time(sides, timer, pairs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gs._Sides, "time", time)
        rec = run(tiny, workload, timer)
    p = rec["pdl"]
    assert p["on"] is True and p["tried"] and p["captured"] and "faster" in p["why"]
    assert p["prefetch"] is False  # the weight streamers' L2 prefetch is opt-in
    assert p["off_ms"] == 2.0 and p["on_ms"] == pytest.approx(1.8)
    assert p["on_vs_off"]["estimate"] == 0.9 and p["on_vs_off"]["pairs"] == 4
    assert seen[0].pdl is True  # the later timings use the graph captured with PDL on
    assert rec["verification"]["passed"] and rec["shipped"] is True
    assert pdl_here.STATE.on is False  # only inside the capture


@pytest.mark.parametrize("verdict", ["same", "slower"])
def test_pdl_stays_off_unless_faster(tiny, fakes, pdl_here, verdict):
    timer = timer_of(ratio(verdict), ratio("faster"), ratio("faster"), ratio("faster"))
    rec = run(tiny, PREFILL, timer)
    p = rec["pdl"]
    assert p["on"] is False and p["tried"] and verdict in p["why"]
    assert p["off_ms"] == 2.0 and p["on_ms"] is not None and len(timer.calls) == 4


def test_the_prefetch_opted_in_rides_with_pdl_and_says_so(tiny, fakes, pdl_here, monkeypatch):
    monkeypatch.setenv(pdl_here.PREFETCH_ENV, "1")
    timer = timer_of(ratio("faster", 0.9), ratio("faster"), ratio("faster"), ratio("faster"))
    rec = run(tiny, PREFILL, timer)
    assert rec["pdl"]["tried"] is True and rec["pdl"]["prefetch"] is True


def test_pdl_forced_off_by_the_environment(tiny, fakes, pdl_here, monkeypatch):
    monkeypatch.setenv(pdl_here.NO_PDL_ENV, "1")
    timer = timer_of(ratio("faster"), ratio("faster"), ratio("faster"))
    rec = run(tiny, PREFILL, timer)
    assert rec["pdl"]["tried"] is False and pdl_here.NO_PDL_ENV in rec["pdl"]["why"]
    assert len(timer.calls) == 3


def test_pdl_capture_failure_keeps_the_plain_graph(tiny, fakes, pdl_here, monkeypatch):
    monkeypatch.setattr(fake_graphs.ThirdFails, "made", 0)
    fakes(prefill=fake_graphs.ThirdFails)  # the third capture is the PDL one
    timer = timer_of(ratio("faster"), ratio("faster"), ratio("faster"))
    rec = run(tiny, PREFILL, timer)
    assert rec["pdl"]["on"] is False and rec["pdl"]["captured"] is False
    assert "aten::item" in rec["pdl"]["why"] and rec["shipped"] is True
    assert len(timer.calls) == 3


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


def test_a_cut_in_a_later_workload_keeps_the_records_made_before_it(tmp_path, fakes,
                                                                    monkeypatch):
    """Stopped (Ctrl-C, a time limit) while graphing decode, the stage has already written
    prefill's record, which `optimize --resume` then does not redo."""
    from profiling.loader import resolve

    monkeypatch.setattr(gs, "can_graph", lambda device: True)
    real = gs.graph_workload

    def cut(model, ref, workload, *args, **kw):
        if workload.mode == "decode":
            raise KeyboardInterrupt
        return real(model, ref, workload, *args, **kw)
    monkeypatch.setattr(gs, "graph_workload", cut)
    _integration(tmp_path, [PREFILL, DECODE])
    with pytest.raises(KeyboardInterrupt):
        gs.graphs_stage(tmp_path, resolve("tiny-llama"), [PREFILL, DECODE], {"accepted": {}},
                        lambda _: None, 3, timer=timer_of(ratio("faster")))
    integ = read_json(tmp_path / "integration.json", "integration")["workloads"]
    assert integ[PREFILL.key]["graphs"]["captured"] is True
    assert "graphs" not in integ[DECODE.key]


# the API ------------------------------------------------------------------------------------

def _run_dir(tmp_path, graphs: dict[str, dict]) -> None:
    write_json(tmp_path / "verification" / "summary.json", {"accepted": {}, "rejected": []})
    write_json(tmp_path / "integration.json", {"families": [], "workloads": {
        w.key: {"workload": w.to_dict(), "kept": [], "cases": {}, "graphs": graphs[w.key]}
        for w in (PREFILL, DECODE) if w.key in graphs}})


def test_api_replays_the_graph_for_its_shape_falls_through_otherwise_and_undo_frees(
        tiny, fakes, tmp_path):
    from pipeline.api import apply_kernels

    model, _ = tiny
    _run_dir(tmp_path, {PREFILL.key: {"shipped": True, "decision": "graphs ship"}})
    handle = apply_kernels(model, tmp_path, workload=PREFILL.key, graphs=True)
    graph = handle.graph
    assert isinstance(graph, fake_graphs.GraphedPrefill) and graph.shape == (2, 8)
    ids = torch.randint(0, model.config.vocab_size, (2, 8))
    other = torch.randint(0, model.config.vocab_size, (1, 5))
    with torch.no_grad():
        out = handle(ids)
        assert out is graph.out  # the graph's static buffer: replayed, not run eagerly
        assert torch.allclose(out, model(ids).logits, atol=1e-5)
        eager = handle(other)
        assert eager is not graph.out and eager.shape[:2] == (1, 5)
        assert torch.equal(eager, model(other).logits)
    handle.undo()
    assert graph.closed and handle.graph is None


def test_api_decode_handle_has_a_graphed_static_decoder(tiny, fakes, tmp_path):
    from pipeline.api import DECODE_HEADROOM, apply_kernels

    model, _ = tiny
    _run_dir(tmp_path, {DECODE.key: {"shipped": True}})
    with apply_kernels(model, tmp_path, workload=DECODE.key, graphs=True) as handle:
        dec = handle.decoder
        assert dec.graph is True and dec.max_len == DECODE.seq + DECODE_HEADROOM
        prompt = torch.randint(0, model.config.vocab_size, (1, DECODE.seq))
        new = dec.generate(prompt, 4)
        assert new.shape == (1, 4) and dec.position == DECODE.seq + 4
    assert dec.closed


@pytest.mark.parametrize("kept_on", [True, False])
def test_api_captures_with_pdl_where_the_graphs_stage_kept_it(tiny, fakes, tmp_path, pdl_here,
                                                              kept_on):
    from pipeline.api import apply_kernels

    model, _ = tiny
    why = "on: faster" if kept_on else "off: not faster"
    _run_dir(tmp_path, {DECODE.key: {"shipped": True, "pdl": {"on": kept_on, "why": why}},
                        PREFILL.key: {"shipped": True, "pdl": {"on": kept_on, "why": why}}})
    with apply_kernels(model, tmp_path, workload=DECODE.key, graphs=True) as handle:
        assert handle.decoder.pdl is kept_on
    with apply_kernels(model, tmp_path, workload=PREFILL.key, graphs=True) as handle:
        assert handle.graph.pdl is kept_on


def test_api_graphs_where_they_did_not_ship_is_a_one_line_error(tiny, fakes, tmp_path):
    from core.errors import UserError
    from pipeline.api import apply_kernels

    model, _ = tiny
    _run_dir(tmp_path, {PREFILL.key: {"skipped": gs.NO_GPU},
                        DECODE.key: {"shipped": False, "decision": "eager: capture failed "
                                     "(aten::item synchronises)"}})
    with pytest.raises(UserError, match=gs.NO_GPU) as e:
        apply_kernels(model, tmp_path, workload=PREFILL.key, graphs=True)
    assert "\n" not in str(e.value) and "graphs=False" in str(e.value)
    with pytest.raises(UserError, match="aten::item"):
        apply_kernels(model, tmp_path, workload=DECODE.key, graphs=True)
    with pytest.raises(UserError, match="needs a workload"):
        apply_kernels(model, tmp_path, graphs=True)
    assert not any("forward" in m.__dict__ for m in model.modules())
    # graphs=False: the kernels alone, as before, no graph
    handle = apply_kernels(model, tmp_path, workload=PREFILL.key)
    assert handle.graph is None and handle.decoder is None
    handle.undo()


def test_api_graph_set_is_the_set_the_graphs_stage_chose(tiny, tmp_path):
    from pipeline.api import apply_kernels

    model, _ = tiny
    _run_dir(tmp_path, {PREFILL.key: {"shipped": True, "families": ["rmsnorm"]}})
    with apply_kernels(model, tmp_path, workload=PREFILL.key, graph_set=True) as handle:
        assert handle.families == ["rmsnorm"] and handle.graph is None
    with apply_kernels(model, tmp_path, workload=PREFILL.key) as handle:
        assert handle.families == []  # the eager shipped set


# the report ---------------------------------------------------------------------------------

def _brief(est, low, high):
    return {"estimate": est, "ci_low": low, "ci_high": high, "verdict": "faster",
            "meaningful": True, "reason": None, "pairs": 30}


def test_report_block_shows_timings_decision_projection_pool_and_kernel_counts():
    from pipeline import report_plots as rp

    row = {"pattern": "host: CUDA graph capture", "share": 0.85, "replay_gain": 5.1,
           "graph_with_kernels_gain": 6.2, "why": "launch-bound pass: GPU busy 15% of wall",
           "note": None}
    g = {"captured": True, "reason": None, "decision": "graphs ship", "shipped": True,
         "medians": {"eager_ms": 18.9, "graphed_ms": 2.91, "eager_kept_ms": 12.0,
                     "graphed_kept_ms": 2.5},
         "graphed_vs_eager": _brief(2.5 / 18.9, 0.12, 0.14),
         "graphed_vs_eager_kept": _brief(2.5 / 12.0, 0.2, 0.22),
         "graphed_unpatched_vs_eager": _brief(2.91 / 18.9, 0.15, 0.16),
         "projected": {"unpatched": 6.0, "kept": 7.0}, "measured_speedup": 18.9 / 2.5,
         "verification": {"trials": [{"passed": True}] * 3, "passed": True},
         "pool_bytes": {"kept": 3 * 2**20, "unpatched": 2 * 2**20},
         "kernels_per_pass": {"unpatched": 700, "kept": 420, "graphed_unpatched": 750,
                              "graphed": 380},
         "families": ["rmsnorm", "add_rmsnorm"],
         "sets": {"kept": {"families": ["rmsnorm"], "graphed_ms": 2.75, "kernels_per_pass": 600},
                  "integrable": {"families": ["rmsnorm", "add_rmsnorm"], "graphed_ms": 2.5,
                                 "kernels_per_pass": 380},
                  "chosen": "integrable", "why": "the integrable set: its graph is faster"}}
    md = rp.to_markdown(rp.graphs_blocks({"graph_row": row, "graphs": g}))
    for text in ("share 85.0%", "5.100x", "6.200x", "GPU busy 15%", "18.900 ms", "2.910 ms",
                 "12.000 ms", "2.500 ms", "graphs ship", "6.000x / 7.000x", "7.560x",
                 "3/3 trials passed", "kept 3.0 MiB / unpatched 2.0 MiB", "700 -> 420",
                 "750 -> 380", "Kernels in the graph: rmsnorm, add_rmsnorm", "2.750 ms",
                 "its graph is faster"):
        assert text in md, text
    failed = rp.to_markdown(rp.graphs_blocks({"graph_row": None, "graphs": {
        "captured": False, "reason": "aten::item synchronises", "decision": "eager"}}))
    assert "Not captured (aten::item synchronises)" in failed and "ms" not in failed
    skipped = rp.to_markdown(rp.graphs_blocks({"graph_row": None,
                                               "graphs": {"skipped": gs.NO_GPU}}))
    assert gs.NO_GPU in skipped
    assert rp.graphs_blocks({"graph_row": None, "graphs": None}) == []


def test_report_reads_the_graph_projection_as_pass_times():
    from pipeline import report_plots as rp

    g = {"medians": {"graphed_ms": 2.683, "graphed_kept_ms": 1.881},
         "projected_for_kept": {"unpatched_pass_us": 2529.0, "kept_pass_us": 1793.0,
                                "basis": "the step over a static KV cache"}}
    rows = dict(rp.pass_time_rows(g))
    kept = rows["graphed pass, kernels + graph: projected (frozen) / measured"]
    assert "1.793 ms / 1.881 ms (4.7% apart" in kept and "static KV cache" in kept
    assert "(5.7% apart" in rows["graphed pass, unpatched: projected (frozen) / measured"]
    assert rp.pass_time_rows({"medians": {}, "projected": {}}) == []
    # with the eager median beside them, the frozen pass time reads as a speedup whose error
    # is the pass time's: 13.5 / 1.793 against 13.5 / 1.881
    g["medians"]["eager_ms"] = 13.5
    both = dict(rp.pass_time_rows(g))["kernels + graph over the eager timed here: projected "
                                      "/ measured"]
    assert both.startswith("7.529x / 7.177x")


def test_a_decode_only_run_prefills_generate_on_the_unpatched_model(tiny, tmp_path):
    """Every workload patched is a decode step: `generate` runs the prompt's pass on a twin
    over the same weights without the patches (they would only decline there) and the steps
    on the patched model; the tokens are transformers'. A run with a prefill workload
    prefills on the patched model."""
    from pipeline.api import apply_kernels

    model, _ = tiny
    write_json(tmp_path / "verification" / "summary.json", {"accepted": {}, "rejected": []})

    def integration(*workloads):
        write_json(tmp_path / "integration.json", {"families": ["rmsnorm"], "workloads": {
            w.key: {"workload": w.to_dict(), "kept": ["rmsnorm"], "cases": {}}
            for w in workloads}})

    integration(DECODE)
    ids = torch.randint(3, model.config.vocab_size, (1, 6))
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=3, do_sample=False)
    with apply_kernels(model, tmp_path, workload=DECODE.key) as handle:
        twin = handle.prefill_model
        assert twin is not None and twin is not model
        assert twin.model.norm.weight is model.model.norm.weight  # no weight copied
        assert "forward" in vars(model.model.norm) and "forward" not in vars(twin.model.norm)
        seen = []
        hooks = [m.register_forward_pre_hook(lambda mod, args, kw, name=name: seen.append(
            (name, kw["input_ids"].shape[1] if "input_ids" in kw else args[0].shape[1])),
            with_kwargs=True) for name, m in (("twin", twin), ("patched", model))]
        with torch.no_grad():
            got = handle.generate(ids, max_new_tokens=3, do_sample=False)
        for h in hooks:
            h.remove()
        assert torch.equal(got, want)
        assert seen == [("twin", 6), ("patched", 1), ("patched", 1)]
    assert handle.prefill_model is None
    integration(DECODE, PREFILL)
    with apply_kernels(model, tmp_path) as handle:
        assert handle.prefill_model is None

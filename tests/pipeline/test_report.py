"""The report stage on synthetic artifacts: profile+ranking only, a full GPU run (one family
accepted, one rejected, a rollback on one of two workloads), and a CPU run whose timings are
not meaningful."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from matplotlib.image import imread

from core.artifacts import read_json, write_json
from pipeline.report import write_report

PRE, DEC = "prefill-b8-s1024-bf16", "decode-b1-s128-bf16"
HEADINGS = ("Workload", "Environment", "Comparison", "Correctness", "Measurements", "Decision")
RMS_KEY = "rmsnorm/bfloat16-hidden64-rows8192-abc123"
GATED_KEY = "gated_act/bfloat16-inter172-rows8192-def456"


def timing(median, meaningful=True):
    return {"median_ms": median, "p20_ms": median * 0.98, "p80_ms": median * 1.02,
            "iqr_ms": median * 0.04, "min_ms": median * 0.95, "max_ms": median * 1.1, "n": 100,
            "meaningful": meaningful,
            "reason": None if meaningful else "CPU / Triton interpreter: not a GPU timing",
            "method": "cuda events, L2 flushed per repetition" if meaningful
            else "host perf_counter", "gbps": 2500.0 if meaningful else None, "tflops": None}


def ratio(estimate, lo, hi, verdict, decision, meaningful=True):
    return {"ratios": [estimate] * 30, "statistic": "median", "estimate": estimate,
            "ci_low": lo, "ci_high": hi, "confidence": 0.95, "verdict": verdict,
            "meaningful": meaningful,
            "reason": None if meaningful else "CPU / Triton interpreter: not a GPU timing",
            "decision": decision}


def profile_workload(key, mode, batch, seq, busy, device="cuda"):
    gpu = device == "cuda"
    shares = {"rmsnorm": 0.15, "swiglu": 0.05, "linear": 0.45, "lm_head": 0.12}
    rest = 1 - sum(shares.values())
    return {
        "key": key, "workload": {"batch": batch, "seq": seq, "dtype": "bfloat16",
                                 "device": device, "mode": mode},
        "time_basis": "device" if gpu else "cpu",
        "wall": {"median_ms": 40.0, "p10_ms": 39.0, "p90_ms": 42.5, "min_ms": 38.0,
                 "max_ms": 45.0, "reps": 20},
        "profiled_ms_per_step": 46.0, "gpu_busy_share": busy if gpu else None,
        "gpu_idle_share": 1 - busy if gpu else None, "rest_share": rest,
        "by_op": [{"op": "aten::mm", "calls": 10, "time_us": 2e4, "share": 0.5, "cpu_us": 50.0}],
        "ops": [{"name": "aten::linear", "module": "lm_head", "module_class": "Linear",
                 "share": shares["lm_head"], "time_us": 4800.0},
                {"name": "aten::linear", "module": "model.layers.0.mlp.up_proj",
                 "module_class": "Linear", "share": shares["linear"], "time_us": 18000.0}],
    }


def ranking_workload(key, mode, batch, seq, busy, device="cuda"):
    gpu = device == "cuda"
    rows = [
        {"pattern": "rmsnorm", "family": "rmsnorm", "share": 0.15, "attainable_speedup": 3.0,
         "amdahl_gain": 1.111, "replay_gain": 1.09 if gpu else None},
        {"pattern": "swiglu_mlp", "family": "gated_act", "share": 0.05,
         "attainable_speedup": 2.5, "amdahl_gain": 1.026, "replay_gain": 1.02 if gpu else None},
        {"pattern": "linear", "family": None, "share": 0.556, "attainable_speedup": 1.0,
         "amdahl_gain": 1.0, "replay_gain": None},
    ] + [{"pattern": f"op:aten::op{i} @ LlamaModel", "family": None, "share": 0.001,
          "attainable_speedup": 1.0, "amdahl_gain": 1.0, "replay_gain": None}
         for i in range(14)]
    for r in rows:
        r.update({"occurrences": 4, "modules": ["model.layers.*"], "time_us": r["share"] * 4e4,
                  "host_us": 100.0, "launches": 8, "min_bytes": 1 << 20, "flops": 0,
                  "roofline_us": 10.0, "target_us": 10.0, "target_source": "roofline",
                  "achieved_GBps": 800.0, "host_share": 0.01})
    return {"key": key, "workload": {"batch": batch, "seq": seq, "dtype": "bfloat16",
                                     "device": device, "mode": mode},
            "wall_ms": 40.0, "time_basis": "device" if gpu else "cpu",
            "gpu_busy_share": busy if gpu else None,
            "launch_bound": gpu and busy < 0.5,
            "regime": "CPU profile: shares are host time" if not gpu else
            "launch-bound: host time" if busy < 0.5 else "device-bound",
            "ranked_by": "replay_gain" if gpu else "amdahl_gain", "rows": rows,
            "cumulative": [{"n": 1, "pattern": "rmsnorm", "amdahl": 1.111,
                            "replay": 1.09 if gpu else None},
                           {"n": 2, "pattern": "swiglu_mlp", "amdahl": 1.14,
                            "replay": 1.11 if gpu else None}],
            "ceiling_amdahl": 1.14, "ceiling_replay": 1.11 if gpu else None}


def write_profile_and_ranking(run, device="cuda"):
    specs = [(PRE, "prefill", 8, 1024, 0.9), (DEC, "decode", 1, 128, 0.2)]
    env = {"gpu": "NVIDIA H200" if device == "cuda" else None, "driver": "580.1",
           "torch": "2.11", "triton": "3.6.0", "transformers": "5.1", "cuda": "13.0",
           "python": "3.12", "cpu": "x86_64", "device": device}
    ceil = {"device": "NVIDIA H200", "bandwidth_GBps": 4100.0, "matmul_TFLOPs": 760.0,
            "matmul_dtype": "bfloat16", "launch_us": 4.5, "method": "copy of 1 GiB",
            "measured_at": "2026-01-01T00:00:00Z"}
    write_json(run / "profile.json", {
        "stage": "profile", "environment": env, "ceilings": ceil,
        "model": {"id": "tiny-llama", "source": "zoo", "weights": "random",
                  "model_type": "llama", "num_layers": 2, "hidden_size": 64},
        "workloads": [profile_workload(*s, device=device) for s in specs]})
    write_json(run / "ranking.json", {"stage": "rank", "model": "tiny-llama", "ceilings": ceil,
                                      "workloads": [ranking_workload(*s, device=device)
                                                    for s in specs]})


def write_optimize_artifacts(run, gpu=True):
    rms_src = str(run / "candidates/rmsnorm/c/BLOCK1024/kernel.py")
    gated_src = str(run / "candidates/gated_act/c/BLOCK256/kernel.py")
    rec_ok = run / "verification/rmsnorm/c__BLOCK1024.json"
    rec_bad = run / "verification/gated_act/c__BLOCK256.json"
    tol = {"bfloat16": {"atol": 1e-3, "rtol": 1.6e-2, "why": "2 ulps"}}
    cases = [{"label": "c0", "origin": "given", "case": {}},
             {"label": "c0.e0", "origin": "edge of c0", "case": {}}]
    for path, fam, verdict, reasons in (
            (rec_ok, "rmsnorm", "accepted", []),
            (rec_bad, "gated_act", "rejected", ["numerics in c0: max rel error 0.31 > rtol"])):
        write_json(path, {"candidate": path.stem, "family": fam, "verdict": verdict,
                          "checks": [{"name": "numerics", "case": "c0", "passed": not reasons,
                                      "detail": "ok"}], "errors": [], "reasons": reasons,
                          "timing": None, "seeds": {"master": 0, "trials": 3}, "cases": cases,
                          "source_sha256": "ab" * 32, "device": "cuda" if gpu else "cpu",
                          "environment": {"triton": "3.6.0", "torch": "2.11",
                                          "tolerances": tol}, "duration_s": 3.0})
    rms_case = {"rows": 8192, "hidden": 64, "dtype": "bfloat16"}
    write_json(run / "candidates/search_log.json", {"searches": [
        {"family": "rmsnorm", "case": rms_case, "case_key": RMS_KEY.split("/")[1],
         "device": "cuda", "baseline": timing(0.034, gpu),
         "candidates": [{"path": rms_src, "config": {"BLOCK": 1024}, "origin": "generated",
                         "screen": "pass", "timing": timing(0.017, gpu), "decision": "best"},
                        {"path": "x", "config": {"BLOCK": 64}, "origin": "generated",
                         "screen": "wrong result", "decision": "discarded: wrong result"}],
         "order": [rms_src]},
        {"family": "gated_act", "case": {"rows": 8192, "inter": 172, "dtype": "bfloat16"},
         "case_key": GATED_KEY.split("/")[1], "device": "cuda", "baseline": timing(0.05, gpu),
         "candidates": [{"path": gated_src, "config": {"BLOCK": 256}, "origin": "generated",
                         "screen": "pass", "timing": timing(0.04, gpu), "decision": "best"}],
         "order": [gated_src]}]})
    write_json(run / "verification/summary.json", {
        "accepted": {RMS_KEY: {"family": "rmsnorm", "case": rms_case, "source": rms_src,
                               "config": {"BLOCK": 1024}, "kernel": timing(0.017, gpu),
                               "baseline": timing(0.034, gpu), "record": str(rec_ok),
                               "speedup": 0.034 / 0.017}},
        "rejected": [{"key": GATED_KEY, "family": "gated_act",
                      "tried": [{"candidate": gated_src, "verdict": "rejected",
                                 "reasons": ["numerics in c0: max rel error 0.31 > rtol"],
                                 "record": str(rec_bad)}],
                      "reason": "no candidate passed verification"}]})
    note = None if gpu else "CPU/interpreter run: kernel times are not GPU timings"
    write_json(run / "projection.json", {
        "stage": "projection", "kernel_speedups": {"rmsnorm": 2.0} if gpu else {},
        "families": ["rmsnorm", "gated_act"],
        "workloads": {PRE: {"amdahl": 1.081 if gpu else 1.0, "replay": 1.07 if gpu else None,
                            "patterns": ["rmsnorm"] if gpu else [], "note": note},
                      DEC: {"amdahl": 1.02 if gpu else 1.0, "replay": 1.005 if gpu else None,
                            "patterns": ["rmsnorm"] if gpu else [], "note": note}}})
    trials = [{"seed": 100 + i, "error_unpatched": 0.02, "error_patched": 0.021,
               "limit": 0.03, "passed": True} for i in range(3)]
    check = {"set": {"families": ["rmsnorm"], "trials": trials, "passed": True},
             "rejected": {}, "kept": ["rmsnorm"]}
    effect = {"remaining_occurrences": {"rmsnorm": 0}, "new_kernels": ["_rmsnorm_fwd"],
              "passed": True}
    if gpu:
        pre = {"per_family": {"rmsnorm": ratio(0.93, 0.92, 0.94, "faster", "kept")},
               "combined": ratio(0.93, 0.92, 0.94, "faster", "kept"), "kept": ["rmsnorm"]}
        dec = {"per_family": {"rmsnorm": ratio(1.03, 1.01, 1.05, "slower", "rolled back")},
               "combined": None, "kept": []}
    else:
        d = "kept (timing not meaningful here: no decision on speed)"
        pre = dec = {"per_family": {"rmsnorm": ratio(0.77, 0.7, 0.8, "faster", d, False)},
                     "combined": ratio(0.77, 0.7, 0.8, "faster", "kept", False),
                     "kept": ["rmsnorm"]}
    write_json(run / "integration.json", {
        "stage": "integrate", "families": ["rmsnorm"], "environment": {},
        "workloads": {k: {"workload": {}, "check": check, "patch_effect": effect, **v}
                      for k, v in ((PRE, pre), (DEC, dec))}})


def section(md: str, key: str) -> str:
    start = md.index(f"## Workload {key}")
    nxt = md.find("\n## ", start + 5)
    return md[start:nxt if nxt > 0 else None]


def assert_png(path):
    img = imread(path)
    assert img.ndim == 3 and img.shape[0] > 50 and img.shape[1] > 50


def test_profile_and_ranking_only(tmp_path):
    write_profile_and_ranking(tmp_path)
    out = write_report(tmp_path)
    for k in ("markdown", "html", "json"):
        assert out[k].exists()
    assert out["acceptance"] == []
    names = sorted(p.name for p in out["plots"])
    assert names == sorted([f"share_{PRE}.png", f"share_{DEC}.png", f"cumulative_{PRE}.png",
                            f"cumulative_{DEC}.png"])
    for p in out["plots"]:
        assert_png(p)
    md = out["markdown"].read_text()
    assert "Only profiling and ranking have run" in md
    assert "not measured" in md and "ceiling 1.140x" in md
    assert "Launch-bound" in section(md, DEC) and "Launch-bound" not in section(md, PRE)
    assert "logits_to_keep=1" in section(md, PRE)  # lm_head is 12% of the prefill
    assert "logits_to_keep=1" not in section(md, DEC)  # decode: one position anyway
    data = read_json(out["json"])
    for w in data["workloads"]:  # the share rows plus the rest row sum to 1
        assert sum(r["share"] for r in w["shares"]) == pytest.approx(1.0)
        assert w["shares"][-1]["label"] == "rest: host/launch/idle"
    html = out["html"].read_text()
    assert f'<img src="plots/share_{PRE}.png"' in html and "<table>" in html
    assert "<style>" in html and "<script" not in html


def test_the_floor_pass_is_said_beside_the_ceiling_of_kernel_work(tmp_path):
    write_profile_and_ranking(tmp_path)
    ranking = read_json(tmp_path / "ranking.json")
    ranking["workloads"][0]["floor"] = {"wall_ms": 25.0, "kernel_ms": 24.2, "over_wall": 1.6}
    write_json(tmp_path / "ranking.json", ranking)
    md = write_report(tmp_path)["markdown"].read_text()
    pre, dec = section(md, PRE), section(md, DEC)
    assert re.search(r"Floor: the pass's GEMMs and attention alone.*25\.00 ms \(kernels 24\.20\)"
                     r": at most 1\.60x over this pass's 40\.00 ms", pre)
    assert "Floor:" not in dec
    # after optimize, the terminal's final table gives it beside the measured speedup
    from pipeline.summary import optimize_rows

    write_optimize_artifacts(tmp_path, gpu=True)
    notes = {r[0]: r[-1] for r in optimize_rows(tmp_path)}
    assert "floor 1.600x (its GEMMs and attention alone)" in notes[PRE]
    assert "floor" not in notes.get(DEC, "")


@pytest.mark.parametrize("graphed, floor_x, near", [
    (1.53, 1.62, True),   # 5.9 % above the floor: fusion is done
    (1.40, 1.62, False),  # 15.7 % above it: more to fuse
    (None, 1.50, True),   # no graph shipped: the eager-patched pass against the floor
])
def test_a_pass_near_its_floor_is_told_to_look_at_the_gemms_not_fusion(graphed, floor_x, near):
    from pipeline.report import verdict

    w = {"key": PRE, "time_basis": "device", "launch_bound": False,
         "shipped": {"families": ["rmsnorm"], "speedup": 1.45, "ci": [1.43, 1.47]},
         "measured": {"meaningful": True}, "projected": {"replay": 1.46},
         "projection_error": {"replay": 0.007}, "floor": {"over_wall": floor_x},
         "graphs": {"shipped": True, "measured_speedup": graphed} if graphed else {}}
    line = verdict(w)
    best = graphed or 1.45
    assert ("not more fusion" in line) is near
    if near:
        assert f"within {floor_x / best - 1:.1%} of its floor ({floor_x:.3f}x" in line
    assert "not more fusion" not in verdict({**w, "floor": None})


def test_full_gpu_run(tmp_path):
    write_profile_and_ranking(tmp_path)
    write_optimize_artifacts(tmp_path, gpu=True)
    out = write_report(tmp_path)
    assert {p.name for p in out["plots"]} >= {"comparison.png", f"share_{DEC}.png"}
    for p in out["plots"]:
        assert_png(p)
    md = out["markdown"].read_text()
    # prefill: projected 1.081 (Amdahl) / 1.070 (replay) vs measured 1/0.93
    m = 1 / 0.93
    pre = section(md, PRE)
    for s in ("1.081x", "1.070x", f"{m:.3f}x", f"{abs(1.081 - m) / m:.1%}",
              f"{abs(1.07 - m) / m:.1%}", f"[{1 / 0.94:.3f}x, {1 / 0.92:.3f}x]"):
        assert s in pre, s
    # decode: rmsnorm alone measured 1/1.03, then rolled back; shipped is the baseline
    m = 1 / 1.03
    dec = section(md, DEC)
    for s in (f"{m:.3f}x", f"{abs(1.02 - m) / m:.1%}", f"{abs(1.005 - m) / m:.1%}",
              "rolled back", "Launch-bound", "nothing kept"):
        assert s in dec, s
    assert "Rollbacks: none." in pre and "Rollbacks: none." not in dec
    assert "attention" not in md  # nothing skipped in this run
    assert "no candidate passed verification" in md and "max rel error 0.31" in md
    data = read_json(out["json"])
    w = {x["key"]: x for x in data["workloads"]}
    assert w[PRE]["measured"]["speedup"] == pytest.approx(1 / 0.93)
    assert w[PRE]["projection_error"]["replay"] == pytest.approx(abs(1.07 - 1 / 0.93) * 0.93)
    assert w[PRE]["rollbacks"] == [] and w[DEC]["rollbacks"][0]["family"] == "rmsnorm"
    assert w[DEC]["shipped"]["speedup"] == 1.0
    assert sorted(p.name for p in out["acceptance"]) == ["gated_act.md", "rmsnorm.md"]
    for p in out["acceptance"]:
        text = p.read_text()
        labels = re.findall(r"^(\w+):", text, flags=re.MULTILINE)
        assert [x for x in labels if x in HEADINGS] == list(HEADINGS), p.name
    rms = (tmp_path / "acceptance/rmsnorm.md").read_text()
    assert "NVIDIA H200" in rms and "bfloat16 atol 0.001 rtol 0.016" in rms
    assert "2.000x" in rms and f"rolled back on {DEC}" in rms and f"kept on {PRE}" in rms
    gated = (tmp_path / "acceptance/gated_act.md").read_text()
    assert "rejected: " in gated and "max rel error 0.31" in gated
    html = out["html"].read_text()
    assert '<img src="plots/comparison.png"' in html and "Acceptance records" in html
    assert json.loads(out["json"].read_text())["schema_version"] == 1


def test_a_family_set_aside_before_integration_is_listed_but_not_as_a_rollback(tmp_path):
    """A family never patched in (slower at kernel level, or superseded by a rival replacing
    the same ops) is listed with its reason under its own heading, not under Rollbacks."""
    write_profile_and_ranking(tmp_path)
    write_optimize_artifacts(tmp_path, gpu=True)
    integ = read_json(tmp_path / "integration.json", "integration")
    why = {"attention": "not integrated: slower than the code it replaces at kernel level "
                        "(0.19x)",
           "gated_act": "superseded by matmul_epilogue, which replaces the same ops"}
    for w in integ["workloads"].values():
        w["skipped"] = why
    write_json(tmp_path / "integration.json", integ)
    out = write_report(tmp_path)
    data = read_json(out["json"])
    for w in data["workloads"]:
        assert w["set_aside"] == why
        assert not {"attention", "gated_act"} & {r["family"] for r in w["rollbacks"]}
    pre = section(out["markdown"].read_text(), PRE)
    aside = pre.split("Set aside before integration", 1)[1]
    assert "Rollbacks: none." in pre.split("Set aside before integration", 1)[0]
    for fam, reason in why.items():
        assert f"- {fam}: {reason}" in aside


def test_a_kept_family_that_missed_some_calls_is_said_in_the_report(tmp_path):
    """integrate.reach lists, per family, the cases the pass asked for that no accepted kernel
    covers: for a kept family the report says its kernel did not reach every call."""
    write_profile_and_ranking(tmp_path)
    write_optimize_artifacts(tmp_path, gpu=True)
    integ = read_json(tmp_path / "integration.json", "integration")
    missed = "bfloat16-hidden64-rows8192-packed"
    for w in integ["workloads"].values():
        w["declined"] = {"rmsnorm": [missed], "gated_act": ["not-kept"]}
    write_json(tmp_path / "integration.json", integ)
    out = write_report(tmp_path)
    data = read_json(out["json"])
    # a family the workload does not ship is not reported (the decode workload ships none)
    assert {w["key"]: w["declined"] for w in data["workloads"]} == {
        PRE: {"rmsnorm": [missed]}, DEC: {}}
    md = section(out["markdown"].read_text(), PRE)
    assert "rmsnorm did not reach every call" in md and missed in md
    assert "not-kept" not in md


def test_cpu_run_labels_timings_not_meaningful(tmp_path):
    write_profile_and_ranking(tmp_path, device="cpu")
    write_optimize_artifacts(tmp_path, gpu=False)
    out = write_report(tmp_path)
    md = out["markdown"].read_text()
    assert "not meaningful" in md and "CPU run" in md
    assert f"{1 / 0.77:.3f}x" not in md  # the CPU whole-model ratio is never a speedup
    assert "2.000x" not in md  # nor the CPU kernel micro-benchmark
    assert "Launch-bound" not in md  # no GPU, no launch-bound claim
    rms = (tmp_path / "acceptance/rmsnorm.md").read_text()
    assert "not meaningful" in rms and "2.000x" not in rms
    data = read_json(out["json"])
    for w in data["workloads"]:
        assert w["measured"]["speedup"] is None and w["projection_error"] is None
        assert w["measured"]["meaningful"] is False
    assert data["kernels"]["accepted"][0]["speedup"] is None
    # the verdict, first thing in the report: what ships, and that nothing is measured here
    head = md.split("## Verdict", 1)[1].split("##", 1)[0]
    for w in data["workloads"]:
        line = next(x for x in head.splitlines() if x.startswith(f"- {w['key']}:"))
        assert f"ships {', '.join(w['shipped']['families']) or 'nothing'};" in line
        # said once, not three ways ("measured: not meaningful", "projected: n/a", "no
        # speedup measured")
        assert "a CPU run (Triton interpreter): nothing is measured or projected as a " \
            "speedup; next: " in line
        assert "not meaningful" not in line and "n/a" not in line
        assert not re.search(r"\d\.\d{3}x", line), line
    # the first screen: verdict, the whole-model table, the kernels; then the rest
    assert md.index("## Verdict") < md.index("## Whole-model speedup per workload") \
        < md.index("## Kernels") < md.index("## Model and environment")
    assert "Measurement conditions" not in md  # no projection on the CPU to blame a machine for
    assert "-0.0%" not in md
    # the terminal summary projects and measures nothing, and says why in full
    from pipeline.summary import OPTIMIZE_COLUMNS, optimize_rows

    for row in optimize_rows(tmp_path):
        cells = dict(zip(OPTIMIZE_COLUMNS, row))
        assert {cells[c] for c in ("projected (replay)", "projected (Amdahl)", "measured",
                                   "95% CI")} == {"-"}
        # once: not again as "CPU / Triton interpreter: not a GPU timing"
        assert cells["note"].startswith("CPU/interpreter run: kernel times are not GPU timings")
        assert "not a GPU timing;" not in cells["note"] + ";", cells["note"]


def test_a_machine_running_at_another_speed_is_said_next_to_the_error(tmp_path):
    """The unpatched pass measured beside the patched one took 52 ms against the profile's 40:
    the report says the machine ran 30 % slower and that the projection assumes the profiled
    one; at 42 ms (within 10 %) it says nothing."""
    write_profile_and_ranking(tmp_path)
    write_optimize_artifacts(tmp_path, gpu=True)
    integ = read_json(tmp_path / "integration.json", "integration")
    said = {}
    for times in ([52.0, 51.0, 53.0], [41.0, 42.0, 43.5]):
        integ["workloads"][PRE]["combined"]["times_a_ms"] = times
        write_json(tmp_path / "integration.json", integ)
        out = write_report(tmp_path)
        data = {w["key"]: w for w in read_json(out["json"])["workloads"]}
        said[times[0]] = (data[PRE]["conditions"], section(out["markdown"].read_text(), PRE))
    note, md = said[52.0]
    assert "took 52.0 ms here (median of 3) against 40.0 ms when profiled (+30%)" in note
    assert "the machine's, not the model's" in md
    note, md = said[41.0]
    assert note is None and "the machine's, not the model's" not in md


def test_the_replay_at_the_timings_host_speed_is_shown_beside_the_error(tmp_path):
    """Where the timing's host took 1.2x the profile's time per unpatched pass, the verdict,
    the terminal's summary and the table give the kept set's replay at that speed (the verdict
    and the table with its error against the measured 1.075x, 1 / 0.93), beside the frozen
    projection's; at 1.03x (same host, within noise) they say nothing of it."""
    from pipeline.summary import optimize_rows

    write_profile_and_ranking(tmp_path)
    write_optimize_artifacts(tmp_path, gpu=True)
    integ = read_json(tmp_path / "integration.json", "integration")
    said = {}
    for drift in (1.2, 1.03):
        integ["workloads"][PRE]["projection_at_timing_host"] = {
            "families": ["rmsnorm"], "host_drift": drift, "profile_host_ms": 5.0,
            "timing_host_ms": 5.0 * drift, "replay": 1.1}
        write_json(tmp_path / "integration.json", integ)
        out = write_report(tmp_path)
        data = {w["key"]: w for w in read_json(out["json"])["workloads"]}
        notes = {r[0]: r[-1] for r in optimize_rows(tmp_path)}  # the terminal's table
        said[drift] = (data[PRE]["verdict"], section(out["markdown"].read_text(), PRE),
                       notes[PRE])
    verdict, md, note = said[1.2]
    err = f"{abs(1.1 - 1 / 0.93) * 0.93:.1%}"
    assert (f"1.100x at the timing's host speed (error {err}; the host took 1.20x the "
            f"profile's time)") in verdict
    assert (f"1.100x (error {err}): host 6.00 ms per unpatched pass at the timing against "
            f"5.00 at the profile (1.20x)") in md
    assert ("1.100x projected at the timing's host speed (the host took 1.20x the profile's "
            "time)") in note
    verdict, md, note = said[1.03]
    assert "timing's host speed" not in verdict and "host speed of the timing" not in md
    assert "timing's host speed" not in note


def test_a_set_that_leaves_the_pass_waiting_on_the_host_is_called_host_bound(tmp_path):
    """The shipped set's forward returns after 24 of its 25 ms, the unpatched one after 21 of
    31 ms: the report and the terminal summary say it is host-bound after patching and that
    faster kernels cannot help; returning after 12 of 20 ms, they do not; where the unpatched
    pass waited on the host too, the gain is said to come from fewer launches."""
    from pipeline.integrate import pass_bound
    from pipeline.summary import console, print_optimize

    write_profile_and_ranking(tmp_path)
    write_optimize_artifacts(tmp_path, gpu=True)
    integ = read_json(tmp_path / "integration.json", "integration")
    said = {}
    for patched_host, patched_wall, base_host in ((24.0, 25.0, 20.0), (12.0, 20.0, 20.0),
                                                  (11.0, 11.2, 30.0)):
        comb = integ["workloads"][PRE]["combined"]
        comb.update(times_a_ms=[31.0, 30.0, 32.0], host_a_ms=[base_host + 1, base_host, 30.0],
                    times_b_ms=[patched_wall] * 3, host_b_ms=[patched_host] * 3)
        comb["bound"] = pass_bound(comb)
        write_json(tmp_path / "integration.json", integ)
        out = write_report(tmp_path)
        with console.capture() as cap:
            print_optimize(tmp_path)
        said[patched_host] = (section(out["markdown"].read_text(), PRE), cap.get())
    md, terminal = said[24.0]
    assert ("Host-bound after patching: the forward returns to Python after 21.0 of its "
            "31.0 ms unpatched, 24.0 of 25.0 ms with all kept kernels" in md)
    assert "faster kernels cannot shorten this pass" in md
    assert "unpatched 21.0 / 31.0 ms, patched 24.0 / 25.0 ms" in md
    assert "host-bound after" in terminal
    md, terminal = said[12.0]
    assert "Host-bound after patching" not in md and "host-bound" not in terminal
    assert "patched 12.0 / 20.0 ms" in md
    md, terminal = said[11.0]  # batch 1: the unpatched pass waited on the host already
    assert "Host-bound before and after patching" in md and "not from faster kernels" in md


def test_the_report_shows_the_re_profiled_parts(tmp_path):
    write_profile_and_ranking(tmp_path)
    write_optimize_artifacts(tmp_path, gpu=True)
    integ = read_json(tmp_path / "integration.json", "integration")
    integ["workloads"][PRE]["combined"].update(times_a_ms=[40.0] * 3, times_b_ms=[37.0] * 3)
    integ["workloads"][PRE]["reprofile"] = {
        "families": ["rmsnorm"], "family_kernels": {"rmsnorm": ["_rmsnorm_fwd"]},
        "patched_us": {"_rmsnorm_fwd": 3500.0, "gemm": 30000.0},
        "unpatched_us": {"gemm": 29000.0, "x": 6000.0}}
    write_json(tmp_path / "integration.json", integ)
    md = write_report(tmp_path)["markdown"].read_text()
    pre = section(md, PRE)
    # rmsnorm's row: 0.15 x 40 ms profiled, projected at the frozen 2.000x, 3.5 ms re-profiled
    line = next(x for x in pre.splitlines() if x.startswith("| rmsnorm (_rmsnorm_fwd)"))
    assert "6.000 ms" in line and "3.000 ms" in line and "3.500 ms" in line
    assert "+0.500 ms" in line
    assert "kept the GPU busy 35.000 ms" in pre
    assert "took longer patched: gemm 29.000 ms -> 30.000 ms." in pre


def test_headroom_no_family_acts_on_is_listed_and_patch_memory_shown(tmp_path):
    """No silent headroom: a row 3x under its roofline with no family (here the LM head the
    matmul family declined, in a ranking written before `no_remedy` existed: filled from the
    rows) is listed with share and attainable speedup; rows at the roofline are not. The
    memory a kept patch holds (padded weights) is shown per family."""
    write_profile_and_ranking(tmp_path)
    write_optimize_artifacts(tmp_path, gpu=True)
    ranking = read_json(tmp_path / "ranking.json", "ranking")
    for w in ranking["workloads"]:
        w["rows"].append({**w["rows"][2], "pattern": "lm_head", "share": 0.12,
                          "attainable_speedup": 3.0,
                          "declined": {"family": "matmul", "reason": "test reason"}})
    ranking["workloads"][1]["no_remedy"] = []  # the ranking's own list wins where it has one
    write_json(tmp_path / "ranking.json", ranking)
    integ = read_json(tmp_path / "integration.json", "integration")
    integ["workloads"][PRE]["patch_memory"] = {"matmul": 77 * 2**20}
    write_json(tmp_path / "integration.json", integ)
    out = write_report(tmp_path)
    data = {w["key"]: w for w in read_json(out["json"])["workloads"]}
    assert [g["pattern"] for g in data[PRE]["no_remedy"]] == ["lm_head"]
    assert data[PRE]["no_remedy"][0]["why"] == "matmul: test reason"
    assert data[DEC]["no_remedy"] == []
    md = out["markdown"].read_text()
    pre, dec = section(md, PRE), section(md, DEC)
    assert "No remedy yet" in pre and "| lm_head | 12.0% | 3.000x | matmul: test reason |" in pre
    assert "No remedy yet" not in dec
    assert "matmul 77.0 MiB" in pre and "MiB" not in dec


def test_patch_memory_is_what_a_patch_holds_beyond_the_weights():
    """What the integrate stage records for the report: tiny-gpt2's two c_fc (64 -> 176 wide,
    padded) held as fp32 copies, weight and bias, by the matmul family; nothing for a
    family that builds no copies; the copy is as wide as the widest padded width searched
    (held_width: 256)."""
    import torch

    from codegen.matmul.reference import held_width
    from pipeline.patching import patch_memory
    from profiling.loader import build, resolve

    model = build(resolve("tiny-gpt2"), torch.float32, "cpu")
    width = held_width(176)
    assert width == 256
    assert patch_memory(model, ["matmul", "gelu"]) == {"matmul": 2 * (64 * width + width) * 4}
    assert not [n for n, m in model.named_modules() if "forward" in m.__dict__]  # undone


RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


@pytest.mark.parametrize("name, key, expect", [
    ("optimize-llama-3.2-1b-b8-s1024-run15", "prefill-b8-s1024-bf16",
     ["ships rmsnorm, rope, matmul_epilogue, kv_cache, add_rmsnorm", "measured 1.439x "
      "[1.425x, 1.450x]", "projected 1.501x (replay, error 4.3%)", "device-bound"]),
    ("optimize-qwen2.5-0.5b-b1-s128-run15", "decode-b1-s128-bf16",
     ["measured 1.419x [1.411x, 1.435x]", "projected 1.451x (replay, error 2.2%)",
      "next: less host work per pass (CUDA graphs)"]),
])
def test_the_verdict_of_a_committed_gpu_run(name, key, expect, tmp_path):
    """The committed H200 runs (flat names: search_log.json, verification_summary.json) render,
    and their verdict lines say what the README's results table says."""
    import shutil

    sys.path.insert(0, str(RESULTS.parent))
    from reproject import unpack_run

    res = RESULTS / name
    if not (res / "trace").is_dir():
        pytest.skip("committed H200 run not present")
    unpack_run(res, tmp_path)
    for f in ("search_log.json", "verification_summary.json"):
        shutil.copy(res / f, tmp_path / f)
    md = Path(write_report(tmp_path)["markdown"]).read_text()
    head = md.split("## Verdict", 1)[1].split("##", 1)[0]
    line = next(x for x in head.splitlines() if x.startswith(f"- {key}:"))
    for text in expect:
        assert text in line, (text, line)
    assert "search" in md.split("Artifacts read:", 1)[1].split("\n", 1)[0]


def test_a_committed_gpu_report_reads_in_shapes_configs_and_links(tmp_path):
    """Configs as `warps=2`, cases as shapes, a link to each shipped kernel.py, acceptance
    records without the boilerplate every record repeats, and a set's projection never
    labelled an error."""
    import shutil

    sys.path.insert(0, str(RESULTS.parent))
    from reproject import unpack_run

    res = RESULTS / "optimize-llama-3.2-1b-b8-s1024-run15"
    if not (res / "trace").is_dir():
        pytest.skip("committed H200 run not present")
    unpack_run(res, tmp_path)
    for f in ("search_log.json", "verification_summary.json"):
        shutil.copy(res / f, tmp_path / f)
    out = write_report(tmp_path)
    md = Path(out["markdown"]).read_text()
    kernels = md.split("\n## Kernels\n", 1)[1].split("\n## ", 1)[0]
    assert "| rmsnorm | 8192 x 2048 (rows x hidden), bfloat16 | rows_per_program=1, warps=2 |" \
        in kernels
    assert "{'" not in kernels and "-332a3c |" not in kernels  # no dict reprs, no hash ids
    links = re.findall(r"- \[(\w+), [^\]]*: kernel\.py\]\((candidates/[^)]+/kernel\.py)\)", md)
    kept = read_json(tmp_path / "integration.json")["workloads"]["prefill-b8-s1024-bf16"]["kept"]
    assert sorted(f for f, _ in links) == sorted(kept)
    # the acceptance records are linked, not inlined: each is its own file, whole
    records = md.split("\n## Acceptance records\n", 1)[1].split("\n## ", 1)[0]
    assert "| field | value |" not in records and "| Workload |" not in md
    for fam in kept:
        assert f"(acceptance/{fam}.md)" in records
        assert (tmp_path / "acceptance" / f"{fam}.md").read_text().count("Workload:") == 1
    assert "error against the projection" not in md and "projected for that set: " in md
    # "Patch took effect": each op's count once, none unchanged, GPU kernels by short names
    effect = next(x for x in md.splitlines() if x.startswith("Patch took effect"))
    assert effect.count("mul 148->2") == 1 and "0->0" not in effect and "{'" not in effect
    assert "elementwise_kernel_with_index," in effect and "c10::Scalar" not in effect
    assert len(effect) < 900, len(effect)
    # a family set aside before integration is not a rollback
    assert "- gated_act: superseded by matmul_epilogue" in md
    assert "gated_act (kernel timing)" not in md
    html = Path(out["html"]).read_text()
    assert "overflow-wrap:anywhere" in html

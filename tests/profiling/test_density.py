"""The density curve (profiling.density) and the projection's use of it (projection.replay.clocked):
the synthetic pass is the profile's GEMMs and attention with the rest as fills, the curve is
read piecewise linearly, and a pass projected denser in compute kernels gets them slower."""

from __future__ import annotations

import pytest

from core.workload import Workload
from profiling.density import compute_correlations, plan, slowdown
from tests.pipeline.test_rank import H200, PREFILL, _fixture_workload

RISING = [{"scale": 1.0, "compute_share": 0.4, "compute_ratio": 1.0},
          {"scale": 0.5, "compute_share": 0.6, "compute_ratio": 1.02},
          {"scale": 0.1, "compute_share": 0.9, "compute_ratio": 1.12}]


@pytest.fixture(scope="module")
def prefill_w():
    return _fixture_workload(PREFILL, Workload(8, 1024, "bfloat16", "cuda"))


def test_the_synthetic_pass_is_the_profiles_gemms_and_attention_with_the_rest_as_fills(
        prefill_w):
    ops = [o for o in prefill_w["ops"] if o.get("device_us")]
    steps = plan(prefill_w["ops"])
    gemms = [s for s in steps if s[0] == "gemm"]
    assert len(gemms) == sum(o["name"] == "aten::linear" for o in ops)
    # two layers: one attention call each, at the query's [b, h, s, d]
    sdpa = [s for s in steps if s[0] == "sdpa"]
    assert len(sdpa) == 2 and sdpa[0][1] == 8 and sdpa[0][3] == 1024
    # every prefill GEMM has the pass's 8192 tokens as rows
    assert {g[1] for g in gemms} == {8192}
    compute_us = sum(o["device_us"] for o in ops if o["name"] == "aten::linear"
                     or o["name"].startswith("aten::scaled_dot_product"))
    fills = [s[1] for s in steps if s[0] == "fill"]
    assert sum(fills) == pytest.approx(sum(o["device_us"] for o in ops) - compute_us)
    # no two fills in a row: runs of other ops merge
    assert all(not (a[0] == b[0] == "fill") for a, b in zip(steps, steps[1:]))
    corr = compute_correlations(prefill_w["ops"])
    assert len(corr) >= len(gemms) + 2


def test_slowdown_reads_the_curve_piecewise_in_scale_and_flat_beyond_its_ends():
    assert slowdown(None, 0.3) == 1.0
    assert slowdown(RISING, 1.0) == 1.0
    assert slowdown(RISING, 0.5) == pytest.approx(1.02)
    assert slowdown(RISING, 0.3) == pytest.approx(1.07)
    assert slowdown(RISING, 0.01) == pytest.approx(1.12)  # held at both ends
    assert slowdown(RISING, 1.5) == 1.0
    # against a baseline already on the curve: the ratio to the curve's scale 1
    shifted = [{**p, "compute_ratio": p["compute_ratio"] * 2} for p in RISING]
    assert slowdown(shifted, 0.5) == pytest.approx(1.02)


def test_a_denser_projected_pass_gets_its_compute_kernels_slower(prefill_w):
    from pipeline.projection.replay import clocked, replayed_once, workload_graph
    from pipeline.stages.rank import rank_workload
    from profiling.replay import Replacement, what_if

    plain = rank_workload(prefill_w, H200, PREFILL)
    flat = [{**p, "compute_ratio": 1.0} for p in RISING]
    same = rank_workload({**prefill_w, "density": flat}, H200, PREFILL)
    slower = rank_workload({**prefill_w, "density": RISING}, H200, PREFILL)
    rows = {r["pattern"]: r for r in plain["rows"]}
    assert "power cap" in slower["regime"] and "1.12x" in slower["regime"]
    assert "power cap" not in plain["regime"]
    for ranked in (same, slower):
        assert [r["pattern"] for r in ranked["rows"]] == [r["pattern"] for r in plain["rows"]]
    for name in ("rmsnorm", "rope"):
        r0 = rows[name]["replay_gain"]
        assert {r["pattern"]: r for r in same["rows"]}[name]["replay_gain"] == pytest.approx(r0)
        assert {r["pattern"]: r for r in slower["rows"]}[name]["replay_gain"] < r0
    # by hand: the compute kernels' time after the replacements, times the curve's ratio
    # less one; memory-bound kernels at a tenth of their time make the pass denser
    graph = workload_graph({**prefill_w, "density": RISING}, PREFILL)
    compute = graph.graph["compute"]
    dev = [a for _, a in graph.nodes(data=True) if a["kind"] == "device"]
    reps = [Replacement(frozenset([a["correlation"]]), a["dur"] * 0.1) for a in dev
            if a["correlation"] not in compute and a["dur"] > 50]
    assert reps
    us = what_if(graph, reps)
    c = sum(a["dur"] for a in dev if a["correlation"] in compute)
    base = replayed_once(graph)

    def paired(c_after, us):  # both passes at the clock of their mix (clocked's docstring)
        k = ((base - c) + (us - c_after)) / (c + c_after) * c / (base - c)
        f = slowdown(RISING, k)
        return base + c * (f - 1), us + c_after * (f - 1)

    b1, p1 = clocked(graph, reps, us)
    assert (b1, p1) == pytest.approx(paired(c, us)) and p1 > us and b1 > base
    assert base / us > b1 / p1 > 1  # the gain shrinks: the patched pass's compute is a larger part
    # a replacement of compute kernels counts as compute at its new time
    gemm = next(a for a in dev if a["correlation"] in compute)
    fused = [Replacement(frozenset([gemm["correlation"]]), gemm["dur"] * 2)]
    us = what_if(graph, fused)
    assert clocked(graph, fused, us) == pytest.approx(paired(c + gemm["dur"], us))


def test_the_floor_is_the_compute_steps_alone_with_odd_gemm_columns_padded(prefill_w):
    from profiling.density import ALIGN, floor_steps

    compute = [s for s in plan(prefill_w["ops"]) if s[0] != "fill"]
    steps = floor_steps(prefill_w["ops"])
    assert len(steps) == len(compute) and all(s[0] != "fill" for s in steps)
    assert all(s[3] % ALIGN == 0 and s[3] - c[3] < ALIGN and s[:3] == c[:3]
               for s, c in zip(steps, compute) if s[0] == "gemm")
    assert [s for s in steps if s[0] == "sdpa"] == [s for s in compute if s[0] == "sdpa"]
    # GPT-2's LM head: 50257 columns -> 50304 (the matmul family pads its weight to 50432)
    head = {"name": "aten::linear", "shapes": [[8192, 768], [50257, 768]], "device_us": 900.0}
    assert floor_steps([head]) == [("gemm", 8192, 768, 50304)]


def test_the_ranking_says_how_far_the_floor_pass_lets_kernel_work_go(prefill_w):
    from pipeline.stages.rank import floor_line, rank_workload

    assert rank_workload(prefill_w, H200, PREFILL)["floor"] is None  # profiles from before it
    wall = prefill_w["wall"]["median_ms"]
    ranked = rank_workload({**prefill_w, "floor": {"wall_ms": wall / 1.6, "kernel_ms": wall / 1.7}},
                           H200, PREFILL)
    assert ranked["floor"]["over_wall"] == pytest.approx(1.6)
    line = floor_line(ranked)
    assert "1.60x" in line and f"{wall / 1.6:.2f} ms" in line and f"{wall:.2f} ms" in line
    assert floor_line({**ranked, "floor": None}) is None


@pytest.mark.gpu
def test_the_floor_pass_is_the_compute_kernels_alone_on_the_gpu():
    from profiling.density import floor, measure

    ops = [{"name": "aten::linear", "shapes": [[4096, 2048], [2048, 2048]], "device_us": 60.0,
            "kernels": []},
           {"name": "aten::mul", "shapes": [[4096, 2048]], "device_us": 80.0, "kernels": []}] * 8
    f = floor(ops, seconds=0.3)
    with_fills = measure(ops, 4000.0, scales=(1.0,), seconds=0.3)[0]
    # eight GEMMs and no copies: at most the kernels of the pass with its fills
    assert 0 < f["kernel_ms"] * 1e3 < with_fills["compute_us"] + with_fills["copy_us"]
    # the replay's wall and its profiled kernels time the same pass, but the profiler slows a
    # dense one (Qwen2.5-0.5B b8's floor on the H200: kernels 15.55-16.03 ms, replays 14.72-14.95)
    assert 0.8 < f["kernel_ms"] / f["wall_ms"] < 1.2


@pytest.mark.gpu
def test_density_is_measured_on_the_gpu():
    from profiling.density import measure

    ops = [{"name": "aten::linear", "shapes": [[4096, 2048], [2048, 2048]], "device_us": 60.0,
            "kernels": []},
           {"name": "aten::mul", "shapes": [[4096, 2048]], "device_us": 80.0, "kernels": []}] * 8
    pts = measure(ops, 4000.0, scales=(1.0, 0.2), seconds=0.3)
    assert pts[0]["compute_ratio"] == 1.0 and pts[0]["copy_us"] > 0
    assert pts[1]["compute_share"] > pts[0]["compute_share"]
    assert pts[1]["copy_us"] < pts[0]["copy_us"]

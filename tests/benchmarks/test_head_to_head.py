"""benchmarks/head_to_head.py's pure parts: the split of its rounds by the host's speed, the
variant list, the rotation, the ratios it records and its kernel count (the timing itself
needs a GPU and a run directory)."""

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from core.errors import UserError

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from head_to_head import (  # noqa: E402
    ALL_VARIANTS,
    VARIANTS,
    alone,
    by_host_speed,
    counted,
    kernel_count,
    parse_variants,
    ratios,
    rotation,
    share_recompile_limit,
    static_len,
)


def test_rounds_split_by_eager_host_time_show_each_regime():
    # run 12's shape: compile GPU-bound at 21 ms; ours host-bound, 17.7 ms when the host is
    # fast and 25.7 when slow; eager's host time marks the host's speed
    eager_host = [27.0, 33.0, 26.0, 34.0, 27.5, 33.5]
    times = {"eager": [h + 0.5 for h in eager_host],
             "ours": [17.7 if h < 30 else 25.7 for h in eager_host],
             "compile": [21.0, 21.2, 21.0, 21.2, 21.0, 21.2]}
    host = {"eager": eager_host, "ours": [t - 0.3 for t in times["ours"]],
            "compile": [17.0] * 6}
    split = by_host_speed(times, host)
    fast, slow = split["fast_host"], split["slow_host"]
    assert fast["rounds"] == slow["rounds"] == 3
    assert fast["eager_host_ms"] == 27.0 and slow["eager_host_ms"] == 33.5
    assert fast["median_ms"]["ours"] == 17.7 and slow["median_ms"]["ours"] == 25.7
    assert fast["ours_over_compile"] == pytest.approx(21.0 / 17.7)
    assert slow["ours_over_compile"] == pytest.approx(21.2 / 25.7)


def test_a_steady_host_is_all_fast_and_a_short_fast_stretch_is_kept_apart():
    times = {"eager": [30.0] * 4, "ours": [20.0] * 4, "compile": [22.0] * 4}
    host = {"eager": [25.0] * 4, "ours": [15.0] * 4, "compile": [10.0] * 4}
    split = by_host_speed(times, host)
    assert list(split) == ["fast_host"] and split["fast_host"]["rounds"] == 4
    assert split["fast_host"]["ours_over_compile"] == pytest.approx(1.1)
    # four fast rounds in thirty, as in run 12's Qwen b8: a median split would bury them
    eager_host = [24.5] * 4 + [30.7] * 26
    times = {"eager": [27.5] * 4 + [33.7] * 26, "ours": [17.7] * 4 + [25.7] * 26,
             "compile": [21.0] * 30}
    split = by_host_speed(times, {"eager": eager_host, "ours": eager_host,
                                  "compile": eager_host})
    assert split["fast_host"]["rounds"] == 4 and split["slow_host"]["rounds"] == 26
    assert split["fast_host"]["ours_over_compile"] > 1 > split["slow_host"]["ours_over_compile"]


def test_variants_default_to_the_old_three_and_eager_always_leads():
    assert parse_variants(None, "prefill") == (list(VARIANTS), {})
    chosen, skipped = parse_variants("graph,ours-graphs,graph,eager-static", "prefill")
    assert chosen == ["eager", "graph", "ours-graphs"]
    assert list(skipped) == ["eager-static"]  # decode only
    chosen, skipped = parse_variants(",".join(ALL_VARIANTS), "decode")
    assert chosen == list(ALL_VARIANTS) and skipped == {}
    with pytest.raises(UserError, match="unknown variant.*graphs"):
        parse_variants("eager,graphs", "decode")


def test_every_variant_leads_a_round_equally_often():
    names = ["eager", "ours", "graph", "ours-graphs"]
    orders = [rotation(names, i) for i in range(8)]
    assert all(sorted(o) == sorted(names) for o in orders)
    assert [o[0] for o in orders] == names * 2


def test_the_static_cache_has_a_slot_for_the_step_rounded_to_16():
    assert static_len(1024) == 1040 and static_len(15) == 16 and static_len(16) == 32


def test_ratios_keep_the_old_keys_and_add_every_variant_over_eager():
    times = {"eager": [10.0] * 5, "ours": [8.0] * 5, "compile": [5.0] * 5,
             "graph": [4.0] * 5, "ours-graphs": [2.0] * 5, "compile-reduce-overhead": [2.5] * 5}
    out = ratios(times)
    assert out["ours_over_eager"]["speedup"] == pytest.approx(1.25)
    assert out["compile_over_eager"]["speedup"] == pytest.approx(2.0)
    assert out["ours_over_compile"]["speedup"] == pytest.approx(0.625)
    assert set(out["over_eager"]) == set(times) - {"eager"}
    assert out["over_eager"]["ours-graphs"]["speedup"] == pytest.approx(5.0)
    assert out["pairs"]["ours-graphs_over_compile-reduce-overhead"]["speedup"] == \
        pytest.approx(1.25)
    assert out["pairs"]["ours-graphs_over_graph"]["speedup"] == pytest.approx(2.0)
    only = ratios({"eager": [10.0] * 3, "graph": [5.0] * 3})
    assert "ours_over_compile" not in only and "compile_over_eager" not in only
    assert only["pairs"] == {}


def test_the_host_split_without_compile_has_no_ours_over_compile():
    times = {"eager": [30.0, 40.0], "graph": [3.0, 3.1]}
    split = by_host_speed(times, {"eager": [25.0, 35.0], "graph": [0.1, 0.1]})
    assert split["fast_host"]["median_ms"]["graph"] == 3.0
    assert "ours_over_compile" not in split["fast_host"]


def test_kernels_are_device_events_other_than_copies():
    ev = [SimpleNamespace(device_type="DeviceType.CUDA", name=n)
          for n in ("ampere_bf16_gemm", "Memcpy HtoD (Pageable -> Device)", "triton_rmsnorm",
                    "Memset (Device)")]
    ev.append(SimpleNamespace(device_type="DeviceType.CPU", name="aten::mm"))
    assert kernel_count(ev) == 2


def test_eager_alone_times_after_warming_and_reports_wall_and_host_apart():
    import time

    calls = []

    def call():  # 4 ms on the host, nothing queued after it returns
        calls.append(1)
        time.sleep(0.004)

    got = alone(call, "cpu", rounds=4, warm=2)
    assert len(calls) == 6 and got["rounds"] == 4
    assert 3.5 < got["median_host_ms"] <= got["median_ms"] < 50
    assert got["device_allocs"] is None  # counted on CUDA only
    assert alone(call, "cpu", rounds=0) is None and len(calls) == 6


def test_hf_best_experts_times_every_option_on_a_twin_and_keeps_the_fastest():
    """Each experts implementation the installed transformers offers is tried on a twin over
    the same weights; the fastest that runs is returned, the model itself left as built, and
    an option that cannot run here is named with its reason."""
    import torch
    from head_to_head import best_experts

    from core.workload import Workload
    from models.moe import experts_options
    from profiling.loader import build, resolve

    model = build(resolve("tiny-olmoe"), torch.float32, "cpu")
    before = model.config._experts_implementation
    variant, chosen = best_experts(model, Workload(1, 8), calls=1)
    assert set(chosen["median_ms"]) | set(chosen["failed"]) == set(experts_options())
    assert {"eager", "batched_mm", "grouped_mm"} <= set(chosen["median_ms"])
    best = chosen["option"]
    assert chosen["median_ms"][best] == min(chosen["median_ms"].values())
    assert variant.config._experts_implementation == best
    assert model.config._experts_implementation == before
    assert variant.model.layers[0].mlp.experts.gate_up_proj is \
        model.model.layers[0].mlp.experts.gate_up_proj  # shared, never copied
    with pytest.raises(ValueError, match="not a mixture-of-experts"):
        best_experts(build(resolve("tiny-llama"), torch.float32, "cpu"), Workload(1, 8))


def test_compiled_twins_share_a_recompile_limit_raised_for_each():
    import torch

    with torch._dynamo.config.patch(recompile_limit=8):  # restored on exit
        assert share_recompile_limit(["eager", "ours", "compile"]) is None
        assert torch._dynamo.config.recompile_limit == 8
        assert share_recompile_limit(["eager", "compile", "ours-compile"]) == 16
        assert torch._dynamo.config.recompile_limit == 16


def test_a_compiled_call_that_breaks_its_graph_is_counted():
    import torch

    def f(x):
        x = x + 1
        torch._dynamo.graph_break()
        return x * 2

    torch._dynamo.reset()
    fn = torch.compile(f, backend="eager")
    tally = {"graphs": 0, "graph_breaks": 0}
    assert counted(lambda: fn(torch.ones(3)), tally).tolist() == [4.0] * 3
    assert tally == {"graphs": 2, "graph_breaks": 1}
    counted(lambda: fn(torch.ones(3)), tally)  # cached: nothing new
    assert tally == {"graphs": 2, "graph_breaks": 1}


def test_top_kernels_sums_each_kernels_calls_and_time_longest_first():
    from types import SimpleNamespace

    from head_to_head import top_kernels

    def ev(name, us, device="DeviceType.CUDA"):
        return SimpleNamespace(name=name, device_type=device,
                               time_range=SimpleNamespace(elapsed_us=lambda: us))

    events = [ev("gemv", 10), ev("norm", 3), ev("gemv", 12), ev("Memcpy HtoD", 50),
              ev("aten::mm", 99, "DeviceType.CPU")]
    assert top_kernels(events) == [["gemv", 2, 0.022], ["norm", 1, 0.003]]


def test_the_prefetch_variant_is_pdl_with_the_prefetch(monkeypatch, tmp_path):
    """ours-graphs-pdl-prefetch captures with PDL on and the weight streamers' L2 prefetch
    on (paired against ours-graphs-pdl, which has it only where opted in); refused where PDL
    cannot run."""
    from head_to_head import PAIRS, pdl_context
    from results_table import VARIANTS as TABLE_VARIANTS

    from codegen import launch, pdl

    assert ("ours-graphs-pdl-prefetch", "ours-graphs-pdl") in PAIRS
    assert "ours-graphs-pdl-prefetch" in TABLE_VARIANTS
    with pytest.raises(ValueError, match="PDL cannot run here"):  # the CPU: the interpreter
        pdl_context("ours-graphs-pdl-prefetch", tmp_path, "key")
    monkeypatch.setattr(launch, "pdl_hardware_reason", lambda: None)
    monkeypatch.delenv(pdl.NO_PDL_ENV, raising=False)
    monkeypatch.delenv(pdl.PREFETCH_ENV, raising=False)
    seen = {}
    for name in ("ours-graphs-pdl", "ours-graphs-pdl-prefetch"):
        with pdl_context(name, tmp_path, "key")():
            seen[name] = (pdl.STATE.on, pdl.STATE.prefetch)
    assert seen == {"ours-graphs-pdl": (True, False),
                    "ours-graphs-pdl-prefetch": (True, True)}
    assert pdl_context("ours-graphs-nopdl", tmp_path, "key") is None

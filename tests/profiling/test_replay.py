"""The what-if trace replay: faithful without changes, right in both regimes with them."""

from pathlib import Path

import pytest

from profiling.replay import (
    Replacement,
    apply_replacements,
    build_graph,
    critical_path,
    device_busy_us,
    device_event_ids,
    graphed,
    graphed_with,
    kernel_table,
    replay,
    what_if,
)
from profiling.trace import load_trace, profiler_steps

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
PREFILL = FIXTURES / "prefill_b8_s1024_2layer.json.gz"
DECODE = FIXTURES / "decode_b1_kv1024_2layer.json.gz"


@pytest.fixture(scope="module")
def prefill():
    return load_trace(PREFILL)


@pytest.fixture(scope="module")
def decode():
    return load_trace(DECODE)


def _halve(graph, keep=lambda row: True):
    return [Replacement(frozenset({r["correlation"]}), r["dur_us"] / 2)
            for r in kernel_table(graph) if keep(r)]


# A host thread that launches K1, then spends 1000 us in Python (the GPU idles), then
# launches K2 and K3 back to back and synchronises. Times in µs.
def _synthetic_trace():
    host = {"pid": 1, "tid": 1, "ph": "X"}
    gpu = {"pid": 0, "tid": 7, "ph": "X", "cat": "kernel"}

    def launch(ts, corr, name="cudaLaunchKernel", dur=5.0):
        return {**host, "cat": "cuda_runtime", "name": name, "ts": ts, "dur": dur,
                "args": {"correlation": corr}}

    def kernel(ts, dur, corr):
        return {**gpu, "name": f"k{corr}", "ts": ts, "dur": dur,
                "args": {"correlation": corr, "stream": 7}}

    return {"traceEvents": [
        {**host, "cat": "user_annotation", "name": "ProfilerStep#1", "ts": 0.0, "dur": 1240.0},
        launch(10.0, 1), kernel(17.0, 50.0, 1),
        launch(1015.0, 2), kernel(1022.0, 100.0, 2),
        launch(1040.0, 3), kernel(1123.0, 100.0, 3),
        launch(1060.0, 4, "cudaDeviceSynchronize", 170.0),
        {**gpu, "tid": 1, "cat": "cuda_sync", "name": "Context Sync", "ts": 1061.0, "dur": 165.0,
         "args": {"correlation": 4, "cuda_sync_kind": "Context Sync", "stream": -1}},
    ]}


def test_synthetic_graph_replays_trace_and_has_expected_structure():
    trace = _synthetic_trace()
    g = build_graph(trace)
    assert replay(g) == pytest.approx(1240.0, rel=1e-6)
    kinds = sorted(a["kind"] for _, a in g.nodes(data=True))
    assert kinds.count("launch") == 3 and kinds.count("device") == 3 and kinds.count("sync") == 1
    # The sync waits for the last kernel: its own duration is only the wake-up after K3.
    assert g.nodes[("sync", 7)]["dur"] == pytest.approx(1230.0 - 1223.0)
    assert sorted(device_event_ids(trace).values()) == [1, 2, 3]
    assert [r["id"] for r in kernel_table(g)] == [2, 4, 6]  # indices in traceEvents


def test_synthetic_kernel_speedup_under_a_host_gap_gains_nothing():
    g = build_graph(_synthetic_trace())
    base = replay(g)
    faster = what_if(g, [({1}, 25.0)])  # K1 runs while the host is busy for 1000 us
    assert faster == pytest.approx(base, rel=0.01)
    # By traceEvents index the same replacement gives the same answer.
    assert what_if(g, [({2}, 25.0)], ids="event") == pytest.approx(faster)
    cp = critical_path(g)
    assert cp.host_share > 0.8 and ("device", 2) not in cp.nodes


def test_synthetic_removing_host_time_shortens_the_step():
    g = build_graph(_synthetic_trace())
    base = replay(g)
    # Fusing K1 and K2 dispatches one launch: L2 (5 us) goes, and with it up to 900 us of the
    # host op time before it; the fused kernel keeps the summed duration.
    fused = apply_replacements(g, [({1, 2}, 150.0)], host_saving_us=900.0)
    assert fused.graph["host_removed_us"] == pytest.approx(905.0)
    assert replay(fused) < base - 800.0
    assert what_if(g, [({1, 2}, 150.0)]) < base
    # The host op time taken per removed launch is capped by the host segment before it:
    # L3 follows L2 after 20 us, so fusing K2 and K3 removes 5 + 20 us of host time, which
    # gains ~nothing here because the GPU, busy with K2 and K3, sets the pace by then.
    fused = apply_replacements(g, [({2, 3}, 200.0)], host_saving_us=900.0)
    assert fused.graph["host_removed_us"] == pytest.approx(25.0)
    assert replay(fused) == pytest.approx(base, rel=0.01)


def test_replacement_errors():
    g = build_graph(_synthetic_trace())
    with pytest.raises(ValueError, match="no device event"):
        what_if(g, [({99}, 1.0)])
    with pytest.raises(ValueError, match="overlap"):
        what_if(g, [({1, 2}, 1.0), ({2}, 1.0)])


@pytest.mark.parametrize("path", [PREFILL, DECODE], ids=["prefill", "decode"])
def test_no_replacement_replays_every_traced_step_within_2_percent(path):
    trace = load_trace(path)
    for step, span in enumerate(profiler_steps(trace)):
        g = build_graph(trace, step)
        assert g.graph["traced_us"] == pytest.approx(span["dur"], rel=0.02)
        assert replay(g) == pytest.approx(g.graph["traced_us"], rel=0.02)
        cp = critical_path(g)
        assert cp.length_us == pytest.approx(replay(g))
        assert cp.host_us + cp.device_us + cp.gap_us == pytest.approx(cp.length_us)


def test_prefill_is_gpu_bound_and_halving_elementwise_kernels_pays(prefill):
    # Measured on step 0: 13077 us traced; the 68 elementwise kernels are 1919 us of 10643 us
    # device time; halving them replays to about 12452 us (-4.8 %).
    g = build_graph(prefill, 0)
    base = replay(g)
    assert critical_path(g).device_share > 0.6
    faster = what_if(g, _halve(g, lambda r: "elementwise" in r["name"]))
    assert faster < base * 0.97
    # A kernel speedup can never make the step longer, nor gain more than the time it saves.
    saved = sum(r["dur_us"] / 2 for r in kernel_table(g) if "elementwise" in r["name"])
    assert base - faster <= saved + 1e-6


def test_decode_is_launch_bound_and_halving_kernels_gains_little(decode):
    # Measured on step 0: 45629 us traced, 372 us of device work; halving every kernel
    # leaves the replay unchanged because the host sets the pace throughout.
    g = build_graph(decode, 0)
    base = replay(g)
    assert critical_path(g).host_share > 0.95
    assert what_if(g, _halve(g)) > base * 0.99
    # Fusion still helps here by removing launches: merging two kernels into one removes
    # one launch call from the host chain, and the step shrinks by about that much.
    rows = kernel_table(g)
    fused = apply_replacements(g, [({rows[0]["correlation"], rows[1]["correlation"]},
                                    rows[0]["dur_us"] + rows[1]["dur_us"])])
    assert fused.graph["host_removed_us"] > 0
    assert base - replay(fused) == pytest.approx(fused.graph["host_removed_us"], rel=0.05)


def test_synthetic_total_host_saving_pays_the_removed_calls_and_pools_the_rest():
    """A measured host delta of a fused call, its removed launch calls included: the
    replacement saves exactly that, whatever the launches' own traced durations, the rest
    taken off the segments before them in proportion to their lengths (L3's 20 us segment
    alone could not hold half of it, the 1000 us one before L2 can)."""
    g = build_graph(_synthetic_trace())

    def fuse(**kw):
        return apply_replacements(g, [Replacement(frozenset({1, 2, 3}), 250.0, **kw)])

    fused = fuse(host_saving_total_us=120.0)
    # L2 and L3 go (5 us each) and 110 us comes off seg 1 (1000 us) and seg 2 (20 us), each
    # by the same fraction: 120 us in all, where 60 us per launch less a launch, capped at
    # the one segment before each, takes 85
    assert fused.graph["host_removed_us"] == pytest.approx(120.0)
    segs = {n: a["dur"] for n, a in fused.nodes(data=True) if a["kind"] == "host"}
    assert segs[("host", 1)] == pytest.approx(1000.0 * (1 - 110 / 1020))
    assert segs[("host", 2)] == pytest.approx(20.0 * (1 - 110 / 1020))
    assert fuse(host_saving_us=55.0).graph["host_removed_us"] == pytest.approx(85.0)
    # never more than the segments hold; a negative delta adds host time evenly
    assert fuse(host_saving_total_us=1e4).graph["host_removed_us"] == pytest.approx(1030.0)
    costs = fuse(host_saving_total_us=-40.0)
    assert costs.graph["host_removed_us"] == pytest.approx(-40.0)
    assert replay(costs) > replay(fuse(host_saving_total_us=0.0))


# ------------------------------------------------------------------ replayed as one CUDA graph

def test_synthetic_graphed_pass_is_the_stream_chain_plus_graph_costs():
    g = build_graph(_synthetic_trace())
    # K1 50 + K2 100 + K3 100 in stream order, each node 2 us more, one launch of 10 us: the
    # 1000 us host gap, the launches and the sync are gone
    assert graphed(g, 2.0, 10.0) == pytest.approx(10.0 + 250.0 + 3 * 2.0)
    assert graphed(g, 0.0, 0.0) == pytest.approx(device_busy_us(g))
    # a negative node cost (kernels faster back to back than after the eager gaps) shortens
    # each kernel, but none below zero
    assert graphed(g, -10.0, 0.0) == pytest.approx(250.0 - 3 * 10.0)
    assert graphed(g, -80.0, 0.0) == pytest.approx(0.0 + 20.0 + 20.0)
    # kernels + graph: K2 and K3 fused into one 150 us kernel, then graphed
    assert graphed_with(g, [({2, 3}, 150.0)], 2.0, 10.0) == pytest.approx(
        10.0 + 50.0 + 150.0 + 2 * 2.0)


def test_synthetic_graphed_keeps_a_cross_stream_wait():
    import networkx as nx

    g = nx.DiGraph()
    g.add_node(("host", 0), kind="host", dur=500.0)
    for i, (dur, stream) in enumerate(((10.0, 1), (5.0, 1), (7.0, 2))):
        g.add_node(("device", i), kind="device", dur=dur, ts=float(i), stream=stream)
        g.add_edge(("host", 0), ("device", i), kind="launch", lag=3.0)
    g.add_edge(("device", 0), ("device", 1), kind="stream", lag=40.0)
    g.add_edge(("device", 0), ("device", 2), kind="wait", lag=40.0)
    # the longer branch after the wait: 10 then 7 (not 10 then 5), lags and host gone
    assert graphed(g, 1.0, 4.0) == pytest.approx(4.0 + 11.0 + 8.0)


@pytest.mark.parametrize("path", [DECODE, PREFILL])
def test_fixture_graphed_keeps_gpu_time_and_removes_host(path):
    g = build_graph(load_trace(path))
    busy, wall = device_busy_us(g), replay(g)
    one_stream = graphed(g, 0.0, 0.0)
    assert busy - 1e-6 <= one_stream < wall
    n = sum(1 for _, a in g.nodes(data=True) if a["kind"] == "device")
    # every kernel pays its node cost, once on the critical chain, when it is one stream
    assert graphed(g, 1.0, 5.0) <= one_stream + n * 1.0 + 5.0 + 1e-6
    assert graphed(g, 1.0, 5.0) > one_stream

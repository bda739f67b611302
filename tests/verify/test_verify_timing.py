"""timing.py and stats.py: labels off the GPU, and the paired-ratio verdict."""

import time

import numpy as np
import pytest
import torch

from verify.stats import bootstrap_ci, summarize
from verify.timing import NOT_GPU_REASON, bench, bench_graphed, paired_ratio


class FakeClock:
    """Synthetic timings: each fn advances the clock by its own duration."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_identical_fns_are_the_same():
    clock, rng = FakeClock(), np.random.default_rng(1)

    def fn():
        clock.now += 0.010 * (1 + 0.05 * rng.standard_normal())

    result = paired_ratio(fn, fn, n=40, clock=clock)
    assert result.verdict == "same"
    assert result.ci_low < 1.0 < result.ci_high
    assert len(result.ratios) == 40


def test_clearly_slower_and_faster_fns():
    def fast():
        time.sleep(0.001)

    def slow():
        time.sleep(0.004)

    slower = paired_ratio(fast, slow, n=12)
    assert slower.verdict == "slower" and slower.ci_low > 1.5
    assert paired_ratio(slow, fast, n=12).verdict == "faster"
    assert slower.meaningful is False and slower.reason == NOT_GPU_REASON  # CPU wall time


def test_bootstrap_is_reproducible_and_brackets_the_estimate():
    values = np.random.default_rng(0).normal(1.0, 0.1, 50)
    a = bootstrap_ci(values, "median", seed=3)
    assert a == bootstrap_ci(values, "median", seed=3)
    estimate, low, high = bootstrap_ci(values, "mean")
    assert low < estimate < high and high - low < 0.1
    with pytest.raises(ValueError):
        bootstrap_ci(values, "mode")


def test_summary_spread():
    s = summarize([1.0, 2.0, 3.0, 4.0, 100.0])
    assert s["median_ms"] == 3.0 and s["p20_ms"] < s["median_ms"] < s["p80_ms"]
    assert s["n"] == 5 and s["max_ms"] == 100.0


def test_cpu_bench_is_labelled_not_meaningful():
    x = torch.randn(1024)
    timing = bench(lambda: x * 2, device="cpu", min_bytes=8192, flops=1024, rep_ms=5)
    assert timing.meaningful is False and timing.reason == NOT_GPU_REASON
    assert timing.median_ms > 0 and timing.gbps > 0 and timing.tflops > 0


@pytest.mark.gpu
def test_gpu_bench_and_paired_ratio_are_meaningful():
    x = torch.randn(1 << 24, device="cuda")
    timing = bench(lambda: x * 2, device="cuda", min_bytes=2 * x.numel() * 4)
    assert timing.meaningful and "L2 flushed" in timing.method
    assert 100 < timing.gbps < 6000  # a memory-bound op on an H200-class GPU
    result = paired_ratio(lambda: x * 2, lambda: x * 2, n=20, device="cuda")
    assert result.meaningful and result.verdict in ("same", "faster", "slower")


@pytest.mark.gpu
def test_gpu_bench_times_the_device_work_not_a_slow_wrapper():
    """A wrapper that spends 300 us of Python before a ~10 us kernel: the events must time the
    kernel (run 12's Liger cells timed the wrapper)."""
    x = torch.randn(1 << 20, device="cuda")

    def slow_wrapper():
        t = time.perf_counter()
        while time.perf_counter() - t < 3e-4:
            pass
        return x * 2

    plain = bench(lambda: x * 2, device="cuda", rep_ms=20)
    wrapped = bench(slow_wrapper, device="cuda", rep_ms=20)
    assert "head start" in wrapped.method
    assert wrapped.median_ms < plain.median_ms + 0.05 < 0.3


def test_graphed_timing_is_not_measured_on_the_cpu():
    x = torch.randn(16)
    assert bench_graphed(lambda: x * 2, device="cpu") == (None, NOT_GPU_REASON)


@pytest.mark.gpu
def test_graphed_timing_drops_the_event_overhead_and_scales_with_the_work():
    """A tiny kernel costs about 3 us more between events than inside a graph (the per-call
    overhead the graph projection must not count); a kernel of 8x the bytes takes longer in
    the graph too; a call that synchronises cannot be captured and says so."""
    small = torch.randn(256, device="cuda")
    big = torch.randn(1 << 23, device="cuda")
    out_s, out_b = torch.empty_like(small), torch.empty_like(big)
    tiny_ms, why = bench_graphed(lambda: torch.mul(small, 2, out=out_s), device="cuda")
    assert why is None and 0 < tiny_ms
    events = bench(lambda: torch.mul(small, 2, out=out_s), device="cuda", rep_ms=20)
    assert tiny_ms < events.median_ms - 1e-3  # > 1 us less than between events
    big_ms, _ = bench_graphed(lambda: torch.mul(big, 2, out=out_b), device="cuda")
    assert big_ms > 4 * tiny_ms
    ms, why = bench_graphed(lambda: small.sum().item(), device="cuda")
    assert ms is None and why.startswith("not capturable")
    # and the process goes on capturing (the screen worker times its next candidate)
    again, why = bench_graphed(lambda: torch.mul(small, 2, out=out_s), device="cuda")
    assert why is None and again > 0


def test_paired_ratio_records_each_calls_host_time_apart_from_its_wall_time(monkeypatch):
    """Host time = until the call returned; wall time also waits for the synchronise (here a
    fake device that finishes 5 ms after the host returns for the candidate, 1 ms for the
    baseline)."""
    clock = FakeClock()
    pending = [0.0]

    def call(host_s, device_s):
        def fn():
            clock.now += host_s
            pending[0] = device_s
        return fn

    def synchronize(device=None):
        clock.now += pending[0]
        pending[0] = 0.0

    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    r = paired_ratio(call(0.004, 0.001), call(0.002, 0.005), n=6, device="cuda", clock=clock)
    assert r.host_a_ms == pytest.approx([4.0] * 6) and r.times_a_ms == pytest.approx([5.0] * 6)
    assert r.host_b_ms == pytest.approx([2.0] * 6) and r.times_b_ms == pytest.approx([7.0] * 6)
    assert r.verdict == "slower" and r.meaningful


def _scripted(clock, durations, order=None, name=None):
    """A call that advances the fake clock by the next scripted duration."""
    it = iter(durations)

    def fn():
        clock.now += next(it)
        if order is not None:
            order.append(name)
    return fn


def test_more_pairs_only_while_the_interval_is_wide_and_never_past_max_n():
    """A noisy stretch (the host slowing down for a while) widens the interval: more pairs
    are run, in batches of n, until it is narrow or max_n is reached; a quiet measurement stays
    at n, and so does one without max_n."""
    rng = np.random.default_rng(4)

    def noisy(k):
        return [0.010 * (1 + 0.4 * abs(x)) for x in rng.standard_normal(k)]

    def measure(a_times, b_times, max_n):
        clock, order = FakeClock(), []
        r = paired_ratio(_scripted(clock, a_times, order, "a"),
                         _scripted(clock, b_times, order, "b"), n=10, warmup=0,
                         max_n=max_n, clock=clock)
        return r, order

    stretch_a, stretch_b = noisy(10) + [0.010] * 190, noisy(10) + [0.008] * 190
    wide, _ = measure(stretch_a, stretch_b, None)
    assert len(wide.ratios) == 10 and wide.ci_high - wide.ci_low > 0.05 * wide.estimate
    grown, order = measure(stretch_a, stretch_b, 40)
    assert 10 < len(grown.ratios) <= 40 and len(grown.ratios) % 10 == 0
    assert grown.ci_high - grown.ci_low <= 0.05 * grown.estimate
    assert grown.estimate == pytest.approx(0.8)
    # pairs keep alternating which side runs first across the batches
    assert order[:4] == ["a", "b", "b", "a"] and order[20:24] == ["a", "b", "b", "a"]
    quiet, _ = measure([0.010] * 200, [0.008] * 200, 40)
    assert len(quiet.ratios) == 10 and quiet.estimate == pytest.approx(0.8)
    capped, _ = measure(noisy(200), noisy(200), 25)
    assert len(capped.ratios) == 25

"""The one place where anything is timed.

Kernel micro-benchmarks (`bench`): the first call (compilation) is never counted; warm-up, then
many repetitions, each between CUDA events with the L2 cache flushed before it (a 256 MB write, as
triton.testing.do_bench does), so a kernel is not timed on inputs the previous repetition left in
cache. Before each start event the GPU also sleeps for about twice fn's host time per call, so
every launch of fn is queued before the GPU reaches the start event: the events time the device
work, not a Python wrapper that returns slower than the flush runs (Liger's RMSNorm
wrapper put 51-111 us in the window of a 23 us kernel). The host's share is measured elsewhere,
by the whole-model timings. Baseline, candidate and the plain-copy bandwidth reference all go
through this function. Each result carries median and spread, and the achieved GB/s (min_bytes
/ time) and TFLOP/s.

Whole-model comparisons (`paired_ratio`): baseline and candidate interleaved in one process (order
alternating per pair, so drift and cache state hit both alike); the per-pair ratio's median (or
mean) gets a bootstrap 95 % interval, and only an interval that excludes 1.0 counts as faster or
slower.

On the CPU (and under the Triton interpreter) the numbers are kept for information but labelled
not meaningful, and no speedup is derived from them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import cache

import torch

from verify.stats import bootstrap_ci, summarize

NOT_GPU_REASON = "CPU / Triton interpreter: not a GPU timing"
L2_FLUSH_BYTES = 256 * 1024 * 1024


@dataclass
class Timing:
    median_ms: float
    p20_ms: float
    p80_ms: float
    iqr_ms: float
    min_ms: float
    max_ms: float
    n: int
    meaningful: bool
    reason: str | None
    method: str
    gbps: float | None = None  # min_bytes / median time
    tflops: float | None = None  # flops / median time

    def to_dict(self) -> dict:
        return asdict(self)


def _rates(median_ms: float, min_bytes: int | None, flops: int | None):
    seconds = median_ms / 1e3
    if seconds <= 0:
        return None, None
    gbps = min_bytes / seconds / 1e9 if min_bytes else None
    tflops = flops / seconds / 1e12 if flops else None
    return gbps, tflops


def bench(fn: Callable[[], object], *, device: str | torch.device, min_bytes: int | None = None,
          flops: int | None = None, warmup_ms: float = 25.0, rep_ms: float = 100.0,
          min_reps: int = 10, max_reps: int = 1000, flush_l2: bool = True,
          before: Callable[[], object] | None = None) -> Timing:
    """Time fn() on `device`; CUDA events and an L2 flush per repetition on a GPU.

    `before`: run ahead of every call of fn, outside the timed window (the verifier rotates
    and refreshes input and output buffers there, so no repetition sees the inputs of the
    last)."""
    device = torch.device(device)
    if before is not None:
        call = fn

        def fn() -> None:  # untimed calls (compilation, estimate, warm-up) rotate too
            before()
            call()
    if device.type == "cuda":
        times, method = _bench_cuda(fn, device, warmup_ms, rep_ms, min_reps, max_reps, flush_l2,
                                    call if before is not None else None, before)
        meaningful, reason = True, None
    else:
        times, method = _bench_host(fn, warmup_ms, rep_ms, min_reps, max_reps,
                                    call if before is not None else None, before)
        meaningful, reason = False, NOT_GPU_REASON
    s = summarize(times)
    gbps, tflops = _rates(s["median_ms"], min_bytes, flops)
    return Timing(**s, meaningful=meaningful, reason=reason, method=method, gbps=gbps,
                  tflops=tflops)


def _reps(estimate_ms: float, budget_ms: float, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, budget_ms / max(estimate_ms, 1e-3))))


def _bench_cuda(fn, device, warmup_ms, rep_ms, min_reps, max_reps, flush_l2, timed=None,
                before=None):
    torch.cuda.synchronize(device)
    fn()  # compiles / autotunes: never counted
    torch.cuda.synchronize(device)
    cache = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device=device) if flush_l2 else None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    for _ in range(5):
        fn()
    end.record()
    host_ms = (time.perf_counter() - t0) / 5 * 1e3
    torch.cuda.synchronize(device)
    estimate = start.elapsed_time(end) / 5
    # capped: a call that synchronises inside has host time = device time, and no head start
    # helps it
    head_start = int(_sleep_cycles_per_ms(device) * min(2 * host_ms + 0.02, 2.0))
    for _ in range(_reps(estimate, warmup_ms, 1, max_reps)):
        fn()
    n = _reps(estimate, rep_ms, min_reps, max_reps)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for i in range(n):
        if before is not None:
            before()
        if cache is not None:
            cache.zero_()  # outside the events: evicts the inputs from L2
        torch.cuda._sleep(head_start)
        starts[i].record()
        (timed or fn)()
        ends[i].record()
    torch.cuda.synchronize(device)
    times = [s.elapsed_time(e) for s, e in zip(starts, ends)]
    method = "cuda events, host head start"
    return times, method + (", L2 flushed per repetition" if flush_l2 else "")


def bench_graphed(fn: Callable[[], object], *, device: str | torch.device, calls: int = 8,
                  reps: int = 15) -> tuple[float | None, str | None]:
    """fn's device time per call as a CUDA graph replays it: (ms, None), or (None, why) when
    fn cannot be captured. `bench` times a call between events, which costs about 3 us more
    than the kernel takes inside a graph (a few-microsecond kernel reads about three times its
    graphed time), so a ratio of two `bench` times misstates what a
    replacement saves in a graph. Here `calls` copies of (L2 flush, fn) are captured in one
    graph and `calls` flushes alone in another; the difference of their median replays, per
    call, is fn's time, with its inputs evicted from L2 as in `bench`."""
    device = torch.device(device)
    if device.type != "cuda":
        return None, NOT_GPU_REASON
    cache = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device=device)
    try:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # lazy initialisation (cuBLAS handles) outside capture
            for _ in range(2):
                fn()
        torch.cuda.current_stream(device).wait_stream(side)
        torch.cuda.synchronize(device)
        graphs = []
        for with_fn in (False, True):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(calls):
                    cache.zero_()
                    if with_fn:
                        fn()
            graphs.append(g)
    except Exception as e:  # noqa: BLE001 - a call that syncs or allocates outside the pool
        torch.cuda.synchronize(device)
        return None, f"not capturable: {type(e).__name__}: {e}"[:200]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    medians = []
    for g in graphs:
        g.replay()
        times = []
        for _ in range(reps):
            start.record()
            g.replay()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end))
        medians.append(summarize(times)["median_ms"])
    del graphs
    return max(medians[1] - medians[0], 0.0) / calls, None


@cache
def _sleep_cycles_per_ms(device) -> float:
    """What one ms of `torch.cuda._sleep` (a spin on the GPU clock) costs in cycles, measured
    once per device."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)  # clocks up
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    torch.cuda.synchronize(device)
    return 10_000_000 / max(start.elapsed_time(end), 1e-3)


def _bench_host(fn, warmup_ms, rep_ms, min_reps, max_reps, timed=None, before=None):
    fn()
    t0 = time.perf_counter()
    fn()
    estimate = (time.perf_counter() - t0) * 1e3
    for _ in range(_reps(estimate, warmup_ms, 0, max_reps)):
        fn()
    times = []
    for _ in range(_reps(estimate, rep_ms, min(min_reps, 3), max_reps)):
        if before is not None:
            before()
        t0 = time.perf_counter()
        (timed or fn)()
        times.append((time.perf_counter() - t0) * 1e3)
    return times, "host perf_counter"


def copy_reference(nbytes: int, device: str | torch.device, **kw) -> Timing:
    """A plain device copy moving the same bytes (half read, half written): what a memory-bound
    kernel's GB/s is compared with, rather than only the largest possible copy."""
    half = max(1, nbytes // 2)
    src = torch.empty(half, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return bench(lambda: dst.copy_(src), device=device, min_bytes=2 * half, **kw)


@dataclass
class PairedRatio:
    """Per-pair ratios time(b) / time(a): above 1 means b is slower than a."""

    ratios: list[float]
    statistic: str
    estimate: float
    ci_low: float
    ci_high: float
    confidence: float
    verdict: str  # "faster" | "slower" | "same" (b relative to a)
    meaningful: bool
    reason: str | None
    times_a_ms: list[float] = field(default_factory=list)
    times_b_ms: list[float] = field(default_factory=list)
    # per call, the time until it returned, before the synchronise: its host time, unless it
    # synchronises inside (then the two times match)
    host_a_ms: list[float] = field(default_factory=list)
    host_b_ms: list[float] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def ratio_verdict(low: float, high: float) -> str:
    if low > 1.0:
        return "slower"
    if high < 1.0:
        return "faster"
    return "same"


def paired_ratio(fn_a: Callable[[], object], fn_b: Callable[[], object], n: int = 30, *,
                 device: str | torch.device | None = None, warmup: int = 2,
                 statistic: str = "median", confidence: float = 0.95, seed: int = 0,
                 n_boot: int = 10_000, max_n: int | None = None, max_width: float = 0.05,
                 clock: Callable[[], float] = time.perf_counter) -> PairedRatio:
    """Run a (baseline) and b (candidate) interleaved n times; bootstrap the ratio b / a.

    Wall time per call, synchronised on a GPU, as the whole-model timing is defined. `clock` is
    injectable so the statistics can be tested on synthetic timings.

    `max_n`: while the confidence interval is wider than `max_width` of the estimate, run up
    to n more pairs at a time, until max_n pairs in all. A lent host's speed can drop by a
    third for a stretch of a measurement (benchmarks/results/README.md, "Host speed moves"),
    which widens the interval; more pairs then narrow it instead of leaving a verdict to one
    stretch.
    """
    if n < 2:
        raise ValueError("paired_ratio needs n >= 2 pairs")
    dev = torch.device(device) if device is not None else None
    sync = (lambda: torch.cuda.synchronize(dev)) if dev is not None and dev.type == "cuda" \
        else (lambda: None)

    def timed(fn) -> tuple[float, float]:
        """(wall ms, ms until fn returned)."""
        sync()
        t0 = clock()
        fn()
        t1 = clock()
        sync()
        return (clock() - t0) * 1e3, (t1 - t0) * 1e3

    for _ in range(warmup):
        fn_a()
        fn_b()
    times_a, times_b, host_a, host_b = [], [], [], []

    def run_pairs(count: int) -> None:
        for _ in range(count):
            # Alternate which runs first so order effects (cache, clocks) favour neither side.
            if len(times_a) % 2 == 0:
                (ta, ha), (tb, hb) = timed(fn_a), timed(fn_b)
            else:
                (tb, hb), (ta, ha) = timed(fn_b), timed(fn_a)
            times_a.append(ta)
            times_b.append(tb)
            host_a.append(ha)
            host_b.append(hb)

    run_pairs(n)
    while True:
        ratios = [b / a if a > 0 else float("inf") for a, b in zip(times_a, times_b)]
        estimate, low, high = bootstrap_ci(ratios, statistic, confidence, n_boot, seed)
        left = (max_n or 0) - len(ratios)
        if left <= 0 or not (high - low > max_width * abs(estimate)):
            break
        run_pairs(min(n, left))
    meaningful = dev is not None and dev.type == "cuda"
    return PairedRatio(ratios=ratios, statistic=statistic, estimate=estimate, ci_low=low,
                       ci_high=high, confidence=confidence, verdict=ratio_verdict(low, high),
                       meaningful=meaningful, reason=None if meaningful else NOT_GPU_REASON,
                       times_a_ms=times_a, times_b_ms=times_b, host_a_ms=host_a,
                       host_b_ms=host_b)

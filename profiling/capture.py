"""Run a workload under torch.profiler, and time it without the profiler.

The profiled pass follows FACTS.md: a schedule (wait/warm-up steps excluded, `ProfilerStep#N`
markers for HTA), shapes, `with_stack=True` for module events, CUDA sync events for critical
path analysis, and a synchronise before each `prof.step()` so a step holds its own GPU work.
The wall time, the denominator of every share, is measured separately with no profiler.
"""

from __future__ import annotations

import gzip
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from core.artifacts import write_text
from core.workload import Workload

WAIT, WARMUP, ACTIVE = 1, 2, 3
WALL_WARMUP, WALL_REPS = 3, 20  # wall_time's untimed and timed calls


@dataclass
class Runner:
    """The measured call of a workload: `call()` runs exactly what the wall time times."""

    call: Callable[[], object]
    reset: Callable[[], None]  # undoes side effects between calls (decode: crop the KV cache)
    input_ids: torch.Tensor

    def once(self) -> None:
        """One pass as the whole-model timing runs it: no autograd, side effects undone."""
        with torch.no_grad():
            self.call()
        self.reset()


def make_runner(model, workload: Workload, seed: int = 0) -> Runner:
    device = workload.device
    vocab = model.config.vocab_size
    gen = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.randint(0, vocab, (workload.batch, workload.seq), generator=gen).to(device)
    if workload.mode == "prefill":
        def call():
            return model(ids)

        return Runner(call, lambda: None, ids)
    from models.graphs import cache_argument, output_cache

    name = cache_argument(model)
    with torch.no_grad():
        out = model(ids, use_cache=True)
    cache = output_cache(out)
    next_ids = torch.randint(0, vocab, (workload.batch, 1), generator=gen).to(device)

    def call():
        return model(next_ids, use_cache=True, **{name: cache})

    def reset():
        # each decode step appends one position; crop back so every timed call sees `seq`
        # (a negative crop removes that many positions on every transformers 5 release)
        extra = cache.get_seq_length() - workload.seq
        if extra > 0:
            cache.crop(-extra)

    return Runner(call, reset, next_ids)


def make_static_runner(model, workload: Workload, seed: int = 0) -> Runner:
    """A decode workload's step as a CUDA graph would replay it: eager, over a static KV cache
    (`models.graphs.StaticDecoder(graph=False)`) prefilled with `seq` positions; each call
    writes position `seq` and `reset` rewinds to it. Its trace is what the graph projection
    replays for decode: the static cache reads and masks all its slots each step, work the
    dynamic cache's step does not do (benchmarks/results/README.md, "Static-cache decode
    graphs")."""
    from models.graphs import StaticDecoder, static_len

    if workload.mode != "decode":
        raise ValueError(f"a static-cache runner is for decode workloads, not {workload.mode}")
    device = workload.device
    vocab = model.config.vocab_size
    gen = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.randint(0, vocab, (workload.batch, workload.seq), generator=gen).to(device)
    next_ids = torch.randint(0, vocab, (workload.batch, 1), generator=gen).to(device)
    decoder = StaticDecoder(model, workload.batch, static_len(workload.seq), graph=False)
    decoder.prefill(ids)

    def call():
        return decoder.step(next_ids)

    return Runner(call, lambda: decoder.rewind(workload.seq), next_ids)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def module_names(model, runner: Runner) -> dict[str, str]:
    """Map the profiler's `Class_N` module labels to dotted paths.

    The profiler numbers instances of a class in the order they are first called; a hooked
    forward pass sees the same order.
    """
    order: list[torch.nn.Module] = []
    seen: set[int] = set()

    def hook(mod, args):
        if id(mod) not in seen:
            seen.add(id(mod))
            order.append(mod)

    handles = [m.register_forward_pre_hook(hook) for m in model.modules()]
    try:
        with torch.no_grad():
            runner.call()
            runner.reset()
    finally:
        for h in handles:
            h.remove()
    path_of = {id(m): name or "(root)" for name, m in model.named_modules()}
    counters: dict[str, int] = {}
    names = {}
    for m in order:
        cls = type(m).__name__
        n = counters.get(cls, 0)
        counters[cls] = n + 1
        names[f"{cls}_{n}"] = path_of.get(id(m), f"{cls}_{n}")
    return names


def wall_time(runner: Runner, device: str, warmup: int = WALL_WARMUP,
              reps: int = WALL_REPS) -> dict:
    """Median wall time of the measured call, synchronised, no profiler (milliseconds), and
    the median time the call takes to return before the synchronise (`enqueue_ms`). On a GPU
    that is the host's own time for the pass when the forward never synchronises inside (an
    upper bound when it does): a pass whose host needs most of the wall to enqueue it turns
    host-bound once kernels shrink the device time (Qwen2.5-0.5B at batch 8 on a slow
    host). On the CPU the two agree. The replay takes it as a bound on the host's speed
    (`pipeline.projection.replay.workload_graph`)."""
    times, enqueues = [], []
    with torch.no_grad():
        for i in range(warmup + reps):
            sync(device)
            t = time.perf_counter()
            runner.call()
            returned = time.perf_counter()
            sync(device)
            dt = (time.perf_counter() - t) * 1e3
            runner.reset()
            if i >= warmup:
                times.append(dt)
                enqueues.append((returned - t) * 1e3)
    times.sort()
    return {"median_ms": statistics.median(times), "min_ms": times[0], "max_ms": times[-1],
            "p10_ms": times[len(times) // 10], "p90_ms": times[(len(times) * 9) // 10],
            "enqueue_ms": statistics.median(enqueues), "reps": reps,
            "timer": "perf_counter around a synchronised call"}


@contextmanager
def _without_usdt_lines():
    """Kineto writes a `USDT: ... profiler_start` / `profiler_stop` line to the process's stderr
    (the file descriptor, from C++) at every session, whatever its log level; the rest of what
    is written there meanwhile is passed on when the session ends."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as buf:
        os.dup2(buf.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            buf.seek(0)
            rest = [line for line in buf.read().decode(errors="replace").splitlines(True)
                    if not line.startswith("USDT:")]
            if rest:
                sys.stderr.write("".join(rest))
                sys.stderr.flush()


def capture(runner: Runner, device: str, trace_path: Path) -> float:
    """Profile WAIT+WARMUP+ACTIVE steps; write a gzipped Chrome trace; return profiled ms/step.

    On a GPU this leaves CUPTI attached to the process, and later launches may cost more:
    time before capturing, never after. (Kineto detaches it with TEARDOWN_CUPTI=1, which the
    pipeline does not set: processes with it set hung at exit after their last session;
    benchmarks/probes/README.md, `cupti_probe.py`.)"""
    from torch.profiler import ProfilerActivity, profile, schedule

    cuda = device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    kwargs = {}
    if cuda:
        kwargs["experimental_config"] = torch._C._profiler._ExperimentalConfig(
            enable_cuda_sync_events=True)
    step_times = []
    with _without_usdt_lines(), torch.no_grad(), profile(
            activities=activities, record_shapes=True, with_stack=True,
            schedule=schedule(wait=WAIT, warmup=WARMUP, active=ACTIVE), **kwargs) as prof:
        for i in range(WAIT + WARMUP + ACTIVE):
            t = time.perf_counter()
            runner.call()
            sync(device)
            if i >= WAIT + WARMUP:
                step_times.append((time.perf_counter() - t) * 1e3)
            runner.reset()
            prof.step()
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(raw))
        with open(raw, "rb") as src, tempfile.NamedTemporaryFile(dir=tmp, delete=False) as dst:
            with gzip.GzipFile(fileobj=dst, mode="wb", mtime=0) as gz:
                shutil.copyfileobj(src, gz)
        write_text(trace_path, Path(dst.name).read_bytes())
    return statistics.median(step_times)

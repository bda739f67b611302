"""The screen: run a candidate once against the reference, then time it beside the baseline.

Candidates of one case run in a spawned worker process that builds the case's inputs and times
the baseline (the family reference, which mirrors the Hugging Face code) once, then takes
candidate paths one at a time: a search that picks its next config from the last one's time
(codegen.strategies) pays for the worker once per case, not once per trial. A candidate that
crashes or hangs the worker is logged as such and a fresh worker (without the baseline again)
carries on with the rest.

On Ray (`--workers ray`) each batch of a case's candidates is one task (`RemoteSession`), which
runs the same worker on its node; a node without the run directory screens the sources sent
with the task from a temporary folder.
"""

from __future__ import annotations

import multiprocessing as mp
import signal
import threading
import time
import traceback
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from core.family import Case, Family, result_region

SCREEN_RTOL = {"float32": 1e-4, "float16": 2e-2, "bfloat16": 5e-2}


def _screen_and_time(family_name: str, case: Case, paths: Iterable[str], device: str, conn,
                     baseline: bool = True) -> None:
    """Worker: run each source once, screen it against the reference, time it; each result is
    sent on `conn` (a pipe's end). `paths` may be the pipe's iterator (a session's worker takes
    them as they come)."""
    import torch

    from codegen.registry import get_family
    from core.family import baseline_case_of
    from core.source import load_forward
    from verify.loading import case_params
    from verify.timing import bench, bench_graphed

    family = get_family(family_name)
    gen = torch.Generator(device="cpu").manual_seed(0)
    inputs = family.make_inputs(case, device, gen)
    params = case_params(family, case)
    ref = family.reference(*inputs, **params)
    refs = ref if isinstance(ref, tuple) else (ref,)
    # host_us feeds only the GPU projection; under the CPU interpreter its 51 extra calls of a
    # kernel cost up to a minute per candidate for a number nothing reads
    on_gpu = str(device).startswith("cuda")
    if baseline:
        # what the unpatched model runs: the same values in HF's layout where the two differ
        base_case = baseline_case_of(family, case)
        base_inputs = inputs if base_case == case else family.make_inputs(
            base_case, device, torch.Generator(device="cpu").manual_seed(0))

        def run_baseline():
            family.reference(*base_inputs, **params)

        base = bench(run_baseline, device=device, min_bytes=family.min_bytes(case)).to_dict()
        base["host_us"] = _host_call_us(run_baseline) if on_gpu else None
        # the graph projection's kernel times (verify.timing.bench_graphed); CPU: not measured
        base["graph_ms"], base["graph_note"] = (bench_graphed(run_baseline, device=device)
                                                if on_gpu else (None, None))
        conn.send({"baseline": base})
    for path in paths:
        conn.send({"start": path})
        try:
            fwd = load_forward(path)
            out = family.make_out(case, inputs)
            fwd(*inputs, out=out, **params)
            got = result_region(family, case, out)  # the adapter's buffer may be wider
            outs = got if isinstance(got, tuple) else (got,)
            rtol = SCREEN_RTOL.get(case["dtype"], 1e-2)
            ok = all(torch.allclose(o.float(), r.float(), rtol=rtol, atol=rtol)
                     for o, r in zip(outs, refs))
            entry = {"path": path, "screen": "pass" if ok else "wrong result"}
            if ok:
                def call(fwd=fwd, out=out):
                    fwd(*inputs, out=out, **params)

                def patched_call(fwd=fwd):
                    # what a patched module pays per call: the adapter allocates the output
                    # each time (the baseline's aten ops allocate theirs inside)
                    fwd(*inputs, out=family.make_out(case, inputs), **params)

                entry["timing"] = bench(call, device=device,
                                        min_bytes=family.min_bytes(case)).to_dict()
                entry["host_us"] = _host_call_us(patched_call) if on_gpu else None
                entry["graph_ms"], entry["graph_note"] = (
                    bench_graphed(call, device=device) if on_gpu else (None, None))
        except Exception as e:  # noqa: BLE001 - a failing candidate is a result, not a crash
            entry = {"path": path, "screen": f"error: {type(e).__name__}: {e}"[:300],
                     "trace": traceback.format_exc(limit=3)[-600:]}
        conn.send(entry)


def _session_worker(family_name: str, case: Case, device: str, conn, baseline: bool) -> None:
    """The worker process, deaf to Ctrl-C: a terminal's Ctrl-C reaches the whole foreground
    group, and the caller decides and kills this worker, which must not print a
    KeyboardInterrupt traceback."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOPS)  # held while it was spawned
    _screen_and_time(family_name, case, iter(conn.recv, None), device, conn, baseline)


# what stops a run (Ctrl-C, and SIGTERM as `timeout` and batch schedulers send it)
_STOPS = {signal.SIGINT, signal.SIGTERM}


@contextmanager
def _stops_held() -> Iterator[None]:
    """Ctrl-C and SIGTERM held back while a worker is spawned, then delivered. Stopped in the
    middle, the caller left the worker reading its start-up data from a process that was gone
    (an EOFError traceback on the user's terminal); stopped after it, the caller kills the
    worker. Held twice: Python's handlers only note a stop meanwhile (another thread may take
    the signal and have the main thread run them), and this thread's mask blocks them, which
    the worker inherits, so its own start-up (imports) is deaf to them until
    `_session_worker` takes them back. Python runs handlers in the main thread only: elsewhere
    there is nothing to hold."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    noted: list[int] = []
    handlers = {s: signal.signal(s, lambda signum, frame: noted.append(signum)) for s in _STOPS}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, _STOPS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        for s, handler in handlers.items():
            signal.signal(s, handler)
        if noted:
            signal.raise_signal(noted[0])  # now, to the caller's own handler


def _host_call_us(call, reps: int = 50) -> float:
    """Host time of one call, without waiting for the device: what a launch-bound pass pays
    for this kernel (Triton's launcher, argument checks), used by the projection."""
    import statistics

    call()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        call()
        times.append((time.perf_counter() - t) * 1e6)
    return statistics.median(times)


class ScreenSession:
    """One case's screening worker, kept between calls of `run`."""

    def __init__(self, family: Family, case: Case, device: str, timeout_s: float = 300.0):
        self.family, self.case, self.device, self.timeout_s = family, case, device, timeout_s
        self.baseline: dict | None = None
        self._proc = None
        self._conn = None

    def __enter__(self) -> ScreenSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        # a pipe, not queues: it holds no semaphores, which a run stopped by Ctrl-C (the CLI
        # ends with os._exit) would leave for the resource tracker to warn about
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_session_worker, args=(
            self.family.name, self.case, self.device, child, self.baseline is None))
        with _stops_held():
            self._proc.start()
        child.close()  # the worker's end is the worker's: its death ends the pipe

    def _stop(self, kill: bool) -> None:
        if self._proc is None:
            return
        if kill:
            self._proc.kill()
        else:
            try:
                self._conn.send(None)
            except OSError:  # the worker is gone already
                pass
        self._proc.join(timeout=10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(timeout=10)
        self._conn.close()
        self._proc = self._conn = None

    def _receive(self, deadline: float) -> dict | str | None:
        """The worker's next message; "wait" while it runs and has said nothing for a second;
        None once it died or passed `deadline`."""
        try:
            if self._conn.poll(1.0):
                return self._conn.recv()
        except (EOFError, OSError):
            return None
        return "wait" if self._proc.is_alive() and time.monotonic() < deadline else None

    def close(self) -> None:
        self._stop(kill=False)

    def run(self, jobs: list[dict]) -> list[dict]:
        """The jobs (dicts with "path") screened and timed, in order; a crash or hang fails
        only the candidate that was running. Interrupted, the worker is killed: it must not
        run on without its caller."""
        try:
            return self._run(jobs)
        except BaseException:
            self._stop(kill=True)
            raise

    def _run(self, jobs: list[dict]) -> list[dict]:
        results: dict[str, dict] = {}
        pending = list(jobs)
        while pending:
            if self._proc is None:
                self._start()
            for j in pending:
                self._conn.send(j["path"])
            current = None
            deadline = time.monotonic() + self.timeout_s
            while pending:
                msg = self._receive(deadline)
                if msg == "wait":
                    continue
                deadline = time.monotonic() + self.timeout_s
                if msg is None:  # the worker died (segfault, illegal address) or hung
                    self._stop(kill=True)
                    if current is None:
                        for j in pending:
                            results[j["path"]] = {"screen": "worker failed before any "
                                                            "candidate"}
                    else:
                        results[current] = {"screen": "crashed or hung the worker"}
                    pending = [j for j in pending if j["path"] not in results]
                    break
                if "baseline" in msg:
                    self.baseline = msg["baseline"]
                elif "start" in msg:
                    current = msg["start"]
                else:
                    results[msg["path"]] = msg
                    pending = [j for j in pending if j["path"] not in results]
        return [{**j, **results.get(j["path"], {"screen": "not run"})} for j in jobs]


def screen_and_time(family: Family, case: Case, jobs: list[dict], device: str,
                    timeout_s: float = 300.0) -> tuple[dict | None, list[dict]]:
    """Screen and time `jobs` in one session; (the baseline, their entries)."""
    with ScreenSession(family, case, device, timeout_s) as session:
        entries = session.run(jobs)
        return session.baseline, entries


class RemoteSession:
    """A case's screen on `workers` (verify.workers, Ray): one task per call of `run`."""

    def __init__(self, workers, family: Family, case: Case, device: str,
                 timeout_s: float = 300.0):
        self.workers, self.family, self.case, self.timeout_s = workers, family, case, timeout_s
        # a Ray task sees its one GPU as cuda:0
        self.device = "cuda" if device.startswith("cuda") else device
        self.baseline: dict | None = None

    def close(self) -> None:
        pass

    def run(self, jobs: list[dict]) -> list[dict]:
        texts = {j["path"]: Path(j["path"]).read_text() for j in jobs}
        job = self.workers.submit_call(_screen_anywhere, (
            self.family.name, self.case, jobs, self.device, self.timeout_s, texts),
            self.timeout_s * (len(jobs) + 1))
        try:
            baseline, entries = self.workers.result(job)
        except RuntimeError as e:  # the task failed as a whole (its Ray worker died)
            return [{**j, "screen": f"worker failed before any candidate: {e}"[:300]}
                    for j in jobs]
        self.baseline = self.baseline or baseline
        return entries


def _screen_anywhere(family: Family | str, case: Case, jobs: list[dict], device: str,
                     timeout_s: float, texts: dict[str, str]) -> tuple[dict | None, list[dict]]:
    """screen_and_time where the job runs; on a node without the run directory, the sources
    travel with the job and are screened from a temporary folder (the log keeps the run's
    paths)."""
    import tempfile

    from codegen.registry import get_family

    local, back = [], {}
    folder = None
    for i, j in enumerate(jobs):
        path = j["path"]
        if not Path(path).is_file():
            folder = folder or Path(tempfile.mkdtemp(prefix="screen-src-"))
            copy = folder / f"{i}" / Path(path).name
            copy.parent.mkdir(parents=True)
            copy.write_text(texts[path])
            back[str(copy)] = path
            path = str(copy)
        local.append({**j, "path": path})
    fam = get_family(family) if isinstance(family, str) else family
    baseline, entries = screen_and_time(fam, case, local, device, timeout_s)
    return baseline, [{**e, "path": back.get(e["path"], e["path"])} for e in entries]

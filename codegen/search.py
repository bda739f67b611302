"""Conventional search over a family's parameter space, one recorded case at a time.

Every config is rendered to a readable source file under
`candidates/<family>/<case>/<config>/kernel.py`, run once against the reference (a quick
screen, not the verification), and timed with the verify stage's harness beside the baseline
(the family reference, which mirrors the Hugging Face code) on the same inputs. The search runs
in a worker process: a config that crashes or hangs the worker is logged as such and the search
resumes with the next one. A file the user edited is kept and searched as it is.

The log keeps every candidate tried, its time and spread, kept or discarded, and why, and
where it came from (`source`: "search" here; a proposer's name, and for the built-in language
model proposer its round, for proposals: codegen/proposer.py, codegen/llm_proposer.py).

Backends: "triton" searches `family.search_space`; "cuda" the family's CUDA C++ space
(`Family.cuda`, configs marked {"backend": "cuda"} so their folders differ), or
Triton's where the family has none; "both" the two spaces.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import signal
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from core.family import Case, Family, result_region

SEARCH_SOURCE = "search"
SCREEN_RTOL = {"float32": 1e-4, "float16": 2e-2, "bfloat16": 5e-2}


def case_key(case: Case) -> str:
    short = "-".join(f"{k}{v}" for k, v in sorted(case.items())
                     if isinstance(v, int) and not isinstance(v, bool))
    digest = hashlib.sha1(json.dumps(case, sort_keys=True).encode()).hexdigest()[:6]
    return f"{case.get('dtype', '')}-{short}-{digest}"[:80]


def config_key(config: dict) -> str:
    return "_".join(f"{k}{v}" for k, v in sorted(config.items())) or "default"


def config_backend(config: dict) -> str:
    return config.get("backend", "triton")


def family_backend(family: Family, backend: str) -> str:
    """What `backend` means for this family: CUDA only where it has a CUDA C++ variant."""
    return backend if family.cuda is not None else "triton"


def backend_configs(family: Family, case: Case, backend: str,
                    budget: int | None = None, interpreter: bool = False) -> list[dict]:
    """The configs `backend` searches for `case`; `budget` spreads over each space apart, so
    "both" keeps both backends even with one config per case. Under Triton's CPU interpreter
    one config per case takes the widest tiles: timings mean nothing there, and the run time
    grows with the number of programs (rope's middle config, one head per program, spent 31 s
    verifying tiny-llama's case)."""
    backend = family_backend(family, backend)
    configs = []
    if backend in ("triton", "both"):
        space = family.search_space(case)
        configs += space[-1:] if interpreter and budget == 1 else spread(space, budget)
    if backend in ("cuda", "both"):
        space = family.cuda.search_space(case)
        configs += spread([{**c, "backend": "cuda"} for c in space], budget)
    return configs


def render(family: Family, config: dict, case: Case) -> str:
    if config_backend(config) == "cuda":
        return family.cuda.render(config, case)
    return family.render(config, case)


def write_candidate(family: Family, config: dict, case: Case, path: Path) -> str:
    """Render into `path` unless the user edited the file there; returns its origin."""
    source = render(family, config, case)
    stamp = path.with_suffix(".rendered.sha1")
    digest = hashlib.sha1(source.encode()).hexdigest()
    if path.exists() and stamp.exists() and \
            hashlib.sha1(path.read_bytes()).hexdigest() != stamp.read_text().strip():
        return "user-edited"
    from core.artifacts import write_text

    write_text(path, source)
    write_text(stamp, digest)
    return "generated"


def _screen_worker(*args) -> None:
    """The worker process: `_screen_and_time`, deaf to Ctrl-C. A terminal's Ctrl-C reaches the
    whole foreground group; the caller decides and kills this worker (screen_and_time), which
    must not print a KeyboardInterrupt traceback."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOPS)  # held while it was spawned
    _screen_and_time(*args)


def _screen_and_time(family_name: str, case: Case, paths: list[str], device: str, conn) -> None:
    """Worker: run each source once, screen it against the reference, time it; each result
    is sent on `conn`, a pipe's writing end."""
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
    # what the unpatched model runs: the same values in HF's layout where the two differ
    base_case = baseline_case_of(family, case)
    base_inputs = inputs if base_case == case else family.make_inputs(
        base_case, device, torch.Generator(device="cpu").manual_seed(0))

    def baseline():
        family.reference(*base_inputs, **params)

    # host_us feeds only the GPU projection; under the CPU interpreter its 51 extra calls of a
    # kernel cost up to a minute per candidate for a number nothing reads
    on_gpu = str(device).startswith("cuda")
    base = bench(baseline, device=device, min_bytes=family.min_bytes(case)).to_dict()
    base["host_us"] = _host_call_us(baseline) if on_gpu else None
    # the graph projection's kernel times (verify.timing.bench_graphed); CPU: not measured
    base["graph_ms"], base["graph_note"] = (bench_graphed(baseline, device=device) if on_gpu
                                            else (None, None))
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


def spread(configs: list[dict], budget: int | None) -> list[dict]:
    """At most `budget` configs, evenly spaced over the family's list. Spaces are listed from
    small tiles to large; the first N alone would never try a large tile (the first H200 run
    searched rope's four smallest and reached 36 % of the copy ceiling)."""
    if not budget or budget >= len(configs):
        return list(configs)
    if budget == 1:
        return [configs[len(configs) // 2]]
    step = (len(configs) - 1) / (budget - 1)
    return [configs[round(i * step)] for i in range(budget)]


def search(family: Family, case: Case, root: Path, device: str, max_configs: int | None = None,
           timeout_s: float = 300.0, backend: str = "triton", workers=None) -> dict:
    """Render, screen and time every config for one case; returns the search log entry."""
    return finish_search(submit_search(family, case, root, device, max_configs, timeout_s,
                                       backend, workers))


def submit_search(family: Family, case: Case, root: Path, device: str,
                  max_configs: int | None = None, timeout_s: float = 300.0,
                  backend: str = "triton", workers=None) -> dict:
    """Render the configs and hand the screen to `workers` (verify.workers; default this
    machine): one job per case, so on Ray the cases of a run are screened side by side, each
    case's configs timed one after another on one GPU (their times are compared)."""
    from verify.workers import LocalWorkers

    configs = backend_configs(family, case, backend, max_configs,
                              interpreter=not device.startswith("cuda"))
    folder = root / family.name / case_key(case)
    jobs = []
    for cfg in configs:
        path = folder / config_key(cfg) / "kernel.py"
        origin = write_candidate(family, cfg, case, path)
        # what was screened: a later edit of the file makes a resumed run search the case again
        sha1 = hashlib.sha1(path.read_bytes()).hexdigest()
        jobs.append({"path": str(path), "config": cfg, "backend": config_backend(cfg),
                     "origin": origin, "sha1": sha1, "source": SEARCH_SOURCE})
    workers = workers or LocalWorkers()
    # a Ray task sees its one GPU as cuda:0
    job_device = "cuda" if workers.name == "ray" and device.startswith("cuda") else device
    texts = {j["path"]: Path(j["path"]).read_text() for j in jobs}
    # the family object runs in this process; a Ray task finds it again by name
    which = family.name if workers.name == "ray" else family
    job = workers.submit_call(_screen_anywhere, (which, case, jobs, job_device,
                                                 timeout_s, texts), timeout_s * (len(jobs) + 1))
    return {"family": family, "case": case, "device": device, "backend": backend,
            "workers": workers, "job": job, "jobs": jobs}


def finish_search(pending: dict) -> dict:
    """Wait for a submitted search; its log entry. A screen job that failed as a whole (its
    Ray worker died) fails every config of the case, as a dead local worker does."""
    family, jobs = pending["family"], pending["jobs"]
    try:
        baseline, entries = pending["workers"].result(pending["job"])
    except RuntimeError as e:
        baseline = None
        entries = [{**j, "screen": f"worker failed before any candidate: {e}"[:300]}
                   for j in jobs]
    entry = {"family": family.name, "case": pending["case"], "case_key": case_key(pending["case"]),
             "device": pending["device"], "backend": family_backend(family, pending["backend"]),
             "baseline": baseline, "candidates": entries}
    rank_entries(entry)
    return entry


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


def rank_entries(entry: dict) -> None:
    """Order screened candidates by median time and say why each was kept or discarded."""
    timed = sorted((e for e in entry["candidates"] if e.get("timing")),
                   key=lambda e: e["timing"]["median_ms"])
    for e in entry["candidates"]:
        e["decision"] = f"discarded: {e['screen']}"
    for rank, e in enumerate(timed):
        e["decision"] = "best" if rank == 0 else "slower than best"
    entry["order"] = [e["path"] for e in timed]


def screen_and_time(family: Family, case: Case, jobs: list[dict], device: str,
                    timeout_s: float = 300.0) -> tuple[dict | None, list[dict]]:
    """Run the jobs (dicts with "path") in worker processes; a crash or hang fails only the
    candidate that was running, and a fresh worker carries on with the rest."""
    results: dict[str, dict] = {}
    baseline = None
    pending = list(jobs)
    ctx = mp.get_context("spawn")
    while pending:
        # a pipe, not a Queue: it holds no semaphores, which a run stopped by Ctrl-C (the CLI
        # ends with os._exit) would leave for the resource tracker to warn about
        reader, writer = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_screen_worker,
                           args=(family.name, case, [j["path"] for j in pending], device,
                                 writer))
        with _stops_held():
            proc.start()
        writer.close()  # the child's copy is the only writer: its death ends the pipe
        try:
            pending, said = _collect(reader, proc, pending, results, timeout_s)
        except BaseException:
            proc.kill()  # interrupted: the worker must not run on without its caller
            raise
        finally:
            reader.close()
        baseline = said or baseline
        proc.join(timeout=10)
    entries = [{**j, **results.get(j["path"], {"screen": "not run"})} for j in jobs]
    return baseline, entries


def _collect(reader, proc, pending: list[dict], results: dict[str, dict],
             timeout_s: float) -> tuple[list[dict], dict | None]:
    """One worker's messages into `results`, until it has screened every pending job, died or
    hung (`timeout_s` without a word); the jobs a fresh worker is to run, and the baseline
    it timed (None if it did not)."""
    current = baseline = None
    deadline = time.monotonic() + timeout_s
    while True:
        msg = _receive(reader, proc, deadline)
        if msg == "wait":
            continue
        if msg is None:  # the worker died (segfault, illegal address) or hung
            proc.kill()
            if current is None:
                for j in pending:
                    results[j["path"]] = {"screen": "worker failed before any candidate"}
            else:
                results[current] = {"screen": "crashed or hung the worker"}
            return [j for j in pending if j["path"] not in results], baseline
        deadline = time.monotonic() + timeout_s
        if "baseline" in msg:
            baseline = msg["baseline"]
        elif "start" in msg:
            current = msg["start"]
        else:
            results[msg["path"]] = msg
            if all(j["path"] in results for j in pending):
                return [], baseline


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
    `_screen_worker` takes them back. Python runs handlers in the main thread only: elsewhere
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


def _receive(reader, proc, deadline: float) -> dict | str | None:
    """The worker's next message; "wait" while it runs and has said nothing for a second;
    None once it died or passed `deadline`."""
    try:
        if reader.poll(1.0):
            return reader.recv()
    except EOFError:
        return None
    return "wait" if proc.is_alive() and time.monotonic() < deadline else None

"""Warm Triton's on-disk cache before a GPU search: the candidates compiled side by side.

A search times its candidates one after another on one GPU (codegen.search, codegen.screen),
and on a cold cache each candidate's first call compiles it, one at a time, on one of the
host's cores, while the others wait (an H100 run spent 11-15 s on each case:
benchmarks/results/e2e-b8-1207c-h100/optimize-*.log). Before the generate stage's searches,
`warm_before_search` calls every candidate they will try once, in a pool of spawned worker
processes, so that the compiles land in Triton's cache (TRITON_CACHE_DIR, or ~/.triton/cache)
and the search loads them. Nothing here is timed, and the pool has ended before the first
timing starts.

Which candidates (`planned_configs`): what the case's own `CaseSearch` will try, asked of it,
in its order: memory, edited and guessed seeds first, then a grid's configs (spread over the
space where `max_configs` is smaller) or a random search's seeded order, within the trial
budget. TPE picks from the times it is told, and a proposer may swap a sampled pick for
another, so there every config of the space is warmed (the seeds first): one compile too many
costs a share of one of the pool's processes, one too few a whole compile in the sequential
search. A case whose remembered best is reused is not searched and warms nothing. A CUDA C++
case holds one source for all its configs (codegen/cuda_build.py), so one of them is warmed.

How: each candidate is rendered to the very file the search will screen (write_candidate: a
user's edit is kept), then imported and called once on the case's inputs as the screen calls
it (`warm_one`: make_inputs with the same seed, make_out, the case's params). Triton keys its
cache on the kernel's source and starting line, its constexprs and launch options, and each
argument's dtype, alignment and integer class, all of which the call itself fixes.
`JITFunction.warmup` would compile without launching, but it takes a kernel's own arguments
and grid, and only a candidate's `forward` knows which kernels it launches with which (several,
some picked by size); the launch the call adds costs microseconds.

The pool: min(candidates, cores // 2, 8) processes (PIPELINE_WARM_COMPILE=N sets N,
PIPELINE_WARM_COMPILE=0 turns the warm-up off; it never runs off a GPU or under Triton's
interpreter, where nothing compiles, nor on Ray, whose searches run elsewhere). A process keeps
one case's inputs and is given that case's next candidate while it has one. A failure is
ignored (the search meets and reports it); a candidate that runs longer than
KERNEL_TIMEOUT_S (from when its process took it up: a process's start, importing torch and
making a CUDA context, is not its candidate's), or a warm-up past TOTAL_TIMEOUT_S, has its
process killed with its process group (the compiler's own subprocesses), and a fresh one
takes the rest. What was compiled stays; the search compiles what was not.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from multiprocessing.connection import wait
from pathlib import Path

from codegen.screen import _STOPS, _stops_held
from core.family import Case, Family

ENV = "PIPELINE_WARM_COMPILE"
MAX_PROCESSES = 8
# one candidate: its case's inputs where they are new to the process, its compile and one call;
# a matmul config with deep pipelining compiles in seconds, not minutes
KERNEL_TIMEOUT_S = 120.0
TOTAL_TIMEOUT_S = 300.0
_OFF = ("0", "off", "false", "no")


def skip_reason(device: str) -> str | None:
    """Why no warm-up runs for `device`, or None where it does."""
    if not str(device).startswith("cuda") or os.environ.get("TRITON_INTERPRET") == "1":
        return "nothing compiles off a GPU"
    if os.environ.get(ENV, "").strip().lower() in _OFF:
        return f"{ENV}=0"
    return None


def pool_size(jobs: int) -> int:
    """Processes for `jobs` candidates: the env's number, else min(jobs, cores // 2, 8); fewer
    than two (a small host) is no pool: one process compiles no faster than the search."""
    asked = os.environ.get(ENV, "").strip()
    if asked.isdigit() and int(asked) > 0:
        return min(int(asked), jobs)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
        else os.cpu_count() or 1
    n = min(jobs, cores // 2, MAX_PROCESSES)
    return n if n >= 2 else 0


def planned_configs(search) -> list[dict]:
    """The configs `search` (a codegen.search.CaseSearch not yet run) will try, in its order;
    for an adaptive strategy or one with a proposer, its seeds and then the rest of its space
    (module docstring). Nothing where it will reuse its remembered best."""
    if search.reusable() is not None:
        return []
    s = search.strategy
    if not s.adaptive:
        picks = [c for c, _ in s.planned_picks()]
        if search.proposer is None:
            return picks
    else:
        picks = s.seeds[:s.budget]
    return picks + [c for c in search.space if c not in picks]


def plan_jobs(cases: list[tuple[Family, Case]], root: Path, device: str, *,
              max_configs: int | None = None, backend: str = "triton", plan=None,
              proposer=None, say: Callable[[str], None] | None = None) -> list[dict]:
    """One job per candidate to warm, cases in order, each case's candidates in its search's
    order, their files written as the search will write them. A case whose plan fails is left
    to its search, which reports why."""
    from codegen.search import CaseSearch, case_key, config_backend, write_candidate
    from codegen.strategies import SearchPlan

    plan = plan or SearchPlan()
    if max_configs is not None:  # as codegen.search.submit_search does
        plan = replace(plan, trials=max_configs)
    jobs = []
    for family, case in cases:
        try:
            search = CaseSearch(family, case, root, device, plan, None, backend, proposer, say)
            configs = planned_configs(search)
        except Exception:  # noqa: BLE001 - the search meets it again and reports it
            continue
        cuda_done = False
        for config in configs:
            if config_backend(config) == "cuda":
                if cuda_done:  # one source for every CUDA config of the case: one build
                    continue
                cuda_done = True
            path = search._path(config)
            write_candidate(family, config, case, path)
            jobs.append({"family": family.name, "case": case, "path": str(path),
                         "group": f"{family.name}/{case_key(case)}"})
    return jobs


def warm_one(job: dict, device: str, held: dict) -> None:
    """Call the candidate at job["path"] once on its case's inputs, as the screen does
    (codegen.screen._screen_and_time); `held`: this process's inputs of the last case."""
    import torch

    from codegen.registry import get_family
    from core.source import load_forward
    from verify.loading import case_params

    family, case = get_family(job["family"]), job["case"]
    if held.get("group") != job["group"]:
        held.clear()  # the last case's tensors freed before the next case's are made
        gen = torch.Generator(device="cpu").manual_seed(0)
        held.update(group=job["group"], inputs=family.make_inputs(case, device, gen),
                    params=case_params(family, case))
    inputs = held["inputs"]
    fwd = load_forward(job["path"])
    fwd(*inputs, out=family.make_out(case, inputs), **held["params"])
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()  # a launch error surfaces here, on its own candidate


def _die_with_parent() -> None:
    """SIGKILL this process when the one that started it dies (Linux): a warm-up killed from
    outside must not leave its compiles running."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _cuda_broken(device: str) -> bool:
    if not str(device).startswith("cuda"):
        return False
    try:
        import torch

        torch.cuda.synchronize()
        return False
    except Exception:  # noqa: BLE001 - an illegal address leaves the context unusable
        return True


def _worker(device: str, conn, call: Callable) -> None:
    """A pool process: its own process group (killed as one), deaf to Ctrl-C (the caller
    decides and kills it), one job at a time from `conn`, "ok" or a failure sent back."""
    try:
        os.setpgid(0, 0)
    except OSError:  # then `_kill` kills the process alone
        pass
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOPS)  # held while it was spawned
    held: dict = {}
    try:
        for job in iter(conn.recv, None):
            conn.send("start")  # its time limit starts now, not at the process's start
            try:
                call(job, device, held)
                conn.send("ok")
            except Exception:  # noqa: BLE001 - ignored here: the search meets and reports it
                if not _cuda_broken(device):
                    conn.send("failed")
                    continue
                conn.send("failed, exiting")  # a fresh process takes the next job
                return
    except (EOFError, OSError):  # the caller is gone
        pass


@dataclass
class _Slot:
    proc: mp.Process
    conn: object
    job: dict | None = None
    since: float | None = None  # when the process started the job
    group: str | None = None


def _start(ctx, device: str, call: Callable) -> _Slot:
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_worker, args=(device, child, call), name="warm-compile")
    with _stops_held():  # codegen.screen: a stop mid-spawn would strand the child
        proc.start()
    child.close()
    return _Slot(proc, conn)


def _kill(slot: _Slot) -> None:
    """Kill the process and its group (the compiler's subprocesses) before it is reaped, so
    its id cannot have been given to another process."""
    try:
        os.killpg(slot.proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # not yet its own group leader
        slot.proc.kill()
    slot.proc.join(timeout=10)
    slot.conn.close()


def _stop(slot: _Slot) -> None:
    if slot.job is None:
        try:
            slot.conn.send(None)
        except OSError:
            pass
        slot.proc.join(timeout=5)
    if slot.proc.exitcode is None:  # busy, or deaf to the request
        _kill(slot)
    else:
        slot.conn.close()


def _next_job(todo: list[dict], slot: _Slot, slots: list[_Slot]) -> dict | None:
    """The slot's case's next candidate, else one of a case no other process holds, else the
    first: a process builds few cases' inputs, and the cases spread over the pool."""
    held = {s.group for s in slots if s is not slot and s.job is not None}
    for fits in (lambda j: j["group"] == slot.group, lambda j: j["group"] not in held,
                 lambda j: True):
        for i, j in enumerate(todo):
            if fits(j):
                return todo.pop(i)
    return None


def warm(jobs: list[dict], device: str, processes: int,
         kernel_timeout_s: float = KERNEL_TIMEOUT_S, total_timeout_s: float = TOTAL_TIMEOUT_S,
         call: Callable = warm_one) -> Counter:
    """Run `call(job, device, held)` for every job in `processes` spawned processes; how
    many were "ok", "failed", "timed out", and "not finished" at the total timeout."""
    ctx = mp.get_context("spawn")  # never fork a process that has initialised CUDA
    todo, counts, slots = list(jobs), Counter(), []
    deadline = time.monotonic() + total_timeout_s

    def give(slot: _Slot) -> None:
        slot.job = _next_job(todo, slot, slots)
        if slot.job is not None:
            slot.group, slot.since = slot.job["group"], None
            try:
                slot.conn.send(slot.job)
            except OSError:  # it died meanwhile: the wait below finds it gone
                pass

    try:
        for _ in range(min(processes, len(todo))):
            slots.append(_start(ctx, device, call))
        for slot in slots:
            give(slot)
        while any(s.job is not None for s in slots) and time.monotonic() < deadline:
            busy = [s for s in slots if s.job is not None]
            ready = wait([s.conn for s in busy], timeout=1.0)
            for slot in busy:
                if slot.conn in ready:
                    try:
                        msg = slot.conn.recv()
                    except (EOFError, OSError):  # it died (a segfault, say)
                        msg = "failed, died"
                    if msg == "start":
                        slot.since = time.monotonic()
                        continue
                elif slot.since is not None and time.monotonic() - slot.since > kernel_timeout_s:
                    msg = "timed out"
                else:
                    continue
                counts[msg.split(",")[0]] += 1
                slot.job = None
                if msg not in ("ok", "failed"):  # hung or gone: a fresh process goes on
                    _kill(slot)
                    slots.remove(slot)
                    if not todo:
                        continue
                    slot = _start(ctx, device, call)
                    slots.append(slot)
                give(slot)
    finally:
        counts["not finished"] += len(todo) + sum(s.job is not None for s in slots)
        for slot in slots:
            _stop(slot)
    return counts


def warm_before_search(cases: list[tuple[Family, Case]], root: Path, device: str,
                       say: Callable[[str], None], **how) -> Counter | None:
    """Warm the candidates of `cases` (codegen.search.search's `how`: max_configs, backend,
    plan, proposer) where a warm-up runs; one progress line while it runs and one after."""
    if skip_reason(device) is not None or not cases:
        return None
    try:
        jobs = plan_jobs(cases, root, device, say=say, **how)
    except Exception:  # noqa: BLE001 - the searches meet the same problem and report it
        return None
    n = pool_size(len(jobs))
    if not n:
        return None
    start = time.monotonic()
    say(f"warm compile: {len(jobs)} kernels in {n} processes")
    try:
        counts = warm(jobs, device, n)
    except Exception as e:  # noqa: BLE001 - a warm-up never fails the stage it speeds up
        say(f"warm compile: stopped ({type(e).__name__}: {e}); the search compiles alone")
        return None
    missed = ", ".join(f"{counts[k]} {k}" for k in ("failed", "timed out", "not finished")
                       if counts[k])
    say(f"warm compile: {len(jobs)} kernels in {n} processes, "
        f"{time.monotonic() - start:.1f} s" + (f" ({missed}; the search compiles them)"
                                                if missed else ""))
    return counts


"""Isolation: each candidate is verified in its own process, under a deadline.

A candidate is generated code; it may raise, fail to compile, segfault, abort, call os._exit, hit
an illegal memory access or never return. None of that may take the caller down, so the check
suite (verify/checks.py) runs in a child process that reports as it goes, and the caller turns a
death or a missed deadline into a failed check and moves on.

Children come from a zygote: one server process per caller (`serve()`, started on first use)
that imports torch, triton and the checks once and then forks a fresh child per candidate. A
spawned interpreter would cost ~2 s of imports per candidate; a fork costs milliseconds. The
zygote never runs a kernel or touches CUDA, so CUDA initialises cleanly in each child, and unlike
multiprocessing's spawn/forkserver it never re-executes the caller's __main__ (no
`if __name__ == "__main__"` guard needed by callers). Each child starts its own session, so a
timeout kills everything it started.

A job is a temporary folder: request.json in; messages.jsonl (one JSON [kind, payload] per line,
flushed as the suite goes), worker.log (the child's stdout/stderr and faulthandler output) and
exit (the exit status, written by the zygote when it reaps the child) out.

Isolation protects the caller and the other candidates, not the verdict against code written to
subvert the verifier from inside its own process; that would need a sandbox, not a harness.
"""

from __future__ import annotations

import atexit
import faulthandler
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# torch._dynamo: imported lazily by the first TorchDispatchMode use (~1 s per child otherwise);
# triton.experimental.gluon: by the interpreter's first launch.
_PRELOAD = ("verify.checks", "torch._dynamo", "triton", "triton.language",
            "triton.experimental.gluon")
_LOG_TAIL_CHARS = 3000
_POLL_S = 0.05


@dataclass
class WorkerOutcome:
    status: str  # "done" | "crash" | "timeout" | "error" (the verifier itself failed)
    messages: list[tuple[str, Any]] = field(default_factory=list)
    exitcode: int | None = None
    log_tail: str = ""
    elapsed_s: float = 0.0
    worker: dict = field(default_factory=dict)  # which backend ran it (verify.workers)

    @property
    def last_phase(self) -> str:
        phases = [m[1] for m in self.messages if m[0] == "phase"]
        return phases[-1] if phases else "start-up"

    def describe_exit(self) -> str:
        if self.exitcode is None:
            return "ended without an exit status"
        if self.exitcode < 0:
            try:
                return f"killed by {signal.Signals(-self.exitcode).name}"
            except ValueError:
                return f"killed by signal {-self.exitcode}"
        return f"exited with status {self.exitcode}"


# -- inside the zygote and its children -------------------------------------------------------

def serve() -> None:
    """The zygote: read job folders (one per line) on stdin, fork a child for each, answer its
    pid on stdout, reap children and write their exit status into their job folder."""
    # Ctrl-C is the caller's to handle: it ends the children by closing stdin or by killing
    # their group; a KeyboardInterrupt here (and in the children forked from here, which
    # inherit this) only printed a traceback into the user's terminal
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for module in _PRELOAD:
        try:
            __import__(module)
        except ImportError:
            pass  # no triton: candidates that need it fail in their own process
    children: dict[int, str] = {}
    buffer = b""
    while True:
        _reap(children)
        ready, _, _ = select.select([0], [], [], 0.2)
        if not ready:
            continue
        chunk = os.read(0, 65536)
        if not chunk:  # the caller is gone: take its unfinished children with it
            for pid in children:
                _kill_group(pid)
            return
        buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            job = line.decode()
            pid = os.fork()
            if pid == 0:
                _child(job)  # never returns
            children[pid] = job
            try:
                os.write(1, f"{pid}\n".encode())
            except BrokenPipeError:  # the caller died (killed at a time limit): as on EOF
                for child in children:
                    _kill_group(child)
                return


def _reap(children: dict[int, str]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        job = children.pop(pid, None)
        if job is not None:
            try:
                Path(job, "exit").write_text(str(os.waitstatus_to_exitcode(status)))
            except OSError:
                pass  # the caller already gave up on this job and removed its folder


def _child(job: str) -> None:
    """A forked child: run the suite for the request in `job`, then _exit (never return into the
    zygote's loop)."""
    try:
        _isolate(job)
        with open(os.path.join(job, "messages.jsonl"), "a") as messages:

            def emit(kind: str, payload: Any) -> None:
                messages.write(json.dumps([kind, payload], default=str) + "\n")
                messages.flush()

            try:
                request = json.loads(Path(job, "request.json").read_text())
                # The zygote kept the caller's environment and path of its own start; the
                # caller's may have changed since (TRITON_INTERPRET is read when kernels launch;
                # test folders join sys.path).
                os.environ.clear()
                os.environ.update(request["env"])
                sys.path[:] = request["sys_path"]
                os.chdir(request["cwd"])
                # which machine and GPU judged it: with several GPUs (the Ray backend) the record
                # must say where its timings came from; sent first, so a crash keeps it
                emit("device", device_identity(request["device"]))
                from verify.checks import Suite

                Suite(request, emit).run()
                emit("done", None)
            except BaseException:  # noqa: BLE001 - reported to the caller, which decides
                emit("error", traceback.format_exc()[-_LOG_TAIL_CHARS:])
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def device_identity(device: str) -> dict:
    """Hostname and, on CUDA, the GPU's name, UUID and PCI bus id (as nvidia-smi shows them)."""
    import socket

    ident: dict[str, Any] = {"hostname": socket.gethostname(), "gpu": None}
    if not str(device).startswith("cuda"):
        return ident
    try:
        import torch

        props = torch.cuda.get_device_properties(torch.device(device))
        bus = [getattr(props, f"pci_{k}_id", None) for k in ("domain", "bus", "device")]
        ident["gpu"] = {
            "name": props.name, "uuid": str(getattr(props, "uuid", "")) or None,
            "pci_bus_id": f"{bus[0]:08x}:{bus[1]:02x}:{bus[2]:02x}.0".upper()
            if None not in bus else None,
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}
    except Exception as e:  # noqa: BLE001 - the identity is a note; the checks say the rest
        ident["gpu"] = {"error": f"{type(e).__name__}: {e}"[:200]}
    return ident


def _isolate(job: str) -> None:
    """Own session (a timeout kills the whole group), no core files, output into the job's log,
    and a Python traceback there on a fatal signal."""
    os.setsid()
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    except (ImportError, ValueError, OSError):
        pass
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    log = os.open(os.path.join(job, "worker.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    faulthandler.enable(file=sys.stderr, all_threads=True)


# -- in the caller ----------------------------------------------------------------------------

class _Zygote:
    def __init__(self) -> None:
        code = (f"import sys; sys.path[:0] = {sys.path!r}; "
                "from verify.worker import serve; serve()")
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, start_new_session=True)

    def start(self, job: str) -> int | None:
        try:
            self.proc.stdin.write(f"{job}\n".encode())
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except (BrokenPipeError, OSError):
            return None
        return int(line) if line.strip() else None

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()


_zygote: _Zygote | None = None
_zygote_lock = threading.Lock()


def _start_child(job: str) -> int:
    global _zygote
    with _zygote_lock:
        for _ in range(2):  # a zygote that died (OOM killer, say) is replaced once
            if _zygote is None or _zygote.proc.poll() is not None:
                _zygote = _Zygote()
                atexit.register(_zygote.close)
            pid = _zygote.start(job)
            if pid is not None:
                return pid
            _zygote = None
    raise RuntimeError("the verify worker server did not start (its stderr is this process's); "
                       "check that `python -c 'import verify.checks'` works")


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        try:
            os.kill(pid, signal.SIGKILL)  # killed before its setsid
        except OSError:
            pass


class _Lines:
    """Complete lines appended to a file so far (a line cut short by a crash is not one)."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset = path, 0

    def read(self) -> list:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1
        self.offset += end
        return [tuple(json.loads(line)) for line in data[:end].splitlines() if line.strip()]


def caller_context() -> dict:
    """What a child takes from its caller: environment, import path and folder."""
    return {"env": dict(os.environ), "sys_path": list(sys.path), "cwd": os.getcwd()}


def run_isolated(request: dict, timeout_s: float, context: dict | None = None) -> WorkerOutcome:
    """Run the check suite for one candidate in a fresh child; never raises for anything the
    candidate does. `request`: family (spec), source, cases, device, seed, trials, timing.
    `context`: env, sys_path and cwd for the child (default: this process's)."""
    job = Path(tempfile.mkdtemp(prefix="verify-job-"))
    full = {**request, **(context or caller_context())}
    (job / "request.json").write_text(json.dumps(full, default=str))
    outcome = WorkerOutcome(status="crash")
    start = time.monotonic()
    pid = None
    try:
        pid = _start_child(str(job))
        lines, exit_file = _Lines(job / "messages.jsonl"), job / "exit"
        while True:
            exited = exit_file.exists()  # checked before reading, so no message is missed
            outcome.messages += lines.read()
            final = [m[0] for m in outcome.messages if m[0] in ("done", "error")]
            if final:
                outcome.status = final[0]
                break
            if exited:
                break  # died without finishing: a crash
            if time.monotonic() - start > timeout_s:
                outcome.status = "timeout"
                _kill_group(pid)
                break
            time.sleep(_POLL_S)
        deadline = time.monotonic() + 5
        while not exit_file.exists() and time.monotonic() < deadline:
            time.sleep(_POLL_S)
        if exit_file.exists():
            outcome.exitcode = int(exit_file.read_text() or 0)
        log = (job / "worker.log")
        outcome.log_tail = log.read_text(errors="replace")[-_LOG_TAIL_CHARS:] \
            if log.exists() else ""
    except BaseException:
        # interrupted (Ctrl-C, or a Ray task cancelled after another candidate was accepted):
        # the child must not run on, holding its GPU, after its caller stopped waiting
        if pid is not None:
            _kill_group(pid)
        raise
    finally:
        outcome.elapsed_s = time.monotonic() - start
        shutil.rmtree(job, ignore_errors=True)
    return outcome

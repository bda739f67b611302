"""Where isolated work runs: this machine one job at a time ("local"), or Ray tasks ("ray").

Both backends take the same jobs: a candidate's check suite (`submit_isolated`, judged in
verify.worker's isolated child) or a plain function such as the config screen
(`submit_call`). `result` waits for one job, `cancel` drops one no longer wanted, `drain` waits
until nothing is left running (before a whole-model timing on the driver's GPU).

Local jobs are lazy: a job runs when its result is asked for, so a caller that stops at the
first accepted candidate runs no more than it did before backends existed.

On Ray every job is one task holding one GPU (`num_gpus=1`) where the cluster has GPUs, one
CPU otherwise. A candidate still runs inside the task through verify.worker's isolated child,
under the same deadline, so a segfault or a hang kills that child and not the Ray worker: the
other candidates and the cluster carry on. The candidate's source travels with the task, so
a node without the run directory verifies the same file.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.errors import UserError
from verify.worker import WorkerOutcome, caller_context, run_isolated

BACKENDS = ("local", "ray")
RAY_INSTALL = "pip install 'kernel-pipeline[ray]'"
# Seconds a Ray task may take beyond the candidate's own deadline before the driver gives up
# on it: a new Ray worker imports torch and starts its zygote (~10 s on a loaded 2-core CI box)
RAY_START_S = 120.0
# environment the driver passes on to the isolated child on a Ray node (TRITON_INTERPRET is
# read when a kernel launches); CUDA_VISIBLE_DEVICES stays the one Ray set for the task
_FORWARD_ENV = ("TRITON_", "TORCH_", "PYTORCH_", "PIPELINE_", "CUDA_LAUNCH_BLOCKING",
                "HF_HUB_OFFLINE")


@dataclass
class Job:
    kind: str  # "isolated" | "call"
    args: tuple
    guard_s: float
    started: float = field(default_factory=time.monotonic)
    ref: Any = None  # the Ray ObjectRef
    done: Any = None


class LocalWorkers:
    """Today's path: each job in this process's isolated worker (or call), in order."""

    name = "local"
    parallel = False

    def submit_isolated(self, request: dict, timeout_s: float) -> Job:
        return Job("isolated", (request, timeout_s), timeout_s)

    def submit_call(self, fn: Callable, args: tuple, guard_s: float) -> Job:
        return Job("call", (fn, args), guard_s)

    def result(self, job: Job) -> Any:
        if job.done is None:
            job.started = time.monotonic()
            if job.kind == "isolated":
                outcome = run_isolated(*job.args)
                outcome.worker = {"backend": self.name}
                job.done = outcome
            else:
                fn, args = job.args
                job.done = fn(*args)
        return job.done

    def cancel(self, job: Job) -> None:
        pass  # never started

    def drain(self) -> None:
        pass

    def close(self) -> None:
        pass


class RayWorkers:
    """One Ray task per job, on a cluster at `address` (or RAY_ADDRESS), else a local Ray."""

    name = "ray"
    parallel = True

    def __init__(self, address: str | None = None, gpu: bool | None = None) -> None:
        ray = import_ray()
        self.started_ray = not ray.is_initialized()
        if self.started_ray:
            try:
                ray.init(address=address or None, include_dashboard=False,
                         log_to_driver=False, configure_logging=False)
            except Exception as e:  # noqa: BLE001 - Ray raises bare Exception here
                ray.shutdown()
                where = address or os.environ.get("RAY_ADDRESS") or "a local Ray"
                raise UserError(
                    f"--workers ray: could not start or join {where}: {str(e)[:300]} (on a "
                    "loaded machine a local Ray can time out starting, ray-project/ray#65983: "
                    "start one with `ray start --head` and pass --ray-address)") from None
        resources = ray.cluster_resources()
        if gpu is None:
            gpu = resources.get("GPU", 0) >= 1
        elif gpu and resources.get("GPU", 0) < 1:  # tasks asking for one would wait forever
            if self.started_ray:
                ray.shutdown()
            raise UserError(f"--workers ray: the Ray cluster has no GPU for a GPU run "
                            f"(resources: {resources})")
        self.resources = {"num_gpus": 1} if gpu else {"num_cpus": 1}
        self._isolated = ray.remote(max_retries=0, **self.resources)(_ray_isolated)
        self._call = ray.remote(max_retries=0, **self.resources)(_ray_call)
        self.outstanding: list[Any] = []

    def submit_isolated(self, request: dict, timeout_s: float) -> Job:
        source = Path(request["source"])
        try:
            text = source.read_text()
        except OSError:
            text = None  # the child reports the missing file as a failed load
        context = {"env": _forwarded_env(), "sys_path": list(sys.path), "cwd": os.getcwd()}
        job = Job("isolated", (), timeout_s + RAY_START_S)
        job.ref = self._isolated.remote(request, timeout_s, text, context)
        self.outstanding.append(job.ref)
        return job

    def submit_call(self, fn: Callable, args: tuple, guard_s: float) -> Job:
        job = Job("call", (), guard_s + RAY_START_S)
        job.ref = self._call.remote(fn, args, _forwarded_env())
        self.outstanding.append(job.ref)
        return job

    def result(self, job: Job) -> Any:
        if job.done is not None:
            return job.done
        import ray
        from ray.exceptions import GetTimeoutError, RayError

        try:
            job.done = ray.get(job.ref, timeout=job.guard_s)
        except GetTimeoutError:
            ray.cancel(job.ref, force=True)
            job.done = self._failure("timeout", f"no answer from the Ray task after "
                                                f"{job.guard_s:g} s; task cancelled", job)
        except RayError as e:  # the Ray worker itself died or the task was cancelled
            job.done = self._failure("crash", f"Ray task failed: {type(e).__name__}: "
                                              f"{str(e)[-2000:]}", job)
        return job.done

    def _failure(self, status: str, text: str, job: Job) -> Any:
        if job.kind == "call":
            raise RuntimeError(text)
        return WorkerOutcome(status=status, log_tail=text,
                             elapsed_s=time.monotonic() - job.started,
                             worker={"backend": self.name})

    def cancel(self, job: Job) -> None:
        if job.done is None:
            import ray

            ray.cancel(job.ref)  # a running task is interrupted; run_isolated kills its child

    def drain(self, timeout_s: float = 600.0) -> None:
        """Wait until every task submitted so far has ended (cancelled ones included)."""
        import ray

        if self.outstanding:
            ray.wait(self.outstanding, num_returns=len(self.outstanding), timeout=timeout_s)
        self.outstanding = []

    def close(self) -> None:
        self.drain()
        if self.started_ray:
            import ray

            ray.shutdown()


def _forwarded_env() -> dict:
    return {k: v for k, v in os.environ.items() if k.startswith(_FORWARD_ENV)}


def import_ray():
    try:
        import ray
    except ImportError:
        raise UserError(f"--workers ray needs Ray: {RAY_INSTALL}") from None
    return ray


def make_workers(backend: str = "local", address: str | None = None,
                 gpu: bool | None = None) -> LocalWorkers | RayWorkers:
    if backend == "local":
        return LocalWorkers()
    if backend == "ray":
        return RayWorkers(address, gpu)
    raise UserError(f"unknown workers backend {backend!r} (choose from {', '.join(BACKENDS)})")


# -- inside a Ray task ------------------------------------------------------------------------

def _ray_isolated(request: dict, timeout_s: float, text: str | None,
                  driver: dict) -> WorkerOutcome:
    import ray

    if text is not None and not Path(request["source"]).is_file():
        folder = tempfile.mkdtemp(prefix="verify-src-")
        path = Path(folder) / Path(request["source"]).name
        path.write_text(text)
        request = {**request, "source": str(path)}
    if str(request["device"]).startswith("cuda"):
        request = {**request, "device": "cuda"}  # the task sees its one GPU as cuda:0
    here = caller_context()
    # the driver's import path first (test folders, a source checkout), where this node has it
    path = [p for p in driver["sys_path"] if p and os.path.isdir(p)]
    context = {"env": {**here["env"], **driver["env"]},
               "sys_path": path + [p for p in here["sys_path"] if p not in path],
               "cwd": driver["cwd"] if os.path.isdir(driver["cwd"]) else here["cwd"]}
    outcome = run_isolated(request, timeout_s, context)
    outcome.worker = {"backend": "ray", "ray_node_id": ray.get_runtime_context().get_node_id()}
    return outcome


def _ray_call(fn: Callable, args: tuple, env: dict) -> Any:
    os.environ.update(env)  # read by the processes the call starts (the screen's worker)
    return fn(*args)


Workers = LocalWorkers | RayWorkers

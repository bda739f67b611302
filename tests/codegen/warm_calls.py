"""Stand-ins for codegen.warm_compile.warm_one, run in the warm-up's spawned processes (which
import them by name, so they live in a module of their own): each leaves a marker file with
its process id, and the job's "do" says whether it fails, dies, or hangs (with a child process
in its group, as a compiler's subprocess would be)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path


def marker(job: dict, device: str, held: dict) -> None:
    folder = Path(job["path"])
    (folder / f"{job['name']}.pid").write_text(str(os.getpid()))
    do = job.get("do")
    if do == "fail":
        raise RuntimeError("out of resources: shared memory")
    if do == "die":
        os._exit(3)  # what a segfault does to the process
    if do == "hang":
        child = subprocess.Popen(["sleep", "600"])
        (folder / f"{job['name']}.child").write_text(str(child.pid))
        time.sleep(600)
    time.sleep(job.get("sleep", 0.0))

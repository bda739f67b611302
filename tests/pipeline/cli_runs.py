"""`pipeline ...` run as a user runs it: a fresh interpreter in `home`, offline, the runs
folder inside `home`, this checkout first on the path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_cli(*args, home: Path):
    return subprocess.run(
        [sys.executable, "-m", "pipeline", *args], capture_output=True, text=True, cwd=home,
        timeout=600,
        env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "HOME": str(home),
             "PIPELINE_RUNS": str(home / "runs"), "PYTHONPATH": os.pathsep.join(
                 [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])})

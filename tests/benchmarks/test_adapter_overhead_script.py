"""benchmarks/adapter_overhead.py --rendered: each rendered forward is timed with its kernel
launch replaced by a no-op. Under the Triton interpreter a real launch of any of these takes
milliseconds, so a forward that still launched (its launcher renamed, say) would show here."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "adapter_overhead.py"


def test_rendered_forwards_are_timed_without_their_launch():
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, str(SCRIPT), "--rendered"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": path, "TRITON_INTERPRET": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = {m.group(1): float(m.group(2)) for m in re.finditer(
        r"^(\w+)\s+rendered forward, no-op launch:\s+([\d.]+) us/call", proc.stdout, re.M)}
    assert set(got) == {"rmsnorm", "add_rmsnorm", "rope", "matmul_epilogue"}
    assert all(0 < us < 200 for us in got.values()), got

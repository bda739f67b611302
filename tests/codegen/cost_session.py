"""A screen that times nothing: a config's time is a function of the config, a kernel file's the
number after `# FAKE_MS` in it (tests/codegen/test_search_*.py, test_hybrid.py). It stands in
for codegen.screen.ScreenSession, whose worker runs the candidates."""

from __future__ import annotations

import math
import re
from pathlib import Path

SWEET = {"BM": 128, "BN": 128, "BK": 64, "num_warps": 8, "num_stages": 3, "BLOCK": 1024}
FLAGS = {"TMA": -0.08, "WIDE": -0.03, "SUBTILE": 0.02, "FLAT": 0.05}


def roofline_ms(config: dict) -> float:
    """A synthetic time: each tile size and launch parameter costs the squared log-distance
    from a sweet spot, each kernel variant a fixed amount (the TMA kernels less)."""
    t = 1.0
    for k, v in config.items():
        if k in SWEET:
            t += 0.05 * (math.log2(v) - math.log2(SWEET[k])) ** 2
        elif k in FLAGS and v:
            t += FLAGS[k]
    return t


class CostSession:
    def __init__(self, cost=roofline_ms, fail=()):
        self.cost, self.fail = cost, list(fail)
        self.baseline = {"median_ms": 2.0, "meaningful": True}
        self.jobs: list[dict] = []
        self.closed = False

    def run(self, jobs: list[dict]) -> list[dict]:
        out = []
        for j in jobs:
            self.jobs.append(j)
            if j.get("config") is not None and j["config"] in self.fail:
                out.append({**j, "screen": "error: OutOfResources: shared memory"})
                continue
            if j.get("config") is not None:
                ms = self.cost(j["config"])
            else:
                ms = float(re.search(r"# FAKE_MS (\S+)", Path(j["path"]).read_text()).group(1))
            out.append({**j, "screen": "pass",
                        "timing": {"median_ms": ms, "meaningful": True}})
        return out

    def close(self) -> None:
        self.closed = True

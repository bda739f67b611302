"""Does a pass's GEMMs slow down when the memory-bound work between them shrinks (GPU)?

    python benchmarks/probes/gemm_density.py RUN_DIR [OUT.json] [--scales 1,0.6,0.4,0.25,0.15]

Issue 29: the patched b8 pass runs the same cuBLAS GEMMs as the unpatched one, with the same
inputs, yet each takes 5-11 % longer on Llama-3.2-1B and Phi-3-mini (0 on Qwen2.5-0.5B), and the
SM clock reads 1545-1650 MHz against 1755-1845 unpatched under the 700 W cap. This runs the
profile's own synthetic pass (`profiling.density.measure`: its GEMMs and attention in order,
copies for the rest scaled by k) for each k of RUN_DIR's profiled workloads and prints the
compute kernels' time per pass against k = 1, with their share of the pass.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from profiling.density import measure


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("out", nargs="?")
    ap.add_argument("--scales", default="1,0.6,0.4,0.25,0.15")
    ap.add_argument("--seconds", type=float, default=2.0)
    a = ap.parse_args()
    prof = json.loads((a.run_dir / "profile.json").read_text())
    scales = tuple(float(x) for x in a.scales.split(","))
    result = {"run": str(a.run_dir), "model": prof["model"], "rows": []}
    for w in prof["workloads"]:
        pts = measure(w["ops"], prof["ceilings"]["bandwidth_GBps"], scales, a.seconds)
        print(w["key"])
        for p in pts:
            print(f"  k={p['scale']:.2f}: compute {p['compute_us'] / 1e3:.2f} ms "
                  f"({p['compute_ratio']:.3f}x), copies {p['copy_us'] / 1e3:.2f} ms, "
                  f"share {p['compute_share']:.2f}")
        result["rows"] += [{"workload": w["key"], **p} for p in pts]
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

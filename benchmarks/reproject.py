"""Re-project a committed optimize run with the current projection code.

The projection is frozen before integration from the profile and the kernel-level numbers
(projection.json: kernel speedups and host deltas). This recomputes it for the set each
workload shipped, from those same frozen inputs and the run's trace, with whatever replay and
Amdahl code is checked out now, and prints it next to the frozen projection and the measured
speedup. It reads no whole-model measurement into the projection; the measured column is only
printed beside it.

    python benchmarks/reproject.py benchmarks/results/optimize-<tag> [--out FILE.json]

The results folder needs profile.json.gz (or profile.json), ranking.json, projection.json,
integration.json and trace/<workload>.json.gz.
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import tempfile
from pathlib import Path


def out_and_folders(doc: str) -> tuple[Path, list[Path]]:
    """The command line of the offline scripts over committed runs: OUT.json [RESULTS_DIR ...],
    every `benchmarks/results/optimize-*` folder when none is given."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("results", type=Path, nargs="*")
    args = ap.parse_args()
    root = Path(__file__).resolve().parent / "results"
    return args.out, args.results or sorted(root.glob("optimize-*"))


def unpack_run(results: Path, run: Path) -> tuple[dict, dict, dict]:
    """Lay a results folder out in `run` as the pipeline's run directory (the stage artifacts,
    profile.json unpacked, the traces linked); returns its projection, its integration and its
    ranking by workload key."""
    for name in ("ranking.json", "projection.json", "integration.json"):
        shutil.copy(results / name, run / name)
    packed = results / "profile.json.gz"
    if packed.exists():
        (run / "profile.json").write_bytes(gzip.decompress(packed.read_bytes()))
    else:
        shutil.copy(results / "profile.json", run / "profile.json")
    (run / "trace").symlink_to((results / "trace").resolve())
    ranking = json.loads((run / "ranking.json").read_text())["workloads"]
    return (json.loads((run / "projection.json").read_text()),
            json.loads((run / "integration.json").read_text()), {w["key"]: w for w in ranking})


def frozen_cases(results: Path, proj: dict) -> dict | None:
    """The per-case kernel speedups the eager replay uses: frozen in projection.json, or for
    runs frozen before they were, read from the run's verification summary (the same
    kernel-level numbers); None where neither is there."""
    from pipeline.projection.frozen import case_speedups

    if "case_speedups" in proj:
        return proj["case_speedups"]
    for name in ("verification-summary.json", "verification/summary.json"):
        if (results / name).exists():
            return case_speedups(json.loads((results / name).read_text()),
                                 proj["kernel_speedups"])
    return None


def reproject(results: Path, basis: str | None = None) -> dict:
    """Per workload: the kept set's projection, frozen and now; with `basis` (a reading of
    pipeline.stages.host, e.g. "pass_us_per_call"), the in-model host deltas of that reading
    replace the frozen ones, and each family measured alone is re-projected alone too."""
    from pipeline.projection.host import host_of, rescaled_host
    from pipeline.projection.workload import project_set

    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp)
        proj, integ, ranking = unpack_run(results, run)
        cases = frozen_cases(results, proj)
        out = {}
        for key, w in integ["workloads"].items():
            kept = list(w.get("kept") or [])
            frozen = w.get("projection_for_kept") or proj["workloads"][key]
            host = host_of(proj, key)
            if basis:
                host = {**host, **rescaled_host(ranking[key], proj["workloads"][key].get(
                    "host_in_model") or {}, basis)}
            now = project_set(run, ranking[key], proj["kernel_speedups"], host, True,
                              only=kept, cases=cases)
            measured = 1 / w["combined"]["estimate"] if w.get("combined") else 1.0
            out[key] = {"kept": kept, "measured": measured,
                        "frozen": {k: frozen[k] for k in ("amdahl", "replay")},
                        "now": {k: now[k] for k in ("amdahl", "replay")},
                        "error_frozen": {k: abs(frozen[k] - measured) / measured
                                         for k in ("amdahl", "replay")},
                        "error_now": {k: abs(now[k] - measured) / measured
                                      for k in ("amdahl", "replay")},
                        "alone": {f: {"measured": 1 / m["estimate"], "replay": project_set(
                            run, ranking[key], proj["kernel_speedups"], host, True,
                            only=[f], cases=cases)["replay"]}
                            for f, m in (w.get("per_family") or {}).items() if m.get("estimate")}}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", type=Path)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--host-basis", help="re-project with this in-model host reading "
                                         "(us_per_call: hooked windows; pass_us_per_call: "
                                         "whole passes)")
    args = ap.parse_args()
    out = reproject(args.results, args.host_basis)
    for key, r in out.items():
        print(f"{key}: measured {r['measured']:.3f}x; replay frozen {r['frozen']['replay']:.3f}x "
              f"({r['error_frozen']['replay']:.1%}), now {r['now']['replay']:.3f}x "
              f"({r['error_now']['replay']:.1%}); Amdahl {r['now']['amdahl']:.3f}x "
              f"({r['error_now']['amdahl']:.1%}); kept {', '.join(r['kept'])}")
        for f, a in r["alone"].items():
            print(f"  {f} alone: measured {a['measured']:.3f}x, replay now {a['replay']:.3f}x")
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

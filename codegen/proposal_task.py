"""The task folder a proposer works in, one per searched (family, case):
`proposals/<family>/<case_key>/` holding

- `task.json`: family, case (shapes, dtype, params), the calling convention, the current best
  candidate's path and numbers (its time, spread and GB/s, and the baseline's), the bytes the
  case must move and the device's measured copy bandwidth (`copy_GBps`, from profile.json;
  null when the run has none), and the verification records so far;
- `reference.py`: the family's PyTorch reference (what the candidate must compute);
- `best.py`: the current best source, to start from;
- `out/`: the proposer writes candidate files `out/*.py` here (and, in a hybrid search's trial
  folder, configs of the search space as `out/*.json`: codegen/hybrid.py).

Written by codegen/proposer.py for an external program and by codegen/llm_proposer.py for the
built-in one.
"""

from __future__ import annotations

import inspect
import json
import re
import shutil
from pathlib import Path

from codegen.registry import get_family
from core.artifacts import write_json, write_text

CONTRACT = ("A candidate file defines `forward(*inputs, out, **params) -> None`, computes what "
            "reference.py computes for these inputs and params, and writes the result into the "
            "caller's `out` tensor(s). It may use torch and triton; it must not call the "
            "reference's aten compute ops, allocate its own result, or use another stream.")


def write_task(run_dir: Path, search: dict, folder: Path | None = None,
               extra: dict | None = None) -> Path:
    """The case's task folder (or `folder`); `extra`: more entries for task.json (a hybrid
    search's state, codegen.hybrid)."""
    fam = get_family(search["family"])
    task = folder or run_dir / "proposals" / search["family"] / search["case_key"]
    (task / "out").mkdir(parents=True, exist_ok=True)
    best = next((e for e in search["candidates"] if search["order"]
                 and e["path"] == search["order"][0]), None)
    if best is not None:
        shutil.copyfile(best["path"], task / "best.py")
    write_text(task / "reference.py", inspect.getsource(inspect.getmodule(fam.reference)))
    records = sorted(str(p) for p in (run_dir / "verification" / fam.name).glob("*.json"))
    write_json(task / "task.json", {
        "family": fam.name, "case": search["case"], "contract": CONTRACT,
        "best": {"path": best["path"], "timing": best.get("timing"),
                 "config": best.get("config")} if best else None,
        "baseline": search.get("baseline"),
        "min_bytes": fam.min_bytes(search["case"]),
        "copy_GBps": _copy_bandwidth(run_dir),
        "verification_records": records,
        **(extra or {}),
    })
    return task


def _copy_bandwidth(run_dir: Path) -> float | None:
    try:
        profile = json.loads((run_dir / "profile.json").read_text())
    except (OSError, ValueError):
        return None
    return (profile.get("ceilings") or {}).get("bandwidth_GBps")


def record_name(case_key: str, path: str | Path) -> str:
    """A candidate's verification record name: generated files are all kernel.py (named by
    their config folder); proposals share an out/ folder (named by their file, and by their
    hybrid trial's folder, codegen.hybrid, where the same file name comes back each trial)."""
    p = Path(path)
    if p.name == "kernel.py":
        return f"{case_key}__{p.parent.name}"
    trial = p.parent.parent.name
    return f"{case_key}__" + (f"{trial}_" if re.fullmatch(r"trial\d+", trial) else "") + \
        f"{p.parent.name}_{p.stem}"

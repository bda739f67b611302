"""The proposer interface: an external program adds candidate sources.

For every searched (family, case) the pipeline writes a task folder
`proposals/<family>/<case_key>/` holding

- `task.json`: family, case (shapes, dtype, params), the calling convention, the current best
  candidate's path and numbers (its time, spread and GB/s, and the baseline's), the bytes the
  case must move and the device's measured copy bandwidth (`copy_GBps`, from profile.json;
  null when the run has none), and the verification records so far;
- `reference.py`: the family's PyTorch reference (what the candidate must compute);
- `best.py`: the current best source, to start from;
- `out/`: empty; the proposer writes candidate files `out/*.py` here.

and runs `CMD <task folder>` with a timeout (`--proposer llm` runs the built-in language-model
proposer instead: codegen/llm_proposer.py). Every `out/*.py` it leaves is a candidate like any
other: screened and timed in the same worker as generated ones, then verified by the same
harness in the verify stage. A proposal that is wrong is logged as discarded, with the reason.
"""

from __future__ import annotations

import inspect
import json
import shlex
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

from codegen.registry import get_family
from codegen.search import rank_entries, screen_and_time
from core.artifacts import write_json, write_text

CONTRACT = ("A candidate file defines `forward(*inputs, out, **params) -> None`, computes what "
            "reference.py computes for these inputs and params, and writes the result into the "
            "caller's `out` tensor(s). It may use torch and triton; it must not call the "
            "reference's aten compute ops, allocate its own result, or use another stream.")


def write_task(run_dir: Path, search: dict) -> Path:
    fam = get_family(search["family"])
    task = run_dir / "proposals" / search["family"] / search["case_key"]
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
    })
    return task


def _copy_bandwidth(run_dir: Path) -> float | None:
    try:
        profile = json.loads((run_dir / "profile.json").read_text())
    except (OSError, ValueError):
        return None
    return (profile.get("ceilings") or {}).get("bandwidth_GBps")


def source_label(cmd: str) -> str:
    """The search log's `source` of an external proposer's candidates: its program's name."""
    words = shlex.split(cmd)
    named = [w for w in words if not w.startswith("-")][1:] or words
    return f"proposer {Path(named[0]).name}" if named else "proposer"


def run_proposer(cmd: str, run_dir: Path, log: dict, device: str,
                 say: Callable[[str], None], timeout_s: float = 600.0) -> dict:
    """Ask the proposer for every searched case; add its candidates to the search log.
    `cmd` "llm": the built-in language-model proposer (its options from the run directory)."""
    if cmd.strip() == "llm":
        from codegen.llm_proposer import run_llm_proposer

        return run_llm_proposer(run_dir, log, device, say)
    for search in log["searches"]:
        if not search.get("case_key"):
            continue
        task = write_task(run_dir, search)
        say(f"proposer on {search['family']}/{search['case_key']}")
        try:
            proc = subprocess.run(shlex.split(cmd) + [str(task)], capture_output=True,
                                  text=True, timeout=timeout_s)
            status = f"exit {proc.returncode}"
        except (OSError, subprocess.TimeoutExpired) as e:
            status = f"failed: {type(e).__name__}: {e}"
        search.setdefault("proposer", []).append({"cmd": cmd, "task": str(task),
                                                  "status": status})
        known = {e["path"] for e in search["candidates"]}
        jobs = [{"path": str(p), "config": None, "origin": "proposer",
                 "source": source_label(cmd)}
                for p in sorted((task / "out").glob("*.py")) if str(p) not in known]
        if not jobs:
            continue
        fam = get_family(search["family"])
        _, entries = screen_and_time(fam, search["case"], jobs, device)
        search["candidates"].extend(entries)
        rank_entries(search)
    write_json(run_dir / "candidates" / "search_log.json", log)
    return log

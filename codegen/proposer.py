"""The proposer interface: an external program adds candidate sources.

For every searched (family, case) the pipeline writes a task folder (codegen/proposal_task.py)
and runs `CMD <task folder>` with a timeout (`--proposer llm` runs the built-in language-model
proposer instead: codegen/llm_proposer.py). Every `out/*.py` it leaves is a candidate like any
other: screened and timed in the same worker as generated ones, then verified by the same
harness in the verify stage. A proposal that is wrong is logged as discarded, with the reason.
"""

from __future__ import annotations

import shlex
import subprocess
from collections.abc import Callable
from pathlib import Path

from codegen.proposal_task import write_task
from codegen.registry import get_family
from codegen.search import rank_entries, screen_and_time
from core.artifacts import write_json


def source_label(cmd: str) -> str:
    """The search log's `source` of an external proposer's candidates: its program's name."""
    words = shlex.split(cmd)
    named = [w for w in words if not w.startswith("-")][1:] or words
    return f"proposer {Path(named[0]).name}" if named else "proposer"


def run_command(cmd: str, task: Path, timeout_s: float) -> str:
    """`CMD <task>`; its status ("exit N", or why it did not run to the end)."""
    try:
        proc = subprocess.run(shlex.split(cmd) + [str(task)], capture_output=True, text=True,
                              timeout=timeout_s)
        return f"exit {proc.returncode}"
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"failed: {type(e).__name__}: {e}"


def run_proposer(cmd: str, run_dir: Path, log: dict, device: str,
                 say: Callable[[str], None], timeout_s: float = 600.0) -> dict:
    """Ask the proposer for every searched case it did not take part in (a hybrid search asks
    it on a share of its trials: codegen.hybrid); add its candidates to the search log.
    `cmd` "llm": the built-in language-model proposer (its options from the run directory)."""
    if cmd.strip() == "llm":
        from codegen.llm_proposer import run_llm_proposer

        return run_llm_proposer(run_dir, log, device, say)
    for search in log["searches"]:
        if not search.get("case_key") or (search.get("search") or {}).get("hybrid"):
            continue  # no call to replace, or the proposer took part in the search
        task = write_task(run_dir, search)
        say(f"proposer on {search['family']}/{search['case_key']}")
        status = run_command(cmd, task, timeout_s)
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

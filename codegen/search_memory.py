"""What earlier searches found, kept in the user cache beside `calibrate`'s ceilings.

One JSON file per kernel family, `<cache>/kernel-pipeline/search/<family>.json`
(profiling.roofline.cache_dir: $XDG_CACHE_HOME or ~/.cache), holding per (case, GPU name,
torch version, Triton version) the best configs a search timed, fastest first, with their
times, the strategy and the trials it took. A later search of the same key starts from them
(codegen.strategies: they are its first trials, logged with strategy "memory"), and
`--fresh-search` ignores them; on a GPU, a best whose source is unchanged is taken as timed
(codegen.search.CaseSearch.reusable). A different GPU or software version is a different key:
a config's speed there is a new question.

A file that cannot be read as such a record is one warning and is treated as empty (the next
search of that family writes a new one). Writes are atomic (core.artifacts.write_json); a lock
keeps the threads of one process (Ray searches run side by side) from losing each other's
entries, and two processes at once at worst lose the older of their two writes.
"""

from __future__ import annotations

import datetime as dt
import json
import threading
import warnings
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

from core.artifacts import write_json

_LOCK = threading.Lock()
_WARNED: set[Path] = set()


def memory_dir() -> Path:
    from profiling.roofline import cache_dir

    return cache_dir() / "search"


def memory_path(family: str) -> Path:
    return memory_dir() / f"{family}.json"


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "none"


def environment(device: str) -> dict | None:
    """What a remembered config's speed depends on besides the case; None where the device
    cannot be named (a CUDA device string without CUDA)."""
    from profiling.roofline import device_name

    try:
        name = device_name(device)
    except (RuntimeError, AssertionError):
        return None
    return {"device_name": name, "torch": _version("torch"), "triton": _version("triton")}


def memory_key(case_key: str, env: dict) -> str:
    return f"{case_key} | {env['device_name']} | torch {env['torch']} | triton {env['triton']}"


def _load(path: Path, warn: Callable[[str], None]) -> dict:
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
        entries = data["entries"]
        if not isinstance(entries, dict) or not all(
                isinstance(e, dict) and isinstance(e.get("best"), list)
                for e in entries.values()):
            raise ValueError("entries are not search records")
        return entries
    except (OSError, ValueError, KeyError, TypeError) as e:
        if path not in _WARNED:
            _WARNED.add(path)
            warn(f"search memory {path} is unreadable ({type(e).__name__}: {str(e)[:120]}); "
                 f"ignored, and rewritten by the next search of this family")
        return {}


def _warn(line: str) -> None:
    warnings.warn(line, stacklevel=3)


def recall(family: str, case_key: str, env: dict,
           warn: Callable[[str], None] = _warn) -> dict | None:
    """The remembered record of this case on this GPU and software, or None."""
    return _load(memory_path(family), warn).get(memory_key(case_key, env))


def remember(family: str, case: dict, case_key: str, env: dict, best: list[dict],
             strategy: str, trials: int, warn: Callable[[str], None] = _warn,
             baseline: dict | None = None) -> Path | None:
    """Keep the fastest configs of a search (`best`: {"config", "median_ms"} and what else
    it timed, fastest first) and the case's baseline timing; nothing when none was timed."""
    if not best:
        return None
    path = memory_path(family)
    with _LOCK:
        entries = _load(path, warn)
        entries[memory_key(case_key, env)] = {
            "family": family, "case": case, "case_key": case_key, **env,
            "best": best, "baseline": baseline, "strategy": strategy, "trials": trials,
            "updated": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}
        return write_json(path, {"kind": "search memory", "entries": entries})

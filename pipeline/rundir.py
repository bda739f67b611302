"""Run directories: `./runs/<model>-<UTC timestamp>/`, one per profiled model."""

from __future__ import annotations

import datetime as dt
import difflib
import os
import re
from pathlib import Path

from core.artifacts import load, write_json
from core.errors import UserError
from core.records import RunOptions

OPTIONS = "options.json"
# what `pipeline optimize` was asked for, in the order --resume names them
OPTION_FLAGS = {"top": "--top", "families": "--families", "backend": "--backend",
                "max_configs": "--max-configs", "pairs": "--pairs", "proposer": "--proposer",
                "workers": "--workers", "ray_address": "--ray-address", "search": "--search",
                "search_seconds": "--search-seconds", "search_seed": "--search-seed",
                "fresh_search": "--fresh-search", "proposer_share": "--proposer-share"}


def runs_root() -> Path:
    return Path(os.environ.get("PIPELINE_RUNS", "runs"))


def new_run_dir(model_id: str) -> Path:
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", model_id).strip("_")
    path = runs_root() / f"{safe}-{stamp}"
    n = 1
    while path.exists():
        n += 1
        path = runs_root() / f"{safe}-{stamp}-{n}"
    path.mkdir(parents=True)
    return path


def relocate(path: str | Path, run_dir: Path | None) -> Path:
    """A path stored in an artifact, found again after the run directory was moved or copied
    (artifacts store absolute paths; the part from `candidates/` or `proposals/` on is the
    run's own)."""
    path = Path(path)
    if run_dir is None or path.exists():
        return path
    parts = path.parts
    for anchor in ("candidates", "proposals"):
        if anchor in parts:
            return Path(run_dir).joinpath(*parts[parts.index(anchor):])
    return path


def latest_run() -> Path:
    root = runs_root()
    runs = sorted((p for p in root.glob("*/profile.json")), key=lambda p: p.stat().st_mtime)
    if not runs:
        raise UserError(f"no profiled run under {root}/; run `pipeline profile MODEL_ID` first "
                        f"or pass a run directory")
    return runs[-1].parent


def existing_dir(target: str | Path) -> Path:
    """`target` as a Path; one that does not exist is a UserError naming the run directories
    beside it that it may have been meant for."""
    p = Path(target)
    if p.exists():
        return p
    parent = p.parent if str(p.parent) else Path(".")
    near = difflib.get_close_matches(p.name, [x.name for x in parent.iterdir() if x.is_dir()],
                                     n=3) if parent.is_dir() else []
    hint = f"; did you mean {', '.join(str(parent / x) for x in near)}?" if near else ""
    raise UserError(f"no such directory: {target}{hint}")


def load_run(target: str | None) -> Path:
    if target is None:
        return latest_run()
    p = existing_dir(target)
    if p.is_dir():
        if not (p / "profile.json").exists():
            raise UserError(f"{p} has no profile.json; run `pipeline profile` first")
        return p
    raise UserError(f"{target} is not a run directory")


def write_options(run_dir: Path, options: dict) -> Path:
    """Record the options a run was optimized with (`--resume` keeps them)."""
    return write_json(Path(run_dir) / OPTIONS,
                      {"stage": "options", **{k: options.get(k) for k in OPTION_FLAGS}})


def resume_options(run_dir: Path, given: dict, explicit: set[str]) -> tuple[dict, str | None]:
    """The run's recorded options, overridden by those in `explicit` (named on the command
    line), and one line saying which were kept (None when nothing was recorded)."""
    path = Path(run_dir) / OPTIONS
    if not path.exists():
        return given, None
    recorded = load(path, RunOptions, "run options")

    def was(key: str):
        """The recorded value; None where the run did not record it (from before the option)."""
        return getattr(recorded, key) if recorded.has(key) else None
    # a key the run did not record: what is given now
    merged = {k: given.get(k) if k in explicit or was(k) is None else was(k)
              for k in OPTION_FLAGS}
    kept = [_flag(k, merged[k]) for k in OPTION_FLAGS
            if k not in explicit and merged[k] not in (None, False)]
    said = [_flag(k, given[k]) for k in OPTION_FLAGS
            if k in explicit and given[k] not in (None, False)]
    line = "resuming with the run's options: " + (", ".join(kept) or "none recorded")
    if said:
        line += "; from the command line: " + ", ".join(said)
    return merged, line


def _flag(key: str, v) -> str:
    if v is True:  # a switch: its name says it
        return OPTION_FLAGS[key]
    return f"{OPTION_FLAGS[key]} {','.join(v) if isinstance(v, list) else v}"

"""`pipeline optimize RUN --resume --redo FAMILIES`: the resumed run searches and verifies
these families again, keeping every other family's work (a family changed since the run, a
new search space, another search strategy). Their search log entries and verdicts are
dropped; their candidate files stay (a file the user edited is tried again as such, and one
that renders the same is rewritten the same); the later stages rerun because what they read
changed."""

from __future__ import annotations

from pathlib import Path

from core.artifacts import load, write_json
from core.records import SearchLog, VerificationSummary


def forget(run_dir: Path, families: list[str]) -> dict[str, int]:
    """Drop `families`' searches and verdicts from the run; per family, the cases dropped."""
    dropped = dict.fromkeys(families, 0)
    log_path = run_dir / "candidates" / "search_log.json"
    if log_path.exists():
        log = load(log_path, SearchLog, "search log")
        for s in log.searches:
            if s.family in dropped:
                dropped[s.family] += 1
        log.searches = [s for s in log.searches if s.family not in dropped]
        write_json(log_path, log)
    summary_path = run_dir / "verification" / "summary.json"
    if summary_path.exists():
        summary = load(summary_path, VerificationSummary, "verification summary")

        def family_of(key: str) -> str:
            return key.split("/", 1)[0]

        summary.accepted = {k: v for k, v in summary.accepted.items()
                            if family_of(k) not in dropped}
        summary.rejected = [r for r in summary.rejected if family_of(r.key) not in dropped]
        write_json(summary_path, summary)
    return dropped

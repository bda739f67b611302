"""The report's search table: per searched case, how its configs were chosen and what that took
(the search log's `search` record, codegen/search.py): the strategy, trials against the
budget, configs remembered from an earlier search, the best time, the trial and seconds at
which the search first came within 1 % of that best, failures, and proposer trials."""

from __future__ import annotations

from core.records import Candidate, Search, SearchLog, SearchMeta
from pipeline.report_render import ms

WITHIN = 0.01


def _median(c: Candidate) -> float | None:
    return c.timing.median_ms if c.timing is not None else None


def search_blocks(log: SearchLog | dict | None) -> list[tuple]:
    searches = SearchLog.of(log).searches or [] if log else []
    rows = [_row(s) for s in searches if s.case_key and s.candidates is not None]
    if not rows:
        return []
    return [("h", 2, "Search"),
            ("p", "Per searched case: the strategy that chose its configs (auto: the grid where "
                  "the space fits the trial budget, TPE where it does not), trials of the "
                  "budget, configs an earlier search remembered (tried first), the fastest "
                  "screen time, when the search first came within 1 % of it, candidates that "
                  "failed the screen, and trials a proposer took. Every config tried is in "
                  "candidates/search_log.json with its strategy, time, verdict and reason."),
            ("table", ["family", "case", "strategy", "trials", "from memory", "best",
                       "within 1 % at", "failed", "proposer trials"], rows)]


def _row(s: Search) -> list:
    """One searched case: strategy, trials of the budget, memory, best time, when the search
    came within 1 % of it, failures, proposer trials."""
    cands = s.candidates
    timed = sorted((c for c in cands if _median(c) is not None), key=_median)
    best = _median(timed[0]) if timed else None
    meaningful = timed[0].timing.meaningful if timed else None
    shown = ms(best) + ("" if meaningful is None or meaningful else " (not meaningful)")
    first = next((i for i, c in enumerate(cands, 1) if best is not None
                  and _median(c) is not None and _median(c) <= best * (1 + WITHIN)), None)
    if first is None:
        at = "-"
    else:
        c = cands[first - 1]
        at = (f"trial {c.trial if c.trial is not None else first}"
              + (f", {c.elapsed_s:.1f} s" if c.elapsed_s is not None else ""))
    return [s.family, s.case_key, *_meta_cells(s.search, len(cands)), shown, at,
            sum(c.screen != "pass" for c in cands), len(s.proposals or []) or "-"]


def _meta_cells(meta: SearchMeta | None, n: int) -> list[str]:
    """The strategy (and the one asked for where it differs), trials of the budget (`n`, the
    candidates, where the log predates the record) and the configs from memory."""
    meta = meta or SearchMeta()
    used = meta.strategy if meta.strategy is not None else "-"
    asked = meta.asked
    memory = meta.memory
    return [used if asked in (None, "auto", used) else f"{used} (asked {asked})",
            f"{meta.trials if meta.trials is not None else n} of "
            f"{meta.budget_trials if meta.budget_trials is not None else n}",
            (memory.remembered if memory else None)
            or ("ignored" if memory and memory.ignored else "-")]

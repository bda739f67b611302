"""The report's search table: per searched case, how its configs were chosen and what that took
(the search log's `search` record, codegen/search.py): the strategy, trials against the
budget, configs remembered from an earlier search, the best time, the trial and seconds at
which the search first came within 1 % of that best, failures, and proposer trials."""

from __future__ import annotations

from pipeline.report_render import ms

WITHIN = 0.01


def _median(c: dict) -> float | None:
    return (c.get("timing") or {}).get("median_ms")


def search_blocks(log: dict | None) -> list[tuple]:
    rows = []
    for s in (log or {}).get("searches", []):
        cands = s.get("candidates")
        if not s.get("case_key") or cands is None:
            continue
        meta = s.get("search") or {}
        timed = sorted((c for c in cands if _median(c) is not None), key=_median)
        best = _median(timed[0]) if timed else None
        shown = ms(best) + ("" if not timed or timed[0]["timing"].get("meaningful", True)
                            else " (not meaningful)")
        first = next((i for i, c in enumerate(cands, 1) if best is not None
                      and _median(c) is not None and _median(c) <= best * (1 + WITHIN)), None)
        at = "-" if first is None else (
            f"trial {cands[first - 1].get('trial', first)}"
            + (f", {cands[first - 1]['elapsed_s']:.1f} s" if "elapsed_s" in cands[first - 1]
               else ""))
        asked, used = meta.get("asked"), meta.get("strategy", "-")
        memory = meta.get("memory") or {}
        rows.append([
            s["family"], s["case_key"], used if asked in (None, "auto", used)
            else f"{used} (asked {asked})",
            f"{meta.get('trials', len(cands))} of {meta.get('budget_trials', len(cands))}",
            memory.get("remembered") or ("ignored" if memory.get("ignored") else "-"),
            shown, at, sum(c.get("screen") != "pass" for c in cands),
            len(s.get("proposals") or []) or "-"])
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

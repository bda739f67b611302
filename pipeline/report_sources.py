"""The report's per-source tables: what each source of candidates found, per kernel family.

Sources are the search log's `source` of each candidate: "search" (the conventional search),
"proposer <program>" (an external proposer) and "llm <model> round N" (the built-in proposer,
one row per round). Logs written before sources were recorded count proposals as "proposer"
and everything else as "search".
"""

from __future__ import annotations

from collections import Counter, defaultdict

from core.records import Candidate, LlmRecord, SearchLog, Verdict, VerificationSummary
from pipeline.report_plots import ci, ms, speed
from pipeline.report_view import ReportView, WorkloadView


def _source(c: Candidate) -> str:
    return c.source or ("proposer" if c.origin == "proposer" else "search")


def _why(c: Candidate, verify_reasons: dict[str, str]) -> str | None:
    """The short reason a candidate was rejected (its screen first), or None."""
    screen = c.screen or "not run"
    v = c.verification or Verdict()
    if screen.startswith("rejected by verification: ") or v.verdict == "rejected" \
            and screen == "pass" or c.path in verify_reasons:
        reason = (v.reasons or [verify_reasons.get(c.path, "verification")])[0]
        return "verification: " + reason.split(":", 1)[0].split(" in ", 1)[0]
    if screen == "pass":
        return None
    return "screen: " + (screen.split(":", 2)[1].strip() if screen.startswith("error:")
                         else screen)


def _effect(family: str, workloads: list[WorkloadView]) -> list[str]:
    """What the family's shipped kernels did to the whole model, per workload."""
    out = []
    for w in workloads:
        per = next((p for p in w.per_family or [] if p.family == family), None)
        if per is None:
            continue
        kept = family in (w.kept or [])
        effect = (f"{speed(per.speedup)} {ci(per.ci)}".strip() if per.meaningful
                  else (per.reason or "not meaningful"))
        out.append(f"{w.key}: {'kept' if kept else 'rolled back'}; whole model with it "
                   f"alone: {effect}")
    return out


def source_tables(log: SearchLog | None, summ: VerificationSummary | None,
                  data: ReportView) -> list[tuple]:
    """Report blocks: per family, a table of candidates, verdicts and best time per source,
    and which source's kernel shipped with what it did to the whole model."""
    log = log or SearchLog.of({})
    summ = summ or VerificationSummary.of({})
    by_family: dict[str, list[Candidate]] = defaultdict(list)
    for s in log.searches or []:
        if s.case_key:
            by_family[s.family].extend(s.candidates or [])
    if not by_family:
        return []
    verify_reasons = {t.candidate: (t.reasons or ["rejected"])[0]
                      for r in summ.rejected or [] for t in r.tried if t.verdict == "rejected"}
    shipped = {a.source: a for a in (summ.accepted or {}).values()}
    blocks: list[tuple] = [("h", 2, "Candidates per source")]
    blocks += _llm_blocks(log.llm)
    for fam, cands in by_family.items():
        blocks += _family_blocks(fam, cands, verify_reasons, shipped, data)
    return blocks


def _llm_blocks(llm: LlmRecord | None) -> list[tuple]:
    """The built-in language-model proposer's budgets, tokens used and events."""
    if not llm:
        return []
    b = llm.budgets
    return [("p", f"Language-model proposer: {llm.model} at "
                  f"{llm.endpoint}; budgets {b and b.rounds_per_case} "
                  f"rounds per case, {b and b.max_tokens_per_reply} tokens per "
                  f"reply, {b and b.timeout_s_per_request} s per request, "
                  f"{b and b.wall_s} s in all; {llm.tokens_used} tokens "
                  f"used."),
            *[("note", line) for line in llm.events]]


def _family_blocks(fam: str, cands: list[Candidate], verify_reasons: dict[str, str],
                   shipped: dict, data: ReportView) -> list[tuple]:
    """One family's candidates per source, and which source's kernels shipped."""
    groups: dict[str, list[Candidate]] = defaultdict(list)
    for c in cands:
        groups[_source(c)].append(c)
    rows = [_source_row(src, cs, verify_reasons, shipped) for src, cs in groups.items()]
    blocks = [("h", 3, f"{fam}: candidates per source"),
              ("table", ["source", "candidates", "passed screen", "verified",
                         "rejected (why)", "best kernel time", "cases shipped"], rows)]
    from_src = Counter(_source(c) for c in cands if c.path in shipped)
    if from_src:
        effect = _effect(fam, data.workloads or [])
        blocks.append(("p", f"Shipped: {fam} kernels from "
                            + ", ".join(f"{s} ({n} case{'s' * (n > 1)})"
                                        for s, n in from_src.items())
                            + (". " + "; ".join(effect) if effect else
                               "; not integrated in this run.")))
    else:
        blocks.append(("p", f"Shipped: no {fam} kernel passed verification."))
    return blocks


def _source_row(src: str, cs: list[Candidate], verify_reasons: dict[str, str],
                shipped: dict) -> list:
    why = Counter(w for w in (_why(c, verify_reasons) for c in cs) if w)
    verified = sum((c.verification is not None and c.verification.verdict == "accepted")
                   or c.path in shipped for c in cs)
    timed = [c.timing for c in cs if c.timing]
    best = min(timed, key=lambda t: t.median_ms) if timed else None
    best_s = "-" if best is None else ms(best.median_ms) + (
        "" if best.meaningful is not False else " (not meaningful)")
    return [src, len(cs), sum(c.screen == "pass" for c in cs), verified,
            "; ".join(f"{n}x {w}" for w, n in why.most_common()) or "-",
            best_s, sum(c.path in shipped for c in cs)]

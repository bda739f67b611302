"""Verify stage: the fastest screened candidate of every (family, case) through the judge."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from codegen.proposal_task import record_name
from core.artifacts import load, write_json
from core.records import (
    Accepted,
    Candidate,
    Rejected,
    Search,
    SearchLog,
    Timing,
    Tried,
    VerificationSummary,
)
from pipeline.resume import fingerprint, sha256


def verify_stage(run_dir: Path, log: SearchLog | dict, device: str, say: Callable[[str], None],
                 resume: bool, workers=None) -> VerificationSummary:
    """Fully verify the fastest screened candidate of every (family, case); next if rejected.
    On Ray (`workers`, verify.workers) a case's candidates are verified side by side, one GPU
    each, and the first accepted in the screen's order wins, as in the sequential path; the
    rest are cancelled and not recorded."""
    path = run_dir / "verification" / "summary.json"
    summary = load(path, VerificationSummary, "verification summary") \
        if (resume and path.exists()) else VerificationSummary(accepted={}, rejected=[])
    changed = not path.exists()
    for s in SearchLog.of(log).searches:
        if not s.case_key or _decided(summary, s):
            continue
        key = f"{s.family}/{s.case_key}"
        tried, accepted = _verify_case(run_dir, s, key, device, say, workers)
        if accepted is not None:
            summary.accepted[key] = accepted
        else:
            summary.rejected.append(Rejected(
                key=key, family=s.family, tried=tried, sources=fingerprint(s),
                reason="no candidate passed verification" if tried
                else "no candidate passed the screen"))
        write_json(path, summary)
        changed = False
    if changed:
        write_json(path, summary)
    return summary


def _decided(summary: VerificationSummary, s: Search) -> bool:
    """Whether the summary's decision on the case stands: the files it was made on are
    unchanged (else it is dropped, to be verified again)."""
    key = f"{s.family}/{s.case_key}"
    acc = summary.accepted.get(key)
    if acc is not None:
        made_on = acc.source_sha256 if acc.has("source_sha256") else "unknown"
        if made_on in ("unknown", sha256(acc.source)):
            return True
        del summary.accepted[key]
    rej = next((r for r in summary.rejected if r.key == key), None)
    if rej is not None:
        made_on = rej.sources if rej.has("sources") else "unknown"
        if made_on in ("unknown", fingerprint(s)):
            return True
        summary.rejected.remove(rej)
    return False


def _verify_case(run_dir: Path, s: Search, key: str, device: str, say: Callable[[str], None],
                 workers) -> tuple[list[Tried], Accepted | None]:
    """The case's candidates through the judge in the search's order, until one passes: what
    was tried, and the accepted entry (None where none passed)."""
    from contextlib import closing

    from codegen.registry import get_family
    from verify.harness import verify_each

    fam = get_family(s.family)
    tried = []
    # the search's order over the candidates the log still holds (a log whose candidates
    # were pruned, by hand or by a replayed proposer round, keeps its order)
    listed = {c.path for c in s.candidates or []}
    order = [p for p in s.order or [] if p in listed]
    names = [record_name(s.case_key, cand) for cand in order]
    results = verify_each(fam, order, [s.case], device=device, record_dir=run_dir,
                          names=names, workers=workers)
    with closing(results):  # leaving early cancels the candidates not taken
        for cand, name in zip(order, names):
            say(f"verify {key} {name.split('__', 1)[1]}")
            res = next(results)
            tried.append(Tried(candidate=cand, verdict=res.verdict, reasons=res.reasons,
                               record=res.record_path))
            if res.accepted:
                break
        else:
            return tried, None
    entry = next(e for e in s.candidates if e.path == cand)
    base = s.baseline
    return tried, Accepted(
        family=s.family, case=s.case, source=cand, source_sha256=res.source_sha256,
        config=entry.config, kernel=entry.timing, baseline=base, record=res.record_path,
        speedup=base.median_ms / entry.timing.median_ms,
        graph_speedup=_graph_speedup(base, entry),
        host_delta_us=base.host_us - entry.host_us
        if entry.host_us is not None and base.host_us is not None else None,
        verification_timing=res.timing)


def _graph_speedup(baseline: Timing | dict, entry: Candidate | dict) -> float | None:
    """The speedup inside a CUDA graph (`verify.timing.bench_graphed`), None where either side
    was not captured: the graph projection then falls back to `speedup`."""
    b, c = Timing.of(baseline).graph_ms, Candidate.of(entry).graph_ms
    return b / c if b and c else None

"""Verify stage: the fastest screened candidate of every (family, case) through the judge."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from codegen.proposal_task import record_name
from core.artifacts import read_json, write_json
from pipeline.resume import fingerprint, sha256


def verify_stage(run_dir: Path, log: dict, device: str, say: Callable[[str], None],
                 resume: bool, workers=None) -> dict:
    """Fully verify the fastest screened candidate of every (family, case); next if rejected.
    On Ray (`workers`, verify.workers) a case's candidates are verified side by side, one GPU
    each, and the first accepted in the screen's order wins, as in the sequential path; the
    rest are cancelled and not recorded."""
    from contextlib import closing

    from codegen.registry import get_family
    from verify.harness import verify_each

    path = run_dir / "verification" / "summary.json"
    summary = read_json(path, "verification summary") if (resume and path.exists()) \
        else {"accepted": {}, "rejected": []}
    changed = not path.exists()
    for s in log["searches"]:
        if not s.get("case_key"):
            continue
        key = f"{s['family']}/{s['case_key']}"
        # a decision stands while the files it was made on are unchanged (else: verify again)
        acc = summary["accepted"].get(key)
        if acc is not None:
            if acc.get("source_sha256", "unknown") in ("unknown", sha256(acc["source"])):
                continue
            del summary["accepted"][key]
        rej = next((r for r in summary["rejected"] if r["key"] == key), None)
        if rej is not None:
            if rej.get("sources", "unknown") in ("unknown", fingerprint(s)):
                continue
            summary["rejected"].remove(rej)
        fam = get_family(s["family"])
        tried = []
        # the search's order over the candidates the log still holds (a log whose candidates
        # were pruned, by hand or by a replayed proposer round, keeps its order)
        listed = {c["path"] for c in s.get("candidates") or []}
        order = [p for p in s["order"] or [] if p in listed]
        names = [record_name(s["case_key"], cand) for cand in order]
        results = verify_each(fam, order, [s["case"]], device=device, record_dir=run_dir,
                              names=names, workers=workers)
        with closing(results):  # leaving early cancels the candidates not taken
            for cand, name in zip(order, names):
                say(f"verify {key} {name.split('__', 1)[1]}")
                res = next(results)
                tried.append({"candidate": cand, "verdict": res.verdict,
                              "reasons": res.reasons, "record": res.record_path})
                if res.accepted:
                    break
            else:
                res = None
        if res is not None:
            entry = next(e for e in s["candidates"] if e["path"] == cand)
            summary["accepted"][key] = {
                "family": s["family"], "case": s["case"], "source": cand,
                "source_sha256": res.source_sha256, "config": entry["config"],
                "kernel": entry["timing"],
                "baseline": s["baseline"], "record": res.record_path,
                "speedup": s["baseline"]["median_ms"] / entry["timing"]["median_ms"],
                "graph_speedup": _graph_speedup(s["baseline"], entry),
                "host_delta_us": (s["baseline"].get("host_us") - entry["host_us"])
                if entry.get("host_us") is not None and s["baseline"].get("host_us")
                is not None else None,
                "verification_timing": res.timing}
        else:
            summary["rejected"].append({"key": key, "family": s["family"], "tried": tried,
                                        "sources": fingerprint(s),
                                        "reason": "no candidate passed verification"
                                        if tried else "no candidate passed the screen"})
        write_json(path, summary)
        changed = False
    if changed:
        write_json(path, summary)
    return summary


def _graph_speedup(baseline: dict, entry: dict) -> float | None:
    """The speedup inside a CUDA graph (`verify.timing.bench_graphed`), None where either side
    was not captured: the graph projection then falls back to `speedup`."""
    b, c = baseline.get("graph_ms"), entry.get("graph_ms")
    return b / c if b and c else None

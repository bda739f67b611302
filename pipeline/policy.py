"""Which families reach the model: chosen from the ranking, backfilled, one of each pair of
rivals, and the rival set aside tried where the other does not ship.

- The top N are families (a family replaces all its occurrences), taken from the ranking by
  whole-model gain, best rank over all profiled workloads.
- `--top N` means N families that reach the model: one that has no accepted kernel, or cannot
  win by its own kernel-level numbers, gives its place to the next in the ranking.
- Of two families declared rivals (`RankHooks.rivals`), the one that saves less device time per
  call is set aside (on the CPU, whose interpreter timings say nothing, the one lower in the
  ranking), and tried only where the other does not ship.
"""

from __future__ import annotations

from collections.abc import Callable

from core.records import Accepted, Ranking, VerificationSummary


def choose_families(ranking: Ranking | dict, top: int | None) -> list[str]:
    """Families by their best whole-model gain on any workload, the gain the ranking orders by
    (`rank_gain`: on a launch-bound pass the row's gain inside the graph, where the eager
    replay's host savings of a few percent had left Llama-3.2-1B decode's decode_attention out
    of the top 5); the first `top` (all: None). Two families that replace the same ops may
    both be chosen: they are rivals (`RankHooks.rivals`), and the measured one goes on."""
    best: dict[str, tuple] = {}
    for w in Ranking.of(ranking).workloads:
        fam_rows = [r for r in w.rows if r.family]
        for i, r in enumerate(fam_rows):
            gain = r.rank_gain or r.replay_gain or r.amdahl_gain
            cur = best.get(r.family)
            if cur is None or (-gain, i) < cur:
                best[r.family] = (-gain, i)
    return [f for f, _ in sorted(best.items(), key=lambda kv: kv[1])][:top]


def backfill(ranking: Ranking | dict, families: list[str], top: int, device: str,
             say: Callable[[str], None], summary: VerificationSummary | dict,
             search: Callable[[list[str]], tuple]) -> tuple[list[str], VerificationSummary]:
    """`--top N` means N families that reach the model: a chosen family with no accepted
    kernel, or one that cannot win (`cannot_win`: our attention, ranked 3rd on Llama-3.2-1B b8
    by its roofline and 0.23x of cuDNN's SDPA once measured), gives its place to the next
    family in the ranking; `search(more)` generates and verifies those (without proposals)
    and returns (search log, verification summary)."""
    ranked = choose_families(ranking, None)
    summary = VerificationSummary.of(summary)
    while True:
        useful, _ = integrable(summary.accepted, families, device)
        more = [f for f in ranked if f not in families][:top - len(useful)]
        if not more:
            return families, summary
        say(f"{', '.join(sorted(set(families) - set(useful)))} will not reach the model; next "
            f"in the ranking: {', '.join(more)}")
        families = families + more
        summary = VerificationSummary.of(search(more)[1])


def _accepted(accepted: dict) -> dict[str, Accepted]:
    return Accepted.map_of(accepted)


def cannot_win(accepted: dict, families: list[str]) -> dict[str, str]:
    """Families no workload can gain from by their own kernel-level numbers: every accepted
    case is slower on the device than the code it replaces and saves the host nothing per
    call, nor faster inside a CUDA graph (`graph_speedup`). Integrating one would only spend
    measurement time on a certain rollback (an attention kernel at a fraction of cuDNN's
    SDPA's speed)."""
    out = {}
    accepted = _accepted(accepted)
    for fam in families:
        accs = [a for a in accepted.values() if a.family == fam]
        # a kernel faster inside a CUDA graph can still pay where the graphs stage runs it
        if accs and all(a.speedup < 1 and (a.host_delta_us or 0.0) <= 0
                        and (a.graph_speedup or 0.0) <= 1 for a in accs):
            speeds = ", ".join(f"{a.speedup:.2f}x" for a in accs)
            hosts = ", ".join(f"{-(a.host_delta_us or 0.0):+.1f} us" for a in accs)
            out[fam] = (f"not integrated: slower than the code it replaces at kernel level "
                        f"({speeds}) and no host time saved per call ({hosts})")
    return out


def superseded(accepted: dict, families: list[str], device: str = "cuda") -> dict[str, str]:
    """Of two families that replace the same ops (`RankHooks.rivals`: the matmul with the
    gated activation in its epilogue, and gated_act alone), the one whose accepted kernels save
    less device time per call, summed over its cases, gives way: both patch the same MLP, and
    each one's saving is measured against the same HF code, on the layout that code runs on
    (`VerifyHooks.baseline_case`), by the same harness.
    Interpreter timings (CPU) decide nothing: there the one earlier in `families` (the
    ranking's order) is kept, and the reason says so and what a GPU would decide on.
    Decided once per run, before any in-model measurement: where each family wins on another
    workload, only one is kept for all of them; gated_act's number leaves out its in-model
    gate/up GEMM fusion. Where the winner does not
    ship on a workload, the loser is tried there in its place (`integrate.fall_back`)."""
    saved = _device_saved_us(accepted)
    if not device.startswith("cuda"):
        return {loser: (f"superseded by {winner}, which replaces the same ops, by the "
                        f"ranking's order ({winner} ranks higher): on a GPU the one whose "
                        f"kernels save more device time per call is kept, and interpreter "
                        f"timings cannot tell which that is here")
                for loser, winner in superseded_by(accepted, families, device).items()}
    return {loser: (f"superseded by {winner}, which replaces the same ops: it "
                    f"{_saving(saved(winner))} per call against {_saving(saved(loser))} "
                    f"(kernel-level, summed over cases)")
            for loser, winner in superseded_by(accepted, families, device).items()}


def _saving(us: float) -> str:
    """A device-time saving in words: a negative one is a cost (the kernel is slower)."""
    return f"saves {us:.1f} us" if us >= 0 else f"costs {-us:.1f} us (slower than the original)"


def _device_saved_us(accepted: dict) -> Callable[[str], float]:
    accepted = _accepted(accepted)

    def saved_us(fam: str) -> float:
        return sum((a.baseline.median_ms - a.kernel.median_ms) * 1e3
                   for a in accepted.values() if a.family == fam)
    return saved_us


def superseded_by(accepted: dict, families: list[str], device: str = "cuda") -> dict[str, str]:
    """{family set aside: the family it was set aside for} (`superseded`)."""
    from codegen.registry import get_family

    on_gpu = device.startswith("cuda")
    saved_us = _device_saved_us(accepted)
    out: dict[str, str] = {}
    for fam in families:
        for other in get_family(fam).rank.rivals:
            if other not in families or fam in out or other in out:
                continue
            if on_gpu:
                loser, winner = sorted((fam, other), key=saved_us)
            else:  # the ranking's order: `families` is in it
                winner, loser = sorted((fam, other), key=families.index)
            out[loser] = winner
    return out


def _may_win(accepted: dict, families: list[str], device: str) -> tuple[list, dict]:
    """(families with an accepted kernel that may gain somewhere, {the others: why}). Only GPU
    timings say a kernel is slower; the interpreter's say nothing."""
    fams = [f for f in families if any(a.family == f for a in _accepted(accepted).values())]
    skipped = cannot_win(accepted, fams) if device.startswith("cuda") else {}
    return [f for f in fams if f not in skipped], skipped


def integrable(accepted: dict, families: list[str], device: str) -> tuple[list, dict]:
    """(families integrated, {skipped family: why}): those that may win, less one of each two
    that replace the same ops (`superseded`)."""
    fams, skipped = _may_win(accepted, families, device)
    skipped.update(superseded(accepted, fams, device))
    return [f for f in fams if f not in skipped], skipped


def fallbacks(accepted: dict, families: list[str], device: str) -> dict[str, str]:
    """{family set aside: the family it was set aside for}: tried where that one does not
    ship."""
    return superseded_by(accepted, _may_win(accepted, families, device)[0], device)

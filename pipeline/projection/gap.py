"""Where a projection and its measurement part, family by family.

The projection gives each replaced pattern its profiled GPU time over the family's
kernel-level speedup, and keeps the rest of the pass as profiled. After the timing, one
unpatched and one patched pass are profiled again (`integrate.reprofile`). Their GPU time per
kernel shows what the patched pass spends: each family's own kernels against the time
projected for them, the rest of the GPU work against what it was, and the host-bound remainder
of the measured wall. A family whose kernels take longer in the model than in the kernel
timing, or a rest that grew, is where a projection error comes from. (A family that replaces
ops the profile counted under another pattern, as a fused add + norm takes over a norm, moves
time between two rows; the totals hold.)
"""

from __future__ import annotations

import re
from statistics import median


def _matches(trace_name: str, names: list[str]) -> bool:
    return any(re.search(rf"(?<!\w){re.escape(n)}(?!\w)", trace_name) for n in names)


def gap(rows: list[dict], speed: dict[str, float], reprofile: dict | None,
        profile: dict, replay: float | None, combined: dict | None,
        row_ms: dict[str, float] | None = None) -> dict | None:
    """`rows`: the workload's ranking rows; `speed`: kernel speedups the projection used;
    `profile`: {"wall_ms", "busy_share"} of the profiled unpatched pass; `replay`: the replay
    projection of the set that ran; `combined`: its paired timing (times_a_ms unpatched,
    times_b_ms patched); `row_ms`: each pattern's time as that replay gave it, case by case
    (projections frozen before it was kept have none: the row's time over the family's
    speedup then). Times in ms."""
    if reprofile and reprofile.get("error"):
        return {"error": reprofile["error"]}
    if not reprofile or not reprofile.get("patched_us"):
        return None
    after = reprofile["patched_us"]
    now_busy = sum(reprofile.get("unpatched_us", {}).values()) / 1e3
    parts, claimed, used = [], 0.0, set()
    for fam in reprofile["families"]:
        own = [r for r in rows if r.get("family") == fam]
        base = sum(r["time_us"] for r in own) / 1e3
        names = reprofile["family_kernels"].get(fam) or []
        mine = [n for n in after if n not in used and _matches(n, names)]
        used.update(mine)
        # a family whose kernel is a library's (the matmul family's cuBLAS on a padded
        # weight) has no name of its own to find: its time stays in the rest, not a 0 here
        ours = sum(after[n] for n in mine) / 1e3 if names else None
        if row_ms and own and all(r["pattern"] in row_ms for r in own):
            projected = sum(row_ms[r["pattern"]] for r in own)
        else:
            projected = base / speed[fam] if speed.get(fam) else None
        parts.append({"part": fam, "kernels": sorted(mine), "profiled_ms": base,
                      "projected_ms": projected, "patched_ms": ours})
        claimed += base
    busy = profile["wall_ms"] * profile["busy_share"] if profile.get("busy_share") else None
    unclaimed = busy - claimed if busy is not None else None  # projected as profiled
    rest = {"part": "rest of the GPU work", "kernels": [], "profiled_ms": unclaimed,
            "projected_ms": unclaimed,
            "patched_ms": sum(t for n, t in after.items() if n not in used) / 1e3}
    # a family without a kernel speedup has no projected time: nor has the total then (a 0
    # in its place would project the busy time short by that family's whole profiled time)
    known = busy is not None and all(p["projected_ms"] is not None for p in parts)
    total = {"part": "GPU busy", "kernels": [], "profiled_ms": busy,
             "projected_ms": unclaimed + sum(p["projected_ms"] for p in parts) if known
             else None, "patched_ms": sum(after.values()) / 1e3}
    timed = combined or {}
    wall_patched = median(timed["times_b_ms"]) if timed.get("times_b_ms") else None
    wall_unpatched = median(timed["times_a_ms"]) if timed.get("times_a_ms") else None
    # the host's speed moves between the profile and the timing (benchmarks/results/README.md,
    # "Host speed moves"), so the projected wall is the unpatched pass timed
    # beside the patched one, over the projection
    now = wall_unpatched or profile["wall_ms"]
    wall = {"part": "wall (timed, no profiler)", "kernels": [],
            "profiled_ms": profile["wall_ms"],
            "projected_ms": now / replay if replay else None,
            "patched_ms": wall_patched}
    idle = {"part": "wall - GPU busy (host, launches, gaps)", "kernels": [],
            **{k: wall[k] - total[k] if wall[k] is not None and total[k] is not None else None
               for k in ("profiled_ms", "projected_ms", "patched_ms")}}
    return {"parts": [*parts, rest, total, wall, idle],
            "unpatched_busy_now_ms": now_busy, "unpatched_wall_now_ms": wall_unpatched,
            "slower_in_both": slower_in_both(reprofile.get("unpatched_us") or {}, after, used)}


def slower_in_both(before: dict[str, float], after: dict[str, float], ours: set[str],
                   n: int = 3) -> list[dict]:
    """The kernels both passes ran (no family's) that took the longest extra time patched (at
    least 10 us and 2 % more): what the projection held constant and the model did not (the
    library's GEMMs can run slower beside fused kernels, under the power cap:
    `profiling.density`)."""
    grew = sorted(((after[k] - before[k], k) for k in before.keys() & after.keys()
                   if k not in ours and after[k] - before[k] >= max(10.0, 0.02 * before[k])),
                  reverse=True)[:n]
    return [{"kernel": k, "unpatched_ms": before[k] / 1e3, "patched_ms": after[k] / 1e3}
            for _, k in grew]


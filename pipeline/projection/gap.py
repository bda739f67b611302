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

from core.integration_records import Ratio, Reprofile
from core.record import Record
from core.records import RankedRow


class Part(Record):
    """One part of the pass: its GPU time profiled, projected and re-profiled patched (ms)."""
    part: str
    kernels: list[str] = []
    profiled_ms: float | None = None
    projected_ms: float | None = None
    patched_ms: float | None = None


class SlowerKernel(Record):
    kernel: str
    unpatched_ms: float
    patched_ms: float


class Gap(Record):
    parts: list[Part] = []
    unpatched_busy_now_ms: float | None = None
    unpatched_wall_now_ms: float | None = None
    slower_in_both: list[SlowerKernel] = []
    error: str | None = None


class Profiled(Record):
    """The profiled unpatched pass: its wall time and the share of it the GPU was busy."""
    wall_ms: float
    busy_share: float | None = None


def _matches(trace_name: str, names: list[str]) -> bool:
    return any(re.search(rf"(?<!\w){re.escape(n)}(?!\w)", trace_name) for n in names)


def gap(rows: list[RankedRow | dict], speed: dict[str, float], reprofile: Reprofile | dict | None,
        profile: Profiled | dict, replay: float | None, combined: Ratio | dict | None,
        row_ms: dict[str, float] | None = None) -> Gap | None:
    """`rows`: the workload's ranking rows; `speed`: kernel speedups the projection used;
    `profile`: the profiled unpatched pass; `replay`: the replay projection of the set that
    ran; `combined`: its paired timing (times_a_ms unpatched, times_b_ms patched); `row_ms`:
    each pattern's time as that replay gave it, case by case (projections frozen before it was
    kept have none: the row's time over the family's speedup then). Times in ms."""
    reprofile = Reprofile.of(reprofile) if reprofile is not None else None
    if reprofile is not None and reprofile.error:
        return Gap(error=reprofile.error)
    if reprofile is None or not reprofile.patched_us:
        return None
    profile = Profiled.of(profile)
    after = reprofile.patched_us
    used: set[str] = set()
    parts = [_family_part(fam, RankedRow.list_of(rows), reprofile, used, speed, row_ms)
             for fam in reprofile.families]
    claimed = sum(p.profiled_ms for p in parts)
    busy = profile.wall_ms * profile.busy_share if profile.busy_share else None
    unclaimed = busy - claimed if busy is not None else None  # projected as profiled
    rest = Part(part="rest of the GPU work", kernels=[], profiled_ms=unclaimed,
                projected_ms=unclaimed,
                patched_ms=sum(t for n, t in after.items() if n not in used) / 1e3)
    # a family without a kernel speedup has no projected time: nor has the total then (a 0
    # in its place would project the busy time short by that family's whole profiled time)
    known = busy is not None and all(p.projected_ms is not None for p in parts)
    total = Part(part="GPU busy", kernels=[], profiled_ms=busy,
                 projected_ms=unclaimed + sum(p.projected_ms for p in parts) if known else None,
                 patched_ms=sum(after.values()) / 1e3)
    timed = Ratio.of(combined) if combined is not None else Ratio()
    wall_patched = median(timed.times_b_ms) if timed.times_b_ms else None
    wall_unpatched = median(timed.times_a_ms) if timed.times_a_ms else None
    # the host's speed moves between the profile and the timing (benchmarks/results/README.md,
    # "Host speed moves"), so the projected wall is the unpatched pass timed
    # beside the patched one, over the projection
    now = wall_unpatched or profile.wall_ms
    wall = Part(part="wall (timed, no profiler)", kernels=[], profiled_ms=profile.wall_ms,
                projected_ms=now / replay if replay else None, patched_ms=wall_patched)
    idle = Part(part="wall - GPU busy (host, launches, gaps)", kernels=[], **{
        k: getattr(wall, k) - getattr(total, k)
        if getattr(wall, k) is not None and getattr(total, k) is not None else None
        for k in ("profiled_ms", "projected_ms", "patched_ms")})
    return Gap(parts=[*parts, rest, total, wall, idle],
               unpatched_busy_now_ms=sum(reprofile.unpatched_us.values()) / 1e3,
               unpatched_wall_now_ms=wall_unpatched,
               slower_in_both=slower_in_both(reprofile.unpatched_us, after, used))


def _family_part(fam: str, rows: list[RankedRow], reprofile: Reprofile, used: set[str],
                 speed: dict[str, float], row_ms: dict[str, float] | None) -> Part:
    """A family's own kernels in the patched pass, against the time projected for them; the
    kernels it claims join `used`."""
    own = [r for r in rows if r.family == fam]
    base = sum(r.time_us for r in own) / 1e3
    names = reprofile.family_kernels.get(fam) or []
    mine = [n for n in reprofile.patched_us if n not in used and _matches(n, names)]
    used.update(mine)
    # a family whose kernel is a library's (the matmul family's cuBLAS on a padded
    # weight) has no name of its own to find: its time stays in the rest, not a 0 here
    ours = sum(reprofile.patched_us[n] for n in mine) / 1e3 if names else None
    if row_ms and own and all(r.pattern in row_ms for r in own):
        projected = sum(row_ms[r.pattern] for r in own)
    else:
        projected = base / speed[fam] if speed.get(fam) else None
    return Part(part=fam, kernels=sorted(mine), profiled_ms=base, projected_ms=projected,
                patched_ms=ours)


def slower_in_both(before: dict[str, float], after: dict[str, float], ours: set[str],
                   n: int = 3) -> list[SlowerKernel]:
    """The kernels both passes ran (no family's) that took the longest extra time patched (at
    least 10 us and 2 % more): what the projection held constant and the model did not (the
    library's GEMMs can run slower beside fused kernels, under the power cap:
    `profiling.density`)."""
    grew = sorted(((after[k] - before[k], k) for k in before.keys() & after.keys()
                   if k not in ours and after[k] - before[k] >= max(10.0, 0.02 * before[k])),
                  reverse=True)[:n]
    return [SlowerKernel(kernel=k, unpatched_ms=before[k] / 1e3, patched_ms=after[k] / 1e3)
            for _, k in grew]

"""Host-delta accounting: the host time each family's patch saves per kernel call, as the
projection reads it from the in-model measurements (`pipeline.stages.host`), at the host speed
of the profile, and what a set saves together beyond its families' own deltas."""

from __future__ import annotations

from core.records import HostDelta, HostSet, Projection, RankedWorkload

# Which reading the projection uses: "us_per_call" (hooked windows around the patched modules)
# or "pass_us_per_call" (each whole pass's time to return, no hooks). Both are recorded.
HOST_BASIS = "us_per_call"


def rescaled_host(ranked: RankedWorkload | dict, measured: dict,
                  basis: str | None = None) -> dict:
    """family -> the in-model host delta per call (`basis`: which of the host stage's readings,
    default HOST_BASIS) at the host speed of the profile: its share of the unpatched pass's
    host time, pair by pair, times the profile's host time; for deltas measured before shares
    were recorded, the delta rescaled by `host_drift`."""
    basis = basis or HOST_BASIS
    share = basis.replace("us_per_call", "share_per_call")
    then = RankedWorkload.of(ranked).enqueue_ms
    deltas = HostDelta.map_of(measured)
    return {f: getattr(d, share) * then * 1e3 if then and getattr(d, share) is not None
            else getattr(d, basis) * host_drift(ranked, d)
            for f, d in deltas.items() if getattr(d, basis) is not None}


def host_drift(ranked: RankedWorkload | dict, measured: HostDelta | dict) -> float:
    """The profile's enqueue time over the one measured with the in-model delta: the same
    host, minutes apart, can run the same pass at twice the time (benchmarks/results/README.md,
    "Host speed moves"), and the replay's host chain is calibrated to the profile's moment. 1
    when either is unknown."""
    then = RankedWorkload.of(ranked).enqueue_ms
    now = HostDelta.of(measured).base_enqueue_ms
    return then / now if then and now else 1.0


def host_of(proj: Projection | dict, key: str) -> dict:
    """The host deltas a workload's projection used (per workload since they are measured in
    the model; projections frozen before that have one set for all)."""
    proj = Projection.of(proj)
    w = proj.workloads.get(key)
    return (w.host_delta_us if w is not None else None) or proj.host_delta_us


def summed_share(alone: dict, families: list[str], key: str = "share_per_call") -> float | None:
    """The share of the unpatched pass `families` save by their own deltas (each measured
    alone; `key`: which reading, hooked windows by default) added up: share per call times
    calls per pass; None where one has no such share."""
    deltas = HostDelta.map_of(alone)
    parts = [deltas.get(f) or HostDelta() for f in families]
    if not all(getattr(d, key) is not None for d in parts):
        return None
    return sum(getattr(d, key) * d.calls_per_pass for d in parts)


def spread_set_share(host_us: dict, alone: dict, together: HostSet | dict | None,
                     enqueue_ms: float | None) -> tuple[dict, float | None]:
    """`host_us` (family -> host us saved per call, at the profile's host speed) with what the
    set saves beyond its families' own deltas (`set_host_share` minus `summed_share`) spread
    evenly over the set's kernel calls, and that extra per call; unchanged, None, where the
    set or a family's share was not measured. Evenly, because the pass does not say which
    family the interaction belongs to (benchmarks/results/README.md, "The set's host saving";
    benchmarks/probes/host_share_check.py)."""
    together = HostSet.of(together) if together is not None else HostSet()
    deltas = HostDelta.map_of(alone)
    fams = together.families
    summed = summed_share(deltas, fams)
    if not fams or together.share is None or summed is None or not enqueue_ms \
            or not all(f in host_us for f in fams) \
            or not (calls := sum(deltas[f].calls_per_pass for f in fams)):
        return host_us, None
    extra = (together.share - summed) * enqueue_ms * 1e3 / calls
    return {f: v + extra if f in fams else v for f, v in host_us.items()}, extra

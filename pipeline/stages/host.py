"""Host stage: each integrable family's host time per call, measured in the model, and what
the set saves together, before any whole-model timing (pipeline.host_delta)."""

from __future__ import annotations

from collections.abc import Callable

from pipeline.patching import workload_cases
from pipeline.policy import fallbacks, integrable


def host_stage(model, workloads, summary: dict, families: list[str],
               say: Callable[[str], None], profile_ms: dict | None = None
               ) -> tuple[dict, dict]:
    """Per workload of the model's dtype: each integrable family's host delta per call,
    measured in the model (pipeline.host_delta), before any whole-model timing; and the host
    share the integrable families save together (`set_host_share`).
    `profile_ms`: workload key -> the profile's unpatched host time (the ranking's
    enqueue_ms), which the measurements are taken near."""
    from pipeline.host_delta import in_model_host_deltas, set_host_share

    accepted = summary["accepted"]
    fams, _ = integrable(accepted, families, workloads[0].device)
    together = list(fams)  # the set integration checks first
    fams += list(fallbacks(accepted, families, workloads[0].device))
    out, sets = {}, {}
    for w in workloads:
        if w.dtype != workloads[0].dtype or not fams:
            continue
        say(f"host time per call in the model: {w.key}")
        cases = {f: set(v) for f, v in workload_cases(model, w, fams).items()}
        out[w.key] = in_model_host_deltas(model, w, accepted, fams, cases,
                                          profile_ms=(profile_ms or {}).get(w.key))
        if together:
            sets[w.key] = set_host_share(model, w, accepted, together, cases)
    return out, sets

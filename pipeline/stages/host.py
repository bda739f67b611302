"""The host stage: the host time each integrable family's patch saves (or costs) per kernel
call, measured in the model itself, and what the set saves patched together, before any
whole-model timing. The projection reads them (`pipeline.projection.host`).

Why in the model: the search times a kernel call against the family's reference function,
alone. In the model the patched code is the module's whole replaced forward: the adapter, its
allocations, the module calls it adds or removes (gate_proj and up_proj become one GEMM).
Those differ, and once a pass's kernels are faster it turns nearly host-bound, so these deltas
decide its projection (benchmarks/results/README.md, "Host deltas in the model").

How: the modules whose forward the family's patch replaces get a pre- and a post-hook; the
pre-hook synchronises the device, so each window times host work only (a full launch queue
would otherwise block the host and charge it device time). Windows nested in another window
count once. The unpatched model and a patched twin run interleaved; per pair, the difference
of the summed windows, divided by the kernel calls the patched pass made, gives the delta per
call; the median over pairs is kept. Each pair then runs again without hooks, and the time
each pass takes to return gives a second reading (`pass_us_per_call`), recorded beside the
first; the projection uses the windows (`projection.host.HOST_BASIS`). Only host time is read
here: no whole-model wall time.

Each pair also yields its deltas as shares of that pair's own unpatched pass host time (its
time to return, unhooked): `share_per_call`, `pass_share_per_call`. The projection multiplies
the share by the profile's host time: the host's speed moves within seconds, so a host speed
read apart from the pairs can belong to another moment than the deltas. `base_enqueue_ms`,
the median unhooked unpatched pass of the pairs, is recorded for the report and for the older
rescaling (`projection.host.host_drift`).

Neither the share nor the delta carries over whole between host speeds (benchmarks/results/
README.md, "Host deltas in the model"). So, given the profile's host time, a family measured
more than DRIFT_TOLERANCE away from it is measured again, up to ATTEMPTS times, and the attempt
nearest the profile's host speed is kept (every attempt's `base_enqueue_ms` is recorded under
`attempts_ms`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from contextlib import ExitStack, contextmanager, nullcontext
from functools import partial

import torch

from core.records import HostDelta, HostSet, VerificationSummary
from pipeline.patching import patched, twin, workload_cases
from pipeline.policy import fallbacks, integrable
from profiling.capture import make_runner, sync

DRIFT_TOLERANCE = 0.2
ATTEMPTS = 3


def host_stage(model, workloads, summary: VerificationSummary | dict, families: list[str],
               say: Callable[[str], None], profile_ms: dict | None = None
               ) -> tuple[dict, dict]:
    """Per workload of the model's dtype: each integrable family's host delta per call,
    measured in the model (`in_model_host_deltas`), before any whole-model timing; and the host
    share the integrable families save together (`set_host_share`).
    `profile_ms`: workload key -> the profile's unpatched host time (the ranking's
    enqueue_ms), which the measurements are taken near."""
    accepted = VerificationSummary.of(summary).accepted
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


@contextmanager
def _windows(modules, device: str):
    """Sum of host seconds spent inside `modules` (outermost calls only) -> box[0]."""
    box, depth, start = [0.0], [0], [0.0]
    cuda = device.startswith("cuda")

    def pre(_module, _args):
        if depth[0] == 0:
            if cuda:
                torch.cuda.synchronize()
            start[0] = time.perf_counter()
        depth[0] += 1

    def post(_module, _args, _out):
        depth[0] -= 1
        if depth[0] == 0:
            box[0] += time.perf_counter() - start[0]

    with ExitStack() as stack:
        for m in modules:
            stack.callback(m.register_forward_pre_hook(pre).remove)
            stack.callback(m.register_forward_hook(post).remove)
        yield box


def patched_modules(model, variant) -> list[tuple]:
    """(module of `model`, its twin in `variant`) for every module the patch gave an instance
    forward."""
    base = dict(model.named_modules())
    return [(base[path], m) for path, m in variant.named_modules()
            if "forward" in vars(m) and path in base and "forward" not in vars(base[path])]


def in_model_host_deltas(model, workload, accepted: dict, families: list[str],
                         workload_cases: dict | None = None, pairs: int = 10,
                         profile_ms: float | None = None) -> dict[str, HostDelta]:
    """family -> its HostDelta (us_per_call, share_per_call, pass_us_per_call,
    pass_share_per_call, base_enqueue_ms, calls_per_pass, pairs, modules, attempts_ms: medians
    over pairs, see `_paired`): host time saved per kernel call (negative: the patch costs the
    host more) from the hooked windows and from whole passes, each family patched alone; or
    its `error` where measuring failed (the projection keeps the search's number for it).
    `profile_ms`: the profile's unpatched host time; measurements at a host speed far from it
    are taken again (see the module's docstring)."""
    out = {}
    for name in families:
        try:
            got = _nearest(partial(_one_family, model, workload, accepted, name,
                                   workload_cases, pairs), profile_ms)
        except (RuntimeError, torch.OutOfMemoryError) as e:
            # the projection falls back to the search's per-kernel number for this family
            got = HostDelta(error=f"{type(e).__name__}: {e}"[:200])
            if workload.device.startswith("cuda"):
                torch.cuda.empty_cache()
        if got is not None:
            out[name] = got
    return out


def _nearest(measure, profile_ms: float | None) -> HostDelta | None:
    """`measure()` up to ATTEMPTS times while its unpatched pass ran more than DRIFT_TOLERANCE
    off `profile_ms`; the attempt nearest it, with every attempt's host time."""
    tries = []
    for _ in range(ATTEMPTS if profile_ms else 1):
        got = measure()
        if got is None:
            return None
        got = HostDelta.of(got)
        tries.append(got)
        if not profile_ms or abs(got.base_enqueue_ms / profile_ms - 1) <= DRIFT_TOLERANCE:
            break
    best = min(tries, key=lambda g: abs(g.base_enqueue_ms - (profile_ms or 0)))
    return best.model_copy(update={"attempts_ms": [g.base_enqueue_ms for g in tries]})


def _one_family(model, workload, accepted, name, workload_cases, pairs) -> HostDelta | None:
    calls = {name: 0}
    variant = twin(model)
    with patched(variant, accepted, [name], workload_cases, calls=calls):
        pairs_of = patched_modules(model, variant)
        if not pairs_of:
            return None
        runners = {"base": make_runner(model, workload), "patched": make_runner(variant, workload)}
        mods = {"base": [b for b, _ in pairs_of], "patched": [v for _, v in pairs_of]}
        rows, per_pass = _paired(runners, mods, calls, name, pairs, workload.device)
    if not rows:
        return None
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    return HostDelta(**med, calls_per_pass=per_pass, pairs=len(rows), modules=len(pairs_of))


def _paired(runners: dict, mods: dict, calls: dict, name: str, pairs: int,
            device: str) -> tuple[list[dict], int]:
    """Per pair: base and patched with the windows hooked, then both again without hooks
    (alternating which goes first). Rows of host time saved per kernel call, from the windows
    (`us_per_call`) and from each pass's time to return (`pass_us_per_call`), each also as a
    share of the pair's unhooked unpatched pass (`share_per_call`, `pass_share_per_call`):
    the hooks' own cost stays out of the denominator, which the projection sets against the
    profile's unhooked host time. That pass's own time is `base_enqueue_ms`."""
    rows, per_pass, order = [], 0, list(runners.items())
    with torch.no_grad():
        for i in range(pairs + 1):  # the first pair warms both up and is dropped
            got = {}
            for hooked in (True, False):
                for label, runner in order if i % 2 else order[::-1]:
                    before = calls[name]
                    with _windows(mods[label], device) if hooked else nullcontext() as box:
                        took = _returns_after(runner, device)
                    runner.reset()
                    got[label, hooked] = (box[0] if hooked else took, calls[name] - before)
            per_pass = got["patched", True][1]
            if i and per_pass:
                host = got["base", False][0]
                win = (got["base", True][0] - got["patched", True][0]) / per_pass
                ret = (got["base", False][0] - got["patched", False][0]) / per_pass
                rows.append({"us_per_call": win * 1e6, "share_per_call": win / host,
                             "pass_us_per_call": ret * 1e6, "pass_share_per_call": ret / host,
                             "base_enqueue_ms": host * 1e3})
    return rows, per_pass


def _returns_after(runner, device: str) -> float:
    """Seconds one pass takes to return to Python, started on an idle device."""
    sync(device)
    t = time.perf_counter()
    runner.call()
    took = time.perf_counter() - t
    sync(device)
    return took


def set_host_share(model, workload, accepted: dict, families: list[str],
                   workload_cases: dict | None = None, pairs: int = 10) -> HostSet:
    """The host time `families` save patched together, as a share of the unpatched pass: per
    pair, each pass's time to return (no hooks, alternating which runs first), the median
    over pairs; or {"error"}. On batch 1 the deltas, each measured alone, add up to less than
    the set saves together (benchmarks/results/README.md, "The set's host saving"); the
    projection spreads the difference over the set's calls (`spread_set_share`)."""
    try:
        with patched(twin(model), accepted, families, workload_cases) as variant:
            runners = (make_runner(model, workload), make_runner(variant, workload))
            shares, base = [], []
            with torch.no_grad():
                for i in range(pairs + 1):  # the first pair warms both up and is dropped
                    took = {}
                    for k in ((0, 1) if i % 2 else (1, 0)):
                        took[k] = _returns_after(runners[k], workload.device)
                        runners[k].reset()
                    if i:
                        shares.append((took[0] - took[1]) / took[0])
                        base.append(took[0] * 1e3)
    except (RuntimeError, torch.OutOfMemoryError) as e:
        if workload.device.startswith("cuda"):
            torch.cuda.empty_cache()
        return HostSet(error=f"{type(e).__name__}: {e}"[:200], families=list(families))
    return HostSet(share=statistics.median(shares), base_enqueue_ms=statistics.median(base),
                   pairs=len(shares), families=list(families))

"""Integrate accepted kernels into the model, check it, measure it, accept per workload.

- Patches go through each family's adapter, per model instance, reversibly; a chooser maps each
  call's case to the accepted kernel for that exact case, or to the original code.
- Whole-model check (DESIGN.md): with the model in fp32 as reference (a copy, or layer by
  layer where a copy does not fit: pipeline.fp32_reference), the patched logits' relative
  error may be at most 1.5x the unpatched model's in the same dtype, on several
  fresh random inputs; on a decode workload at every step of a decode over the dynamic cache,
  the static cache (eager, and graphed on a GPU) and a left-padded batch (decode_check.py). A
  failure is bisected to the families that cause it, which are rejected, each with a one-line
  reason naming the family and the trial (the path and step) it failed.
- The patch must show in a re-profile: the replaced patterns are no longer found.
- Per workload, baseline and patched run interleaved; each family alone, then all kept ones.
  A family whose paired-ratio 95 % CI shows a slowdown is rolled back for that workload; if the
  whole set still regresses, everything is rolled back there; else a family that slows the set
  down (timed in it against the set without it) is rolled back. Never ship a regression.
  A family set aside for another that replaces the same ops is tried, by the same rules, where
  that other one did not ship (`fall_back`).
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from codegen.registry import get_family
from core.integration_records import (
    Bound,
    BoundSide,
    Check,
    CheckRun,
    IntegratedWorkload,
    PatchEffect,
    Ratio,
    Reprofile,
    Trial,
)
from core.record import Record
from core.records import Accepted
from core.source import kernel_names
from pipeline.patching import patched, twin

ERROR_RATIO = 1.5
ERROR_FLOOR = 1e-6  # fp32 models agree with their fp32 reference to rounding: allow that much


# Elements of each operand taken to float64 at a time. Whole, Gemma-2B's b8 s1024 logits (8192 x
# 256000) took three 16.8 GB float64 copies and ran an 80 GB H100 out of memory in the check.
ERROR_CHUNK = 1 << 26


def logits_error(out: torch.Tensor, ref: torch.Tensor, chunk: int = ERROR_CHUNK) -> float:
    """||out - ref|| / ||ref||, summed in float64 a slice of rows at a time."""
    out, ref = out.reshape(-1, out.shape[-1]), ref.reshape(-1, ref.shape[-1])
    rows = max(1, chunk // max(1, out.shape[-1]))
    diff2 = ref2 = 0.0
    for i in range(0, out.shape[0], rows):
        o, r = out[i:i + rows].double(), ref[i:i + rows].double()
        diff2 += float((o - r).square().sum())
        ref2 += float(r.square().sum())
    return diff2 ** 0.5 / max(ref2 ** 0.5, 1e-30)


# Spread given to parameters a config initialises to one constant (norm weights at 1, Gemma's
# (1 + w) weights and biases at 0): enough that a kernel skipping one shows in the logits.
CONSTANT_PARAM_SPREAD = 0.2


@contextmanager
def non_trivial_constants(*models, seed: int = 0):
    """Give every parameter whose elements are all equal random values around that constant,
    the same values in each of `models` (matched by name: the model and its fp32 reference),
    and restore them on exit. A norm kernel that ignores its weight is invisible while every
    weight is 1 (or 0 for 1 + w)."""
    first = dict(models[0].named_parameters())
    saved, changed = [], []
    gen = torch.Generator().manual_seed(seed)
    try:
        with torch.no_grad():
            for name, p in first.items():
                flat = p.detach().reshape(-1)
                if p.numel() < 2 or not p.is_floating_point() or \
                        not bool((flat == flat[0]).all()):
                    continue
                changed.append(name)
                noise = CONSTANT_PARAM_SPREAD * torch.randn(p.shape, generator=gen)
                value = float(flat[0]) + noise
                for m in models:
                    q = dict(m.named_parameters()).get(name)
                    if q is not None and q.shape == p.shape:
                        saved.append((q, q.detach().clone()))
                        q.copy_(value.to(device=q.device, dtype=q.dtype))
        yield changed
    finally:
        with torch.no_grad():
            for q, old in reversed(saved):
                q.copy_(old)


class Prompt(Record):
    """One input of the whole-model check: its token ids, and the prefix it shares with the
    prompt before it (None for the first)."""
    seed: int
    ids: Any
    shares_prefix: dict | None = None


def shared_prefix_prompts(vocab: int, shape: tuple[int, int], seeds, device) -> list[Prompt]:
    """One prompt per seed; each after the first repeats its predecessor's first half (of the
    sequence, or of the batch for one-token decode inputs) with a new tail, so a kernel that
    caches across calls keyed on part of its input returns a stale answer for the tail."""
    prompts, previous = [], None
    for seed in seeds:
        gen = torch.Generator().manual_seed(seed + 100)
        ids = torch.randint(0, vocab, shape, generator=gen)
        shared = None
        if previous is not None:
            dim = 1 if shape[1] > 1 else 0
            keep = shape[dim] // 2
            if keep:
                ids.narrow(dim, 0, keep).copy_(previous.narrow(dim, 0, keep))
                shared = {"dim": "seq" if dim else "batch", "length": keep}
        prompts.append(Prompt(seed=seed + 100, ids=ids.to(device), shares_prefix=shared))
        previous = ids
    return prompts


def judge(patched: torch.Tensor, unpatched: torch.Tensor, ref: torch.Tensor) -> dict:
    """One trial under the whole-model rule: the patched logits' error against the fp32
    reference at most ERROR_RATIO times the unpatched model's (and at least ERROR_FLOOR)."""
    e_base, e_new = logits_error(unpatched, ref), logits_error(patched, ref)
    limit = max(ERROR_RATIO * e_base, ERROR_FLOOR)
    return {"error_unpatched": e_base, "error_patched": e_new, "limit": limit,
            "passed": e_new <= limit}


def failure_line(families: list[str], trials: list[Trial]) -> str | None:
    """The first failed trial in one line, naming the patched families and the trial (its
    prompt, and on a decode its path and step); None when every trial passed."""
    t = next((t for t in trials if not t.passed), None)
    if t is None:
        return None
    where = f"seed {t.seed}"
    if t.has("path"):
        step = "the prefill" if t.step == 0 else f"step {t.step}"
        where = f"{t.path} cache, {step} (position {t.position}), {where}"
    if t.has("workload"):
        where = f"{t.workload}, {where}"
    return (f"{', '.join(families)}: {where}: patched logits error {t.error_patched:.3g} > "
            f"limit {t.limit:.3g} ({ERROR_RATIO:g}x the unpatched {t.error_unpatched:.3g})")


def whole_model_check(model, ref_model, accepted: dict, families: list[str], workload,
                      seeds=(0, 1, 2)) -> CheckRun:
    """Errors against the fp32 reference, unpatched and patched, on fresh inputs whose prompts
    share prefixes, with constant-initialised parameters given non-trivial values (in the model
    and the reference alike; the caller's values come back). The patched model is a twin over
    the same weights, patched once for all trials. A decode workload's prompts are prefilled
    and decoded (`decode_check.decode_trials`), every step a trial."""
    from pipeline.decode_check import PROMPTS, decode_trials

    decode = workload.mode == "decode"
    seeds = seeds[:PROMPTS] if decode else seeds
    variant = twin(model)
    trials, skipped = [], {}
    refs = [ref_model] if ref_model is not None else []
    with torch.no_grad(), non_trivial_constants(model, *refs) as changed:
        with patched(variant, accepted, families):
            prompts = shared_prefix_prompts(model.config.vocab_size,
                                            (workload.batch, workload.seq), seeds,
                                            workload.device)
            if decode:
                trials, skipped = decode_trials(model, ref_model, variant, prompts,
                                                workload.device, judge)
            for prompt in prompts if not decode else ():
                ids = prompt.ids
                trials.append({"seed": prompt.seed, "shares_prefix": prompt.shares_prefix,
                               **judge(variant(ids).logits, model(ids).logits,
                                       ref_model(ids).logits)})
    from pipeline.fp32_reference import describe

    trials = Trial.list_of(trials)
    out = CheckRun(families=families, trials=trials, passed=all(t.passed for t in trials),
                   reference=describe(ref_model), failure=failure_line(families, trials),
                   constants_perturbed={"spread": CONSTANT_PARAM_SPREAD, "parameters": changed})
    if skipped:
        out.paths_skipped = skipped
    return out


def check_modes(model, ref_model, accepted: dict, families: list[str], workloads) -> CheckRun:
    """`whole_model_check` on the first workload of each mode among `workloads` (one, or a
    list), merged: a decode step's families act on no prefill (and most prefill cases on no
    decode step), so a run profiled for both is checked decoding too. Each trial names its
    workload where there are several."""
    firsts = []
    for w in workloads if isinstance(workloads, (list, tuple)) else [workloads]:
        if all(f.mode != w.mode for f in firsts):
            firsts.append(w)
    parts = [whole_model_check(model, ref_model, accepted, families, w) for w in firsts]
    if len(parts) == 1:
        return parts[0]
    trials = [t.model_copy(update={"workload": w.key}) for w, part in zip(firsts, parts)
              for t in part.trials]
    skipped = {f"{w.key} {path}": why for w, part in zip(firsts, parts)
               for path, why in (part.paths_skipped or {}).items()}
    return parts[0].model_copy(update={
        "trials": trials, "passed": all(p.passed for p in parts),
        "failure": failure_line(families, trials), "workloads": [w.key for w in firsts],
        **({"paths_skipped": skipped} if skipped else {})})


def check_and_bisect(model, ref_model, accepted: dict, families: list[str],
                     workload) -> Check:
    """Whole-model check of the set (`check_modes`: `workload` one or several); on failure,
    each family alone, failing ones rejected. `reasons`: one line per rejected family, naming
    it and the trial it failed."""
    full = check_modes(model, ref_model, accepted, families, workload)
    result = Check(set=full, rejected={}, kept=list(families), reasons={})
    if full.passed or not families:
        return result
    for name in families:
        alone = check_modes(model, ref_model, accepted, [name], workload)
        if not alone.passed:
            result.rejected[name] = alone
            result.reasons[name] = alone.failure
    result.kept = [f for f in families if f not in result.rejected]
    if result.kept:
        result.kept_set = check_modes(model, ref_model, accepted, result.kept, workload)
        if not result.kept_set.passed:
            for f in result.kept:
                result.rejected[f] = result.kept_set
                result.reasons[f] = result.kept_set.failure
            result.kept = []
    return result


def patch_took_effect(model, accepted: dict, families: list[str], workload) -> PatchEffect:
    """Prove the patch is live: each family's kernel is dispatched, and the aten compute ops
    it replaces run fewer times in the patched forward (a TorchDispatchMode counts them, on
    any device). On a GPU a re-profile also lists the new kernels by name. (A CPU re-profile
    with stacks would trace every Python line the Triton interpreter runs.)"""
    from profiling.capture import make_runner
    from verify.integrity import OpRecorder

    runner = make_runner(model, workload)
    calls: dict[str, int] = {f: 0 for f in families}

    def count_ops():
        with torch.no_grad(), OpRecorder() as rec:
            runner.call()
        runner.reset()
        return rec.counts

    before = count_ops()
    with patched(model, accepted, families, calls=calls):
        after = count_ops()
        per_pass = dict(calls)  # the GPU re-profile below runs the pass once more
        kernels = _gpu_kernel_names(runner) if workload.device.startswith("cuda") else []
    fewer = {}
    for name in families:
        ops = set(get_family(name).aten_ops)
        fewer[name] = {op: [before.get(op, 0), after.get(op, 0)] for op in sorted(ops)}
    ok = all(_proven(per_pass[f], fewer[f]) for f in families)
    return PatchEffect(kernel_calls=per_pass, aten_ops_before_after=fewer, new_kernels=kernels,
                       passed=ok)


def with_effect_of(family: str, effect: PatchEffect | dict | None,
                   other: PatchEffect | dict) -> PatchEffect:
    """`effect` with `family`'s proof from `other`, a proof of the set that family ships in
    (a family tried in place of another is patched without it, so it has a proof of its own)."""
    out = PatchEffect.of(effect) if effect is not None else PatchEffect(
        kernel_calls={}, aten_ops_before_after={}, new_kernels=[], passed=True)
    other = PatchEffect.of(other)
    fewer = other.aten_ops_before_after[family]
    calls = other.kernel_calls[family]
    return PatchEffect(kernel_calls={**out.kernel_calls, family: calls},
                       aten_ops_before_after={**out.aten_ops_before_after, family: fewer},
                       new_kernels=sorted(set(out.new_kernels) | set(other.new_kernels)),
                       passed=out.passed and _proven(calls, fewer))


def _proven(calls: int, fewer: dict) -> bool:
    """The family's kernel ran, and at least one of its aten ops ran fewer times. A family
    that names no aten op (`Family.aten_ops` empty: matmul, whose cuBLAS candidate runs
    aten::mm on a padded weight, so no op count drops) is proven by its counted kernel calls
    alone: the counter sits on the kernel the chooser returned, not on the adapter, so a call
    that fell back to the module's own code is not counted. Without this, GPT-2 b8's report
    said "Patch took effect: NO" for a live LM-head patch (benchmarks/results, 1204b)."""
    if not fewer:
        return calls > 0
    return calls > 0 and any(after < before for before, after in fewer.values())


def gpu_kernel_times(runner) -> dict[str, float]:
    """Kernel name -> its GPU time in us, summed over one profiled pass (CUDA only)."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        runner.call()
        torch.cuda.synchronize()
    runner.reset()
    times: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            times[e.name] = times.get(e.name, 0.0) + e.time_range.elapsed_us()
    return times


def _gpu_kernel_names(runner) -> list[str]:
    return sorted(n for n in gpu_kernel_times(runner)
                  if not n.startswith(("void at::", "at::", "Memset", "Memcpy")))


def family_kernels(accepted: dict, families: list[str]) -> dict[str, list[str]]:
    """family -> the kernel names its accepted sources can launch (`kernel_names`)."""
    names: dict[str, set[str]] = {f: set() for f in families}
    for acc in Accepted.map_of(accepted).values():
        if acc.family in names:
            names[acc.family] |= kernel_names(Path(acc.source).read_text())
    return {f: sorted(n) for f, n in names.items()}


def reprofile(model, accepted: dict, families: list[str], workload,
              workload_cases: dict) -> Reprofile:
    """GPU time per kernel of one unpatched and one patched pass, each after a warm-up pass:
    what the report sets against the projection, family by family (`projection_gap`)."""
    from profiling.capture import make_runner

    try:
        runner = make_runner(model, workload)
        runner.once()
        base = gpu_kernel_times(runner)
        with patched(model, accepted, families, workload_cases):
            runner.once()
            after = gpu_kernel_times(runner)
    except Exception as e:  # noqa: BLE001 - a diagnostic after the decisions must not end the run
        return Reprofile(families=families, error=f"{type(e).__name__}: {e}")
    return Reprofile(families=families, unpatched_us=base, patched_us=after,
                     family_kernels=family_kernels(accepted, families))


class _Timings:
    """The paired whole-model timings of one model and workload: a patched set against the
    unpatched model, or a set against the set without a family; interleaved pairs."""

    def __init__(self, model, workload, accepted: dict, workload_cases: dict, pairs: int,
                 paired_ratio):
        self.model, self.workload, self.accepted, self.cases = model, workload, accepted, \
            workload_cases
        self.pairs, self.paired_ratio, self.device = pairs, paired_ratio, workload.device
        self.base = self.runner_for(model)

    def runner_for(self, m):
        from profiling.capture import make_runner

        once = make_runner(m, self.workload).once

        def run():
            once()
        run.model = m  # which model a timed call runs (the tests' fake timer reads it)
        return run

    def against_base(self, families):
        variant = twin(self.model)
        with patched(variant, self.accepted, families, self.cases):
            return self.paired_ratio(self.base, self.runner_for(variant), n=self.pairs,
                                     device=self.device)

    def with_against_without(self, rest, families):
        without, with_ = twin(self.model), twin(self.model)
        with patched(without, self.accepted, rest, self.cases), \
                patched(with_, self.accepted, families, self.cases):
            return self.paired_ratio(self.runner_for(without), self.runner_for(with_),
                                     n=self.pairs, device=self.device)

    def combine(self, families) -> tuple[Ratio, list[str]]:
        r = self.against_base(families)
        if r.meaningful and r.verdict == "slower":
            return _ratio(r, decision="rolled back: the combined set regresses"), []
        return _ratio(r, bound=pass_bound(r), decision="kept"), families


def _ratio(r, **more) -> Ratio:
    """A paired ratio's record (`verify.timing.PairedRatio`), with the decision taken on it."""
    return Ratio(**r.to_dict(), **more)


UNREACHED = ("not integrated: its kernel ran 0 times in a pass with the set patched (no call "
             "matched a verified case; another family may hand it another layout)")


DECLINED = ("the pass asked for {n} case(s) no accepted kernel covers, where the original code "
            "ran (the kernel's share of the pass is smaller than its ranking row's)")


def reach(model, workload, accepted: dict, families: list[str],
          workload_cases: dict, declined: dict | None = None) -> dict[str, int]:
    """Kernel calls per family in one pass of `workload` with all of `families` patched, as the
    timings patch them. A family at 0 would be timed, kept and projected for nothing: on
    Phi-3-mini b8 s1024 the rope kernel left the keys a column block of qkv_proj's output,
    which no verified kv_cache case described, and kv_cache shipped with 0 calls, projected to
    save 8.5 ms of a 115 ms pass. `declined` (filled in place): per family, the case keys the
    pass asked for that no accepted kernel covers, where the original code ran instead."""
    from profiling.capture import make_runner

    calls = {f: 0 for f in families}
    with patched(model, accepted, families, workload_cases, calls=calls,
                 declined=declined), torch.no_grad():
        runner = make_runner(model, workload)
        runner.call()
        runner.reset()
    return calls


def measure(model, workload, accepted: dict, families: list[str], workload_cases: dict,
            pairs: int, paired_ratio) -> IntegratedWorkload:
    """Each family alone against the baseline, then all kept ones, then each kept one in the
    set against the set without it (`prune_set`); interleaved pairs. A family whose kernel
    the set's pass never calls (`reach`) is not timed (`unreached`)."""
    t = _Timings(model, workload, accepted, workload_cases, pairs, paired_ratio)
    declined: dict[str, list[str]] = {}
    calls = reach(model, workload, accepted, families, workload_cases,
                  declined) if families else {}
    unreached = {f: UNREACHED for f in families if calls[f] == 0}
    families = [f for f in families if f not in unreached]
    per_family, kept = {}, []
    for name in families:
        r = t.against_base([name])
        per_family[name] = _ratio(r, decision=_decision(r))
        if per_family[name].decision != "rolled back":
            kept.append(name)

    combined = None
    if kept:
        combined, kept = t.combine(kept)
        if combined.meaningful and len(kept) > 1:
            pruned = prune_set(kept, {f: per_family[f].estimate for f in kept},
                               t.with_against_without, per_family)
            if pruned != kept:
                # the shipped set is timed again against the baseline, under the same rule
                before = _without_times(combined)
                combined, kept = t.combine(pruned)
                combined.before_pruning = before
    return IntegratedWorkload(per_family=per_family, combined=combined, kept=kept,
                              unreached=unreached, declined=declined)


def fall_back(model, workload, accepted: dict, measured: IntegratedWorkload, family: str,
              instead_of: str, workload_cases: dict, pairs: int, paired_ratio) -> None:
    """`family` was set aside before any measurement for `instead_of`, which replaces the same
    ops; `instead_of` did not ship on this workload (`measured`, from `measure`), so `family`
    is tried in its place under the same rules: alone against the baseline, in the shipped set
    against the set without it, and the set with it against the baseline. Without this, a
    family rolled back on a slow host takes the one set aside for it out of the model too.
    Updates `measured` in place."""
    kept = list(measured.kept)
    if reach(model, workload, accepted, kept + [family], workload_cases)[family] == 0:
        measured.unreached = {**measured.unreached, family: UNREACHED}
        return
    t = _Timings(model, workload, accepted, workload_cases, pairs, paired_ratio)
    r = t.against_base([family])
    rec = _ratio(r, decision=_decision(r), fallback_for=instead_of)
    measured.per_family[family] = rec
    if rec.decision == "rolled back":
        return
    if kept:
        r = t.with_against_without(kept, kept + [family])
        rec.in_set = _without_times(_ratio(r))
        if r.meaningful and r.verdict == "slower":
            rec.decision = "rolled back: the set is slower with it"
            return
    combined, shipped = t.combine(kept + [family])
    if not shipped:  # the set without it still ships
        rec.decision = "rolled back: the set with it regresses"
        rec.combined_with_it = _without_times(combined)
        return
    if measured.combined is not None:
        combined.before_fallback = _without_times(measured.combined)
    measured.combined, measured.kept = combined, shipped


def prune_set(kept: list[str], alone_ratio: dict[str, float], compare,
              per_family: dict) -> list[str]:
    """A family that speeds the model up alone can still slow the set down: once the others
    have shrunk the device time, the pass waits on the host, and a kernel whose launch costs
    more host time than the code it replaced then costs more than its device time saves (a
    kernel that barely wins alone while adding tens of microseconds of host per call).
    Each family, the least useful alone first, is timed in the set against the set without it
    (`compare(rest, with)`, a paired ratio with / without); where the 95 % CI shows the set
    slower with it, it is rolled back for this workload. Records go into each family's
    `in_set` (in `per_family`); returns the families kept. Up to k - 1 tests per workload: a
    family that makes no difference is rolled back by chance about 2.5 % of the time per
    test."""
    for f in sorted(kept, key=lambda f: -alone_ratio[f]):
        if len(kept) < 2:
            break
        rest = [k for k in kept if k != f]
        r = compare(rest, kept)
        per_family[f].in_set = _without_times(_ratio(r))
        if r.meaningful and r.verdict == "slower":
            per_family[f].decision = "rolled back: the set is slower with it"
            kept = rest
    return kept


# The forward returns to Python after this share of its wall time or later: the GPU waits on
# the host, so faster kernels cannot shorten the pass.
HOST_BOUND = 0.9


def pass_bound(ratio) -> Bound | None:
    """What bounds each side of a paired measurement: median host time (until the forward
    returned) against median wall time. A forward that synchronises inside, or blocks on a
    full launch queue, also returns late, so this reads host-bound then too. Kept sets only
    (a rolled-back set ships nothing to describe). The shipped set can leave a device-bound
    pass waiting on the host: once its kernels are faster, the patched pass's host time is
    most of its wall, and on a slower host it loses what the kernels saved. None off the GPU
    (no synchronise: host and wall time are one) and where the record has no host times
    (recorded before they were)."""
    import statistics

    ratio = Ratio.of(ratio if isinstance(ratio, (dict, Record)) else ratio.to_dict())
    if not ratio.meaningful or not ratio.host_b_ms or not ratio.times_b_ms:
        return None

    def side(host_ms: list[float], times_ms: list[float]) -> BoundSide:
        host, wall = statistics.median(host_ms), statistics.median(times_ms)
        return BoundSide(host_ms=host, wall_ms=wall, host_bound=host >= HOST_BOUND * wall)
    return Bound(unpatched=side(ratio.host_a_ms, ratio.times_a_ms),
                 patched=side(ratio.host_b_ms, ratio.times_b_ms))


def _without_times(ratio: Ratio) -> Ratio:
    """A paired ratio's record without its per-call times (the ratios stay)."""
    return ratio.without("times_a_ms", "times_b_ms", "host_a_ms", "host_b_ms")


def _decision(r) -> str:
    if not r.meaningful:
        return "kept (timing not meaningful here: no decision on speed)"
    if r.verdict == "slower":
        return "rolled back"
    return "kept" if r.verdict == "faster" else "kept (no significant difference)"


def fp32_reference(model, layer_by_layer: bool | None = None):
    """The whole-model check's fp32 reference: a copy where it fits, else layer by layer
    over the model's own weights (pipeline.fp32_reference)."""
    from pipeline import fp32_reference as ref

    return ref.fp32_reference(model, layer_by_layer)

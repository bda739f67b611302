"""Every check a candidate goes through. Runs inside the worker process (verify/worker.py).

Per case (the given ones and the family's edge cases), per input set (`trials` random draws, one
draw per stress kind, one with NaN/+inf/-inf injected), the candidate runs twice: once into an
output poisoned with NaN bytes and once with a large finite poison, each inside guard bytes. From
those two runs come:

    runs              forward returned without raising
    numerics          random inputs within tolerance (rule: verify/tolerances.py)
    memoisation       input sets that repeat the last one in part (verify/numerics.py's
                      generic probes; verify/probes.py's, after the family's fixed inputs)
                      within tolerance
    stress            large / tiny / mixed-scale / all-equal-row inputs within tolerance
    nonfinite         NaN and Inf propagate as the reference does
    writes_all        no output element still holds the poison of both runs
    deterministic     the two runs agree bitwise wherever they wrote
    out_of_bounds     guard bytes around `out` (and gaps of a strided `out`) untouched
    out_buffer        `out` keeps its storage, shape and strides (no out.set_(...))
    inputs_unchanged  every input's whole storage is bitwise unchanged
    in_place          families whose adapter writes the result over its inputs (rope:
                      `VerifyHooks.in_place`) get, on the first random input set, the same
                      result bit for bit when `out` is those inputs
    aten_ops          none of family.aten_ops dispatched (TorchDispatchMode; plus the profiler
                      on a GPU)
    default_stream    all GPU work on the caller's stream (profiler); skipped on the CPU

`out` is the buffer the family's adapter hands its kernel (`Family.make_out`); where that is
wider than the result (`VerifyHooks.out_region`: matmul's pad columns), numerics, writes_all and
deterministic judge the result's region only, and out_of_bounds the whole buffer.

Each emits one record per case: {"name", "case", "passed", "detail"} (+ "skipped").
"""

from __future__ import annotations

import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from core.family import baseline_case_of, result_region
from verify.integrity import (
    POISON_NAN,
    GuardedOut,
    OpRecorder,
    bits,
    clone_layouts,
    disallowed_ops,
    profile_streams,
    snapshot_inputs,
    synchronize,
)
from verify.loading import case_params, load_candidate, load_family
from verify.numerics import (
    MEMO_KINDS,
    STRESS_KINDS,
    Comparison,
    apply_stress,
    as_tuple,
    compare,
    inject_nonfinite,
    input_plan,
    order_slack,
    reference_outputs,
    repeat_in_part,
    seed_for,
    stress_indices,
)
from verify.probes import (
    PROBE_KINDS,
    new_activations,
    new_weights,
    probe_kinds,
)
from verify.static import check_source
from verify.timing import NOT_GPU_REASON, bench, copy_reference
from verify.tolerances import tolerance_for

# cache_rewound is a fresh draw (a cache one position short): nothing repeats yet
CHECK_OF_KIND = {"random": "numerics", "nonfinite": "nonfinite", "cache_rewound": "numerics",
                 **{k: "memoisation" for k in MEMO_KINDS + PROBE_KINDS
                    if k != "cache_rewound"},
                 **{k: "stress" for k in STRESS_KINDS}}
ORDER = ("reference", "runs", "numerics", "memoisation", "stress", "nonfinite", "writes_all",
         "deterministic", "out_of_bounds", "out_buffer", "inputs_unchanged", "in_place",
         "aten_ops", "default_stream", "timed_results")
TIMING_BUFFERS = 3  # rotating input/output sets of the timing runs; values come from one more

Emit = Callable[[str, Any], None]


class _ContextLost(Exception):
    """The device is unusable after the candidate (e.g. a CUDA illegal memory access)."""


class CaseChecks:
    """Pass/fail per check name for one case, across all its input sets."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.evaluated: Counter[str] = Counter()
        self.failures: dict[str, list[str]] = {}
        self.skipped: dict[str, str] = {}
        self.stats: dict[str, Comparison] = {}  # per input kind, worst over its input sets
        self.reference_dtype = ""

    def record(self, name: str, problems: list[str], context: str) -> None:
        self.evaluated[name] += 1
        if problems:
            self.failures.setdefault(name, []).append(f"{context}: {'; '.join(problems)}")

    def skip(self, name: str, reason: str) -> None:
        self.skipped[name] = reason

    def add_stats(self, kind: str, c: Comparison) -> None:
        old = self.stats.get(kind)
        if old is None:
            self.stats[kind] = c
            return
        for f in ("max_abs", "max_rel", "worst_ratio", "baseline_max_abs", "baseline_max_rel"):
            setattr(old, f, max(getattr(old, f), getattr(c, f)))

    def errors(self) -> dict:
        """Max errors of the random trials (what the case's inputs look like in a model), the
        worst ratio to the allowed error over every input set, and each kind on its own (stress
        inputs can make the baseline itself lose everything, e.g. an fp32 overflow)."""
        fields = ("max_abs", "max_rel", "worst_ratio", "baseline_max_abs", "baseline_max_rel")
        random = self.stats.get("random")
        return {"case": self.label, "reference_dtype": self.reference_dtype,
                **{f: getattr(random, f) if random else None for f in fields},
                "worst_ratio_any_input": max((c.worst_ratio for c in self.stats.values()),
                                             default=None),
                "by_kind": {k: {f: getattr(c, f) for f in fields} for k, c in self.stats.items()}}

    def _pass_detail(self, name: str) -> str:
        n = self.evaluated[name]
        kinds = [k for k in self.stats if CHECK_OF_KIND[k] == name]
        if kinds:
            s = {f: max(getattr(self.stats[k], f) for k in kinds)
                 for f in ("max_abs", "max_rel", "worst_ratio", "baseline_max_abs")}
            return (f"{n} input sets: max abs {s['max_abs']:.3g}, max rel {s['max_rel']:.3g}, "
                    f"{s['worst_ratio']:.2f} of allowed; baseline max abs "
                    f"{s['baseline_max_abs']:.3g} (reference in {self.reference_dtype})")
        return f"{n} runs"

    def records(self) -> list[dict]:
        out = []
        for name in ORDER:
            if name in self.skipped:
                out.append({"name": name, "case": self.label, "passed": True, "skipped": True,
                            "detail": self.skipped[name]})
            elif self.evaluated[name]:
                fails = self.failures.get(name, [])
                more = f" (and {len(fails) - 1} more)" if len(fails) > 1 else ""
                out.append({"name": name, "case": self.label, "passed": not fails,
                            "detail": fails[0] + more if fails else self._pass_detail(name)})
        return out


def _describe(e: BaseException) -> str:
    """The exception's own line first (what a reason quotes), then where it came from."""
    only = "".join(traceback.format_exception_only(type(e), e)).strip().splitlines()
    where = "".join(traceback.format_tb(e.__traceback__)[-2:])
    return "\n".join([only[-1], *only[:-1], where.rstrip()])[:1500]


def _out_arg(made: Any) -> Any:
    """What `out=` receives: the tensor, or a tuple for multi-output families."""
    return tuple(made) if isinstance(made, list) else made


@dataclass
class _Run:
    outs: list[GuardedOut]
    problems: dict[str, list[str]]


class _Rotation:
    """Input and output buffers for the timing runs. `advance()` (untimed) moves to the next
    buffer, copies the next of TIMING_BUFFERS + 1 value sets into its inputs (so a buffer
    never sees the same values twice running) and refills its outputs with NaN bytes."""

    def __init__(self, family, case: dict, device: torch.device, seeds: list[int]) -> None:
        def draw(seed: int) -> tuple:
            gen = torch.Generator(device=device).manual_seed(seed)
            return as_tuple(family.make_inputs(case, device, gen))

        self.family, self.case = family, case
        self.values = [draw(s) for s in seeds]
        self.buffers = [draw(s) for s in seeds[:TIMING_BUFFERS]]
        self.outs = [family.make_out(case, b) for b in self.buffers]
        self.values_of: list[int | None] = [None] * TIMING_BUFFERS
        self.calls = 0
        self.k = 0

    def advance(self) -> None:
        self.k = self.calls % TIMING_BUFFERS
        v = self.calls % len(self.values)
        for dst, src in zip(self.buffers[self.k], self.values[v]):
            if isinstance(dst, torch.Tensor):
                dst.copy_(src)
        for o in as_tuple(self.outs[self.k]):
            if o.dtype == torch.bool:
                o.fill_(True)
            else:
                bits(o).fill_(-1)  # all bytes 0xFF: NaN in every float format
        self.values_of[self.k] = v
        self.calls += 1

    def inputs(self) -> tuple:
        return self.buffers[self.k]

    def out(self) -> Any:
        return _out_arg(self.outs[self.k])

    def results(self, k: int) -> tuple:
        """The result's region of buffer k's outputs (`VerifyHooks.out_region`)."""
        return as_tuple(result_region(self.family, self.case, _out_arg(self.outs[k])))


class Suite:
    def __init__(self, request: dict, emit: Emit) -> None:
        self.request = request
        self.emit = emit
        self.device = torch.device(request["device"])
        self.family = load_family(request["family"])
        self.forward: Callable[..., None] | None = None
        self.all_passed = True
        # per run: the random prefill of `out` differs from one verification to the next
        self.nonce = int(request.get("nonce", 0))
        self.previous: tuple | None = None  # the last random input set, for the memo probes
        self.previous_kind: str | None = None
        self.memo_kinds = MEMO_KINDS + probe_kinds(self.family)

    # -- one candidate call -------------------------------------------------------------------
    def _call(self, inputs: tuple, templates: tuple, single: bool, params: dict,
              fill: int | None) -> _Run | str:
        """fill: None for NaN bytes, else the seed of a random finite prefill."""
        guards = [GuardedOut.like(t, POISON_NAN) if fill is None else
                  GuardedOut.random(t, fill + i) for i, t in enumerate(templates)]
        out_arg = guards[0].view if single else tuple(g.view for g in guards)
        snaps = snapshot_inputs(inputs)
        metas = [g.meta() for g in guards]
        recorder = OpRecorder()
        try:
            with recorder:
                self.forward(*inputs, out=out_arg, **params)
            synchronize(self.device)
        except BaseException as e:  # noqa: BLE001 - SystemExit from a candidate is a failure too
            if self.device.type == "cuda":
                try:
                    torch.cuda.synchronize(self.device)
                except RuntimeError as lost:
                    raise _ContextLost(f"{_describe(e)}\ndevice unusable afterwards: {lost}") \
                        from None
            return _describe(e)
        bad = disallowed_ops(recorder.counts, self.family.verify.library_ops)
        problems = {
            "inputs_unchanged": [p for i, s in snaps for p in s.problems(i)],
            "out_buffer": [f"output {i}: was {m[:3]}, now {g.meta()[:3]}"
                           for i, (g, m) in enumerate(zip(guards, metas)) if g.meta() != m],
            "out_of_bounds": [f"output {i}: {n} elements outside it were written"
                              for i, g in enumerate(guards) if (n := g.changed_outside())],
            "aten_ops": [f"ran {bad}: compute ops outside the allow-list "
                         "(verify.integrity.ALLOWED_OPS; TorchDispatchMode)"] if bad else [],
        }
        return _Run(guards, problems)

    def _inputs(self, case: dict, kind: str, seed: int) -> tuple[tuple, str] | None:
        """(inputs, what a memoisation probe held and changed, for the record), or None where
        the probe has nothing to probe (a cache that cannot be rewound)."""
        gen = torch.Generator(device=self.device).manual_seed(seed)
        note = ""
        if kind == "cache_grows":
            if self.previous is None or self.previous_kind != "cache_rewound":
                return None
            inputs = self.previous
            self.family.verify.cache.grow(case, inputs, gen)
            note = "the last call's cache one position longer, in the same buffers"
        elif kind in ("new_activations", "new_weights") and self.previous is not None:
            probe = new_activations if kind == "new_activations" else new_weights
            inputs, note = probe(self.family, self.previous, seed)
        else:
            inputs = as_tuple(self.family.make_inputs(case, self.device, gen))
            if kind in MEMO_KINDS and self.previous is not None:
                inputs = repeat_in_part(kind, self.previous, inputs,
                                        self.family.verify.stress_inputs)
            if kind == "cache_rewound":
                if not self.family.verify.cache.rewind(case, inputs):
                    return None
                note = "the cache one position short of the drawn one"
        if kind == "random" or kind in self.memo_kinds:
            self.previous, self.previous_kind = inputs, kind
        return inputs, note

    # -- one input set ------------------------------------------------------------------------
    def _input_set(self, checks: CaseChecks, case: dict, params: dict, kind: str,
                   trial: int) -> bool:
        """False when the candidate raised (the rest of the case is skipped)."""
        seed = seed_for(self.request["seed"], checks.label, kind, trial)
        context = f"{kind} trial {trial} (seed {seed})" if kind == "random" else \
            f"{kind} (seed {seed})"
        self.emit("phase", f"{checks.label}: {context}")
        drawn = self._inputs(case, kind, seed)
        if drawn is None:
            return True
        inputs, note = drawn
        if note:
            context += f": {note}"
        where = stress_indices(self.family, inputs)
        if kind in STRESS_KINDS and not apply_stress(inputs, where, kind, seed):
            return True
        if kind == "nonfinite":
            placed = inject_nonfinite(inputs, where, seed)
            if not placed:
                return True
            context += f" {', '.join(placed[:6])}" + (" ..." if len(placed) > 6 else "")
        try:
            refs, bases, checks.reference_dtype = reference_outputs(self.family, inputs, params)
            slacks = order_slack(self.family, inputs, params,
                                 refs if checks.reference_dtype == "float64" else None)
        except Exception as e:  # noqa: BLE001 - a broken reference is reported, not raised
            checks.record("reference", [f"{type(e).__name__}: {e}"], context)
            return True
        made = self.family.make_out(case, inputs)
        single = not isinstance(made, (tuple, list))
        templates = as_tuple(made)
        runs = []
        fill = seed_for(self.request["seed"], checks.label, kind, trial, "fill", self.nonce)
        for prefill in (None, fill):
            run = self._call(inputs, templates, single, params, prefill)
            if isinstance(run, str):
                checks.record("runs", [run], context)
                return False
            runs.append(run)
        checks.record("runs", [], context)
        first, second = runs
        for name, problems in first.problems.items():
            both = list(dict.fromkeys(problems + second.problems.get(name, [])))
            checks.record(name, both, context)

        def region(values: list) -> tuple:
            """The result's part of per-output tensors shaped like the outputs."""
            return as_tuple(result_region(self.family, case, values[0] if single
                                          else tuple(values)))

        unwritten, unstable = [], []
        nevers = region([a.unwritten() & b.unwritten() for a, b in zip(first.outs, second.outs)])
        differs = region([bits(a.view) != bits(b.view) for a, b in zip(first.outs, second.outs)])
        for i, (never, differ) in enumerate(zip(nevers, differs)):
            differ = differ & ~never
            if int(never.sum()):
                idx = [int(v) for v in never.nonzero()[0]] if never.dim() else []
                unwritten.append(f"output {i}: {int(never.sum())} of {never.numel()} elements "
                                 f"never written (first at {idx})")
            if int(differ.sum()):
                unstable.append(f"output {i}: {int(differ.sum())} elements differ between "
                                "two runs on the same inputs")
        checks.record("writes_all", unwritten, context)
        checks.record("deterministic", unstable, context)
        tols = [tolerance_for(t.dtype) for t in region(list(templates))]
        problem = []
        # Both runs are judged: a candidate that behaves only while `out` looks like poison
        # is wrong in the run whose `out` holds random values.
        for run, how in ((first, "out prefilled with NaN"),
                         (second, f"out prefilled with random values (seed {fill})")):
            result = compare(list(region([g.view for g in run.outs])), refs, bases, tols, slacks,
                             distribution=kind == "random" or kind in self.memo_kinds)
            checks.add_stats(kind, result)
            if not result.ok:
                problem.append(f"{result.n_bad} elements outside tolerance "
                               f"({result.n_nonfinite_bad} non-finite mismatches), {how}; "
                               f"first {result.first_bad}")
                break
        checks.record(CHECK_OF_KIND[kind], problem, context)
        alias = self.family.verify.in_place
        if alias is not None and kind == "random" and trial == 0:
            checks.record("in_place", self._in_place(inputs, alias, first.outs, params),
                          context)
        return True

    def _in_place(self, inputs: tuple, alias: Callable, outs: list, params: dict) -> list[str]:
        """Problems when the candidate writes over its own inputs (out = alias(inputs)), as
        the family's adapter runs it in the model, against its out-of-place result."""
        copies = clone_layouts(inputs)
        out = alias(copies)
        if out is None:  # this case's adapter writes `out` only (VerifyHooks.in_place)
            return []
        try:
            self.forward(*copies, out=out, **params)
            synchronize(self.device)
        except Exception as e:  # noqa: BLE001 - a candidate that cannot alias fails the check
            return [f"raised when out aliases the inputs: {_describe(e).splitlines()[0]}"]
        return [f"output {i}: {n} elements differ when out aliases the inputs"
                for i, (o, g) in enumerate(zip(as_tuple(out), outs))
                if (n := int((bits(o) != bits(g.view)).sum()))]

    # -- the GPU-only stream and profiler check -----------------------------------------------
    def _streams(self, checks: CaseChecks, case: dict, params: dict) -> None:
        if self.device.type != "cuda":
            checks.skip("default_stream", "CPU: no device streams to check")
            return
        seed = seed_for(self.request["seed"], checks.label, "random", 0)
        inputs = as_tuple(self.family.make_inputs(
            case, self.device, torch.Generator(device=self.device).manual_seed(seed)))
        out = _out_arg(self.family.make_out(case, inputs))
        seen = profile_streams(lambda: self.forward(*inputs, out=out, **params), self.device)
        problems = [f"{name} on stream {s} (caller's stream {seen['default_stream']})"
                    for name, s in seen["other_streams"][:5]]
        if seen["current_stream_changed"]:
            problems.append("forward changed the current stream and did not restore it")
        checks.record("default_stream", problems, f"profiled ({seen['n_gpu_events']} GPU events)")
        bad = disallowed_ops(seen["ops"], self.family.verify.library_ops)
        checks.record("aten_ops", [f"ran {bad}: compute ops outside the allow-list (profiler)"]
                      if bad else [], "profiled")

    # -- timing of a candidate that passed everything -----------------------------------------
    def _timing(self, entries: list[dict]) -> tuple[dict, list[dict]]:
        """(timing, checks): candidate and baseline timed over rotating input and output
        buffers whose values are refreshed before every call (outside the timed window), so
        no repetition can be answered from an earlier one; the last result in each output
        buffer is then judged against the reference of the inputs it was computed from."""
        cpu = self.device.type != "cuda"
        budget = {"warmup_ms": 5.0, "rep_ms": 20.0} if cpu else {}
        rows, records = [], []
        for entry in entries:
            if entry["origin"] != "given":
                continue
            case, label = entry["case"], entry["label"]
            params = case_params(self.family, case)
            self.emit("phase", f"{label}: timing")
            rotation = _Rotation(self.family, case, self.device,
                                 [seed_for(self.request["seed"], label, "timing", k, self.nonce)
                                  for k in range(TIMING_BUFFERS + 1)])
            rates = {"min_bytes": self.family.min_bytes(case), "flops": self.family.flops(case)}
            cand = bench(lambda r=rotation, p=params: self.forward(*r.inputs(), out=r.out(), **p),
                         device=self.device, before=rotation.advance, **rates, **budget)
            problems = self._timed_results(rotation, params)
            records.append({"name": "timed_results", "case": label, "passed": not problems,
                            "detail": problems[0] if problems else
                            f"last result of each of {TIMING_BUFFERS} rotating buffers within "
                            "tolerance"})
            # the baseline on what the unpatched model runs (`VerifyHooks.baseline_case`)
            base_case = baseline_case_of(self.family, case)
            base_rot = rotation if base_case == case else _Rotation(
                self.family, base_case, self.device,
                [seed_for(self.request["seed"], label, "baseline", k, self.nonce)
                 for k in range(TIMING_BUFFERS + 1)])
            base = bench(lambda r=base_rot, p=params: self.family.reference(*r.inputs(), **p),
                         device=self.device, before=base_rot.advance, **rates, **budget)
            row = {"case": label, "candidate": cand.to_dict(), "baseline": base.to_dict(),
                   "rotating_buffers": TIMING_BUFFERS}
            if not cpu:
                copy = copy_reference(rates["min_bytes"], self.device)
                row["copy"] = copy.to_dict()
                row["speedup"] = base.median_ms / cand.median_ms
                if cand.gbps and copy.gbps:
                    row["fraction_of_copy_bandwidth"] = cand.gbps / copy.gbps
            rows.append(row)
        timing = {"meaningful": not cpu, "reason": NOT_GPU_REASON if cpu else None,
                  "cases": rows}
        return timing, records

    def _timed_results(self, rotation: _Rotation, params: dict) -> list[str]:
        synchronize(self.device)
        problems = []
        for k in range(TIMING_BUFFERS):
            if rotation.values_of[k] is None:
                continue
            inputs, outs = rotation.buffers[k], rotation.results(k)
            refs, bases, ref_dtype = reference_outputs(self.family, inputs, params)
            tols = [tolerance_for(o.dtype) for o in outs]
            slacks = order_slack(self.family, inputs, params,
                                 refs if ref_dtype == "float64" else None)
            result = compare(list(outs), refs, bases, tols, slacks)
            if not result.ok:
                problems.append(f"timed buffer {k}: {result.n_bad} elements outside tolerance; "
                                f"first {result.first_bad}")
        return problems

    # -- everything ---------------------------------------------------------------------------
    def run(self) -> None:
        self.emit("phase", "checking the source")
        problems = check_source(self.request["source"],
                                getattr(self.family.reference, "__module__", None))
        self.emit("checks", [{"name": "static", "case": None, "passed": not problems,
                              "detail": "; ".join(problems) if problems else
                              "no timer patching, threads, streams or judge imports"}])
        if problems:
            return
        self.emit("phase", "loading candidate")
        try:
            self.forward = load_candidate(self.request["source"])
        except BaseException as e:  # noqa: BLE001 - syntax/import errors are the candidate's
            self.emit("checks", [{"name": "load", "case": None, "passed": False,
                                  "detail": _describe(e)}])
            return
        self.emit("checks", [{"name": "load", "case": None, "passed": True,
                              "detail": "defines forward"}])
        plan = input_plan(self.request["trials"], probe_kinds(self.family))
        for n, entry in enumerate(self.request["cases"]):
            if self.request.get("fail_fast") and not self.all_passed:
                # Rejected already; the remaining cases would only add detail, at a cost.
                self.emit("skipped", [e["label"] for e in self.request["cases"][n:]])
                break
            checks = CaseChecks(entry["label"])
            params = case_params(self.family, entry["case"])
            self.previous = self.previous_kind = None
            try:
                for kind, trial in plan:
                    if kind in self.memo_kinds and entry["origin"] != "given":
                        continue  # a cache keyed on part of the input is no edge case's own
                    if not self._input_set(checks, entry["case"], params, kind, trial):
                        break
                else:
                    self._streams(checks, entry["case"], params)
            except _ContextLost as e:
                checks.record("runs", [str(e)], "device lost")
                self.emit("checks", checks.records())
                self.all_passed = False
                return
            records = checks.records()
            self.all_passed &= all(r["passed"] for r in records)
            self.emit("checks", records)
            self.emit("errors", checks.errors())
        if self.request.get("timing") and self.all_passed:
            timing, records = self._timing(self.request["cases"])
            self.emit("checks", records)
            self.emit("timing", timing)

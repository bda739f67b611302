"""The graphs stage: the host's remedy, applied after integration like a kernel family.

Per workload, on a GPU, the unpatched model and the model with the workload's kept kernels are
captured as CUDA graphs (prefill: `models.graphs.GraphedPrefill` on the workload's input shape;
decode: `models.graphs.StaticDecoder(graph=True)` over a static KV cache, one step replayed at
successive positions). The patched graph is verified against the eager patched model on fresh
inputs copied into the static buffers (decode: at successive positions, against the same
model's eager static-cache decoder) and by the whole-model check (fp32 reference, the 1.5x
rule); then timed, paired and interleaved, against the user's eager call and against the eager
shipped set. Graphs ship for a workload only where both paired 95 % intervals say the graphed
patched model is faster. A capture that fails records its one-line reason and the workload
stays eager; nothing here ends the run.

Which kernels go into the graph is the stage's own choice between two sets: the eager shipped
set, and the integrable set (every family that passed verification and the whole-model check
for the workload, including those the eager timing rolled back). Eager integration decides by
wall time, which at batch 1 is host time: a family that costs host time per call is rolled
back there (a decode step can end up with one family of several), while inside a graph the
host is gone and kernel count and kernel time decide. Where
the two sets differ, the integrable one is captured and verified too and the two graphs are
timed against each other (one extra capture and one paired timing, not a search over subsets);
it is kept only where the paired 95 % interval says it is faster, else the eager set stays.

Then programmatic dependent launch (codegen/pdl.py): where the GPU and Triton support it and
the user did not turn it off (`optimize --no-pdl`, PIPELINE_NO_PDL=1), the chosen set's graph
is captured a second time with PDL on, verified like the first, and the two graphs are timed
paired against each other. Its gain is the overlap of each kernel's start with its
predecessor's tail, which only a whole-graph timing can show, so it is decided here, per
workload, by the same rule: on only where the paired 95 % interval says faster. Both medians
and the decision go into the record (`Graphs.pdl`); later timings (against eager) use the graph
kept.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from contextlib import ExitStack
from functools import partial
from pathlib import Path

import torch

from core.artifacts import load, write_json
from core.integration_records import (
    GraphPDL,
    Graphs,
    GraphSet,
    GraphSets,
    GraphsProjection,
    GraphVerification,
    IntegratedWorkload,
    Integration,
    Medians,
    Ratio,
)
from core.records import Projection, VerificationSummary
from pipeline.patching import patched, twin

NO_GPU = "CUDA graphs need a GPU"
TRIALS = 3
# Graph replay against the eager model it captured: the same kernels run, so their logits agree
# to rounding (relative norm error); a graph reading a stale input or position is off by O(1).
# Not bit for bit: cuBLAS may pick another algorithm (split-K at batch 1) for the eager step
# than under capture, so one trial can differ at the dtype's rounding and the next not at all,
# with the fp32 rule holding on both. A replay may also differ from eager by up to the
# unpatched model's own error against the fp32 reference (the rounding noise of its dtype at
# this shape: a few hundredths in bf16 at b8 s1024; `trial_verdict`). A replay that
# reads a stale input or position is wrong by the logits' own scale, far above either.
GRAPH_TOL = 1e-2
DECODE_STEPS = TRIALS + 1  # static-cache room beyond the prompt: one position per trial


def graphs_stage(run_dir: Path, spec, workloads, summary: VerificationSummary | dict,
                 say: Callable[[str], None], pairs: int, timer=None) -> Integration:
    """Add each measured workload's graphs record to integration.json."""
    integ = load(run_dir / "integration.json", Integration, "integration")
    proj_path = run_dir / "projection.json"
    proj = load(proj_path, Projection, "projection") if proj_path.exists() else None
    measured = [w for w in workloads if w.key in integ.workloads]
    if not measured:
        return integ
    if not can_graph(measured[0].device):
        for w in measured:
            integ.workloads[w.key].graphs = Graphs(skipped=NO_GPU)
        write_json(run_dir / "integration.json", integ)
        return integ
    from pipeline.integrate import fp32_reference
    from profiling.loader import build
    from verify.timing import paired_ratio

    timer = timer or partial(paired_ratio, max_n=2 * pairs)
    accepted = VerificationSummary.of(summary).accepted
    by_dtype: dict[str, list] = {}
    for w in measured:
        by_dtype.setdefault(w.dtype, []).append(w)
    for _dtype, ws in by_dtype.items():
        say(f"building {spec.model_id} for CUDA graphs")
        model = build(spec, ws[0].torch_dtype(), ws[0].device)
        ref = fp32_reference(model)
        for w in ws:
            say(f"graphs {w.key}")
            rec = integ.workloads[w.key]
            frozen = proj.workloads.get(w.key) if proj is not None else None
            projected = frozen.graphs if frozen is not None else None
            try:
                rec.graphs = graph_workload(model, ref, w, accepted, rec.kept, rec.cases, pairs,
                                            timer, projected,
                                            count_kernels=w.device.startswith("cuda"),
                                            integrable=integrable_set(rec))
            except Exception as e:  # noqa: BLE001 - the host's remedy must not end the run
                rec.graphs = Graphs(captured=False, error=_one_line(e),
                                    decision="eager: the graphs stage failed here",
                                    shipped=False, projected=projected)
            if w.device.startswith("cuda"):
                torch.cuda.empty_cache()
            # each workload's record as it is made: a run cut off in a later one resumes
            # with this one done (`optimize` redoes only the workloads without a record)
            write_json(run_dir / "integration.json", integ)
        del model, ref
    return integ


def can_graph(device: str) -> bool:
    return device.startswith("cuda")


def integrable_set(rec: IntegratedWorkload | dict) -> list[str]:
    """The eager shipped set plus every family the whole-model check kept for the workload
    (verified, correct in the model) that the eager timing rolled back, less any that replaces
    the same ops as one already in the set (`RankHooks.rivals`: both would patch one MLP) or whose
    kernel the set's pass never called (`integrate.reach`)."""
    from codegen.registry import get_family

    rec = IntegratedWorkload.of(rec)
    out = list(rec.kept or [])
    unreached = set(rec.unreached)
    for fam in rec.check.kept if rec.check is not None else []:
        rivals = set(get_family(fam).rank.rivals)
        if fam not in out and fam not in unreached and not rivals & set(out):
            out.append(fam)
    return out


def _record_decode_step(rec: Graphs, sides: _Sides) -> None:
    """The graphed decode step's anatomy into `rec`, or why it failed."""
    try:
        step_ms = rec.medians.graphed_kept_ms if rec.medians is not None else None
        rec.decode_step = sides.decode_step(step_ms)
    except Exception as e:  # noqa: BLE001 - a diagnostic must not end the stage
        rec.decode_step_error = _one_line(e)


def graph_workload(model, ref, workload, accepted: dict, kept: list[str], cases: dict,
                   pairs: int, timer, projected: GraphsProjection | dict | None = None,
                   count_kernels: bool = False, integrable: list[str] | None = None) -> Graphs:
    """Capture, verify, time and decide graphs for one workload (see the module docstring).
    `timer(fn_a, fn_b, n=, device=)`: a paired ratio b / a (verify.timing.paired_ratio).
    `integrable`: the set the graph may take instead of `kept` (`integrable_set`)."""
    allowed = {f: set(v) for f, v in cases.items()}
    other = list(integrable or [])
    other = other if other and set(other) != set(kept) else None
    variant, alt = twin(model), twin(model) if other else None
    with torch.no_grad(), ExitStack() as stack:
        stack.enter_context(patched(variant, accepted, kept, allowed))
        if alt is not None:
            stack.enter_context(patched(alt, accepted, other, allowed))
        sides = _Sides(model, variant, workload, kept)
        stack.callback(sides.close)
        rec = Graphs(kept=list(kept), families=list(kept), projected=projected,
                     **sides.capture())
        if not rec.captured:
            rec.update(decision=f"eager: capture failed ({rec.reason})", shipped=False)
            return rec
        rec.verification = sides.verify(ref)
        if not rec.verification.passed:
            rec.update(decision="eager: the graph's output does not match the eager "
                                "patched model", shipped=False)
            return rec
        if other is not None:
            rec.sets = sides.choose_set(alt, other, ref, timer, pairs, count_kernels)
            if rec.sets.chosen == "integrable":
                rec.families = list(other)
                rec.verification = rec.sets.integrable.verification
                rec.sets.integrable = rec.sets.integrable.without("verification")
        rec.pdl = sides.choose_pdl(ref, timer, pairs)
        rec.update(sides.time(timer, pairs))
        rec.decision, rec.shipped = decide(rec.graphed_vs_eager, rec.graphed_vs_eager_kept)
        if count_kernels:
            rec.kernels_per_pass = sides.kernels_per_pass()
            if workload.mode == "decode":
                _record_decode_step(rec, sides)
        rec.measured_speedup = _speedup(rec.graphed_vs_eager)
        return rec


def trial_verdict(e_graph: float, e_new: float, e_base: float) -> dict:
    """One trial's limits and verdict from its relative logits errors: the replay against the
    eager patched model (`e_graph`), the replay and the unpatched model against the fp32
    reference (`e_new`, `e_base`). The replay passes within GRAPH_TOL of eager or within the
    unpatched model's own rounding error (`graph_limit`), and by the whole-model rule."""
    from pipeline.integrate import ERROR_FLOOR, ERROR_RATIO

    graph_limit = max(GRAPH_TOL, e_base)
    limit = max(ERROR_RATIO * e_base, ERROR_FLOOR)
    return {"graph_limit": graph_limit, "limit": limit,
            "passed": e_graph <= graph_limit and e_new <= limit}


def choose(ratio: Ratio | dict) -> tuple[str, str]:
    """(chosen set, why) from the paired ratio integrable-graph / kept-graph: the integrable
    set only where the 95 % CI says its graph is faster (the same rule as every decision)."""
    ratio = Ratio.of(ratio)
    if not ratio.meaningful:
        return "kept", f"the eager shipped set: timing not meaningful here ({ratio.reason})"
    if ratio.verdict == "faster":
        return "integrable", (f"the integrable set: its graph is faster (ratio "
                              f"{ratio.estimate:.3f})")
    return "kept", (f"the eager shipped set: the integrable set's graph is not faster "
                    f"({ratio.verdict}, ratio {ratio.estimate:.3f})")


def choose_pdl(ratio: Ratio | dict) -> tuple[bool, str]:
    """(PDL on, why) from the paired ratio PDL-graph / plain-graph: on only where the 95 % CI
    says the PDL graph is faster (the same rule as every decision)."""
    ratio = Ratio.of(ratio)
    if not ratio.meaningful:
        return False, f"off: timing not meaningful here ({ratio.reason})"
    if ratio.verdict == "faster":
        return True, f"on: the graph with PDL is faster (ratio {ratio.estimate:.3f})"
    return False, (f"off: the graph with PDL is not faster ({ratio.verdict}, ratio "
                   f"{ratio.estimate:.3f})")


def decide(vs_eager: Ratio | dict, vs_kept: Ratio | dict) -> tuple[str, bool]:
    """Graphs ship only where the paired 95 % CI says the graphed patched model is faster than
    the user's eager call and than the eager shipped set; never a regression."""
    for r, what in ((vs_eager, "the eager model"), (vs_kept, "the eager shipped set")):
        r = Ratio.of(r)
        if not r.meaningful:
            return f"eager: timing not meaningful here ({r.reason})", False
        if r.verdict != "faster":
            return (f"eager: graphed is not faster than {what} "
                    f"({r.verdict}, ratio {r.estimate:.3f})"), False
    return "graphs ship", True


class _Sides:
    """The four ways to run one workload: eager and graphed, unpatched and patched."""

    def __init__(self, model, variant, workload, kept_families: list[str] = ()):
        # variant: the eager shipped set; graph_variant: the set in the graph (the same
        # unless `choose_set` adopts the integrable set)
        self.model, self.variant, self.w = model, variant, workload
        self.graph_variant, self.kept_families = variant, list(kept_families)
        self.decode = workload.mode == "decode"
        self.device = workload.device
        self.vocab = model.config.vocab_size
        self.graph_base = self.graph_kept = None
        self.base_reason = None
        self.open: list = []

    def ids(self, seed: int, length: int | None = None) -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed)
        n = self.w.seq if length is None else length
        return torch.randint(0, self.vocab, (self.w.batch, n), generator=gen).to(self.device)

    def _graph(self, m, capture_context=None):
        from models.graphs import GraphedPrefill, StaticDecoder

        if self.decode:
            dec = StaticDecoder(m, self.w.batch, self.w.seq + DECODE_STEPS, graph=True,
                                capture_context=capture_context)
            self.open.append(dec)
            dec.prefill(self.ids(0))
            # the step is captured on its first call: make that happen here, where a failure
            # is a capture failure, then set the position back to the prompt's end
            dec.step(self.ids(1, 1))
            dec.rewind(self.w.seq)
            return dec
        g = GraphedPrefill(m, self.ids(0), capture_context=capture_context)
        self.open.append(g)
        return g

    def capture(self) -> dict:
        from models.graphs import capture_reason

        try:
            self.graph_kept = self._graph(self.variant)
        except Exception as e:  # noqa: BLE001 - a failed capture falls back to eager
            return {"captured": False, "reason": _reason(capture_reason, e)}
        try:
            self.graph_base = self._graph(self.model)
        except Exception as e:  # noqa: BLE001 - only the unpatched graph's timing is lost
            self.base_reason = _reason(capture_reason, e)
        pool = {"kept": self.graph_kept.pool_bytes,
                "unpatched": getattr(self.graph_base, "pool_bytes", None)}
        return {"captured": True, "reason": None, "unpatched_captured": self.graph_base
                is not None, "unpatched_reason": self.base_reason, "pool_bytes": pool}

    def verify(self, ref, graph=None, variant=None) -> dict:
        """The graph of `variant` (default: the kept set's) against that variant eagerly."""
        from pipeline.integrate import logits_error

        graph = self.graph_kept if graph is None else graph
        variant = self.graph_variant if variant is None else variant
        trials = []
        if self.decode:
            from models.graphs import StaticDecoder

            # the unpatched error is the unpatched model's over the same static-cache path
            eager, base_dec = (StaticDecoder(m, self.w.batch, self.w.seq + DECODE_STEPS,
                                             graph=False) for m in (variant, self.model))
            self.open += [eager, base_dec]
            prompt = self.ids(0)
            eager.prefill(prompt)
            base_dec.prefill(prompt)
            graph.rewind(self.w.seq)
            seen = prompt
        for t in range(TRIALS):
            if self.decode:
                step = self.ids(200 + t, 1)
                pos = graph.position
                out = graph.step(step).clone()
                want = eager.step(step)
                seen = torch.cat([seen, step], dim=1)
                ref_out = ref(seen).logits[:, -1:]
                base = base_dec.step(step)
                where = {"position": pos}
            else:
                ids = self.ids(100 + t)
                out = graph(ids).clone()
                want = variant(ids, use_cache=False).logits
                ref_out, base = ref(ids).logits, self.model(ids).logits
                where = {"seed": 100 + t}
            e_graph = logits_error(out, want)
            e_new, e_base = logits_error(out, ref_out), logits_error(base, ref_out)
            trials.append({**where, "graph_vs_eager": e_graph, "error_graphed": e_new,
                           "error_unpatched": e_base, **trial_verdict(e_graph, e_new, e_base)})
        checked = GraphVerification(trials=trials, tolerance=GRAPH_TOL)
        checked.passed = all(t.passed for t in checked.trials)
        return checked

    def graphed(self, g):
        """A timed call of graph `g` (decode: the step at the profiled cache length)."""
        if g is None:
            return None
        if self.decode:
            nxt = self.ids(300, 1)

            def step():
                g.rewind(self.w.seq)  # every timed step at the profiled cache length
                g.step(nxt)
            return step
        ids = self.ids(300)
        return lambda: g(ids)

    def choose_set(self, alt, families: list[str], ref, timer, pairs: int,
                   count_kernels: bool) -> GraphSets:
        """Capture and verify the integrable set's graph, time it against the kept set's,
        adopt it where it is faster (`choose`). Both sets recorded, chosen or not."""
        from models.graphs import capture_reason

        kept, integrable = GraphSet(families=self.kept_families), GraphSet(families=families)
        try:
            graph = self._graph(alt)
        except Exception as e:  # noqa: BLE001 - the kept set's graph still stands
            reason = _reason(capture_reason, e)
            integrable.update(captured=False, reason=reason)
            return GraphSets(kept=kept, integrable=integrable, chosen="kept",
                             why=f"the eager shipped set: the integrable set's capture failed "
                                 f"({reason})")
        integrable.update(captured=True, pool_bytes=graph.pool_bytes)
        verification = self.verify(ref, graph, alt)
        if not verification.passed:
            integrable.verification = verification
            return GraphSets(kept=kept, integrable=integrable, chosen="kept",
                             why="the eager shipped set: the integrable set's graph does not "
                                 "match its eager model")
        r = Ratio.of(timer(self.graphed(self.graph_kept), self.graphed(graph), n=pairs,
                           device=self.device).to_dict())
        kept.graphed_ms, integrable.graphed_ms = _median(r.times_a_ms), _median(r.times_b_ms)
        if count_kernels:
            kept.kernels_per_pass = graph_kernels(self.graphed(self.graph_kept))
            integrable.kernels_per_pass = graph_kernels(self.graphed(graph))
        chosen, why = choose(r)
        if chosen == "integrable":
            integrable.verification = verification
            self.graph_kept, self.graph_variant = graph, alt
        return GraphSets(kept=kept, integrable=integrable, chosen=chosen, why=why,
                         integrable_vs_kept=_brief(r))

    def choose_pdl(self, ref, timer, pairs: int) -> GraphPDL:
        """Capture the graph of the set in it again with PDL on, verify it, time it paired
        against the graph without; keep it where it is faster (`choose_pdl`)."""
        from codegen import pdl
        from models.graphs import capture_reason

        why = pdl.unavailable()
        if why is not None:
            return GraphPDL(on=False, tried=False, why=f"off: {why}")
        # the weight streamers' L2 prefetch rides with PDL only where opted in (codegen/pdl.py)
        tried = {"tried": True, "prefetch": pdl.prefetch_opted_in()}
        try:
            graph = self._graph(self.graph_variant, capture_context=pdl.enabled)
        except Exception as e:  # noqa: BLE001 - the graph without PDL still stands
            reason = _reason(capture_reason, e)
            return GraphPDL(on=False, **tried, captured=False, reason=reason,
                            why=f"off: the capture with PDL failed ({reason})")
        try:
            verification = self.verify(ref, graph)
            if not verification.passed:
                return GraphPDL(on=False, **tried, captured=True, verification=verification,
                                why="off: the graph with PDL does not match the eager model")
            r = Ratio.of(timer(self.graphed(self.graph_kept), self.graphed(graph), n=pairs,
                               device=self.device).to_dict())
        except Exception as e:  # noqa: BLE001 - the graph without PDL still stands
            return GraphPDL(on=False, **tried, captured=True, reason=_one_line(e),
                            why=f"off: checking the graph with PDL failed ({_one_line(e)})")
        on, why = choose_pdl(r)
        if on:
            self.graph_kept = graph
        return GraphPDL(on=on, why=why, **tried, captured=True,
                        off_ms=_median(r.times_a_ms), on_ms=_median(r.times_b_ms),
                        on_vs_off=_brief(r))

    def runners(self) -> dict[str, Callable[[], object]]:
        from profiling.capture import make_runner

        def eager(m):
            runner = make_runner(m, self.w)
            return runner.once

        graphed = self.graphed

        out = {"eager": eager(self.model), "eager_kept": eager(self.variant),
               "graphed": graphed(self.graph_base), "graphed_kept": graphed(self.graph_kept)}
        if self.decode:
            from models.graphs import StaticDecoder

            static = StaticDecoder(self.model, self.w.batch, self.w.seq + DECODE_STEPS,
                                   graph=False)
            self.open.append(static)
            static.prefill(self.ids(0))
            out["eager_static"] = graphed(static)
        return out

    def time(self, timer, pairs: int) -> dict:
        """The paired timings: graphed kept kernels against eager and against eager kept
        kernels, the unpatched graph and (decode) the eager static-cache step against eager,
        and the medians of each side."""
        run = self.runners()

        def pair(a, b) -> Ratio:
            return Ratio.of(timer(run[a], run[b], n=pairs, device=self.device).to_dict())

        main = pair("eager", "graphed_kept")
        vs_kept = pair("eager_kept", "graphed_kept")
        medians = Medians(eager_ms=_median(main.times_a_ms),
                          graphed_kept_ms=_median(main.times_b_ms),
                          eager_kept_ms=_median(vs_kept.times_a_ms), graphed_ms=None)
        out = {"graphed_vs_eager": _brief(main), "graphed_vs_eager_kept": _brief(vs_kept)}
        if self.graph_base is not None:
            base = pair("eager", "graphed")
            medians.graphed_ms = _median(base.times_b_ms)
            out["graphed_unpatched_vs_eager"] = _brief(base)
        if self.decode:
            static = pair("eager", "eager_static")
            medians.eager_static_ms = _median(static.times_b_ms)
            out["eager_static_vs_eager"] = _brief(static)
        return {"medians": medians, **out}

    def kernels_per_pass(self) -> dict:
        """Device kernels of one eager pass, unpatched and with the eager shipped set, and of
        one graphed pass (decode: one step), unpatched and with the set in the graph
        (torch.profiler; CUPTI reports a replay's kernels one by one)."""
        from profiling.capture import make_runner

        counts = {}
        for name, m in (("unpatched", self.model), ("kept", self.variant)):
            runner = make_runner(m, self.w)
            runner.once()
            counts[name] = graph_kernels(runner.once)
        for name, g in (("graphed_unpatched", self.graph_base), ("graphed", self.graph_kept)):
            if g is not None:
                counts[name] = graph_kernels(self.graphed(g))
        return counts

    def decode_step(self, step_ms: float | None) -> dict:
        """The graphed step's anatomy (`pipeline.decode_step`): its kernels with the set in
        the graph, their shares of the measured step, its multiple of the weight-read floor."""
        from pipeline.decode_step import anatomy, step_kernels, weight_bytes
        from profiling.roofline import ceilings

        copy = ceilings(self.device).get("bandwidth_GBps")
        layers = getattr(self.model.config, "num_hidden_layers", 0) or 0
        return anatomy(step_kernels(self.graphed(self.graph_kept)), step_ms,
                       weight_bytes(self.model, self.w.batch), copy, layers)

    def close(self) -> None:
        while self.open:
            self.open.pop().close()


def graph_kernels(call: Callable[[], object]) -> int:
    """Device kernels one synchronised call launches (copies and memsets are not kernels)."""
    from torch.profiler import ProfilerActivity, profile

    call()  # warm: a first call may compile or allocate
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and not e.name.startswith(("Memcpy", "Memset")))


def _median(times: list[float] | None) -> float | None:
    return statistics.median(times) if times else None


def _brief(ratio: Ratio) -> Ratio:
    """A paired ratio's verdict without its per-pair data, and how many pairs it took."""
    return Ratio(estimate=ratio.estimate, ci_low=ratio.ci_low, ci_high=ratio.ci_high,
                 verdict=ratio.verdict, meaningful=ratio.meaningful, reason=ratio.reason,
                 pairs=len(ratio.ratios))


def _speedup(ratio: Ratio | None) -> float | None:
    return 1.0 / ratio.estimate if ratio is not None and ratio.estimate else None


def _reason(capture_reason, exc: BaseException) -> str:
    try:
        return _one_line(capture_reason(exc))
    except Exception:  # noqa: BLE001 - the reason of a failure must not fail in turn
        return _one_line(exc)


def _one_line(x) -> str:
    text = x if isinstance(x, str) else f"{type(x).__name__}: {x}"
    return (text.strip().splitlines() or [""])[0][:300]

"""Ours against eager, torch.compile and CUDA graphs in one process, interleaved, no profiler
(GPU).

    python benchmarks/head_to_head.py RUN_DIR OUT.json [--workload KEY] [--rounds 30]
        [--variants eager,ours,compile,compile-reduce-overhead,graph,ours-graphs,eager-static,
                    ours-compile,ours-kernels,hf-best-experts,ours-graphs-pdl,
                    ours-graphs-nopdl,ours-graphs-pdl-prefetch] [--export PKG]

`pipeline optimize` measures ours against eager in its process; benchmarks/contenders.py
measures compile against eager in another, minutes later. On the lent H200 the host's speed
moves within a call, and a patched set that waits on the host moves with it (Qwen2.5-0.5B b8,
21.5 ms in one call, 16.7 ms in another, against compile's 21.0 ms), so the two ratios
can disagree by more than either CI. Here one process holds the model as built (eager) and
twins over the same weights: patched with the run's kept kernels for the workload
(`pipeline.api.apply_kernels`), `torch.compile` (default mode, and mode="reduce-overhead"),
captured as CUDA graphs (`models.graphs`). Each round times every variant, synchronised, in an
order that rotates; the per-round ratios get bootstrap CIs (`verify.stats`). Liger-Kernel
patches module-level code, so it cannot share the process (contenders.py times it).

Variants (`--variants`, eager always included; the default is the first three):
- eager, ours, compile: the user's call as `pipeline profile` times it (`make_runner`): prefill
  `model(ids)`, decode one token over the default dynamic cache cropped back to `seq`.
- compile-reduce-overhead: torch.compile(mode="reduce-overhead") of a twin; prefill
  `model(ids, use_cache=False)`, decode the static-cache step below.
- graph / ours-graphs: the unpatched twin / a twin patched with the set the graphs stage put
  in the graph (`apply_kernels(graph_set=True)`: the eager shipped set or the integrable one)
  captured (`GraphedPrefill` on `use_cache=False`; `StaticDecoder(graph=True)`), with
  programmatic dependent launch where the graphs stage kept it (`Graphs.pdl`, codegen/pdl.py).
- ours-graphs-pdl / ours-graphs-nopdl: ours-graphs captured with PDL on / off whatever the
  graphs stage decided (skipped where PDL cannot run: no sm_90, the interpreter,
  PIPELINE_NO_PDL), the paired A/B of PDL alone.
- ours-graphs-pdl-prefetch: ours-graphs-pdl with the weight streamers' L2 prefetch before
  the wait (`pdl.enabled(prefetch=True)`), the paired A/B of the prefetch alone against
  ours-graphs-pdl (which has it only where PIPELINE_PDL_PREFETCH is set).
- eager-static (decode only): `StaticDecoder(graph=False)`, eager over the static cache.
- ours-compile: the twin patched with the kept kernels torch.compile traces
  (`apply_kernels(compiled=True)`: each kernel call one custom op, and transformers' SDPA
  attention one opaque op, `codegen.sdpa_op`), then torch.compile in its default mode,
  called as compile is.
- ours-kernels: a twin kernelized with the run's `pipeline export` package (`--export PKG`)
  through the Hugging Face `kernels` library, called as ours is.
- hf-best-experts (MoE models): a twin under the fastest `experts_implementation` the
  installed transformers offers (`models.moe.experts_options`; each option timed on a few
  calls first, `best_experts`), called as eager is; the option and each one's time are in
  the result (`hf_best_experts`).
The compiled variants (COMPILED) are twins of one model class, so they share code objects, and
dynamo's recompile limit (8 entries per code object by default, then the frame runs eager) is
per code object, not per model: in one process a second compiled twin would get what the first
left of it. So the limit is raised to 8 times the number of compiled variants timed, for the
whole process: fair to each, since each keeps the budget it has when compiled alone, and a
variant whose frames recompile beyond it (a graph break per decoder layer, say: each layer's
frame then recompiles per layer index) still falls back to eager as it would alone. Separate
code objects per twin (copies of the model's classes) were not taken: they would time a model
that no user compiles. Each compiled variant's dynamo counts over its calls are recorded
(`dynamo`: graphs compiled, graph breaks in its warm-up calls), so a variant that broke its
graph shows it.
Static-cache decode variants time `rewind(seq)` then `step`, so every call writes position
`seq` as the dynamic cache's does; the cache holds `--max-len` slots (default: seq + 1 rounded
up to 16), which the mask spans. First calls (compiling, capturing) are warm-up, never timed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from core.artifacts import read_json
from core.errors import UserError
from core.workload import Workload
from models.graphs import (
    CaptureError,
    GraphedPrefill,
    StaticDecoder,
    capture_reason,
    static_len,
)
from pipeline.api import apply_kernels
from pipeline.patching import twin
from profiling.capture import make_runner, sync
from profiling.loader import build, resolve
from verify.stats import bootstrap_ci

VARIANTS = ("eager", "ours", "compile")  # the default: what gpu_optimize.sh has always run
ALL_VARIANTS = VARIANTS + ("compile-reduce-overhead", "graph", "ours-graphs", "eager-static",
                           "ours-compile", "ours-kernels", "hf-best-experts",
                           "ours-graphs-pdl", "ours-graphs-nopdl",
                           "ours-graphs-pdl-prefetch")
OURS_GRAPHS = ("ours-graphs", "ours-graphs-pdl", "ours-graphs-nopdl",
               "ours-graphs-pdl-prefetch")
DECODE_ONLY = ("eager-static",)
COMPILED = ("compile", "compile-reduce-overhead", "ours-compile")  # torch.compile's twins
RECOMPILE_LIMIT = 8  # dynamo's default, per code object
FAST_HOST = 1.1  # a round within 10 % of eager's fastest host time counts as a fast host
# ratios beside those over eager: the graph's own gain, the kernels' share inside the graph,
# and the contender the issue sets for graphed ours
PAIRS = (("ours", "compile"), ("ours-graphs", "compile-reduce-overhead"),
         ("ours-graphs", "graph"), ("ours-graphs", "ours"), ("graph", "eager-static"),
         ("ours-compile", "compile"), ("ours-compile", "ours"), ("ours-kernels", "ours"),
         ("ours", "hf-best-experts"), ("ours-graphs", "hf-best-experts"),
         ("ours-graphs-pdl", "ours-graphs-nopdl"),
         ("ours-graphs-pdl-prefetch", "ours-graphs-pdl"))


def parse_variants(text: str | None, mode: str) -> tuple[list[str], dict[str, str]]:
    """(variants to time, eager first; {variant: why it is not timed}) from `--variants`."""
    names = [v.strip() for v in (text or ",".join(VARIANTS)).split(",") if v.strip()]
    unknown = [v for v in names if v not in ALL_VARIANTS]
    if unknown:
        raise UserError(f"unknown variant(s) {', '.join(unknown)}; known: "
                        f"{', '.join(ALL_VARIANTS)}")
    skipped = {v: "decode only: it times the static-cache step" for v in names
               if v in DECODE_ONLY and mode != "decode"}
    chosen = ["eager"] + [v for v in dict.fromkeys(names) if v != "eager" and v not in skipped]
    return chosen, skipped


def rotation(variants: list[str], i: int) -> list[str]:
    """Round i's order: the list rotated by i, so each variant leads as often as the others."""
    k = i % len(variants)
    return variants[k:] + variants[:k]


def device_kernels(events) -> list:
    """Device kernels among profiler events (copies and memsets are not kernels)."""
    return [e for e in events if str(getattr(e, "device_type", "")).endswith("CUDA")
            and not e.name.startswith(("Memcpy", "Memset", "memcpy", "memset"))]


def kernel_count(events) -> int:
    return len(device_kernels(events))


TOP_KERNELS = 12


def top_kernels(events) -> list[list]:
    """[name, calls, ms] of the kernels that took longest in total, longest first: what two
    variants' passes differ in, when their times do."""
    by_name: dict[str, list] = {}
    for e in device_kernels(events):
        row = by_name.setdefault(e.name[:100], [e.name[:100], 0, 0.0])
        row[1] += 1
        row[2] += e.time_range.elapsed_us() / 1e3
    return sorted(by_name.values(), key=lambda r: -r[2])[:TOP_KERNELS]


def kernels_per_pass(call: Callable[[], None], setup: Callable[[], None] | None = None
                     ) -> tuple[int | None, list[list]]:
    """Kernels one synchronised call launches, from torch.profiler (None when it sees none:
    a graph replay's kernels are reported on some CUPTI versions only), and the longest."""
    from torch.profiler import ProfilerActivity, profile

    if setup is not None:
        setup()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    events = prof.events()
    return kernel_count(events) or None, top_kernels(events)


def timed(call, device: str, setup=None) -> tuple[float, float]:
    """(wall ms, ms until the call returned: its host time, the GPU's wait aside); `setup`
    runs first, untimed (a static-cache step's rewind)."""
    if setup is not None:
        setup()
    sync(device)
    t = time.perf_counter()
    call()
    returned = time.perf_counter()
    sync(device)
    return (time.perf_counter() - t) * 1e3, (returned - t) * 1e3


def device_allocs(device: str) -> int | None:
    """The caching allocator's count of device allocations (cudaMalloc or cuMemMap) so far; a
    pass that makes any waits on the driver, which a pass reusing cached blocks does not."""
    if not device.startswith("cuda"):
        return None
    return torch.cuda.memory_stats().get("num_device_alloc")


def timed_counting(call, device: str, setup=None) -> tuple[float, float, int | None]:
    """timed(), and the device allocations the call made (None off CUDA)."""
    before = device_allocs(device)
    wall, returned = timed(call, device, setup)
    after = device_allocs(device)
    return wall, returned, None if before is None or after is None else after - before


def alone(call, device: str, rounds: int, warm: int = 3) -> dict | None:
    """Medians of `rounds` timed calls of `call` made before any other variant exists: eager's
    host speed with no compiled twin, graph pool or patched twin in the process, against which
    the rounds among them can be read (GPT-2 b8's h2h host ran 1.3-2.0x its optimize stage's in
    all five committed runs; nothing here says yet whether the other variants cause it), with
    the device allocations those calls made (`device_allocs`, as the rounds record them)."""
    if rounds < 1:
        return None
    for _ in range(warm):
        call()
        sync(device)
    walls, hosts, allocs = zip(*(timed_counting(call, device) for _ in range(rounds)),
                               strict=True)
    return {"rounds": rounds, "median_ms": statistics.median(walls),
            "median_host_ms": statistics.median(hosts),
            "device_allocs": None if None in allocs else sum(allocs)}


def by_host_speed(times: dict, host: dict) -> dict:
    """The rounds split by eager's host time, at FAST_HOST times its fastest round: where ours
    and compile stand when the host ran at its best and when it did not. On the lent H200 the
    host's speed moves within one run, and a host-bound variant moves with it
    (Qwen2.5-0.5B b8: ours 1.18x of compile in the 4 fast rounds, 0.83x in the other 26), so
    the overall median hides which regime decided it. A split at the median would not have
    shown that: a fast stretch can be a few rounds."""
    cut = FAST_HOST * min(host["eager"])
    out = {}
    for label, fast in (("fast_host", True), ("slow_host", False)):
        idx = [i for i, h in enumerate(host["eager"]) if (h <= cut) == fast]
        if not idx:
            continue
        out[label] = {
            "rounds": len(idx),
            "eager_host_ms": statistics.median(host["eager"][i] for i in idx),
            "median_ms": {k: statistics.median(v[i] for i in idx) for k, v in times.items()},
        }
        if "compile" in times and "ours" in times:
            out[label]["ours_over_compile"] = statistics.median(
                times["compile"][i] / times["ours"][i] for i in idx)
    return out


def ratio(times: dict, a: str, b: str) -> dict:
    """Speedup of b over a, per round, with its bootstrap CI."""
    est, lo, hi = bootstrap_ci([x / y for x, y in zip(times[a], times[b], strict=True)])
    return {"speedup": est, "ci": [lo, hi]}


def ratios(times: dict) -> dict:
    """Old keys (ours_over_eager, compile_over_eager, ours_over_compile) where their variants
    ran, `over_eager` for every variant, and the PAIRS present."""
    out = {"over_eager": {v: ratio(times, "eager", v) for v in times if v != "eager"}}
    for v in ("ours", "compile"):
        if v in times:
            out[f"{v}_over_eager"] = out["over_eager"][v]
    out["pairs"] = {f"{b}_over_{a}": ratio(times, a, b) for b, a in PAIRS
                    if a in times and b in times}
    if "ours_over_compile" in out["pairs"]:
        out["ours_over_compile"] = out["pairs"]["ours_over_compile"]
    return out


def share_recompile_limit(variants: list[str]) -> int | None:
    """Dynamo's recompile limit raised to RECOMPILE_LIMIT per compiled variant (module doc);
    the limit set, or None with fewer than two."""
    n = sum(v in COMPILED for v in variants)
    if n < 2:
        return None
    torch._dynamo.config.recompile_limit = RECOMPILE_LIMIT * n
    return RECOMPILE_LIMIT * n


def dynamo_counts() -> tuple[int, int]:
    """(graphs dynamo compiled, graph breaks it took) in this process so far."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def counted(call, tally: dict):
    """`call`, adding the graphs and graph breaks dynamo took during it to `tally`."""
    graphs, breaks = dynamo_counts()
    out = call()
    after = dynamo_counts()
    tally["graphs"] += after[0] - graphs
    tally["graph_breaks"] += after[1] - breaks
    return out


def no_grad(call):
    def run():
        with torch.no_grad():
            call()
    return run


def mark_step(call):
    """reduce-overhead's cudagraph trees want each call marked as a new step when outputs of
    the last are dropped (transformers' generate marks them likewise)."""
    mark = getattr(torch.compiler, "cudagraph_mark_step_begin", None)

    def run():
        if mark is not None:
            mark()
        call()
    return run


BEST_EXPERTS_CALLS = 5  # timed calls per experts option when choosing hf-best-experts


def best_experts(model, workload: Workload, calls: int = BEST_EXPERTS_CALLS):
    """(a twin under the fastest experts implementation that runs here, {"option", "median_ms"
    per option, "failed": option -> why}). Raises ValueError for a model without experts."""
    from models.moe import experts_options, is_moe, set_experts

    if not is_moe(model):
        raise ValueError("not a mixture-of-experts model")
    medians, failed, best = {}, {}, None
    for option in experts_options():
        try:
            variant = twin(model)
            set_experts(variant, option)
            runner = make_runner(variant, workload)

            def run(r=runner):
                with torch.no_grad():
                    r.call()
                r.reset()
            run()  # warm-up
            medians[option] = statistics.median(timed(run, workload.device)[0]
                                                for _ in range(calls))
        except Exception as exc:  # an option this machine cannot run is named, not fatal
            # (batched_mm gathers every pair's expert weights: out of memory at a long prefill)
            failed[option] = capture_reason(exc)
            if workload.device.startswith("cuda"):
                torch.cuda.empty_cache()
            continue
        if best is None or medians[option] < medians[best[0]]:
            best = (option, variant)
    if best is None:
        raise ValueError(f"no experts implementation ran: {failed}")
    return best[1], {"option": best[0], "median_ms": medians, "failed": failed,
                     "calls_per_option": calls}


def pdl_context(name: str, run_dir: Path, key: str):
    """The capture context of graph variant `name`: PDL as the graphs stage decided for
    ours-graphs, on for ours-graphs-pdl and, with the L2 prefetch, for
    ours-graphs-pdl-prefetch (ValueError where PDL cannot be), off otherwise."""
    from codegen import pdl

    if name in ("ours-graphs-pdl", "ours-graphs-pdl-prefetch"):
        why = pdl.unavailable()
        if why is not None:
            raise ValueError(f"PDL cannot run here: {why}")
        return pdl.enabled if name == "ours-graphs-pdl" else partial(pdl.enabled,
                                                                     prefetch=True)
    if name != "ours-graphs":
        return None
    from core.artifacts import load
    from core.integration_records import Integration
    from pipeline.api import capture_context

    rec = load(run_dir / "integration.json", Integration, "integration").workloads.get(key)
    return capture_context(rec.graphs if rec is not None else None)


def build_variants(model, workload: Workload, variants: list[str], run_dir: Path,
                   max_len: int, package: Path | None = None
                   ) -> tuple[dict, dict, dict, dict, list]:
    """({variant: timed call}, {variant: untimed setup before each call}, {variant: pool
    bytes}, {variant: why skipped}, handles to undo or close). A variant that cannot be built
    (a capture that fails) is skipped with its reason."""
    calls, setups, pools, skipped, owned = {}, {}, {}, {}, []
    runner = make_runner(model, workload)
    decode = workload.mode == "decode"
    gen = torch.Generator(device="cpu").manual_seed(0)
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (workload.batch, workload.seq), generator=gen)
    prompt = prompt.to(workload.device)
    ids = runner.input_ids

    def runner_call(r):
        def run():
            with torch.no_grad():
                r.call()
            r.reset()
        return run

    made = {}

    def ours_twin():  # built on first use, inside the variant's try: a run without kept
        if "ours" not in made:  # kernels skips ours and ours-graphs, not the others
            patched = twin(model)
            handle = apply_kernels(patched, run_dir, workload=workload.key)
            handle.role = "ours"
            owned.append(handle)
            made["ours"] = patched  # only once patched: a failed apply_kernels fails again
        return made["ours"]

    def graph_twin():  # the set the graphs stage put in the graph (may differ from ours)
        if "graph_set" not in made:
            patched = twin(model)
            handle = apply_kernels(patched, run_dir, workload=workload.key, graph_set=True)
            handle.role = "graph_set"
            owned.append(handle)
            made["graph_set"] = patched
        return made["graph_set"]

    def plain_twin():
        return made.setdefault("plain", twin(model))

    def static_step(name, decoder):
        """The step at position `seq`, every call: the rewind is its untimed setup."""
        owned.append(decoder)
        decoder.prefill(prompt)
        setups[name] = lambda: decoder.rewind(workload.seq)

        def run():
            with torch.no_grad():
                decoder.step(ids)
        return run

    # the patched twins first: gated_act's first patch moves the shared gate/up weights into
    # one buffer, and a graph of another twin captured before that would read their old storage
    for name in sorted(variants, key=lambda n: n not in ("ours", "ours-compile",
                                                         *OURS_GRAPHS)):
        try:
            if name == "eager":
                calls[name] = runner_call(runner)
            elif name == "ours":
                calls[name] = runner_call(make_runner(ours_twin(), workload))
            elif name == "compile":
                calls[name] = runner_call(make_runner(torch.compile(twin(model)), workload))
            elif name == "ours-compile":
                patched = twin(model)
                handle = apply_kernels(patched, run_dir, workload=workload.key, compiled=True)
                handle.role = "ours-compile"
                owned.append(handle)
                calls[name] = runner_call(make_runner(torch.compile(patched), workload))
            elif name == "ours-kernels":
                if package is None:
                    raise ValueError("needs --export PKG, the run's `pipeline export` package")
                from pipeline.export import kernelize_package

                calls[name] = runner_call(make_runner(kernelize_package(twin(model), package),
                                                      workload))
            elif name == "compile-reduce-overhead":
                base = twin(model)
                compiled = torch.compile(base, mode="reduce-overhead")
                if decode:
                    dec = StaticDecoder(base, workload.batch, max_len, graph=False,
                                        step_model=compiled)
                    calls[name] = mark_step(static_step(name, dec))
                else:
                    calls[name] = mark_step(no_grad(lambda m=compiled: m(ids, use_cache=False)))
            elif name == "graph" or name in OURS_GRAPHS:
                target = plain_twin() if name == "graph" else graph_twin()
                context = pdl_context(name, run_dir, workload.key)
                if decode:
                    dec = StaticDecoder(target, workload.batch, max_len, graph=True,
                                        capture_context=context)
                    calls[name] = static_step(name, dec)
                    setups[name]()
                    calls[name]()  # captures the step now, so its pool is known
                    pools[name] = dec.pool_bytes
                else:
                    graphed = GraphedPrefill(target, ids, capture_context=context)
                    owned.append(graphed)
                    calls[name] = lambda g=graphed: g(ids)
                    pools[name] = graphed.pool_bytes
            elif name == "hf-best-experts":
                best, chosen = best_experts(model, workload)
                calls[name] = runner_call(make_runner(best, workload))
                calls[name].experts = chosen
            elif name == "eager-static":
                calls[name] = static_step(
                    name, StaticDecoder(plain_twin(), workload.batch, max_len, graph=False))
        except CaptureError as exc:
            skipped[name] = exc.reason
            calls.pop(name, None)
            setups.pop(name, None)
        except Exception as exc:  # a contender that cannot run here is reported, not fatal
            skipped[name] = capture_reason(exc)
            calls.pop(name, None)
            setups.pop(name, None)
    return calls, setups, pools, skipped, owned


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--workload", help="workload key [default: the run's first]")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--variants", help=f"comma-separated, from {', '.join(ALL_VARIANTS)} "
                                       f"[default: {','.join(VARIANTS)}]")
    ap.add_argument("--max-len", type=int, help="static cache slots for decode "
                                                "[default: seq + 1 rounded up to 16]")
    ap.add_argument("--alone-rounds", type=int, default=5,
                    help="eager passes timed before the other variants are built, to tell "
                         "their presence from the host's own drift [default: 5; 0: none]")
    ap.add_argument("--export", type=Path, default=None,
                    help="the run's `pipeline export` package, for ours-kernels")
    ap.add_argument("--no-kernel-count", action="store_true",
                    help="skip counting kernels per pass (one profiled call per variant)")
    args = ap.parse_args()
    profile = read_json(args.run_dir / "profile.json", "profile")
    entry = next(w for w in profile["workloads"]
                 if args.workload in (None, w["key"]))
    workload = Workload.from_dict(entry["workload"])
    variants, skipped = parse_variants(args.variants, workload.mode)
    max_len = args.max_len or static_len(workload.seq)
    recompile_limit = share_recompile_limit(variants)
    model = build(resolve(profile["model"]["id"]), workload.torch_dtype(), workload.device)
    eager_alone = alone(make_runner(model, workload).once, workload.device,
                        args.alone_rounds)
    calls, setups, pools, failed, owned = build_variants(model, workload, variants, args.run_dir,
                                                         max_len, args.export)
    skipped.update(failed)
    if "eager" not in calls:
        raise SystemExit(f"eager did not run: {skipped.get('eager')}")
    names = [v for v in variants if v in calls]
    dynamo = {n: {"graphs": 0, "graph_breaks": 0} for n in names if n in COMPILED}
    first_call_s = {}
    t = time.perf_counter()
    for _ in range(3):  # compiles, captures, autotunes, warms the caching allocator
        for name in names:
            if name in setups:
                setups[name]()
            t1 = time.perf_counter()
            counted(calls[name], dynamo.get(name, {"graphs": 0, "graph_breaks": 0}))
            sync(workload.device)
            first_call_s.setdefault(name, time.perf_counter() - t1)
    warm_s = time.perf_counter() - t
    times = {name: [] for name in names}
    host = {name: [] for name in names}
    allocs = {name: [] for name in names}

    def timed_rounds():
        for i in range(args.rounds):
            for name in rotation(names, i):
                wall, returned, made = timed_counting(calls[name], workload.device,
                                                      setups.get(name))
                times[name].append(wall)
                host[name].append(returned)
                allocs[name].append(made)

    in_rounds = {"graphs": 0, "graph_breaks": 0}
    counted(timed_rounds, in_rounds)
    # after the timing: a profiler session leaves CUPTI attached and later launches slower
    kernels, top = {}, {}
    if workload.device.startswith("cuda") and not args.no_kernel_count:
        for name in names:
            try:
                kernels[name], top[name] = kernels_per_pass(calls[name], setups.get(name))
            except Exception as exc:  # optional: a count the profiler cannot give is noted
                kernels[name] = None
                skipped.setdefault(f"kernels:{name}", capture_reason(exc))
    kept = next((h.families for h in owned if getattr(h, "role", None) == "ours"), [])
    in_graph = next((h.families for h in owned if getattr(h, "role", None) == "graph_set"),
                    None)
    compiled = next(({"families": h.families, "left_out": h.left_out, "notes": h.notes}
                     for h in owned if getattr(h, "role", None) == "ours-compile"), None)
    for h in reversed(owned):
        (h.undo if hasattr(h, "undo") else h.close)()

    result = {
        "run_dir": str(args.run_dir), "workload": workload.key, "kept": kept,
        "graph_families": in_graph, "compiled_families": compiled,
        "hf_best_experts": getattr(calls.get("hf-best-experts"), "experts", None),
        "torch": torch.__version__, "device": torch.cuda.get_device_name(0)
        if workload.device.startswith("cuda") else "cpu",
        "rounds": args.rounds, "warmup_s": warm_s, "variants": names, "skipped": skipped,
        "note": None if workload.device.startswith("cuda") else
        "CPU: our kernels ran in the Triton interpreter; not a GPU timing",
        "median_ms": {k: statistics.median(v) for k, v in times.items()},
        # at about the wall time, that variant's GPU waits on the host
        "median_host_ms": {k: statistics.median(v) for k, v in host.items()},
        "eager_alone": eager_alone,
        # over all the timed rounds; a variant whose passes keep allocating waits on the driver
        "device_allocs": {k: None if None in v else sum(v) for k, v in allocs.items()},
        **ratios(times),
        "by_host_speed": by_host_speed(times, host),
        "first_call_s": first_call_s,
        # per compiled variant over its warm-up calls; in_rounds: all variants while timed
        # (nonzero: a variant recompiled then)
        "dynamo": {**dynamo, "in_rounds": in_rounds}, "recompile_limit": recompile_limit,
        "pool_bytes": pools,
        # ours-graphs captured with PDL (the graphs stage's decision, codegen/pdl.py)
        "ours_graphs_pdl": pdl_context("ours-graphs", args.run_dir, workload.key) is not None
        if "ours-graphs" in names else None,
        "kernels_per_pass": kernels,
        "top_kernels": top,  # per variant: [name, calls, ms] over the profiled call
        "kernels_note": "torch.profiler over one synchronised call after the timing; null "
                        "where it saw no kernel (graph replays on some CUPTI versions)",
        "static_cache_len": max_len if workload.mode == "decode" else None,
        "method": "one process, rounds of every variant in rotating order, each call "
                  "synchronised; per-round ratios, median and percentile bootstrap 95 % CI",
        "times_ms": times, "host_ms": host,
    }
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k not in ("times_ms", "host_ms")},
                     indent=1))


if __name__ == "__main__":
    try:
        main()
    except UserError as e:
        raise SystemExit(f"error: {e}") from None

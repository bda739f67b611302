"""The profile stage: model id + workloads -> profile.json and one trace per workload.

Shares use the unprofiled wall time as the denominator (DESIGN.md, "Amdahl, honestly"). On a
GPU an op's time is the device time attributed to it; on the CPU it is the host time of the
top-level aten op. Where the profiled op times add up to more than the wall time (the profiler's
own overhead inflates host times), they are scaled down to the wall time and the factor is
recorded, so shares plus the "rest" row always sum to exactly 1.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from core.artifacts import write_json
from core.env import environment, steady_cpu_timing
from core.errors import UserError
from core.records import Ceilings, OpRow, Profile, ProfiledOp, ProfiledWorkload, Wall
from core.workload import Workload
from pipeline.projection.replay import LAUNCH_BOUND_BUSY
from profiling import density
from profiling.attribution import attribute
from profiling.capture import (
    ACTIVE,
    WAIT,
    WALL_REPS,
    WALL_WARMUP,
    WARMUP,
    capture,
    make_runner,
    make_static_runner,
    module_names,
    wall_time,
)
from profiling.hta_report import hta_summary
from profiling.loader import ModelSpec, build, parameter_count
from profiling.roofline import ceilings
from profiling.trace import load_trace

PROFILE = "profile.json"


def check_device(device: str) -> None:
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {device} asked for, but no CUDA GPU is visible to torch "
                        f"({torch.__version__}); use --device cpu")
    if device not in ("cpu",) and not device.startswith("cuda"):
        raise UserError(f"unknown device {device!r}; use cpu or cuda")


# A model this large on the CPU is named with its size before it is built: a full-size config
# (what a hub id falls back to offline) profiles there for minutes.
LARGE_ON_CPU = 100_000_000
# passes of one workload's profile: wall_time's warm-up and repetitions, the module naming
# pass, and the profiler's schedule
PASSES = WALL_WARMUP + WALL_REPS + 1 + WAIT + WARMUP + ACTIVE


def cpu_size_note(spec: ModelSpec, workloads: list[Workload]) -> str | None:
    """A warning for a model of LARGE_ON_CPU parameters or more profiled on the CPU: its
    size, memory, and the time its passes take at the CPU's measured matmul rate (2 flops per
    parameter and token); None for a smaller model or a GPU run."""
    on_cpu = [w for w in workloads if w.device == "cpu"]
    if not on_cpu:
        return None
    n = parameter_count(spec)
    if n < LARGE_ON_CPU:
        return None
    itemsize = torch.empty((), dtype=on_cpu[0].torch_dtype()).element_size()
    rate = Ceilings.of(ceilings("cpu")).matmul_TFLOPs * 1e12
    tokens = sum(w.batch * (w.seq if w.mode == "prefill" else 1) for w in on_cpu)
    seconds = PASSES * 2 * n * tokens / rate
    return (f"{spec.name} has {n / 1e9:.2f} B parameters: {n * itemsize / 2**30:.1f} GiB in "
            f"{on_cpu[0].dtype} on the CPU, and its {PASSES * len(on_cpu)} profiled passes take "
            f"about {seconds:.0f} s at this CPU's matmul rate ({rate / 1e12:.2f} TFLOP/s), "
            f"after building it; the built-in tiny- configs (tiny-llama, ...) take seconds")


@dataclass
class Timed:
    """What a workload's profile timed without the profiler (`time_workload`)."""

    wall: Wall
    static_wall: Wall | None = None  # decode on a GPU: the step over a static KV cache
    probe_wall_ms: float | None = None  # the host-bound probe's (`host_factor`)


def time_workload(model, workload: Workload, say: Callable[[str], None]) -> Timed:
    """Everything a workload's profile times without the profiler: the wall time, and on a GPU
    the host-bound probe's. Done for every workload before any profiler session, since Kineto
    leaves CUPTI attached after one (pytorch/pytorch#144455) and later launches of the process
    may pay for it, though the host drifts about as much on its own (benchmarks/probes/
    README.md, `cupti_probe.py`). With workloads of several dtypes each model is
    built twice, once per phase."""
    runner = make_runner(model, workload)
    say("timing without the profiler")
    timed = Timed(wall=Wall.of(wall_time(runner, workload.device)))
    if workload.device.startswith("cuda") and workload.mode == "decode":
        say("timing the step over a static KV cache without the profiler")
        timed.static_wall = Wall.of(wall_time(make_static_runner(model, workload),
                                              workload.device))
    if workload.device.startswith("cuda"):
        probe = _probe(workload)
        timed.probe_wall_ms = Wall.of(wall_time(make_runner(model, probe), probe.device,
                                                warmup=3, reps=10)).median_ms
    return timed


def profile_workload(model, workload: Workload, run_dir: Path, say: Callable[[str], None],
                     timed: Timed) -> ProfiledWorkload:
    """`timed`: what `time_workload` measured for this workload, before any profiler ran."""
    runner = make_runner(model, workload)
    names = module_names(model, runner)
    say("profiling")
    trace_rel = f"trace/{workload.key}.json.gz"
    profiled_ms = capture(runner, workload.device, run_dir / trace_rel)
    result = summarise(run_dir / trace_rel, workload, timed.wall, names, profiled_ms)
    result.trace = trace_rel
    if workload.device.startswith("cuda") and workload.mode == "decode":
        say("profiling the step over a static KV cache (what a CUDA graph replays)")
        static_rel = f"trace/{workload.key}-static.json.gz"
        static = make_static_runner(model, workload)
        static_names = module_names(model, static)
        static_ms = capture(static, workload.device, run_dir / static_rel)
        result.static_trace = static_rel
        # its ops, attributed to patterns like the dynamic step's: the graph projection credits
        # each kernel's saving where the graph runs it (projection.replay.graph_projection)
        result.static = summarise(run_dir / static_rel, workload, timed.static_wall,
                                  static_names, static_ms)
    if workload.device.startswith("cuda"):
        say("HTA analyses")
        result.hta = hta_summary(run_dir / trace_rel)
        say("profiler overhead probe")
        result.host_factor = host_factor(model, workload, timed.probe_wall_ms)
        if (result.gpu_busy_share or 0.0) >= LAUNCH_BOUND_BUSY:
            # a launch-bound pass idles the GPU between kernels: no cap to reach
            _density(result, workload, say)
    return result


def _density(result: ProfiledWorkload, workload: Workload, say: Callable[[str], None]) -> None:
    """The pass's density curve and its floor (`profiling.density`), or why not."""
    say("density curve: the pass's GEMMs against a shrinking rest (the power cap)")
    try:
        result.density = density.measure(result.ops,
                                         Ceilings.of(ceilings(workload.device)).bandwidth_GBps)
        say("floor: the pass's GEMMs and attention alone, in one CUDA graph")
        result.floor = density.floor(result.ops)
    except (RuntimeError, ValueError) as e:  # a calibration: the profile stands without
        result.density_error = str(e).splitlines()[0][:200]
        say(f"density curve not measured: {result.density_error}")


def summarise(trace_path: Path, workload: Workload, wall: Wall | dict,
              names: dict[str, str] | None = None,
              profiled_ms: float | None = None) -> ProfiledWorkload:
    """One workload's profile entry from its trace and its unprofiled wall time."""
    att = attribute(load_trace(trace_path), names)
    on_gpu = workload.device.startswith("cuda")
    wall = Wall.of(wall)
    wall_us = wall.median_ms * 1e3
    op_time = [(op.device_us if on_gpu else op.cpu_us) for op in att.ops]
    work_us = sum(op_time)
    scale = min(1.0, wall_us / work_us) if work_us > 0 else 1.0
    ops = [ProfiledOp(**{**op.to_dict(), "time_us": t * scale, "share": t * scale / wall_us})
           for op, t in zip(att.ops, op_time)]
    profiled_ms = profiled_ms if profiled_ms is not None else att.span_us / 1e3
    return ProfiledWorkload(
        workload=workload.to_dict(),
        key=workload.key,
        time_basis="device" if on_gpu else "cpu",
        wall=wall,
        profiled_ms_per_step=profiled_ms,
        profiler_overhead=profiled_ms / wall.median_ms - 1.0,
        trace=None,
        step=att.step,
        step_index=att.index,
        step_host_us=att.span_us,
        device_busy_us=att.device_busy_us,
        device_span_us=att.device_span_us,
        gpu_busy_share=min(1.0, att.device_busy_us / wall_us) if on_gpu else None,
        gpu_idle_share=max(0.0, 1 - att.device_busy_us / wall_us) if on_gpu else None,
        kernel_count=att.kernel_count,
        kernel_total_us=att.kernel_total_us,
        attributed_us=sum(op.device_us for op in att.ops),
        unattributed_us=att.unattributed_us,
        time_scale=scale,
        rest_share=1.0 - sum(o.share for o in ops),
        ops=ops,
        modules=att.modules,
        by_op=_by_op(ops),
    )


def _probe(workload: Workload) -> Workload:
    return Workload(1, min(8, workload.seq), workload.dtype, workload.device, workload.mode)


def host_factor(model, workload: Workload, wall_ms: float) -> float:
    """How much faster the host runs without the profiler: `wall_ms` (timed by
    `time_workload`) over the profiled step of a tiny, host-bound pass of the same model
    (batch 1, 8 tokens), where the GPU never holds the host back. The profiler's cost is per
    op and per Python call, the same at any batch size, so the factor carries over to the
    real workload; the replay scales host time by it. The wall was timed before any session
    and the capture comes later, so host drift in between goes into the factor too."""
    import tempfile

    probe = _probe(workload)
    with tempfile.TemporaryDirectory() as tmp:
        profiled = capture(make_runner(model, probe), probe.device, Path(tmp) / "probe.json.gz")
    return min(1.0, wall_ms / profiled)


def _expert_load(model, workload: Workload, spec: ModelSpec) -> dict | None:
    """Tokens per expert in one more (unprofiled) pass of an MoE model; None for a dense one."""
    from profiling import expert_load

    runner = make_runner(model, workload)

    def call():
        runner.call()
        runner.reset()
    return expert_load.measure(model, call, random_router=spec.weights != "pretrained")


def _by_op(ops: list[ProfiledOp]) -> list[OpRow]:
    agg: dict[str, OpRow] = {}
    for o in ops:
        row = agg.setdefault(o.name, OpRow(op=o.name, calls=0, time_us=0.0, cpu_us=0.0,
                                           share=0.0))
        row.calls += 1
        row.time_us += o.time_us
        row.cpu_us += o.cpu_us
        row.share += o.share
    return sorted(agg.values(), key=lambda r: -r.time_us)


def run_profile(spec: ModelSpec, workloads: list[Workload], run_dir: Path,
                say: Callable[[str], None] = lambda s: None,
                generations: list[tuple[int, int, int]] | None = None) -> Profile:
    """Profile every workload (each its own model build only when dtype/device change).
    `generations`: the (batch, prompt, new tokens) the workloads were chosen for
    (`--generation`), kept for `pipeline e2e`'s default grid."""
    for w in workloads:
        check_device(w.device)
    if any(w.device == "cpu" for w in workloads):
        steady_cpu_timing()
    built: dict[tuple, torch.nn.Module] = {}

    def model_for(w: Workload):
        key = (w.dtype, w.device)
        if key not in built:
            built.clear()
            say(f"building {spec.model_id} ({spec.weights} weights, {w.dtype}, {w.device})")
            built[key] = build(spec, w.torch_dtype(), w.device)
        return built[key]

    timed, results = {}, []
    try:
        for w in workloads:  # every unprofiled timing first (see time_workload)
            say(f"[{w.key}]")
            timed[w.key] = time_workload(model_for(w), w, say)
        for w in workloads:
            say(f"[{w.key}]")
            results.append(profile_workload(model_for(w), w, run_dir, say, timed[w.key]))
            load = _expert_load(model_for(w), w, spec)
            if load is not None:
                results[-1].expert_load = load
    except torch.OutOfMemoryError:
        raise UserError(f"out of memory building or profiling {spec.model_id} at {w.key}; "
                        f"try a smaller --batch or --seq, or a GPU with more memory") from None
    skipped = {w.hta.reason for w in results if w.hta is not None and not w.hta.available}
    for reason in skipped:  # once, not per workload
        say(f"HTA analyses skipped: {reason}")
    profile = Profile(
        stage="profile", model=spec.describe(), environment=environment(workloads[0].device),
        ceilings=ceilings(workloads[0].device), workloads=results,
        **({"generations": [list(g) for g in generations]} if generations else {}))
    write_json(run_dir / PROFILE, profile)
    return profile

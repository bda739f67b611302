"""integration.json's records: per workload, the whole-model check, the paired timings and the
decisions (`pipeline.stages.integrate`), the re-profile, the projections of the set that
shipped, and the graphs stage's record (`pipeline.stages.graphs`)."""

from __future__ import annotations

from core.record import Needed, Record
from core.run_records import Environment, GraphsProjection, ProjectedSet, WorkloadLabel


class BoundSide(Record):
    host_ms: Needed[float]
    wall_ms: Needed[float]
    host_bound: Needed[bool]


class Bound(Record):
    """What bounds each side of a paired timing (`pipeline.integrate.pass_bound`)."""
    unpatched: Needed[BoundSide]
    patched: BoundSide | None = None


class Ratio(Record):
    """A paired whole-model timing b / a (`verify.timing.paired_ratio`), with the decision
    taken on it where one was."""
    estimate: float | None = None
    ci_low: float | None = None
    ci_high: float | None = None
    verdict: str | None = None
    meaningful: bool | None = None
    reason: str | None = None
    decision: str | None = None
    ratios: list[float] = []
    times_a_ms: list[float] | None = None
    times_b_ms: list[float] | None = None
    host_a_ms: list[float] | None = None
    host_b_ms: list[float] | None = None
    pairs: int | None = None
    bound: Bound | None = None
    # a family's own record: the set with it against the set without it, the set with it
    # against the baseline where that regressed, and the family it ships in place of
    in_set: Ratio | None = None
    combined_with_it: Ratio | None = None
    fallback_for: str | None = None


class Trial(Record):
    """One trial of the whole-model check: the logits' errors against the fp32 reference."""
    error_unpatched: Needed[float]
    error_patched: Needed[float]
    limit: Needed[float]
    passed: Needed[bool]
    seed: int | None = None
    shares_prefix: dict | None = None
    # on a decode workload: which cache path, which step, at which position
    path: str | None = None
    step: int | None = None
    position: int | None = None
    workload: str | None = None


class CheckRun(Record):
    """One whole-model check of a set of families (`integrate.whole_model_check`)."""
    families: list[str] | None = None
    trials: list[Trial] = []
    passed: bool | None = None
    reference: str | None = None  # what the fp32 reference was (pipeline.fp32_reference)
    failure: str | None = None
    paths_skipped: dict[str, str] | None = None
    workloads: list[str] | None = None


class Check(Record):
    """The check of the set, bisected on failure (`integrate.check_and_bisect`)."""
    set: CheckRun | None = None
    rejected: dict[str, CheckRun] = {}
    kept: list[str] = []
    reasons: dict[str, str | None] = {}
    kept_set: CheckRun | None = None


class PatchEffect(Record):
    """The patch-took-effect proof (`integrate.patch_took_effect`)."""
    kernel_calls: dict[str, int] = {}
    aten_ops_before_after: dict[str, dict[str, list[int]]] = {}
    new_kernels: list[str] = []
    passed: bool = False


class Reprofile(Record):
    """GPU time per kernel of one unpatched and one patched pass (`integrate.reprofile`)."""
    families: list[str] = []
    unpatched_us: dict[str, float] = {}
    patched_us: dict[str, float] = {}
    family_kernels: dict[str, list[str]] = {}
    error: str | None = None


class TimingHost(Record):
    """The shipped set's replay at the timing's host speed (`timing_host_projection`)."""
    families: Needed[list[str]]
    host_drift: Needed[float]
    profile_host_ms: Needed[float]
    timing_host_ms: Needed[float]
    replay: float | None = None


class GraphTrial(Record):
    passed: Needed[bool]


class GraphVerification(Record):
    trials: list[GraphTrial] = []
    tolerance: float | None = None
    passed: bool = False


class GraphSet(Record):
    """One of the two sets the graphs stage chooses between (`_Sides.choose_set`)."""
    families: list[str] = []
    captured: bool | None = None
    reason: str | None = None
    graphed_ms: float | None = None
    kernels_per_pass: int | None = None
    verification: GraphVerification | None = None


class GraphSets(Record):
    kept: Needed[GraphSet]
    integrable: Needed[GraphSet]
    chosen: Needed[str]
    why: Needed[str]


class Medians(Record):
    eager_ms: float | None = None
    graphed_ms: float | None = None
    eager_kept_ms: float | None = None
    graphed_kept_ms: float | None = None
    eager_static_ms: float | None = None


class KernelsPerPass(Record):
    unpatched: int | None = None
    kept: int | None = None
    graphed_unpatched: int | None = None
    graphed: int | None = None


class StepKernel(Record):
    kernel: Needed[str]
    calls: Needed[int]
    ms: Needed[float]
    share: Needed[float]


class DecodeStep(Record):
    """A graphed decode step's anatomy (`pipeline.decode_step`)."""
    kernels_per_step: Needed[int]
    kernels_per_layer: Needed[float | None]
    step_ms: Needed[float]
    busy_ms: Needed[float]
    floor_ms: Needed[float | None]
    floor_multiple: Needed[float | None]
    kernels: Needed[list[StepKernel]]
    levers_ms: Needed[dict[str, float]]
    verdict: Needed[str]


class GraphPDL(Record):
    """Programmatic dependent launch in the graph (codegen/pdl.py): the step captured with
    PDL and verified, timed paired against the same set's graph without it; `on` only where
    the paired 95 % CI says the PDL graph is faster (`stages.graphs.choose_pdl`)."""
    on: bool = False
    why: Needed[str]
    tried: bool = False  # False: PDL unavailable or turned off here (`why` says which)
    # where tried: whether the PDL graph's weight streamers prefetched their slabs into L2
    # before the wait (off where PIPELINE_NO_PDL_PREFETCH is set; codegen/pdl.py)
    prefetch: bool | None = None
    captured: bool | None = None
    reason: str | None = None  # why the PDL capture failed, where it did
    off_ms: float | None = None  # medians of the paired timing: the graph without PDL
    on_ms: float | None = None  # and with it
    on_vs_off: Ratio | None = None
    verification: GraphVerification | None = None  # the PDL graph's, where it failed


class Graphs(Record):
    """The graphs stage's record of one workload (`stages.graphs.graph_workload`)."""
    skipped: str | None = None
    captured: bool | None = None
    reason: str | None = None
    error: str | None = None
    decision: str | None = None
    shipped: bool = False
    kept: list[str] = []
    families: list[str] | None = None
    projected: GraphsProjection | None = None
    projected_for_kept: GraphsProjection | None = None
    verification: GraphVerification | None = None
    sets: GraphSets | None = None
    medians: Medians | None = None
    graphed_vs_eager: Ratio | None = None
    graphed_vs_eager_kept: Ratio | None = None
    graphed_unpatched_vs_eager: Ratio | None = None
    eager_static_vs_eager: Ratio | None = None
    measured_speedup: float | None = None
    pool_bytes: dict[str, int | None] = {}
    kernels_per_pass: KernelsPerPass | None = None
    pdl: GraphPDL | None = None  # on a GPU; absent in runs from before PDL
    # on a GPU, for a decode workload; absent in runs from before it
    decode_step: DecodeStep | None = None
    decode_step_error: str | None = None  # why the anatomy failed, where it did


class Compiled(Record):
    """What a compiled user of the shipped set is offered (`pipeline.patching.for_compile`)."""
    families: list[str] = []
    left_out: dict[str, str] = {}  # family -> why torch.compile is not offered it


class IntegratedWorkload(Record):
    kept: Needed[list[str]]
    cases: dict[str, list[str]] = {}
    workload: WorkloadLabel | None = None
    check: Check | None = None
    fallback_checks: dict[str, Check] = {}
    patch_effect: PatchEffect | None = None
    patch_memory: dict[str, int] = {}
    compiled: Compiled | None = None  # absent in runs from before compiled users were offered
    # set aside before integration, never patched in: family -> why
    skipped: dict[str, str] = {}
    per_family: dict[str, Ratio] = {}
    combined: Ratio | None = None
    unreached: dict[str, str] = {}
    declined: dict[str, list[str]] = {}
    reprofile: Reprofile | None = None
    projection_for_kept: ProjectedSet | None = None
    projection_at_timing_host: TimingHost | None = None
    # the graphs stage's record; absent in runs from before it
    graphs: Graphs | None = None


class Integration(Record):
    families: list[str] = []
    chosen: list[str] | None = None
    environment: Environment | None = None
    workloads: Needed[dict[str, IntegratedWorkload]]


Ratio.model_rebuild()

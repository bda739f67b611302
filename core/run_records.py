"""The records of a run's artifacts up to the frozen projection: profile.json, ranking.json,
the search log, the verification summary and records, projection.json and options.json
(`core.records` is where readers import them from).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from core.record import Needed, Record

# profile.json ------------------------------------------------------------------------------


class WorkloadSpec(Record):
    batch: Needed[int]
    seq: Needed[int]
    dtype: Needed[str]
    device: Needed[str]
    mode: Needed[Literal["prefill", "decode"]]


class WorkloadLabel(Record):
    """A workload as a later artifact names it beside its own numbers (ranking.json,
    integration.json): what of it was written."""
    batch: int | None = None
    seq: int | None = None
    dtype: str | None = None
    device: str | None = None
    mode: str | None = None


class ModelInfo(Record):
    id: Needed[str]
    name: str | None = None
    source: str | None = None
    weights: str | None = None
    model_type: str | None = None
    revision: str | None = None
    num_layers: int | None = None
    hidden_size: int | None = None
    notes: Any = None


class Environment(Record):
    gpu: str | None = None
    driver: str | None = None
    cuda: str | None = None
    torch: str | None = None
    triton: str | None = None
    transformers: str | None = None
    python: str | None = None
    cpu: str | None = None
    cpu_threads: int | None = None
    device: str | None = None


class Ceilings(Record):
    """The roofline ceilings measured on the device (`profiling.roofline.ceilings`)."""
    bandwidth_GBps: float | None = None
    matmul_TFLOPs: float | None = None
    matmul_dtype: str | None = None
    launch_us: float | None = None
    graph_node_us: float | None = None
    graph_launch_us: float | None = None
    graph_tiny_kernel_us: float | None = None
    device: str | None = None
    measured_at: str | None = None
    method: str | None = None


class Wall(Record):
    """A pass timed without the profiler (`profiling.capture.wall_time`)."""
    median_ms: Needed[float]
    p10_ms: float | None = None
    p90_ms: float | None = None
    enqueue_ms: float | None = None  # the call's return to the host, before the synchronise


class KernelRef(Record):
    correlation: int | None = None


class ProfiledOp(Record):
    """One top-level aten op of the profiled step (`profiling.attribution.Op`)."""
    name: Needed[str]
    time_us: Needed[float]
    share: float = 0.0
    cpu_us: float = 0.0
    device_us: float = 0.0
    launches: int = 0
    module: str | None = None
    module_class: str | None = None
    kernels: list[KernelRef] = []


class OpRow(Record):
    """The profile's ops aggregated by name (`by_op`)."""
    op: Needed[str]
    calls: Needed[int]
    time_us: Needed[float]
    share: Needed[float]
    cpu_us: float = 0.0


class ModuleRow(Record):
    module_class: str = Field(alias="class")
    calls: Needed[int]
    device_us: Needed[float]
    host_us: Needed[float]


class DensityPoint(Record):
    """A point of the pass's density curve (`profiling.density.measure`)."""
    compute_share: Needed[float]
    compute_ratio: Needed[float]


class Floor(Record):
    """The pass's GEMMs and attention alone (`profiling.density.floor`); `over_wall` once
    ranked."""
    wall_ms: float | None = None
    kernel_ms: float | None = None
    over_wall: float | None = None


class HtaSummary(Record):
    available: bool = False
    reason: str | None = None


class ProfiledStep(Record):
    """What `pattern_rows` reads of a profiled pass: a workload's, or the static-cache step
    a decode workload also profiles."""
    key: str | None = None
    ops: list[ProfiledOp] = []
    time_basis: str | None = None  # "device" on a GPU, "cpu" on the CPU
    wall: Wall | None = None
    gpu_busy_share: float | None = None
    step_index: int = -1


class ProfiledWorkload(ProfiledStep):
    workload: Needed[WorkloadSpec]
    key: Needed[str]
    wall: Needed[Wall]
    ops: Needed[list[ProfiledOp]]
    profiled_ms_per_step: float | None = None
    gpu_idle_share: float | None = None
    kernel_count: int | None = None
    unattributed_us: float | None = None
    time_scale: float | None = None
    rest_share: float | None = None
    by_op: list[OpRow] = []
    modules: dict[str, ModuleRow] = {}
    trace: str | None = None
    # decode on a GPU: the step over a static KV cache, attributed the same way
    static_trace: str | None = None
    static: ProfiledWorkload | None = None
    hta: HtaSummary | None = None
    host_factor: float | None = None
    density: list[DensityPoint] | None = None
    floor: Floor | None = None
    density_error: str | None = None
    # an MoE model's tokens per expert in one more pass (`profiling.expert_load.measure`)
    expert_load: dict | None = None


class Profile(Record):
    model: Needed[ModelInfo]
    workloads: Needed[list[ProfiledWorkload]]
    environment: Environment | None = None
    ceilings: Ceilings | None = None
    # the generations the workloads were chosen for (`pipeline profile --generation`)
    generations: list[list[int]] | None = None


# ranking.json ------------------------------------------------------------------------------


class Declined(Record):
    family: Needed[str]
    reason: Needed[str]


class RankedRow(Record):
    """A pattern's row: its ops over the pass, the roofline of a fused kernel, the gains of
    replacing it (`pipeline.pattern_rows`, `pipeline.stages.rank`). Built and filled in by the
    rank stage; `kernel_correlations` and `occurrence_cases` are the replay's, not written."""
    pattern: Needed[str]
    family: Needed[str | None]
    share: Needed[float]
    occurrences: int | None = None
    modules: list[str] = []
    time_us: float = 0.0
    host_us: float = 0.0
    launches: int = 0
    op_calls: int = 0
    min_bytes: int = 0
    flops: int = 0
    roofline_us: float = 0.0
    target_us: float | None = None
    target_source: str | None = None
    attainable_speedup: float | None = None
    achieved_GBps: float | None = None
    host_share: float | None = None
    kernel_correlations: list[list[int | None]] = []
    occurrence_cases: list[dict | None] | None = None
    alternative_to: list[str] = []
    extends: str | None = None
    overlaps: list[str] = []
    declined: Declined | None = None
    amdahl_gain: float | None = None
    replay_gain: float | None = None
    graph_gain: float | None = None
    rank_gain: float | None = None
    option_of: str | None = None
    options: list[str] | None = None  # None: ranked before rows were grouped
    # the CUDA-graph row (`rank.graph_row`): the host's remedy, not a family
    remedy: str | None = None
    why: str | None = None
    note: str | None = None
    graph_with_kernels_gain: float | None = None
    graphed_pass_us: float | None = None
    # in the replay: measured kernel numbers per row (`projection.workload`)
    host_delta_us: float | None = None
    case_speedups: list | None = None


class NoRemedy(Record):
    pattern: Needed[str]
    share: Needed[float]
    attainable_speedup: float | None = None
    why: str | None = None


class CurvePoint(Record):
    """The cumulative projection of the top `n` candidate families."""
    n: Needed[int]
    pattern: Needed[str]
    family: str | None = None
    amdahl: Needed[float]
    replay: float | None = None


class RankedWorkload(Record):
    key: Needed[str]
    rows: Needed[list[RankedRow]]
    workload: WorkloadLabel | None = None
    wall_ms: float | None = None
    enqueue_ms: float | None = None
    time_basis: str | None = None
    gpu_busy_share: float | None = None
    gpu_idle_share: float | None = None
    launch_bound: bool | None = None
    regime: str | None = None
    ranked_by: str | None = None
    ordered_by: str | None = None
    rest_share: float | None = None
    no_remedy: list[NoRemedy] | None = None  # None: ranked before it was listed
    cumulative: list[CurvePoint] = []
    ceiling_amdahl: float | None = None
    ceiling_replay: float | None = None
    floor: Floor | None = None


class Ranking(Record):
    workloads: Needed[list[RankedWorkload]]
    model: str | None = None
    ceilings: Ceilings | None = None


# the search log (candidates/search_log.json) ------------------------------------------------


class Timing(Record):
    """One side of a kernel-level timing (`verify.timing`)."""
    median_ms: float | None = None
    p20_ms: float | None = None
    p80_ms: float | None = None
    n: int | None = None
    method: str | None = None
    meaningful: bool | None = None
    reason: str | None = None
    gbps: float | None = None
    host_us: float | None = None
    graph_ms: float | None = None


class Verdict(Record):
    verdict: str | None = None
    reasons: list[str] = []


class Candidate(Record):
    """One config tried for a case (`codegen.search`)."""
    path: Needed[str]
    config: Any = None
    timing: Timing | None = None
    screen: str | None = None
    source: str | None = None  # which source proposed it ("search", "proposer ...", "llm ...")
    origin: str | None = None
    verification: Verdict | None = None
    host_us: float | None = None
    graph_ms: float | None = None
    sha1: str | None = None
    trial: int | None = None
    elapsed_s: float | None = None


class Memory(Record):
    remembered: Any = None
    ignored: Any = None


class SearchMeta(Record):
    """How a case's configs were chosen (`codegen.search`: strategy, budget, trials)."""
    asked: str | None = None
    strategy: str | None = None
    trials: int | None = None
    budget_trials: int | None = None
    memory: Memory | None = None
    rank_by: str | None = None  # "kernel" or "graph" (codegen.strategies.SearchPlan)


class Search(Record):
    family: Needed[str]
    case_key: Needed[str | None]
    case: Needed[dict | None]
    note: str | None = None
    backend: str = "triton"  # logs written before backends searched Triton
    candidates: list[Candidate] | None = None
    order: list[str] | None = None
    baseline: Timing | None = None
    search: SearchMeta | None = None
    proposals: list | None = None


class LlmBudgets(Record):
    rounds_per_case: int | None = None
    max_tokens_per_reply: int | None = None
    timeout_s_per_request: float | None = None
    wall_s: float | None = None


class LlmRecord(Record):
    """The built-in language-model proposer's budgets, tokens and events."""
    model: str | None = None
    endpoint: str | None = None
    budgets: LlmBudgets | None = None
    tokens_used: int = 0
    events: list[str] = []


class SearchLog(Record):
    searches: Needed[list[Search]]
    llm: LlmRecord | None = None


# the verification summary and records ----------------------------------------------------


class Accepted(Record):
    family: Needed[str]
    case: Needed[dict]
    source: Needed[str]
    speedup: Needed[float]
    source_sha256: str | None = None
    config: Any = None
    kernel: Timing | None = None
    baseline: Timing | None = None
    record: str | None = None
    graph_speedup: float | None = None  # both sides inside a CUDA graph, where captured
    host_delta_us: float | None = None  # host time the candidate's call saves over HF's code


class Tried(Record):
    candidate: str | None = None
    verdict: str | None = None
    reasons: list[str] = []
    record: str | None = None


class Rejected(Record):
    key: Needed[str]
    family: Needed[str]
    reason: Needed[str]
    tried: list[Tried] = []
    sources: dict[str, str | None] | None = None


class VerificationSummary(Record):
    accepted: Needed[dict[str, Accepted]]
    rejected: Needed[list[Rejected]]


class InputSet(Record):
    label: str | None = None
    origin: str | None = None


class CheckResult(Record):
    passed: bool | None = None


class Seeds(Record):
    master: int | None = None
    trials: int | None = None


class Tolerance(Record):
    atol: Needed[float]
    rtol: Needed[float]


class VerifyEnvironment(Record):
    accelerator: str | None = None
    triton: str | None = None
    torch: str | None = None
    tolerances: dict[str, Tolerance] = {}


class VerificationRecord(Record):
    verdict: Needed[str]
    reasons: Needed[list[str]]
    candidate: str | None = None
    source_sha256: str | None = None
    cases: list[InputSet] = []
    checks: list[CheckResult] = []
    seeds: Seeds | None = None
    environment: VerifyEnvironment | None = None


# projection.json --------------------------------------------------------------------------


class ProjectedSet(Record):
    """A set's projection from the frozen kernel numbers (`projection.workload.project_set`)."""
    families: list[str] = []
    amdahl: float | None = None
    replay: float | None = None
    row_ms: dict[str, float] | None = None
    patterns: list[str] = []


class GraphsProjection(Record):
    """The frozen CUDA-graph projection of a workload (`projection.workload.project_graphs`)."""
    unpatched: float | None = None
    kept: float | None = None
    patterns: list[str] = []
    note: str | None = None
    basis: str | None = None
    unpatched_pass_us: float | None = None
    kept_pass_us: float | None = None


class HostDelta(Record):
    """A family's host time per kernel call, measured in the model (`stages.host`)."""
    us_per_call: float | None = None
    share_per_call: float | None = None
    pass_us_per_call: float | None = None
    pass_share_per_call: float | None = None
    base_enqueue_ms: float | None = None
    calls_per_pass: int | None = None
    attempts_ms: list[float] = []
    error: str | None = None


class HostSet(Record):
    """The host share a set saves patched together (`stages.host.set_host_share`)."""
    families: list[str] = []
    share: float | None = None
    base_enqueue_ms: float | None = None
    pairs: int | None = None
    error: str | None = None
    extra_us_per_call: float | None = None


class ProjectedWorkload(Record):
    amdahl: Needed[float]
    replay: Needed[float | None]
    patterns: Needed[list[str]]
    row_ms: dict[str, float] | None = None
    note: str | None = None
    host_delta_us: dict[str, float] | None = None
    host_in_model: dict[str, HostDelta] = {}
    host_set: HostSet | None = None
    graphs: GraphsProjection | None = None


class Projection(Record):
    kernel_speedups: Needed[dict[str, float]]
    families: Needed[list[str]]
    workloads: Needed[dict[str, ProjectedWorkload]]
    host_delta_us: dict[str, float] = {}
    case_speedups: dict[str, list] | None = None
    graph_kernel_speedups: dict[str, float] | None = None
    graph_case_speedups: dict[str, list] | None = None


# options.json ------------------------------------------------------------------------------


class RunOptions(Record):
    """The options `pipeline optimize` ran with (options.json), which `--resume` keeps."""
    top: Needed[int]
    families: list[str] | None = None
    backend: str = "triton"
    max_configs: int | None = None
    pairs: int | None = None
    proposer: str | None = None
    workers: str = "local"  # runs from before backends: the local worker
    ray_address: str | None = None
    # the search (codegen.strategies.SearchPlan); None (runs from before strategies): the
    # command line's, by default its defaults
    search: str | None = None
    search_seconds: float | None = None
    search_seed: int | None = None
    fresh_search: bool | None = None
    proposer_share: float | None = None

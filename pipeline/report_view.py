"""The report's typed view: report.json's numbers (`report.collect`) as records, built once,
which the report's tables, plots and acceptance records read as attributes.

Every field a reader uses is declared here (a typo is an AttributeError, not a silent None);
what is copied whole from an artifact keeps that artifact's record (`core.records`). report.json
itself is written from the plain data the view is built from, so the file does not depend on
how the view declares its fields.
"""

from __future__ import annotations

from typing import Any

from core.record import Needed, Record
from core.records import (
    Bound,
    Ceilings,
    CurvePoint,
    Environment,
    Floor,
    Graphs,
    HostDelta,
    HostSet,
    ModelInfo,
    NoRemedy,
    PatchEffect,
    Timing,
    Trial,
    WorkloadLabel,
)
from pipeline.projection.gap import Gap

Num = float | int | None  # as written: an int stays an int where the text shows it as one


class TableRow(Record):
    """A row of the "Top patterns" table (`report._table_rows`)."""
    pattern: str | None = None
    family: str | None = None
    remedy: str | None = None
    occurrences: Num = None
    share: Num = None
    time_us: Num = None
    launches: Num = None
    attainable_speedup: Num = None
    target_source: str | None = None
    achieved_GBps: Num = None
    amdahl_gain: Num = None
    replay_gain: Num = None
    rank_gain: Num = None
    option_of: str | None = None
    overlaps: list[str] | None = None


class ShareRow(Record):
    """A bar of the "where the time goes" plot: the table's rows, the rows past it, the rest."""
    label: Needed[str]
    share: Num = None
    kind: Needed[str]


class GraphRow(Record):
    """The ranking's CUDA-graph row: the host's remedy for the rest row."""
    pattern: str | None = None
    share: Num = None
    replay_gain: Num = None
    graph_with_kernels_gain: Num = None
    why: str | None = None
    note: str | None = None


class Projected(Record):
    """A workload's frozen projection (`report._projected`), or the one of the set that ran
    (`integration.json`'s `projection_for_kept`)."""
    amdahl: Num = None
    replay: Num = None
    families: list[str] = []
    patterns: list[str] = []
    note: str | None = None
    kernel_speedups: dict[str, float] = {}
    host_in_model: dict[str, HostDelta] = {}
    host_set: HostSet | None = None
    host_used: dict[str, float] = {}
    row_ms: dict[str, float] | None = None


class RatioView(Record):
    """A paired timing read as a speedup (`report._ratio`)."""
    families: list[str] = []
    scope: str | None = None
    ratio: Num = None
    ratio_ci: list[Num] = []
    meaningful: bool = False
    reason: str | None = None
    verdict: str | None = None
    decision: str | None = None
    pairs: int | None = None
    speedup: Num = None
    ci: list[Num] | None = None
    note: str | None = None


class FamilyTiming(RatioView):
    """A family's whole-model timing alone, and in the set where it was timed there."""
    family: Needed[str]
    in_set: RatioView | None = None
    fallback_for: str | None = None


class Shipped(Record):
    families: list[str] = []
    speedup: Num = None
    ci: list[Num] | None = None
    note: str | None = None


class ProjectionError(Record):
    amdahl: Num = None
    replay: Num = None


class AtTimingHost(Record):
    """The replay at the timing's host speed, with its error (`report._at_timing_host`)."""
    replay: Num = None
    error: Num = None
    host_drift: Num = None
    profile_host_ms: Num = None
    timing_host_ms: Num = None


class Rollback(Record):
    family: Needed[str]
    stage: Needed[str]
    reason: Needed[str]


class CheckView(Record):
    """A whole-model check as the report says it (`report._check_summary`)."""
    families: list[str] | None = None
    passed: bool | None = None
    trials: list[Trial] = []
    reference: str | None = None
    rejected: list[str] = []


class WorkloadView(Record):
    """One workload of report.json (`report._workload`)."""
    key: Needed[str]
    workload: WorkloadLabel = WorkloadLabel()
    time_basis: str | None = None
    timing_meaningful: bool = False
    wall_ms: Num = None
    wall_p10_ms: Num = None
    wall_p90_ms: Num = None
    enqueue_ms: Num = None
    profiled_ms_per_step: Num = None
    gpu_busy_share: Num = None
    gpu_idle_share: Num = None
    launch_bound: bool = False
    regime: str | None = None
    rest_share: Num = None
    ranked_by: str | None = None
    ordered_by: str | None = None
    top_patterns: list[TableRow] = []
    shares: list[ShareRow] = []
    more_rows: int = 0
    cumulative: list[CurvePoint] = []
    ceiling_amdahl: Num = None
    ceiling_replay: Num = None
    floor: Floor | None = None
    floor_text: str | None = None
    graph_row: GraphRow | None = None
    graphs: Graphs | None = None
    projected: Projected | None = None
    measured: RatioView | None = None
    shipped: Shipped | None = None
    projection_error: ProjectionError | None = None
    at_timing_host: AtTimingHost | None = None
    bound: Bound | None = None
    compared_projection: Projected | None = None
    per_family: list[FamilyTiming] = []
    rollbacks: list[Rollback] = []
    set_aside: dict[str, str] = {}
    kept: list[str] | None = None
    check: CheckView | None = None
    fallback_checks: dict[str, CheckView] = {}
    patch_effect: PatchEffect | None = None
    declined: dict[str, list[str]] = {}
    gap: Gap | None = None
    conditions: str | None = None
    host_bound_note: str | None = None
    suggestions: list[str] = []
    experts_note: str | None = None
    no_remedy: list[NoRemedy] = []
    patch_memory: dict[str, int] = {}
    verdict: str | None = None


class SearchCount(Record):
    configs: Needed[int]
    passed_screen: Needed[int]


class AcceptedKernel(Record):
    key: Needed[str]
    family: Needed[str]
    case_key: Needed[str]
    case: Any = None
    config: Any = None
    origin: str | None = None
    source: str | None = None
    record: str | None = None
    kernel: Timing | None = None
    baseline: Timing | None = None
    meaningful: bool = False
    speedup: Num = None
    search: SearchCount | None = None


class TriedView(Record):
    candidate: Any = None
    verdict: str | None = None
    reasons: list[str] = []
    record: str | None = None


class RejectedKernel(Record):
    key: Needed[str]
    family: Needed[str]
    reason: str | None = None
    case: Any = None
    tried: list[TriedView] = []
    search: SearchCount | None = None


class Kernels(Record):
    accepted: list[AcceptedKernel] = []
    rejected: list[RejectedKernel] = []
    not_applicable: list[str] = []


class ReportView(Record):
    """report.json as the report reads it."""
    stage: str = "report"
    artifacts: list[str] = []
    model: ModelInfo = ModelInfo.of({})
    environment: Environment = Environment()
    ceilings: Ceilings = Ceilings()
    kernel_speedups: dict[str, float] | None = None
    chosen_families: list[str] | None = None
    kernels: Kernels = Kernels()
    workloads: list[WorkloadView] = []
    plots: dict[str, str] = {}  # plot key -> its path under the run directory
    acceptance: dict[str, str] = {}  # family -> its acceptance record's path


def view(data: dict) -> ReportView:
    """The report's numbers (`report.collect`) as the view its readers take."""
    return ReportView.of(data)

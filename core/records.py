"""The typed shape of every artifact a run directory holds, validated when it is read.

Each model names the fields the stages and the report rely on; everything else an artifact
carries (timings, per-trial details, diagnostics) stays readable as extra fields, so adding a
field to an artifact never breaks reading an older one, while a file that lacks what its
readers need, or holds the wrong type there, is refused with one line naming the file and
the first field that is wrong (`core.artifacts.read_json`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict


class Record(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)


class WorkloadSpec(Record):
    batch: int
    seq: int
    dtype: str
    device: str
    mode: Literal["prefill", "decode"]


class ModelInfo(Record):
    id: str


class ProfiledOp(Record):
    name: str
    time_us: float


class ProfiledWorkload(Record):
    workload: WorkloadSpec
    key: str
    wall: dict
    ops: list[ProfiledOp]


class Profile(Record):
    model: ModelInfo
    workloads: list[ProfiledWorkload]


class RankedRow(Record):
    pattern: str
    family: str | None
    share: float


class RankedWorkload(Record):
    key: str
    rows: list[RankedRow]


class Ranking(Record):
    workloads: list[RankedWorkload]


class Search(Record):
    family: str
    case_key: str | None
    case: dict | None


class SearchLog(Record):
    searches: list[Search]


class Accepted(Record):
    family: str
    case: dict
    source: str
    speedup: float


class Rejected(Record):
    key: str
    family: str
    reason: str


class VerificationSummary(Record):
    accepted: dict[str, Accepted]
    rejected: list[Rejected]


class VerificationRecord(Record):
    verdict: str
    reasons: list[str]


class ProjectedWorkload(Record):
    amdahl: float
    replay: float | None
    patterns: list[str]


class Projection(Record):
    kernel_speedups: dict[str, float]
    families: list[str]
    workloads: dict[str, ProjectedWorkload]


class StepKernel(Record):
    kernel: str
    calls: int
    ms: float
    share: float


class DecodeStep(Record):
    """A graphed decode step's anatomy (pipeline.decode_step)."""
    kernels_per_step: int
    kernels_per_layer: float | None
    step_ms: float
    busy_ms: float
    floor_ms: float | None
    floor_multiple: float | None
    kernels: list[StepKernel]
    levers_ms: dict[str, float]
    verdict: str


class GraphsRecord(Record):
    # on a GPU, for a decode workload; absent in runs from before it
    decode_step: DecodeStep | None = None


class IntegratedWorkload(Record):
    kept: list[str]
    cases: dict[str, list[str]] = {}
    # the graphs stage's record (pipeline.stages.graphs); absent in runs from before it
    graphs: GraphsRecord | None = None


class Integration(Record):
    families: list[str] = []
    workloads: dict[str, IntegratedWorkload]


class RunOptions(Record):
    """The options `pipeline optimize` ran with (options.json), which `--resume` keeps."""
    top: int
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


class TokenTimes(Record):
    """One variant's timings over a generation's repetitions (milliseconds)."""
    ttft_p50: float
    ttft_p99: float
    tpot_p50: float | None  # None with one new token: no step between tokens
    tpot_p99: float | None
    e2e_p50: float  # the whole call, synchronised
    tok_s: float  # new tokens of the whole batch per second at the median call
    samples: int  # timed calls
    calls_ms: list[float] = []  # each timed call's wall, in round order


class GenerationVariant(Record):
    """One way of generating (`pipeline.e2e.VARIANTS`), measured or skipped with its reason."""
    name: str
    skipped: str | None = None
    note: str | None = None
    times: TokenTimes | None = None
    over_eager: float | None = None  # end-to-end speedup over hf-eager (median call)
    # 95 % bootstrap interval of the per-round ratios hf-eager's call / this one's (the rounds
    # rotate the order, each pairs two calls minutes apart at most)
    over_eager_ci: list[float] | None = None
    ttft_over_eager: float | None = None
    tpot_over_eager: float | None = None
    floor_multiple: float | None = None  # TPOT p50 over the decode step's weight-read floor
    setup_s: float | None = None  # one-off before the first call: patching, building
    first_call_s: float | None = None  # the untimed first call: compiling, capturing
    same_tokens: float | None = None  # share of new tokens equal to hf-eager's
    first_divergence: int | None = None  # first new-token index any row differs there
    families: list[str] = []  # kernel families patched in
    # per phase ("prefill", "steps"): each family's kernel calls in one timed generation, and
    # the cases it had no kernel for (those calls ran the original code)
    kernel_calls: dict[str, dict[str, int]] = {}
    declined: dict[str, dict[str, list[str]]] = {}
    # per phase, the families whose kernel served every call of it (a graphed step's kernels
    # are called while it is captured: a replay runs no Python and counts no call)
    served: dict[str, list[str]] = {}
    projected: GenerationProjection | None = None


class GenerationProjection(Record):
    """The frozen prefill and decode projections of the run, composed over the generation
    (`pipeline.e2e_projection`), beside the measurement."""
    ttft_ms: float
    tpot_ms: float
    e2e_ms: float
    speedup: float  # end to end over hf-eager's measured call
    prefill_speedup: float
    decode_speedup: float
    prefill_share: float  # of hf-eager's TTFT, the profiled prefill pass
    step_share: float  # of hf-eager's TPOT, the profiled decode step
    error: float | None = None  # |projected - measured| / measured, end to end
    notes: list[str] = []


class GenerationPoint(Record):
    key: str  # generate-b{batch}-p{prompt}-n{new}-{dtype}
    batch: int
    prompt: int
    new: int
    prefill_workload: str | None = None  # the run's workloads whose kernels serve it
    decode_workload: str | None = None
    floor_ms: float | None = None  # weight bytes over the copy bandwidth
    weight_bytes: int | None = None
    skipped: str | None = None
    variants: list[GenerationVariant] = []


class E2E(Record):
    """e2e.json: generation end to end, per grid point, every variant in one process."""
    model: str
    device: str
    dtype: str
    rounds: int
    notes: list[str] = []
    points: list[GenerationPoint]


GenerationVariant.model_rebuild()


# the artifact kinds `read_json` is asked for, and the model each is checked against
BY_KIND: dict[str, type[Record]] = {
    "profile": Profile,
    "ranking": Ranking,
    "search log": SearchLog,
    "verification summary": VerificationSummary,
    "verification record": VerificationRecord,
    "projection": Projection,
    "integration": Integration,
    "run options": RunOptions,
    "e2e": E2E,
}

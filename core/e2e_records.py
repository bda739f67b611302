"""e2e.json's records: generation end to end (`pipeline e2e`), per grid point and variant."""

from __future__ import annotations

from core.record import Record


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

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


class IntegratedWorkload(Record):
    kept: list[str]
    cases: dict[str, list[str]] = {}
    # the graphs stage's record (pipeline.stages.graphs); absent in runs from before it
    graphs: dict | None = None


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
}

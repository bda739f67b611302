"""verify_candidate: the one entry point every candidate goes through.

Generated, proposed and hand-written candidates alike: a source file defining
`forward(*inputs, out, **params)`, verified in an isolated worker on the given cases plus the
family's edge cases, judged by verify/checks.py, recorded as
`<record_dir>/verification/<family>/<candidate>.json`. A candidate that fails in any way comes back
as a rejected VerificationResult; only mistakes of the caller (an unknown family, no cases) raise.

Cost note, large cases. The LM head of GPT-2 (x 8192 x 768 @ w 768 x 50257 bf16, padded to
50304) is the largest case a family verifies. Per full-size input set (3 random trials, 2 memo
probes, 4 stress kinds, 1 non-finite: 10, plus 3 timing buffers judged afterwards), counted
with a dispatch-mode counter at 1/64 of the rows and scaled (rows scale everything but the
weight): the bf16 baseline, 0.63 TFLOP (6.7 ms at the unpadded 94 TFLOP/s); the float64
reference, 0.63 TFLOP (about 13 ms at the ~50 TFLOP/s of Hopper's FP64 tensor cores); the
order bound, |x| @ |w| in float64 (13 ms) and, before, the exact product a second time (13 ms,
now `reference=` reused) plus 157 GB of elementwise traffic (~45 ms); the candidate twice (2
ms); two comparisons of 370-395 GB each (~0.1 s each at ~4 TB/s). The largest item was none
of these: out's random prefill drawn on the CPU, two serial generator passes and elementwise
ops over 412 M values (1.25 s at 1/16 of the rows on a 2-core host, so several seconds per
set at full size) and a pageable 0.8 GB copy; it is drawn on the device now
(`integrity.GuardedOut.random`). Estimate: before, 10 x (4-8 s) + ~1 s of GPU work; after,
13 x ~0.3 s + the timing (~1 s) + start-up, under 10 s (`tests/codegen/test_matmul.py`'s GPU
test holds it under 20 s). Every check still runs at full size: float32 references would
not help here (Hopper's fp32 and fp64 GEMM rates are alike) and smaller stand-in cases
would not show what cuBLAS picks at 8192 rows.
"""

from __future__ import annotations

import hashlib
import json
import platform
import secrets
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from core.family import Case, Family
from verify.loading import candidate_name, family_spec, load_family
from verify.numerics import MEMO_KINDS, input_plan, seed_for
from verify.probes import probe_kinds
from verify.tolerances import TOLERANCES
from verify.worker import WorkerOutcome
from verify.workers import LocalWorkers, Workers


@dataclass
class VerificationResult:
    candidate: str
    family: str
    verdict: str  # "accepted" | "rejected"
    checks: list[dict]
    errors: list[dict]
    reasons: list[str] = field(default_factory=list)
    timing: dict | None = None
    seeds: dict = field(default_factory=dict)
    cases: list[dict] = field(default_factory=list)
    cases_skipped: list[str] = field(default_factory=list)  # not run after a failure (fail_fast)
    source: str = ""
    source_sha256: str = ""
    device: str = ""
    environment: dict = field(default_factory=dict)
    duration_s: float = 0.0
    record_path: str | None = None
    notes: list[str] = field(default_factory=list)  # what this verification could not see
    # where it ran: backend ("local" | "ray"), hostname, the GPU (name, uuid, PCI bus id),
    # on Ray the node; the timings in `timing` are that GPU's
    worker: dict = field(default_factory=dict)

    @property
    def accepted(self) -> bool:
        return self.verdict == "accepted"

    def failed(self) -> set[str]:
        """Names of the checks that failed (what tests and the search log key on)."""
        return {c["name"] for c in self.checks if not c["passed"]}

    def to_dict(self) -> dict:
        return asdict(self)


def expand_cases(family: Family, cases: Sequence[Case]) -> list[dict]:
    """The given cases, then each one's edge cases, without duplicates (first label wins)."""
    entries, seen = [], set()

    def add(case: Case, label: str, origin: str) -> None:
        key = json.dumps(case, sort_keys=True, default=str)
        if key not in seen:
            seen.add(key)
            entries.append({"label": label, "origin": origin, "case": dict(case)})

    for i, case in enumerate(cases):
        add(case, f"c{i}", "given")
    for i, case in enumerate(cases):
        for j, edge in enumerate(family.edge_cases(case)):
            add(edge, f"c{i}.e{j}", f"edge of c{i}")
    return entries


def _environment(device: str) -> dict:
    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__, "device": device}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if device.startswith("cuda") and torch.cuda.is_available():
        env["accelerator"] = torch.cuda.get_device_name(torch.device(device))
        env["cuda"] = torch.version.cuda
    return env


def _worker_checks(outcome: WorkerOutcome, timeout_s: float) -> list[dict]:
    where = outcome.last_phase
    if outcome.status == "timeout":
        return [{"name": "timeout", "case": None, "passed": False,
                 "detail": f"no result after {timeout_s:g} s (last: {where}); worker killed"}]
    if outcome.status == "crash":
        tail = outcome.log_tail.strip()[-1200:]
        return [{"name": "crash", "case": None, "passed": False,
                 "detail": f"worker {outcome.describe_exit()} during {where}"
                           + (f"\n{tail}" if tail else "")}]
    if outcome.status == "error":
        text = next((m[1] for m in outcome.messages if m[0] == "error"), "")
        return [{"name": "harness", "case": None, "passed": False,
                 "detail": f"verifier failed during {where} (not judged: rejected)\n{text}"}]
    return []


# Root causes before their symptoms: an unwritten output also fails numerics, a crash ends all.
_PRIORITY = ("harness", "static", "load", "crash", "timeout", "runs", "reference", "out_buffer",
             "writes_all", "out_of_bounds", "inputs_unchanged", "aten_ops", "default_stream",
             "deterministic", "numerics", "memoisation", "stress", "nonfinite", "timed_results")

# Triton 3.9's interpreter casts fp32 to bf16 by truncation, not round-to-nearest-even, so on
# the CPU a kernel that accumulates in bf16 lands as close to the reference as one that
# accumulates in fp32 and rounds once; only a GPU run tells them apart (tests marked gpu).
BF16_CPU_NOTE = ("bfloat16 on the CPU: the Triton interpreter truncates fp32 -> bf16 instead of "
                 "rounding to nearest, so bf16 accumulation cannot be told from fp32 "
                 "accumulation here; the GPU verification is the one that holds bf16 "
                 "candidates to the reference's error distribution")


def _reasons(checks: list[dict]) -> list[str]:
    """One line per failed check, most fundamental first."""
    reasons = []
    names = dict.fromkeys(c["name"] for c in checks if not c["passed"])
    for name in sorted(names, key=lambda n: _PRIORITY.index(n) if n in _PRIORITY else 99):
        failed = [c for c in checks if c["name"] == name and not c["passed"]]
        first = failed[0]
        where = f" in {len(failed)} cases, first {first['case']}" if len(failed) > 1 else \
            (f" in {first['case']}" if first["case"] else "")
        reasons.append(f"{name}{where}: {first['detail'].splitlines()[0][:300]}")
    return reasons


def verify_candidate(family: Family | str, source_path: str | Path, cases: Sequence[Case], *,
                     device: str, seed: int = 0, trials: int = 3, timeout_s: float = 120,
                     record_dir: str | Path | None = None, timing: bool = True,
                     fail_fast: bool = True, candidate: str | None = None,
                     workers: Workers | None = None) -> VerificationResult:
    """Verify one candidate source file; a result object whatever the candidate does.

    family: a Family, a codegen.registry name, or "module:attr". cases: the cases the model runs
    (exact shapes/dtypes/strides); the family's edge cases are added. seed: master seed of every
    input (per input set seeds are derived and recorded). timing: time an accepted candidate and
    the baseline on the given cases (labelled not meaningful off the GPU). fail_fast: stop after
    the first case with a failed check (the verdict is then settled). record_dir: the run
    directory; the record goes to verification/<family>/<candidate>.json under it. workers:
    where it runs (verify.workers; default this machine's isolated worker).
    """
    with closing(verify_each(family, [source_path], cases, device=device, seed=seed,
                             trials=trials, timeout_s=timeout_s, record_dir=record_dir,
                             timing=timing, fail_fast=fail_fast, workers=workers,
                             names=[candidate])) as results:
        return next(results)


def verify_each(family: Family | str, source_paths: Sequence[str | Path],
                cases: Sequence[Case], *, device: str, seed: int = 0, trials: int = 3,
                timeout_s: float = 120, record_dir: str | Path | None = None,
                timing: bool = True, fail_fast: bool = True,
                names: Sequence[str | None] | None = None, workers: Workers | None = None,
                ) -> Iterator[VerificationResult]:
    """verify_candidate for each source, results yielded in input order. All are submitted
    first (Ray runs them side by side, one GPU each; the local backend runs each when its
    result is taken); closing the iterator early cancels those not taken, and only taken
    results are recorded, so stopping at the first accepted one records what the sequential
    path records."""
    if not cases:
        raise ValueError("verify_candidate needs at least one case")
    workers = workers or LocalWorkers()
    spec = family_spec(family)
    fam = load_family(spec) if isinstance(family, str) else family
    entries = expand_cases(fam, cases)
    names = list(names) if names is not None else [None] * len(source_paths)
    submitted = []
    for source_path, name in zip(source_paths, names):
        source = Path(source_path)
        # Fresh per verification, recorded: what `out` is prefilled with and the timing runs'
        # values are drawn from it, so a candidate cannot learn them from an earlier run.
        nonce = secrets.randbits(62)
        request = {"family": spec, "source": str(source.resolve()), "cases": entries,
                   "device": str(device), "seed": int(seed), "trials": int(trials),
                   "timing": bool(timing), "fail_fast": bool(fail_fast), "nonce": nonce}
        submitted.append((source, name or candidate_name(source), nonce,
                          workers.submit_isolated(request, timeout_s)))
    taken = 0
    try:
        for source, name, nonce, job in submitted:
            outcome = workers.result(job)
            taken += 1
            yield _result(fam, source, name, entries, nonce, outcome, job.started,
                          device=str(device), seed=seed, trials=trials, timeout_s=timeout_s,
                          record_dir=record_dir)
    finally:
        for *_, job in submitted[taken:]:
            workers.cancel(job)


def _result(fam: Family, source: Path, name: str, entries: list[dict], nonce: int,
            outcome: WorkerOutcome, started: float, *, device: str, seed: int, trials: int,
            timeout_s: float, record_dir: str | Path | None) -> VerificationResult:
    checks = [c for kind, payload in outcome.messages if kind == "checks" for c in payload]
    checks += _worker_checks(outcome, timeout_s)
    if outcome.status == "done" and not any(c["name"] in ("load", "static") for c in checks):
        checks.append({"name": "harness", "case": None, "passed": False,
                       "detail": "worker finished without reporting any check"})
    errors = [payload for kind, payload in outcome.messages if kind == "errors"]
    timing_data = next((payload for kind, payload in outcome.messages if kind == "timing"), None)
    accepted = outcome.status == "done" and bool(checks) and all(c["passed"] for c in checks) \
        and len(errors) == len(entries)
    try:
        digest = hashlib.sha256(source.read_bytes()).hexdigest()
    except OSError:
        digest = ""
    probes = probe_kinds(fam)
    memo = MEMO_KINDS + probes
    result = VerificationResult(
        candidate=name,
        family=fam.name,
        verdict="accepted" if accepted else "rejected",
        checks=checks,
        errors=errors,
        reasons=_reasons(checks),
        timing=timing_data,
        seeds={"master": int(seed), "trials": int(trials), "nonce": nonce,
               "nonce_rule": "random per verification; seeds the random prefill of out "
                             "(seed_for(master, label, kind, trial, 'fill', nonce)) and the "
                             "timing runs' values",
               "rule": "sha256 of (master, case label, input kind, trial); see numerics.seed_for",
               "input_sets": {e["label"]: {f"{kind}/{t}": seed_for(seed, e["label"], kind, t)
                                           for kind, t in input_plan(trials, probes)
                                           if e["origin"] == "given" or kind not in memo}
                              for e in entries}},
        cases=entries,
        cases_skipped=next((p for kind, p in outcome.messages if kind == "skipped"), []),
        source=str(source),
        source_sha256=digest,
        device=device,
        environment={**_environment(device),
                     "tolerances": {k: v.to_dict() for k, v in TOLERANCES.items()}},
        duration_s=time.monotonic() - started,
        notes=[BF16_CPU_NOTE] if not device.startswith("cuda") and any(
            str(e["case"].get("dtype", "")).endswith("bfloat16") for e in entries) else [],
        worker={**outcome.worker,
                **next((p for kind, p in outcome.messages if kind == "device"), {})},
    )
    if record_dir is not None:
        from core.artifacts import write_json

        path = Path(record_dir) / "verification" / fam.name / f"{name}.json"
        result.record_path = str(path)
        write_json(path, result.to_dict())
    return result


def verify_candidates(family: Family | str, source_paths: Sequence[str | Path],
                      cases: Sequence[Case], *, jobs: int = 1, **kwargs: Any,
                      ) -> list[VerificationResult]:
    """verify_candidate for several sources, `jobs` workers at a time (results in input order).

    jobs > 1 runs candidates side by side, so keep timing=False then (or jobs=1 on a GPU): timings
    taken while another candidate runs are not worth recording.
    """
    if jobs <= 1:
        return [verify_candidate(family, p, cases, **kwargs) for p in source_paths]
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(lambda p: verify_candidate(family, p, cases, **kwargs),
                             source_paths))

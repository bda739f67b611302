"""`pipeline optimize`: rank -> generate -> verify -> host -> project -> integrate -> graphs ->
report.

Each stage writes its artifact atomically; with `--resume` a stage whose artifact exists is
skipped, and inside generate/verify every (family, case) already done is skipped too. The
projection is frozen (projection.json) before integration measures anything.

A candidate is specialised to its case (constexpr widths); families give edge cases that keep
those widths (one row, prime row counts, strided rows), so the verifier runs the very file
that will run in the model on them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from codegen.cuda_build import resolve_backend
from codegen.hybrid import make_proposer
from codegen.strategies import SearchPlan
from core.artifacts import load
from core.env import steady_cpu_timing
from core.errors import UserError
from core.integration_records import Integration
from core.records import Profile, Ranking, SearchLog, VerificationSummary
from core.workload import Workload
from pipeline.interpreter import use_interpreter_without_gpu
from pipeline.policy import backfill, choose_families
from pipeline.projection.frozen import freeze_projection, project_kept
from pipeline.report import write_report
from pipeline.rundir import write_options
from pipeline.stages.generate import generate_stage
from pipeline.stages.graphs import graphs_stage
from pipeline.stages.host import host_stage
from pipeline.stages.integrate import integrate_stage
from pipeline.stages.rank import run_rank
from pipeline.stages.verify import verify_stage
from profiling.loader import ModelSpec, build, resolve
from verify.workers import make_workers


@dataclass
class Run:
    """One `optimize` run, as its stages need it: where it writes, the model and workloads it
    profiled, the options it was given, and where candidates are screened and verified."""

    dir: Path
    spec: ModelSpec
    workloads: list[Workload]
    say: Callable[[str], None]
    resume: bool
    top: int
    only: list[str] | None  # exactly these families, instead of the top `top`
    max_configs: int | None
    pairs: int | None
    proposer: str | None
    backend: str
    pool: Any  # verify.workers: LocalWorkers or RayWorkers
    plan: SearchPlan  # the search's strategy, budgets, seed, memory and proposer share
    hybrid: Any = None  # the proposer taking a share of a sampled search's trials

    @property
    def device(self) -> str:
        return self.workloads[0].device

    @property
    def on_gpu(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def timing_pairs(self) -> int:
        return self.pairs or (30 if self.on_gpu else 3)


def run_optimize(run_dir: Path, top: int, say: Callable[[str], None], resume: bool = False,
                 max_configs: int | None = None, pairs: int | None = None,
                 proposer: str | None = None, backend: str = "triton",
                 only: list[str] | None = None, workers: str = "local",
                 ray_address: str | None = None, plan: SearchPlan | None = None) -> dict:
    """All stages after profile on `run_dir`; returns the paths of what was written.
    `only`: exactly these families (in the ranking's order), instead of the top `top`.
    `backend`: kernel languages to generate, "triton", "cuda" or "both"; CUDA C++ falls back
    to Triton on a CPU run and raises UserError on a GPU that cannot build it.
    `workers`: where candidates are screened and verified, "local" (this machine, one at a
    time) or "ray" (one Ray task per candidate, one GPU each, on the cluster at `ray_address`
    or $RAY_ADDRESS, else a local Ray started here).
    `plan`: the search's strategy, budgets, seed, memory and proposer share
    (codegen.strategies.SearchPlan; `max_configs` is its trial budget)."""
    plan = plan or SearchPlan()
    profile = load(run_dir / "profile.json", Profile, "profile")
    write_options(run_dir, {"top": top, "families": only, "backend": backend,
                            "max_configs": max_configs, "pairs": pairs, "proposer": proposer,
                            "workers": workers, "ray_address": ray_address,
                            "search": plan.strategy, "search_seconds": plan.seconds,
                            "search_seed": plan.seed, "fresh_search": plan.fresh,
                            "proposer_share": plan.proposer_share})
    workloads = [Workload.from_dict(w.workload.to_dict()) for w in profile.workloads]
    device = workloads[0].device
    on_gpu = device.startswith("cuda")
    if on_gpu and all(w.mode == "decode" for w in workloads):
        # decode steps ship as CUDA graphs (the graphs stage): configs are chosen by their
        # time inside one
        plan = replace(plan, rank_by="graph")
    backend, note = resolve_backend(backend, device)  # before any stage runs
    if note:
        say(note)
    if not on_gpu:
        use_interpreter_without_gpu()  # for API callers; the CLI did it before any import
        steady_cpu_timing()  # as the profile timed it

    # before any stage: a missing Ray, or a cluster without a GPU, is one line, not a failure
    pool = make_workers(workers, ray_address, gpu=on_gpu)
    if pool.name == "ray":
        say(f"workers: Ray tasks, each with {pool.resources}")
    try:
        # on the CPU the interpreter makes timings meaningless: one config per case is enough
        run = Run(dir=run_dir, spec=resolve(profile.model.id), workloads=workloads,
                  say=say, resume=resume, top=top, only=only,
                  max_configs=max_configs or (None if on_gpu else 1), pairs=pairs,
                  proposer=proposer, backend=backend, pool=pool, plan=plan,
                  # the proposer takes a share of the sampled searches' trials
                  # (codegen.hybrid), and runs beside the others as before
                  hybrid=make_proposer(proposer, run_dir) if plan.proposer_share > 0 else None)
        return _stages(run)
    finally:
        pool.close()


def _stages(run: Run) -> dict:
    ranking = _ranking(run.dir, run.resume, run.say)
    families = _chosen(ranking, run.top, run.only)
    model = build(run.spec, run.workloads[0].torch_dtype(), run.device)
    verified_before = _read_if(run.resume, run.dir / "verification" / "summary.json",
                               VerificationSummary, "verification summary")
    _, summary = _search(run, model, families, run.resume, propose=True)
    if not run.only:
        families, summary = backfill(ranking, families, run.top, run.device, run.say, summary,
                                     lambda more: _search(run, model, more, True, propose=False))

    # Whole-model timings (host, integrate, graphs) run on the driver's GPU with nothing else
    # on it: on a one-GPU node a Ray task may hold that same GPU, so every task, cancelled
    # ones too, must have ended first. Families of one workload are integrated one after
    # another on that GPU, not spread over Ray: each decision (rolled back or kept, the next
    # family backfilled) is measured in the model with the families kept before it.
    run.pool.drain()
    # later stages are skipped on --resume only if what they read did not change in this run
    # (an edited kernel, verified again, must reach the projection and the model)
    integ = _read_if(run.resume, run.dir / "integration.json", Integration, "integration")
    unchanged = verified_before == summary and integ is not None and integ.chosen == families
    if not (unchanged and (run.dir / "projection.json").exists()):
        _freeze(run, model, ranking, summary, families)
    if not unchanged:
        integrate_stage(run.dir, run.spec, run.workloads, summary, families, run.say,
                        run.timing_pairs, built={(run.workloads[0].dtype, run.device): model})
    model = None  # integration freed its copy; the graphs stage builds its own
    # integration.json is written before the graphs stage runs: a run cut off in that stage
    # resumes with its measured workloads that have no "graphs" record yet
    measured = load(run.dir / "integration.json", Integration, "integration").workloads
    pending = [w for w in run.workloads
               if w.key in measured and not measured[w.key].has("graphs")]
    if pending:
        graphs_stage(run.dir, run.spec, pending, summary, run.say, run.timing_pairs)
    # cheap (replays of the frozen numbers) and idempotent, so always: a resumed run that was
    # cut off before it gets the kept set's projection too
    project_kept(run.dir, run.on_gpu)
    run.say("report")
    return write_report(run.dir)


def _search(run: Run, model, families: list[str], again: bool,
            propose: bool) -> tuple[SearchLog, VerificationSummary]:
    """Generate and verify `families` (`again`: keep what an earlier attempt did); the search
    log and the verification summary."""
    log = generate_stage(run.dir, families, model, run.workloads, run.device, run.say, again,
                         run.max_configs, run.backend, workers=run.pool, plan=run.plan,
                         proposer=run.hybrid if propose else None)
    if run.proposer and propose:
        from codegen.proposer import run_proposer

        # the proposer adds its candidates to the log as plain data (codegen's own format)
        log = SearchLog.of(run_proposer(run.proposer, run.dir, log.to_dict(), run.device,
                                        run.say))
    return log, verify_stage(run.dir, log, run.device, run.say, again, workers=run.pool)


def _freeze(run: Run, model, ranking: Ranking, summary: VerificationSummary,
            families: list[str]) -> None:
    """The host deltas measured in the model (on a GPU), then the projection frozen."""
    enqueue = {w.key: w.enqueue_ms for w in ranking.workloads}
    in_model, in_model_set = host_stage(model, run.workloads, summary, families, run.say,
                                        enqueue) if run.on_gpu else (None, None)
    freeze_projection(run.dir, summary, families, run.on_gpu, in_model, in_model_set)


def _ranking(run_dir: Path, resume: bool, say: Callable[[str], None]) -> Ranking:
    if not (resume and (run_dir / "ranking.json").exists()):
        say("rank")
        run_rank(run_dir)
    return load(run_dir / "ranking.json", Ranking, "ranking")


def _chosen(ranking: Ranking, top: int, only: list[str] | None) -> list[str]:
    families = choose_families(ranking, None if only else top)
    if only:
        families = [f for f in families if f in only] + [f for f in only if f not in families]
    if not families:
        raise UserError("the ranking names no pattern a kernel family can replace")
    return families


def _read_if(resume: bool, path: Path, model, kind: str):
    return load(path, model, kind) if resume and path.exists() else None

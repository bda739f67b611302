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
from pathlib import Path

from codegen.cuda_build import resolve_backend
from core.artifacts import read_json
from core.env import steady_cpu_timing
from core.errors import UserError
from core.workload import Workload
from pipeline.interpreter import use_interpreter_without_gpu
from pipeline.policy import backfill, choose_families
from pipeline.projection import freeze_projection, project_kept
from pipeline.report import write_report
from pipeline.rundir import write_options
from pipeline.stages.generate import generate_stage
from pipeline.stages.graphs import graphs_stage
from pipeline.stages.host import host_stage
from pipeline.stages.integrate import integrate_stage
from pipeline.stages.rank import run_rank
from pipeline.stages.verify import verify_stage
from profiling.loader import build, resolve
from verify.workers import make_workers


def run_optimize(run_dir: Path, top: int, say: Callable[[str], None], resume: bool = False,
                 max_configs: int | None = None, pairs: int | None = None,
                 proposer: str | None = None, backend: str = "triton",
                 only: list[str] | None = None, workers: str = "local",
                 ray_address: str | None = None) -> dict:
    """All stages after profile on `run_dir`; returns the paths of what was written.
    `only`: exactly these families (in the ranking's order), instead of the top `top`.
    `backend`: kernel languages to generate, "triton", "cuda" or "both"; CUDA C++ falls back
    to Triton on a CPU run and raises UserError on a GPU that cannot build it.
    `workers`: where candidates are screened and verified, "local" (this machine, one at a
    time) or "ray" (one Ray task per candidate, one GPU each, on the cluster at `ray_address`
    or $RAY_ADDRESS, else a local Ray started here)."""
    profile = read_json(run_dir / "profile.json", "profile")
    write_options(run_dir, {"top": top, "families": only, "backend": backend,
                            "max_configs": max_configs, "pairs": pairs, "proposer": proposer,
                            "workers": workers, "ray_address": ray_address})
    workloads = [Workload.from_dict(w["workload"]) for w in profile["workloads"]]
    device = workloads[0].device
    on_gpu = device.startswith("cuda")
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
        return _stages(run_dir, top, say, resume, max_configs, pairs, proposer, backend, only,
                       profile, workloads, device, on_gpu, pool)
    finally:
        pool.close()


def _stages(run_dir, top, say, resume, max_configs, pairs, proposer, backend, only, profile,
            workloads, device, on_gpu, pool) -> dict:
    ranking = _ranking(run_dir, resume, say)
    families = _chosen(ranking, top, only)
    spec = resolve(profile["model"]["id"])
    model = build(spec, workloads[0].torch_dtype(), device)
    # on the CPU the interpreter makes timings meaningless: one config per case is enough
    max_configs = max_configs or (None if on_gpu else 1)

    def search(fams: list[str], again: bool, propose: bool) -> tuple[dict, dict]:
        log = generate_stage(run_dir, fams, model, workloads, device, say, again, max_configs,
                             backend, workers=pool)
        if proposer and propose:
            from codegen.proposer import run_proposer

            log = run_proposer(proposer, run_dir, log, device, say)
        return log, verify_stage(run_dir, log, device, say, again, workers=pool)

    verified_before = _read_if(resume, run_dir / "verification" / "summary.json",
                               "verification summary")
    _, summary = search(families, resume, propose=True)
    if not only:
        families, summary = backfill(ranking, families, top, device, say, summary,
                                     lambda more: search(more, True, propose=False))

    # Whole-model timings (host, integrate, graphs) run on the driver's GPU with nothing else
    # on it: on a one-GPU node a Ray task may hold that same GPU, so every task, cancelled
    # ones too, must have ended first. Families of one workload are integrated one after
    # another on that GPU, not spread over Ray: each decision (rolled back or kept, the next
    # family backfilled) is measured in the model with the families kept before it.
    pool.drain()
    # later stages are skipped on --resume only if what they read did not change in this run
    # (an edited kernel, verified again, must reach the projection and the model)
    integ = _read_if(resume, run_dir / "integration.json", "integration")
    unchanged = verified_before == summary and integ is not None \
        and integ.get("chosen") == families
    if not (unchanged and (run_dir / "projection.json").exists()):
        enqueue = {w["key"]: w.get("enqueue_ms") for w in ranking["workloads"]}
        in_model, in_model_set = host_stage(model, workloads, summary, families, say,
                                            enqueue) if on_gpu else (None, None)
        freeze_projection(run_dir, summary, families, on_gpu, in_model, in_model_set)
    if not unchanged:
        integrate_stage(run_dir, spec, workloads, summary, families, say,
                        pairs or (30 if on_gpu else 3),
                        built={(workloads[0].dtype, device): model})
    model = None  # integration freed its copy; the graphs stage builds its own
    # integration.json is written before the graphs stage runs: a run cut off in that stage
    # resumes with its measured workloads that have no "graphs" record yet
    measured = read_json(run_dir / "integration.json", "integration")["workloads"]
    pending = [w for w in workloads if w.key in measured and "graphs" not in measured[w.key]]
    if pending:
        graphs_stage(run_dir, spec, pending, summary, say, pairs or (30 if on_gpu else 3))
    # cheap (replays of the frozen numbers) and idempotent, so always: a resumed run that was
    # cut off before it gets the kept set's projection too
    project_kept(run_dir, on_gpu)
    say("report")
    return write_report(run_dir)


def _ranking(run_dir: Path, resume: bool, say: Callable[[str], None]) -> dict:
    if not (resume and (run_dir / "ranking.json").exists()):
        say("rank")
        run_rank(run_dir)
    return read_json(run_dir / "ranking.json", "ranking")


def _chosen(ranking: dict, top: int, only: list[str] | None) -> list[str]:
    families = choose_families(ranking, None if only else top)
    if only:
        families = [f for f in families if f in only] + [f for f in only if f not in families]
    if not families:
        raise UserError("the ranking names no pattern a kernel family can replace")
    return families


def _read_if(resume: bool, path: Path, kind: str) -> dict | None:
    return read_json(path, kind) if resume and path.exists() else None

"""Generate stage: search every (family, case) the model calls and log each candidate tried."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from core.artifacts import load, write_json
from core.records import Search, SearchLog
from pipeline.resume import edited_since_screened


def generate_stage(run_dir: Path, families: list[str], model, workloads, device: str,
                   say: Callable[[str], None], resume: bool, max_configs: int | None,
                   backend: str = "triton", workers=None, plan=None,
                   proposer=None) -> SearchLog:
    """`backend`: "triton", "cuda" or "both" (already checked against the device). `workers`
    (verify.workers): every case is submitted first, then taken in order, so on Ray the cases
    are searched side by side; the local backend searches each as it is taken, as before.
    `plan` (codegen.strategies.SearchPlan): how each case is searched, `max_configs` its trial
    budget; `proposer` (codegen.hybrid): takes a share of a sampled search's trials. On a
    GPU without Ray, the candidates the searches will try are compiled side by side before
    the first is timed (codegen.warm_compile; PIPELINE_WARM_COMPILE=0 turns that off)."""
    from codegen import search as searching
    from codegen.registry import get_family
    from codegen.search import case_key, family_backend
    from codegen.warm_compile import warm_before_search

    path = run_dir / "candidates" / "search_log.json"
    log = load(path, SearchLog, "search log") if (resume and path.exists()) \
        else SearchLog(searches=[])
    index = {(s.family, s.case_key): i for i, s in enumerate(log.searches)}
    # a case whose candidate file was edited after it was screened is searched again: the
    # edit is kept (write_candidate) and screened, then verified, as it is now
    done = {k for k, i in index.items() if not edited_since_screened(log.searches[i])}
    changed = not (resume and path.exists())
    how = {"max_configs": max_configs, "backend": backend, "plan": plan, "proposer": proposer,
           "say": say}
    pending, searched = [], []
    for name in families:
        fam = get_family(name)
        wanted = family_backend(fam, backend)
        if wanted != backend:
            say(f"{name} has no CUDA C++ variant; generating Triton")
        cases = []
        for w in workloads:
            for c in fam.cases_from_model(model, w):
                if c not in cases:
                    cases.append(c)
        if not cases:
            pending.append((name, None, (name, None), None))
            continue
        for case in cases:
            key = (name, case_key(case))
            # a case searched for another backend is searched again (logs written before
            # backends existed searched Triton)
            if key in done and log.searches[index[key]].backend == wanted:
                continue
            args = (fam, case, run_dir / "candidates", device)
            if workers is not None and workers.parallel:
                job = searching.submit_search(*args, workers=workers, **how)
                pending.append((name, case, key, lambda job=job: searching.finish_search(job)))
            else:  # searched when taken, below
                searched.append((fam, case))
                pending.append((name, case, key, lambda args=args: searching.search(
                    *args, **how)))
    # the local searches compile their candidates one after another: on a GPU, compile them
    # side by side first (codegen.warm_compile), so the searches find them in Triton's cache
    warm_before_search(searched, run_dir / "candidates", device, **how)
    for name, case, key, job in pending:  # in the order of the loop above, as before backends
        if job is None:
            if key not in index:
                index[key] = len(log.searches)
                log.searches.append(Search(
                    family=name, case_key=None, case=None,
                    note="the model has no call this family can replace"))
                changed = True
            continue
        say(f"generate {name} {case_key(case)}")
        entry = Search.of(job())
        if key in index:
            log.searches[index[key]] = entry
        else:
            index[key] = len(log.searches)
            log.searches.append(entry)
        write_json(path, log)
        changed = False
    if getattr(proposer, "record", None):  # the language model's budgets, tokens, events
        log.llm = proposer.record
        changed = True
    if changed:
        write_json(path, log)
    return log

"""The search over a family's parameter space, one recorded case at a time.

Every config tried is rendered to a readable source file under
`candidates/<family>/<case>/<config>/kernel.py`, run once against the reference (a quick
screen, not the verification), and timed with the verify stage's harness beside the baseline
(the family reference, which mirrors the Hugging Face code) on the same inputs, in the case's
screening worker (codegen.screen): a config that crashes or hangs the worker is logged as such
and the search goes on with the next one. A file the user edited is kept, and tried first.

Which configs: codegen.strategies (the grid, random, or TPE; by default the grid where the
space fits the trial budget, TPE where it does not), starting from the configs an earlier
search of the same case on the same GPU and software found best (codegen.search_memory) unless
the plan is fresh. On a GPU, a case whose remembered best renders to the source it timed is
not searched again: its remembered timing and baseline stand (`CaseSearch.reusable`), and the
verify stage still judges it. With a proposer and a sampled strategy, the proposer takes a
share of the trials (codegen.hybrid).

The log keeps every candidate tried: by which strategy (`strategy`: grid, random, tpe, memory,
edited, proposer) at which trial, why where it was not the strategy's own pick (`why`), its
time and spread, kept or discarded, and why (`decision`), and where it came from (`source`:
"search" here; a proposer's name, and for the built-in language model proposer its round, for
proposals: codegen/proposer.py, codegen/llm_proposer.py). `search` holds the case's strategy,
budgets, trials, what stopped it and what memory it started from; `proposals` each proposer
trial's source, verdicts and time.

Backends: "triton" searches `family.search_space`; "cuda" the family's CUDA C++ space
(`Family.cuda`, configs marked {"backend": "cuda"} so their folders differ), or
Triton's where the family has none; "both" the two spaces.
"""

from __future__ import annotations

import hashlib
import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

from codegen import strategies
from codegen.screen import (  # noqa: F401 - the screen's names, as callers import them here
    SCREEN_RTOL,
    RemoteSession,
    ScreenSession,
    _screen_and_time,
    screen_and_time,
)
from codegen.strategies import SearchPlan
from core.family import Case, Family

SEARCH_SOURCE = "search"
_THREADS: list[ThreadPoolExecutor] = []


def case_key(case: Case) -> str:
    short = "-".join(f"{k}{v}" for k, v in sorted(case.items())
                     if isinstance(v, int) and not isinstance(v, bool))
    digest = hashlib.sha1(json.dumps(case, sort_keys=True).encode()).hexdigest()[:6]
    return f"{case.get('dtype', '')}-{short}-{digest}"[:80]


def config_key(config: dict) -> str:
    return "_".join(f"{k}{v}" for k, v in sorted(config.items())) or "default"


def config_backend(config: dict) -> str:
    return config.get("backend", "triton")


def family_backend(family: Family, backend: str) -> str:
    """What `backend` means for this family: CUDA only where it has a CUDA C++ variant."""
    return backend if family.cuda is not None else "triton"


def backend_configs(family: Family, case: Case, backend: str,
                    budget: int | None = None, interpreter: bool = False) -> list[dict]:
    """The configs `backend` searches for `case`; `budget` spreads over each space apart, so
    "both" keeps both backends even with one config per case. Under Triton's CPU interpreter
    one config per case takes the widest tiles: timings mean nothing there, and the run time
    grows with the number of programs (rope's middle config, one head per program, spent 31 s
    verifying tiny-llama's case)."""
    backend = family_backend(family, backend)
    configs = []
    if backend in ("triton", "both"):
        space = family.search_space(case)
        configs += space[-1:] if interpreter and budget == 1 else spread(space, budget)
    if backend in ("cuda", "both"):
        space = family.cuda.search_space(case)
        configs += spread([{**c, "backend": "cuda"} for c in space], budget)
    return configs


def render(family: Family, config: dict, case: Case) -> str:
    if config_backend(config) == "cuda":
        return family.cuda.render(config, case)
    return family.render(config, case)


def user_edited(path: Path) -> bool:
    """Whether the file at `path` differs from what was rendered there."""
    stamp = path.with_suffix(".rendered.sha1")
    return path.exists() and stamp.exists() and \
        hashlib.sha1(path.read_bytes()).hexdigest() != stamp.read_text().strip()


def write_candidate(family: Family, config: dict, case: Case, path: Path) -> str:
    """Render into `path` unless the user edited the file there; returns its origin."""
    if user_edited(path):
        return "user-edited"
    from core.artifacts import write_text

    source = render(family, config, case)
    write_text(path, source)
    write_text(path.with_suffix(".rendered.sha1"), hashlib.sha1(source.encode()).hexdigest())
    return "generated"


def spread(configs: list[dict], budget: int | None) -> list[dict]:
    """At most `budget` configs, evenly spaced over the family's list. Spaces are listed from
    small tiles to large; the first N alone would never try a large tile (rope's four smallest
    reach about a third of the copy ceiling)."""
    if not budget or budget >= len(configs):
        return list(configs)
    if budget == 1:
        return [configs[len(configs) // 2]]
    step = (len(configs) - 1) / (budget - 1)
    return [configs[round(i * step)] for i in range(budget)]




def search(family: Family, case: Case, root: Path, device: str, max_configs: int | None = None,
           timeout_s: float = 300.0, backend: str = "triton", workers=None,
           plan: SearchPlan | None = None, proposer=None, say=None) -> dict:
    """Search one case; returns its search log entry. `max_configs`: the trial budget
    (overrides the plan's); `proposer`: a codegen.hybrid proposer, used where the plan's
    strategy samples (random, TPE)."""
    return finish_search(submit_search(family, case, root, device, max_configs, timeout_s,
                                       backend, workers, plan, proposer, say))


def submit_search(family: Family, case: Case, root: Path, device: str,
                  max_configs: int | None = None, timeout_s: float = 300.0,
                  backend: str = "triton", workers=None, plan: SearchPlan | None = None,
                  proposer=None, say=None) -> dict:
    """Start one case's search. On Ray (`workers.parallel`) it runs in a thread of this
    process and screens in Ray tasks, so the cases of a run are searched side by side, each
    case's configs timed on one GPU (their times are compared); otherwise it runs when
    finish_search asks for it, in a screening worker on this machine."""
    plan = plan or SearchPlan()
    if max_configs is not None:
        plan = replace(plan, trials=max_configs)
    parallel = workers is not None and workers.parallel

    def run() -> dict:
        session = RemoteSession(workers, family, case, device, timeout_s) if parallel \
            else ScreenSession(family, case, device, timeout_s)
        try:
            return CaseSearch(family, case, root, device, plan, session, backend,
                              proposer, say).run()
        finally:
            session.close()

    if not parallel:
        return {"run": run}
    if not _THREADS:
        _THREADS.append(ThreadPoolExecutor(max_workers=64, thread_name_prefix="search"))
    return {"future": _THREADS[0].submit(run)}


def finish_search(pending: dict) -> dict:
    """Wait for a submitted search; its log entry."""
    return pending["future"].result() if "future" in pending else pending["run"]()


def _median(entry: dict) -> float | None:
    return (entry.get("timing") or {}).get("median_ms")


class CaseSearch:
    """One case's search: the strategy's picks, timed one trial at a time in `session` (a
    codegen.screen session), or all at once where nothing depends on the times (the grid and
    random search without a proposer or a time budget)."""

    def __init__(self, family: Family, case: Case, root: Path, device: str, plan: SearchPlan,
                 session, backend: str = "triton", proposer=None, say=None,
                 until=None) -> None:
        """`until(entry)`: a reason to stop after a trial, or None (benchmarks stop a
        strategy once it has reached a target)."""
        self.family, self.case, self.device, self.plan = family, case, device, plan
        self.session, self.say, self.until = session, say or (lambda line: None), until
        self.folder = root / family.name / case_key(case)
        self.space = backend_configs(family, case, backend)
        interpreter = not device.startswith("cuda")
        self._recalled: dict | None = None
        memory, seeds = self._memory(), []
        if memory.get("configs"):
            seeds = [(c, "memory", memory["why"]) for c in memory.pop("configs")]
        seeds += [(c, "edited", "the user edited this file") for c in self.space
                  if user_edited(self._path(c)) and all(c != s[0] for s in seeds)]
        if not interpreter and not memory.get("used") and family.leads is not None:
            seeds += [(c, "guess", "the family's best guess")
                      for c in self.space[:family.leads(case)] if all(c != s[0] for s in seeds)]
        self.seeds = seeds
        name, trials = strategies.resolve(plan, len(self.space), interpreter,
                                          warm=memory.get("used", False))
        planned = backend_configs(family, case, backend, trials, interpreter) \
            if name == "grid" else None
        self.strategy = strategies.make(name, self.space, trials, plan.seed,
                                        [c for c, _, _ in seeds], planned)
        self.proposer = proposer if proposer is not None and name != "grid" \
            and plan.proposer_share > 0 else None
        self.started = time.monotonic()
        self.entry = {
            "family": family.name, "case": case, "case_key": case_key(case), "device": device,
            "backend": family_backend(family, backend), "baseline": None, "candidates": [],
            "search": {"strategy": name, "asked": plan.strategy, "space": len(self.space),
                       "budget_trials": self.strategy.budget, "budget_s": plan.seconds,
                       "seed": plan.seed, "memory": memory,
                       "rank_by": plan.rank_by,
                       "hybrid": self.proposer.label if self.proposer else None,
                       "proposer_share": plan.proposer_share if self.proposer else None}}
        if self.proposer:
            self.entry["proposals"] = []

    def _path(self, config: dict) -> Path:
        return self.folder / config_key(config) / "kernel.py"

    def _memory(self) -> dict:
        """What an earlier search of this case found (its configs still in the space)."""
        if self.plan.fresh:
            return {"used": False, "ignored": "--fresh-search"}
        from codegen import search_memory

        env = search_memory.environment(self.device)
        if env is None:
            return {"used": False}
        rec = search_memory.recall(self.family.name, case_key(self.case), env,
                                   warn=lambda line: self.say(f"warning: {line}"))
        configs = [b["config"] for b in (rec or {}).get("best", [])
                   if b.get("config") in self.space][:strategies.MEMORY_TOP]
        if not configs:
            return {"used": False}
        best = rec["best"][0]
        self._recalled = rec
        return {"used": True, "key": search_memory.memory_key(case_key(self.case), env),
                "configs": configs, "remembered": len(configs),
                "why": f"remembered: fastest {best.get('median_ms')} ms in a "
                       f"{rec.get('strategy')} search of {rec.get('trials')} trials "
                       f"({rec.get('updated')})"}

    def job(self, config: dict, strategy: str, trial: int, why: str | None = None) -> dict:
        """Render `config` (unless the user edited its file) as one trial's screen job."""
        path = self._path(config)
        origin = write_candidate(self.family, config, self.case, path)
        seed = next((s for s in self.seeds if s[0] == config), None)
        if strategy == "seed" and seed is not None:
            strategy, why = seed[1], seed[2]
        job = {"path": str(path), "config": config, "backend": config_backend(config),
               "origin": origin,
               # what was screened: a later edit makes a resumed run search the case again
               "sha1": hashlib.sha1(path.read_bytes()).hexdigest(), "source": SEARCH_SOURCE,
               "strategy": strategy, "trial": trial}
        return {**job, "why": why} if why else job

    def timed(self, jobs: list[dict]) -> list[dict]:
        """Screen and time `jobs`; their log entries, with the search's seconds so far."""
        entries = self.session.run(jobs)
        for e in entries:
            e["elapsed_s"] = round(time.monotonic() - self.started, 3)
        self.entry["candidates"].extend(entries)
        return entries

    def tell(self, entries: list[dict]) -> None:
        for e in entries:
            if e.get("config") is not None and e["config"] in self.space:
                self.strategy.tell(e["config"], _median(e))

    def reusable(self) -> dict | None:
        """The remembered fastest candidate, measured as it stands, where a warm case need not
        be timed again: a GPU run (the memory's key already holds the GPU, torch and Triton), a
        sampled or default strategy (an asked-for grid is exhaustive), the memory holding that
        candidate's timing and the case's baseline, and the config rendering today to the
        very source it timed (a changed family template is a new question)."""
        rec = self._recalled
        if rec is None or not self.device.startswith("cuda") or self.plan.strategy == "grid":
            return None
        best, base = rec["best"][0], rec.get("baseline") or {}
        if best.get("config") not in self.space or not (best.get("timing") or {}).get(
                "median_ms") or not base.get("median_ms") or not best.get("sha1"):
            return None
        path = self._path(best["config"])
        # write_candidate stamps the rendered source's sha1 beside it: no second hash
        if write_candidate(self.family, best["config"], self.case, path) != "generated" or \
                path.with_suffix(".rendered.sha1").read_text().strip() != best["sha1"]:
            return None
        return {"path": str(path), "config": best["config"],
                "backend": config_backend(best["config"]), "origin": "generated",
                "sha1": best["sha1"], "source": SEARCH_SOURCE, "strategy": "memory",
                "trial": 0, "screen": "pass", "timing": best["timing"],
                "host_us": best.get("host_us"), "graph_ms": best.get("graph_ms"),
                "why": f"reused, not timed again: {rec.get('strategy')} search of "
                       f"{rec.get('trials')} trials ({rec.get('updated')})",
                "elapsed_s": round(time.monotonic() - self.started, 3)}

    def run(self) -> dict:
        s, plan = self.strategy, self.plan
        trial, stopped = 0, "budget or space spent"
        reused = self.reusable()
        if reused is not None:
            self.entry["candidates"].append(reused)
            self.entry["baseline"] = self._recalled["baseline"]
            self.entry["search"].update(trials=0, stopped="reused the remembered best",
                                        elapsed_s=round(time.monotonic() - self.started, 3))
            rank_entries(self.entry)
            return self.entry
        if not s.adaptive and self.proposer is None and plan.seconds is None and \
                self.until is None:
            picks = s.planned_picks()
            self.tell(self.timed([self.job(c, why, i) for i, (c, why) in
                                  enumerate(picks, 1)]))
            trial = len(picks)
        while trial < s.budget:
            if plan.seconds is not None and time.monotonic() - self.started >= plan.seconds:
                stopped = f"time budget of {plan.seconds:g} s spent"
                break
            pick = s.suggest()
            if pick is None:
                break
            trial += 1
            if self.proposer is not None and proposer_turn(trial, plan.proposer_share):
                self.proposer.trial(self, pick, trial)  # codegen.hybrid
            else:
                self.tell(self.timed([self.job(pick[0], pick[1], trial)]))
            if self.until is not None and (reason := self.until(self.entry)):
                stopped = reason
                break
        self.entry["baseline"] = self.session.baseline
        self.entry["search"].update(trials=trial, stopped=stopped,
                                    elapsed_s=round(time.monotonic() - self.started, 3))
        rank_entries(self.entry)
        self._remember()
        return self.entry

    def _remember(self) -> None:
        """The fastest configs timed, for a later search (not timings that mean nothing)."""
        # in the ranking's order (rank_entries: by the graphed time where the plan asks)
        by_path = {e.get("path"): e for e in self.entry["candidates"]}
        timed = [e for e in (by_path[p] for p in self.entry.get("order") or [])
                 if _median(e) is not None and e.get("config") in self.space
                 and e["timing"].get("meaningful")]
        # the timing as a whole and the baseline beside it: a warm GPU run can take the best
        # as measured (`reusable`)
        best = [{"config": e["config"], "median_ms": _median(e), "strategy": e["strategy"],
                 "timing": e["timing"], "host_us": e.get("host_us"),
                 "graph_ms": e.get("graph_ms"), "sha1": e.get("sha1")}
                for e in timed[:strategies.MEMORY_TOP]]
        if not best:
            return
        from codegen import search_memory

        env = search_memory.environment(self.device)
        if env is not None:
            search_memory.remember(self.family.name, self.case, case_key(self.case), env, best,
                                   self.entry["search"]["strategy"],
                                   self.entry["search"]["trials"],
                                   warn=lambda line: self.say(f"warning: {line}"),
                                   baseline=self.entry["baseline"])


def proposer_turn(trial: int, share: float) -> bool:
    """Whether trial `trial` (from 1) is the proposer's: `share` of the trials, spread evenly,
    never the first (there is nothing to show the proposer yet unless every trial is its)."""
    return int(trial * share + 1e-9) > int((trial - 1) * share + 1e-9)


def rank_entries(entry: dict) -> None:
    """Order screened candidates by median time and say why each was kept or discarded; by
    the time inside a CUDA graph where the search asks for it (SearchPlan.rank_by) and every
    timed candidate has one."""
    timed = [e for e in entry["candidates"] if e.get("timing")]
    if (entry.get("search") or {}).get("rank_by") == "graph" \
            and all(e.get("graph_ms") for e in timed):
        timed.sort(key=lambda e: e["graph_ms"])
    else:
        timed.sort(key=lambda e: e["timing"]["median_ms"])
    for e in entry["candidates"]:
        e["decision"] = f"discarded: {e['screen']}"
    for rank, e in enumerate(timed):
        e["decision"] = "best" if rank == 0 else "slower than best"
    entry["order"] = [e["path"] for e in timed]

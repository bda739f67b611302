"""The hybrid search: a proposer takes a share of a sampled search's trials.

The scheme is the "Centaur" of arXiv 2603.24647: the optimiser (here random search or TPE,
codegen.strategies) runs every trial, and on a share of them (`--proposer-share`, default 0.3,
spread evenly: codegen.search.proposer_turn) a proposer sees the optimiser's state and proposes
instead. The study found a share of about 0.3 best, and 0.8 worse than none.

A proposer trial writes a task folder, `proposals/<family>/<case>/trial<N>/`, holding what
codegen.proposal_task writes for any proposer (task.json, reference.py, best.py, out/) plus, in
task.json, `optimiser`: the configs of the space, every config tried so far with its time (or
why it failed) and the strategy that picked it, the best so far, and the optimiser's own next
pick (`suggestion`, what TPE's model or the random order would try now). The proposer (any
command, run as `CMD <folder>`, or the built-in language model) answers with files in out/:
`*.json`, a config of the space, which is rendered and timed like the optimiser's picks and
told to the optimiser; `*.py`, a new kernel source, screened and timed like any candidate (and,
from the language model, verified at once, as its rounds are: codegen.llm_proposer). Where the
proposer leaves nothing that can run (no file, a config outside the space or already timed),
the optimiser's suggestion runs in its place, so the trial is not lost.

The search log keeps each proposer trial (`proposals`): its source, status, seconds, the
suggestion, and per proposal its file, kind, config, verdict and time.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

from codegen.search import rank_entries
from core.artifacts import write_json, write_text

MAX_SHOWN = 40  # tried configs listed in the task (the space is at most a few dozen)
_JSON = re.compile(r"```[ \t]*json[ \t]*\n(.*?)```", re.S)


class Proposer:
    """What a proposer trial asks of a proposer: `ask(task) -> status`, having left its
    proposals in the task's out/; `label`, the log's source; `verify_sources`, whether its
    kernel files are verified as soon as they are timed."""

    label = "proposer"
    verify_sources = False
    record: dict | None = None

    def ask(self, task: Path) -> str:
        raise NotImplementedError

    def trial(self, search, suggestion: tuple[dict, str], trial: int) -> None:
        proposer_trial(self, search, suggestion, trial)


class CommandProposer(Proposer):
    """An external program, run as `CMD <task folder>` (codegen/proposer.py's contract)."""

    verify_sources = False  # the verify stage verifies what it ranks, as for `--proposer CMD`

    def __init__(self, cmd: str, timeout_s: float = 600.0) -> None:
        from codegen.proposer import source_label

        self.cmd, self.timeout_s, self.label = cmd, timeout_s, source_label(cmd)

    def ask(self, task: Path) -> str:
        from codegen.proposer import run_command

        return run_command(self.cmd, task, self.timeout_s)[:300]


class LLMProposer(Proposer):
    """The built-in language-model proposer (codegen.llm_proposer) on one trial at a time: one
    request per proposer trial, within its wall budget; after an endpoint failure it is not
    asked again this run (the optimiser's suggestions run instead)."""

    verify_sources = True

    def __init__(self, run_dir: Path, options=None, client=None) -> None:
        from codegen.llm_proposer import _endpoint, load_options

        self.options = (options or load_options(run_dir)).resolved()
        self.client, self.started, self.stopped = client, time.monotonic(), None
        self.label = f"llm {self.options.model}"
        self.record = {"model": self.options.model, "endpoint": _endpoint(), "mode": "hybrid",
                       "budgets": {"max_tokens_per_reply": self.options.max_tokens,
                                   "timeout_s_per_request": self.options.timeout_s,
                                   "wall_s": self.options.wall_s},
                       "events": [], "tokens_used": 0}

    def _event(self, line: str) -> str:
        from codegen.llm_proposer import _mask

        self.record["events"].append(_mask(line))
        return line

    def ask(self, task: Path) -> str:
        from codegen import llm_proposer as llm

        if self.stopped:
            return f"not asked: {self.stopped}"
        if time.monotonic() - self.started > self.options.wall_s:
            self.stopped = "wall budget spent"
            return self._event(f"llm proposer: wall budget of {self.options.wall_s:g} s "
                               f"spent; the optimiser runs the remaining trials")
        self.client = self.client or llm._client(self.options)
        messages = prompt(task)
        write_json(task / "prompt.json", {"messages": messages})
        try:
            text, tokens = llm.ask(self.client, self.options, messages)
        except llm.EndpointFailure as e:
            self.stopped = str(e)
            return self._event(f"llm proposer: {self.options.model} at {llm._endpoint()} "
                               f"failed: {e}; the optimiser runs the remaining trials")
        self.record["tokens_used"] += tokens
        write_text(task / "reply.md", llm._mask(text))
        trial = int(task.name.removeprefix("trial"))
        llm.write_round(task, trial, llm.extract(text))
        for i, block in enumerate(_JSON.findall(text), 1):
            write_text(task / "out" / f"r{trial}_config{i}.json", block)
        return f"answered ({tokens} tokens)"


def prompt(task: Path) -> list[dict]:
    """The language model's request: codegen.llm_proposer's prompt for the case, and the
    optimiser's state with the two ways to answer."""
    from codegen.llm_proposer import _mask
    from codegen.llm_proposer import prompt as case_prompt

    spec = json.loads((task / "task.json").read_text())
    opt = spec["optimiser"]
    messages = case_prompt(task, [], opt["trial"], opt["budget_trials"])
    messages[1]["content"] += _mask(
        "\n\nA search over the family's parameter space is running; this trial is yours. Its "
        "state (the space, every config timed so far with its time in ms, the best, and the "
        "config its " + opt["strategy"] + " optimiser would try next):\n```json\n"
        + json.dumps({k: opt[k] for k in ("space", "tried", "best", "suggestion")}, indent=1)
        + "\n```\nAnswer with a config of the space you expect to be faster than the best, "
        "as one ```json block holding that object exactly as the space lists it, or with a "
        "new kernel file in a ```python block, or both.")
    return messages


def optimiser_state(search, suggestion: tuple[dict, str], trial: int) -> dict:
    """What a proposer trial shows of the search (codegen.search.CaseSearch)."""
    tried = [{"config": e.get("config"), "file": Path(e["path"]).name
              if e.get("config") is None else None,
              "median_ms": (e.get("timing") or {}).get("median_ms"),
              "screen": e.get("screen"), "strategy": e.get("strategy")}
             for e in search.entry["candidates"]]
    timed = sorted((t for t in tried if t["median_ms"] is not None),
                   key=lambda t: t["median_ms"])
    state = {"strategy": search.strategy.name, "trial": trial,
             "budget_trials": search.strategy.budget, "space": search.space,
             "tried": tried[-MAX_SHOWN:], "best": timed[:5],
             "suggestion": {"config": suggestion[0], "picked_by": suggestion[1]}}
    model = getattr(search.strategy, "state", None)
    if model is not None:
        state["model"] = model()
    return state


def read_proposals(task: Path) -> tuple[list[tuple[Path, dict | None, str | None]], list[Path]]:
    """The configs (each with its problem, None when it parses) and sources in out/."""
    configs = []
    for p in sorted((task / "out").glob("*.json")):
        try:
            config = json.loads(p.read_text())
            problem = None if isinstance(config, dict) else "not a JSON object"
        except (OSError, ValueError) as e:
            config, problem = None, f"unreadable: {type(e).__name__}"
        configs.append((p, config if problem is None else None, problem))
    return configs, sorted((task / "out").glob("*.py"))


def proposer_trial(proposer: Proposer, search, suggestion: tuple[dict, str],
                   trial: int) -> None:
    """One trial of `search` (codegen.search.CaseSearch) that `proposer` takes; logged in
    `search.entry["proposals"]`."""
    entry = search.entry
    rank_entries(entry)  # best.py and the best so far
    run_dir = search.folder.parents[2]  # <run>/candidates/<family>/<case>
    task = run_dir / "proposals" / entry["family"] / entry["case_key"] / f"trial{trial:02d}"
    from codegen.proposal_task import write_task

    write_task(run_dir, entry, folder=task,
               extra={"optimiser": optimiser_state(search, suggestion, trial)})
    t0 = time.monotonic()
    status = proposer.ask(task)
    record = {"trial": trial, "source": proposer.label, "task": str(task), "status": status,
              "seconds": round(time.monotonic() - t0, 3), "suggestion": suggestion[0],
              "proposals": []}
    configs, sources = read_proposals(task)
    jobs, shown = [], []
    for path, config, problem in configs:
        if problem is None and config not in search.space:
            problem = "not in the search space"
        elif problem is None and search.strategy.tried(config):
            problem = "already timed"
        if problem is None:
            jobs.append({**search.job(config, "proposer", trial),
                         "source": proposer.label, "proposal": path.name})
        shown.append({"file": path.name, "kind": "config", "config": config,
                      "verdict": problem})
    for path in sources:
        jobs.append({"path": str(path), "config": None, "origin": "proposer",
                     "source": proposer.label, "strategy": "proposer", "trial": trial,
                     "proposal": path.name})
        shown.append({"file": path.name, "kind": "kernel", "config": None, "verdict": None})
    if jobs:
        entries = search.timed(jobs)
        if proposer.verify_sources:
            from codegen.llm_proposer import verify_screened

            kernels = [e for e in entries if e.get("config") is None]
            verify_screened(search.family, entry, kernels, search.device, run_dir)
        search.tell(entries)
        by_file = {e["proposal"]: e for e in entries}
        for s in shown:
            e = by_file.get(s["file"])
            if e is not None:
                s["verdict"], s["median_ms"] = e["screen"], (e.get("timing") or {}).get(
                    "median_ms")
    else:
        config = suggestion[0]
        record["fallback"] = "the proposer left nothing to run; the optimiser's suggestion ran"
        search.tell(search.timed([search.job(config, suggestion[1], trial,
                                             why=record["fallback"])]))
    record["proposals"] = shown
    entry["proposals"].append(record)
    search.say(f"proposer trial {trial} on {entry['family']}/{entry['case_key']}: {status}, "
               f"{len(jobs)} proposal(s) timed")


def make_proposer(cmd: str | None, run_dir: Path):
    """The proposer a hybrid search asks: `cmd` "llm" for the built-in one; None without."""
    if not cmd:
        return None
    if cmd.strip() == "llm":
        return LLMProposer(run_dir)
    return CommandProposer(cmd)

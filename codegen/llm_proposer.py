"""The built-in proposer: a language model behind an OpenAI-compatible chat-completions endpoint.

`--proposer llm` selects it (codegen.proposer dispatches). It uses the official `openai` client,
so OPENAI_BASE_URL and OPENAI_API_KEY mean what they mean to that client (a local vLLM,
llama.cpp or Ollama server needs no key: a placeholder is sent when none is set). The model
comes from the options (`--llm-model`) or PIPELINE_LLM_MODEL.

For every searched (family, case) it writes the proposer task folder
(codegen.proposal_task.write_task) and runs up to `rounds` rounds. A round sends one prompt
(the contract, reference.py, the case, best.py with its time against the roofline and the
copy bandwidth, and what was rejected so far with the checks it failed and their figures) and
reads every fenced code block of the reply as
one candidate, `out/r<round>_<n>.py`. Each is screened and timed like a generated candidate
(codegen.search.screen_and_time: a spawned worker process) and, unless it failed to load,
verified by verify.harness.verify_candidate (the isolated worker, records under verification/);
the rejected ones, with the checks they failed, go into the next round's prompt. Proposed code
is never imported into this process.

Parameter space: a proposal may start with one header line
`# SPACE: {"BLOCK": [64, 128], "NUM_WARPS": [4, 8]}` (a JSON object of lists), naming
module-level constants of the file (`BLOCK = 64`). Each point of the product (at most
MAX_POINTS, spread evenly) is rendered by rewriting those assignments and becomes its own
candidate `out/r<round>_<n>_<point>.py`, swept like a config of the conventional search.

Failure of the endpoint (unreachable, timeout, HTTP error, a malformed reply, a reply with no
code) is one line through `say` and in the search log's `llm.events`; the proposer then stops
asking and the run goes on with what the conventional search found. Budgets: rounds per case,
tokens per reply, seconds per request and seconds in all; they and the tokens used are recorded
in the search log (`llm`). Each answered round is recorded in `<task>/rounds.json` (atomically,
with the entries of its candidates), so `--resume` replays it instead of asking again.

The API key is never written: not to the log, the prompts kept in the task folder, nor the
error lines (any occurrence of it is masked).
"""

from __future__ import annotations

import itertools
import json
import os
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from codegen.proposal_task import record_name, write_task
from codegen.registry import get_family
from codegen.search import rank_entries, screen_and_time, spread
from core.artifacts import read_json, write_json, write_text
from core.errors import UserError

MODEL_ENV = "PIPELINE_LLM_MODEL"
OPTIONS_FILE = "llm_options.json"  # under proposals/: the options the CLI gave this run
MAX_POINTS = 8
MAX_FEEDBACK = 8
_CODE = re.compile(r"```[ \t]*(?:python|py)?[ \t]*\n(.*?)```", re.S)
_SPACE = re.compile(r"^#\s*SPACE:\s*(\{.*\})\s*$", re.M)

SYSTEM = ("You write one GPU kernel at a time in Python with Triton (triton, triton.language "
          "as tl) and torch. Reply with one or more complete candidate files, each in its own "
          "```python fenced block, and nothing the file needs outside it.")


@dataclass
class LLMOptions:
    model: str | None = None
    rounds: int = 3
    max_tokens: int = 8192
    timeout_s: float = 300.0
    wall_s: float = 3600.0

    def resolved(self) -> LLMOptions:
        model = self.model or os.environ.get(MODEL_ENV)
        if not model:
            raise UserError(f"--proposer llm needs a model: pass --llm-model NAME or set "
                            f"{MODEL_ENV}")
        if self.rounds < 1 or self.max_tokens < 1 or self.timeout_s <= 0 or self.wall_s <= 0:
            raise UserError("--llm-rounds, --llm-max-tokens, --llm-timeout and --llm-wall "
                            "must be positive")
        return LLMOptions(model, self.rounds, self.max_tokens, self.timeout_s, self.wall_s)


def save_options(run_dir: Path, options: LLMOptions) -> Path:
    """What the CLI hands the proposer stage (run_optimize passes only the proposer's name)."""
    return write_json(Path(run_dir) / "proposals" / OPTIONS_FILE, asdict(options.resolved()))


def load_options(run_dir: Path) -> LLMOptions:
    path = Path(run_dir) / "proposals" / OPTIONS_FILE
    if not path.exists():
        return LLMOptions().resolved()
    data = read_json(path, "llm options")
    return LLMOptions(**{k: data[k] for k in asdict(LLMOptions()) if k in data}).resolved()


class EndpointFailure(Exception):
    """The endpoint gave no usable reply; the message is the one line the user sees."""


def _mask(text: str) -> str:
    key = os.environ.get("OPENAI_API_KEY")
    return text.replace(key, "***") if key else text


def _endpoint() -> str:
    """The base URL without any user:password part (that part may hold a credential)."""
    url = urlsplit(os.environ.get("OPENAI_BASE_URL") or "https://api.openai.com/v1")
    host = url.hostname or ""
    netloc = host + (f":{url.port}" if url.port else "")
    return urlunsplit((url.scheme, netloc, url.path, "", ""))


def _client(options: LLMOptions):
    try:
        import openai
    except ImportError as e:
        raise UserError("--proposer llm needs the openai package: pip install "
                        "'kernel-pipeline[llm]' (or pip install openai)") from e
    # max_retries=0: a failure is reported once and the run goes on without the proposer
    return openai.OpenAI(api_key=os.environ.get("OPENAI_API_KEY") or "not-set",
                         timeout=options.timeout_s, max_retries=0)


def ask(client, options: LLMOptions, messages: list[dict]) -> tuple[str, int]:
    """The reply's text and the tokens it cost; EndpointFailure on anything unusable."""
    try:
        reply = client.chat.completions.create(model=options.model, messages=messages,
                                               max_tokens=options.max_tokens)
        text = reply.choices[0].message.content
    except Exception as e:  # noqa: BLE001 - any client failure is one line, not a crash
        first = (str(e).splitlines() or [""])[0][:200]
        raise EndpointFailure(f"{type(e).__name__}: {first}") from e
    if not isinstance(text, str):
        raise EndpointFailure("malformed reply: no message content")
    usage = getattr(reply, "usage", None)
    return text, int(getattr(usage, "total_tokens", 0) or 0)


def extract(text: str) -> list[str]:
    """Every fenced code block that defines `forward`."""
    return [b.strip() + "\n" for b in _CODE.findall(text) if "def forward" in b]


def space_points(source: str) -> list[dict]:
    """The points of the declared parameter space ([] when none, or when it is not a JSON
    object of non-empty lists)."""
    m = _SPACE.search(source)
    if not m:
        return []
    try:
        space = json.loads(m.group(1))
    except json.JSONDecodeError:
        return []
    if not isinstance(space, dict) or not space or not all(
            isinstance(v, list) and v and re.fullmatch(r"[A-Za-z_]\w*", k)
            for k, v in space.items()):
        return []
    names = sorted(space)
    points = [dict(zip(names, values, strict=True)) for values in itertools.product(*(space[n]
                                                                         for n in names))]
    return spread(points, MAX_POINTS)


def render_point(source: str, point: dict) -> str | None:
    """`source` with each named module-level constant set to the point's value; None when a
    name has no such assignment (the point cannot be rendered)."""
    for name, value in point.items():
        source, n = re.subn(rf"^{name}\s*(:\s*[\w.]+\s*)?=.*$", f"{name} = {value!r}", source,
                            count=1, flags=re.M)
        if n == 0:
            return None
    return source


def _point_key(point: dict) -> str:
    return "_".join(f"{k}{v}" for k, v in sorted(point.items()))


def write_round(task: Path, rnd: int, sources: list[str]) -> list[dict]:
    """Candidate files of one round: each proposal, or each point of its space."""
    jobs = []
    for i, src in enumerate(sources, 1):
        points = space_points(src)
        rendered = [(f"r{rnd}_{i}_{_point_key(p)}", render_point(src, p), p) for p in points]
        rendered = [r for r in rendered if r[1] is not None] or [(f"r{rnd}_{i}", src, None)]
        for stem, text, point in rendered:
            path = task / "out" / f"{stem}.py"
            write_text(path, text)
            jobs.append({"path": str(path), "config": point, "origin": "proposer",
                         "proposal": i})
    return jobs


def judge(fam, search: dict, jobs: list[dict], device: str, run_dir: Path) -> list[dict]:
    """Screen and time in the search's worker, then verify in the isolated worker everything
    that loaded and ran; a candidate verification rejects is discarded with its reasons."""
    _, entries = screen_and_time(fam, search["case"], jobs, device)
    return verify_screened(fam, search, entries, device, run_dir)


def verify_screened(fam, search: dict, entries: list[dict], device: str,
                    run_dir: Path) -> list[dict]:
    """Verify every screened entry that loaded and ran (judge's second half)."""
    from verify.harness import verify_candidate

    for e in entries:
        if e["screen"] not in ("pass", "wrong result"):
            continue
        res = verify_candidate(fam, e["path"], [search["case"]], device=device,
                               record_dir=run_dir, timing=False,
                               candidate=record_name(search["case_key"], e["path"]))
        e["verification"] = {"verdict": res.verdict, "reasons": res.reasons[:4],
                             "record": res.record_path}
        if not res.accepted and e["screen"] == "pass":
            # kept out of the ranking (rank_entries orders what has a timing), so the verify
            # stage does not judge it again; its screen time stays on record
            e["screen_timing"] = e.pop("timing", None)
            e["screen"] = "rejected by verification: " + (res.reasons[0] if res.reasons
                                                          else res.verdict)
    return entries


def rejected(entries: list[dict]) -> list[dict]:
    return [e for e in entries
            if e["screen"] != "pass" or (e.get("verification") or {}).get("verdict")
            == "rejected"]


def _figures(e: dict, rnd: int) -> str:
    """What a rejected candidate failed, for the next prompt."""
    v = e.get("verification") or {}
    said = "passed the screen, rejected by verification" if e["screen"].startswith(
        "rejected by verification") else f"screen: {e['screen']}"
    lines = [f"- round {rnd}, {Path(e['path']).name}: {said}"]
    lines += [f"  failed check {r}" for r in v.get("reasons") or []]
    if e.get("trace") and e["screen"].startswith("error"):
        lines.append("  traceback tail:\n" + "\n".join("    " + t for t in
                                                       e["trace"].strip().splitlines()[-6:]))
    return "\n".join(lines)


def _earlier_records(task_spec: dict, case_key: str, task: Path) -> list[str]:
    """Failed verification records of this case not made by this proposer's rounds (whose
    feedback comes from rounds.json): generated configs, an external proposer's files."""
    out = []
    for p in task_spec.get("verification_records") or []:
        if not Path(p).name.startswith(f"{case_key}__"):
            continue
        try:
            rec = read_json(p, "verification record")
        except UserError:
            continue
        if re.fullmatch(r"r\d+_.*\.py", Path(rec.get("source", "")).name) and \
                Path(rec["source"]).parent == task / "out":
            continue
        if rec.get("verdict") == "rejected":
            out.append(f"- {Path(rec.get('source', p)).name} (earlier): "
                       + "; ".join(rec.get("reasons") or ["rejected"])[:600])
    return out[:MAX_FEEDBACK]


def prompt(task: Path, feedback: list[str], rnd: int, rounds: int) -> list[dict]:
    spec = json.loads((task / "task.json").read_text())
    best = spec.get("best") or {}
    t = best.get("timing") or {}
    copy = spec.get("copy_GBps")
    roofline = ""
    if t.get("median_ms") and spec.get("min_bytes"):
        floor_ms = spec["min_bytes"] / (copy * 1e9) * 1e3 if copy else None
        roofline = (f"It takes {t['median_ms']:.4f} ms ({t.get('gbps') or 0:.1f} GB/s) for "
                    f"{spec['min_bytes']} bytes that must move"
                    + (f"; the copy bandwidth is {copy:.0f} GB/s, so the floor is "
                       f"{floor_ms:.4f} ms" if floor_ms else "") + ".")
        base = (spec.get("baseline") or {}).get("median_ms")
        if base:
            roofline += f" The code it replaces (the reference) takes {base:.4f} ms."
    if t and not t.get("meaningful", True):
        roofline += " (These timings come from the CPU interpreter and mean nothing.)"
    best_src = (task / "best.py").read_text() if (task / "best.py").is_file() else ""
    parts = [
        f"Round {rnd} of {rounds}. Write a faster correct Triton kernel for this case.",
        "Contract: " + spec["contract"],
        "Case (shapes, dtype, params):\n```json\n" + json.dumps(spec["case"], indent=1)
        + "\n```",
        "reference.py (what the candidate must compute, bit for bit where the dtype allows):"
        "\n```python\n" + (task / "reference.py").read_text() + "```",
    ]
    if best_src:
        parts.append("The current best candidate (best.py). " + roofline
                     + "\n```python\n" + best_src + "```")
    parts.append("A file may declare a small parameter space in its first line, e.g. "
                 '`# SPACE: {"BLOCK": [64, 128]}`, naming module-level constants it assigns '
                 "(`BLOCK = 64`); every point is rendered and timed.")
    if feedback:
        parts.append("Rejected so far (do not repeat these mistakes):\n"
                     + "\n".join(feedback[-MAX_FEEDBACK:]))
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": _mask("\n\n".join(parts))}]


def _known(search: dict) -> set[str]:
    return {e["path"] for e in search["candidates"]}


def run_llm_proposer(run_dir: Path, log: dict, device: str, say: Callable[[str], None],
                     options: LLMOptions | None = None, client=None) -> dict:
    """Up to `options.rounds` rounds for every searched case; candidates join the search log
    with their source ("llm <model> round N"). `client`: an openai.OpenAI-like object."""
    options = (options or load_options(run_dir)).resolved()
    started = time.monotonic()
    rec = log.setdefault("llm", {})
    rec.update({"model": options.model, "endpoint": _endpoint(),
                "budgets": {"rounds_per_case": options.rounds,
                            "max_tokens_per_reply": options.max_tokens,
                            "timeout_s_per_request": options.timeout_s,
                            "wall_s": options.wall_s}})
    rec.setdefault("events", [])
    rec.setdefault("tokens_used", 0)
    stopped = None

    def event(line: str) -> None:
        line = _mask(line)
        rec["events"].append(line)
        say(line)

    for search in log["searches"]:
        if not search.get("case_key") or (search.get("search") or {}).get("hybrid"):
            continue  # no call to replace, or the proposer took part in the search
        fam = get_family(search["family"])
        task = write_task(run_dir, search)
        state_path = task / "rounds.json"
        state = read_json(state_path, "llm rounds") if state_path.exists() else {"rounds": []}
        spec = json.loads((task / "task.json").read_text())
        feedback = _earlier_records(spec, search["case_key"], task)
        for rnd in range(1, options.rounds + 1):
            label = f"llm {options.model} round {rnd}"
            done = next((r for r in state["rounds"] if r["round"] == rnd), None)
            if done is None:
                if stopped:
                    break
                if time.monotonic() - started > options.wall_s:
                    stopped = "wall budget"
                    event(f"llm proposer: wall budget of {options.wall_s:g} s spent; "
                          f"no more rounds asked")
                    break
                client = client or _client(options)
                say(f"llm round {rnd} on {search['family']}/{search['case_key']}")
                messages = prompt(task, feedback, rnd, options.rounds)
                write_json(task / f"prompt_r{rnd}.json", {"messages": messages})
                try:
                    text, tokens = ask(client, options, messages)
                    sources = extract(text)
                    if not sources:
                        raise EndpointFailure("reply holds no fenced code block defining "
                                              "forward")
                except EndpointFailure as e:
                    stopped = str(e)
                    event(f"llm proposer: {options.model} at {_endpoint()} failed on "
                          f"{search['family']}/{search['case_key']} round {rnd}: {e}; "
                          f"going on with the conventional search")
                    break
                rec["tokens_used"] += tokens
                write_text(task / f"reply_r{rnd}.md", _mask(text))
                jobs = [{**j, "source": label, "round": rnd}
                        for j in write_round(task, rnd, sources)]
                entries = judge(fam, search, jobs, device, run_dir)
                done = {"round": rnd, "model": options.model, "tokens": tokens,
                        "entries": entries}
                state["rounds"].append(done)
                write_json(state_path, state)  # answered: --resume replays it
            new = [e for e in done["entries"] if e["path"] not in _known(search)]
            if new:
                search["candidates"].extend(new)
                rank_entries(search)
                write_json(run_dir / "candidates" / "search_log.json", log)
            for e in rejected(done["entries"]):
                feedback.append(_figures(e, rnd))
    write_json(run_dir / "candidates" / "search_log.json", log)
    return log

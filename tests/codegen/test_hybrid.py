"""The hybrid search (codegen/hybrid.py): a proposer takes its share of a TPE search's trials,
sees the search's state in its task folder, and each proposal is timed, told to the optimiser
and logged with its source, verdict and time. Times are synthetic (cost_session.py); the
proposers are a real subprocess (fake_trial_proposer.py) and a stand-in language-model
client."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from cost_session import CostSession

from codegen.hybrid import CommandProposer, LLMProposer
from codegen.llm_proposer import LLMOptions
from codegen.matmul_epilogue import FAMILY as EPILOGUE
from codegen.matmul_epilogue.reference import make_case as epilogue_case
from codegen.search import CaseSearch
from codegen.strategies import SearchPlan

CASE = epilogue_case(8192, 2048, 8192, "bfloat16", "silu")
SPACE = EPILOGUE.search_space(CASE)
PROPOSER = Path(__file__).with_name("fake_trial_proposer.py")


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def _hybrid(run_dir, proposer, trials=10, share=0.3, said=None):
    plan = SearchPlan("tpe", trials=trials, seed=0, proposer_share=share)
    return CaseSearch(EPILOGUE, CASE, run_dir / "candidates", "cpu", plan, CostSession(),
                      proposer=proposer, say=said.append if said is not None else None).run()


def test_the_proposer_takes_its_share_of_the_trials_and_each_proposal_is_logged(tmp_path):
    said: list[str] = []
    entry = _hybrid(tmp_path, CommandProposer(f"{sys.executable} {PROPOSER}"), said=said)
    calls = entry["proposals"]
    assert [c["trial"] for c in calls] == [4, 7, 10]  # 0.3 of 10 trials, spread
    assert entry["search"]["hybrid"] == "proposer fake_trial_proposer.py"
    assert entry["search"]["proposer_share"] == 0.3 and entry["search"]["trials"] == 10
    for c in calls:
        assert c["source"] == "proposer fake_trial_proposer.py" and c["status"] == "exit 0"
        assert c["seconds"] > 0 and c["suggestion"] in SPACE
        assert c["proposals"] and all(p["verdict"] == "pass" and p["median_ms"] > 0
                                      for p in c["proposals"])
    first = {p["file"]: p for p in calls[0]["proposals"]}
    assert set(first) == {"next.json", "fast.py"}
    assert first["next.json"]["kind"] == "config" and first["fast.py"]["kind"] == "kernel"
    assert first["fast.py"]["median_ms"] == 0.5
    # the proposals are candidates like any other, and the kernel file is the fastest
    proposed = [c for c in entry["candidates"] if c["strategy"] == "proposer"]
    assert {c["trial"] for c in proposed} == {4, 7, 10}
    assert all(c["source"] == "proposer fake_trial_proposer.py" for c in proposed)
    assert entry["order"][0].endswith("trial04/out/fast.py")
    # the optimiser was told the proposed configs: no config was timed twice
    configs = [json.dumps(c["config"], sort_keys=True) for c in entry["candidates"]
               if c["config"] is not None]
    assert len(configs) == len(set(configs)) == 10  # 7 picked by TPE, 3 proposed
    assert sum("proposer trial" in s for s in said) == 3


def test_the_task_folder_holds_the_optimisers_state(tmp_path):
    _hybrid(tmp_path, CommandProposer(f"{sys.executable} {PROPOSER}"))
    task = tmp_path / "proposals" / "matmul_epilogue"
    (case_dir,) = task.iterdir()
    assert sorted(p.name for p in case_dir.iterdir()) == ["trial04", "trial07", "trial10"]
    spec = json.loads((case_dir / "trial04" / "task.json").read_text())
    opt = spec["optimiser"]
    assert opt["strategy"] == "tpe" and opt["trial"] == 4 and opt["budget_trials"] == 10
    assert opt["space"] == SPACE and len(opt["tried"]) == 3
    assert opt["suggestion"]["config"] in SPACE and opt["suggestion"]["picked_by"] == "tpe"
    times = [b["median_ms"] for b in opt["best"]]
    assert times == sorted(times) and len(times) == 3
    assert opt["model"]["sampler"] == "optuna TPESampler"
    assert (case_dir / "trial04" / "best.py").is_file() and spec["best"]["timing"]
    saw = json.loads((case_dir / "trial04" / "proposer_saw.json").read_text())
    assert saw["argv"][-1] == str(case_dir / "trial04")


def test_nothing_usable_runs_the_optimisers_suggestion(tmp_path):
    entry = _hybrid(tmp_path, CommandProposer(f"{sys.executable} {PROPOSER} --nothing"),
                    trials=4, share=0.5)
    calls = entry["proposals"]
    assert [c["trial"] for c in calls] == [2, 4]
    for c in calls:
        verdicts = {p["file"]: p["verdict"] for p in c["proposals"]}
        assert verdicts["outside.json"] == "not in the search space"
        assert verdicts["broken.json"].startswith("unreadable")
        assert "nothing to run" in c["fallback"]
    ran = [c for c in entry["candidates"] if c["trial"] in (2, 4)]
    assert len(ran) == 2 and all(c["config"] == p["suggestion"] for c, p in zip(ran, calls))
    assert all("the proposer left nothing to run" in c["why"] for c in ran)
    assert len(entry["candidates"]) == 4


def test_a_proposer_that_fails_costs_its_trials_nothing(tmp_path):
    entry = _hybrid(tmp_path, CommandProposer("/nonexistent/proposer"), trials=4, share=0.5)
    assert all(c["status"].startswith("failed: FileNotFoundError") for c in entry["proposals"])
    assert len(entry["candidates"]) == 4


def _client(replies: list):
    def create(**kwargs):
        create.calls.append(kwargs)
        reply = replies.pop(0)
        if isinstance(reply, Exception):
            raise reply
        return SimpleNamespace(choices=[SimpleNamespace(message=SimpleNamespace(content=reply))],
                               usage=SimpleNamespace(total_tokens=100))

    create.calls = []
    return SimpleNamespace(chat=SimpleNamespace(completions=SimpleNamespace(create=create)))


def test_the_language_model_takes_its_trials_from_the_optimisers_state(tmp_path):
    untried = SPACE[-1]
    client = _client([f"Try this:\n```json\n{json.dumps(untried)}\n```\n",
                      RuntimeError("connection refused")])
    proposer = LLMProposer(tmp_path, LLMOptions(model="stand-in"), client=client)
    entry = _hybrid(tmp_path, proposer)
    first, second, third = entry["proposals"]
    assert first["source"] == "llm stand-in" and first["status"] == "answered (100 tokens)"
    assert first["proposals"][0]["config"] == untried and first["proposals"][0]["verdict"] \
        == "pass"
    sent = client.chat.completions.create.calls[0]["messages"][1]["content"]
    assert "this trial is yours" in sent and '"suggestion"' in sent
    # a failed endpoint is one event and not asked again: the optimiser runs those trials
    assert second["status"].startswith("llm proposer: stand-in at")
    assert third["status"].startswith("not asked") and "fallback" in third
    assert len(client.chat.completions.create.calls) == 2
    assert proposer.record["tokens_used"] == 100 and len(proposer.record["events"]) == 1
    assert len(entry["candidates"]) == 10


def test_a_proposals_record_name_tells_its_trial_apart():
    """The same file name from two proposer trials gets two verification records."""
    from codegen.proposal_task import record_name

    base = "/run/proposals/rmsnorm/case"
    assert record_name("case", "/run/candidates/rmsnorm/case/BLOCK64/kernel.py") == \
        "case__BLOCK64"
    assert record_name("case", f"{base}/out/good.py") == "case__out_good"
    assert record_name("case", f"{base}/trial04/out/good.py") == "case__trial04_out_good"
    assert record_name("case", f"{base}/trial07/out/good.py") == "case__trial07_out_good"

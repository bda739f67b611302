"""The search's memory (codegen/search_memory.py): what a search found best starts the next
search of the same case, GPU and software; `--fresh-search` ignores it; a corrupt file is one
warning. Times are synthetic (cost_session.py); the cache lives in this test's folder."""

from __future__ import annotations

import json

import pytest
from cost_session import CostSession

from codegen import search_memory, strategies
from codegen.matmul_epilogue import FAMILY as EPILOGUE
from codegen.matmul_epilogue.reference import make_case as epilogue_case
from codegen.search import CaseSearch, case_key
from codegen.strategies import SearchPlan

CASE = epilogue_case(8192, 2048, 8192, "bfloat16", "silu")


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "kernel-pipeline" / "search"


def _search(root, plan, said=None):
    return CaseSearch(EPILOGUE, CASE, root, "cpu", plan, CostSession(),
                      say=(said.append if said is not None else None)).run()


def test_a_second_search_starts_from_the_first_ones_best(tmp_path, cache):
    first = _search(tmp_path / "a", SearchPlan("tpe", trials=8, seed=0))
    assert not first["search"]["memory"]["used"]
    path = cache / "matmul_epilogue.json"
    stored = json.loads(path.read_text())["entries"]
    (entry,) = stored.values()
    assert entry["case_key"] == case_key(CASE) and entry["device_name"].startswith("cpu")
    assert {"torch", "triton"} <= set(entry) and entry["trials"] == 8
    timed = sorted((c for c in first["candidates"] if c.get("timing")),
                   key=lambda c: c["timing"]["median_ms"])
    assert [b["config"] for b in entry["best"]] == [c["config"] for c in timed[:3]]

    second = _search(tmp_path / "b", SearchPlan("tpe", trials=8, seed=0))
    memory = second["search"]["memory"]
    assert memory["used"] and memory["remembered"] == strategies.MEMORY_TOP
    cands = second["candidates"]
    assert [c["strategy"] for c in cands[:3]] == ["memory"] * 3
    assert [c["config"] for c in cands[:3]] == [b["config"] for b in entry["best"]]
    assert all(c["why"].startswith("remembered: fastest") for c in cands[:3])
    # a warm case re-times what it remembers and tries a few more, not its whole budget
    assert len(cands) == strategies.MEMORY_TOP + strategies.WARM_EXTRA
    assert {c["strategy"] for c in cands[3:]} == {"tpe"}

    fresh = _search(tmp_path / "c", SearchPlan("tpe", trials=8, seed=0, fresh=True))
    assert fresh["search"]["memory"] == {"used": False, "ignored": "--fresh-search"}
    assert "memory" not in {c["strategy"] for c in fresh["candidates"]}
    assert len(fresh["candidates"]) == 8
    assert [c["config"] for c in fresh["candidates"]] == \
        [c["config"] for c in first["candidates"]], "the same seed, the same picks"


def test_memory_is_per_gpu_and_software(tmp_path, monkeypatch):
    _search(tmp_path / "a", SearchPlan("tpe", trials=4))
    real = search_memory.environment
    monkeypatch.setattr(search_memory, "environment",
                        lambda device: {**real(device), "triton": "0.0-other"})
    other = _search(tmp_path / "b", SearchPlan("tpe", trials=4))
    assert not other["search"]["memory"]["used"]
    assert len(json.loads((tmp_path / "cache" / "kernel-pipeline" / "search" /
                           "matmul_epilogue.json").read_text())["entries"]) == 2


def test_timings_that_mean_nothing_are_not_remembered(tmp_path, cache):
    session = CostSession()
    real = session.run
    session.run = lambda jobs: [{**e, "timing": {**e["timing"], "meaningful": False}}
                                for e in real(jobs)]
    CaseSearch(EPILOGUE, CASE, tmp_path, "cpu", SearchPlan("tpe", trials=3), session).run()
    assert not (cache / "matmul_epilogue.json").exists()


@pytest.mark.parametrize("text", ["{not json", '{"entries": [1, 2]}', '["a list"]'])
def test_a_corrupt_memory_file_is_one_warning(tmp_path, cache, text):
    cache.mkdir(parents=True)
    path = cache / "matmul_epilogue.json"
    path.write_text(text)
    said: list[str] = []
    first = _search(tmp_path / "a", SearchPlan("tpe", trials=4), said)
    second = _search(tmp_path / "b", SearchPlan("tpe", trials=4), said)
    warnings = [s for s in said if s.startswith("warning: search memory")]
    assert len(warnings) == 1 and str(path) in warnings[0] and "\n" not in warnings[0]
    assert not first["search"]["memory"]["used"] and len(first["candidates"]) == 4
    # the first search wrote a readable file in its place, which the second started from
    assert second["search"]["memory"]["used"]
    assert json.loads(path.read_text())["kind"] == "search memory"


def test_a_warm_gpu_case_takes_its_remembered_best_as_timed(tmp_path, cache, monkeypatch):
    """On a GPU the remembered best, rendering to the source it timed, is not searched again:
    no screen runs, its timing and the baseline stand. A changed source, an asked-for grid or
    --fresh-search searches as before."""
    monkeypatch.setattr(search_memory, "environment", lambda device: {
        "device_name": "fake H100", "torch": "t", "triton": "tr"})

    def search(root, plan):
        session = CostSession()
        entry = CaseSearch(EPILOGUE, CASE, root, "cuda", plan, session).run()
        return entry, session

    first, s1 = search(tmp_path / "a", SearchPlan("tpe", trials=6, seed=0))
    assert s1.jobs and not first["search"]["memory"]["used"]
    best = min((c for c in first["candidates"] if c.get("timing")),
               key=lambda c: c["timing"]["median_ms"])

    warm, s2 = search(tmp_path / "b", SearchPlan("tpe", trials=6, seed=0))
    assert s2.jobs == [], "nothing screened: the remembered best stands"
    (reused,) = warm["candidates"]
    assert reused["strategy"] == "memory" and reused["why"].startswith("reused")
    assert reused["config"] == best["config"] and reused["timing"] == best["timing"]
    assert warm["baseline"] == s1.baseline and warm["order"] == [reused["path"]]
    assert warm["search"]["trials"] == 0

    for plan in (SearchPlan("grid"), SearchPlan("tpe", trials=6, fresh=True)):
        _, s = search(tmp_path / plan.strategy, plan)
        assert s.jobs, f"{plan} searches again"

    path = cache / "matmul_epilogue.json"
    data = json.loads(path.read_text())
    for entry in data["entries"].values():
        entry["best"][0]["sha1"] = "0" * 40  # the template changed since it was timed
    path.write_text(json.dumps(data))
    again, s3 = search(tmp_path / "c", SearchPlan("tpe", trials=6, seed=0))
    assert s3.jobs and again["candidates"][0]["strategy"] == "memory"  # re-timed, as seeds

"""The warm-up before a GPU search (codegen/warm_compile.py): it plans exactly the candidates
the search will try, in the search's order (tiny-llama's cases, searches run on a screen that
times nothing: cost_session.py); it runs only on a GPU and only while the env allows; its pool
is real spawned processes, and a candidate that fails, dies or hangs costs its process, not the
warm-up (stand-in calls: warm_calls.py). CPU only."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import pytest
import torch
import warm_calls
from cost_session import CostSession

from codegen import search_memory
from codegen import warm_compile as wc
from codegen.registry import families
from codegen.search import CaseSearch, config_backend
from codegen.strategies import SearchPlan
from core.workload import Workload
from profiling.loader import build, resolve

GPU = "cuda"  # what the planner sees: a search on a GPU (nothing runs on it here)


@pytest.fixture(scope="module")
def tiny_cases():
    model = build(resolve("tiny-llama"), torch.float32, "cpu")
    return [(f, c) for f in families().values() for c in f.cases_from_model(model, Workload(2, 8))]


@pytest.fixture(autouse=True)
def own_memory(tmp_path, monkeypatch):
    """A search memory of the test's own (on a GPU machine the user's would be read)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def tried(family, case, root, plan, backend="triton") -> list[dict]:
    """The configs the search itself tries, in its order."""
    session = CostSession()
    CaseSearch(family, case, root, GPU, plan, session, backend).run()
    return session.jobs


def planned(family, case, root, plan, backend="triton") -> list[dict]:
    return wc.planned_configs(CaseSearch(family, case, root, GPU, plan, None, backend))


@pytest.mark.parametrize("plan", [SearchPlan(), SearchPlan("grid", trials=3),
                                  SearchPlan("random", trials=4)],
                         ids=["auto", "grid-3", "random-4"])
def test_the_plan_is_what_the_search_tries(tiny_cases, tmp_path, plan):
    """Grid and random: exactly the search's configs in its order, and their files where it
    screens them. TPE (auto on the larger spaces): its seeds first, then every config it might
    pick; what it tried is among them."""
    exact = 0
    for family, case in tiny_cases:
        plan_list = planned(family, case, tmp_path / "plan", plan)
        jobs = tried(family, case, tmp_path / "search", plan)
        configs = [j["config"] for j in jobs]
        search = CaseSearch(family, case, tmp_path, GPU, plan, None)
        if search.strategy.adaptive:
            seeds = search.strategy.seeds
            assert plan_list[:len(seeds)] == configs[:len(seeds)]
            assert all(c in plan_list for c in configs) and len(plan_list) == len(search.space)
        else:
            assert plan_list == configs, (family.name, case)
            exact += 1
        paths = [j["path"] for j in wc.plan_jobs([(family, case)], tmp_path / "search", GPU,
                                                 plan=plan)]
        assert {j["path"] for j in jobs} <= set(paths)
        assert [j["path"] for j in jobs][:len(search.strategy.seeds)] == \
            paths[:len(search.strategy.seeds)]
        if not search.strategy.adaptive:
            assert [j["path"] for j in jobs] == paths
    assert exact >= 5  # most of tiny-llama's spaces are searched by a grid here


def test_max_configs_and_the_search_memory(tiny_cases, tmp_path, monkeypatch):
    """max_configs is the trial budget, as in codegen.search.search; a remembered case warms
    its remembered configs first, and one whose remembered best is reused warms nothing."""
    monkeypatch.setattr(search_memory, "environment", lambda device: {
        "device_name": "a fake GPU", "torch": "t", "triton": "t"})
    family, case = next((f, c) for f, c in tiny_cases if f.name == "rope")
    jobs = wc.plan_jobs([(family, case)], tmp_path, GPU, max_configs=4, plan=SearchPlan("grid"))
    assert len(jobs) == 4
    first = tried(family, case, tmp_path, SearchPlan("grid"))  # remembers its best three
    grid = SearchPlan("grid")  # an asked-for grid times its remembered configs again, first
    plan_list = planned(family, case, tmp_path, grid)
    again = tried(family, case, tmp_path, grid)
    assert plan_list == [j["config"] for j in again]
    assert [j["strategy"] for j in again[:3]] == ["memory"] * 3 and len(first) == len(again)
    # auto: the remembered best is reused, not timed: nothing to compile
    assert planned(family, case, tmp_path, SearchPlan()) == []
    assert tried(family, case, tmp_path, SearchPlan()) == []


def test_a_cuda_case_warms_one_build(tiny_cases, tmp_path):
    family, case = next((f, c) for f, c in tiny_cases if f.name == "rmsnorm")
    jobs = wc.plan_jobs([(family, case)], tmp_path, GPU, backend="both")
    space = CaseSearch(family, case, tmp_path, GPU, SearchPlan(), None, "both").space
    cuda = [c for c in space if config_backend(c) == "cuda"]
    assert len(cuda) > 1 and len(jobs) == len(space) - len(cuda) + 1
    assert all(Path(j["path"]).is_file() for j in jobs)


def test_only_on_a_gpu_and_while_the_env_allows(tiny_cases, tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(wc, "warm", lambda jobs, device, n: calls.append((jobs, n)) or
                        Counter(ok=len(jobs) - 1, failed=1))
    lines = []
    cases = tiny_cases[:2]
    assert wc.warm_before_search(cases, tmp_path, "cpu", lines.append) is None
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv(wc.ENV, "0")
    assert wc.skip_reason("cuda:0") == f"{wc.ENV}=0"
    assert wc.warm_before_search(cases, tmp_path, "cuda:0", lines.append) is None
    assert calls == [] and lines == []
    monkeypatch.setenv(wc.ENV, "3")
    assert wc.skip_reason("cuda:0") is None
    assert wc.warm_before_search(cases, tmp_path, "cuda:0", lines.append)["ok"] > 0
    (jobs, n), = calls
    assert n == 3 and len({j["group"] for j in jobs}) == 2
    assert lines[0] == f"warm compile: {len(jobs)} kernels in 3 processes"
    assert lines[1].startswith(f"warm compile: {len(jobs)} kernels in 3 processes, ")
    assert lines[1].endswith(" s (1 failed; the search compiles them)")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert wc.skip_reason("cuda:0") is not None
    monkeypatch.delenv(wc.ENV)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert wc.pool_size(100) == 8 and wc.pool_size(3) == 3 and wc.pool_size(1) == 0


def test_a_broken_warm_up_does_not_fail_the_stage(tiny_cases, tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv(wc.ENV, "2")

    def broken(*args):
        raise OSError("no more processes")

    monkeypatch.setattr(wc, "warm", broken)
    lines = []
    assert wc.warm_before_search(tiny_cases[:1], tmp_path, "cuda", lines.append) is None
    assert lines[-1].startswith("warm compile: stopped (OSError: no more processes)")


def _jobs(folder: Path, dos: list) -> list[dict]:
    return [{"name": f"j{i}", "path": str(folder), "group": f"case{i % 2}", "do": do,
             "sleep": 0.3} for i, do in enumerate(dos)]


def test_the_pool_is_separate_processes(tmp_path):
    counts = wc.warm(_jobs(tmp_path, [None] * 6), "cpu", 3, call=warm_calls.marker)
    pids = {int(p.read_text()) for p in tmp_path.glob("*.pid")}
    assert counts == Counter(ok=6)
    assert len(list(tmp_path.glob("*.pid"))) == 6
    assert len(pids) >= 2 and os.getpid() not in pids


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")  # dead; a container's init may be slow to reap it


def test_failing_dying_and_hanging_candidates_cost_only_themselves(tmp_path):
    dos = ["hang", "fail", None, "die", None, None]
    counts = wc.warm(_jobs(tmp_path, dos), "cpu", 2, kernel_timeout_s=2,
                     call=warm_calls.marker)
    assert counts == Counter({"ok": 3, "failed": 2, "timed out": 1})
    # the hung process was killed with its group: the subprocess it started too
    child = int((tmp_path / "j0.child").read_text())
    assert _gone(child)
    # the rest ran in its stead, in fresh processes
    assert all((tmp_path / f"j{i}.pid").exists() for i in range(6))


def test_the_total_timeout_ends_the_warm_up(tmp_path):
    counts = wc.warm(_jobs(tmp_path, ["hang", None]), "cpu", 1, kernel_timeout_s=60,
                     total_timeout_s=2, call=warm_calls.marker)
    assert counts == Counter({"not finished": 2})
    child = tmp_path / "j0.child"  # where the process got that far in 2 s
    assert not child.exists() or _gone(int(child.read_text()))


def test_warm_one_runs_a_candidate_as_the_screen_does(tiny_cases, tmp_path):
    """The real call, in this process, under the interpreter: a rendered candidate of a tiny
    case runs on the case's inputs, which the process keeps for the case's next candidate."""
    family, case = next((f, c) for f, c in tiny_cases if f.name == "rmsnorm")
    jobs = wc.plan_jobs([(family, case)], tmp_path, "cpu", max_configs=2)
    held: dict = {}
    for job in jobs:
        wc.warm_one(job, "cpu", held)
        inputs = held["inputs"]
    assert held["group"] == jobs[0]["group"] and held["inputs"] is inputs


@pytest.mark.gpu
def test_the_search_finds_the_warmed_kernels_in_the_cache(tmp_path, monkeypatch):
    """On a GPU: after the warm-up, a search of the same case compiles nothing more (no new
    cubin in a Triton cache of the test's own)."""
    from codegen.rmsnorm import FAMILY as RMSNORM
    from codegen.screen import ScreenSession

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    case = {"rows": 4096, "hidden": 2048, "dtype": "bfloat16", "eps": 1e-6, "offset": 0.0,
            "cast_first": True}
    plan = SearchPlan("grid", trials=3)
    jobs = wc.plan_jobs([(RMSNORM, case)], tmp_path / "run", "cuda", plan=plan)
    assert len(jobs) >= 3 and wc.warm(jobs, "cuda", 2) == Counter(ok=len(jobs))

    def cubins() -> set[Path]:
        return set((tmp_path / "triton").rglob("*.cubin"))

    warmed = cubins()
    assert len(warmed) >= len(jobs)
    with ScreenSession(RMSNORM, case, "cuda") as session:
        entry = CaseSearch(RMSNORM, case, tmp_path / "run", "cuda", plan, session).run()
    assert [c["path"] for c in entry["candidates"]] == [j["path"] for j in jobs]
    assert all(c["screen"] == "pass" for c in entry["candidates"])
    assert cubins() == warmed

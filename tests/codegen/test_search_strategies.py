"""The search strategies (codegen/strategies.py) and one case's search (codegen/search.py) on a
synthetic cost: no kernel runs, the time of a config is a function of it (cost_session.py)."""

from __future__ import annotations

import statistics

import pytest
from cost_session import CostSession, roofline_ms

from codegen import strategies
from codegen.matmul_epilogue import FAMILY as EPILOGUE
from codegen.matmul_epilogue.reference import make_case as epilogue_case
from codegen.search import CaseSearch, proposer_turn
from codegen.strategies import SearchPlan

# Llama-3.2-1B's gate/up projections at batch 8 x seq 1024: the prefill tiles, the TMA
# kernels and their variants, 16 configs
CASE = epilogue_case(8192, 2048, 8192, "bfloat16", "silu")
SPACE = EPILOGUE.search_space(CASE)


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def _trials_to_best(name: str, seed: int) -> int:
    best = min(map(roofline_ms, SPACE))
    s = strategies.make(name, SPACE, None, seed)
    n = 0
    while (pick := s.suggest()) is not None:
        n += 1
        ms = roofline_ms(pick[0])
        s.tell(pick[0], ms)
        if ms == best:
            return n
    raise AssertionError("the space was spent without its best")


def test_tpe_finds_the_grids_best_in_at_most_40_percent_of_its_trials():
    """Seeded: within 6 of the 16 trials on 18 of seeds 0-19 (seed 0 takes 10); random search,
    on the same cost, on 9."""
    assert len(SPACE) == 16
    limit = int(0.4 * len(SPACE))  # the grid tries all 16
    tpe = [_trials_to_best("tpe", seed) for seed in range(20)]
    rand = [_trials_to_best("random", seed) for seed in range(20)]
    assert sum(n <= limit for n in tpe) >= 16, tpe
    assert statistics.mean(tpe) < statistics.mean(rand), (tpe, rand)
    assert sum(n <= limit for n in rand) < sum(n <= limit for n in tpe), rand


def test_a_seed_gives_the_same_picks_and_each_config_once():
    def picks(seed):
        s = strategies.make("tpe", SPACE, 10, seed)
        out = []
        while (pick := s.suggest()) is not None:
            out.append(pick[0])
            s.tell(pick[0], roofline_ms(pick[0]))
        return out

    first = picks(3)
    assert first == picks(3) and len(first) == 10
    assert all(first.count(c) == 1 for c in first)
    assert picks(4) != first


def test_auto_is_the_grid_where_the_space_fits_the_budget():
    plan = SearchPlan()
    assert strategies.resolve(plan, 7) == ("grid", None)
    assert strategies.resolve(plan, 16) == ("tpe", strategies.DEFAULT_TRIALS)
    assert strategies.resolve(SearchPlan(trials=20), 16) == ("grid", 20)
    assert strategies.resolve(SearchPlan(trials=4), 7) == ("tpe", 4)
    assert strategies.resolve(plan, 16, interpreter=True) == ("grid", None)
    # remembered: the remembered configs and a few more, not the whole grid again
    assert strategies.resolve(plan, 7, warm=True) == (
        "tpe", strategies.MEMORY_TOP + strategies.WARM_EXTRA)
    assert strategies.resolve(SearchPlan("grid"), 16, warm=True) == ("grid", None)
    assert strategies.resolve(SearchPlan("random", trials=3), 16) == ("random", 3)


def test_the_encoding_orders_integers_and_decodes_to_the_space():
    enc = strategies.Encoding(SPACE)
    assert enc.levels["BM"] == [64, 128] and enc.levels["TMA"] == ["-", True]
    assert "GROUP_M" not in enc.distributions  # one value: nothing to choose
    for c in SPACE:
        assert enc.nearest(enc.params(c), SPACE) == c
    # without a config itself, its nearest is a neighbour: one key one step away
    wide = next(c for c in SPACE if c.get("WIDE"))
    near = enc.nearest(enc.params(wide), [c for c in SPACE if c != wide])
    assert sum(near.get(k) != wide.get(k) for k in {*near, *wide}) == 1, near


def test_the_search_log_says_what_ran_by_which_strategy_and_why(tmp_path):
    failing = [c for c in SPACE if c.get("SUBTILE")]
    session = CostSession(fail=failing)
    entry = CaseSearch(EPILOGUE, CASE, tmp_path / "candidates", "cpu",
                       SearchPlan("tpe", trials=len(SPACE), seed=1), session).run()
    cands = entry["candidates"]
    assert len(cands) == len(SPACE) == entry["search"]["trials"]
    assert [c["trial"] for c in cands] == list(range(1, len(SPACE) + 1))
    assert {c["strategy"] for c in cands} == {"tpe"}
    assert all(c["screen"] and c["decision"] and c["elapsed_s"] >= 0 for c in cands)
    best = min((c for c in cands if c.get("timing")), key=lambda c: c["timing"]["median_ms"])
    assert best["decision"] == "best" and entry["order"][0] == best["path"]
    failed = [c for c in cands if c["config"] in failing]
    assert failed and all(c["decision"].startswith("discarded: error: OutOfResources")
                          for c in failed)
    assert entry["search"]["strategy"] == "tpe" and entry["search"]["space"] == len(SPACE)
    assert entry["baseline"]["median_ms"] == 2.0


def test_the_grid_and_random_search_screen_in_one_batch(tmp_path):
    for name in ("grid", "random"):
        session = CostSession()
        calls = []
        real = session.run
        session.run = lambda jobs, real=real, calls=calls: calls.append(len(jobs)) or real(jobs)
        entry = CaseSearch(EPILOGUE, CASE, tmp_path / name, "cpu",
                           SearchPlan(name, trials=5, seed=2, fresh=True), session).run()
        assert calls == [5] and len(entry["candidates"]) == 5
        assert {c["strategy"] for c in entry["candidates"]} == {name}


def test_a_time_budget_stops_the_search(tmp_path, monkeypatch):
    import codegen.search as search_mod

    clock = iter(range(0, 1000, 10))  # every reading 10 s later than the last
    monkeypatch.setattr(search_mod.time, "monotonic", lambda: float(next(clock)))
    entry = CaseSearch(EPILOGUE, CASE, tmp_path / "candidates", "cpu",
                       SearchPlan("tpe", trials=16, seconds=25), CostSession()).run()
    assert 1 <= entry["search"]["trials"] < 16
    assert entry["search"]["stopped"] == "time budget of 25 s spent"


def test_the_proposers_turns_are_its_share_of_the_trials():
    turns = [t for t in range(1, 11) if proposer_turn(t, 0.3)]
    assert turns == [4, 7, 10]
    assert not any(proposer_turn(t, 0.0) for t in range(1, 11))
    assert all(proposer_turn(t, 1.0) for t in range(1, 11))
    assert sum(proposer_turn(t, 0.5) for t in range(1, 9)) == 4


def test_on_parallel_workers_a_case_searches_in_a_thread_and_screens_remotely(tmp_path,
                                                                               monkeypatch):
    """On Ray (`workers.parallel`) each case's search runs in a thread of this process; a
    grid's screen is one task, TPE's one task per trial, each given the family by name and
    the sources' text (a node may not see the run directory)."""
    import threading

    import codegen.screen
    from codegen.search import finish_search, submit_search

    calls, threads = [], set()

    def remote(family, case, jobs, device, timeout_s, texts):
        threads.add(threading.current_thread().name)
        calls.append((family, device, len(jobs), all(texts[j["path"]] for j in jobs)))
        return {"median_ms": 2.0}, [{**j, "screen": "pass", "timing": {
            "median_ms": roofline_ms(j["config"]), "meaningful": True}} for j in jobs]

    class Workers:
        name, parallel = "ray", True

        def submit_call(self, fn, args, guard_s):
            return fn(*args)

        def result(self, job):
            return job

    monkeypatch.setattr(codegen.screen, "_screen_anywhere", remote)
    pending = [submit_search(EPILOGUE, CASE, tmp_path / name, "cuda:0", workers=Workers(),
                             plan=SearchPlan(name, trials=trials, fresh=True))
               for name, trials in (("tpe", 3), ("grid", 4))]
    assert all("future" in p for p in pending)
    tpe, grid = (finish_search(p) for p in pending)
    assert len(tpe["candidates"]) == 3 and len(grid["candidates"]) == 4
    assert tpe["baseline"] == grid["baseline"] == {"median_ms": 2.0}
    assert sorted(c[2] for c in calls) == [1, 1, 1, 4]
    assert all(c[:2] == ("matmul_epilogue", "cuda") and c[3] for c in calls)
    assert all(t.startswith("search") for t in threads)


@pytest.mark.parametrize("strategy", ["tpe", "random", "auto"])
def test_a_gpu_search_times_the_familys_guesses_first(tmp_path, strategy):
    """gemv's space leads with cuBLAS and its guessed tile: a GPU search of four trials times
    both first whatever its strategy (o_proj's guess, second in the list, was skipped by an
    even spread and by TPE's random starts); the interpreter does not."""
    from codegen.gemv import FAMILY as GEMV
    from codegen.gemv.reference import make_case as gemv_case

    case = gemv_case(1, 2048, 2048, "bfloat16", False, (1, 1))
    space = GEMV.search_space(case)
    assert len(space) > 4 and GEMV.leads(case) == 2
    plan = SearchPlan(strategy, trials=4, seed=3, fresh=True)
    gpu = CaseSearch(GEMV, case, tmp_path / "gpu", "cuda", plan, CostSession()).run()
    cands = gpu["candidates"]
    assert [c["config"] for c in cands[:2]] == space[:2]
    assert [c["strategy"] for c in cands[:2]] == ["guess", "guess"] and len(cands) <= 5
    cpu = CaseSearch(GEMV, case, tmp_path / "cpu", "cpu", plan, CostSession()).run()
    assert "guess" not in {c["strategy"] for c in cpu["candidates"]}

"""The screen's worker (codegen/screen.py), kept between a search's trials: one worker times the
baseline once and the candidates as they come; a candidate that kills it fails alone, and a
fresh worker carries on without timing the baseline again. CPU, Triton interpreter, a tiny
rmsnorm case; on a GPU, a TPE search of a real case through it."""

from __future__ import annotations

import pytest

from codegen import screen
from codegen.rmsnorm import FAMILY as RMSNORM
from codegen.screen import ScreenSession

CASE = {"rows": 4, "hidden": 64, "dtype": "float32", "eps": 1e-6, "offset": 0.0,
        "cast_first": True}
DIES = '''import os


def forward(x, weight, *, out, **params):
    os._exit(3)  # what a segfault or an illegal address does to the worker
'''


def test_one_worker_for_many_trials_and_a_fresh_one_after_a_crash(tmp_path, monkeypatch):
    space = RMSNORM.search_space(CASE)
    good = []
    for i, config in enumerate(space[:2]):
        path = tmp_path / f"good{i}.py"
        path.write_text(RMSNORM.render(config, CASE))
        good.append({"path": str(path), "config": config})
    dies = tmp_path / "dies.py"
    dies.write_text(DIES)
    starts = []
    real_start = ScreenSession._start
    monkeypatch.setattr(ScreenSession, "_start", lambda self: starts.append(
        self.baseline is None) or real_start(self))
    with ScreenSession(RMSNORM, CASE, "cpu", timeout_s=120) as session:
        (first,) = session.run(good[:1])
        baseline = session.baseline
        crashed, second = session.run([{"path": str(dies), "config": None}, good[1]])
    assert first["screen"] == "pass" and first["timing"]["median_ms"] > 0
    assert baseline is not None and session.baseline is baseline
    assert crashed["screen"] == "crashed or hung the worker"
    assert second["screen"] == "pass" and second["config"] == space[1]
    # the first worker served two calls; the second worker did not time the baseline again
    assert starts == [True, False]


def test_screen_and_time_is_one_session(tmp_path):
    path = tmp_path / "kernel.py"
    path.write_text(RMSNORM.render(RMSNORM.search_space(CASE)[-1], CASE))
    baseline, (entry,) = screen.screen_and_time(RMSNORM, CASE, [{"path": str(path)}], "cpu")
    assert baseline["median_ms"] > 0 and entry["screen"] == "pass"


@pytest.mark.gpu
def test_a_tpe_search_on_the_gpu_remembers_its_best(tmp_path, monkeypatch):
    from codegen.search import CaseSearch
    from codegen.strategies import SearchPlan

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    case = {**CASE, "rows": 4096, "hidden": 2048, "dtype": "bfloat16"}

    def search(root):
        with ScreenSession(RMSNORM, case, "cuda") as session:
            return CaseSearch(RMSNORM, case, root, "cuda", SearchPlan("tpe", trials=3),
                              session).run()

    entry = search(tmp_path / "a")
    assert len(entry["candidates"]) == 3
    assert all(c["screen"] == "pass" and c["timing"]["meaningful"] for c in entry["candidates"])
    best = next(c for c in entry["candidates"] if c["path"] == entry["order"][0])
    warm = search(tmp_path / "b")
    assert warm["search"]["memory"]["used"]
    assert warm["candidates"][0]["strategy"] == "memory"
    assert warm["candidates"][0]["config"] == best["config"]

"""benchmarks/head_to_head.py's split of its rounds by the host's speed (the timing itself
needs a GPU and a run directory; the split is plain arithmetic over its recorded rounds)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from head_to_head import by_host_speed  # noqa: E402


def test_rounds_split_by_eager_host_time_show_each_regime():
    # run 12's shape: compile GPU-bound at 21 ms; ours host-bound, 17.7 ms when the host is
    # fast and 25.7 when slow; eager's host time marks the host's speed
    eager_host = [27.0, 33.0, 26.0, 34.0, 27.5, 33.5]
    times = {"eager": [h + 0.5 for h in eager_host],
             "ours": [17.7 if h < 30 else 25.7 for h in eager_host],
             "compile": [21.0, 21.2, 21.0, 21.2, 21.0, 21.2]}
    host = {"eager": eager_host, "ours": [t - 0.3 for t in times["ours"]],
            "compile": [17.0] * 6}
    split = by_host_speed(times, host)
    fast, slow = split["fast_host"], split["slow_host"]
    assert fast["rounds"] == slow["rounds"] == 3
    assert fast["eager_host_ms"] == 27.0 and slow["eager_host_ms"] == 33.5
    assert fast["median_ms"]["ours"] == 17.7 and slow["median_ms"]["ours"] == 25.7
    assert fast["ours_over_compile"] == pytest.approx(21.0 / 17.7)
    assert slow["ours_over_compile"] == pytest.approx(21.2 / 25.7)


def test_a_steady_host_is_all_fast_and_a_short_fast_stretch_is_kept_apart():
    times = {"eager": [30.0] * 4, "ours": [20.0] * 4, "compile": [22.0] * 4}
    host = {"eager": [25.0] * 4, "ours": [15.0] * 4, "compile": [10.0] * 4}
    split = by_host_speed(times, host)
    assert list(split) == ["fast_host"] and split["fast_host"]["rounds"] == 4
    assert split["fast_host"]["ours_over_compile"] == pytest.approx(1.1)
    # four fast rounds in thirty, as in run 12's Qwen b8: a median split would bury them
    eager_host = [24.5] * 4 + [30.7] * 26
    times = {"eager": [27.5] * 4 + [33.7] * 26, "ours": [17.7] * 4 + [25.7] * 26,
             "compile": [21.0] * 30}
    split = by_host_speed(times, {"eager": eager_host, "ours": eager_host,
                                  "compile": eager_host})
    assert split["fast_host"]["rounds"] == 4 and split["slow_host"]["rounds"] == 26
    assert split["fast_host"]["ours_over_compile"] > 1 > split["slow_host"]["ours_over_compile"]

"""benchmarks/host_speed_reproject.py on an H200 run (Qwen2.5-0.5B b8 s1024, its artifacts and
trace in tests/fixtures): at the profile's own host speed
it gives the frozen projection back (the control that makes its other readings comparable),
it reads the two other host speeds the run recorded, and the summary counts them."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUN = ROOT / "tests/fixtures/run-qwen2.5-0.5b-b8-s1024"
sys.path.insert(0, str(ROOT / "benchmarks"))


@pytest.mark.skipif(not (RUN / "trace").is_dir(), reason="H200 run fixture not present")
def test_profile_speed_is_the_frozen_projection_and_others_move_it():
    from host_speed_reproject import reproject_at, summary

    [(key, row)] = reproject_at(RUN).items()
    assert key == "prefill-b8-s1024-bf16"
    assert row["replay"]["profile"] == pytest.approx(row["frozen"], rel=1e-9)
    # the profile read 27.4 ms of host per unpatched pass, the host-delta stage and the
    # timing about 19: a faster host leaves the b8 pass more device-bound, so the replay rises
    assert row["host_ms"]["profile"] > 1.3 * row["host_ms"]["fresh"]
    assert row["replay"]["fresh"] > row["replay"]["profile"]
    assert row["replay"]["measured"] > row["replay"]["profile"]
    s = summary([{"run": RUN.name, "workload": key, **row}])
    assert s["rows"] == 1 and s["frozen"]["mean"] == pytest.approx(s["profile"]["mean"])
    assert s["measured"]["mean"] < s["frozen"]["mean"]  # 0.2 % against 1.0 % here

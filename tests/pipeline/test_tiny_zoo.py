"""Every tiny architecture of the zoo, by the `tiny-` name the README gives it: each builds,
profiles (a prefill and a decode step) and ranks on the CPU. `test_optimize.py`'s
`test_top_n_end_to_end` takes three of them (one a mixture of experts) through `optimize`."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from core.workload import Workload
from models.zoo import ZOO

README = Path(__file__).resolve().parents[2] / "README.md"
TINY = sorted(n for n in ZOO if n.startswith("tiny-"))


def test_the_readme_names_every_tiny_model_and_no_other():
    named = set(re.findall(r"`(tiny-[a-z0-9.-]+)`", README.read_text()))
    assert named == set(TINY)


@pytest.mark.parametrize("name", TINY)
def test_a_tiny_model_profiles_and_ranks_on_the_cpu(name, tmp_path):
    from pipeline.stages.profile import run_profile
    from pipeline.stages.rank import run_rank
    from profiling.loader import resolve

    spec = resolve(name)
    assert spec.source == "zoo" and spec.model_type == ZOO[name]["model_type"]
    profile = run_profile(spec, [Workload(1, 8), Workload(1, 8, mode="decode")], tmp_path)
    for w in profile["workloads"]:
        assert w["wall"]["median_ms"] > 0 and w["ops"]
        shares = sum(o["share"] for o in w["ops"]) + w["rest_share"]
        assert shares == pytest.approx(1.0, abs=1e-9)
    ranking = run_rank(tmp_path)
    # every architecture has code some family replaces: at the least the decode step's KV
    # cache append
    families = {r["family"] for w in ranking["workloads"] for r in w["rows"] if r["family"]}
    assert "kv_cache" in families, families

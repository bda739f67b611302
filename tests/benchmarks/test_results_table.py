"""latest.json rows from a head-to-head run: the graphed rows carry the frozen pass time, and
ours-graphs' projected speedup divides the eager median of that same run by it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))


def _run(tmp_path: Path) -> tuple[dict, Path]:
    key = "prefill-b1-s128-bf16"
    frozen = {"unpatched": 4.2, "kept": 7.8, "unpatched_pass_us": 2950.0,
              "kept_pass_us": 1600.0}
    (tmp_path / "projection.json").write_text(json.dumps(
        {"workloads": {key: {"replay": 1.39, "graphs": frozen}}}))
    (tmp_path / "integration.json").write_text(json.dumps(
        {"workloads": {key: {"projection_for_kept": {"replay": 1.38},
                             "graphs": {"projected_for_kept": frozen}}}}))
    h2h = {"workload": key,
           "median_ms": {"eager": 14.4, "ours": 9.7, "graph": 2.5, "ours-graphs": 1.5},
           "over_eager": {v: {"speedup": 14.4 / ms, "ci": [1.0, 2.0]}
                          for v, ms in (("ours", 9.7), ("graph", 2.5), ("ours-graphs", 1.5))},
           "kernels_per_pass": {"ours-graphs": 206}}
    return h2h, tmp_path


def test_graphed_rows_project_from_the_frozen_pass_time_over_this_runs_eager(tmp_path):
    from results_table import rows_from_h2h

    h2h, run = _run(tmp_path)
    rows = {r["variant"]: r for r in rows_from_h2h(h2h, "m", "c0ffee", "2026-12-03", run)}
    assert rows["ours"]["projected"] == 1.38  # the set that shipped, not the frozen 1.39
    assert rows["ours-graphs"]["projected_ms"] == 1.6
    assert abs(rows["ours-graphs"]["projected"] - 14.4 / 1.6) < 1e-9  # not the frozen 7.8
    assert rows["graph"]["projected_ms"] == 2.95 and rows["graph"]["projected"] is None
    assert "projected_ms" not in rows["eager"] and rows["eager"]["over_eager"] == 1.0
    assert rows["ours-graphs"]["kernels_per_pass"] == 206


def test_upsert_replaces_a_remeasured_row_and_keeps_the_others(tmp_path):
    from results_table import load, rows_from_h2h, upsert

    h2h, run = _run(tmp_path)
    path = tmp_path / "latest.json"
    upsert(path, rows_from_h2h(h2h, "m", "old", "2026-12-02", run))
    h2h["median_ms"] = {"eager": 14.0, "ours": 9.0}
    upsert(path, rows_from_h2h(h2h, "m", "new", "2026-12-03", run))
    rows = {r["variant"]: r for r in load(path)["rows"]}
    assert rows["ours"]["commit"] == "new" and rows["ours"]["ms"] == 9.0
    assert rows["graph"]["commit"] == "old" and len(rows) == 4


def test_rows_from_another_card_are_refused_and_start_a_file_of_their_own(tmp_path):
    from results_table import load, rows_from_h2h, upsert

    h2h, run = _run(tmp_path)
    rows = rows_from_h2h(h2h, "m", "c0", "2026-12-05", run)
    h200 = tmp_path / "latest.json"
    upsert(h200, rows, "NVIDIA H200, torch 2.11.0+cu130")
    assert load(h200)["machine"] == "NVIDIA H200, torch 2.11.0+cu130"
    upsert(h200, rows, "NVIDIA H200")  # the same card, described more briefly
    with pytest.raises(ValueError, match="H100 80GB HBM3 go in a file of their own"):
        upsert(h200, rows, "NVIDIA H100 80GB HBM3, torch 2.11.0+cu130")
    assert len(load(h200)["rows"]) == len(rows)  # nothing written
    h100 = tmp_path / "latest-h100.json"
    upsert(h100, rows, "NVIDIA H100 80GB HBM3, torch 2.11.0+cu130")
    assert load(h100)["machine"] == "NVIDIA H100 80GB HBM3, torch 2.11.0+cu130"


def test_a_liger_run_becomes_its_row_and_is_refused_on_another_cards_file(tmp_path):
    from results_table import load, row_from_contender, upsert

    c = {"contender": "liger", "model": "gemma-2b", "workload": "prefill-b8-s1024-bf16",
         "torch": "2.11.0+cu130", "gpu": "NVIDIA H100 80GB HBM3", "eager_ms": 85.3,
         "contender_ms": 71.4, "speedup": 85.3 / 71.4, "method": "medians of 30"}
    row = row_from_contender(c, "db810b2", "2026-12-05")
    assert (row["variant"], row["ms"], row["ci"]) == ("liger", 71.4, None)
    assert row["over_eager"] == round(85.3 / 71.4, 4) and "medians of 30" in row["source"]
    h100 = tmp_path / "latest-h100.json"
    upsert(h100, [row], f"{c['gpu']}, torch {c['torch']}")
    assert load(h100)["rows"] == [row]
    with pytest.raises(ValueError, match="go in a file of their own"):
        upsert(h100, [row], "NVIDIA H200, torch 2.11.0+cu130")

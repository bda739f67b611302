"""benchmarks/search_strategies.py on the CPU: the --dry-run flow (synthetic times, the real
strategies, the scripted proposer as a subprocess) writes one row per strategy and seed with
what it reached against the grid; two calls' files merge into one table; a real run refuses
without a GPU."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "search_strategies.py"


def run_script(*args, timeout=240):
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {k: v for k, v in os.environ.items() if k != "OPENAI_BASE_URL"}
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env={**env, "PYTHONPATH": path})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for fams in ("rmsnorm", "gemv"):
        folder = tmp_path_factory.mktemp(fams)
        proc = run_script("--dry-run", "--full", "--out", str(folder), "--families", fams,
                          "--seeds", "0,1")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        out[fams] = folder
    return out


def test_every_strategy_and_seed_is_a_row_scored_against_the_grid(runs):
    data = json.loads((runs["rmsnorm"] / "search_strategies.json").read_text())
    rows = data["rows"]
    assert [(r["strategy"], r["seed"]) for r in rows] == [
        ("grid", None), ("random", 0), ("random", 1), ("tpe", 0), ("tpe", 1), ("hybrid", 0),
        ("hybrid", 1)]
    grid = rows[0]
    assert grid["trials"] == grid["space"] == 9 and grid["best_ms"] == grid["best_grid_ms"]
    for r in rows:
        assert r["trials_to_1pct"] is not None and 1 <= r["trials_to_1pct"] <= r["trials"]
        assert r["seconds_to_1pct"] is not None and r["failures"] == 0
        # --full: every budget spent, so every run found the grid's best
        assert r["best_grid_ms"] == grid["best_ms"] and r["trials"] == 9
    hybrid = [r for r in rows if r["strategy"] == "hybrid"]
    assert all(r["proposer_calls"] == 2 for r in hybrid)  # 0.3 of 9 trials
    assert all(r["proposer"] == "proposer scripted_proposer.py" for r in hybrid)
    assert data["meta"]["dry_run"] and "scripted" in data["meta"]["proposer"]
    log = json.loads((runs["rmsnorm"] / "logs" / "rmsnorm-hybrid-s0.json").read_text())
    proposed = [p for call in log["proposals"] for p in call["proposals"]]
    assert proposed and all(p["file"] == "neighbour.json" and p["verdict"] == "pass"
                            for p in proposed)
    md = (runs["rmsnorm"] / "search_strategies.md").read_text()
    assert "DRY RUN" in md and md.count("| rmsnorm |") == 7


def test_without_full_a_run_stops_within_1_percent(tmp_path):
    proc = run_script("--dry-run", "--out", str(tmp_path), "--families", "rmsnorm",
                      "--strategies", "grid,tpe")
    assert proc.returncode == 0, proc.stderr
    rows = json.loads((tmp_path / "search_strategies.json").read_text())["rows"]
    tpe = rows[1]
    assert tpe["stopped"] == "within 1 % of the grid's best"
    assert tpe["trials"] == tpe["trials_to_1pct"] < rows[0]["trials"]


def test_two_calls_merge_into_one_table(runs, tmp_path):
    proc = run_script("--out", str(tmp_path), "--table",
                      *(str(runs[f] / "search_strategies.json") for f in ("rmsnorm", "gemv")))
    assert proc.returncode == 0, proc.stderr
    merged = json.loads((tmp_path / "search_strategies.json").read_text())
    assert [r["family"] for r in merged["rows"]] == ["rmsnorm"] * 7 + ["gemv"] * 7
    assert set(merged["tpe_within_1pct_in_30pct"]) == {"rmsnorm", "gemv"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_a_real_run_refuses_without_a_gpu(tmp_path):
    proc = run_script("--out", str(tmp_path), "--families", "rmsnorm")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "benchmarks/search_strategies.py: no CUDA GPU here; timings on the CPU mean nothing "
        "(--dry-run tests the flow on the CPU)"]

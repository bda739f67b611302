"""benchmarks/moe_table.py --dry-run: the experts block's table on the CPU (tiny-olmoe, fp32,
interpreter): every experts implementation of the installed transformers is tried (one that
cannot run here is named), ours is checked before it is timed, and the best of each side is
set against the other."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from moe_table import main, parse_workloads  # noqa: E402

from models.moe import experts_options  # noqa: E402


def test_dry_run_writes_the_table(tmp_path, capsys):
    assert main(["--out", str(tmp_path), "--dry-run", "--workloads", "decode:1x4"]) == 0
    data = json.loads((tmp_path / "moe.json").read_text())
    (w,) = data["workloads"]
    assert w["case"]["rows"] == 1 and w["case"]["model_type"] == "olmoe"
    assert {f"hf:{o}" for o in experts_options()} <= set(w["rows"])
    assert w["ours"].startswith("ours:") and w["rows"][w["ours"]]["rel_error"] < 1e-5
    assert w["best_hf"] in ("hf:eager", "hf:batched_mm", "hf:grouped_mm")
    assert w["ours_over_best_hf"] > 0
    assert "ours over" in (tmp_path / "moe.md").read_text()


def test_bad_workloads_are_one_line_errors():
    assert parse_workloads("prefill:8x1024,decode:1x1024") == [("prefill", 8, 1024),
                                                              ("decode", 1, 1024)]
    with pytest.raises(SystemExit, match="bad workload"):
        parse_workloads("both:1x2")

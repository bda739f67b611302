"""`pipeline optimize --search tpe --max-configs 3 --proposer CMD --proposer-share 0.5` end to
end on the CPU (tiny-llama's rmsnorm, Triton interpreter): the options reach every case's
search, the proposer takes its trials inside it (and is not asked again beside it), the run
records the options, and the report's search table shows each case."""

from __future__ import annotations

import sys
from pathlib import Path

from test_optimize import md_table, run_cli, searched

from core.artifacts import read_json

PROPOSER = Path(__file__).resolve().parents[1] / "codegen" / "fake_trial_proposer.py"


def test_a_tpe_search_with_a_proposer_inside_end_to_end(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_cli("optimize", "tiny-llama", "--families", "rmsnorm", "--batch", "1", "--seq",
                   "8", "--device", "cpu", "--pairs", "2", "--search", "tpe", "--max-configs",
                   "3", "--search-seed", "1", "--proposer", f"{sys.executable} {PROPOSER}",
                   "--proposer-share", "0.5", "--run-dir", str(run_dir), home=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    opts = read_json(run_dir / "options.json", "run options")
    assert (opts["search"], opts["max_configs"], opts["search_seed"],
            opts["proposer_share"]) == ("tpe", 3, 1, 0.5)
    cases = searched(read_json(run_dir / "candidates" / "search_log.json"))
    assert cases
    for s in cases:
        assert s["search"]["strategy"] == "tpe" and s["search"]["trials"] == 3
        assert s["search"]["hybrid"] == "proposer fake_trial_proposer.py"
        assert [p["trial"] for p in s["proposals"]] == [2]
        assert "proposer" not in s, "asked beside the search too"
        by = [c["strategy"] for c in s["candidates"]]
        assert by.count("tpe") == 2 and by.count("proposer") == 2  # a config and a kernel
        assert all(c["screen"] == "pass" for c in s["candidates"])
    rows = md_table((run_dir / "report.md").read_text(), "## Search")
    assert [(r["family"], r["strategy"], r["trials"], r["proposer trials"]) for r in rows] == \
        [("rmsnorm", "tpe", "3 of 3", "1")] * len(cases)

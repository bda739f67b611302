"""`--resume` keeps the options a run was started with (options.json), unless the command line
names them again, and says so in one line."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from core.artifacts import read_json
from pipeline.cli import cli


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    """A tiny-llama CPU run, `optimize --top 2 --pairs 2` interrupted after generate."""
    run = tmp_path_factory.mktemp("resume") / "run"
    runner = CliRunner()
    res = runner.invoke(cli, ["profile", "tiny-llama", "--batch", "1", "--seq", "8",
                              "--device", "cpu", "--run-dir", str(run)])
    assert res.exit_code == 0, res.output
    mp = pytest.MonkeyPatch()
    import pipeline.optimize as opt

    def stop(*args, **kwargs):
        raise KeyboardInterrupt

    mp.setattr(opt, "verify_stage", stop)
    try:
        res = runner.invoke(cli, ["optimize", str(run), "--top", "2", "--pairs", "2"])
    finally:
        mp.undo()
    assert res.exit_code != 0 and not (run / "integration.json").exists()
    assert (run / "candidates" / "search_log.json").exists(), "generate did not run"
    return run


def resumed(run, monkeypatch, *extra):
    import pipeline.optimize as opt

    seen = {}

    def fake(run_dir, top, say, **kw):
        seen.update(top=top, **kw)
        return {"markdown": str(run_dir / "report.md")}

    monkeypatch.setattr(opt, "run_optimize", fake)
    monkeypatch.setattr("pipeline.summary.print_optimize", lambda run_dir, **k: None)
    res = CliRunner().invoke(cli, ["optimize", str(run), "--resume", *extra])
    assert res.exit_code == 0, res.output
    return seen, res.output


def test_the_run_records_the_options_it_was_started_with(interrupted):
    opts = read_json(interrupted / "options.json", "run options")
    assert (opts["top"], opts["pairs"], opts["families"], opts["backend"]) == (
        2, 2, None, "triton")


def test_resume_uses_the_recorded_options_and_says_so(interrupted, monkeypatch):
    seen, out = resumed(interrupted, monkeypatch)
    assert seen["top"] == 2 and seen["pairs"] == 2 and seen["resume"] is True
    lines = [x for x in out.splitlines() if x.startswith("resuming with the run's options")]
    assert len(lines) == 1 and "--top 2" in lines[0] and "--pairs 2" in lines[0], out


def test_an_option_given_again_on_resume_wins(interrupted, monkeypatch):
    seen, out = resumed(interrupted, monkeypatch, "--top", "4")
    assert seen["top"] == 4 and seen["pairs"] == 2
    assert "from the command line: --top 4" in out


def test_resume_keeps_or_overrides_the_workers_backend(tmp_path):
    from pipeline.rundir import resume_options, write_options

    write_options(tmp_path, {"top": 2, "backend": "triton", "workers": "ray",
                             "ray_address": "127.0.0.1:6379"})
    assert read_json(tmp_path / "options.json", "run options")["workers"] == "ray"
    given = {"top": 2, "families": None, "backend": "triton", "max_configs": None,
             "pairs": None, "proposer": None, "workers": "local", "ray_address": None}
    kept, line = resume_options(tmp_path, given, explicit=set())
    assert (kept["workers"], kept["ray_address"]) == ("ray", "127.0.0.1:6379")
    assert "--workers ray" in line
    back, line = resume_options(tmp_path, given, explicit={"workers"})
    assert back["workers"] == "local" and "from the command line: --workers local" in line
    # a run from before backends (no such key): the local worker, or what is given now
    (tmp_path / "options.json").write_text('{"schema_version": 1, "stage": "options", "top": 2}')
    assert resume_options(tmp_path, given, explicit=set())[0]["workers"] == "local"


def test_resume_keeps_the_search_options(tmp_path, monkeypatch):
    """The search's strategy, time budget, seed, --fresh-search and proposer share are kept
    by --resume (a run without them recorded takes the command line's defaults)."""
    from codegen.strategies import SearchPlan
    from pipeline.rundir import write_options

    (tmp_path / "profile.json").write_text('{"schema_version": 1}')
    write_options(tmp_path, {"top": 2, "backend": "triton", "workers": "local",
                             "search": "tpe", "search_seconds": 30.0, "search_seed": 3,
                             "fresh_search": True, "proposer_share": 0.5})
    seen, out = resumed(tmp_path, monkeypatch)
    assert seen["plan"] == SearchPlan("tpe", None, 30.0, 3, True, 0.5)
    line = next(x for x in out.splitlines() if x.startswith("resuming with"))
    assert "--search tpe" in line and "--fresh-search" in line and "--search-seed 3" in line
    assert "--fresh-search True" not in line
    seen, out = resumed(tmp_path, monkeypatch, "--search", "grid", "--proposer-share", "0")
    assert seen["plan"] == SearchPlan("grid", None, 30.0, 3, True, 0.0)
    # options.json from before the search options: the defaults
    (tmp_path / "options.json").write_text('{"schema_version": 1, "stage": "options", "top": 2}')
    seen, _ = resumed(tmp_path, monkeypatch)
    assert seen["plan"] == SearchPlan()

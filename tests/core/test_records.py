"""Artifacts are validated against their typed records when read: the committed GPU runs read
back whole, and an old or corrupt file is one line naming the file and what is wrong."""

import gzip
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from core.artifacts import load, read_json, write_json
from core.errors import UserError
from core.records import BY_KIND, Integration, Ranking

ROOT = Path(__file__).resolve().parents[2]
RUNS = sorted((ROOT / "benchmarks" / "results").glob("optimize-*-run15*"))
# the committed runs keep their artifacts flat, profile.json gzipped
FILES = {"profile": "profile.json.gz", "ranking": "ranking.json", "search log": "search_log.json",
         "verification summary": "verification_summary.json", "projection": "projection.json",
         "integration": "integration.json"}


@pytest.mark.parametrize("run", RUNS, ids=lambda p: p.name)
def test_every_artifact_of_a_committed_gpu_run_reads_as_its_record(run, tmp_path):
    assert RUNS, "no committed run-15 folders"
    for kind, name in FILES.items():
        src = run / name
        if name.endswith(".gz"):
            dst = tmp_path / name.removesuffix(".gz")
            dst.write_bytes(gzip.decompress(src.read_bytes()))
            src = dst
        data = read_json(src, kind)
        assert BY_KIND[kind].model_validate(data)  # and typed access works on it
    ranking = load(run / "ranking.json", Ranking, "ranking")
    assert ranking.workloads and all(r.share >= 0 for w in ranking.workloads for r in w.rows)
    integ = load(run / "integration.json", Integration, "integration")
    assert all(set(w.kept) <= set(integ.families) | set(w.cases) for w in integ.workloads.values())


def _one_line(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert "\n" not in text
    return text


def test_a_missing_field_is_named_with_the_file(tmp_path):
    path = write_json(tmp_path / "ranking.json", {"workloads": [{"key": "w", "rows": [
        {"pattern": "rmsnorm", "family": "rmsnorm"}]}]})
    with pytest.raises(UserError) as e:
        read_json(path, "ranking")
    text = _one_line(e)
    assert str(path) in text and "workloads.0.rows.0.share" in text and "required" in text


def test_a_wrong_type_is_named(tmp_path):
    path = write_json(tmp_path / "integration.json",
                      {"families": ["rmsnorm"], "workloads": {"w": {"kept": "rmsnorm"}}})
    with pytest.raises(UserError) as e:
        read_json(path, "integration")
    assert "workloads.w.kept" in _one_line(e)


def test_an_old_schema_version_and_broken_json_are_one_line(tmp_path):
    old = tmp_path / "projection.json"
    old.write_text(json.dumps({"schema_version": 0, "workloads": {}}))
    with pytest.raises(UserError) as e:
        read_json(old, "projection")
    assert "schema_version 0" in _one_line(e)
    broken = tmp_path / "profile.json"
    broken.write_text('{"schema_version": 1, "workloads": [')
    with pytest.raises(UserError) as e:
        read_json(broken, "profile")
    assert "not valid JSON" in _one_line(e)


def test_extra_fields_are_kept_for_the_readers_that_want_them(tmp_path):
    path = write_json(tmp_path / "projection.json", {
        "kernel_speedups": {"rmsnorm": 2.0}, "families": ["rmsnorm"], "note": "kept",
        "workloads": {"w": {"amdahl": 1.1, "replay": None, "patterns": [], "host_set": {}}}})
    assert read_json(path, "projection")["note"] == "kept"
    assert load(path, BY_KIND["projection"], "projection").workloads["w"].amdahl == 1.1


def test_the_cli_reports_a_corrupt_run_in_one_line(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(RUNS[0], run, ignore=shutil.ignore_patterns("trace", "*.gz", "plots"))
    (run / "profile.json").write_text(json.dumps({"schema_version": 1, "workloads": []}))
    proc = subprocess.run([sys.executable, "-m", "pipeline", "report", str(run)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "profile.json" in lines[0] and "model" in lines[0], proc.stderr


def test_a_record_passes_on_what_it_was_read_from_until_a_field_is_set():
    """`as_written`: the part of an artifact as the file had it (its key order, an int where
    the record declares a float), for a reader that passes it on whole; a record a field was
    set on gives its fields instead."""
    written = {"rows": [], "key": "prefill", "wall_ms": 12,
               "floor": {"over_wall": 2, "wall_ms": 1.5}}
    rec = Ranking.of({"workloads": [written]}).workloads[0]
    assert rec.wall_ms == 12.0 and isinstance(rec.wall_ms, float)
    assert json.dumps(rec.as_written()) == json.dumps(written)
    assert json.dumps(rec.floor.as_written()) == json.dumps(written["floor"])
    rec.wall_ms = 13.0
    assert rec.as_written() == {**written, "wall_ms": 13.0}
    assert list(rec.as_written()) != list(written)  # the record's own order now

"""Right kernels pass (also at the tolerance edge), records are complete, and a crashing or
hanging candidate fails cleanly while the next one is still verified."""

import json
from pathlib import Path

import pytest
import torch
from verify_families import CASE_BF16, CASE_FP16, CASE_FP32, RMSNORM

from verify.harness import expand_cases, verify_candidate, verify_candidates
from verify.loading import candidate_name, case_params, family_spec
from verify.tolerances import TOLERANCES

HERE = Path(__file__).parent
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CASES = [CASE_FP32, CASE_FP16, CASE_BF16]
ALL_CHECKS = {"static", "load", "runs", "numerics", "memoisation", "stress", "nonfinite",
              "writes_all", "deterministic", "out_of_bounds", "out_buffer", "inputs_unchanged",
              "aten_ops", "default_stream", "timed_results"}


def with_tolerances(name: str, folder: Path) -> Path:
    """A perturbed candidate with the tolerance table written in (it may not import verify/)."""
    table = {k: (v.atol, v.rtol) for k, v in TOLERANCES.items()}
    text = (HERE / "candidates" / f"{name}.py").read_text()
    path = folder / f"{name}.py"
    path.write_text(text.replace("TOLERANCES: dict = {}", f"TOLERANCES: dict = {table!r}"))
    return path


@pytest.fixture(scope="module")
def edge_results(tmp_path_factory):
    record_dir = tmp_path_factory.mktemp("run")
    names = ["good_rmsnorm", "perturbed_half_tol", "perturbed_double_tol"]
    paths = [HERE / "candidates" / "good_rmsnorm.py",
             *(with_tolerances(n, record_dir) for n in names[1:])]
    got = verify_candidates(RMSNORM, paths, CASES,
                            device=DEVICE, trials=2, record_dir=record_dir, fail_fast=False,
                            jobs=2, timing=True)
    return record_dir, dict(zip(names, got))


def test_right_kernel_is_accepted_with_a_complete_record(edge_results):
    record_dir, results = edge_results
    result = results["good_rmsnorm"]
    assert result.verdict == "accepted", result.reasons
    assert {c["name"] for c in result.checks} == ALL_CHECKS
    record = json.loads(
        (record_dir / "verification" / "test_rmsnorm" / "good_rmsnorm.json").read_text())
    assert record["schema_version"] == 1
    assert record["verdict"] == "accepted" and record["reasons"] == []
    labels = [e["label"] for e in expand_cases(RMSNORM, CASES)]
    assert [e["case"] for e in record["errors"]] == labels  # max errors for every case
    for e in record["errors"]:
        assert e["reference_dtype"] == "float64"
        # the memoisation probes run on the given cases only
        memo = {"same_buffers", "same_prefix"} if e["case"] in ("c0", "c1", "c2") else set()
        assert set(e["by_kind"]) == {"random", "large", "tiny", "mixed", "equal", "nonfinite",
                                     *memo}
    assert record["seeds"]["master"] == 0
    assert set(record["seeds"]["input_sets"]) == set(labels)
    assert record["environment"]["tolerances"]["bfloat16"]["rtol"] > 0
    assert len(record["source_sha256"]) == 64


def test_timing_is_labelled_and_never_a_speedup_off_the_gpu(edge_results):
    timing = edge_results[1]["good_rmsnorm"].timing
    assert [row["case"] for row in timing["cases"]] == ["c0", "c1", "c2"]  # given cases only
    row = timing["cases"][0]
    assert row["candidate"]["median_ms"] > 0 and row["candidate"]["gbps"] > 0
    if DEVICE == "cpu":
        assert timing["meaningful"] is False
        assert timing["reason"] == "CPU / Triton interpreter: not a GPU timing"
        assert row["candidate"]["meaningful"] is False and "speedup" not in row
        stream = [c for c in edge_results[1]["good_rmsnorm"].checks
                  if c["name"] == "default_stream"]
        assert all(c["skipped"] and "CPU" in c["detail"] for c in stream)
    else:
        assert timing["meaningful"] is True and row["speedup"] > 0 and "copy" in row


def test_half_the_tolerance_passes_twice_fails_in_every_dtype(edge_results):
    results = edge_results[1]
    half, double = results["perturbed_half_tol"], results["perturbed_double_tol"]
    assert half.verdict == "accepted", half.reasons
    for given in ("c0", "c1", "c2"):  # float32, float16, bfloat16
        worst = next(e["worst_ratio"] for e in half.errors if e["case"] == given)
        assert 0.3 < worst <= 1.0  # random inputs; stress may reach the baseline's own error
    assert double.verdict == "rejected"
    failed_cases = {c["case"] for c in double.checks if c["name"] == "numerics"
                    and not c["passed"]}
    assert {"c0", "c1", "c2"} <= failed_cases
    assert double.failed() <= {"numerics", "memoisation", "stress", "nonfinite"}


def test_crash_and_hang_fail_cleanly_and_the_next_candidate_is_verified(tmp_path):
    crash = verify_candidate(RMSNORM, HERE / "cheats" / "crash_segfault.py", [CASE_FP32],
                             device=DEVICE, record_dir=tmp_path)
    hang = verify_candidate(RMSNORM, HERE / "cheats" / "hang.py", [CASE_FP32], device=DEVICE,
                            timeout_s=5)
    after = verify_candidate(RMSNORM, HERE / "candidates" / "good_rmsnorm.py", [CASE_FP32],
                             device=DEVICE, trials=1, timing=False)
    assert crash.failed() == {"crash"} and "SIGSEGV" in crash.reasons[0]
    saved = json.loads(Path(crash.record_path).read_text())
    assert saved["verdict"] == "rejected" and saved["checks"][-1]["name"] == "crash"
    assert hang.failed() == {"timeout"}
    assert "5 s" in hang.reasons[0] and "c0: random trial 0" in hang.reasons[0]
    assert hang.duration_s < 15
    assert after.verdict == "accepted", after.reasons


def test_family_specs_params_and_names():
    assert family_spec(RMSNORM) == "verify_families:RMSNORM"
    assert family_spec("verify_families:RMSNORM") == "verify_families:RMSNORM"
    assert case_params(RMSNORM, CASE_FP32) == {"eps": 1e-6}
    assert candidate_name("runs/x/candidates/rms/v3/kernel.py") == "v3"
    assert candidate_name("cheats/hang.py") == "hang"
    labels = [e["label"] for e in expand_cases(RMSNORM, [CASE_FP32, CASE_FP32])]
    assert labels == ["c0", "c0.e0", "c0.e1", "c0.e2"]  # duplicates dropped


def test_caller_mistakes_raise():
    with pytest.raises(ValueError):
        verify_candidate(RMSNORM, HERE / "candidates" / "good_rmsnorm.py", [], device=DEVICE)


def test_the_zygote_leaves_quietly_when_its_caller_is_gone(tmp_path):
    """A caller killed at a time limit closes the zygote's stdout before the zygote answers a
    job with its child's pid: the zygote exits 0 without a traceback in the user's terminal."""
    import subprocess
    import sys

    code = (f"import sys; sys.path[:0] = {sys.path!r}; "
            "from verify.worker import serve; serve()")
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    proc.stdout.close()  # the caller's end of the pid pipe, gone
    proc.stdin.write(f"{tmp_path / 'no-such-job'}\n".encode())
    proc.stdin.flush()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0
    assert b"Traceback" not in err and b"BrokenPipe" not in err

"""`pipeline profile` end to end through click on a tiny model on the CPU, and bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from core.artifacts import read_json

# this checkout, not whichever the environment installed (an editable install of another)
REPO = Path(__file__).resolve().parents[2]


def run_cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "pipeline", *args], capture_output=True,
                          text=True, cwd=cwd, timeout=600,
                          env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin",
                               "HOME": str(cwd or "."), "PYTHONPATH": str(REPO)})


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    proc = run_cli("profile", "tiny-llama", "--batch", "1,2", "--seq", "16", "--device", "cpu",
                   "--run-dir", str(run_dir), cwd=run_dir)
    assert proc.returncode == 0, proc.stderr
    return run_dir, proc


def test_profile_writes_a_valid_profile(profiled):
    run_dir, proc = profiled
    prof = read_json(run_dir / "profile.json", "profile")
    assert prof["model"]["weights"] == "random"
    assert [w["key"] for w in prof["workloads"]] == ["prefill-b1-s16-fp32", "prefill-b2-s16-fp32"]
    for w in prof["workloads"]:
        assert (run_dir / w["trace"]).exists()
        shares = sum(o["share"] for o in w["ops"]) + w["rest_share"]
        assert shares == pytest.approx(1.0, abs=1e-9)
        assert w["rest_share"] >= -1e-9
        assert w["wall"]["median_ms"] > 0
        linear = [o for o in w["ops"] if o["name"] == "aten::linear"]
        assert len(linear) == 2 * 7 + 1
        assert any(o["module"] == "model.layers.1.mlp.down_proj" for o in linear)
        assert all(o["shapes"] for o in linear)
    assert "aten::linear" in proc.stdout
    # the two times of a pass are told apart, and a CPU op has one time column, not two
    out = " ".join(proc.stdout.split())
    assert "timed without the profiler: shares are of this time" in out
    assert "the same pass under the profiler, which adds its own cost to every op" in out
    assert "ms: the op's CPU time under the profiler" in out and "cpu ms" not in out
    ranking = json.loads((run_dir / "ranking.json").read_text())
    assert len(ranking["workloads"]) == 2


@pytest.mark.parametrize("args, message", [
    (["profile", "no-such-model-xyz"], "a local folder with the model's config.json works"),
    (["profile", "tiny-llama", "--batch", "0"], "--batch"),
    (["profile", "tiny-llama", "--seq", "abc"], "--seq"),
    (["profile", "tiny-llama", "--dtype", "int3"], "unknown dtype"),
    (["profile", "tiny-llama", "--device", "cuda"], "no CUDA GPU"),
    (["rank", "/nonexistent/run"], "no such directory: /nonexistent/run"),
    (["report", "/nonexistent/run"], "no such directory: /nonexistent/run"),
    # a path that does not exist is not an unknown model
    (["optimize", "/nonexistent"], "no such directory: /nonexistent"),
    (["profile", "./no/such/folder"], "no such directory"),
    # beside runs/ (made below), `runs/NAME` is a mistyped run directory, not a hub id
    (["optimize", "runs/tiny-llama-2026"], "no such directory: runs/tiny-llama-2026; did you "
                                           "mean runs/tiny-llama-20260101T000000Z?"),
    (["profile", "broken"], "broken/config.json is not valid JSON (line 1, column 24)"),
])
def test_bad_input_is_one_line_and_exit_2(args, message, tmp_path):
    if "cuda" in args:
        import torch

        if torch.cuda.is_available():
            pytest.skip("a GPU is present")
    (tmp_path / "runs" / "tiny-llama-20260101T000000Z").mkdir(parents=True)
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text('{"model_type": "llama",')
    proc = run_cli(*args, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and message in err[0], proc.stderr


def test_decode_step_keeps_the_cache_length(tmp_path):
    """Decode workloads time one token against a KV cache of --seq, every call."""
    import torch

    from core.workload import Workload
    from models.graphs import output_cache
    from profiling.capture import make_runner
    from profiling.loader import build, resolve

    model = build(resolve("tiny-llama"), torch.float32, "cpu")
    runner = make_runner(model, Workload(2, 16, mode="decode"))
    assert tuple(runner.input_ids.shape) == (2, 1)
    for _ in range(3):
        with torch.no_grad():
            out = runner.call()
        assert tuple(out.logits.shape[:2]) == (2, 1)
        cache = output_cache(out)
        assert cache.get_seq_length() == 17
        runner.reset()
        assert cache.get_seq_length() == 16


def test_every_workload_is_timed_before_any_profiler_session(tmp_path, call_order):
    """A profiler session leaves CUPTI attached on a GPU and every later launch slower: the
    unprofiled wall times of all workloads come before the first capture."""
    import pipeline.stages.profile as ps
    from core.workload import Workload
    from profiling.loader import resolve

    order = call_order(ps, wall_time="wall", capture="capture")
    workloads = [Workload(1, 8, "float32", "cpu", "prefill"),
                 Workload(1, 8, "float32", "cpu", "decode")]
    profile = ps.run_profile(resolve("tiny-llama"), workloads, tmp_path)
    assert order == ["wall", "wall", "capture", "capture"]
    assert [w["key"] for w in profile["workloads"]] == [w.key for w in workloads]
    assert all(w["wall"]["median_ms"] > 0 for w in profile["workloads"])


def test_optimize_on_a_gpu_profiles_in_a_child_process(monkeypatch):
    """`optimize MODEL_ID` on a GPU runs `pipeline profile` in its own process (its profiler
    sessions would leave CUPTI attached to this one, which then times the model); the child's
    failure ends the command with the child's exit status."""
    import subprocess

    from click.testing import CliRunner

    import pipeline.cli as cli

    seen = []
    monkeypatch.setattr(cli, "_defaults", lambda dtype, device: ("bf16", "cuda"))
    monkeypatch.setattr(subprocess, "run", lambda args, **_: seen.append(args) or
                        subprocess.CompletedProcess(args, 3))
    got = CliRunner().invoke(cli.cli, ["optimize", "tiny-llama", "--batch", "2", "--seq", "16",
                                       "--mode", "prefill,decode"])
    assert got.exit_code == 3
    [args] = seen
    assert args[1:4] == ["-m", "pipeline", "profile"]
    assert args[4:] == ["tiny-llama", "--batch", "2", "--seq", "16", "--mode", "prefill,decode",
                        "--top", "5"]


def test_profile_output_is_plain_progress_lines_without_profiler_noise(profiled):
    """Piped (not a TTY): one line per step with the elapsed seconds; no Kineto USDT lines, no
    warnings."""
    import re

    _, proc = profiled
    lines = proc.stdout.splitlines()
    steps = [m for m in (re.match(r"\[\s*(\d+\.\d) s\] profiling: (.+)", x) for x in lines) if m]
    assert [m.group(2) for m in steps][:3] == ["start", "[prefill-b1-s16-fp32]",
                                              "building tiny-llama (random weights, float32, "
                                              "cpu)"], proc.stdout[:2000]
    times = [float(m.group(1)) for m in steps]
    assert times == sorted(times) and "timing without the profiler" in proc.stdout
    assert "USDT" not in proc.stdout + proc.stderr, proc.stderr
    assert "Warning" not in proc.stderr, proc.stderr


def test_tiny_gpt2_builds_without_token_id_warnings(tmp_path):
    code = ("import torch; from profiling.loader import build, resolve; "
            "m = build(resolve('tiny-gpt2'), torch.float32, 'cpu'); "
            "print(m.config.bos_token_id, m.config.eos_token_id, m.config.vocab_size)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["511", "511", "512"]
    assert "token_id" not in proc.stderr, proc.stderr


def test_a_config_that_fails_validation_says_why_in_one_line(tmp_path):
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 100, "num_attention_heads": 3,
        "num_hidden_layers": 1, "intermediate_size": 64, "vocab_size": 100}))
    proc = run_cli("profile", str(tmp_path / "bad"), "--seq", "8", cwd=tmp_path)
    assert proc.returncode != 0
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and "not a multiple of the number of attention heads" in err[0], err
    assert "Traceback" not in proc.stderr


def test_a_local_folder_names_the_run_and_the_report_by_its_own_name(tmp_path):
    """An absolute folder as MODEL_ID: the run directory and the report's title carry the
    folder's name, not the whole path; the profile keeps the path to build it again."""
    from pipeline.report import write_report

    folder = tmp_path / "models" / "my-llama"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 64, "intermediate_size": 176,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 512}))
    proc = run_cli("profile", str(folder), "--seq", "8", "--device", "cpu", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    [run] = (tmp_path / "runs").iterdir()
    assert run.name.startswith("my-llama-"), run.name
    assert read_json(run / "profile.json", "profile")["model"]["id"] == str(folder)
    md = Path(write_report(run)["markdown"]).read_text()
    assert md.splitlines()[0] == "# Kernel report: my-llama"


def test_mode_both_is_prefill_and_decode():
    from pipeline.cli import _modes

    assert _modes("both") == "prefill,decode"
    assert _modes("prefill") == "prefill"


# Ctrl-C sends SIGINT; `timeout` and batch schedulers stop a run with SIGTERM, which exits 143
# (128 + 15), as a process killed by TERM would
STOPS = {"SIGINT": (130, "interrupted"), "SIGTERM": (143, "terminated")}


@pytest.mark.parametrize("stop", sorted(STOPS))
def test_a_stopped_optimize_says_how_to_resume_in_one_line(stop, profiled, tmp_path):
    """The real signal, sent to a real `pipeline optimize` while it generates kernels (click
    turned the KeyboardInterrupt into its own Abort, and the run printed only `aborted`)."""
    import os
    import shutil
    import signal

    rc, said = STOPS[stop]
    run = tmp_path / "run"
    shutil.copytree(profiled[0], run)
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipeline", "optimize", str(run), "--top", "3"], cwd=tmp_path,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path),
             "PYTHONPATH": str(REPO)},
        # a shell's background job (and so a test runner's child) may inherit SIGINT ignored,
        # and Python then installs no Ctrl-C handler; a terminal's foreground job has it
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        seen = []
        for line in proc.stdout:  # progress lines: signal once generating has begun
            seen.append(line)
            if "optimize: generate" in line:
                break
        assert proc.poll() is None, "".join(seen) + proc.stderr.read()
        os.kill(proc.pid, getattr(signal, stop))
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == rc, err
    assert err.strip().splitlines() == [
        f"{said}; resume with `pipeline optimize {run} --resume`"], err


def test_the_verify_zygote_ignores_ctrl_c():
    """A terminal's Ctrl-C goes to the whole foreground group; the zygote and its children
    must not answer it with a KeyboardInterrupt traceback (the caller decides)."""
    import os
    import signal
    import time

    from verify.worker import _Zygote

    z = _Zygote()
    try:
        time.sleep(1.0)
        os.kill(z.proc.pid, signal.SIGINT)
        time.sleep(0.5)
        assert z.proc.poll() is None, "the zygote died of SIGINT"
    finally:
        z.close()


def test_a_model_without_sdpa_attention_is_profiled_with_its_eager_attention(tmp_path):
    """transformers gives Gemma-2 (attention logit soft-capping) no SDPA path and refused the
    build outright when asked for one; the model is built with its eager attention, said in
    the profile's model notes."""
    (tmp_path / "gemma2").mkdir()
    (tmp_path / "gemma2" / "config.json").write_text(json.dumps({
        "model_type": "gemma2", "hidden_size": 64, "intermediate_size": 176, "head_dim": 16,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 512, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}))
    proc = run_cli("profile", str(tmp_path / "gemma2"), "--seq", "8", "--device", "cpu",
                   "--run-dir", str(tmp_path / "run"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    model = read_json(tmp_path / "run" / "profile.json", "profile")["model"]
    assert model["model_type"] == "gemma2"
    assert any("eager attention" in n for n in model["notes"]), model["notes"]


def test_a_step_that_runs_long_says_so_again_in_a_log(capsys):
    """Off a terminal (a redirected log), a step that outlasts the heartbeat is told again with
    how long it has run; a short one is not."""
    import time

    from rich.console import Console

    from pipeline.progress import progress

    with progress(Console(), "profiling", heartbeat_s=0.3) as say:
        say("quick")
        say("building")
        time.sleep(1.0)
        say("done")
    lines = [x.split("] ", 1)[1] for x in capsys.readouterr().out.splitlines()]
    assert lines[:3] == ["profiling: start", "profiling: quick", "profiling: building"]
    beats = [x for x in lines if "still running" in x]
    assert beats and all(x.startswith("profiling: building: still running, ") for x in beats)
    assert lines[-1] == "profiling: done" and 2 <= len(beats) <= 4, lines


def test_a_large_model_on_the_cpu_is_named_with_its_size_before_it_is_built(monkeypatch):
    import pipeline.stages.profile as ps
    from core.workload import Workload
    from profiling.loader import resolve

    monkeypatch.setattr(ps, "ceilings", lambda device: {"matmul_TFLOPs": 1.0})
    note = ps.cpu_size_note(resolve("llama-3.2-1b"), [Workload(2, 64)])
    # 1.236 B parameters, 4 bytes each; 30 passes of 2 flops per parameter and token
    assert note.startswith("llama-3.2-1b has 1.24 B parameters: 4.6 GiB in float32 on the CPU")
    assert f"about {30 * 2 * 1.2358e9 * 128 / 1e12:.0f} s" in note and "(1.00 TFLOP/s)" in note
    assert ps.cpu_size_note(resolve("tiny-llama"), [Workload(2, 64)]) is None
    assert ps.cpu_size_note(resolve("llama-3.2-1b"), [Workload(2, 64, device="cuda")]) is None


def test_profile_warns_of_a_large_model_before_building_it(monkeypatch, tmp_path):
    from click.testing import CliRunner

    import pipeline.cli as cli
    import pipeline.stages.profile as ps
    from core.errors import UserError

    def build_and_profile(*args, **kwargs):
        raise UserError("stopped where the model would be built")

    monkeypatch.setattr(ps, "ceilings", lambda device: {"matmul_TFLOPs": 1.0})
    monkeypatch.setattr(ps, "run_profile", build_and_profile)
    got = CliRunner().invoke(cli.cli, ["profile", "llama-3.2-1b", "--device", "cpu",
                                       "--run-dir", str(tmp_path)])
    assert isinstance(got.exception, UserError)
    assert "warning: llama-3.2-1b has 1.24 B parameters" in " ".join(got.output.split())

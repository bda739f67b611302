"""benchmarks/kernel_table.py on the CPU: the --dry-run driver starts one worker process per
contender (eager, ours, copy; compile and Liger only mean something on a GPU), merges their JSON
and writes the markdown table; a crashing worker becomes one line; a real run refuses here."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "kernel_table.py"
MODELS = ("llama-3.2-1b", "qwen2.5-0.5b")
# the registry's order (alphabetical): the table discovers its families there
FAMILIES = ("add_rmsnorm", "gated_act", "kv_cache", "rmsnorm", "rope")


def run_script(*args, timeout=120):
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "PYTHONPATH": path})


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("kernels")
    # at most 4 configs per case: the interpreter is slow, and the option is tested with it
    proc = run_script("--dry-run", "--out", str(out), "--contenders", "eager,ours,copy",
                      "--max-configs", "4")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads((out / "kernels.json").read_text()), (out / "kernels.md").read_text()


def test_every_family_of_both_models_is_checked_then_timed(dry_run):
    merged, _ = dry_run
    assert {c: w["status"] for c, w in merged["workers"].items()} == \
        {"eager": "ok", "ours": "ok", "copy": "ok"}
    assert list(merged["models"]) == list(MODELS)
    for model in MODELS:
        assert list(merged["models"][model]) == list(FAMILIES)
        for fam, row in merged["models"][model].items():
            eager, ours, copy = (row["contenders"][c] for c in ("eager", "ours", "copy"))
            # the family reference repeats the HF code, so eager matches it bit for bit
            assert eager["status"] == "ok" and eager["max_abs_err"] == 0.0, (model, fam, eager)
            # ours rounds once where HF rounds twice: a few bf16 ulps at |x| ~ 8, no more
            assert ours["status"] == "ok" and ours["max_abs_err"] <= 0.25, (model, fam, ours)
            assert 1 <= ours["configs_ok"] <= ours["configs_tried"] <= 4 and ours["config"], ours
            # every config tried is listed, and the one reported is the fastest of them
            assert len(ours["configs"]) == ours["configs_tried"]
            assert ours["median_us"] == min(c["median_us"] for c in ours["configs"]
                                            if c["status"] == "ok")
            assert copy["status"] == "ok" and copy["median_us"] > 0
            assert row["min_bytes"] > 0 and row["best"] in ("eager", "ours")
            assert ours["pct_same_byte_copy"] == pytest.approx(
                100 * copy["median_us"] / ours["median_us"])
            assert ours["speedup_vs_eager"] == pytest.approx(
                eager["median_us"] / ours["median_us"])
        assert merged["models"][model]["rmsnorm"]["case"]["rows"] == 4  # toy shapes
        # HF's rotary tables: the case the pipeline records, so ours reads half of each row
        assert merged["models"][model]["rope"]["case"]["equal_halves"] is True
    assert merged["large_copy"]["gbps"] > 0 and merged["dry_run"] is True


def test_markdown_has_one_row_per_family_and_model(dry_run):
    _, md = dry_run
    assert "DRY RUN" in md and "Command: `" in md
    for model in MODELS:
        section = md.split(f"## {model}\n")[1].split("\n## ")[0]
        rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in section.splitlines()
                if ln.startswith("| ") and not ln.startswith("| family")]
        assert [r[0] for r in rows] == list(FAMILIES)
        for r in rows:
            assert len(r) == 10 and r[2] == "-" and r[3] == "-", r  # compile, liger not run
            assert float(r[1]) > 0 and float(r[4]) > 0, r  # eager and ours timed
            assert r[9] in ("eager", "ours")


def test_a_crashing_worker_is_one_line_and_the_table_still_written(tmp_path):
    proc = run_script("--dry-run", "--out", str(tmp_path), "--contenders", "copy",
                      "--models", "no-such-model")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    merged = json.loads((tmp_path / "kernels.json").read_text())
    status = merged["workers"]["copy"]["status"]
    assert status.startswith("failed: rc 1") and "no-such-model" in status and "\n" not in status
    cell = merged["models"]["no-such-model"]["rmsnorm"]["contenders"]["copy"]
    assert cell["status"] == status
    assert "| rmsnorm | - | - | - | - |" in (tmp_path / "kernels.md").read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_a_real_run_refuses_without_a_gpu(tmp_path):
    proc = run_script("--out", str(tmp_path / "out"), timeout=60)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert "no CUDA GPU" in proc.stderr and not (tmp_path / "out").exists()


@pytest.mark.parametrize("model, act", [("phi-3-mini", "silu"), ("gemma-2b", "gelu_tanh")])
def test_held_out_mlps_are_benched_with_their_own_activation(model, act):
    """Phi-3's MLP holds `activation_fn`, not `act_fn`, and Gemma's is GeGLU: the gated
    families' cases and HF contenders follow the model (both had been silu on `act_fn`)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import kernel_table
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    from codegen.matmul_epilogue.reference import gated_gemm, make_inputs

    setup = kernel_table.model_setup(model, True, ["gated_act", "matmul_epilogue"])
    case = setup["cases"]["matmul_epilogue"]
    assert case["act"] == setup["cases"]["gated_act"]["act"] == act
    assert case.get("weights") == ("packed" if model == "phi-3-mini" else None)
    case = {**case, "dtype": "float32"}
    inputs = make_inputs(case, generator=torch.Generator().manual_seed(0))
    hf = kernel_table.bench_module("matmul_epilogue").hf(setup, inputs, "cpu")
    torch.testing.assert_close(hf(*inputs), gated_gemm(*inputs, act=act))
    from codegen.gated_act.reference import gated_act
    from codegen.gated_act.reference import make_inputs as act_inputs

    case = {**setup["cases"]["gated_act"], "dtype": "float32"}
    assert case["layout"] == ("packed" if model == "phi-3-mini" else "separate")
    inputs = act_inputs(case, generator=torch.Generator().manual_seed(0))
    hf = kernel_table.bench_module("gated_act").hf(setup, inputs, "cpu")
    torch.testing.assert_close(hf(*inputs), gated_act(*inputs, act=act))

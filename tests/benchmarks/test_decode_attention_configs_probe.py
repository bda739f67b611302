"""benchmarks/probes/decode_attention_configs.py, checked on the CPU before any GPU time goes to
it: without CUDA it stops with one line; its own code (inputs, rendering every config, the
error checks, the table) runs end to end under the interpreter at a small fp32 case, the graph
timing replaced by one call of each function; a config that fails is a row of the table."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
PROBE = ROOT / "benchmarks" / "probes" / "decode_attention_configs.py"
sys.path.insert(0, str(PROBE.parent))
import decode_attention_configs as probe  # noqa: E402


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU message")
def test_without_cuda_it_stops_with_one_line():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(PROBE)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        "decode_attention_configs: needs a CUDA GPU (torch.cuda.is_available() is False)"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's run of the probe")
def test_the_probe_renders_checks_and_tabulates_every_config(monkeypatch):
    from codegen.decode_attention import bench, kernel

    calls = []

    def one_call(fns):  # the CUDA graph's stand-in: the first call, a fake time per call
        fns[0]()
        calls.append(len(fns))
        return 10.0 if len(fns) == probe.WARM_CALLS else 20.0

    monkeypatch.setattr(bench, "graph_us", one_call)
    for name, value in {"DEVICE": "cpu", "DTYPE": "float32", "HEADS": 8, "KV_HEADS": 2,
                        "HEAD_DIM": 16, "SLOTS": 256, "LENGTH": 200}.items():
        monkeypatch.setattr(probe, name, value)
    render = kernel.render

    def failing_render(config, case):  # the one-split config fails to render
        if config["SPLITS"] == 1:
            raise RuntimeError("out of resources: shared memory\nmore text")
        return render(config, case)

    monkeypatch.setattr(kernel, "render", failing_render)
    result = probe.run()
    case = result["case"]
    space = kernel.search_space(case)
    assert [r["config"] for r in result["rows"][1:]] == [probe._label(c) for c in space]
    sdpa, *configs = result["rows"]
    assert sdpa["kernels"] is None and sdpa["max_abs_err"] < 1e-5
    failed = [r for r in configs if "error" in r]
    assert [r["config"] for r in failed] == [probe._label(space[-1])]
    assert failed[0]["error"] == "RuntimeError: out of resources: shared memory"
    for r in configs[:-1]:
        assert r["ok"] and r["max_abs_err"] < 1e-5 and r["warm_us"] == 10.0
        assert r["warm_GBps"] == pytest.approx(result["kv_bytes"] / 10.0 / 1e3)
    assert set(calls) == {probe.WARM_CALLS, result["cold_caches"]}
    text = probe.table(result)
    assert "| HF sdpa_attention_forward (SDPA) | - | 10.00 | " in text
    assert f"| {probe._label(space[0])} | 1 | 10.00* |" in text
    assert f"| {probe._label(space[-1])} | 1 | failed: RuntimeError: out of resources" in text

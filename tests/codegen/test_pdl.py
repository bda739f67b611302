"""Programmatic dependent launch (codegen/pdl.py): the launcher's per-launch switch, off on the
CPU and wherever it cannot run, the escape hatch, every decode-path kernel's PDL constexpr
(last, off by default, so the interpreter never meets a griddepcontrol instruction), and the
sm_90 PTX of each with PDL on: weights may load before `griddepcontrol.wait`, nothing the
step writes is read or written before it."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from codegen import pdl
from codegen.launch import launcher

ROOT = Path(__file__).resolve().parents[2]


class FakeKernel:
    """What `launcher` reads of a JIT function, recording each launch's keyword arguments."""

    def __init__(self):
        self.launches: list[dict] = []

        def fn(x_ptr, n, BLOCK, PDL=False):  # noqa: N803 - Triton's constexpr style
            pass
        self.fn = fn

    def __getitem__(self, grid):
        return lambda *args, **kw: self.launches.append(kw)


@pytest.fixture
def pdl_here(monkeypatch):
    from codegen import launch

    monkeypatch.setattr(launch, "pdl_hardware_reason", lambda: None)
    monkeypatch.delenv(pdl.NO_PDL_ENV, raising=False)


def test_launcher_keeps_pdl_off_where_it_cannot_run():
    assert pdl.hardware_reason() is not None  # the CPU tests run the interpreter
    kernel = FakeKernel()
    launch = launcher(kernel, BLOCK=64, num_warps=4)
    with pdl.enabled() as on:
        assert on is False and pdl.STATE.on is False
        launch((1,), "x", 3)
    assert kernel.launches == [{"BLOCK": 64, "PDL": False, "num_warps": 4}]
    assert pdl.launch_options() == {}


def test_launcher_switches_per_launch_where_pdl_can_run(pdl_here):
    kernel = FakeKernel()
    launch = launcher(kernel, BLOCK=64, num_warps=4)
    launch((1,), "x", 3)
    with pdl.enabled() as on:
        assert on is True
        launch((1,), "x", 3)
        assert pdl.launch_options() == {"PDL": True, "launch_pdl": True}
    launch((1,), "x", 3)
    assert [k["PDL"] for k in kernel.launches] == [False, True, False]
    assert [k.get("launch_pdl") for k in kernel.launches] == [None, True, None]
    assert pdl.STATE.on is False


def test_a_caller_binding_pdl_itself_gets_no_switch(pdl_here):
    kernel = FakeKernel()
    launch = launcher(kernel, BLOCK=64, PDL=False)
    with pdl.enabled():
        launch((1,), "x", 3)
    assert kernel.launches == [{"BLOCK": 64, "PDL": False}]


@pytest.mark.parametrize("value,off", [("1", True), ("yes", True), ("0", False), ("", False)])
def test_the_environment_forces_pdl_off(pdl_here, monkeypatch, value, off):
    monkeypatch.setenv(pdl.NO_PDL_ENV, value)
    kernel = FakeKernel()
    launch = launcher(kernel, BLOCK=64)
    with pdl.enabled() as on:
        launch((1,), "x", 3)
    assert on is not off and kernel.launches[0]["PDL"] is not off
    assert (pdl.unavailable() is not None) is off


def test_pdl_keeps_the_launcher_and_the_candidates_exportable(tmp_path):
    """pipeline/export.py copies codegen/launch.py into a package that has no project to
    import, and refuses a candidate importing the project beyond codegen.launch: the PDL
    switch lives in launch.py, and decode_attention's direct launches take it from there."""
    import ast
    from types import SimpleNamespace

    from codegen.decode_attention.kernel import render, search_space
    from pipeline.export import _source

    tree = ast.parse((ROOT / "codegen" / "launch.py").read_text())
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom | ast.Import)
                and any(a.name.startswith("codegen") for a in n.names)
                or isinstance(n, ast.ImportFrom) and (n.module or "").startswith("codegen")]
    case = {"head_dim": 64, "dtype": "bfloat16", "batch": 1, "heads": 4, "kv_heads": 2,
            "slots": 64, "scale": 0.125}
    path = tmp_path / "decode_attention.py"
    path.write_text(render(search_space(case)[0], case))
    text, why = _source(SimpleNamespace(source=str(path)), tmp_path)  # an Accepted's field
    assert why is None and "from .._launch import pdl_options" in text


def _decode_kernels() -> dict:
    sys.path.insert(0, str(Path(__file__).parent))
    try:
        from pdl_ptx import KERNELS
    finally:
        sys.path.pop(0)
    return KERNELS


def test_every_decode_kernel_takes_pdl_last_and_off_by_default():
    """The interpreter never runs a griddepcontrol instruction: PDL is False unless bound, and
    `launcher` binds it True only where `hardware_reason` is None (never under it)."""
    for name, (kernel, _, _) in _decode_kernels().items():
        params = list(inspect.signature(kernel.fn).parameters.values())
        assert params[-1].name == "PDL" and params[-1].default is False, name


def _has_gdc() -> bool:
    try:
        from triton.language.extra.cuda import gdc_wait  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not _has_gdc(), reason="this Triton has no griddepcontrol (gdc_wait)")
def test_sm90_ptx_waits_before_touching_the_steps_tensors():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, str(Path(__file__).parent / "pdl_ptx.py")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    facts = json.loads(done.stdout.strip().splitlines()[-1])
    for name, f in facts.items():
        if name == "gemv_without_pdl":
            assert f["wait"] is None and f["launch"] is None  # PDL off: none of it
            continue
        assert f["wait"] is not None and f["launch"] is not None, name
        assert f["wait"] < f["launch"], name  # a successor starts one kernel ahead, no more
        assert f["stores_before_wait"] == 0, name  # no write before the predecessor is done
        if name in ("gemv", "gemv_fused", "gated_gemv", "qkv", "rmsnorm", "add_rmsnorm"):
            assert f["loads_before_wait"] > 0, name  # the weights' first loads overlap
        else:
            assert f["loads_before_wait"] == 0, name  # activations only after the wait
    assert facts["qkv"]["waits"] == 3  # one in each of the q, k and v programs' paths


# every family a graphed decode step runs (benchmarks/gpu_decode.sh's FAMILIES)
DECODE_FAMILIES = ("gemv", "qkv_proj", "matmul_epilogue", "decode_attention", "kv_cache",
                   "rope", "rmsnorm", "add_rmsnorm")


def _patch_decode_families(model, tmp_path) -> list:
    """Undos of every decode family patched on `model`, one candidate per case (the last
    config of each space: a Triton kernel, never gemv's cuBLAS entry, which is first)."""
    import importlib

    from family_checks import CountingChooser

    undos = []
    for name in DECODE_FAMILIES:
        family = importlib.import_module(f"codegen.{name}").FAMILY
        (tmp_path / name).mkdir(exist_ok=True)
        undos.append(family.patch(model, CountingChooser(family, tmp_path / name)))
    return undos


@pytest.mark.gpu
def test_graphed_decode_step_with_pdl_matches_it_without(tmp_path):
    """tiny-llama's step captured twice over our decode kernels, with PDL and without: at
    successive positions (the KV append advances the position on the device, the attention
    reads it) the two replays give the same logits, and both the eager step's."""
    import torch

    from models.graphs import StaticDecoder
    from profiling.loader import build, resolve

    if pdl.unavailable() is not None:
        pytest.skip(f"PDL cannot run here: {pdl.unavailable()}")
    torch.manual_seed(0)
    model = build(resolve("tiny-llama"), torch.bfloat16, "cuda").eval()
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 500, (1, 12), generator=gen).cuda()
    steps = torch.randint(3, 500, (1, 4), generator=gen).cuda()
    undos = _patch_decode_families(model, tmp_path)
    try:
        decoders = [StaticDecoder(model, 1, 32, graph=True),
                    StaticDecoder(model, 1, 32, graph=True, capture_context=pdl.enabled),
                    StaticDecoder(model, 1, 32, graph=False)]
        for dec in decoders:
            dec.prefill(prompt)
        for i in range(steps.shape[1]):
            plain, with_pdl, eager = (dec.step(steps[:, i:i + 1]).clone() for dec in decoders)
            torch.testing.assert_close(with_pdl, plain, atol=1e-2, rtol=1e-2)
            torch.testing.assert_close(with_pdl, eager, atol=2e-2, rtol=2e-2)
        assert pdl.STATE.on is False
        for dec in decoders:
            dec.close()
    finally:
        while undos:
            undos.pop()()

"""Programmatic dependent launch (codegen/pdl.py): the launcher's per-launch switch, off on the
CPU and wherever it cannot run, the escape hatches (PDL, and its L2 prefetch alone), every
decode-path kernel's PDL constexpr (last, off by default, so the interpreter never meets a
griddepcontrol instruction) and the weight streamers' PREFETCH just before it, the generated
norm-fused candidates carrying both, and the sm_90 PTX of each with PDL on: weights may load
(and the slab be prefetched) before `griddepcontrol.wait`, nothing the step writes is read or
written before it."""

from __future__ import annotations

import inspect
import sys
from contextlib import nullcontext
from functools import partial
from pathlib import Path

import pytest

from codegen import pdl
from codegen.launch import launcher

ROOT = Path(__file__).resolve().parents[2]


class FakeKernel:
    """What `launcher` reads of a JIT function, recording each launch's keyword arguments;
    `prefetch`: a weight streamer's, with PREFETCH before PDL."""

    def __init__(self, prefetch: bool = False):
        self.launches: list[dict] = []

        def fn(x_ptr, n, BLOCK, PDL=False):  # noqa: N803 - Triton's constexpr style
            pass

        def streamer(x_ptr, n, BLOCK, PREFETCH=False, PDL=False):  # noqa: N803
            pass
        self.fn = streamer if prefetch else fn

    def __getitem__(self, grid):
        return lambda *args, **kw: self.launches.append(kw)


@pytest.fixture
def pdl_here(monkeypatch):
    from codegen import launch

    monkeypatch.setattr(launch, "pdl_hardware_reason", lambda: None)
    monkeypatch.delenv(pdl.NO_PDL_ENV, raising=False)
    monkeypatch.delenv(pdl.PREFETCH_ENV, raising=False)


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


def test_a_weight_streamer_prefetches_only_with_pdl(pdl_here):
    """PREFETCH is opt-in and follows PDL: False with PDL off, False inside `enabled()`,
    True inside `enabled(prefetch=True)`; a kernel without PREFETCH never gets one."""
    streamer, plain = FakeKernel(prefetch=True), FakeKernel()
    launches = [launcher(streamer, BLOCK=64), launcher(plain, BLOCK=64)]
    contexts = [(nullcontext(), False), (pdl.enabled(prefetch=True), True),
                (pdl.enabled(), False), (pdl.enabled(on=False, prefetch=True), False)]
    for context, prefetch in contexts:
        with context:
            assert pdl.STATE.prefetch is prefetch
            for launch in launches:
                launch((1,), "x", 3)
    assert [(k["PREFETCH"], k["PDL"]) for k in streamer.launches] == [
        (False, False), (True, True), (False, True), (False, False)]
    assert [k["PDL"] for k in plain.launches] == [False, True, True, False]
    assert all("PREFETCH" not in k for k in plain.launches)
    assert pdl.STATE.on is False and pdl.STATE.prefetch is False


@pytest.mark.parametrize("value,on", [("1", True), ("yes", True), ("0", False), ("", False)])
def test_the_environment_opts_into_the_prefetch(pdl_here, monkeypatch, value, on):
    monkeypatch.setenv(pdl.PREFETCH_ENV, value)
    kernel = FakeKernel(prefetch=True)
    launch = launcher(kernel, BLOCK=64)
    with pdl.enabled() as pdl_on:
        launch((1,), "x", 3)
    with pdl.enabled(prefetch=False):  # an explicit choice beats the environment
        launch((1,), "x", 3)
    assert pdl_on is True and pdl.unavailable() is None  # PDL itself is on either way
    assert kernel.launches == [{"BLOCK": 64, "PREFETCH": on, "PDL": True, "launch_pdl": True},
                               {"BLOCK": 64, "PREFETCH": False, "PDL": True, "launch_pdl": True}]
    assert pdl.prefetch_opted_in() is on


def test_a_streamer_stays_off_where_pdl_cannot_run():
    kernel = FakeKernel(prefetch=True)
    launch = launcher(kernel, BLOCK=64)
    with pdl.enabled(prefetch=True):
        assert pdl.STATE.prefetch is False
        launch((1,), "x", 3)
    assert kernel.launches == [{"BLOCK": 64, "PREFETCH": False, "PDL": False}]


def _norm_candidate(name: str) -> str:
    """A rendered norm-fused candidate (Llama-3.2-1B's shapes, the first config)."""
    import importlib

    family = importlib.import_module(f"codegen.{name}").FAMILY
    make_case = importlib.import_module(f"codegen.{name}.reference").make_case
    case = (make_case(1, 2048, 2048, 512, 512, "bfloat16", False, (1, 1)) if name == "norm_qkv"
            else make_case(1, 2048, 8192, "bfloat16"))
    return family.render(family.search_space(case)[0], case)


@pytest.mark.parametrize("name", ["norm_qkv", "norm_gate_up"])
def test_generated_norm_candidates_wait_under_pdl_and_prefetch_before_it(name):
    """The candidate files carry the PDL path (their kernels are rendered from source): the
    kernel takes PREFETCH and PDL last, waits and lets its successor launch only under
    `if PDL:`, and prefetches only under `if PREFETCH:` inside it (the order within it is
    the PTX test's)."""
    import ast

    text = _norm_candidate(name)
    tree = ast.parse(text)
    kernel = next(f for f in tree.body if isinstance(f, ast.FunctionDef)
                  and f.name == f"_{name}_kernel")
    assert [a.arg for a in kernel.args.args[-2:]] == ["PREFETCH", "PDL"]

    def calls(node) -> list[str]:
        return [ast.unparse(c.func) for c in ast.walk(node) if isinstance(c, ast.Call)]

    guarded: dict[str, list[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name):
            guarded.setdefault(node.test.id, []).extend(calls(node))
    everywhere = calls(tree)
    for call, flag in (("tl.extra.cuda.gdc_wait", "PDL"),
                       ("tl.extra.cuda.gdc_launch_dependents", "PDL"),
                       ("_prefetch_slab", "PREFETCH"), ("_prefetch_slab", "PDL")):
        assert 0 < everywhere.count(call) == guarded[flag].count(call), (call, flag)
    assert "prefetch.global.L2" in text  # the helper's source travels with the candidate
    assert "launcher(" in text  # PDL and PREFETCH bound per launch by codegen.launch


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
    from family_checks import compiled_script_facts

    facts = compiled_script_facts("pdl_ptx.py")
    for name, f in facts.items():
        if name == "gemv_without_pdl":
            assert f["wait"] is None and f["launch"] is None  # PDL off: none of it
            assert f["prefetches"] == 0
            continue
        assert f["wait"] is not None and f["launch"] is not None, name
        assert f["wait"] < f["launch"], name  # a successor starts one kernel ahead, no more
        assert f["stores_before_wait"] == 0, name  # no write before the predecessor is done
        if name in STREAMERS + ("rmsnorm", "add_rmsnorm", "gemv_without_prefetch"):
            assert f["loads_before_wait"] > 0, name  # the weights' first loads overlap
        else:
            assert f["loads_before_wait"] == 0, name  # activations only after the wait
        if name in STREAMERS:  # the slab's lines asked of L2 before the wait
            assert f["prefetches_before_wait"] > 0, name
        else:
            assert f["prefetches"] == 0, name
    for name in ("qkv", "norm_qkv", "qkv_dot", "norm_qkv_dot"):
        assert facts[name]["waits"] == 3  # one in each of the q, k and v programs' paths
        assert facts[name]["prefetches"] == 3 * facts[name]["prefetches_before_wait"]


# the weight-streaming kernels: PREFETCH before PDL (pdl_ptx.py's names)
STREAMERS = ("gemv", "gemv_fused", "gemv_dot", "gated_gemv", "gated_gemv_dot", "qkv",
             "qkv_dot", "norm_qkv", "norm_qkv_dot", "norm_gate_up", "norm_gate_up_dot")


def test_the_weight_streamers_take_prefetch_before_pdl():
    for name, (kernel, _, _) in _decode_kernels().items():
        params = list(inspect.signature(kernel.fn).parameters.values())
        takes = params[-2].name == "PREFETCH" and params[-2].default is False
        assert takes is (name in STREAMERS), name


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


def _layer_chain(tmp_path, device="cuda", dtype="bfloat16"):
    """(run, inputs, outputs): Llama-3.2-1B's decode chain at one row over rendered candidates,
    each kernel reading what the one before wrote: o_proj's GEMV (a -> x), norm_gate_up (x +
    residual -> normed, h, total), down_proj's GEMV split over k with its sum kernel (total +=
    h @ Wd^T), norm_qkv (total -> normed, q, k, v)."""
    import torch
    from family_checks import load_rendered

    from codegen.gemv import FAMILY as GEMV
    from codegen.gemv.reference import make_case as gemv_case
    from codegen.norm_gate_up import FAMILY as GATE_UP
    from codegen.norm_gate_up.reference import make_case as gate_up_case
    from codegen.norm_qkv import FAMILY as QKV
    from codegen.norm_qkv.reference import make_case as qkv_case

    gen = torch.Generator(device).manual_seed(0)
    o_case, d_case = gemv_case(1, 2048, 2048, dtype, False), gemv_case(1, 8192, 2048, dtype,
                                                                          False)
    g_case = gate_up_case(1, 2048, 8192, dtype)
    q_case = qkv_case(1, 2048, 2048, 512, 512, dtype, False)
    split = next(c for c in GEMV.search_space(d_case) if c.get("SPLIT_K", 1) > 1)
    o_proj = load_rendered(GEMV, GEMV.search_space(o_case)[-1], o_case, tmp_path)
    down = load_rendered(GEMV, split, d_case, tmp_path)
    gate_up = load_rendered(GATE_UP, GATE_UP.search_space(g_case)[0], g_case, tmp_path)
    qkv = load_rendered(QKV, QKV.search_space(q_case)[0], q_case, tmp_path)
    a, w_o = GEMV.make_inputs(o_case, device, gen)
    _, w_d = GEMV.make_inputs(d_case, device, gen)
    x, nw1, wg, wu, residual = GATE_UP.make_inputs(g_case, device, gen)
    g_outs = GATE_UP.make_out(g_case, (x, nw1, wg, wu, residual))
    q_inputs = QKV.make_inputs(q_case, device, gen)
    q_outs = QKV.make_out(q_case, q_inputs)

    def run():
        o_proj(a, w_o, out=x)
        gate_up(x, nw1, wg, wu, residual, out=g_outs, **GATE_UP.params(g_case))
        down(g_outs[1], w_d, out=g_outs[2], accumulate=True)
        qkv(g_outs[2], *q_inputs[1:], out=q_outs, **QKV.params(q_case))

    return run, (a, residual), (x, *g_outs, *q_outs)


@pytest.mark.gpu
def test_gpu_norm_fused_chain_with_pdl_and_prefetch_in_a_graph_matches_it_without(tmp_path):
    """The chain captured in a CUDA graph with PDL and the L2 prefetch on, and without PDL,
    replayed over fresh inputs: every output of the graph without PDL equals the eager
    chain's bit for bit (the same kernels), and of the graph with PDL within bf16's tolerance
    (the same arithmetic in the same order, compiled apart). The outputs are poisoned before
    each replay, so a kernel reading its predecessor's output before the wait reads NaN."""
    import torch

    if pdl.unavailable() is not None:
        pytest.skip(f"PDL cannot run here: {pdl.unavailable()}")
    run, inputs, outputs = _layer_chain(tmp_path)
    run()  # compiles the launchers without PDL
    with pdl.enabled(prefetch=True) as on:
        assert on and pdl.STATE.prefetch
        run()  # and with PDL and the prefetch, outside the capture
    graphs = {}
    for name, context in (("pdl", partial(pdl.enabled, prefetch=True)), ("plain", nullcontext)):
        graphs[name] = torch.cuda.CUDAGraph()
        with context(), torch.cuda.graph(graphs[name]):
            run()
    gen = torch.Generator("cuda").manual_seed(1)
    for _ in range(4):
        for t in inputs:
            t.copy_(torch.randn(t.shape, generator=gen, device="cuda") * 2)
        run()
        want = [o.clone() for o in outputs]
        for name, graph in graphs.items():
            for o in outputs:
                o.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            for o, w in zip(outputs, want, strict=True):
                if name == "plain":
                    assert torch.equal(o, w)
                else:
                    torch.testing.assert_close(o, w, atol=1e-2, rtol=1.6e-2)
    assert pdl.STATE.on is False and pdl.STATE.prefetch is False

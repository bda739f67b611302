"""Gated activation family: reference == the HF MLPs' own activation path (Llama, Gemma, Phi-3),
rendered kernels == reference, patterns == what the profile's matcher finds, per-instance
patching and undo on tiny models. CPU runs the kernels under Triton's interpreter (fp32, fp16);
bf16 kernel checks run on a GPU (the interpreter gets bf16 math wrong)."""

from __future__ import annotations

import pytest
import torch
from family_checks import (
    DEVICE,
    CountingChooser,
    assert_close,
    instance_forwards,
    load_rendered,
    profiled_occurrences,
    run_candidate,
    space_ends,
)
from transformers import GemmaConfig, LlamaConfig, Phi3Config
from transformers.models.gemma.modeling_gemma import GemmaMLP
from transformers.models.llama.modeling_llama import LlamaMLP
from transformers.models.phi3.modeling_phi3 import Phi3MLP

from codegen.gated_act import FAMILY
from codegen.gated_act.patch import find_gated_mlps
from codegen.gated_act.reference import make_case
from core.workload import Workload
from profiling.loader import build, resolve

# sigmoid(z) = 1 / (1 + exp(-z)) overflows exp for z << 0 on the way to the right 0.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
TOL = {"float32": (1e-5, 1e-5), "float16": (4e-3, 4e-3), "bfloat16": (3e-2, 3e-2)}
KERNEL_DTYPES = ["float32", "float16", pytest.param("bfloat16", marks=pytest.mark.gpu)]
FORMS = [("silu", "separate"), ("gelu_tanh", "separate"), ("silu", "packed")]
SHAPES = [(16, 176), (1, 1023), (3, 257), (2, 2048)]
HIDDEN, INTER = 32, 48


def _mlp(kind: str, dtype):
    torch.manual_seed(0)
    if kind == "llama":
        mlp = LlamaMLP(LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTER))
    elif kind == "gemma":
        mlp = GemmaMLP(GemmaConfig(hidden_size=HIDDEN, intermediate_size=INTER,
                                   hidden_act="gelu_pytorch_tanh"))
    else:
        mlp = Phi3MLP(Phi3Config(hidden_size=HIDDEN, intermediate_size=INTER))
    return mlp.to(dtype)


def _hf_activation_path(mlp, x):
    """The projection outputs the activation reads and the tensor down_proj receives."""
    seen = {}
    proj = mlp.gate_up_proj if isinstance(mlp, Phi3MLP) else None
    hooks = [mlp.down_proj.register_forward_pre_hook(
        lambda m, args: seen.__setitem__("hidden", args[0]))]
    if proj is not None:
        hooks.append(proj.register_forward_hook(lambda m, a, out: seen.__setitem__("in", (out,))))
    else:
        hooks.append(mlp.gate_proj.register_forward_hook(
            lambda m, a, out: seen.__setitem__("gate", out)))
        hooks.append(mlp.up_proj.register_forward_hook(
            lambda m, a, out: seen.__setitem__("up", out)))
    with torch.no_grad():
        mlp(x)
    for h in hooks:
        h.remove()
    inputs = seen["in"] if proj is not None else (seen["gate"], seen["up"])
    return inputs, seen["hidden"]


@pytest.mark.parametrize("kind, act", [("llama", "silu"), ("gemma", "gelu_tanh"),
                                       ("phi3", "silu")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_reference_is_bitwise_the_hf_mlp(kind, act, dtype):
    mlp = _mlp(kind, dtype)
    x = torch.randn(2, 5, HIDDEN, generator=torch.Generator().manual_seed(1)).to(dtype)
    inputs, hidden = _hf_activation_path(mlp, x)
    got = FAMILY.reference(*inputs, act=act)
    assert got.dtype == hidden.dtype and torch.equal(got, hidden)


@pytest.mark.parametrize("act, layout", FORMS)
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("rows, cols", SHAPES)
def test_rendered_matches_reference(rows, cols, dtype, act, layout, tmp_path):
    case = make_case(rows, cols, dtype, act, layout)
    configs = FAMILY.search_space(case)
    assert 1 <= len(configs) <= 18
    for config in space_ends(configs):
        out, ref = run_candidate(FAMILY, config, case, tmp_path)
        assert_close(out, ref, TOL[dtype])


def test_every_config_of_a_space_is_correct(tmp_path):
    case = make_case(3, 1500, "float16", "gelu_tanh", "separate")
    for config in FAMILY.search_space(case):
        out, ref = run_candidate(FAMILY, config, case, tmp_path)
        assert_close(out, ref, TOL["float16"])


@pytest.mark.parametrize("act, layout", FORMS)
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_edge_cases(dtype, act, layout, tmp_path):
    base = make_case(16, 176, dtype, act, layout)
    edges = FAMILY.edge_cases(base)
    assert any(c["rows"] == 1 for c in edges) and any("row_stride" in c for c in edges)
    assert all(c["cols"] == base["cols"] for c in edges)  # the width is baked into a candidate
    space = FAMILY.search_space(base)
    assert space[-1].get("FLAT")  # a flat block spans rows: strided rows must still map right
    for config in (space[0], space[-1]):
        for case in edges:
            out, ref = run_candidate(FAMILY, config, case, tmp_path, rendered_for=base)
            assert_close(out, ref, TOL[dtype])


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy, on inf inside the interpreter
def test_special_values_propagate_like_hf(tmp_path):
    case = make_case(1, 8, "float32", "silu", "separate")
    forward = load_rendered(FAMILY, FAMILY.search_space(case)[0], case, tmp_path)
    gate = torch.tensor([[float("nan"), float("inf"), float("-inf"), -100.0, 100.0, 0.0, -0.0,
                          1e-30]], device=DEVICE)
    up = torch.tensor([[1.0, 2.0, 3.0, 1.0, 0.5, float("inf"), 1.0, 1.0]], device=DEVICE)
    out = torch.empty_like(gate)
    forward(gate, up, out=out)
    assert_close(out, FAMILY.reference(gate, up, act="silu"), TOL["float32"])


def test_rendered_source_is_specialised_and_guards_its_params(tmp_path):
    case = make_case(4, 300, "float32", "gelu_tanh", "packed")
    source = FAMILY.render({"BLOCK": 512, "num_warps": 4}, case)
    for line in ("COLS = 300", "BLOCK = 512", "NUM_WARPS = 4", "GELU_TANH = True",
                 "def _gated_act_forward_kernel", "def forward(gate_up, *, out, **params)"):
        assert line in source
    forward = load_rendered(FAMILY, {"BLOCK": 512, "num_warps": 4}, case, tmp_path)
    (gate_up,) = FAMILY.make_inputs(case)
    with pytest.raises(ValueError):
        forward(gate_up, out=torch.empty(4, 300), act="silu")
    with pytest.raises(ValueError):
        forward(gate_up, out=torch.empty(4, 299), act="gelu_tanh")


@pytest.mark.parametrize("model_id, pattern, act_op", [("tiny-llama", "swiglu_mlp", "aten::silu"),
                                                       ("tiny-gemma", "geglu_mlp", "aten::gelu"),
                                                       ("tiny-phi3", "swiglu_mlp", "aten::silu")])
def test_patterns_match_the_profiled_mlps(model_id, pattern, act_op, tmp_path):
    model = build(resolve(model_id), torch.float32, "cpu")
    found = [(name, ops) for name, fam, ops in profiled_occurrences(model, tmp_path)
             if fam == "gated_act"]
    assert [name for name, _ in found] == [pattern] * 2
    for _, ops in found:
        assert {n: c for n, c in ops.items() if n in (act_op, "aten::mul")} == {act_op: 1,
                                                                             "aten::mul": 1}
        assert "aten::linear" not in ops


@pytest.mark.parametrize("model_id, layout", [("tiny-llama", "separate"),
                                              ("tiny-gemma", "separate"),
                                              ("tiny-phi3", "packed")])
def test_patch_runs_the_kernel_and_undo_restores(model_id, layout, tmp_path):
    model = build(resolve(model_id), torch.float32, DEVICE)
    ids = torch.randint(3, 500, (2, 8), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    with torch.no_grad():
        before = model(ids).logits
        chooser = CountingChooser(FAMILY, tmp_path)
        undo = FAMILY.patch(model, chooser)
        assert len(instance_forwards(model)) == 2
        patched = model(ids).logits
        undo()
        after = model(ids).logits
    assert chooser.calls == 2
    assert chooser.distinct_cases() == FAMILY.cases_from_model(model, Workload(2, 8))
    assert chooser.cases[0]["layout"] == layout
    torch.testing.assert_close(patched, before, atol=1e-4, rtol=1e-4)
    assert torch.equal(after, before)
    assert instance_forwards(model) == []


def test_separate_projections_run_as_one_gemm_without_a_weight_copy(tmp_path):
    """Patched, a Llama MLP runs one [gate; up] GEMM (gate_proj and up_proj are not called)
    over views of one buffer; undo gives each projection its own storage back, same values;
    a projection given a new weight, or a hook, meanwhile is honoured (the MLP falls back to
    calling the projections)."""
    model = build(resolve("tiny-llama"), torch.float32, DEVICE)
    mlp = find_gated_mlps(model)[0].module
    gate_w, up_w = mlp.gate_proj.weight.detach().clone(), mlp.up_proj.weight.detach().clone()
    x = torch.randn(2, 5, mlp.gate_proj.in_features,
                    generator=torch.Generator().manual_seed(0)).to(DEVICE)
    seen = []
    for proj in (mlp.gate_proj, mlp.up_proj):  # counts calls without registering a hook
        proj.forward = (lambda f: lambda *a: (seen.append(1), f(*a))[1])(proj.forward)
    with torch.no_grad():
        want = mlp(x)
        seen.clear()
        undo = FAMILY.patch(model, CountingChooser(FAMILY, tmp_path))
        got = mlp(x)
        assert seen == []
        assert mlp.up_proj.weight.data_ptr() == mlp.gate_proj.weight.data_ptr() + \
            gate_w.numel() * gate_w.element_size()
        assert torch.equal(mlp.gate_proj.weight, gate_w)
        mlp.up_proj.weight = torch.nn.Parameter(up_w * 2)
        doubled = mlp(x)
        assert len(seen) == 2
        mlp.up_proj.weight = torch.nn.Parameter(up_w)
        hooked = []
        handle = mlp.gate_proj.register_forward_hook(lambda *a: hooked.append(1))
        mlp(x)
        handle.remove()
        assert hooked == [1]
        undo()
        after = mlp(x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    ref_doubled = mlp.down_proj(torch.nn.functional.silu(mlp.gate_proj(x)) * (mlp.up_proj(x) * 2))
    torch.testing.assert_close(doubled, ref_doubled, atol=1e-5, rtol=1e-5)
    assert torch.equal(after, want)
    for proj in (mlp.gate_proj, mlp.up_proj):  # each on a storage of its own size again
        assert proj.weight.untyped_storage().nbytes() == gate_w.numel() * gate_w.element_size()
    assert torch.equal(mlp.gate_proj.weight, gate_w) and torch.equal(mlp.up_proj.weight, up_w)


def test_twins_patched_together_share_one_fused_weight(tmp_path):
    """Two twins over the same Parameters, patched at once (as the integrate and graphs stages
    do): both keep their one-GEMM MLPs over one [gate; up] buffer, undoing one leaves the other
    fused, and undoing both gives each projection its own storage back, same values."""
    from pipeline.patching import twin

    model = build(resolve("tiny-llama"), torch.float32, DEVICE)
    a, b = twin(model), twin(model)
    mlp_a, mlp_b = (find_gated_mlps(m)[0].module for m in (a, b))
    gate_w = mlp_a.gate_proj.weight.detach().clone()
    up_w = mlp_a.up_proj.weight.detach().clone()
    x = torch.randn(1, 3, gate_w.shape[1], generator=torch.Generator().manual_seed(0)).to(DEVICE)
    seen = []
    for proj in (mlp_a.gate_proj, mlp_a.up_proj):  # counts twin a's projection calls
        proj.forward = (lambda f: lambda *args: (seen.append(1), f(*args))[1])(proj.forward)
    with torch.no_grad():
        want = mlp_a(x)
        seen.clear()
        undo_a = FAMILY.patch(a, CountingChooser(FAMILY, tmp_path))
        ptr = mlp_a.gate_proj.weight.data_ptr()
        undo_b = FAMILY.patch(b, CountingChooser(FAMILY, tmp_path))
        assert mlp_a.gate_proj.weight.data_ptr() == ptr  # b's patch did not move the weights
        got_a, got_b = mlp_a(x), mlp_b(x)
        assert seen == []  # twin a still runs its one GEMM
        undo_b()
        assert mlp_a.gate_proj.weight.data_ptr() == ptr
        again_a = mlp_a(x)
        assert seen == []
        undo_a()
    for got in (got_a, got_b, again_a):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for proj, w in ((mlp_a.gate_proj, gate_w), (mlp_a.up_proj, up_w)):
        assert proj.weight.untyped_storage().nbytes() == w.numel() * w.element_size()
        assert torch.equal(proj.weight, w)


def test_gate_up_fuses_only_up_to_its_token_cut(tmp_path, monkeypatch):
    """Above GATE_UP_MAX_TOKENS tokens a call runs HF's two projections and hands the kernel
    two tensors (the wider fused GEMM ran slower there on the H200); at or below it, one GEMM
    and its halves. The cases the rank stage asks for follow the same cut, and both calls
    give the unpatched MLP's output."""
    import sys

    # the package re-exports the patch function under the module's name
    monkeypatch.setattr(sys.modules["codegen.gated_act.patch"], "GATE_UP_MAX_TOKENS", 4)
    model = build(resolve("tiny-llama"), torch.float32, DEVICE)
    mlp = find_gated_mlps(model)[0].module
    seen = []
    for proj in (mlp.gate_proj, mlp.up_proj):
        proj.forward = (lambda f: lambda *a: (seen.append(1), f(*a))[1])(proj.forward)
    gen = torch.Generator().manual_seed(0)
    small = torch.randn(1, 4, mlp.gate_proj.in_features, generator=gen).to(DEVICE)
    large = torch.randn(2, 5, mlp.gate_proj.in_features, generator=gen).to(DEVICE)
    with torch.no_grad():
        want_small, want_large = mlp(small), mlp(large)
        seen.clear()
        chooser = CountingChooser(FAMILY, tmp_path)
        undo = FAMILY.patch(model, chooser)
        got_small = mlp(small)
        assert seen == [] and chooser.cases[-1]["operands"] == "halves"
        got_large = mlp(large)
        assert len(seen) == 2 and chooser.cases[-1]["operands"] == "separate"
        undo()
    assert chooser.calls == 2
    torch.testing.assert_close(got_small, want_small, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_large, want_large, atol=1e-5, rtol=1e-5)
    operands = {w.tokens: FAMILY.cases_from_model(model, w)[0]["operands"]
                for w in (Workload(1, 4, dtype="float32"), Workload(2, 5, dtype="float32"))}
    assert operands == {4: "halves", 10: "separate"}


def test_decode_cases_have_one_row_per_sequence():
    model = build(resolve("tiny-llama"), torch.float32, "cpu")
    (case,) = FAMILY.cases_from_model(model, Workload(3, 64, mode="decode", dtype="bfloat16"))
    assert case == make_case(3, 176, "bfloat16", "silu", "separate", lead=(3, 1),
                             operands="halves")  # the (batch, 1, cols) halves it is handed



def test_lookalike_mlps_are_left_alone():
    class ScaledMLP(LlamaMLP):  # right name and children, different computation
        def forward(self, x):
            return 2 * super().forward(x)

    class MLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            small = {"hidden_size": 8, "intermediate_size": 16, "num_attention_heads": 2}
            self.a = ScaledMLP(LlamaConfig(**small))
            self.b = LlamaMLP(LlamaConfig(**small, hidden_act="relu"))
            self.c = LlamaMLP(LlamaConfig(**small))

    assert [m.path for m in find_gated_mlps(MLP())] == ["c"]


def test_no_memory_for_the_fused_weight_keeps_both_projections(tmp_path, monkeypatch):
    """Fusing needs one layer's [gate; up] more memory for a moment; without it the MLP is
    still patched and runs its two projections, and nothing else is lost."""
    from codegen.gated_act.patch import GateUp

    def no_room(*args, **kwargs):
        raise torch.OutOfMemoryError("no room")

    model = build(resolve("tiny-llama"), torch.float32, DEVICE)
    mlp = find_gated_mlps(model)[0].module
    x = torch.randn(1, 3, mlp.gate_proj.in_features).to(DEVICE)
    monkeypatch.setattr(GateUp, "__init__", no_room)
    with torch.no_grad():
        want = mlp(x)
        chooser = CountingChooser(FAMILY, tmp_path)
        undo = FAMILY.patch(model, chooser)
        got = mlp(x)
        undo()
    assert chooser.calls == 1
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_halves_are_timed_against_what_the_unpatched_mlp_runs(monkeypatch):
    """A halves case (gate and up as column halves of the fused GEMM's output) times the
    kernel on the halves and HF's activation on two contiguous tensors, what the unpatched
    MLP multiplies; other cases time both sides on the same inputs."""
    import dataclasses
    import types

    import codegen.registry
    from codegen.screen import _screen_and_time

    halves = make_case(6, 32, "float32", "silu", "separate", operands="halves")
    assert FAMILY.verify.baseline_case(halves) == {**halves, "operands": "separate"}
    plain = make_case(6, 32, "float32", "silu", "separate", operands="separate")
    assert FAMILY.verify.baseline_case(plain) is plain

    seen = []

    def recording(*inputs, **params):
        seen.append([t.is_contiguous() for t in inputs])
        return FAMILY.reference(*inputs, **params)

    fam = dataclasses.replace(FAMILY, reference=recording)
    monkeypatch.setattr(codegen.registry, "get_family", lambda name: fam)
    nowhere = types.SimpleNamespace(send=lambda message: None)  # the worker's pipe
    for case in (halves, plain):
        seen.clear()
        _screen_and_time("gated_act", case, [], "cpu", nowhere)
        assert seen[0] == ([False, False] if case is halves else [True, True])  # the screen's
        assert seen[1:] and all(s == [True, True] for s in seen[1:])  # the timed baseline's


def test_the_verifiers_timing_runs_the_baseline_on_the_baseline_case(monkeypatch, tmp_path):
    """The verifier's timing (verify.checks) gives the candidate the halves and the baseline
    HF's two contiguous tensors, as the search's screen does."""
    import dataclasses

    from family_checks import load_rendered

    import verify.checks as checks

    halves = make_case(6, 32, "float32", "silu", "separate", operands="halves")
    seen = []

    def recording(*inputs, **params):
        seen.append([t.is_contiguous() for t in inputs])
        return FAMILY.reference(*inputs, **params)

    fam = dataclasses.replace(FAMILY, reference=recording)
    monkeypatch.setattr(checks, "load_family", lambda spec: fam)
    suite = checks.Suite({"device": "cpu", "family": "x:FAMILY", "seed": 0}, lambda *a: None)
    candidate = load_rendered(FAMILY, FAMILY.search_space(halves)[-1], halves, tmp_path)
    inputs_seen = []

    def forward(*inputs, **kw):
        inputs_seen.append([t.is_contiguous() for t in inputs])
        return candidate(*inputs, **kw)

    suite.forward = forward
    timing, records = suite._timing([{"origin": "given", "case": halves, "label": "c0"}])
    assert timing["cases"] and all(r["passed"] for r in records)
    assert inputs_seen and all(s == [False, False] for s in inputs_seen)
    # the reference never runs on the halves: the baseline's bench (at least 10 calls) on its
    # own contiguous inputs, the judging of the timed results on upcast copies
    assert not any(s == [False, False] for s in seen)
    assert sum(s == [True, True] for s in seen) >= 10

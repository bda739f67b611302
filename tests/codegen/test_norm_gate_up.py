"""Residual add + RMSNorm + gate/up GEMV family: the reference is the layer's add, its
post_attention_layernorm and the MLP's act(gate_proj(x)) * up_proj(x), bit for bit; rendered
candidates (one row to MAX_ROWS, a hidden size no BLOCK_K divides, x a column slice of wider
rows, SiLU and tanh-GELU, with and without the residual, Llama's and Gemma's norm forms) equal
it; the patch on a decode step gives the unpatched logits with one launch per layer for the
norm and gate/up, alone and under add_rmsnorm's layer forward (the add folded in), composes
with matmul_epilogue, rmsnorm and norm_qkv in either order, stops fusing where the MLP does
not take what the launch kept, and undo restores. CPU runs the kernel under the interpreter
(fp32, fp16); bf16 runs on a GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from family_checks import (
    DEVICE,
    CountingChooser,
    assert_close,
    instance_forwards,
    load_rendered,
    run_candidate,
    space_ends,
)
from transformers import DynamicCache

from codegen.norm_gate_up import FAMILY, MAX_ROWS
from codegen.norm_gate_up.patch import layers
from codegen.norm_gate_up.reference import make_case
from codegen.registry import get_family
from core.workload import Workload
from models.graphs import cache_argument
from profiling.loader import build, resolve

TOL = {"float32": (1e-5, 1e-5), "float16": (2e-3, 4e-3), "bfloat16": (1e-2, 1.6e-2)}
# hidden 300: no BLOCK_K divides it, SiLU, the residual add; hidden 96 with tanh-GELU and
# Gemma's form, no residual; hidden 64 with SiLU and the add, 3 rows
CASES = [make_case(1, 300, 80, "float32", "silu"),
         make_case(2, 96, 112, "float32", "gelu_tanh", residual=False, form="gemma"),
         make_case(3, 64, 176, "float32", "silu", eps=1e-5)]


def test_the_reference_is_the_layers_add_norm_and_gated_mlp_bitwise():
    for name in ("tiny-llama", "tiny-gemma"):
        for dtype in (torch.float32, torch.bfloat16):
            torch.manual_seed(0)
            model = build(resolve(name), dtype, "cpu")
            layer = model.model.layers[0]
            norm, mlp = layer.post_attention_layernorm, layer.mlp
            x = torch.randn(3, model.config.hidden_size).to(dtype)
            residual = torch.randn(3, model.config.hidden_size).to(dtype)
            act = "gelu_tanh" if name == "tiny-gemma" else "silu"
            eps = norm.eps if hasattr(norm, "eps") else norm.variance_epsilon
            form = {"offset": 1.0, "cast_first": False} if name == "tiny-gemma" else {}
            with torch.no_grad():
                total = residual + x
                normed = norm(total)
                h = mlp.act_fn(mlp.gate_proj(normed)) * mlp.up_proj(normed)
                got = FAMILY.reference(x, norm.weight, mlp.gate_proj.weight, mlp.up_proj.weight,
                                       residual, eps=eps, act=act, **form)
                plain = FAMILY.reference(total, norm.weight, mlp.gate_proj.weight,
                                         mlp.up_proj.weight, eps=eps, act=act, **form)
            assert all(torch.equal(g, w) for g, w in zip(got, (normed, h, total))), name
            assert all(torch.equal(g, w) for g, w in zip(plain, (normed, h))), name


@pytest.mark.parametrize("dtype", ["float32", "float16",
                                   pytest.param("bfloat16", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("base", CASES, ids=["h300-silu-add", "h96-geglu-gemma", "h64-3rows"])
def test_rendered_candidates_equal_the_add_norm_and_gated_mlp(base, dtype, tmp_path):
    case = {**base, "dtype": dtype}
    edges = FAMILY.edge_cases(case)
    assert {c["rows"] for c in [case, *edges]} >= {1, 3, MAX_ROWS}
    for config in space_ends(FAMILY.search_space(case)):
        for c in [case, *edges]:
            out, ref = run_candidate(FAMILY, config, c, tmp_path, rendered_for=case)
            assert len(out) == (3 if case["residual"] else 2)
            assert_close(out, ref, TOL[dtype])


# ------------------------------------------------------------------ the patch on a decode step

@pytest.fixture(scope="module", params=["tiny-llama", "tiny-qwen2"])
def tiny(request):
    spec = resolve(request.param)
    spec.config.num_key_value_heads = spec.config.num_attention_heads
    torch.manual_seed(0)
    model = build(spec, torch.float32, DEVICE)
    assert len(layers(model)) == model.config.num_hidden_layers
    return model


def _decode_step(model, ids):
    cache = DynamicCache()
    with torch.no_grad():
        arg = {cache_argument(model): cache}
        prefill = model(ids, use_cache=True, **arg).logits
        return prefill, model(ids[:, -1:], use_cache=True, **arg).logits


def _ids():
    return torch.randint(3, 500, (2, 5), generator=torch.Generator().manual_seed(4)).to(DEVICE)


def test_patched_decode_step_runs_one_launch_per_layer_and_undo_restores(tiny, tmp_path):
    ids = _ids()
    want_prefill, want = _decode_step(tiny, ids)
    chooser = CountingChooser(FAMILY, tmp_path)
    undo = FAMILY.patch(tiny, chooser)
    try:
        got_prefill, got = _decode_step(tiny, ids)
        again = _decode_step(tiny, ids)[1]  # still fusing: every launch was claimed
    finally:
        undo()
    layers_n = tiny.config.num_hidden_layers
    assert chooser.calls == 2 * layers_n
    assert torch.equal(got_prefill, want_prefill)
    assert_close(got, want, (1e-5, 1e-5))
    assert torch.equal(got, again)
    assert chooser.distinct_cases() == FAMILY.cases_from_model(
        tiny, Workload(2, 5, "float32", DEVICE, "decode"))
    assert all(c["residual"] for c in chooser.distinct_cases())
    assert FAMILY.cases_from_model(tiny, Workload(2, 5, "float32", DEVICE)) == []
    assert instance_forwards(tiny) == []
    assert torch.equal(_decode_step(tiny, ids)[1], want)


@pytest.mark.parametrize("ours_first", [True, False])
@pytest.mark.parametrize("other", ["add_rmsnorm", "matmul_epilogue", "rmsnorm", "norm_qkv"])
def test_composes_in_either_patch_order(tiny, other, ours_first, tmp_path):
    """With add_rmsnorm (the rival: patched first, this family's layer forward stacks above
    it; patched second, it leaves these layers alone), matmul_epilogue on the MLP, rmsnorm
    on the norm or norm_qkv on the attention: the add, the norm and gate/up still come from
    this family's one launch per layer; logits as unpatched."""
    ids = _ids()
    _, want = _decode_step(tiny, ids)
    (tmp_path / "o").mkdir()
    (tmp_path / "t").mkdir()
    ours = CountingChooser(FAMILY, tmp_path / "o")
    theirs_family = get_family(other)
    theirs = CountingChooser(theirs_family, tmp_path / "t",
                             pick=0 if other == "matmul_epilogue" else -1)
    pairs = [(FAMILY, ours), (theirs_family, theirs)]
    undos = [f.patch(tiny, c) for f, c in (pairs if ours_first else pairs[::-1])]
    try:
        _, got = _decode_step(tiny, ids)
    finally:
        for u in undos if ours_first else reversed(undos):
            u()
    assert ours.calls == tiny.config.num_hidden_layers
    assert_close(got, want, (1e-5, 1e-5))
    assert instance_forwards(tiny) == []


DECODE_SET = ("gemv", "norm_qkv", "norm_gate_up", "matmul_epilogue", "rmsnorm")


@pytest.mark.parametrize("order", [DECODE_SET, DECODE_SET[::-1]])
def test_the_decode_set_composes_in_any_patch_order(tiny, order, tmp_path):
    """Both norm fusions with the shipped decode set (add_rmsnorm set aside, the rival): per
    layer the input norm with q/k/v and the add + post-attention norm with gate/up, each one
    launch, the residual still accumulated in down_proj's GEMV (gemv's accumulate); logits as
    unpatched; undo restores every module."""
    ids = _ids()
    _, want = _decode_step(tiny, ids)
    choosers, undos = {}, []
    try:
        for name in order:
            (tmp_path / name).mkdir()
            choosers[name] = CountingChooser(get_family(name), tmp_path / name,
                                             pick=0 if name == "matmul_epilogue" else -1)
            undos.append(get_family(name).patch(tiny, choosers[name]))
        _, got = _decode_step(tiny, ids)
    finally:
        for u in reversed(undos):
            u()
    layers_n = tiny.config.num_hidden_layers
    assert choosers["norm_qkv"].calls == layers_n
    assert choosers["norm_gate_up"].calls == layers_n
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert instance_forwards(tiny) == []


def test_an_unclaimed_launch_stops_the_layer_fusing(tiny, tmp_path):
    """A forward stacked on the MLP that never asks below (HF's own MLP code) leaves what the
    launch kept unclaimed: the next step's add + norm sees it and that layer runs the
    reference's torch code from then on; logits as unpatched at every step."""
    from models.patching import set_instance_forward

    ids = _ids()
    _, want = _decode_step(tiny, ids)
    mlp = tiny.model.layers[0].mlp
    chooser = CountingChooser(FAMILY, tmp_path)
    undo = FAMILY.patch(tiny, chooser)
    undo_hf = set_instance_forward(mlp, lambda x: type(mlp).forward(mlp, x))
    try:
        _, got = _decode_step(tiny, ids)
        _, got_again = _decode_step(tiny, ids)
    finally:
        undo_hf()
        undo()
    layers_n = tiny.config.num_hidden_layers
    assert chooser.calls == layers_n + layers_n - 1
    assert_close(got, want, (1e-5, 1e-5))
    assert_close(got_again, want, (1e-5, 1e-5))
    assert instance_forwards(tiny) == []


def test_a_hooked_mlp_runs_hfs_code(tiny, tmp_path):
    """A hook on the MLP (a user's, accelerate's) must see it called: no launch for that
    layer while it is there."""
    ids = _ids()
    _, want = _decode_step(tiny, ids)
    chooser = CountingChooser(FAMILY, tmp_path)
    undo = FAMILY.patch(tiny, chooser)
    handle = tiny.model.layers[0].mlp.register_forward_pre_hook(lambda m, a: None)
    try:
        _, got = _decode_step(tiny, ids)
    finally:
        handle.remove()
        undo()
    assert chooser.calls == tiny.config.num_hidden_layers - 1
    assert_close(got, want, (1e-5, 1e-5))


@pytest.mark.gpu
def test_gpu_every_config_is_right_in_bf16_at_llamas_shape_and_captures(tmp_path):
    """Llama-3.2-1B's add + post-attention norm and gate/up (2048 -> 8192, SiLU, bf16) at one
    and MAX_ROWS rows: every config's total and normed equal the reference's within bf16
    rounding and h is within bf16 error of the float64 products of the reference's normed x;
    one config captured in a CUDA graph replays the eager result on new x."""
    for rows in (1, MAX_ROWS):
        case = make_case(rows, 2048, 8192, "bfloat16", "silu", eps=1e-5)
        inputs = FAMILY.make_inputs(case, "cuda", torch.Generator("cuda").manual_seed(rows))
        kw = FAMILY.params(case)
        ref = FAMILY.reference(*inputs, **kw)
        n = ref[0].double()
        exact = F.silu(n @ inputs[2].double().T) * (n @ inputs[3].double().T)
        for config in FAMILY.search_space(case):
            forward = load_rendered(FAMILY, config, case, tmp_path)
            outs = tuple(o.fill_(float("nan")) for o in FAMILY.make_out(case, inputs))
            forward(*inputs, out=outs, **kw)
            torch.cuda.synchronize()
            assert torch.equal(outs[2], ref[2])  # one rounded add, as HF's
            assert_close(outs[0], ref[0], (1e-2, 1.6e-2))
            err = (outs[1].double() - exact).abs().max().item()
            assert err <= 1e-2 + 1.6e-2 * exact.abs().max().item(), (rows, config, err)
    case = make_case(1, 2048, 8192, "bfloat16", "silu", eps=1e-5)
    kw = FAMILY.params(case)
    forward = load_rendered(FAMILY, FAMILY.search_space(case)[0], case, tmp_path)
    inputs = FAMILY.make_inputs(case, "cuda", torch.Generator("cuda").manual_seed(9))
    outs = FAMILY.make_out(case, inputs)
    forward(*inputs, out=outs, **kw)  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward(*inputs, out=outs, **kw)
    inputs[0].copy_(torch.randn_like(inputs[0]))
    graph.replay()
    want = FAMILY.make_out(case, inputs)
    forward(*inputs, out=want, **kw)
    torch.cuda.synchronize()
    assert all(torch.equal(o, w) for o, w in zip(outs, want))


@pytest.mark.parametrize("batch", [1, MAX_ROWS + 1])
def test_a_decode_step_ranks_it_beside_matmul_epilogue(batch, tmp_path):
    """One occurrence per layer holding the MLP's gate/up Linears, its activation and product
    and the layer's post_attention_layernorm, an option of the gated MLP's row beside
    matmul_epilogue's; past MAX_ROWS rows there is none (the pattern's `accepts`)."""
    from pipeline.stages.profile import summarise
    from pipeline.stages.rank import rank_workload
    from profiling.capture import capture, make_runner, module_names

    model = build(resolve("tiny-llama"), torch.float32, "cpu")
    wl = Workload(batch, 8 * batch, "float32", "cpu", "decode")
    runner = make_runner(model, wl)
    names = module_names(model, runner)
    ms = capture(runner, "cpu", tmp_path / "trace.json.gz")
    w = summarise(tmp_path / "trace.json.gz", wl, {"median_ms": ms}, names, ms)
    ceil = {"bandwidth_GBps": 4128.5, "matmul_TFLOPs": 768.6, "launch_us": 8.5,
            "fused_launch_host_us": 17.3}
    rows = {r["pattern"]: r for r in rank_workload(w, ceil, None)["rows"]}
    layers_n = model.config.num_hidden_layers
    assert rows["gated_mlp_gemm"]["occurrences"] == layers_n
    if batch > MAX_ROWS:
        assert "norm_gate_up" not in rows
        return
    ours, norm = rows["norm_gate_up"], rows["rmsnorm"]
    assert ours["family"] == "norm_gate_up" and ours["occurrences"] == layers_n
    assert ours["option_of"] == "swiglu_mlp" and "rmsnorm" in ours["alternative_to"]
    per_norm = norm["op_calls"] // norm["occurrences"]
    assert ours["op_calls"] == rows["gated_mlp_gemm"]["op_calls"] + layers_n * per_norm

"""RMSNorm + grouped q/k/v projection family: the reference is HF's norm module followed by its
three Linears, bit for bit; rendered candidates (one row to MAX_ROWS, a width no BLOCK_K
divides, x a column slice of wider rows, a 2-D x, GQA ratios 1, 4 and 7, biases, Llama's and
Gemma's norm forms) equal it; a candidate refuses too many rows; the patch on a decode step
gives the unpatched logits through one launch per layer for the norm and the three
projections, leaves the prefill alone, composes with gemv, rmsnorm and add_rmsnorm in either
order, stops fusing where the attention does not take what the launch kept, and undo restores.
CPU runs the kernel under the interpreter (fp32, fp16); bf16 runs on a GPU."""

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

from codegen.norm_qkv import FAMILY, MAX_ROWS
from codegen.norm_qkv.patch import layers
from codegen.norm_qkv.reference import make_case
from core.workload import Workload
from models.graphs import cache_argument
from profiling.loader import build, resolve

TOL = {"float32": (1e-5, 1e-5), "float16": (1e-3, 2e-3), "bfloat16": (1e-2, 1.6e-2)}
# k=300: no BLOCK_K divides it; GQA ratio 4 (nq 64 over nk 16), biases (Qwen2), Llama's form.
# k=96 (not a power of two) with GQA ratio 7 (nq 112 over nk 16), Gemma's form, 3 rows of a
# strided x. k=64 with ratio 1, one row.
CASES = [make_case(1, 300, 64, 16, 16, "float32", True, (1, 1)),
         {**make_case(3, 96, 112, 16, 16, "float32", False, (3, 1), form="gemma"),
          "row_stride": 160},
         make_case(1, 64, 64, 64, 64, "float32", False, (1, 1), eps=1e-5)]


def test_the_reference_is_hfs_norm_then_its_three_linears_bitwise():
    """fp32 and bf16 (both literal op sequences on the CPU): the reference of the model's own
    tensors equals its input_layernorm followed by q_proj, k_proj and v_proj, bit for bit."""
    for name in ("tiny-llama", "tiny-qwen2"):
        spec = resolve(name)
        for dtype in (torch.float32, torch.bfloat16):
            torch.manual_seed(0)
            model = build(spec, dtype, "cpu")
            layer = model.model.layers[0]
            attn, norm = layer.self_attn, layer.input_layernorm
            x = torch.randn(3, 1, model.config.hidden_size).to(dtype)
            with torch.no_grad():
                normed = norm(x)
                want = (normed, attn.q_proj(normed), attn.k_proj(normed), attn.v_proj(normed))
                biases = [] if attn.q_proj.bias is None else [
                    getattr(attn, n).bias for n in ("q_proj", "k_proj", "v_proj")]
                got = FAMILY.reference(x, norm.weight, attn.q_proj.weight, attn.k_proj.weight,
                                       attn.v_proj.weight, *biases, eps=norm.variance_epsilon)
            assert all(torch.equal(g, w) for g, w in zip(got, want)), (name, dtype)


@pytest.mark.parametrize("dtype", ["float32", "float16",
                                   pytest.param("bfloat16", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("base", CASES, ids=["k300-gqa4-bias", "k96-gqa7-gemma-strided",
                                             "k64-gqa1"])
def test_rendered_candidates_equal_the_norm_and_three_linears(base, dtype, tmp_path):
    case = {**base, "dtype": dtype}
    edges = FAMILY.edge_cases(case)
    assert {c["rows"] for c in [case, *edges]} >= {1, 3, MAX_ROWS}
    assert all(c["rows"] <= MAX_ROWS for c in edges)
    for config in space_ends(FAMILY.search_space(case)):
        for c in [case, *edges]:
            out, ref = run_candidate(FAMILY, config, c, tmp_path, rendered_for=case)
            assert [o.shape for o in out] == [r.shape for r in ref]
            assert_close(out, ref, TOL[dtype])


def test_candidate_refuses_too_many_rows_and_another_form(tmp_path):
    case = make_case(1, 64, 64, 64, 64, "float32", False, (1, 1))
    forward = load_rendered(FAMILY, FAMILY.search_space(case)[-1], case, tmp_path)
    x, nw, wq, wk, wv = FAMILY.make_inputs(case, DEVICE, torch.Generator(DEVICE).manual_seed(0))
    outs = FAMILY.make_out(case, (x,))
    with pytest.raises(ValueError, match="offset"):
        forward(x, nw, wq, wk, wv, out=outs, eps=1e-6, offset=1.0, cast_first=False)
    big = torch.randn(MAX_ROWS + 1, 1, 64)
    many = tuple(torch.empty(MAX_ROWS + 1, 1, n) for n in (64, 64, 64, 64))
    with pytest.raises(ValueError, match="rows"):
        forward(big, nw, wq, wk, wv, out=many, eps=1e-6, offset=0.0, cast_first=True)


def test_cases_stop_at_max_rows():
    with pytest.raises(ValueError, match="rows"):
        make_case(MAX_ROWS + 1, 64, 64, 64, 64, "float32", False)


# ------------------------------------------------------------------ the patch on a decode step

@pytest.fixture(scope="module", params=["tiny-llama", "tiny-qwen2"])
def tiny(request):
    """The tiny model with one kv head per query head: k/v 64 wide, a width no family pads
    (the built-in 32 are the matmul family's, so no attention of theirs qualifies)."""
    spec = resolve(request.param)
    spec.config.num_key_value_heads = spec.config.num_attention_heads
    torch.manual_seed(0)
    model = build(spec, torch.float32, DEVICE)
    assert len(layers(model)) == model.config.num_hidden_layers
    assert not layers(build(resolve(request.param), torch.float32, DEVICE))
    return model


def _decode_step(model, ids):
    cache = DynamicCache()
    with torch.no_grad():
        arg = {cache_argument(model): cache}
        prefill = model(ids, use_cache=True, **arg).logits
        return prefill, model(ids[:, -1:], use_cache=True, **arg).logits


def _ids():
    return torch.randint(3, 500, (2, 5), generator=torch.Generator().manual_seed(4)).to(DEVICE)


def _norm_calls(model):
    """Counts calls of the input norms' and q/k/v projections' class forwards (what runs when
    the fused launch does not serve them): {"norm": n, "proj": n}."""
    counts = {"norm": 0, "proj": 0}
    handles = []
    for layer, _ in layers(model):
        handles.append(layer.input_layernorm.register_forward_pre_hook(
            lambda *a: counts.__setitem__("norm", counts["norm"] + 1)))
    return counts, handles


def test_patched_decode_step_runs_one_launch_per_layer_and_undo_restores(tiny, tmp_path):
    ids = _ids()
    want_prefill, want = _decode_step(tiny, ids)
    chooser = CountingChooser(FAMILY, tmp_path)
    undo = FAMILY.patch(tiny, chooser)
    try:
        got_prefill, got = _decode_step(tiny, ids)
        got_again = _decode_step(tiny, ids)[1]  # still fusing: every launch was claimed
    finally:
        undo()
    layers_n = tiny.config.num_hidden_layers
    assert chooser.calls == 2 * layers_n  # the steps only, one launch per layer each
    assert torch.equal(got_prefill, want_prefill)
    assert_close(got, want, (1e-5, 1e-5))
    assert torch.equal(got, got_again)
    assert chooser.distinct_cases() == FAMILY.cases_from_model(
        tiny, Workload(2, 5, "float32", DEVICE, "decode"))
    assert FAMILY.cases_from_model(tiny, Workload(2, 5, "float32", DEVICE)) == []
    assert instance_forwards(tiny) == []
    assert torch.equal(_decode_step(tiny, ids)[1], want)


@pytest.mark.parametrize("ours_first", [True, False])
@pytest.mark.parametrize("other", ["gemv", "rmsnorm", "add_rmsnorm"])
def test_composes_in_either_patch_order(tiny, other, ours_first, tmp_path):
    """With gemv (on the projections), rmsnorm (on the norm) or add_rmsnorm (the layer's
    forward): the norm and q, k, v come from this family's one launch per layer whichever was
    patched last; logits as unpatched; undo in either order restores."""
    from codegen.registry import get_family

    ids = _ids()
    _, want = _decode_step(tiny, ids)
    (tmp_path / "o").mkdir()
    (tmp_path / "t").mkdir()
    ours = CountingChooser(FAMILY, tmp_path / "o")
    theirs_family = get_family(other)
    theirs = CountingChooser(theirs_family, tmp_path / "t")
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


def test_an_unclaimed_launch_stops_the_layer_fusing(tiny, tmp_path):
    """A hook on q_proj keeps the attention from taking what the norm's launch kept: the next
    step's norm sees it unclaimed and that layer runs HF's norm and projections from then on,
    with the unpatched logits; a normed tensor read by someone else holds the norm's values."""
    ids = _ids()
    _, want = _decode_step(tiny, ids)
    layer = tiny.model.layers[0]
    chooser = CountingChooser(FAMILY, tmp_path)
    undo = FAMILY.patch(tiny, chooser)
    try:
        with torch.no_grad():
            x = torch.randn(2, 1, tiny.config.hidden_size, device=DEVICE)
            normed = layer.input_layernorm(x)  # fused: q, k, v kept, never claimed
            assert chooser.calls == 1
            assert_close(normed, FAMILY.reference(
                x, layer.input_layernorm.weight, *(getattr(layer.self_attn, n).weight
                                                   for n in ("q_proj", "k_proj", "v_proj")),
                *([] if layer.self_attn.q_proj.bias is None else
                  [getattr(layer.self_attn, n).bias for n in ("q_proj", "k_proj", "v_proj")]),
                eps=layer.input_layernorm.variance_epsilon)[0], (1e-6, 1e-6))
            other = x.clone()
            assert torch.equal(layer.self_attn.q_proj(other), F.linear(
                other, layer.self_attn.q_proj.weight, layer.self_attn.q_proj.bias))
        _, got = _decode_step(tiny, ids)
    finally:
        undo()
    # layer 0 stopped at its first call of the step; the other layers fused
    assert chooser.calls == 1 + tiny.config.num_hidden_layers - 1
    assert_close(got, want, (1e-5, 1e-5))
    assert instance_forwards(tiny) == []


def test_a_hooked_projection_runs_hfs_code(tiny, tmp_path):
    layer = tiny.model.layers[0]
    chooser = CountingChooser(FAMILY, tmp_path)
    undo = FAMILY.patch(tiny, chooser)
    try:
        handle = layer.self_attn.v_proj.register_forward_hook(lambda m, i, o: None)
        with torch.no_grad():
            x = torch.randn(1, 1, tiny.config.hidden_size, device=DEVICE)
            assert torch.equal(layer.input_layernorm(x),
                               type(layer.input_layernorm).forward(layer.input_layernorm, x))
        handle.remove()
        assert chooser.calls == 0
    finally:
        undo()


DECODE_SET = ("gemv", "norm_qkv", "matmul_epilogue", "add_rmsnorm", "rmsnorm")


@pytest.mark.parametrize("order", [DECODE_SET, DECODE_SET[::-1]])
def test_the_decode_set_composes_in_any_patch_order(tiny, order, tmp_path):
    """The shipped decode set with this family in qkv_proj's place, patched in either order:
    the input norm and q, k, v from one launch per layer, add_rmsnorm's layer forward around
    it, gemv on the other projections; logits as unpatched; undo restores every module."""
    from codegen.registry import get_family

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
    assert choosers["norm_qkv"].calls == tiny.config.num_hidden_layers
    assert all(c.calls > 0 for c in choosers.values())
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert instance_forwards(tiny) == []


@pytest.mark.parametrize("batch", [1, MAX_ROWS + 1])
def test_a_decode_step_ranks_it_beside_qkv_proj(batch, tmp_path):
    """One occurrence per layer holding the three projections' gemv occurrences and the input
    norm's rmsnorm occurrence, an option of the gemv row beside qkv_proj's (its rival); past
    MAX_ROWS rows there is none (the pattern's `accepts`)."""
    from pipeline.stages.profile import summarise
    from pipeline.stages.rank import rank_workload
    from profiling.capture import capture, make_runner, module_names

    spec = resolve("tiny-llama")
    spec.config.num_key_value_heads = spec.config.num_attention_heads
    model = build(spec, torch.float32, "cpu")
    wl = Workload(batch, 8 * batch, "float32", "cpu", "decode")
    runner = make_runner(model, wl)
    names = module_names(model, runner)
    ms = capture(runner, "cpu", tmp_path / "trace.json.gz")
    w = summarise(tmp_path / "trace.json.gz", wl, {"median_ms": ms}, names, ms)
    ceil = {"bandwidth_GBps": 4128.5, "matmul_TFLOPs": 768.6, "launch_us": 8.5,
            "fused_launch_host_us": 17.3}
    rows = {r["pattern"]: r for r in rank_workload(w, ceil, None)["rows"]}
    layers_n = model.config.num_hidden_layers
    assert rows["qkv_proj"]["occurrences"] == layers_n
    if batch > MAX_ROWS:
        assert "norm_qkv" not in rows
        return
    ours, norm = rows["norm_qkv"], rows["rmsnorm"]
    assert ours["family"] == "norm_qkv" and ours["occurrences"] == layers_n
    assert ours["option_of"] == "gemv" and set(ours["alternative_to"]) == {"gemv", "rmsnorm"}
    per_norm = norm["op_calls"] // norm["occurrences"]
    assert ours["op_calls"] == rows["qkv_proj"]["op_calls"] + layers_n * per_norm


@pytest.mark.gpu
def test_gpu_every_config_is_right_in_bf16_at_llamas_shape_and_captures(tmp_path):
    """Llama-3.2-1B's input norm and projections (2048 -> 2048, 512, 512, bf16) at one and
    MAX_ROWS rows: every config's normed equals the reference's within bf16 rounding and q, k,
    v are within bf16 error of the float64 products of the reference's normed x; one config
    captured in a CUDA graph replays the eager result on new x."""
    for rows in (1, MAX_ROWS):
        case = make_case(rows, 2048, 2048, 512, 512, "bfloat16", False, (rows, 1), eps=1e-5)
        inputs = FAMILY.make_inputs(case, "cuda", torch.Generator("cuda").manual_seed(rows))
        kw = FAMILY.params(case)
        ref = FAMILY.reference(*inputs, **kw)
        exact = [F.linear(ref[0].double(), w.double()) for w in inputs[2:5]]
        for config in FAMILY.search_space(case):
            forward = load_rendered(FAMILY, config, case, tmp_path)
            outs = tuple(o.fill_(float("nan")) for o in FAMILY.make_out(case, inputs))
            forward(*inputs, out=outs, **kw)
            torch.cuda.synchronize()
            assert_close(outs[0], ref[0], (1e-2, 1.6e-2))
            for o, e in zip(outs[1:], exact):
                err = (o.double() - e).abs().max().item()
                assert err <= 1e-2 + 1.6e-2 * e.abs().max().item(), (rows, config, err)
    case = make_case(1, 2048, 2048, 512, 512, "bfloat16", False, (1, 1), eps=1e-5)
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

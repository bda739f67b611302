"""Grouped q/k/v projection family: rendered candidates (k no BLOCK_K divides, a strided 3-D
and a 2-D x, with and without biases) == three F.linear calls; the verifier accepts one; a
candidate refuses other shapes; the patch on a decode step gives the unpatched logits through
one kernel call per layer, leaves the prefill alone, hands rope and the cache contiguous
tensors, falls back where the kept k/v would be wrong (another input, one changed in place, a
hook), and undo restores. CPU runs the kernel under the interpreter (fp32, fp16); bf16 and a
CUDA graph capture run on a GPU."""

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

from codegen.qkv_proj import FAMILY, MAX_ROWS
from codegen.qkv_proj.patch import attentions
from codegen.qkv_proj.reference import make_case
from core.workload import Workload
from models.graphs import cache_argument
from profiling.loader import build, resolve

TOL = {"float32": (1e-5, 1e-5), "float16": (1e-3, 2e-3), "bfloat16": (1e-2, 1.6e-2)}
# k=300: no BLOCK_K divides it (masked steps); nk=nv=64 under nq=128; biases (Qwen2). The
# second: 3 rows, x a column slice of wider rows (row stride k + 64), k=512, no bias.
CASES = [make_case(1, 300, 128, 64, 64, "float32", True, (1, 1)),
         {**make_case(3, 512, 64, 64, 64, "float32", False, (3, 1)), "row_stride": 576}]


@pytest.mark.parametrize("dtype", ["float32", "float16",
                                   pytest.param("bfloat16", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("base", CASES, ids=["1row-bias", "3rows-strided"])
def test_rendered_candidates_equal_three_linears(base, dtype, tmp_path):
    case = {**base, "dtype": dtype}
    for config in space_ends(FAMILY.search_space(case)):
        for c in [case, *FAMILY.edge_cases(case)]:
            out, ref = run_candidate(FAMILY, config, c, tmp_path, rendered_for=case)
            assert [o.shape for o in out] == [r.shape for r in ref]
            assert_close(out, ref, TOL[dtype])


def test_the_search_space_is_small_and_ends_with_the_interpreters_cheapest():
    case = make_case(1, 2048, 2048, 512, 512, "bfloat16", False, (1, 1))
    space = FAMILY.search_space(case)
    assert 2 <= len(space) <= 6 and len({repr(c) for c in space}) == len(space)
    assert space[-1]["BLOCK_N"] == 32 and space[-1]["BLOCK_K"] == 512
    assert all(c["BLOCK_N"] * c["BLOCK_K"] >= 2048 for c in space)


def test_candidate_refuses_other_shapes_and_too_many_rows(tmp_path):
    case = make_case(1, 64, 64, 64, 64, "float32", False, (1, 1))
    forward = load_rendered(FAMILY, FAMILY.search_space(case)[-1], case, tmp_path)
    x, wq, wk, wv = FAMILY.make_inputs(case, DEVICE, torch.Generator(DEVICE).manual_seed(0))
    outs = FAMILY.make_out(case, (x,))
    with pytest.raises(ValueError, match="contiguous weights"):
        forward(x, wq, wk[:32], wv, out=outs)
    with pytest.raises(ValueError, match="bias"):
        forward(x, wq, wk, wv, wq[0], wk[0], wv[0], out=outs)
    big = torch.randn(MAX_ROWS + 1, 1, 64)
    many = tuple(torch.empty(MAX_ROWS + 1, 1, 64) for _ in range(3))
    with pytest.raises(ValueError, match="rows"):
        forward(big, wq, wk, wv, out=many)


# ------------------------------------------------------------------ the patch on a decode step

@pytest.fixture(scope="module", params=["tiny-llama", "tiny-qwen2"])
def tiny(request):
    """The tiny model with one kv head per query head: k/v 64 wide, a width no family pads
    (the built-in 32 are the matmul family's, so no attention of theirs qualifies)."""
    spec = resolve(request.param)
    spec.config.num_key_value_heads = spec.config.num_attention_heads
    torch.manual_seed(0)
    model = build(spec, torch.float32, DEVICE)
    assert len(attentions(model)) == model.config.num_hidden_layers
    assert not attentions(build(resolve(request.param), torch.float32, DEVICE))
    return model


def _decode_step(model, ids):
    cache = DynamicCache()
    with torch.no_grad():
        arg = {cache_argument(model): cache}
        prefill = model(ids, use_cache=True, **arg).logits
        return prefill, model(ids[:, -1:], use_cache=True, **arg).logits


def test_patched_decode_step_runs_one_kernel_per_layer_and_undo_restores(tiny, tmp_path):
    ids = torch.randint(3, 500, (2, 5), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    want_prefill, want = _decode_step(tiny, ids)
    chooser = CountingChooser(FAMILY, tmp_path)
    undo = FAMILY.patch(tiny, chooser)
    try:
        got_prefill, got = _decode_step(tiny, ids)
    finally:
        undo()
    assert chooser.calls == tiny.config.num_hidden_layers  # the step only, one per layer
    assert torch.equal(got_prefill, want_prefill)
    assert_close(got, want, (1e-5, 1e-5))
    assert chooser.distinct_cases() == FAMILY.cases_from_model(
        tiny, Workload(2, 5, "float32", DEVICE, "decode"))
    assert FAMILY.cases_from_model(tiny, Workload(2, 5, "float32", DEVICE)) == []
    assert instance_forwards(tiny) == []
    assert torch.equal(_decode_step(tiny, ids)[1], want)


@pytest.mark.parametrize("qkv_first", [True, False])
def test_composes_with_gemv_in_either_patch_order(tiny, qkv_first, tmp_path):
    """Both families on a decode step: q, k and v come from qkv_proj's one launch per layer
    whichever was patched last (gemv's forward asks the fused one below it first), gemv runs
    every other projection (o_proj, the MLP, the LM head); logits as unpatched; undo in any
    order restores. Where qkv_proj declines (a chooser with no kernel), gemv runs q, k and v."""
    from codegen.gemv import FAMILY as GEMV

    ids = torch.randint(3, 500, (2, 5), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    _, want = _decode_step(tiny, ids)
    gemv_calls = {}
    for give in (True, False):
        (tmp_path / f"{give}q").mkdir()
        (tmp_path / f"{give}g").mkdir()
        ours = CountingChooser(FAMILY, tmp_path / f"{give}q", give=give)
        theirs = CountingChooser(GEMV, tmp_path / f"{give}g")
        pairs = [(FAMILY, ours), (GEMV, theirs)]
        undos = [f.patch(tiny, c) for f, c in (pairs if qkv_first else pairs[::-1])]
        try:
            _, got = _decode_step(tiny, ids)
        finally:
            for u in undos if qkv_first else reversed(undos):
                u()
        layers = tiny.config.num_hidden_layers
        assert ours.calls == (layers if give else 0)
        gemv_calls[give] = theirs.calls
        assert_close(got, want, (1e-5, 1e-5))
        assert instance_forwards(tiny) == []
    # gemv ran o_proj and down_proj (and the LM head) either way, q, k and v only
    # where qkv_proj declined
    assert gemv_calls[True] >= 2 * layers
    assert gemv_calls[False] - gemv_calls[True] == 3 * layers


def test_kept_k_and_v_are_served_only_for_the_tensor_q_saw(tiny, tmp_path):
    attn = tiny.model.layers[0].self_attn
    chooser = CountingChooser(FAMILY, tmp_path)
    undo = FAMILY.patch(tiny, chooser)
    try:
        with torch.no_grad():
            x = torch.randn(2, 1, 64, device=DEVICE)
            q = attn.q_proj(x)
            k, v = attn.k_proj(x), attn.v_proj(x)  # kept from q_proj's launch
            assert chooser.calls == 1 and all(t.is_contiguous() for t in (q, k, v))
            assert_close(k, F.linear(x, attn.k_proj.weight, attn.k_proj.bias), (1e-5, 1e-5))
            other = x.clone()
            assert torch.equal(attn.k_proj(other), F.linear(other, attn.k_proj.weight,
                                                            attn.k_proj.bias))
            attn.q_proj(x)
            x.mul_(2.0)  # the same tensor, changed in place since q_proj saw it
            assert_close(attn.v_proj(x), F.linear(x, attn.v_proj.weight, attn.v_proj.bias),
                         (1e-6, 1e-6))
            handle = attn.v_proj.register_forward_hook(lambda m, i, o: None)
            calls = chooser.calls
            attn.q_proj(x)  # a hook on one of the three: HF's three Linears run
            handle.remove()
            assert chooser.calls == calls
            for shape in ((MAX_ROWS + 1, 1, 64), (1, 3, 64)):  # past MAX_ROWS, a prefill
                y = torch.randn(shape, device=DEVICE)
                assert torch.equal(attn.q_proj(y), F.linear(y, attn.q_proj.weight,
                                                            attn.q_proj.bias))
            assert chooser.calls == calls
    finally:
        undo()


@pytest.mark.gpu
def test_gpu_every_config_is_right_in_bf16_at_llamas_shape_and_captures():
    """Llama-3.2-1B's projections (2048 -> 2048, 512, 512, bf16) at one and eight rows: every
    config within bf16 error of the float64 products; one captured in a CUDA graph replays the
    eager result on new x."""
    import tempfile
    from pathlib import Path

    tmp = Path(tempfile.mkdtemp())
    for rows in (1, 8):
        case = make_case(rows, 2048, 2048, 512, 512, "bfloat16", False, (rows, 1))
        inputs = FAMILY.make_inputs(case, "cuda", torch.Generator("cuda").manual_seed(rows))
        x, ws = inputs[0], inputs[1:]
        exact = [F.linear(x.double(), w.double()) for w in ws]
        for config in FAMILY.search_space(case):
            forward = load_rendered(FAMILY, config, case, tmp)
            outs = tuple(o.fill_(float("nan")) for o in FAMILY.make_out(case, inputs))
            forward(*inputs, out=outs)
            torch.cuda.synchronize()
            for o, e in zip(outs, exact):
                err = (o.double() - e).abs().max().item()
                assert err <= 1e-2 + 1.6e-2 * e.abs().max().item(), (rows, config, err)
    case = make_case(1, 2048, 2048, 512, 512, "bfloat16", False, (1, 1))
    forward = load_rendered(FAMILY, FAMILY.search_space(case)[0], case, tmp)
    inputs = FAMILY.make_inputs(case, "cuda", torch.Generator("cuda").manual_seed(9))
    outs = FAMILY.make_out(case, inputs)
    forward(*inputs, out=outs)  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward(*inputs, out=outs)
    inputs[0].copy_(torch.randn_like(inputs[0]))
    graph.replay()
    want = FAMILY.make_out(case, inputs)
    forward(*inputs, out=want)
    torch.cuda.synchronize()
    assert all(torch.equal(o, w) for o, w in zip(outs, want))

"""Rotary family: reference == transformers' apply_rotary_pos_emb (Llama full, Phi-3 partial),
rendered kernels == reference on HF's strided layout, patterns == what the profile's matcher
finds, per-instance patching through the module global, and undo, on tiny models. CPU runs the
kernels under Triton's interpreter (fp32, fp16); bf16 kernel checks run on a GPU."""

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
from transformers.models.llama import modeling_llama
from transformers.models.phi3 import modeling_phi3

from codegen.rope import FAMILY
from codegen.rope.patch import find_rotary_attentions
from codegen.rope.reference import make_case
from core.workload import Workload
from models.graphs import cache_argument, output_cache
from profiling.loader import build, resolve

TOL = {"float32": (1e-5, 1e-5), "float16": (4e-3, 4e-3), "bfloat16": (3e-2, 3e-2)}
KERNEL_DTYPES = ["float32", "float16", pytest.param("bfloat16", marks=pytest.mark.gpu)]
# (batch, seq, heads, kv_heads, head_dim, rot_dim): prefill GQA, decode, Phi-3-like partial,
# a head_dim whose half is no power of two.
SHAPES = [(2, 8, 4, 2, 16, 16), (3, 1, 8, 2, 64, 64), (1, 6, 4, 4, 32, 16), (2, 3, 3, 1, 96, 96)]


def _partial_phi3_spec(factor=0.5):
    spec = resolve("tiny-phi3")
    spec.config.rope_parameters = {**spec.config.rope_parameters,
                                   "partial_rotary_factor": factor}
    return spec


@pytest.mark.parametrize("rot_dim, hf", [(16, modeling_llama), (8, modeling_phi3),
                                         (16, modeling_phi3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_reference_is_bitwise_the_hf_function(rot_dim, hf, dtype):
    case = make_case(2, 5, 4, 2, 16, rot_dim, str(dtype).removeprefix("torch."), cos_batch=2)
    q, k, cos, sin = FAMILY.make_inputs(case, "cpu", torch.Generator().manual_seed(1))
    assert not q.is_contiguous() and not k.is_contiguous()  # HF's transposed views
    want = hf.apply_rotary_pos_emb(q, k, cos, sin)
    got = FAMILY.reference(q, k, cos, sin)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and torch.equal(g, w)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rendered_matches_reference(shape, dtype, tmp_path):
    case = make_case(*shape, dtype)
    configs = FAMILY.search_space(case)
    assert 1 <= len(configs) <= 24
    for config in space_ends(configs):
        out, ref = run_candidate(FAMILY, config, case, tmp_path)
        assert_close(out, ref, TOL[dtype])


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_edge_cases(dtype, tmp_path):
    base = make_case(2, 8, 4, 2, 16, 16, dtype)
    edges = FAMILY.edge_cases(base)
    assert any(c["seq"] == 1 for c in edges) and any(c.get("contiguous") for c in edges)
    baked = ("heads", "kv_heads", "head_dim", "rot_dim")
    assert all(c[k] == base[k] for c in edges for k in baked)
    for case in edges:
        out, ref = run_candidate(FAMILY, FAMILY.search_space(base)[-1], case, tmp_path,
                                 rendered_for=base)
        assert_close(out, ref, TOL[dtype])


def test_outputs_may_be_strided_views_too(tmp_path):
    """The patch allocates outputs like q (HF's elementwise result keeps q's memory order)."""
    case = make_case(2, 5, 4, 2, 32, 16, "float32")
    forward = load_rendered(FAMILY, FAMILY.search_space(case)[0], case, tmp_path)
    q, k, cos, sin = FAMILY.make_inputs(case, DEVICE, torch.Generator(DEVICE).manual_seed(0))
    out = (torch.full_like(q, float("nan")), torch.full_like(k, float("nan")))
    assert out[0].stride() == q.stride()
    forward(q, k, cos, sin, out=out)
    assert_close(out, FAMILY.reference(q, k, cos, sin), TOL["float32"])


def test_rendered_source_is_specialised_and_checks_shapes(tmp_path):
    case = make_case(2, 8, 4, 2, 32, 16, "float16")
    config = {"BLOCK_S": 2, "BLOCK_H": 2, "num_warps": 1}
    source = FAMILY.render(config, case)
    for line in ("HEADS = 4", "KV_HEADS = 2", "HEAD_DIM = 32", "ROT_DIM = 16", "BLOCK_S = 2",
                 "BLOCK_H = 2", "BLOCK_PASS = 16", "NUM_WARPS = 1", "def _rope_forward_kernel",
                 "def forward(q, k, cos, sin, *, out, **params)"):
        assert line in source
    forward = load_rendered(FAMILY, config, case, tmp_path)
    q, k, cos, sin = FAMILY.make_inputs(case)
    with pytest.raises(ValueError):
        forward(q, k, cos[..., :8], sin[..., :8], out=FAMILY.make_out(case, (q, k)))
    with pytest.raises(ValueError):
        forward(q, k, cos, sin, out=FAMILY.make_out(case, (q, k)), unsqueeze_dim=2)


@pytest.mark.parametrize("model_id, pattern", [("tiny-llama", "rope"), ("tiny-gemma", "rope"),
                                               ("tiny-phi3", "rope_partial")])
def test_patterns_match_the_profiled_rotary_calls(model_id, pattern, tmp_path):
    model = build(resolve(model_id), torch.float32, "cpu")
    found = [(name, ops) for name, fam, ops in profiled_occurrences(model, tmp_path)
             if fam == "rope"]
    assert [name for name, _ in found] == [pattern] * 2
    want = next(p for p in FAMILY.patterns if p.name == pattern).ops
    for _, ops in found:
        assert {n: ops[n] for n in want} == want


@pytest.mark.parametrize("model_id", ["tiny-llama", "tiny-gemma", "tiny-phi3", "phi3-partial"])
def test_patch_runs_the_kernel_and_undo_restores(model_id, tmp_path):
    spec = _partial_phi3_spec() if model_id == "phi3-partial" else resolve(model_id)
    model = build(spec, torch.float32, DEVICE)
    attentions = find_rotary_attentions(model)
    module_globals = attentions[0][2]
    original = module_globals["apply_rotary_pos_emb"]
    ids = torch.randint(3, 500, (2, 8), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    with torch.no_grad():
        before = model(ids).logits
        chooser = CountingChooser(FAMILY, tmp_path)
        undo = FAMILY.patch(model, chooser)
        assert patched_rotaries(model) == 2
        patched = model(ids).logits
        # per-row position ids, as transformers' generate passes them at batch > 1: cos and
        # sin then carry the batch, a case of its own
        per_row = model(ids, position_ids=torch.arange(8, device=DEVICE).repeat(2, 1)).logits
        # between calls the module global is the original: other models never see the swap
        assert module_globals["apply_rotary_pos_emb"] is original
        undo()
        after = model(ids).logits
    assert chooser.calls == 4
    assert [c["cos_batch"] for c in chooser.distinct_cases()] == [1, 2]
    assert chooser.distinct_cases() == FAMILY.cases_from_model(model, Workload(2, 8))
    torch.testing.assert_close(per_row, before, atol=1e-4, rtol=1e-4)
    if model_id == "phi3-partial":
        assert chooser.cases[0]["rot_dim"] == chooser.cases[0]["head_dim"] // 2
    torch.testing.assert_close(patched, before, atol=1e-4, rtol=1e-4)
    assert torch.equal(after, before)
    assert instance_forwards(model) == [] and patched_rotaries(model) == 0
    assert module_globals["apply_rotary_pos_emb"] is original


def patched_rotaries(model) -> int:
    """Attentions whose rotary runs ours: an instance forward on the attention, or on its own
    rotary slot (transformers' `use_kernelized_func`, where `kernels` is installed)."""
    return sum("forward" in m.__dict__ or any("forward" in slot.__dict__ for slot in
                                               m.__dict__.get("_kernel_funcs", {}).values())
               for _, m, _, _ in find_rotary_attentions(model))


def test_other_models_of_the_family_are_untouched(tmp_path):
    patched_model = build(resolve("tiny-llama"), torch.float32, DEVICE)
    other = build(resolve("tiny-llama"), torch.float32, DEVICE)
    chooser = CountingChooser(FAMILY, tmp_path)
    undo = FAMILY.patch(patched_model, chooser)
    ids = torch.arange(3, 11, device=DEVICE).view(1, 8)
    with torch.no_grad():
        other(ids)
        assert chooser.calls == 0
        patched_model(ids)
        assert chooser.calls == 2
    undo()


def test_decode_step_uses_the_decode_cases(tmp_path):
    model = build(resolve("tiny-llama"), torch.float32, DEVICE)
    ids = torch.arange(3, 19, device=DEVICE).view(2, 8)
    with torch.no_grad():
        cache = output_cache(model(ids, use_cache=True))
        chooser = CountingChooser(FAMILY, tmp_path)
        undo = FAMILY.patch(model, chooser)
        step = model(ids[:, :1], use_cache=True, **{cache_argument(model): cache}).logits
        undo()
    assert chooser.calls == 2
    listed = FAMILY.cases_from_model(model, Workload(2, 8, mode="decode"))
    assert chooser.distinct_cases() == [c for c in listed if c["cos_batch"] == 1]
    assert [c["cos_batch"] for c in listed] == [1, 2]  # generate's per-row positions
    assert torch.isfinite(step).all()



@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_split_layout_matches_reference(shape, dtype, tmp_path):
    """q and k as separate power-of-two head tiles (Liger's layout), padded heads masked off."""
    case = make_case(*shape, dtype)
    split = [c for c in FAMILY.search_space(case) if c.get("SPLIT")]
    assert split, "every test shape admits the split layout"
    for config in space_ends(split):
        out, ref = run_candidate(FAMILY, config, case, tmp_path)
        assert_close(out, ref, TOL[dtype])
    source = FAMILY.render(split[0], case)
    assert "def _rope_split_kernel" in source and "_rope_forward_kernel" not in source


@pytest.mark.parametrize("dtype", ["float16", pytest.param("bfloat16", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("shape", SHAPES)
def test_native_arithmetic_rounds_as_hf_does(shape, dtype, tmp_path):
    """NATIVE=1 computes in the storage dtype with HF's order of operations (x1 * c1 - x2 * s1,
    each step rounded), so under the interpreter it reproduces HF's half-precision result bit
    for bit (the fp32 default is only within rounding of it); a GPU compiler may contract a
    product and a sum into one FMA, so there it is held to the dtype's tolerance. Searched only
    where the dtype is not fp32 (there it adds nothing)."""
    case = make_case(*shape, dtype)
    native = [c for c in FAMILY.search_space(case) if c.get("NATIVE")]
    assert native and all(c.get("SPLIT") for c in native)
    assert not any(c.get("NATIVE") for c in FAMILY.search_space({**case, "dtype": "float32"}))
    for config in space_ends(native):
        out, ref = run_candidate(FAMILY, config, case, tmp_path)
        if DEVICE == "cpu":
            for o, r in zip(out, ref):
                torch.testing.assert_close(o, r, rtol=0, atol=0)
        else:
            assert_close(out, ref, TOL[dtype])
    source = FAMILY.render(native[0], case)
    assert "NATIVE = True" in source and f"computes in {dtype}" in source
    assert "enable_fp_fusion=not NATIVE" in source  # a GPU compiler must not contract it


def test_known_attention_forwards_rotate_in_place_others_get_new_tensors(tmp_path):
    """HF's Llama/Qwen2/Mistral/Gemma/Phi-3 attentions rebind q and k to the result at once,
    so the adapter writes the rotation over them; an attention with any other forward (one
    that might still read the unrotated q) gets new tensors, as HF's function returns."""
    from codegen.rope.patch import in_place_ok

    class KeepsQuery(modeling_llama.LlamaAttention):
        def forward(self, hidden_states, position_embeddings, attention_mask, **kwargs):
            self.last_query = hidden_states
            return super().forward(hidden_states, position_embeddings, attention_mask, **kwargs)

    assert in_place_ok(modeling_llama.LlamaAttention) and in_place_ok(modeling_phi3.Phi3Attention)
    assert not in_place_ok(KeepsQuery)
    model = build(resolve("tiny-llama"), torch.float32, DEVICE)
    inner = CountingChooser(FAMILY, tmp_path)
    aliased = []

    def chooser(case):
        kernel = inner(case)

        def call(q, k, cos, sin, *, out, **kw):
            aliased.append(out[0] is q and out[1] is k)
            return kernel(q, k, cos, sin, out=out, **kw)
        return call

    undo = FAMILY.patch(model, chooser)
    with torch.no_grad():
        model(torch.randint(3, 500, (1, 4)).to(DEVICE))
    undo()
    assert aliased == [True, True]


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("shape", [(2, 8, 4, 2, 16, 16), (1, 6, 4, 4, 32, 16)])
def test_half_table_reads_one_half_and_holds_only_where_the_halves_are_equal(shape, dtype,
                                                                              tmp_path):
    """A case whose model builds cos/sin as cat(freqs, freqs) gets kernels that read the first
    half of each row; on such tables they match the reference (joint and split layouts, full
    and partial rotary). Fed a general table (second half's angles differ, as make_inputs
    gives a case without the key), the same kernel is wrong: the verifier would reject it."""
    case = make_case(*shape, dtype, equal_halves=True)
    general = {k: v for k, v in case.items() if k != "equal_halves"}
    q, k, cos, sin = FAMILY.make_inputs(general, "cpu", torch.Generator().manual_seed(0))
    half = case["rot_dim"] // 2
    assert not torch.equal(cos[..., :half], cos[..., half:])
    q, k, cos, sin = FAMILY.make_inputs(case, "cpu", torch.Generator().manual_seed(0))
    assert torch.equal(cos[..., :half], cos[..., half:])
    configs = FAMILY.search_space(case)
    assert configs == FAMILY.search_space(general)  # not a search axis
    for config in (configs[0], next(c for c in configs if c.get("SPLIT"))):
        assert "HALF_TABLE = True" in FAMILY.render(config, case)
        assert "HALF_TABLE = False" in FAMILY.render(config, general)
        out, ref = run_candidate(FAMILY, config, case, tmp_path)
        assert_close(out, ref, TOL[dtype])
        forward = load_rendered(FAMILY, config, case, tmp_path)
        inputs = FAMILY.make_inputs(general, DEVICE, torch.Generator(DEVICE).manual_seed(0))
        got = FAMILY.make_out(general, inputs)
        forward(*inputs, out=got)
        want = FAMILY.reference(*inputs)
        assert max((g.float() - w.float()).abs().max().item() for g, w in zip(got, want)) > 0.1


def test_models_with_hf_rotary_tables_get_half_table_cases_others_do_not(tmp_path):
    """The installed HF rotary embedding's rows really have equal halves (the assumption the
    half-table kernel rests on); a model whose rotary embedding runs other code gets cases
    without the key, and the patched model dispatches to kernels of the matching cases."""
    from codegen.rope.patch import tables_have_equal_halves

    model = build(resolve("tiny-llama"), torch.float32, DEVICE)
    rotary = model.model.rotary_emb
    x = torch.zeros(1, device=DEVICE)
    cos, sin = rotary(x, torch.arange(40, 47, device=DEVICE)[None])
    half = cos.shape[-1] // 2
    assert torch.equal(cos[..., :half], cos[..., half:]) and torch.equal(sin[..., :half],
                                                                         sin[..., half:])
    assert tables_have_equal_halves(model)
    assert all(c.get("equal_halves") for c in FAMILY.cases_from_model(model, Workload(2, 8)))
    for model_id in ("tiny-qwen2", "tiny-mistral", "tiny-gemma", "tiny-phi3"):
        assert tables_have_equal_halves(build(resolve(model_id), torch.float32, DEVICE))

    class Shifted(type(rotary)):
        def forward(self, x, position_ids):
            cos, sin = super().forward(x, position_ids)
            return cos.roll(1, dims=-1), sin.roll(1, dims=-1)

    rotary.__class__ = Shifted
    assert not tables_have_equal_halves(model)
    cases = FAMILY.cases_from_model(model, Workload(2, 8))
    assert cases and not any(c.get("equal_halves") for c in cases)
    chooser = CountingChooser(FAMILY, tmp_path)
    ids = torch.arange(3, 19, device=DEVICE).view(2, 8)
    with torch.no_grad():
        undo = FAMILY.patch(model, chooser)
        patched = model(ids).logits
        undo()
        want = model(ids).logits
    assert chooser.distinct_cases() == [c for c in cases if c["cos_batch"] == 1]
    torch.testing.assert_close(patched, want, atol=1e-4, rtol=1e-4)


def test_a_run_with_only_whole_table_kernels_still_patches_a_half_table_model(tmp_path):
    """Kernels searched for general cases (a run from before `equal_halves`) serve a model
    whose tables have equal halves; a chooser with nothing for either leaves HF's code."""
    model = build(resolve("tiny-llama"), torch.float32, DEVICE)
    inner = CountingChooser(FAMILY, tmp_path)
    asked = []

    def general_only(case):
        asked.append(case)
        return None if case.get("equal_halves") else inner(case)

    ids = torch.arange(3, 19, device=DEVICE).view(2, 8)
    with torch.no_grad():
        want = model(ids).logits
        undo = FAMILY.patch(model, general_only)
        got = model(ids).logits
        undo()
    # each layer's dispatcher asks once per signature: the half-table case, then the general one
    assert inner.calls == 2 and [c.get("equal_halves") for c in asked] == [True, None] * 2
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    nothing = CountingChooser(FAMILY, tmp_path, give=False)
    with torch.no_grad():
        undo = FAMILY.patch(model, nothing)
        assert torch.equal(model(ids).logits, want)
        undo()
    assert nothing.calls == 0 and len(nothing.distinct_cases()) == 2

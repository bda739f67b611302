"""Attention family: reference == transformers' sdpa_attention_forward, rendered kernels ==
reference on HF's strided layout and the edge cases, the verifier accepts a candidate, the
pattern == what the profile's matcher finds, and per-instance patching through the modeling
module's ALL_ATTENTION_FUNCTIONS with exact undo and fallbacks, on tiny models. CPU runs the
kernels under Triton's interpreter (fp32, fp16); bf16 and real model shapes run on a GPU."""

from __future__ import annotations

import types

import pytest
import torch
from family_checks import (
    DEVICE,
    CountingChooser,
    assert_close,
    declines_then_trains,
    instance_forwards,
    load_rendered,
    profiled_ops,
    run_candidate,
    space_ends,
    verify_on_cpu_or_gpu,
)
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from codegen.attention import FAMILY
from codegen.attention.patch import GLOBAL_NAME, find_attentions
from codegen.attention.reference import make_case
from core.workload import Workload
from models.graphs import cache_argument, output_cache
from profiling.loader import build, resolve

# fp16 outputs are rounded once from fp32; PV runs in fp32, so 2 fp16 ulps hold everywhere
TOL = {"float32": (2e-5, 2e-5), "float16": (2e-3, 2e-3), "bfloat16": (2e-2, 2e-2)}
KERNEL_DTYPES = ["float32", "float16", pytest.param("bfloat16", marks=pytest.mark.gpu)]
# (batch, seq, heads, kv_heads, head_dim): tiny GQA as the zoo's tiny models, several query
# blocks with a 7:1 group, MHA with a head_dim no power of two, one token
SHAPES = [(2, 8, 4, 2, 16), (1, 45, 14, 2, 32), (2, 19, 3, 3, 24), (3, 1, 4, 1, 16)]
TINY = ["tiny-llama", "tiny-qwen2", "tiny-mistral"]
IDS = torch.randint(3, 500, (2, 8), generator=torch.Generator().manual_seed(0))


def _hf_attention(q, k, v, scale):
    module = types.SimpleNamespace(num_key_value_groups=q.shape[1] // k.shape[1],
                                   is_causal=True)
    out, weights = sdpa_attention_forward(module, q, k, v, None, dropout=0.0, scaling=scale)
    assert weights is None
    return out


@pytest.mark.parametrize("seq", [1, 7])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_reference_is_bitwise_the_hf_function(dtype, seq):
    for heads, kv_heads in ((4, 2), (4, 4)):
        case = make_case(2, seq, heads, kv_heads, 16, dtype)
        q, k, v = FAMILY.make_inputs(case, DEVICE, torch.Generator(DEVICE).manual_seed(1))
        assert q.stride(1) == 16 and k.stride(1) == 16  # HF's transposed views
        want = _hf_attention(q, k, v, case["scale"])
        got = FAMILY.reference(q, k, v, scale=case["scale"])
        assert got.shape == (2, seq, heads, 16) and got.is_contiguous()
        assert got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (3, 3)])
def test_float64_reference_is_sdpa_on_finite_inputs(heads, kv_heads):
    """float64 (the verifier's accuracy reference) is spelled out; on finite inputs it is SDPA."""
    case = make_case(2, 9, heads, kv_heads, 16, "float64")
    q, k, v = FAMILY.make_inputs(case, DEVICE, torch.Generator(DEVICE).manual_seed(2))
    want = _hf_attention(q, k, v, case["scale"])
    torch.testing.assert_close(FAMILY.reference(q, k, v, scale=case["scale"]), want,
                               atol=1e-12, rtol=1e-12)


def test_search_space_is_small_and_causal_blocks_line_up():
    for seq in (1, 8, 45, 512, 4096):
        for d in (16, 64, 128, 256):
            configs = FAMILY.search_space(make_case(2, seq, 8, 2, d, "bfloat16"))
            assert 1 <= len(configs) <= 12
            assert all(c["BLOCK_M"] % c["BLOCK_N"] == 0 for c in configs)
            assert all(c["BLOCK_M"] <= max(16, seq) * 2 for c in configs)
    big = FAMILY.search_space(make_case(2, 512, 32, 8, 64, "bfloat16"))
    assert big[-1]["BLOCK_M"] == 128 and big[0]["BLOCK_M"] <= 32


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rendered_matches_reference(shape, dtype, tmp_path):
    case = make_case(*shape, dtype)
    configs = FAMILY.search_space(case)
    for config in space_ends(configs):
        out, ref = run_candidate(FAMILY, config, case, tmp_path)
        assert_close(out, ref, TOL[dtype])


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_edge_cases(dtype, tmp_path):
    base = make_case(2, 8, 4, 2, 16, dtype)
    edges = FAMILY.edge_cases(base)
    assert any(c["seq"] == 1 for c in edges) and any(c.get("contiguous") for c in edges)
    assert any(c["heads"] == c["kv_heads"] for c in edges)
    assert any(c["heads"] == 7 * c["kv_heads"] for c in edges)
    assert any(c["seq"] > 128 and c["seq"] % 16 for c in edges)  # several blocks, none full
    assert all(c["head_dim"] == base["head_dim"] and c["scale"] == base["scale"]
               for c in edges)
    # the candidate of the base case runs them all, with its narrowest and widest tiles
    for config in (FAMILY.search_space(base)[0], {"BLOCK_M": 128, "BLOCK_N": 64,
                                                  "num_warps": 4, "num_stages": 2}):
        for case in edges:
            out, ref = run_candidate(FAMILY, config, case, tmp_path, rendered_for=base)
            assert_close(out, ref, TOL[dtype])


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy, on NaN
def test_rows_with_only_minus_inf_scores_give_zero_and_nan_propagates(tmp_path):
    """SDPA's fully-masked convention (math backend, FlashAttention): a row whose every score
    is -inf gives 0, not NaN; a NaN input gives NaN in its row only."""
    case = make_case(1, 4, 2, 1, 16, "float32")
    q, k, v = FAMILY.make_inputs(case, DEVICE, torch.Generator(DEVICE).manual_seed(3))
    k[0, 0, 0, 0], k[0, 0, 1, 0] = 1.0, -1.0
    q[0, 0, 0, 0] = float("-inf")  # row 0 of head 0 sees only key 0: score -inf
    q[0, 1, 2, 3] = float("nan")
    forward = load_rendered(FAMILY, FAMILY.search_space(case)[0], case, tmp_path)
    out = FAMILY.make_out(case, (q,))
    forward(q, k, v, out=out, scale=case["scale"])
    # float64 runs SDPA's math backend on either device, as the verifier's reference does
    ref = FAMILY.reference(q.double(), k.double(), v.double(), scale=case["scale"]).float()
    assert torch.equal(out[0, 0, 0], torch.zeros(16, device=DEVICE))
    assert q[0, 0, 0] @ k[0, 0, 1] == float("inf")  # the masked key 1 would score +inf
    assert torch.equal(ref[0, 0, 0], out[0, 0, 0])
    assert out[0, 2, 1].isnan().all() and ref[0, 2, 1].isnan().all()
    finite = torch.ones_like(out, dtype=torch.bool)
    finite[0, 2, 1] = False
    assert out[finite].isfinite().all()
    torch.testing.assert_close(out[finite], ref[finite], atol=2e-5, rtol=2e-5)


def test_rendered_source_is_specialised_and_checks_shapes(tmp_path):
    case = make_case(2, 8, 4, 2, 32, "float16")
    config = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 1, "num_stages": 2}
    source = FAMILY.render(config, case)
    for line in ("HEAD_DIM = 32", "BLOCK_D = 32", 'DTYPE = "float16"', "BLOCK_M = 16",
                 "BLOCK_N = 16", "NUM_WARPS = 1", "NUM_STAGES = 2", 'PV_PRECISION = "tf32x3"',
                 "def _attn_fwd_kernel", "def _attn_key_blocks",
                 "def forward(q, k, v, *, out, scale=SCALE)",
                 "enable_fp_fusion=False"):  # the GPU NaN of 2026-11-30: no FMA of s*scale - m
        assert line in source
    forward = load_rendered(FAMILY, config, case, tmp_path)
    q, k, v = FAMILY.make_inputs(case)
    with pytest.raises(ValueError):  # head_dim is baked in
        forward(q[..., :16], k[..., :16], v[..., :16], out=torch.empty(2, 8, 4, 16,
                                                                        dtype=q.dtype))
    with pytest.raises(ValueError):  # so is the dtype (it picks the dot precisions)
        forward(q.float(), k.float(), v.float(), out=torch.empty(2, 8, 4, 32))
    with pytest.raises(ValueError):  # k/v lengths differ from q's: not the causal square
        forward(q, k[:, :, :4], v[:, :, :4], out=FAMILY.make_out(case, (q,)))


def _profiled_attention(model, tmp_path):
    """[(pattern, family, op dicts)] of the attention occurrences in one profiled CPU forward,
    matched with the base patterns plus this family's."""
    from profiling.patterns import BASE_PATTERNS, match

    ops = profiled_ops(model, tmp_path, batch=2)
    found, _ = match(ops, list(BASE_PATTERNS) + list(FAMILY.patterns))
    return [(o.pattern, o.family, [ops[i] for i in o.ops]) for o in found
            if o.family == "attention"]


@pytest.mark.parametrize("model_id", TINY)
def test_pattern_matches_the_profiled_sdpa_calls_and_costs_them(model_id, tmp_path):
    model = build(resolve(model_id), torch.float32, "cpu")
    found = _profiled_attention(model, tmp_path)
    assert [name for name, _, _ in found] == ["attention"] * model.config.num_hidden_layers
    [case] = FAMILY.cases_from_model(model, Workload(2, 8))
    for _, _, ops in found:
        assert [o["name"] for o in ops].count("aten::scaled_dot_product_attention") == 1
        assert FAMILY.patterns[0].cost(ops) == (FAMILY.min_bytes(case), FAMILY.flops(case))


@pytest.mark.parametrize("model_id", TINY)
def test_patch_runs_the_kernel_and_undo_restores(model_id, tmp_path):
    model = build(resolve(model_id), torch.float32, DEVICE)
    [(_, attention, module_globals), *_] = find_attentions(model)
    original, config = module_globals[GLOBAL_NAME], attention.config
    ids = IDS.to(DEVICE)
    with torch.no_grad():
        before = model(ids).logits
        chooser = CountingChooser(FAMILY, tmp_path)
        undo = FAMILY.patch(model, chooser)
        assert len(instance_forwards(model)) == model.config.num_hidden_layers
        patched = model(ids).logits
        # between calls the module global is the original and the config untouched: other
        # models and instances never see the swap
        assert module_globals[GLOBAL_NAME] is original and attention.config is config
        assert config._attn_implementation == "sdpa"
        undo()
        after = model(ids).logits
    assert chooser.calls == model.config.num_hidden_layers
    assert chooser.distinct_cases() == FAMILY.cases_from_model(model, Workload(2, 8))
    torch.testing.assert_close(patched, before, atol=1e-4, rtol=1e-4)
    assert torch.equal(after, before)
    assert instance_forwards(model) == []
    assert module_globals[GLOBAL_NAME] is original and attention.config is config


def test_other_models_of_the_family_are_untouched(tmp_path):
    patched_model = build(resolve("tiny-llama"), torch.float32, DEVICE)
    other = build(resolve("tiny-llama"), torch.float32, DEVICE)
    chooser = CountingChooser(FAMILY, tmp_path)
    undo = FAMILY.patch(patched_model, chooser)
    ids = IDS[:1].to(DEVICE)
    with torch.no_grad():
        other(ids)
        assert chooser.calls == 0
        patched_model(ids)
        assert chooser.calls == 2
    undo()


def test_decode_step_falls_back_and_has_no_cases(tmp_path):
    model = build(resolve("tiny-llama"), torch.float32, DEVICE)
    ids = IDS.to(DEVICE)
    name = cache_argument(model)
    with torch.no_grad():
        cache = output_cache(model(ids, use_cache=True))
        want = model(ids[:, :1], use_cache=True, **{name: cache}).logits
        cache = output_cache(model(ids, use_cache=True))
        chooser = CountingChooser(FAMILY, tmp_path)
        undo = FAMILY.patch(model, chooser)
        step = model(ids[:, :1], use_cache=True, **{name: cache}).logits
        undo()
    assert chooser.cases == [] and chooser.calls == 0
    assert torch.equal(step, want)
    assert FAMILY.cases_from_model(model, Workload(2, 8, mode="decode")) == []


def test_padding_mask_falls_back(tmp_path):
    """A padded batch makes HF build a mask: not the pure causal case, HF's SDPA runs."""
    model = build(resolve("tiny-qwen2"), torch.float32, DEVICE)
    ids = IDS.to(DEVICE)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with torch.no_grad():
        want = model(ids, attention_mask=mask).logits
        chooser = CountingChooser(FAMILY, tmp_path)
        undo = FAMILY.patch(model, chooser)
        got = model(ids, attention_mask=mask).logits
        unpadded = model(ids, attention_mask=torch.ones_like(ids)).logits  # HF drops this mask
        undo()
    assert torch.equal(got, want)
    assert chooser.calls == 2 and torch.isfinite(unpadded).all()


def test_declined_cases_and_autograd_run_the_original_code(tmp_path):
    model, chooser = declines_then_trains(FAMILY, "tiny-llama", IDS, tmp_path)
    assert chooser.calls == 0 and chooser.cases == []
    assert any(p.grad is not None for p in model.parameters())


def test_eager_attention_is_left_alone(tmp_path):
    """The dispatcher only fronts transformers' own sdpa_attention_forward."""
    model = build(resolve("tiny-llama"), torch.float32, DEVICE)
    model.set_attn_implementation("eager")
    assert FAMILY.cases_from_model(model, Workload(2, 8)) == []
    chooser = CountingChooser(FAMILY, tmp_path)
    undo = FAMILY.patch(model, chooser)
    with torch.no_grad():
        model(IDS.to(DEVICE))
    undo()
    assert chooser.cases == []


# ---------------------------------------------------------------- GPU: real model shapes, bf16

# (batch, seq, heads, kv_heads, head_dim) of Llama-3.2-1B and Qwen2.5-0.5B at batch 2, seq 512
REAL = {"llama-3.2-1b": (2, 512, 32, 8, 64), "qwen2.5-0.5b": (2, 512, 14, 2, 64)}
# q a transposed view of its projection, k and v the KV cache's contiguous cat results
CACHED = ("bshd", "bhsd", "bhsd")


@pytest.mark.gpu
@pytest.mark.parametrize("model_id", sorted(REAL))
def test_gpu_bf16_model_shapes_match_and_verify(model_id, tmp_path):
    case = make_case(*REAL[model_id], "bfloat16", layouts=CACHED)
    configs = FAMILY.search_space(case)
    for config in configs:
        out, ref = run_candidate(FAMILY, config, case, tmp_path)
        assert_close(out, ref, TOL["bfloat16"])
    verify_on_cpu_or_gpu(FAMILY, case, tmp_path)


@pytest.mark.parametrize("model_id", sorted(REAL))
def test_cases_from_the_real_configs(model_id):
    from transformers import AutoConfig, AutoModelForCausalLM

    from models.zoo import ZOO

    config = AutoConfig.for_model(**ZOO[model_id])
    with torch.device("meta"):  # shapes only: no weights allocated
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    [case] = FAMILY.cases_from_model(model, Workload(2, 512, "bfloat16", "cuda"))
    assert case == make_case(*REAL[model_id], "bfloat16", layouts=CACHED)

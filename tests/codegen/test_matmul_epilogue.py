"""Matmul-epilogue family: reference == the HF MLPs' path up to down_proj (Llama, Gemma, Phi-3),
rendered dual-GEMM kernels == reference on recorded and awkward shapes, its patterns extend
gated_act's occurrences with the absorbed projections, and the patch wraps whatever runs the MLP
(gated_act's patch included), per instance, with undo. CPU runs the kernels under Triton's
interpreter (fp32, fp16); bf16 kernel checks run on a GPU (the interpreter gets bf16 wrong)."""

from __future__ import annotations

import collections

import pytest
import torch
from family_checks import (
    DEVICE,
    CountingChooser,
    assert_close,
    declines_then_trains,
    instance_forwards,
    load_rendered,
    logits_patched,
    profiled_ops,
    run_candidate,
    space_ends,
    verify_on_cpu_or_gpu,
)
from transformers import GemmaConfig, LlamaConfig, Phi3Config
from transformers.models.gemma.modeling_gemma import GemmaMLP
from transformers.models.llama.modeling_llama import LlamaMLP
from transformers.models.phi3.modeling_phi3 import Phi3MLP

from codegen.gated_act import FAMILY as GATED_ACT
from codegen.gated_act.reference import activation
from codegen.matmul import FAMILY as MATMUL
from codegen.matmul_epilogue import FAMILY, gated_gemm_cost
from codegen.matmul_epilogue.reference import MAX_BLOCK_M, make_case
from core.workload import Workload
from profiling.loader import build, resolve
from verify.numerics import apply_stress

# sigmoid(z) = 1 / (1 + exp(-z)) overflows exp for z << 0 on the way to the right 0.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

# Against the reference in the case's dtype. fp32: the kernel sums each dot product over hidden
# in another order than BLAS (BK-wide steps), which moves gate and up by a few ulps of the
# partial sums, ~1e-6 relative at these widths. fp16/bf16: the reference rounds four times in
# the storage dtype (gate, up, the activation, the product; the gate's rounding carried through
# the activation's slope, at most 1.13), the kernel once from fp32: about 5.3 half-ulps, 2^-11
# (fp16) or 2^-8 (bf16) each, hence rtol 3e-3 and 2.5e-2. atol covers the activation's tail
# (gate << 0), where act(gate) is tiny and its relative error large but the absolute one stays
# under 2^-11 * max|g act'(g)| (0.26) * |up|, about 2e-5 at these inputs (measured worst 2.4e-5
# over 4 x 131072 elements at rtol 3e-3: hence 1e-4).
TOL = {"float32": (1e-5, 1e-5), "float16": (1e-4, 3e-3), "bfloat16": (1e-3, 2.5e-2)}
KERNEL_DTYPES = ["float32", "float16", pytest.param("bfloat16", marks=pytest.mark.gpu)]
ACTS = ["silu", "gelu_tanh"]
# (rows, hidden, cols): tiny-llama's recorded MLP (2 x 8 tokens); one row; a prime row count
# with a hidden of several K steps and a tail (896 = 14 x 64, 7 x 128) and a narrow output; just
# past the largest row block with a hidden no BK divides (96) and cols no BN divides (176).
SHAPES = [(16, 64, 176), (1, 96, 176), (37, 896, 48), (MAX_BLOCK_M + 1, 96, 176)]
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


def _weights(mlp):
    if isinstance(mlp, Phi3MLP):
        w = mlp.gate_up_proj.weight
        return w[:INTER], w[INTER:]
    return mlp.gate_proj.weight, mlp.up_proj.weight


def _down_proj_input(mlp, x):
    seen = {}
    hook = mlp.down_proj.register_forward_pre_hook(
        lambda m, args: seen.__setitem__("hidden", args[0]))
    with torch.no_grad():
        mlp(x)
    hook.remove()
    return seen["hidden"]


@pytest.mark.parametrize("kind, act", [("llama", "silu"), ("gemma", "gelu_tanh"),
                                       ("phi3", "silu")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_reference_is_bitwise_the_hf_mlp(kind, act, dtype):
    mlp = _mlp(kind, dtype)
    x = torch.randn(2, 5, HIDDEN, generator=torch.Generator().manual_seed(1)).to(dtype)
    hidden = _down_proj_input(mlp, x)
    with torch.no_grad():
        got = FAMILY.reference(x, *_weights(mlp), act=act)
    assert got.dtype == hidden.dtype and torch.equal(got, hidden)


def test_the_reference_of_packed_halves_runs_phi3s_one_gemm():
    """Phi-3's halves take its own path (one GEMM, the product on strided halves: the timing
    baseline must cost what the model ran); halves of separate storages, however placed, and
    two unrelated weights take two GEMMs."""
    from codegen.matmul_epilogue.reference import packed_weight

    w = torch.randn(2 * INTER, HIDDEN)
    packed = packed_weight(w[:INTER], w[INTER:])
    assert packed is not None and packed.data_ptr() == w.data_ptr() and torch.equal(packed, w)
    assert packed_weight(w[INTER:], w[:INTER]) is None  # up before gate: not Phi-3's order
    assert packed_weight(w[:INTER].clone(), w[INTER:].clone()) is None
    assert packed_weight(w[:INTER], w[INTER + 1:2 * INTER + 1]) is None  # shapes differ
    x = torch.randn(3, HIDDEN)
    ops = []

    class Count(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            ops.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    with Count():
        FAMILY.reference(x, w[:INTER], w[INTER:])
    assert ops.count("linear") == 1 and "chunk" in ops
    ops.clear()
    with Count():
        FAMILY.reference(x, w[:INTER].clone(), w[INTER:].clone())
    assert ops.count("linear") == 2


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("rows, hidden, cols", SHAPES)
def test_rendered_matches_reference(rows, hidden, cols, dtype, act, tmp_path):
    case = make_case(rows, hidden, cols, dtype, act)
    for config in space_ends(FAMILY.search_space(case)):
        out, ref = run_candidate(FAMILY, config, case, tmp_path)
        assert_close(out, ref, TOL[dtype])


@pytest.mark.parametrize("rows", [5, 65])  # a few-rows space, a prefill space
def test_every_config_of_a_space_is_correct(rows, tmp_path):
    case = make_case(rows, 40, 48, "float16", "gelu_tanh")  # 40: a K tail for every BK
    configs = FAMILY.search_space(case)
    for config in configs:
        out, ref = run_candidate(FAMILY, config, case, tmp_path)
        assert_close(out, ref, TOL["float16"])


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("rows", [1, 7, 64, 65, 8192])
def test_search_space_orders_small_to_widest(rows, dtype):
    from codegen.matmul_epilogue.kernel import SMEM_LIMIT, smem_bytes

    case = make_case(rows, 2048, 8192, dtype, "silu")
    configs = [c for c in FAMILY.search_space(case) if not c.get("GEMV")]
    areas = [c["BM"] * c["BN"] for c in configs]
    assert areas == sorted(areas) and areas[-1] == max(areas) == 128 * 128
    assert configs[-1]["BM"] == MAX_BLOCK_M  # the edge cases go one row past it
    assert len({repr(c) for c in configs}) == len(configs)
    assert all(c["BK"] >= 16 and smem_bytes(c, case) <= SMEM_LIMIT for c in configs)
    small_m = {c["BM"] for c in configs} & {16, 32}
    if rows <= 64:  # decode and short prompts get row blocks their size
        assert small_m == {16, 32}
    else:
        assert not small_m and 8 <= len(configs) <= 16


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_edge_cases(dtype, tmp_path):
    base = make_case(16, 96, 176, dtype, "silu")
    edges = FAMILY.edge_cases(base)
    rows = [c["rows"] for c in edges]
    assert 1 in rows and MAX_BLOCK_M + 1 in rows and any("row_stride" in c for c in edges)
    assert any(r > 2 and all(r % d for d in range(2, r)) for r in rows)  # a prime
    # HIDDEN and COLS are baked into a candidate: the edges keep them
    assert all((c["hidden"], c["cols"]) == (base["hidden"], base["cols"]) for c in edges)
    strided = next(c for c in edges if "row_stride" in c)
    x = FAMILY.make_inputs(strided)[0]
    assert x.stride(0) == strided["row_stride"] > x.shape[1]
    for config in space_ends(FAMILY.search_space(base)):
        for case in edges:
            out, ref = run_candidate(FAMILY, config, case, tmp_path, rendered_for=base)
            assert_close(out, ref, TOL[dtype])


@pytest.mark.parametrize("rows, gemv", [(1, True), (2, True), (4, True), (16, True),
                                        (17, False), (64, False)])
def test_decode_rows_search_the_gemv_kernel_first(rows, gemv):
    """At a decode step's rows (at most the gemv family's 16) the GEMV kernel's configs lead
    the space (the search's `spread` always measures the first); the tile kernels follow.
    From 2 rows DOT_CONFIGS tensor-core ones join them (BLOCK_N 16 at least), the first of
    them the family's guess from 4 rows (Llama-3.2-1B's 8192 columns: 256 programs of 32)."""
    space = FAMILY.search_space(make_case(rows, 2048, 8192, "bfloat16", "silu"))
    assert bool(space[0].get("GEMV")) is gemv
    assert not any(c.get("GEMV") for c in space[-3:])  # the widest tile stays last
    if gemv:
        from codegen.matmul_epilogue.gemv import DOT_CONFIGS, MAX_CONFIGS

        heads = [c for c in space if c.get("GEMV")]
        dots = [c for c in heads if c.get("DOT")]
        assert len(heads) == MAX_CONFIGS + len(dots) == len({repr(c) for c in heads})
        assert len(dots) == (DOT_CONFIGS if rows >= 2 else 0)
        assert all(c["BLOCK_N"] >= 16 and c["DOT"] is True for c in dots)
        assert all("DOT" not in c for c in heads if c not in dots)  # the dicts they were
        if rows >= 4:
            assert heads[0] == {"GEMV": True, "BLOCK_N": 32, "BLOCK_K": 256, "num_warps": 4,
                                "num_stages": 3, "DOT": True}
        else:
            assert "DOT" not in heads[0] and heads[0]["BLOCK_K"] == 512


# (rows, hidden, cols): one row; the gemv family's largest row block; a prime row count over
# a hidden of several K steps and a tail (896 = 7 x 128), a non-power-of-two cols (176) no
# BLOCK_N divides; and past MAX_ROWS (two launches, the second of one row).
GEMV_SHAPES = [(1, 96, 176), (16, 64, 48), (7, 896, 176), (17, 96, 176)]


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("rows, hidden, cols", GEMV_SHAPES)
def test_every_gemv_config_matches_reference(rows, hidden, cols, dtype, act, tmp_path):
    from codegen.matmul_epilogue.gemv import search_space

    case = make_case(rows, hidden, cols, dtype, act)
    for config in search_space(case):
        out, ref = run_candidate(FAMILY, config, case, tmp_path)
        assert_close(out, ref, TOL[dtype])


@pytest.mark.parametrize("dtype, act", [("float32", "silu"), ("float16", "gelu_tanh")])
def test_the_gemv_kernels_dot_configs_match_reference_at_eight_rows(dtype, act, tmp_path):
    """DOT (both weights' tiles through tensor-core dots, 8 rows padded to 16) on a hidden of
    several K steps and a tail (896 = 3.5 x 256) and cols no BLOCK_N divides (176), and on
    Phi-3's packed halves (strided weight views, fp16): every DOT config of the space."""
    from codegen.matmul_epilogue.gemv import DOT_CONFIGS, search_space

    for weights in (None, "packed") if dtype == "float16" else (None,):
        case = make_case(8, 896, 176, dtype, act, **({"weights": weights} if weights else {}))
        dots = [c for c in search_space(case) if c.get("DOT")]
        assert len(dots) == DOT_CONFIGS and {c["BLOCK_K"] for c in dots} != {128}
        for config in dots:
            out, ref = run_candidate(FAMILY, config, case, tmp_path)
            assert_close(out, ref, TOL[dtype])


def test_the_gemv_kernel_reads_phi3s_packed_halves_in_place(tmp_path):
    case = make_case(3, 96, 176, "float32", "silu", weights="packed")
    config = FAMILY.search_space(case)[0]
    assert config.get("GEMV")
    out, ref = run_candidate(FAMILY, config, case, tmp_path)
    assert_close(out, ref, TOL["float32"])


def test_the_gemv_kernel_sums_in_fp32(tmp_path):
    """As test_fp16_dots_accumulate_in_fp32, for the GEMV kernel's sums."""
    case = make_case(1, 96, 16, "float16", "silu")
    forward = load_rendered(FAMILY, FAMILY.search_space(case)[0], case, tmp_path)
    x = torch.ones(1, 96, dtype=torch.float16, device=DEVICE)
    x[0, 0] = 2048
    w_gate = torch.ones(16, 96, dtype=torch.float16, device=DEVICE)
    out = torch.empty(1, 16, dtype=torch.float16, device=DEVICE)
    forward(x, w_gate, w_gate / 1024, out=out, act="silu")
    exact = torch.tensor(2143 * 2143 / 1024, dtype=torch.float64).half()
    assert torch.equal(out.cpu(), exact.expand(1, 16))


def test_fp16_dots_accumulate_in_fp32(tmp_path):
    """x = [2048, 1, 1, ...]: an fp16 accumulator loses every 1 after the 2048 (2049 is not an
    fp16), an fp32 one keeps them all. Under the interpreter tl.dot is numpy's matmul with the
    fp32 accumulator's dtype as its result type, which converts fp16 operands first."""
    case = make_case(1, 96, 16, "float16", "silu")
    forward = load_rendered(FAMILY, FAMILY.search_space(case)[-1], case, tmp_path)
    x = torch.ones(1, 96, dtype=torch.float16, device=DEVICE)
    x[0, 0] = 2048
    w_gate = torch.ones(16, 96, dtype=torch.float16, device=DEVICE)
    out = torch.empty(1, 16, dtype=torch.float16, device=DEVICE)
    forward(x, w_gate, w_gate / 1024, out=out, act="silu")
    exact = torch.tensor(2143 * 2143 / 1024, dtype=torch.float64).half()  # silu(2143) = 2143
    assert exact != 2048 * 2 and torch.equal(out.cpu(), exact.expand(1, 16))


@pytest.mark.parametrize("dtype, act", [("float32", "silu"), ("float16", "gelu_tanh")])
def test_tma_candidates_are_searched_for_prefill_rows_and_match_on_the_edges(dtype, act,
                                                                            tmp_path):
    """From TMA_MIN_ROWS rows the space ends with the TMA kernel (loads and stores through
    tensor descriptors, one program per SM on a GPU); it must be right where TMA zero-fills
    (a hidden no BK divides, rows and cols past the last tile) and where it cannot address x
    directly (a column slice goes through an aligned copy)."""
    from codegen.matmul_epilogue.kernel import TMA_MIN_ROWS, tma_ok

    case = make_case(TMA_MIN_ROWS + 44, 96, 176, dtype, act)
    space = FAMILY.search_space(case)
    tma = [c for c in space if c.get("TMA") and not c.get("WIDE")]
    assert space[-1].get("TMA") and len(tma) == 4
    # the output tile stored whole and in two halves: both go through the checks below
    plain, halves = tma[0], tma[-1]
    assert not plain.get("SUBTILE") and halves.get("SUBTILE")
    assert not any(c.get("TMA") for c in FAMILY.search_space({**case, "rows": 64}))
    assert not tma_ok({**case, "cols": 173})  # 173 x 2 bytes: not a 16-byte row
    source = FAMILY.render(halves, case)
    assert "tl.make_tensor_descriptor" in source and "launcher(_gated_gemm_tma_kernel" in source
    assert "SUBTILE=True" in source and "SUBTILE=False" in FAMILY.render(plain, case)
    helpers = load_rendered(FAMILY, halves, case, tmp_path).__globals__
    buf = torch.zeros(case["rows"] * 96 + 1, dtype=getattr(torch, dtype))
    shifted = buf[1:].view(case["rows"], 96)  # contiguous, but 2 or 4 bytes off alignment
    assert shifted.is_contiguous() and not helpers["_aligned"](shifted)
    assert helpers["_aligned"](helpers["_fresh"](shifted))
    for config in (plain, halves):
        for edge in [case] + FAMILY.edge_cases(case):
            out, ref = run_candidate(FAMILY, config, edge, tmp_path, rendered_for=case)
            assert_close(out, ref, TOL[dtype])
    verify_on_cpu_or_gpu(FAMILY, case, tmp_path)


@pytest.mark.parametrize("dtype, act", [("float32", "gelu_tanh"), ("float16", "silu")])
def test_wide_candidates_read_both_weights_through_one_descriptor(dtype, act, tmp_path):
    """The wide kernel (one dot over gate and up, a 3-D descriptor whose leading stride is the
    distance between them) comes last for prefill rows and gives act(gate) * up whichever
    weight lies first in memory, on the edges, and through copies where one descriptor cannot
    reach both (weights of different strides)."""
    from codegen.matmul_epilogue.kernel import TMA_MIN_ROWS

    case = make_case(TMA_MIN_ROWS + 44, 96, 176, dtype, act)
    space = FAMILY.search_space(case)
    wide = [c for c in space if c.get("WIDE")]
    assert len(wide) == 2 and space[-1] is wide[-1] and all(c["TMA"] for c in wide)
    assert not any(c.get("WIDE") for c in FAMILY.search_space({**case, "rows": 64}))
    source = FAMILY.render(space[-1], case)
    assert "launcher(_gated_gemm_wide_kernel, UP_FIRST=True" in source
    assert "One fp32 (128 x 256) accumulator" in source
    for config in wide:
        for edge in [case] + FAMILY.edge_cases(case):
            out, ref = run_candidate(FAMILY, config, edge, tmp_path, rendered_for=case)
            assert_close(out, ref, TOL[dtype])
    forward = load_rendered(FAMILY, space[-1], case, tmp_path)
    x, wg, wu = FAMILY.make_inputs(case, DEVICE, torch.Generator(DEVICE).manual_seed(1))
    ref = FAMILY.reference(x, wg, wu, act=act)
    packed = torch.cat([wu, wg])  # up first in memory, one buffer (Phi-3's gate_up_proj)
    # gate's rows 64 elements further apart than up's: each alone is TMA's, the two are not
    # one descriptor's, so both get copied
    spaced = torch.zeros(wg.shape[0], wg.shape[1] + 64, dtype=wg.dtype, device=DEVICE)
    spaced[:, :wg.shape[1]] = wg
    gate_spaced = spaced[:, :wg.shape[1]]
    helpers = forward.__globals__
    assert helpers["_aligned"](gate_spaced) and not helpers["_pairable"](gate_spaced, wu)
    assert helpers["_pairable"](packed[wg.shape[0]:], packed[:wg.shape[0]])
    for w_gate, w_up in [(packed[wg.shape[0]:], packed[:wg.shape[0]]), (gate_spaced, wu)]:
        out = torch.full_like(ref, float("nan"))
        forward(x, w_gate, w_up, out=out, act=act)
        assert_close(out, ref, TOL[dtype])
    swapped = torch.zeros_like(ref)  # the roles matter: act(up) * gate is another product
    forward(x, packed[:wg.shape[0]], packed[wg.shape[0]:], out=swapped, act=act)
    assert (swapped - ref).abs().max() > 100 * TOL[dtype][0]
    verify_on_cpu_or_gpu(FAMILY, case, tmp_path)


@pytest.mark.parametrize("kind", ["random", "mixed"])
def test_the_order_bound_rejects_tf32_products_at_a_real_width(kind):
    """At hidden 2048 the worst-case bound alone would excuse TF32 products (and an fp16
    accumulator); the verifier's parity test does not. Another fp32 summation order passes."""
    from verify.numerics import compare_one, order_slack
    from verify.tolerances import tolerance_for

    case = make_case(64, 2048, 256, "float32", "silu")
    x, wg, wu = FAMILY.make_inputs(case, "cpu", torch.Generator().manual_seed(3))
    if kind == "mixed":
        apply_stress((x, wg, wu), FAMILY.verify.stress_inputs, kind, 3)
    exact = FAMILY.reference(*(t.double() for t in (x, wg, wu)))
    base = FAMILY.reference(x, wg, wu)
    (slack,) = order_slack(FAMILY, (x, wg, wu), {"act": "silu"})
    tol = tolerance_for(torch.float32)

    def blocked(a, w):  # fp32 partial products over 256-wide K blocks, summed last to first
        parts = [a[:, k:k + 256] @ w[:, k:k + 256].T for k in range(0, a.shape[1], 256)]
        return torch.stack(parts[::-1]).sum(0)

    other_order = activation(blocked(x, wg), "silu") * blocked(x, wu)
    assert compare_one(other_order, exact, base, tol, slack).ok

    def tf32(t):  # 10 mantissa bits, as TF32 tensor cores read fp32 operands
        return (t.view(torch.int32) & ~0x1FFF).view(torch.float32)

    truncated = FAMILY.reference(tf32(x), tf32(wg), tf32(wu))
    out = compare_one(truncated, exact, base, tol, slack)
    assert not out.ok and not compare_one(truncated, exact, base, tol).ok


def test_the_order_bound_still_rejects_a_lost_term(tmp_path):
    """The bound is no blanket: a candidate whose K loop stops one step early (the last BK
    columns of x never multiplied) fails the numerics check on random inputs."""
    from verify.harness import verify_candidate

    case = make_case(16, 96, 176, "float32", "silu")
    config = FAMILY.search_space(case)[-1]
    source = FAMILY.render(config, case)
    assert "for k in range(0, HIDDEN, BK):" in source
    path = tmp_path / "kernel.py"
    path.write_text(source.replace("for k in range(0, HIDDEN, BK):",
                                   "for k in range(0, HIDDEN - BK, BK):"))
    result = verify_candidate(FAMILY, path, [case], device=DEVICE, trials=1, timing=False,
                              fail_fast=False, timeout_s=240)
    assert not result.accepted
    assert "numerics" in result.failed(), result.reasons


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy, on inf inside the interpreter
@pytest.mark.parametrize("dtype, kind", [("float16", "large"), ("float16", "mixed"),
                                         ("float32", "mixed")])
@pytest.mark.parametrize("act", ACTS)
def test_stress_inputs_stay_within_the_dot_product_error_bound(dtype, kind, act, tmp_path):
    """On the verifier's stress values for x, every element is within the classic bound of an
    fp32-accumulated dot product, |fl(sum) - sum| <= K u / (1 - K u) * sum |x_k w_k| (u = 2^-24)
    for gate and up, carried through the activation (slope <= 1.13) and the product, plus the
    fp32 epilogue (16 ulps) and the rounding to the output dtype. Where gate or up cancel the
    bound is far above what the verifier allows from the baseline's error at that element; at
    ordinary elements it is tight: an fp16 accumulator, a lost K tail or a wrong row breaks it.
    (fp32 "large" overflows the accumulators in torch as here: nothing finite to bound.)"""
    case = make_case(MAX_BLOCK_M + 1, 96, 176, dtype, act)
    forward = load_rendered(FAMILY, FAMILY.search_space(case)[-1], case, tmp_path)
    # the output's rounding: relative half-ulp, and the half-ulp of its smallest subnormal
    rel, tiny = {"float16": (2.0 ** -11, 2.0 ** -25), "float32": (0.0, 0.0)}[dtype]
    top = torch.finfo(getattr(torch, dtype)).max
    for seed in range(3):
        inputs = FAMILY.make_inputs(case, DEVICE, torch.Generator(DEVICE).manual_seed(seed))
        assert apply_stress(inputs, FAMILY.verify.stress_inputs, kind, seed)
        out = FAMILY.make_out(case, inputs)
        forward(*inputs, out=out, act=act)
        x, wg, wu = (t.double().cpu() for t in inputs)
        gate, up = x @ wg.T, x @ wu.T
        ref = activation(gate, act) * up
        k = case["hidden"] * 2.0 ** -24
        gamma = k / (1 - k)
        d_gate, d_up = gamma * (x.abs() @ wg.abs().T), gamma * (x.abs() @ wu.abs().T)
        before = (1.13 * d_gate * (up.abs() + d_up) + activation(gate, act).abs() * d_up
                  + 2.0 ** -20 * (ref.abs() + 1.13 * gate.abs() * up.abs()))
        bound = before + rel * (ref.abs() + before) + tiny
        got = out.double().cpu()
        finite = ref.abs() + bound < top
        assert finite.float().mean() > 0.01  # something left to check
        assert torch.isfinite(got[finite]).all()
        assert ((got - ref).abs() <= bound)[finite].all()
        overflow = ref.abs() - bound > top * (1 + rel)  # rounds to inf
        assert torch.equal(got[overflow], ref[overflow].sign() * float("inf"))


def test_rendered_source_is_specialised_and_guards_its_inputs(tmp_path):
    case = make_case(16, 96, 176, "float32", "gelu_tanh")
    config = {"BM": 32, "BN": 64, "BK": 32, "num_warps": 4, "num_stages": 3, "GROUP_M": 8}
    source = FAMILY.render(config, case)
    for line in ("HIDDEN = 96", "COLS = 176", "BM = 32", "BN = 64", "BK = 32", "GROUP_M = 8",
                 "NUM_WARPS = 4", "NUM_STAGES = 3", "GELU_TANH = True", "DTYPE = 'float32'",
                 "INPUT_PRECISION = 'ieee'", "def _gated_gemm_kernel",
                 "def forward(x, w_gate, w_up, *, out, **params)"):
        assert line in source
    assert "INPUT_PRECISION = 'tf32'" in FAMILY.render(config, {**case, "dtype": "float16"})
    forward = load_rendered(FAMILY, config, case, tmp_path)
    x, wg, wu = FAMILY.make_inputs(case, DEVICE)
    # x (batch, seq, hidden) and out (batch, seq, cols), as the patched MLP passes them
    out = torch.empty(2, 8, 176, device=DEVICE)
    forward(x.view(2, 8, 96), wg, wu, out=out, act="gelu_tanh")
    assert_close(out, FAMILY.reference(x, wg, wu, act="gelu_tanh").view(2, 8, 176),
                 TOL["float32"])
    bad_calls = [
        ((x, wg, wu), {"out": torch.empty(16, 176, device=DEVICE), "act": "silu"}),
        ((x[:, :95], wg[:, :95], wu[:, :95]), {"out": torch.empty(16, 176, device=DEVICE)}),
        ((x, wg[:175], wu[:175]), {"out": torch.empty(16, 175, device=DEVICE)}),
        ((x, wg, wu), {"out": torch.empty(15, 176, device=DEVICE)}),
        ((x.half(), wg.half(), wu.half()), {"out": torch.empty(16, 176, device=DEVICE).half()}),
    ]
    for args, kwargs in bad_calls:
        with pytest.raises(ValueError):
            forward(*args, **kwargs)


def _profiled_alternatives(model, tmp_path):
    """(op dicts, occurrences of this family's patterns) of one CPU forward of 1 x 8 tokens."""
    from profiling.patterns import BASE_PATTERNS, alternatives, match

    ops = profiled_ops(model, tmp_path)
    patterns = (list(BASE_PATTERNS) + list(GATED_ACT.patterns) + list(MATMUL.patterns)
                + list(FAMILY.patterns))
    found, _ = match(ops, patterns)
    assert not any(o.family == "matmul_epilogue" for o in found)  # never a claimant
    return ops, alternatives(found, patterns)


@pytest.mark.parametrize("model_id, extends, act, linears", [
    ("tiny-llama", "swiglu_mlp", "silu", ["gate_proj", "up_proj"]),
    ("tiny-gemma", "geglu_mlp", "gelu_tanh", ["gate_proj", "up_proj"]),
    ("tiny-phi3", "swiglu_mlp", "silu", ["gate_up_proj"])])
def test_patterns_extend_gated_act_with_the_absorbed_projections(model_id, extends, act, linears,
                                                                 tmp_path):
    model = build(resolve(model_id), torch.float32, "cpu")
    ops, alts = _profiled_alternatives(model, tmp_path)
    assert [(o.pattern, o.family, o.extends) for o in alts] == \
        [("gated_mlp_gemm", "matmul_epilogue", extends)] * 2
    act_op = "aten::gelu" if act == "gelu_tanh" else "aten::silu"
    case = make_case(8, 64, 176, "float32", act)
    for o in alts:
        mine = [ops[i] for i in o.ops]
        names = collections.Counter(op["name"] for op in mine)
        assert names["aten::linear"] == len(linears) and names[act_op] == names["aten::mul"] == 1
        assert sorted(op["module"].rsplit(".", 1)[-1] for op in mine
                      if op["name"] == "aten::linear") == linears  # not down_proj
        # x once, both weights, the product once; the two GEMMs' flops
        assert gated_gemm_cost(mine) == (FAMILY.min_bytes(case), 4 * 8 * 64 * 176)


@pytest.mark.parametrize("model_id, act", [("tiny-llama", "silu"), ("tiny-gemma", "gelu_tanh"),
                                           ("tiny-phi3", "silu")])
def test_patch_runs_the_kernel_and_undo_restores(model_id, act, tmp_path):
    model = build(resolve(model_id), torch.float32, DEVICE)
    ids = torch.randint(3, 500, (2, 8), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    with torch.no_grad():
        before = model(ids).logits
        chooser = CountingChooser(FAMILY, tmp_path)
        undo = FAMILY.patch(model, chooser)
        assert len(instance_forwards(model)) == 2
        patched = model(ids).logits
        model(ids)  # same signature: the kernel runs again, the chooser is not asked again
        undo()
        after = model(ids).logits
    assert chooser.calls == 4 and len(chooser.cases) == 2
    weights = "packed" if model_id == "tiny-phi3" else None  # one gate_up_proj weight
    assert chooser.distinct_cases() == FAMILY.cases_from_model(model, Workload(2, 8)) == \
        [make_case(16, 64, 176, "float32", act, lead=(2, 8), weights=weights)]
    torch.testing.assert_close(patched, before, atol=1e-4, rtol=1e-4)
    assert torch.equal(after, before)
    assert instance_forwards(model) == []


@pytest.mark.parametrize("order", ["gemv_first", "epilogue_first"])
def test_composes_with_gemv_at_a_decode_step(order, tmp_path):
    """Both families patched (in either order) on a decode step: the MLP runs the GEMV with the
    gated epilogue and skips gate_proj's and up_proj's gemv kernels (same product, same
    weights: `SAME_RESULT`), gemv keeps every other projection (down_proj, q/k/v/o, the LM
    head); the logits match the unpatched model's, and undo in any order restores every
    module's own forward. A Linear with any other instance forward still declines the GEMV."""
    from codegen.gemv import FAMILY as GEMV
    from models.patching import set_instance_forward

    model = build(resolve("tiny-llama"), torch.float32, DEVICE).eval()
    ids = torch.randint(3, 500, (3, 1), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    with torch.no_grad():
        before = model(ids).logits
    ours = CountingChooser(FAMILY, tmp_path / "epilogue", pick=0)
    theirs = CountingChooser(GEMV, tmp_path / "gemv")
    (tmp_path / "epilogue").mkdir()
    (tmp_path / "gemv").mkdir()
    pairs = [(GEMV, theirs), (FAMILY, ours)]
    undos = [fam.patch(model, chooser)
             for fam, chooser in (pairs if order == "gemv_first" else pairs[::-1])]
    try:
        with torch.no_grad():
            patched = model(ids).logits
        mlps = [m for m in model.modules() if type(m).__name__.endswith("MLP")]
        assert ours.calls == len(mlps) and all(c.get("lead") == "3x1" for c in ours.cases)
        hidden, inter = mlps[0].gate_proj.in_features, mlps[0].gate_proj.out_features
        widths = {(c["k"], c["n"]) for c in theirs.distinct_cases()}
        assert (hidden, inter) not in widths and (inter, hidden) in widths  # down_proj's
        assert theirs.calls > 0
        assert_close(patched, before, TOL["float32"])
        # a foreign instance forward on up_proj (a LoRA-like adapter): the MLP declines
        mlp = mlps[0]
        calls = ours.calls
        undo_foreign = set_instance_forward(mlp.up_proj, mlp.up_proj.forward)
        with torch.no_grad():
            mlp(torch.randn(3, 1, hidden, device=DEVICE))
        undo_foreign()
        assert ours.calls == calls
    finally:
        for u in undos if order == "gemv_first" else reversed(undos):
            u()
    assert instance_forwards(model) == []


def test_weights_allocated_apart_but_back_to_back_are_not_packed(tmp_path):
    """Two weights of separate storages that happen to sit back to back (the CUDA caching
    allocator did it to 4 of Llama-3.2-1B's 16 MLPs) ask for the case the model's cases list,
    the one verified: read as "packed" they asked for an unverified case and ran HF's MLP."""
    import numpy as np

    model = build(resolve("tiny-llama"), torch.float32, DEVICE)
    for mlp in (layer.mlp for layer in model.model.layers):
        gate, up = mlp.gate_proj.weight, mlp.up_proj.weight
        both = np.concatenate([gate.detach().numpy(), up.detach().numpy()])
        # from_numpy gives each half a storage of its own, at adjacent addresses
        mlp.gate_proj.weight = torch.nn.Parameter(torch.from_numpy(both[:len(gate)]))
        mlp.up_proj.weight = torch.nn.Parameter(torch.from_numpy(both[len(gate):]))
        w_g, w_u = mlp.gate_proj.weight, mlp.up_proj.weight
        assert w_u.data_ptr() == w_g.data_ptr() + w_g.numel() * w_g.element_size()
        assert w_u.untyped_storage().data_ptr() != w_g.untyped_storage().data_ptr()
    ids = torch.randint(3, 500, (2, 8), generator=torch.Generator().manual_seed(0))
    before, patched, chooser = logits_patched(FAMILY, model, ids, tmp_path)
    assert chooser.distinct_cases() == FAMILY.cases_from_model(model, Workload(2, 8)) == \
        [make_case(16, 64, 176, "float32", "silu", lead=(2, 8))]
    assert chooser.calls == 2  # every MLP ran the kernel
    torch.testing.assert_close(patched, before, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("undo_first", ["matmul_epilogue", "gated_act"])
def test_stacks_over_gated_acts_patch(undo_first, tmp_path):
    """gated_act patched first, this family on top: declined, the MLP runs gated_act's kernel
    (on its fused [gate; up] weight); accepted, this kernel runs instead, reading the weights
    that are now views of gated_act's buffer. Undone in either order, the model is as before."""
    model = build(resolve("tiny-llama"), torch.float32, DEVICE)
    ids = torch.randint(3, 500, (2, 8), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    with torch.no_grad():
        before = model(ids).logits
        gated = CountingChooser(GATED_ACT, tmp_path)
        undo_gated = GATED_ACT.patch(model, gated)
        declining = CountingChooser(FAMILY, tmp_path, give=False)
        undo_mine = FAMILY.patch(model, declining)
        declined = model(ids).logits
        assert (gated.calls, declining.calls, len(declining.cases)) == (2, 0, 2)
        undo_mine()
        mine = CountingChooser(FAMILY, tmp_path)
        undo_mine = FAMILY.patch(model, mine)
        stacked = model(ids).logits
        assert (mine.calls, gated.calls) == (2, 2)
        if undo_first == "gated_act":  # buried under this one: passes through, weights split
            undo_gated()
            half = model(ids).logits
            assert (mine.calls, gated.calls) == (4, 2)
            undo_mine()
        else:
            undo_mine()
            half = model(ids).logits
            assert (mine.calls, gated.calls) == (2, 4)
            undo_gated()
        after = model(ids).logits
    for logits in (declined, stacked, half):
        torch.testing.assert_close(logits, before, atol=1e-4, rtol=1e-4)
    assert torch.equal(after, before)
    assert instance_forwards(model) == []


def test_weights_are_read_at_call_time_and_hooks_are_honoured(tmp_path):
    model = build(resolve("tiny-llama"), torch.float32, DEVICE)
    mlp = model.model.layers[0].mlp
    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    chooser = CountingChooser(FAMILY, tmp_path)
    undo = FAMILY.patch(model, chooser)
    with torch.no_grad():
        mlp.up_proj.weight = torch.nn.Parameter(mlp.up_proj.weight * 2)  # after patching
        got = mlp(x)
        assert chooser.calls == 1
        torch.testing.assert_close(got, LlamaMLP.forward(mlp, x), atol=1e-5, rtol=1e-5)
        hooked = []
        handle = mlp.gate_proj.register_forward_hook(lambda *a: hooked.append(1))
        mlp(x)
        handle.remove()
        assert hooked == [1] and chooser.calls == 1  # the projections ran, not the kernel
        mlp(x)
        assert chooser.calls == 2
        # accelerate-style: an instance forward on a projection (offloaded weights come in
        # there), then a projection swapped for another module after patching (PEFT's LoRA)
        up = mlp.up_proj
        seen = []
        linear = type(up).forward
        up.forward = lambda t: (seen.append(1), linear(up, t))[1]
        torch.testing.assert_close(mlp(x), LlamaMLP.forward(mlp, x), atol=1e-5, rtol=1e-5)
        assert seen and chooser.calls == 2
        del up.forward
        mlp.gate_proj = torch.nn.Sequential(mlp.gate_proj)
        torch.testing.assert_close(mlp(x), LlamaMLP.forward(mlp, x), atol=1e-5, rtol=1e-5)
        assert chooser.calls == 2
    undo()


def test_declined_cases_and_autograd_run_the_original_code(tmp_path):
    model, chooser = declines_then_trains(FAMILY, "tiny-phi3",
                                          torch.arange(3, 19).view(2, 8), tmp_path)
    assert chooser.calls == 0
    assert model.model.layers[0].mlp.gate_up_proj.weight.grad is not None


def test_decode_cases_have_one_row_per_sequence():
    model = build(resolve("tiny-llama"), torch.float32, "cpu")
    (case,) = FAMILY.cases_from_model(model, Workload(3, 64, mode="decode", dtype="bfloat16"))
    assert case == make_case(3, 64, 176, "bfloat16", "silu", lead=(3, 1))


def test_lookalike_and_biased_mlps_are_left_alone(tmp_path):
    class ScaledMLP(LlamaMLP):  # right name and children, different computation
        def forward(self, x):
            return 2 * super().forward(x)

    class MLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            small = {"hidden_size": 8, "intermediate_size": 16, "num_attention_heads": 2}
            self.a = ScaledMLP(LlamaConfig(**small))
            self.b = LlamaMLP(LlamaConfig(**small, hidden_act="relu"))
            self.c = LlamaMLP(LlamaConfig(**small, mlp_bias=True))  # the kernel adds no bias
            self.d = LlamaMLP(LlamaConfig(**small))

    holder = MLP()
    undo = FAMILY.patch(holder, CountingChooser(FAMILY, tmp_path))
    assert instance_forwards(holder) == ["d"]
    assert FAMILY.cases_from_model(holder, Workload(1, 4)) == [make_case(4, 8, 16, "float32",
                                                                         "silu", lead=(1, 4))]
    undo()
    assert instance_forwards(holder) == []


def test_cost_model_counts_the_gemms_and_the_unwritten_intermediates():
    case = make_case(8192, 2048, 8192, "bfloat16", "silu")
    assert FAMILY.min_bytes(case) == 2 * (8192 * 2048 + 2 * 8192 * 2048 + 8192 * 8192)
    assert FAMILY.flops(case) == 4 * 8192 * 2048 * 8192 + GATED_ACT.flops(
        {**case, "layout": "separate"})

"""GEMV family: rendered candidates (cuBLAS; GEMV split and unsplit, k no BLOCK_K divides,
strided 3-D and 2-D x, with and without bias) == F.linear at one and three rows; the verifier
accepts a GEMV and a cuBLAS one; the
patch on tiny-llama's decode step gives the unpatched logits through the kernel on the
unpadded Linears only (the LM head included, still tied), falls back on a prefill and past
MAX_ROWS, and undo restores; the ranking splits a projection call between `gemv` and matmul's
`linear` by the same test. CPU runs the kernel under the interpreter (fp32, fp16); bf16 and a
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
    verify_on_cpu_or_gpu,
)
from transformers import DynamicCache

from codegen.gemv import FAMILY, MAX_ROWS
from codegen.gemv.kernel import CUBLAS
from codegen.gemv.reference import make_case
from codegen.matmul import PATTERNS as MATMUL_PATTERNS
from codegen.matmul.reference import gemv_call
from core.workload import Workload
from models.graphs import cache_argument
from profiling.loader import build, resolve
from profiling.patterns import match

TOL = {"float32": (1e-5, 1e-5), "float16": (1e-3, 2e-3), "bfloat16": (1e-2, 1.6e-2)}
# k=300: no BLOCK_K divides it (the masked steps, a split whose chunk passes k); n=40: no
# BLOCK_N of 16 or 32 divides it. The second: 3 rows of one sequence, x a column slice of wider
# rows (3-D, row stride k + 64), k=512 split evenly (the unmasked loads).
CASES = [make_case(1, 300, 40, "float32", True, (1, 1)),
         {**make_case(3, 512, 64, "float32", False, (1, 3)), "row_stride": 576}]


def _ends_and_a_split(case):
    """cuBLAS (first), the first and last GEMV configs, the first split one with the sum
    kernel and the first FUSED one."""
    space = FAMILY.search_space(case)
    assert space[0] == CUBLAS and CUBLAS not in space[1:]
    fused = next(c for c in space[1:] if c.get("FUSED"))
    # a space of DOT configs keeps fewer of the others: the sum kernel's split of a tile if so
    split = next((c for c in space[1:] if c["SPLIT_K"] > 1 and not c.get("FUSED")),
                 {k: v for k, v in fused.items() if k not in ("FUSED", "DOT")})
    configs = {repr(c): c for c in (space[0], space[1], space[-1], split, fused)}
    assert {c["SPLIT_K"] > 1 for c in list(configs.values())[1:]} == {True, False}
    return list(configs.values())


@pytest.mark.parametrize("dtype", ["float32", "float16",
                                   pytest.param("bfloat16", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("base", CASES, ids=["1row-bias", "3rows-strided"])
def test_rendered_candidates_equal_f_linear(base, dtype, tmp_path):
    case = {**base, "dtype": dtype}
    for config in _ends_and_a_split(case):
        out, ref = run_candidate(FAMILY, config, case, tmp_path)
        assert out.shape == (*[int(d) for d in case["lead"].split("x")], case["n"])
        x, w, *b = FAMILY.make_inputs(case, DEVICE, torch.Generator(DEVICE).manual_seed(0))
        assert x.dim() == 3 and x.is_contiguous() == ("row_stride" not in case)
        assert_close(ref, F.linear(x, w, *b), (0, 0))  # the reference is F.linear itself
        assert_close(out, ref, TOL[dtype])


def test_the_search_space_is_small_and_ends_with_the_interpreters_cheapest():
    space = FAMILY.search_space(make_case(1, 2048, 512, "bfloat16", False, (1, 1)))
    assert 2 < len(space) <= 24 and space[0] == CUBLAS
    assert all(c["SPLIT_K"] * c["BLOCK_K"] <= 2048 for c in space[1:])
    assert space[-1] == {"BLOCK_N": 32, "BLOCK_K": 512, "SPLIT_K": 1, "num_warps": 4,
                         "num_stages": 3}
    # k/v at one row: 512 outputs fill an H200 only when split (the probe's cold winner), the
    # sum folded into the split kernel first (k is four times n), then with the sum kernel
    assert space[1] == {**space[-1], "BLOCK_N": 4, "SPLIT_K": 4, "FUSED": True}
    assert space[2] == {**space[-1], "BLOCK_N": 4, "SPLIT_K": 4}
    # a k under every BLOCK_K still gets a config (one masked step)
    assert FAMILY.search_space(make_case(1, 64, 64, "float32", False))[-1]["BLOCK_K"] == 128


def test_the_verifier_accepts_the_cublas_candidate(tmp_path):
    """Its torch.mm / addmm are the family's declared library calls (`library_ops`)."""
    verify_on_cpu_or_gpu(FAMILY, make_case(2, 136, 32, "float32", True, (2, 1)), tmp_path,
                         CUBLAS)


def test_candidate_refuses_other_shapes_and_too_many_rows(tmp_path):
    case = make_case(2, 200, 64, "float32", True, (2, 1))
    forward = load_rendered(FAMILY, FAMILY.search_space(case)[-1], case, tmp_path)
    x, w, b = FAMILY.make_inputs(case)
    with pytest.raises(ValueError):
        forward(x, w, out=FAMILY.make_out(case, (x,)))  # its bias, missing
    with pytest.raises(ValueError):
        forward(x, w[:16], b, out=FAMILY.make_out(case, (x,)))
    big = torch.zeros(MAX_ROWS + 1, 1, 200)
    with pytest.raises(ValueError, match="rows"):
        forward(big, w, b, out=torch.empty(MAX_ROWS + 1, 1, 64))
    cublas = load_rendered(FAMILY, CUBLAS, case, tmp_path)
    with pytest.raises(ValueError, match="rows"):
        cublas(big, w, b, out=torch.empty(MAX_ROWS + 1, 1, 64))


# ------------------------------------------------------------------ the patch on tiny-llama

@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return build(resolve("tiny-llama"), torch.float32, DEVICE)


def _decode_step(model, ids):
    cache = DynamicCache()
    with torch.no_grad():
        kw = {cache_argument(model): cache}
        prefill = model(ids, use_cache=True, **kw).logits
        return prefill, model(ids[:, -1:], use_cache=True, **kw).logits


def test_patched_decode_step_runs_the_kernel_on_unpadded_linears_only(tiny, tmp_path):
    """tiny-llama (hidden 64, intermediate 176, kv width 32, vocab 512, tied head): q, o and
    down (64 wide) and the LM head reach the kernel at the decode step; k, v (32 wide) and
    gate, up (176 wide) are the matmul family's padded widths and stay unwrapped; the prefill
    (5 tokens per sequence) runs the modules' own code."""
    ids = torch.randint(3, 500, (2, 5), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    want_prefill, want = _decode_step(tiny, ids)
    embed = tiny.model.embed_tokens.weight
    chooser = CountingChooser(FAMILY, tmp_path)
    undo = FAMILY.patch(tiny, chooser)
    try:
        attn, mlp = tiny.model.layers[0].self_attn, tiny.model.layers[0].mlp
        assert "forward" in attn.q_proj.__dict__ and "forward" in tiny.lm_head.__dict__
        assert not {"forward"} & (attn.k_proj.__dict__.keys() | mlp.up_proj.__dict__.keys())
        got_prefill, got = _decode_step(tiny, ids)
        assert tiny.lm_head.weight is embed  # tied: no copy, no new Parameter
    finally:
        undo()
    layers = tiny.config.num_hidden_layers
    assert chooser.calls == 3 * layers + 1  # the step only: q, o, down per layer, the head
    assert torch.equal(got_prefill, want_prefill)
    assert_close(got, want, (1e-5, 1e-5))
    assert chooser.distinct_cases() == FAMILY.cases_from_model(
        tiny, Workload(2, 5, "float32", DEVICE, "decode"))
    assert instance_forwards(tiny) == [] and tiny.lm_head.weight is embed
    assert torch.equal(_decode_step(tiny, ids)[1], want)


def test_calls_past_max_rows_or_of_several_tokens_keep_the_modules_code(tiny, tmp_path):
    q = tiny.model.layers[0].self_attn.q_proj
    chooser = CountingChooser(FAMILY, tmp_path)
    undo = FAMILY.patch(tiny, chooser)
    try:
        with torch.no_grad():
            for shape in ((MAX_ROWS + 1, 1, 64), (MAX_ROWS + 1, 64), (1, 3, 64)):
                x = torch.randn(shape, device=DEVICE)
                assert torch.equal(q(x), F.linear(x, q.weight))
            assert chooser.calls == 0
            x = torch.randn(3, 1, 64, device=DEVICE)
            assert_close(q(x), F.linear(x, q.weight), (1e-5, 1e-5))
            assert chooser.calls == 1
    finally:
        undo()


def test_cases_from_model_are_the_decode_steps(tiny):
    cases = FAMILY.cases_from_model(tiny, Workload(2, 8, "float32", DEVICE, "decode"))
    assert cases == [make_case(2, 64, 64, "float32", False, (2, 1)),
                     make_case(2, 176, 64, "float32", False, (2, 1)),
                     make_case(2, 64, 512, "float32", False, (2, 1))]
    assert FAMILY.cases_from_model(tiny, Workload(2, 8, "float32", DEVICE)) == []
    assert FAMILY.cases_from_model(tiny, Workload(MAX_ROWS + 1, 8, "float32", DEVICE,
                                                  "decode")) == []


def _linear_op(x_shape, n):
    return {"name": "aten::linear", "shapes": [list(x_shape), [n, x_shape[-1]], []],
            "module": "model.q_proj", "module_class": "Linear", "module_calls": [1],
            "functions": []}


@pytest.mark.parametrize("x_shape, n, gemv", [
    ((1, 1, 2048), 512, True), ((16, 1, 2048), 2048, True), ((17, 1, 2048), 2048, False),
    ((1, 8, 2048), 2048, False), ((1, 1, 768), 50257, False)])
def test_a_projection_call_is_claimed_by_exactly_one_of_gemv_and_matmul(x_shape, n, gemv):
    """A decode step's call at an unpadded width is `gemv`; more rows, several tokens per
    sequence, or a width the matmul family pads stay its `linear`, whichever pattern goes
    first."""
    ops = [_linear_op(x_shape, n)]
    assert gemv_call(ops) == gemv
    for patterns in (FAMILY.patterns + MATMUL_PATTERNS, MATMUL_PATTERNS + FAMILY.patterns):
        found, unclaimed = match(ops, list(patterns))
        assert unclaimed == [] and [(o.pattern, o.family) for o in found] == \
            [("gemv", "gemv") if gemv else ("linear", "matmul")]


@pytest.mark.gpu
def test_gpu_every_config_is_right_in_bf16_at_llamas_kv_shape_and_captures():
    """Llama-3.2-1B's k/v projection (2048 -> 512, bf16): every config of the search space at
    one row, and the ends and a split at eight, within bf16 error of the float64 product; a
    split config captured in a CUDA graph replays the eager result on new x (the workspace
    comes from the graph's pool). Times nothing: codegen/gemv/bench.py does."""
    import tempfile
    from pathlib import Path

    tmp = Path(tempfile.mkdtemp())
    for rows in (1, 8):
        case = make_case(rows, 2048, 512, "bfloat16", False, (rows, 1))
        x, w = FAMILY.make_inputs(case, "cuda", torch.Generator("cuda").manual_seed(rows))
        exact = F.linear(x.double(), w.double())
        space = FAMILY.search_space(case)
        for config in space if rows == 1 else _ends_and_a_split(case):
            forward = load_rendered(FAMILY, config, case, tmp)
            out = FAMILY.make_out(case, (x,)).fill_(float("nan"))
            forward(x, w, out=out, **FAMILY.params(case))
            torch.cuda.synchronize()
            err = (out.double() - exact).abs().max().item()
            assert err <= 1e-2 + 1.6e-2 * exact.abs().max().item(), (rows, config, err)
    case = make_case(1, 2048, 512, "bfloat16", False, (1, 1))
    split = next(c for c in FAMILY.search_space(case)[1:] if c["SPLIT_K"] > 1)
    forward = load_rendered(FAMILY, split, case, tmp)
    x, w = FAMILY.make_inputs(case, "cuda", torch.Generator("cuda").manual_seed(9))
    out = FAMILY.make_out(case, (x,))
    forward(x, w, out=out, **FAMILY.params(case))  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward(x, w, out=out, **FAMILY.params(case))
    x.copy_(torch.randn_like(x))
    graph.replay()
    want = FAMILY.make_out(case, (x,))
    forward(x, w, out=want, **FAMILY.params(case))
    torch.cuda.synchronize()
    assert torch.equal(out, want)


def test_the_decode_gemv_table_counts_bytes_and_reads_against_the_copy_bandwidth():
    from codegen.gemv.bench import (
        COLD_BYTES,
        MAX_COPIES,
        config_words,
        copies_for,
        gemv_bytes,
        markdown,
    )

    # Llama-3.2-1B's k/v projection at one row, bf16: the weight, x and the output
    assert gemv_bytes(1, 2048, 512, False, 2) == (2048 * 512 + 2048 + 512) * 2
    assert gemv_bytes(8, 896, 128, True, 2, weights=2) == (2 * 896 * 128 + 8 * 896 + 8 * 128
                                                           + 128) * 2
    # cold weights: enough copies to pass COLD_BYTES (Qwen's 224 KiB k/v included)
    assert copies_for(2 << 20) * (2 << 20) >= COLD_BYTES
    assert copies_for(896 * 128 * 2) * 896 * 128 * 2 >= COLD_BYTES
    assert copies_for(1 << 10) == MAX_COPIES
    assert copies_for(1 << 30) == 1
    line = {"model": "llama-3.2-1b", "shape": "k/v", "rows": 1, "k": 2048, "n": 512,
            "bytes": 2_100_000, "cublas_us": 1.5, "cublas_GBps": 1400.0, "best_us": 1.0,
            "best_GBps": 2100.0, "speedup": 1.5}
    md = markdown([line, {**line, "shape": "down", "best_GBps": None}], 3000.0, "H100")
    assert "Copy bandwidth (`pipeline calibrate`): 3000 GB/s" in md
    assert "| llama-3.2-1b | k/v | 1 | 2048 | 512 | 2.1 | 1.5 | 1400.0 | 1.0 | 2100.0 | 70% |" in md
    assert "| down |" in md and md.count("\n|") == 4 and md.count("| - |\n") == 2
    best = {**line, "best_config": {"BLOCK_N": 16, "BLOCK_K": 512, "SPLIT_K": 4, "FUSED": True}}
    assert "| 1.5 | 16x512 split 4 fused |" in markdown([best], 3000.0, "H100")
    two = {"BLOCK_N": 8, "BLOCK_K": 512, "SPLIT_K": 2}
    assert config_words(two) == "8x512 split 2 + sum kernel"
    assert config_words(CUBLAS) == "cuBLAS"
    assert config_words({"GEMV": True, "BLOCK_N": 8, "BLOCK_K": 512}) == "8x512"
    assert config_words({**two, "FUSED": True, "DOT": True}) == "8x512 split 2 fused dot"


@pytest.mark.parametrize("bias", [False, True])
def test_every_config_accumulates_into_out_in_its_epilogue(bias, tmp_path):
    """`accumulate=True`: out += x @ W^T with the sum rounded once, cuBLAS's config (addmm_),
    the split configs (in the sum kernel) and the direct ones alike; a biased projection
    refuses it (the residual add it serves has none)."""
    case = make_case(3, 300, 40, "float32", bias, (3, 1))
    space = FAMILY.search_space(case)
    assert any(c.get("SPLIT_K", 1) > 1 for c in space) and space[0] == CUBLAS
    inputs = FAMILY.make_inputs(case, DEVICE, torch.Generator(DEVICE).manual_seed(3))
    total = torch.randn(3, 1, 40, device=DEVICE)
    for config in space:
        forward = load_rendered(FAMILY, config, case, tmp_path)
        out = total.clone()
        if bias:
            with pytest.raises(ValueError, match="without a bias"):
                forward(*inputs, out=out, accumulate=True, **FAMILY.params(case))
            continue
        forward(*inputs, out=out, accumulate=True, **FAMILY.params(case))
        assert_close(out, total + F.linear(*inputs), (1e-5, 1e-5))


# ------------------------------------------------------------------ FUSED split-K

SPLIT4 = {"BLOCK_N": 16, "BLOCK_K": 128, "SPLIT_K": 4, "num_warps": 4, "num_stages": 3}
FUSED4 = {**SPLIT4, "FUSED": True}  # the split sum in the last split program of each block


def _counters(forward, device) -> torch.Tensor:
    """The FUSED candidate's arrival counters (codegen.launch's, keyed by the inputs' device
    and the candidate's column blocks)."""
    from codegen.launch import ARRIVALS

    return ARRIVALS[(device, forward.__globals__["N_BLOCKS"])]


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("base", CASES, ids=["1row-bias", "3rows-strided"])
def test_fused_split_equals_the_sum_kernels_bit_for_bit_and_leaves_its_counters_at_zero(
        base, dtype, tmp_path):
    """FUSED (4 splits of 128: at k=300 the last split is empty and the third masked; n=40 is
    no multiple of BLOCK_N 16) at one row with a bias and at three strided rows with and
    without `accumulate`, called twice in a row on new inputs: one kernel launched (the sum
    kernel is never called), the two-kernel split's output bit for bit (one summation helper,
    split order), the reference's within tolerance, and each call leaves the same counter
    buffer at zero for the next. The interpreter runs a launch's programs one after another,
    so the last split of each column block is the one that sums."""
    case = {**base, "dtype": dtype}
    fused = load_rendered(FAMILY, FUSED4, case, tmp_path)
    two = load_rendered(FAMILY, SPLIT4, case, tmp_path)
    fused.__globals__["_split_sum_kernel"] = None  # launching it would raise
    params, counts = FAMILY.params(case), None
    for accumulate in (False,) if case["bias"] else (False, True):
        for seed in (1, 2):
            inputs = FAMILY.make_inputs(case, DEVICE, torch.Generator(DEVICE).manual_seed(seed))
            start = FAMILY.make_out(case, inputs).normal_()
            got, want = start.clone(), start.clone()
            fused(*inputs, out=got, accumulate=accumulate, **params)
            two(*inputs, out=want, accumulate=accumulate, **params)
            assert torch.equal(got, want), (accumulate, seed)
            ref = FAMILY.reference(*inputs, **params)
            assert_close(got, ref + start if accumulate else ref, TOL[dtype])
            now = _counters(fused, inputs[0].device)
            assert now.dtype == torch.int32 and now.shape == (3 if case["n"] == 40 else 4,)
            assert (now == 0).all() and (counts is None or now is counts)
            counts = now


def test_the_verifier_accepts_a_fused_split_candidate(tmp_path):
    """FUSED, whose counters carry from call to call through the verifier's repeated,
    edge-case and memoisation calls (the family's example case; two splits of 128, the
    second mostly masked)."""
    verify_on_cpu_or_gpu(FAMILY, FAMILY.examples[0], tmp_path, {**FUSED4, "SPLIT_K": 2})


def test_the_search_space_leads_with_a_fused_split_where_k_is_several_times_n():
    """Down projections (Llama-3.2-1B, Llama-3.1-8B, Qwen2.5-0.5B) and Llama's k/v: the guess
    after cuBLAS (Family.leads) is FUSED at the widest BLOCK_K, 16 x 512 tiles where the grid
    allows (Llama-3.2-1B's down: 128 column blocks x 4 splits, 512 programs); q/o, gate/up and
    the LM head keep the unfused guess first. Every FUSED config splits k; the others carry
    no FUSED key (their folder names and remembered searches stay what they were); the space
    holds at most MAX_CONFIGS and ends with the interpreter's cheapest."""
    from codegen.gemv.kernel import MAX_CONFIGS

    def space(k, n):
        return FAMILY.search_space(make_case(1, k, n, "bfloat16", False, (1, 1)))

    tile = {"BLOCK_K": 512, "num_warps": 4, "num_stages": 3, "FUSED": True}
    assert space(8192, 2048)[1] == {**tile, "BLOCK_N": 16, "SPLIT_K": 4}
    assert space(14336, 4096)[1] == {**tile, "BLOCK_N": 16, "SPLIT_K": 2}
    for k, n in ((4864, 896), (2048, 512), (4096, 1024)):
        guess = space(k, n)[1]
        assert guess["FUSED"] and guess["BLOCK_K"] == 512 and guess["SPLIT_K"] > 1, (k, n)
    for k, n in ((2048, 2048), (2048, 8192), (4096, 4096), (2048, 128256)):
        assert "FUSED" not in space(k, n)[1] and space(k, n)[2]["FUSED"], (k, n)
    for k, n in ((8192, 2048), (896, 128), (2048, 2048), (300, 40)):
        configs = space(k, n)
        assert 2 < len(configs) <= MAX_CONFIGS and configs[0] == CUBLAS
        assert all(c["SPLIT_K"] > 1 for c in configs if c.get("FUSED") is True)
        assert all(c.get("FUSED", True) is True for c in configs[1:])  # True or absent
        assert configs[-1]["SPLIT_K"] == 1 and "FUSED" not in configs[-1]
    assert space(8192, 2048)[-1] == {"BLOCK_N": 32, "BLOCK_K": 512, "SPLIT_K": 1,
                                     "num_warps": 4, "num_stages": 3}


def test_the_fused_source_says_so_and_orders_its_arrival(tmp_path):
    case = make_case(1, 8192, 2048, "float16", False, (1, 1))
    two, fused = FAMILY.render(SPLIT4, case), FAMILY.render(FUSED4, case)
    assert "FUSED = False" in two and "then a sum kernel" in two
    assert "FUSED = True" in fused and "Launch: one kernel, 4 K splits" in fused
    assert 'sem="acq_rel", scope="gpu"' in fused and 'cache_modifier=".cg"' in fused


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 4])
def test_gpu_fused_split_replays_in_a_cuda_graph(rows):
    """Llama-3.2-1B's down projection (8192 -> 2048, bf16) with the residual add folded in
    (`accumulate`), the family's FUSED guess captured once and replayed five times on new x:
    each replay equals the two-kernel split of the same tile run eagerly, bit for bit, and
    leaves the counters at zero (the graph holds no memset: the last program resets them)."""
    import tempfile
    from pathlib import Path

    tmp = Path(tempfile.mkdtemp())
    case = make_case(rows, 8192, 2048, "bfloat16", False, (rows, 1))
    fused_config = FAMILY.search_space(case)[1]
    assert fused_config.get("FUSED")
    fused = load_rendered(FAMILY, fused_config, case, tmp)
    two = load_rendered(FAMILY, {k: v for k, v in fused_config.items() if k != "FUSED"}, case,
                        tmp)
    gen = torch.Generator("cuda").manual_seed(rows)
    x, w = FAMILY.make_inputs(case, "cuda", gen)
    start = FAMILY.make_out(case, (x,)).normal_(generator=gen)
    out = start.clone()
    fused(x, w, out=out, accumulate=True, **FAMILY.params(case))  # compile, counters, before
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(start)
        fused(x, w, out=out, accumulate=True, **FAMILY.params(case))
    for _ in range(5):
        x.copy_(torch.randn(x.shape, generator=gen, device="cuda", dtype=x.dtype))
        graph.replay()
        want = start.clone()
        two(x, w, out=want, accumulate=True, **FAMILY.params(case))
        torch.cuda.synchronize()
        assert torch.equal(out, want)
        assert (_counters(fused, x.device) == 0).all()
    exact = start.double() + F.linear(x.double(), w.double())
    assert (out.double() - exact).abs().max().item() <= 1e-2 + 1.6e-2 * exact.abs().max().item()


# ------------------------------------------------------------------ DOT (tensor-core rows)

DOT1 = {"BLOCK_N": 16, "BLOCK_K": 128, "SPLIT_K": 1, "num_warps": 4, "num_stages": 3,
        "DOT": True}
DOT_CONFIGS = [DOT1, {**DOT1, "BLOCK_N": 32, "SPLIT_K": 2},  # split, then the sum kernel
               {**DOT1, "SPLIT_K": 4, "FUSED": True}]


@pytest.mark.parametrize("rows, dtype", [(2, "float32"), (3, "float16"), (8, "float32"),
                                         (8, "float16"), (16, "float16")])
def test_dot_configs_equal_the_reference_with_bias_and_accumulating(rows, dtype, tmp_path):
    """DOT unsplit, split with the sum kernel and FUSED split (two of them at each row
    count: each in both dtypes), at k=300 (no BLOCK_K divides
    it: masked steps, a split past k) and n=40 (no BLOCK_N divides it): with a bias, and
    without one accumulating into out (the residual add), within the family's tolerances. x
    is (rows, 1, k) at even rows, one sequence of rows tokens, a column slice of wider rows,
    at odd ones (the (batch, seq) strides of the padded rows' loads)."""
    lead = (rows, 1) if rows % 2 == 0 else (1, rows)
    # two configs per run (the interpreter's time), in turn
    for config in (DOT_CONFIGS * 2)[{2: 0, 3: 1, 8: 2, 16: 0}[rows] + (dtype == "float16"):][:2]:
        for bias in (True, False):
            case = make_case(rows, 300, 40, dtype, bias, lead)
            if rows % 2:
                case["row_stride"] = 364
            forward = load_rendered(FAMILY, config, case, tmp_path)
            inputs = FAMILY.make_inputs(case, DEVICE, torch.Generator(DEVICE).manual_seed(rows))
            start = FAMILY.make_out(case, inputs).normal_()
            out = start.clone()
            forward(*inputs, out=out, accumulate=not bias, **FAMILY.params(case))
            ref = FAMILY.reference(*inputs, **FAMILY.params(case))
            assert_close(out, ref if bias else start + ref, TOL[dtype])


def test_the_verifier_accepts_a_dot_candidate(tmp_path):
    """DOT on the family's example case (2 rows, k=136, n=32, fp32, a bias) through the
    verifier's edge cases (1, 3, 5, 7 and 16 rows, strided x) and stress values: the fp32 dot
    is IEEE, within the fp32 order bound. (One program: the interpreter's time.)"""
    verify_on_cpu_or_gpu(FAMILY, FAMILY.examples[0], tmp_path, {**DOT1, "BLOCK_N": 32})


def test_dot_configs_lead_the_search_space_from_four_rows():
    """Llama-3.2-1B's and Llama-3.1-8B's projections: no DOT at one row (the space as it was);
    from two rows DOT configs (BLOCK_N 16 at least, unsplit or FUSED, staged tiles in
    DOT_SMEM), the family's guess (the second entry: Family.leads) a DOT one from four rows
    and the row loop's below; cuBLAS first, the interpreter's cheapest last, at most
    MAX_CONFIGS; the other configs carry no DOT key (their remembered searches stand)."""
    from codegen.gemv.kernel import DOT_SMEM, MAX_CONFIGS, NUM_STAGES, block_ks

    shapes = ((2048, 2048), (2048, 512), (2048, 8192), (8192, 2048), (2048, 128256),
              (4096, 14336), (896, 128), (300, 40))
    for rows in (1, 2, 3, 4, 8, 16):
        for k, n in shapes:
            for dtype in ("bfloat16", "float32"):
                space = FAMILY.search_space(make_case(rows, k, n, dtype, False, (rows, 1)))
                dots = [c for c in space if c.get("DOT")]
                assert 2 < len(space) <= MAX_CONFIGS and space[0] == CUBLAS
                assert space[-1] == {"BLOCK_N": 32, "BLOCK_K": block_ks(k)[-1],
                                     "SPLIT_K": 1, "num_warps": 4, "num_stages": 3}
                assert len({repr(c) for c in space}) == len(space)
                assert all(c.get("DOT", True) is True for c in space[1:])  # True or absent
                assert bool(dots) is (rows >= 2), (rows, k, n)
                assert bool(space[1].get("DOT")) is (rows >= 4), (rows, k, n)
                item = 4 if dtype == "float32" else 2
                for c in dots:
                    assert c["BLOCK_N"] >= 16 and (c["SPLIT_K"] == 1) is not c.get("FUSED")
                    assert NUM_STAGES * (c["BLOCK_N"] + 16) * c["BLOCK_K"] * item <= DOT_SMEM
                if rows >= 2:  # a short list still spans the widths
                    assert {c["BLOCK_N"] for c in dots} == {16, 32, 64}, (k, n, dtype)
    # Llama-3.2-1B's gate/up at 8 rows: 256 programs of 32 columns, each over all of k
    guess = FAMILY.search_space(make_case(8, 2048, 8192, "bfloat16", False, (8, 1)))[1]
    assert guess == {"BLOCK_N": 32, "BLOCK_K": 512, "SPLIT_K": 1, "num_warps": 4,
                     "num_stages": 3, "DOT": True}


def test_the_dot_source_says_so_and_pads_the_rows(tmp_path):
    case = make_case(8, 2048, 2048, "float16", False, (8, 1))
    dot, rows = FAMILY.render(DOT1, case), FAMILY.render({**DOT1, "DOT": False}, case)
    words = "Each step one tensor-core dot of the weight tile by x's rows padded to 16"
    assert "DOT = True" in dot and "MIN_BLOCK_M = 16" in dot and words in dot
    assert "DOT = False" in rows and "MIN_BLOCK_M = 1" in rows and words not in rows
    assert "tl.dot(w, tl.trans(x), acc" in dot


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [2, 8, 16])
def test_gpu_dot_configs_are_right_in_bf16_at_llamas_shapes(rows):
    """Every DOT config the spaces offer (tensor cores, staged tiles in shared memory) at
    Llama-3.2-1B's q/o, down and LM-head shapes and its gated gate+up GEMV, bf16: within bf16
    error of the float64 product. Times nothing: codegen/gemv/bench.py does."""
    import tempfile
    from pathlib import Path

    from codegen.matmul_epilogue import FAMILY as GATED
    from codegen.matmul_epilogue.reference import make_case as gated_case

    tmp = Path(tempfile.mkdtemp())
    gen = torch.Generator("cuda").manual_seed(rows)
    for k, n in ((2048, 2048), (8192, 2048), (2048, 128256)):
        case = make_case(rows, k, n, "bfloat16", False, (rows, 1))
        x, w = FAMILY.make_inputs(case, "cuda", gen)
        exact = F.linear(x.double(), w.double())
        for config in [c for c in FAMILY.search_space(case) if c.get("DOT")]:
            out = FAMILY.make_out(case, (x,)).fill_(float("nan"))
            load_rendered(FAMILY, config, case, tmp)(x, w, out=out, **FAMILY.params(case))
            torch.cuda.synchronize()
            err = (out.double() - exact).abs().max().item()
            assert err <= 1e-2 + 1.6e-2 * exact.abs().max().item(), (k, n, config, err)
    case = gated_case(rows, 2048, 8192, "bfloat16", "silu")
    inputs = GATED.make_inputs(case, "cuda", gen)
    want = GATED.reference(*inputs, **GATED.params(case))
    for config in [c for c in GATED.search_space(case) if c.get("DOT")]:
        out = GATED.make_out(case, inputs).fill_(float("nan"))
        load_rendered(GATED, config, case, tmp)(*inputs, out=out, **GATED.params(case))
        torch.cuda.synchronize()
        assert_close(out, want, (1e-3, 2.5e-2))

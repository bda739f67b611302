"""DOT (gemv's tensor-core step for several rows: the weight tile is the dot's M side, the rows
padded with zeros to 16 its N side) in the grouped q/k/v projection and the norm-fused decode
kernels (qkv_proj, norm_qkv, norm_gate_up): each family's DOT configs equal its reference
within its tolerance at 2 to 16 rows (qkv_proj) and 2 to MAX_ROWS (the norm fusions: 4), on the
bias / no-bias, GQA, strided-x and norm-form cases the families' own tests use, with the
verifier accepting one; DOT configs are absent at one row, follow the row loop's guess at 2-3
rows and lead from 4, and leave the row loop's configs as they were; the source says DOT. CPU
runs the kernels under the interpreter (fp32, fp16); bf16 at Llama-3.2-1B's shapes runs on a
GPU. The PTX facts (weight loads and the L2 prefetch before PDL's wait) are test_pdl.py's.

Tolerances are each family's (test_qkv_proj.py's, test_norm_qkv.py's, test_norm_gate_up.py's
TOL): the dot multiplies the same values as the row loop (the weight and x, or the normed
rows, in the dtype; 16-bit products are exact in fp32, the fp32 dot is IEEE, not TF32) and
sums them in fp32 in another order, which those tolerances already allow for; the norm
prologue (rstd, the normed slices, HF's roundings) stays fp32 as in the row loop.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from family_checks import assert_close, load_rendered, run_candidate, verify_on_cpu_or_gpu

from codegen.gemv.kernel import DOT_BLOCK_NS, DOT_SMEM, NUM_STAGES
from codegen.norm_gate_up import FAMILY as NORM_GATE_UP
from codegen.norm_gate_up.reference import make_case as gate_up_case
from codegen.norm_qkv import FAMILY as NORM_QKV
from codegen.norm_qkv.reference import make_case as norm_qkv_case
from codegen.qkv_proj import FAMILY as QKV
from codegen.qkv_proj.reference import make_case as qkv_case

FAMILIES = {"qkv_proj": QKV, "norm_qkv": NORM_QKV, "norm_gate_up": NORM_GATE_UP}
# the families' own tests' tolerances (norm_gate_up's fp16 is wider: the activation's product)
TOL = {"float32": (1e-5, 1e-5), "float16": (1e-3, 2e-3)}
GATE_UP_TOL = {"float32": (1e-5, 1e-5), "float16": (2e-3, 4e-3)}


def _dots(space: list[dict]) -> list[dict]:
    return [c for c in space if c.get("DOT")]


def _each_case_a_dot_config(family, cases, turn: int, tol, tmp_path) -> int:
    """Every case through one of its space's DOT configs (the `turn`-th onwards, in turn, so
    the parametrizations between them run each); returns how many ran."""
    ran = 0
    for i, case in enumerate(cases):
        dots = _dots(family.search_space(case))
        assert dots, case
        out, ref = run_candidate(family, dots[(turn + i) % len(dots)], case, tmp_path)
        assert [o.shape for o in out] == [r.shape for r in ref]
        assert_close(out, ref, tol)
        ran += 1
    return ran


@pytest.mark.parametrize("rows, dtype", [(2, "float32"), (3, "float16"), (8, "float32"),
                                         (16, "float16")])
def test_qkv_proj_dot_configs_equal_three_linears(rows, dtype, tmp_path):
    """k=300 (no BLOCK_K divides it: masked steps), GQA (nq 128 over nk = nv 64) with biases
    (Qwen2); k=512 with nq = nk = nv and no bias, x a column slice of wider rows at odd row
    counts (the padded rows' (batch, seq) strides)."""
    cases = [qkv_case(rows, 300, 128, 64, 64, dtype, True, (rows, 1)),
             qkv_case(rows, 512, 64, 64, 64, dtype, False, (rows, 1))]
    if rows % 2:
        cases[1]["row_stride"] = 576
    assert _each_case_a_dot_config(QKV, cases, rows, TOL[dtype], tmp_path) == 2


@pytest.mark.parametrize("rows, dtype", [(2, "float32"), (3, "float16"), (4, "float32")])
def test_norm_qkv_dot_configs_equal_the_norm_and_three_linears(rows, dtype, tmp_path):
    """test_norm_qkv.py's cases at 2 to MAX_ROWS rows: k=300 with GQA ratio 4, biases and
    Llama's form; k=96 (not a power of two) with ratio 7, Gemma's form, x a column slice of
    wider rows; k=64 with ratio 1. The normed output (program 0's stores of the padded tile)
    as well as q, k and v."""
    cases = [norm_qkv_case(rows, 300, 64, 16, 16, dtype, True, (rows, 1)),
             {**norm_qkv_case(rows, 96, 112, 16, 16, dtype, False, (rows, 1), form="gemma"),
              "row_stride": 160},
             norm_qkv_case(rows, 64, 64, 64, 64, dtype, False, (rows, 1), eps=1e-5)]
    assert _each_case_a_dot_config(NORM_QKV, cases, rows, TOL[dtype], tmp_path) == 3


@pytest.mark.parametrize("rows, dtype", [(2, "float32"), (3, "float16"), (4, "float32")])
def test_norm_gate_up_dot_configs_equal_the_add_norm_and_gated_mlp(rows, dtype, tmp_path):
    """test_norm_gate_up.py's cases at 2 to MAX_ROWS rows: hidden 300 with SiLU and the
    residual add; hidden 96 with tanh-GELU, Gemma's form and no residual; hidden 64 with SiLU
    and the add. normed, h and the total (program 0's stores of the padded tile)."""
    cases = [gate_up_case(rows, 300, 80, dtype, "silu"),
             gate_up_case(rows, 96, 112, dtype, "gelu_tanh", residual=False, form="gemma"),
             gate_up_case(rows, 64, 176, dtype, "silu", eps=1e-5)]
    assert _each_case_a_dot_config(NORM_GATE_UP, cases, rows, GATE_UP_TOL[dtype],
                                   tmp_path) == 3


# norm_gate_up alone (13 s under the interpreter; the CI suite has a 15-minute budget): its
# DOT step is norm_qkv's prologue and qkv_proj's tile step, whose equality with the reference
# the tests above check on the same edge shapes
@pytest.mark.parametrize("name", ["norm_gate_up"])
def test_the_verifier_accepts_a_dot_candidate(name, tmp_path):
    """DOT on the family's example case (2 rows, fp32) through the verifier's edge cases (one
    row, a prime count, MAX_ROWS, strided and 2-D x) and stress values: the fp32 dot is IEEE,
    within the fp32 order bound. (The narrowest tile: the interpreter's time.)"""
    family = FAMILIES[name]
    case = family.examples[0]
    config = min(_dots(family.search_space(case)), key=lambda c: c["BLOCK_N"])
    verify_on_cpu_or_gpu(family, case, tmp_path, config)


def _llama_cases(name: str, rows: int, dtype: str) -> list[dict]:
    """Llama-3.2-1B's and Llama-3.1-8B's shapes (and Qwen2.5-0.5B's narrow k/v) for a family."""
    if name == "norm_gate_up":
        return [gate_up_case(rows, h, c, dtype) for h, c in ((2048, 8192), (4096, 14336),
                                                              (896, 4864))]
    make = qkv_case if name == "qkv_proj" else norm_qkv_case
    return [make(rows, k, nq, nkv, nkv, dtype, False, (rows, 1))
            for k, nq, nkv in ((2048, 2048, 512), (4096, 4096, 1024), (896, 896, 128))]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_dot_configs_lead_the_search_space_from_four_rows(name):
    """At Llama's shapes: no DOT at one row; from two rows DOT configs (BLOCK_N 16 at least,
    the staged weight tiles and the x tile in DOT_SMEM, a short list spanning the widths) with
    the row loop's configs as they were at one row (the same dicts: their folders and search
    memories stand); the first config (the family's guess, Family.leads) a DOT one from four
    rows, the row loop's below; the interpreter's cheapest (a row-loop tile) last."""
    family = FAMILIES[name]
    weights = 2 if name == "norm_gate_up" else 1
    max_rows = 16 if name == "qkv_proj" else 4
    for dtype in ("bfloat16", "float32"):
        item = 4 if dtype == "float32" else 2
        for i, one in enumerate(_llama_cases(name, 1, dtype)):
            plain = family.search_space(one)
            assert not _dots(plain) and family.leads(one) == 1
            for rows in [r for r in (2, 3, 4, 8, 16) if r <= max_rows]:
                space = family.search_space(_llama_cases(name, rows, dtype)[i])
                dots = _dots(space)
                assert [c for c in space if not c.get("DOT")] == plain
                assert len({repr(c) for c in space}) == len(space)
                assert all(c.get("DOT", True) is True for c in space)  # True or absent
                assert bool(space[0].get("DOT")) is (rows >= 4), (name, rows)
                assert space[-1] == plain[-1] and not space[-1].get("DOT")
                assert 1 <= len(dots) <= 3
                for c in dots:
                    assert c["BLOCK_N"] >= 16
                    assert NUM_STAGES * (weights * c["BLOCK_N"] + 16) * c["BLOCK_K"] * item \
                        <= DOT_SMEM
                if dtype == "bfloat16" and weights == 1:
                    assert {c["BLOCK_N"] for c in dots} == set(DOT_BLOCK_NS), (name, one)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_dot_source_says_so_and_pads_the_rows(name):
    family = FAMILIES[name]
    case = _llama_cases(name, 4, "float16")[0]
    config = _dots(family.search_space(case))[0]
    dot, rows = family.render(config, case), family.render({**config, "DOT": False}, case)
    words = "tensor-core dot per"  # the module docstring's account of a step
    assert "DOT = True" in dot and "MIN_BLOCK_M = 16" in dot and words in dot.split('"""')[1]
    assert "DOT = False" in rows and "MIN_BLOCK_M = 1" in rows
    assert words not in rows.split('"""')[1]
    assert "tl.dot(w, tl.trans(x), acc" in dot  # gemv's _dot_rows


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [2, 4, 16])
def test_gpu_dot_configs_are_right_in_bf16_at_llamas_shapes(rows, tmp_path):
    """Every DOT config the spaces offer (tensor cores, staged tiles in shared memory) at
    Llama-3.2-1B's shapes in bf16: qkv_proj's q/k/v and norm_qkv's (2048 -> 2048, 512, 512)
    within bf16 error of the float64 products (norm_qkv's of the reference's normed x, whose
    own normed equals the reference's within bf16 rounding); norm_gate_up's (2048 -> 8192,
    SiLU) total as HF's one rounded add, normed and h within bf16 error. The norm fusions at
    their MAX_ROWS (4) at most. Times nothing: the search does."""
    gen = torch.Generator("cuda").manual_seed(rows)

    def within(out, exact, what):
        err = (out.double() - exact).abs().max().item()
        assert err <= 1e-2 + 1.6e-2 * exact.abs().max().item(), (what, rows, err)

    def run(family, case, config, inputs):
        outs = tuple(o.fill_(float("nan")) for o in family.make_out(case, inputs))
        load_rendered(family, config, case, tmp_path)(*inputs, out=outs, **family.params(case))
        torch.cuda.synchronize()
        return outs

    case = qkv_case(rows, 2048, 2048, 512, 512, "bfloat16", False, (rows, 1))
    inputs = QKV.make_inputs(case, "cuda", gen)
    exact = [F.linear(inputs[0].double(), w.double()) for w in inputs[1:]]
    for config in _dots(QKV.search_space(case)):
        for o, e in zip(run(QKV, case, config, inputs), exact):
            within(o, e, config)
    if rows > 4:
        return
    case = norm_qkv_case(rows, 2048, 2048, 512, 512, "bfloat16", False, (rows, 1), eps=1e-5)
    inputs = NORM_QKV.make_inputs(case, "cuda", gen)
    ref = NORM_QKV.reference(*inputs, **NORM_QKV.params(case))
    exact = [F.linear(ref[0].double(), w.double()) for w in inputs[2:5]]
    for config in _dots(NORM_QKV.search_space(case)):
        outs = run(NORM_QKV, case, config, inputs)
        assert_close(outs[0], ref[0], (1e-2, 1.6e-2))
        for o, e in zip(outs[1:], exact):
            within(o, e, config)
    case = gate_up_case(rows, 2048, 8192, "bfloat16", "silu", eps=1e-5)
    inputs = NORM_GATE_UP.make_inputs(case, "cuda", gen)
    ref = NORM_GATE_UP.reference(*inputs, **NORM_GATE_UP.params(case))
    n = ref[0].double()
    exact = F.silu(n @ inputs[2].double().T) * (n @ inputs[3].double().T)
    for config in _dots(NORM_GATE_UP.search_space(case)):
        outs = run(NORM_GATE_UP, case, config, inputs)
        assert torch.equal(outs[2], ref[2])  # one rounded add, as HF's
        assert_close(outs[0], ref[0], (1e-2, 1.6e-2))
        within(outs[1], exact, config)

"""matmul_gelu: the reference is GPT2MLP's c_fc + act bit for bit, the rendered kernel (bias and
tanh-GELU in the epilogue) matches it under the interpreter (fp32, fp16; bf16 on a GPU), the
patch on tiny-gpt2 gives the same logits and undo restores them bit for bit, and the profile
shows the pattern as an alternative to gelu_new that absorbs c_fc's linear."""

from __future__ import annotations

import collections

import pytest
import torch
from family_checks import (
    DEVICE,
    CountingChooser,
    assert_close,
    instance_forwards,
    profiled_ops,
    run_candidate,
    space_ends,
)

from codegen.gelu import FAMILY as GELU
from codegen.matmul import FAMILY as MATMUL
from codegen.matmul_gelu import FAMILY, gemm_gelu_cost
from codegen.matmul_gelu.patch import find_mlps
from codegen.matmul_gelu.reference import MAX_BLOCK_M, make_case
from core.workload import Workload
from profiling.loader import build, resolve

TOL = {"float32": (1e-5, 1e-5), "float16": (1e-3, 2e-3), "bfloat16": (1e-2, 1.6e-2)}
DTYPES = ["float32", "float16", pytest.param("bfloat16", marks=pytest.mark.gpu)]


def test_reference_is_the_mlps_own_c_fc_and_act():
    model = build(resolve("tiny-gpt2"), torch.float32, "cpu")
    (mlp, act), *_ = find_mlps(model)
    x = torch.randn(2, 8, mlp.c_fc.weight.shape[0])
    with torch.no_grad():
        want = mlp.act(mlp.c_fc(x))
        got = FAMILY.reference(x, mlp.c_fc.weight, mlp.c_fc.bias, act=act)
    assert act == "gelu_new" and torch.equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, k, n", [(16, 64, 176), (MAX_BLOCK_M + 1, 96, 64)])
@pytest.mark.parametrize("act", ["gelu_new", "gelu_pytorch_tanh"])
def test_rendered_kernel_matches_the_reference(rows, k, n, act, dtype, tmp_path):
    case = make_case(rows, k, n, dtype, act)
    for config in space_ends(FAMILY.search_space(case)):
        out, ref = run_candidate(FAMILY, config, case, tmp_path)
        assert_close(out, ref, TOL[dtype])


def test_patch_gives_the_same_logits_and_undo_restores(tmp_path):
    model = build(resolve("tiny-gpt2"), torch.float32, DEVICE)
    ids = torch.randint(0, 500, (2, 8), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    n_mlps = len(find_mlps(model))
    with torch.no_grad():
        before = model(ids).logits
        chooser = CountingChooser(FAMILY, tmp_path)
        undo = FAMILY.patch(model, chooser)
        assert len(instance_forwards(model)) == n_mlps > 0
        patched = model(ids).logits
        undo()
        after = model(ids).logits
    assert chooser.calls == n_mlps
    assert chooser.distinct_cases() == FAMILY.cases_from_model(model, Workload(2, 8))
    assert_close(patched, before, (1e-4, 1e-4))
    assert torch.equal(after, before) and instance_forwards(model) == []


def test_a_wrapped_c_fc_falls_back_to_what_ran_before(tmp_path):
    """tiny-gpt2's c_fc (176 wide) is padded by the matmul family: its adapter must see the
    call, so the fused kernel steps aside."""
    model = build(resolve("tiny-gpt2"), torch.float32, DEVICE)
    ids = torch.randint(0, 500, (1, 8), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    with torch.no_grad():
        before = model(ids).logits
        undo_matmul = MATMUL.patch(model, lambda case: None)  # wraps, runs the module's code
        chooser = CountingChooser(FAMILY, tmp_path)
        undo = FAMILY.patch(model, chooser)
        got = model(ids).logits
        undo_matmul()
        undo()
    assert chooser.calls == 0 and torch.equal(got, before)


def test_pattern_extends_gelu_new_and_absorbs_the_sibling_c_fc(tmp_path):
    from profiling.patterns import BASE_PATTERNS, alternatives, match

    model = build(resolve("tiny-gpt2"), torch.float32, "cpu")
    ops = profiled_ops(model, tmp_path)
    patterns = list(BASE_PATTERNS) + list(GELU.patterns) + list(MATMUL.patterns) + \
        list(FAMILY.patterns)
    found, _ = match(ops, patterns)
    assert not any(o.family == "matmul_gelu" for o in found)  # never a claimant
    alts = alternatives(found, patterns)
    n_layers = model.config.n_layer
    assert [(o.pattern, o.family, o.extends) for o in alts] == \
        [("mlp_gemm_gelu", "matmul_gelu", "gelu_new")] * n_layers
    k, n = model.transformer.h[0].mlp.c_fc.weight.shape
    case = make_case(8, k, n, "float32", "gelu_new")
    for o in alts:
        mine = [ops[i] for i in o.ops]
        names = collections.Counter(op["name"] for op in mine)
        assert names["aten::addmm"] == 1 and names["aten::tanh"] == 1
        assert [op["module"].rsplit(".", 1)[-1] for op in mine
                if op["name"] == "aten::addmm"] == ["c_fc"]  # not c_proj
        assert gemm_gelu_cost(mine) == (FAMILY.min_bytes(case), FAMILY.flops(case))


@pytest.mark.gpu
def test_patch_reaches_the_kernel_on_the_gpu_stack_in_bf16(tmp_path):
    """GPT2MLP's forward as the GPU stack's transformers writes it is recognised, and the
    compiled bf16 kernel gives the logits within bf16 rounding."""
    model = build(resolve("tiny-gpt2"), torch.bfloat16, "cuda")
    ids = torch.randint(0, 500, (2, 64), device="cuda")
    with torch.no_grad():
        before = model(ids).logits.float()
        chooser = CountingChooser(FAMILY, tmp_path)
        undo = FAMILY.patch(model, chooser)
        patched = model(ids).logits.float()
        undo()
    assert chooser.calls == model.config.n_layer
    torch.testing.assert_close(patched, before, atol=5e-2, rtol=5e-2)

"""Softmax family: reference == torch.softmax with its dtype semantics, rendered kernels (whole
row and looped online forms) == reference including NaN/inf behaviour, and the documented
no-op patch: no zoo model runs a standalone softmax in its forward. CPU runs the kernels under
Triton's interpreter (fp32, fp16); bf16 kernel checks run on a GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from family_checks import (
    DEVICE,
    assert_close,
    load_rendered,
    run_candidate,
    space_ends,
)
from torch.profiler import ProfilerActivity, profile

from codegen.softmax import FAMILY
from codegen.softmax.reference import make_case
from core.workload import Workload
from profiling.loader import build, resolve

TOL = {"float32": (1e-6, 1e-5), "float16": (1e-3, 4e-3), "bfloat16": (8e-3, 3e-2)}
KERNEL_DTYPES = ["float32", "float16", pytest.param("bfloat16", marks=pytest.mark.gpu)]
# (rows, cols, out_dtype or None for the input's): attention-like widths, a prime, one past a
# power of two, a row wider than the looped blocks, HF eager's fp32 output from half scores.
SHAPES = [(16, 100, None), (3, 257, None), (1, 1023, None), (2, 5003, None), (4, 300, "float32")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_reference_is_torch_softmax_with_its_dtype_semantics(dtype):
    x = (4 * torch.randn(5, 77, generator=torch.Generator().manual_seed(1))).to(dtype)
    assert torch.equal(FAMILY.reference(x), torch.softmax(x, dim=-1))
    got = FAMILY.reference(x, out_dtype="float32")
    want = F.softmax(x, dim=-1, dtype=torch.float32)  # as HF's eager attention calls it
    assert got.dtype == torch.float32 and torch.equal(got, want)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("rows, cols, out_dtype", SHAPES)
def test_rendered_matches_reference(rows, cols, out_dtype, dtype, tmp_path):
    case = make_case(rows, cols, dtype, out_dtype)
    configs = FAMILY.search_space(case)
    assert 1 <= len(configs) <= 12
    for config in space_ends(configs):
        out, ref = run_candidate(FAMILY, config, case, tmp_path)
        assert_close(out, ref, TOL[case["out_dtype"]])


def test_whole_row_and_looped_forms_are_both_searched_and_correct(tmp_path):
    case = make_case(2, 5003, "float16")
    configs = FAMILY.search_space(case)
    assert {c["BLOCK"] >= 5003 for c in configs} == {True, False}
    for config in configs:
        out, ref = run_candidate(FAMILY, config, case, tmp_path)
        assert_close(out, ref, TOL["float16"])


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_edge_cases(dtype, tmp_path):
    base = make_case(16, 100, dtype)
    edges = FAMILY.edge_cases(base)
    assert any(c["rows"] == 1 for c in edges) and any("row_stride" in c for c in edges)
    assert all(c["cols"] == base["cols"] for c in edges)  # the width is baked into a candidate
    for case in edges:
        out, ref = run_candidate(FAMILY, FAMILY.search_space(base)[0], case, tmp_path,
                                 rendered_for=base)
        assert_close(out, ref, TOL[dtype])


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy, on inf inside the interpreter
@pytest.mark.parametrize("block", [64, 16])  # whole row, looped
def test_special_values_propagate_like_torch(block, tmp_path):
    inf, nan = float("inf"), float("nan")
    x = torch.randn(6, 40, generator=torch.Generator().manual_seed(3))
    x[0, 20:] = -inf  # a causal mask: fine
    x[1, :] = -inf  # a fully masked row: NaN in torch
    x[2, 5] = nan
    x[3, 7] = inf
    x[4, :] = 7.0  # all equal
    x[5, :17] = -inf  # the first looped block sees only -inf
    case = make_case(6, 40, "float32")
    forward = load_rendered(FAMILY, {"BLOCK": block, "num_warps": 1}, case, tmp_path)
    x = x.to(DEVICE)
    out = torch.full_like(x, 123.0)
    forward(x, out=out, out_dtype="float32")
    assert_close(out, torch.softmax(x, dim=-1), TOL["float32"])


def test_rendered_source_is_specialised_and_guards_its_params(tmp_path):
    case = make_case(4, 5003, "float16", "float32")
    config = {"BLOCK": 1024, "num_warps": 4}
    source = FAMILY.render(config, case)
    for line in ("COLS = 5003", "BLOCK = 1024", "SINGLE = False", "NUM_WARPS = 4",
                 "OUT_DTYPE = torch.float32", "def _softmax_forward_kernel",
                 "def forward(x, *, out, **params)"):
        assert line in source
    forward = load_rendered(FAMILY, config, case, tmp_path)
    (x,) = FAMILY.make_inputs(case)
    with pytest.raises(ValueError):
        forward(x, out=torch.empty(4, 5003), out_dtype="float16")
    with pytest.raises(ValueError):
        forward(x, out=torch.empty(4, 5003, dtype=torch.float16))


def _top_level_ops(model, ids) -> set[str]:
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
        model(ids)
    return {e.name for e in prof.events() if e.cpu_parent is None}


@pytest.mark.parametrize("model_id", ["tiny-llama", "tiny-gemma", "tiny-phi3", "tiny-gpt2"])
def test_zoo_models_run_no_standalone_softmax_and_patch_is_a_no_op(model_id):
    model = build(resolve(model_id), torch.float32, "cpu")
    ids = torch.arange(3, 19).view(2, 8)
    ops = _top_level_ops(model, ids)
    assert "aten::scaled_dot_product_attention" in ops
    assert not {"aten::softmax", "aten::_softmax"} & ops
    assert FAMILY.cases_from_model(model, Workload(2, 8)) == []
    with torch.no_grad():
        before = model(ids).logits
        undo = FAMILY.patch(model, lambda case: pytest.fail("no case should be asked"))
        patched = model(ids).logits
        undo()
    assert torch.equal(patched, before)
    assert not any("forward" in m.__dict__ for m in model.modules())

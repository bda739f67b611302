"""GELU family: reference == transformers' NewGELUActivation, rendered kernels == reference,
pattern == what the profile's matcher finds in GPT-2, per-instance patching and undo on
tiny-gpt2. CPU runs the kernels under Triton's interpreter (fp32, fp16); bf16 kernel checks
run on a GPU (the interpreter gets bf16 math wrong)."""

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
from transformers.activations import NewGELUActivation

from codegen.gelu import FAMILY
from codegen.gelu.patch import find_activations
from codegen.gelu.reference import make_case
from core.workload import Workload
from profiling.loader import build, resolve

# sigmoid(z) = 1 / (1 + exp(-z)) overflows exp for z << 0 on the way to the right 0.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
# HF rounds each of its eight ops in half precision; 1 + tanh(z) loses most digits near
# z = -2, so the fp16 reference itself is a few 1e-4 off the exact value there.
TOL = {"float32": (1e-5, 1e-5), "float16": (4e-3, 4e-3), "bfloat16": (3e-2, 3e-2)}
KERNEL_DTYPES = ["float32", "float16", pytest.param("bfloat16", marks=pytest.mark.gpu)]
SHAPES = [(16, 176), (1, 1023), (3, 257), (2, 3072)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_reference_is_bitwise_the_hf_module(dtype):
    x = (3 * torch.randn(4, 7, 96, generator=torch.Generator().manual_seed(1))).to(dtype)
    want = NewGELUActivation()(x)
    got = FAMILY.reference(x)
    assert got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("rows, cols", SHAPES)
def test_rendered_matches_reference(rows, cols, dtype, tmp_path):
    case = make_case(rows, cols, dtype)
    configs = FAMILY.search_space(case)
    assert 1 <= len(configs) <= 12
    for config in space_ends(configs):
        out, ref = run_candidate(FAMILY, config, case, tmp_path)
        assert_close(out, ref, TOL[dtype])


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_edge_cases(dtype, tmp_path):
    base = make_case(16, 176, dtype)
    edges = FAMILY.edge_cases(base)
    assert any(c["rows"] == 1 for c in edges) and any("row_stride" in c for c in edges)
    assert all(c["cols"] == base["cols"] for c in edges)  # the width is baked into a candidate
    for case in edges:
        out, ref = run_candidate(FAMILY, FAMILY.search_space(base)[0], case, tmp_path,
                                 rendered_for=base)
        assert_close(out, ref, TOL[dtype])


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy, on inf inside the interpreter
def test_special_values_propagate_like_hf(tmp_path):
    case = make_case(1, 8, "float32")
    forward = load_rendered(FAMILY, FAMILY.search_space(case)[0], case, tmp_path)
    x = torch.tensor([[float("nan"), float("inf"), float("-inf"), -100.0, 100.0, 0.0, -0.0,
                       -2.0]], device=DEVICE)
    out = torch.empty_like(x)
    forward(x, out=out)
    assert_close(out, NewGELUActivation()(x), TOL["float32"])


def test_rendered_source_is_specialised_and_guards_its_params(tmp_path):
    case = make_case(4, 300, "float16")
    source = FAMILY.render({"BLOCK": 256, "num_warps": 2}, case)
    # launched through codegen.launch (less host time per call than the JIT's path)
    for line in ("COLS = 300", "BLOCK = 256", "NUM_WARPS = 2", "N_COL_BLOCKS = 2",
                 "def _gelu_forward_kernel", "def forward(x, *, out, **params)",
                 "_launch = launcher(_gelu_forward_kernel"):
        assert line in source
    forward = load_rendered(FAMILY, {"BLOCK": 256, "num_warps": 2}, case, tmp_path)
    (x,) = FAMILY.make_inputs(case)
    with pytest.raises(ValueError):
        forward(x, out=torch.empty_like(x), approximate="none")
    with pytest.raises(ValueError):
        forward(x, out=torch.empty(4, 301, dtype=x.dtype))


def test_pattern_matches_the_profiled_activations(tmp_path):
    model = build(resolve("tiny-gpt2"), torch.float32, "cpu")
    found = [(name, ops) for name, fam, ops in profiled_occurrences(model, tmp_path)
             if fam == "gelu"]
    assert [name for name, _ in found] == ["gelu_new"] * 2
    for _, ops in found:
        assert dict(ops) == FAMILY.patterns[0].ops


def test_patch_runs_the_kernel_and_undo_restores(tmp_path):
    model = build(resolve("tiny-gpt2"), torch.float32, DEVICE)
    assert [p for p, _ in find_activations(model)] == ["transformer.h.0.mlp.act",
                                                      "transformer.h.1.mlp.act"]
    ids = torch.randint(3, 500, (2, 8), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    with torch.no_grad():
        before = model(ids).logits
        chooser = CountingChooser(FAMILY, tmp_path)
        undo = FAMILY.patch(model, chooser)
        assert instance_forwards(model) == ["transformer.h.0.mlp.act", "transformer.h.1.mlp.act"]
        patched = model(ids).logits
        undo()
        after = model(ids).logits
    assert chooser.calls == 2
    assert chooser.distinct_cases() == FAMILY.cases_from_model(model, Workload(2, 8))
    torch.testing.assert_close(patched, before, atol=1e-4, rtol=1e-4)
    assert torch.equal(after, before)
    assert instance_forwards(model) == []


"""Cross-entropy family: reference == F.cross_entropy (mean and per row, ignore_index), rendered
kernels == reference, a deterministic mean, NaN/inf behaviour, and the documented no-op patch
(the profiled forward computes no loss). CPU runs the kernels under Triton's interpreter (fp32,
fp16); bf16 kernel checks run on a GPU."""

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

from codegen.cross_entropy import FAMILY
from codegen.cross_entropy.reference import make_case
from core.workload import Workload
from profiling.loader import build, resolve

TOL = {"float32": (1e-5, 1e-5), "float16": (4e-3, 4e-3), "bfloat16": (3e-2, 3e-2)}
KERNEL_DTYPES = ["float32", "float16", pytest.param("bfloat16", marks=pytest.mark.gpu)]
SHAPES = [(16, 512), (1, 1023), (6, 5003), (4, 300)]


def test_reference_is_f_cross_entropy_mean_and_per_row():
    case = make_case(10, 50, "float32")
    logits, target = FAMILY.make_inputs(case, "cpu", torch.Generator().manual_seed(1))
    mean, rows = FAMILY.reference(logits, target, ignore_index=-100)
    assert torch.equal(mean, F.cross_entropy(logits, target))
    assert torch.equal(rows, F.cross_entropy(logits, target, reduction="none"))
    ignored = target == -100
    assert ignored.sum() == 2 and torch.all(rows[ignored] == 0)
    torch.testing.assert_close(mean, rows.sum() / (~ignored).sum())


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("rows, vocab", SHAPES)
def test_rendered_matches_reference(rows, vocab, dtype, tmp_path):
    case = make_case(rows, vocab, dtype)
    configs = FAMILY.search_space(case)
    assert 1 <= len(configs) <= 12
    for config in space_ends(configs):
        out, ref = run_candidate(FAMILY, config, case, tmp_path)
        assert_close(out, ref, TOL[dtype])


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_edge_cases(dtype, tmp_path):
    base = make_case(16, 512, dtype)
    edges = FAMILY.edge_cases(base)
    assert any(c["rows"] == 1 for c in edges) and any("row_stride" in c for c in edges)
    assert all(c["vocab"] == base["vocab"] for c in edges)  # baked into a candidate
    if dtype != "float32":  # 1025 interpreted programs take seconds on a CPU: once is enough
        edges = [c for c in edges if c["rows"] < 1000 or DEVICE == "cuda"]
    for case in edges:
        out, ref = run_candidate(FAMILY, {"BLOCK": 256, "num_warps": 4}, case, tmp_path,
                                 rendered_for=base)
        assert_close(out, ref, TOL[dtype])


def test_mean_is_deterministic(tmp_path):
    case = make_case(37, 300, "float32")
    forward = load_rendered(FAMILY, FAMILY.search_space(case)[0], case, tmp_path)
    logits, target = FAMILY.make_inputs(case, DEVICE, torch.Generator(DEVICE).manual_seed(0))
    results = []
    for _ in range(3):
        out = FAMILY.make_out(case, (logits, target))
        forward(logits, target, out=out, ignore_index=-100)
        results.append(out)
    assert all(torch.equal(a, b) for r in results[1:] for a, b in zip(r, results[0]))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy, on inf inside the interpreter
def test_special_values_propagate_like_torch(tmp_path):
    inf = float("inf")
    case = make_case(5, 40, "float32")
    forward = load_rendered(FAMILY, {"BLOCK": 16, "num_warps": 1}, case, tmp_path)
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(2))
    logits[0, 20:] = -inf  # masked vocabulary: fine
    logits[1, 3] = -inf  # ... and the target sits there: infinite loss
    logits[2, :] = -inf  # nothing left: NaN
    logits[3, :17] = -inf  # the first block sees only -inf
    logits, target = logits.to(DEVICE), torch.tensor([4, 3, 0, 30, 9], device=DEVICE)
    out = FAMILY.make_out(case, (logits,))
    forward(logits, target, out=out)
    assert_close(out, FAMILY.reference(logits, target), TOL["float32"])


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy, on 0 / 0 inside the interpreter
def test_all_rows_ignored_gives_a_nan_mean(tmp_path):
    case = make_case(3, 64, "float32")
    forward = load_rendered(FAMILY, FAMILY.search_space(case)[0], case, tmp_path)
    logits = torch.randn(3, 64, device=DEVICE)
    target = torch.full((3,), -100, device=DEVICE)
    out = FAMILY.make_out(case, (logits,))
    forward(logits, target, out=out)
    assert torch.isnan(out[0]) and torch.equal(out[1], torch.zeros(3, device=DEVICE))
    assert torch.isnan(F.cross_entropy(logits, target))


def test_rendered_source_is_specialised_and_guards_its_params(tmp_path):
    case = make_case(4, 5003, "float16", ignore_index=0)
    config = {"BLOCK": 2048, "num_warps": 8}
    source = FAMILY.render(config, case)
    for line in ("VOCAB = 5003", "BLOCK = 2048", "NUM_WARPS = 8", "IGNORE_INDEX = 0",
                 "def _cross_entropy_forward_kernel", "def _cross_entropy_mean_kernel",
                 "def forward(logits, target, *, out, **params)"):
        assert line in source
    forward = load_rendered(FAMILY, config, case, tmp_path)
    inputs = FAMILY.make_inputs(case)
    with pytest.raises(ValueError):
        forward(*inputs, out=FAMILY.make_out(case, inputs), ignore_index=-100)
    with pytest.raises(ValueError):
        forward(inputs[0][:, :5000], inputs[1], out=FAMILY.make_out(case, inputs))


@pytest.mark.parametrize("model_id", ["tiny-llama", "tiny-gpt2"])
def test_profiled_forward_has_no_loss_and_patch_is_a_no_op(model_id):
    model = build(resolve(model_id), torch.float32, "cpu")
    ids = torch.arange(3, 19).view(2, 8)
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
        model(ids)
    assert not {"aten::cross_entropy_loss", "aten::nll_loss"} & {e.name for e in prof.events()}
    assert FAMILY.cases_from_model(model, Workload(2, 8)) == []
    with torch.no_grad():
        before = model(ids).logits
        undo = FAMILY.patch(model, lambda case: pytest.fail("no case should be asked"))
        patched = model(ids).logits
        undo()
    assert torch.equal(patched, before)

"""A small test family for verify/: Llama-style RMSNorm, in plain torch.

Shaped like a real codegen family (reference, inputs, out, edge cases, byte/flop counts,
forbidden aten ops) so the harness is exercised exactly as the pipeline will use it.
"""

from __future__ import annotations

import torch

from core.family import Family, Pattern


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, *, eps: float = 1e-6):
    """As in Hugging Face's LlamaRMSNorm, except that a float64 input stays float64 (HF would
    drop it to float32), so the verifier's float64 run is a true high-precision reference."""
    dtype = x.dtype
    h = x.to(torch.promote_types(dtype, torch.float32))
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(dtype)


def make_inputs(case, device, generator):
    dtype = getattr(torch, case["dtype"])
    rows, hidden = case["rows"], case["hidden"]
    width = case.get("row_stride", hidden)  # > hidden: rows are slices of a wider buffer
    x = torch.randn(rows, width, generator=generator, device=device).to(dtype)[:, :hidden]
    w = (1 + 0.1 * torch.randn(hidden, generator=generator, device=device)).to(dtype)
    return x, w


def make_out(case, inputs):
    x = inputs[0]
    return torch.empty(case["rows"], case["hidden"], dtype=x.dtype, device=x.device)


def edge_cases(case):
    h = case["hidden"]
    return [
        {**case, "rows": 1},
        {**case, "hidden": h + 3 if h % 2 == 0 else h + 2},  # just over a power-of-two block
        {**case, "row_stride": h + 16},  # non-contiguous rows
    ]


def _itemsize(case) -> int:
    return torch.empty(0, dtype=getattr(torch, case["dtype"])).element_size()


RMSNORM = Family(
    name="test_rmsnorm",
    patterns=(Pattern(name="test_rmsnorm", description="RMSNorm for verify tests",
                      module_class="LlamaRMSNorm", family="test_rmsnorm"),),
    reference=rms_norm_reference,
    make_inputs=make_inputs,
    make_out=make_out,
    edge_cases=edge_cases,
    min_bytes=lambda c: (2 * c["rows"] * c["hidden"] + c["hidden"]) * _itemsize(c),
    flops=lambda c: 4 * c["rows"] * c["hidden"],
    search_space=lambda c: [{}],
    render=lambda config, case: "",
    patch=lambda model, forward_by_case: (lambda: None),
    cases_from_model=lambda model, workload: [],
    aten_ops=("aten::pow", "aten::mean", "aten::rsqrt", "aten::mul"),
)

CASE_FP32 = {"rows": 4, "hidden": 64, "dtype": "float32", "eps": 1e-6}
CASE_FP16 = {"rows": 3, "hidden": 40, "dtype": "float16", "eps": 1e-5}
CASE_BF16 = {"rows": 2, "hidden": 32, "dtype": "bfloat16", "eps": 1e-6}


def scale_shift_reference(x: torch.Tensor, *, scale: float = 2.0, shift: float = 1.0):
    """Two outputs from one input: exercises tuple `out` (like rotary q/k)."""
    return x * scale, x + shift


PAIR = Family(
    name="test_scale_shift",
    patterns=(Pattern(name="test_scale_shift", description="two-output test family"),),
    reference=scale_shift_reference,
    make_inputs=lambda case, device, generator: (
        torch.randn(case["rows"], case["cols"], generator=generator, device=device)
        .to(getattr(torch, case["dtype"])),),
    make_out=lambda case, inputs: (torch.empty_like(inputs[0]), torch.empty_like(inputs[0])),
    edge_cases=lambda case: [{**case, "rows": 1}],
    min_bytes=lambda c: 3 * c["rows"] * c["cols"] * 4,
    flops=lambda c: 2 * c["rows"] * c["cols"],
    search_space=lambda c: [{}],
    render=lambda config, case: "",
    patch=lambda model, forward_by_case: (lambda: None),
    cases_from_model=lambda model, workload: [],
    aten_ops=("aten::mul", "aten::add"),
)

CASE_PAIR = {"rows": 3, "cols": 20, "dtype": "float32", "scale": 3.0, "shift": -0.5}

"""Row softmax over the last dim with torch's dtype semantics, and the case side of the family.

`torch.softmax(x, dim=-1, dtype=d)` first casts x to d, then normalises, accumulating in fp32
for half types and rounding the result to d; without `dtype` the output keeps x's dtype. HF's
eager attention calls it with dtype=float32 on half-precision scores. The case records both:
`dtype` (the input's) and `out_dtype` (the result's).
"""

from __future__ import annotations

import torch

from codegen.dtypes import torch_dtype
from core.family import Case, distinct


def softmax(x: torch.Tensor, *, out_dtype: str | None = None) -> torch.Tensor:
    return torch.softmax(x, dim=-1, dtype=torch_dtype(out_dtype) if out_dtype else None)


def make_case(rows: int, cols: int, dtype: str, out_dtype: str | None = None) -> Case:
    return {"rows": int(rows), "cols": int(cols), "dtype": dtype,
            "out_dtype": out_dtype or dtype}


def params(case: Case) -> dict:
    """The keyword params a candidate's forward and the reference take for `case`."""
    return {"out_dtype": case["out_dtype"]}


def make_inputs(case: Case, device="cpu", generator=None) -> tuple:
    """(rows, cols) scores; `row_stride` > cols makes x a strided view of a wider buffer."""
    rows, cols = case["rows"], case["cols"]
    stride = case.get("row_stride", cols)
    gen_device = generator.device if generator is not None else "cpu"
    buf = torch.randn((rows, stride), generator=generator, device=gen_device,
                      dtype=torch.float32)
    # Attention scores spread over several units; x4 makes the max subtraction matter.
    buf = (4.0 * buf).to(device=device, dtype=torch_dtype(case["dtype"]))
    return (buf[:, :cols],)


def make_out(case: Case, inputs: tuple) -> torch.Tensor:
    return torch.empty((case["rows"], case["cols"]), dtype=torch_dtype(case["out_dtype"]),
                       device=inputs[0].device)


def edge_cases(case: Case) -> list[Case]:
    """Variations a candidate rendered for `case` must survive: the row width is baked into it
    (the dispatcher only sends it that width), so edges vary what stays free at run time: one
    row, a prime row count, a strided (non-contiguous) input."""
    cases = [
        {**case, "rows": 1},
        {**case, "rows": 7},
        {**case, "rows": 4, "row_stride": case["cols"] + 64},
    ]
    return distinct(case, cases)


def _size(name: str) -> int:
    return torch.empty((), dtype=torch_dtype(name)).element_size()


def min_bytes(case: Case) -> int:
    """Read each score once, write each probability once."""
    n = case["rows"] * case["cols"]
    return n * (_size(case["dtype"]) + _size(case["out_dtype"]))


def flops(case: Case) -> int:
    """Per element: the max compare, the subtract, exp (counted as one), the sum, the divide."""
    return 5 * case["rows"] * case["cols"]

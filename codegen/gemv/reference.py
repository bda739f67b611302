"""A few-row projection as nn.Linear computes it, and the case side of the family.

The product, the order bound, the scalar params and the cost are the matmul family's (layout
"linear": the module's own (n, k) weight); what differs here is that the weight is never padded
(the matmul family takes the widths it pads, `codegen.matmul.reference.gemv_takes`), and that a
case has at most MAX_ROWS rows, laid out as the model passes them: x is (batch, 1, k) at a
decode step (`lead` "batchx1"), out the (batch, 1, n) tensor the adapter allocates.
"""

from __future__ import annotations

import torch

from codegen.dtypes import random_normal, torch_dtype
from codegen.matmul.reference import GEMV_MAX_ROWS, flops, linear, min_bytes, order_bound
from codegen.matmul.reference import params as params
from codegen.shapes import lead_key, lead_of
from core.family import Case, distinct

MAX_ROWS = GEMV_MAX_ROWS

__all__ = ["MAX_ROWS", "edge_cases", "flops", "linear", "make_case", "make_inputs", "make_out",
           "min_bytes", "order_bound", "params"]


def make_case(rows: int, k: int, n: int, dtype: str, bias: bool, lead=None) -> Case:
    """`rows` tokens of width `k` in, `n` out; `lead`, when given, the leading shape of x and
    out as the adapter passes them ((batch, 1) at a decode step); none: a 2-D (rows, k) x."""
    if not 1 <= int(rows) <= MAX_ROWS:
        raise ValueError(f"a GEMV case has 1 to {MAX_ROWS} rows, got {rows}")
    case = {"rows": int(rows), "k": int(k), "n": int(n), "dtype": dtype, "layout": "linear",
            "bias": bool(bias)}
    if lead is not None:
        case["lead"] = lead_key(lead, rows)
    return case


def make_inputs(case: Case, device="cpu", generator=None) -> tuple:
    """(x, w[, b]): w the module's own (n, k) weight, scaled by k**-0.5 as trained ones are; x
    of the case's leading shape, a column slice of wider rows where `row_stride` > k."""
    k, n, dtype = case["k"], case["n"], case["dtype"]
    x = random_normal((*lead_of(case), case.get("row_stride", k)), device, generator, dtype,
               1.0)[..., :k]
    w = random_normal((n, k), device, generator, dtype, k ** -0.5)
    if not case["bias"]:
        return x, w
    return x, w, random_normal((n,), device, generator, dtype, 0.5)


def make_out(case: Case, inputs: tuple) -> torch.Tensor:
    return torch.empty((*lead_of(case), case["n"]), dtype=torch_dtype(case["dtype"]),
                       device=inputs[0].device)


def _rows(case: Case, rows: int, lead: str | None) -> Case:
    out = {**case, "rows": rows}
    out.pop("lead", None)
    return {**out, "lead": lead} if lead else out


def edge_cases(case: Case) -> list[Case]:
    """k, n and the bias are baked into a candidate; the rows stay free up to MAX_ROWS (the
    adapter sends no more): one row (decode at batch 1), a prime count (no row block divides
    it), MAX_ROWS itself, x as a column slice of wider rows, and a plain 2-D x."""
    cases = [
        _rows(case, 1, "1x1"),
        _rows(case, 3, "3x1"),
        _rows(case, MAX_ROWS, f"{MAX_ROWS}x1"),
        {**_rows(case, 5, "5x1"), "row_stride": case["k"] + 64},
        _rows(case, 7, None),
    ]
    return distinct(case, cases)

"""An attention's q, k and v projections as HF runs them (three nn.Linear calls on one input),
and the case side of the family.

A case: `rows` tokens of width `k` in (at most MAX_ROWS, one per sequence: a decode step),
`nq`, `nk`, `nv` out, `bias` (Qwen2's three projections have one, Llama's none), `lead` the
leading shape of x and the outputs as the model passes them ((batch, 1)); edge cases add
`row_stride` (x a column slice of wider rows) and a 2-D x. The inputs are the modules' own
(x, wq, wk, wv[, bq, bk, bv]), the output the three (lead..., n) tensors HF's Linears return:
the kernel writes the same layout, so what runs after the projections (rope, the KV-cache
update) sees what it sees unpatched.

The bound on the summation order is the matmul family's, per output.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from codegen.dtypes import element_size, random_normal, torch_dtype
from codegen.matmul.reference import GEMV_MAX_ROWS
from codegen.matmul.reference import order_bound as linear_bound
from codegen.shapes import lead_key, lead_of
from core.family import Case, distinct

MAX_ROWS = GEMV_MAX_ROWS
WIDTHS = ("nq", "nk", "nv")


def make_case(rows: int, k: int, nq: int, nk: int, nv: int, dtype: str, bias: bool,
              lead=None) -> Case:
    if not 1 <= int(rows) <= MAX_ROWS:
        raise ValueError(f"a grouped q/k/v case has 1 to {MAX_ROWS} rows, got {rows}")
    case = {"rows": int(rows), "k": int(k), "nq": int(nq), "nk": int(nk), "nv": int(nv),
            "dtype": dtype, "bias": bool(bias)}
    if lead is not None:
        case["lead"] = lead_key(lead, rows)
    return case


def params(case: Case) -> dict:
    return {}


def qkv(x, wq, wk, wv, bq=None, bk=None, bv=None):
    """(q, k, v): the three projections, each its own F.linear, as the attention calls them."""
    return F.linear(x, wq, bq), F.linear(x, wk, bk), F.linear(x, wv, bv)


def make_inputs(case: Case, device="cpu", generator=None) -> tuple:
    """(x, wq, wk, wv[, bq, bk, bv]): weights (n, k) scaled by k**-0.5 as trained ones are; x
    of the case's leading shape, a column slice of wider rows where `row_stride` > k."""
    k, dtype = case["k"], case["dtype"]
    x = random_normal((*lead_of(case), case.get("row_stride", k)), device, generator, dtype,
                      1.0)[..., :k]
    ws = tuple(random_normal((case[n], k), device, generator, dtype, k ** -0.5) for n in WIDTHS)
    if not case["bias"]:
        return (x, *ws)
    return (x, *ws, *(random_normal((case[n],), device, generator, dtype, 0.5) for n in WIDTHS))


def make_out(case: Case, inputs: tuple) -> tuple:
    lead = lead_of(case)
    return tuple(torch.empty((*lead, case[n]), dtype=torch_dtype(case["dtype"]),
                             device=inputs[0].device) for n in WIDTHS)


def order_bound(x, wq, wk, wv, bq=None, bk=None, bv=None, *, reference=None) -> tuple:
    """Per output, the matmul family's dot-product bound for its own weight."""
    refs = reference if reference is not None else (None, None, None)
    return tuple(linear_bound(x, w, b, n=w.shape[0], layout="linear",
                              reference=None if r is None else (r,))
                 for w, b, r in zip((wq, wk, wv), (bq, bk, bv), refs))


def _rows(case: Case, rows: int, lead: str | None) -> Case:
    out = {**case, "rows": rows}
    out.pop("lead", None)
    return {**out, "lead": lead} if lead else out


def edge_cases(case: Case) -> list[Case]:
    """k, the widths and the bias are baked into a candidate; the rows stay free up to MAX_ROWS:
    one row, a prime count, MAX_ROWS itself, x as a column slice of wider rows, a 2-D x."""
    return distinct(case, [
        _rows(case, 1, "1x1"),
        _rows(case, 3, "3x1"),
        _rows(case, MAX_ROWS, f"{MAX_ROWS}x1"),
        {**_rows(case, 5, "5x1"), "row_stride": case["k"] + 64},
        _rows(case, 7, None),
    ])


def n_total(case: Case) -> int:
    return sum(case[n] for n in WIDTHS)


def min_bytes(case: Case) -> int:
    """x read once, the three weights once, the outputs written once."""
    rows, k, n = case["rows"], case["k"], n_total(case)
    return (rows * k + k * n + rows * n + (n if case["bias"] else 0)) * element_size(case)


def flops(case: Case) -> int:
    return 2 * case["rows"] * case["k"] * n_total(case)

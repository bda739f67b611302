"""A projection as Hugging Face computes it (nn.Linear, GPT-2's Conv1D, the LM head), on the
weight the family's adapter holds, and the case side of the family.

Two weight layouts occur: nn.Linear stores (out, in) and runs `F.linear(x, W, b)`; GPT-2's
Conv1D stores (in, out) and runs `torch.addmm(b, x2d, W)`. A width no 64 divides (GPT-2's vocab
50257) makes the output's leading dimension misaligned for cuBLAS's vector loads and stores;
the adapter then holds a copy of the weight (and bias) padded with zeros to `n_pad` output
columns, built once when the model is patched (patch.py), and the kernel computes into a
buffer of `n_pad` columns that the caller sees sliced back to `n`. The reference takes that
padded weight and computes exactly what the module computes: its first `n` output columns
hold the module's own values (the slice of a zero-padded weight is the original weight,
element for element), so it is bitwise the module's result (tests check it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from codegen.dtypes import element_size, random_normal, torch_dtype
from codegen.shapes import lead_key, lead_of, with_rows
from core.family import Case, distinct

LAYOUTS = ("linear", "conv1d")
# Output widths are padded to a multiple of this many elements (128 bytes of bf16): what
# Inductor's pad_mm and nanoGPT's 50304-wide vocab do for the same reason.
PAD_MULTIPLE = 64
# The widths a cuBLAS candidate may compute, searched per shape (kernel.search_space): which
# multiple gives cuBLAS the better tiling of the last columns is a measurement, not a rule.
# The adapter holds the weight padded to the largest, so every choice is a view of it.
PAD_CHOICES = (64, 128, 256)
# The largest row block of kernel.search_space (edge cases go one row past it).
MAX_BLOCK_M = 128
# A call of at most this many rows, one token per sequence (a decode step at batch <= 16), at
# a width this family does not pad, is the gemv family's (codegen/gemv): there cuBLAS's
# few-row kernels read the weight at 0.4-2.9 TB/s on the H200 (issue 25), and this family's
# candidates act on padded widths only.
GEMV_MAX_ROWS = 16


def padded(n: int, multiple: int = PAD_MULTIPLE) -> int:
    """`n` output columns rounded up to `multiple`; `n` itself when a multiple of
    PAD_MULTIPLE already (such a projection is not padded at all)."""
    return n if n % PAD_MULTIPLE == 0 else -(-n // multiple) * multiple


def gemv_takes(lead, n: int) -> bool:
    """Whether a projection of output width `n` whose x has leading shape `lead` goes to the
    gemv family: 1 to GEMV_MAX_ROWS rows, one token per sequence (a 2-D x counts its rows),
    a width needing no padding."""
    rows = 1
    for d in lead:
        rows *= int(d)
    return (0 < rows <= GEMV_MAX_ROWS and (len(lead) < 2 or int(lead[-1]) == 1)
            and padded(int(n)) == int(n))


def gemv_call(ops: list[dict]) -> bool:
    """`gemv_takes` for a profiled Linear scope, from its aten::linear's recorded shapes."""
    lin = next((o for o in ops if o["name"] == "aten::linear"), None)
    shapes = (lin or {}).get("shapes") or []
    if len(shapes) < 2 or not isinstance(shapes[0], list) or not shapes[0] \
            or not isinstance(shapes[1], list) or len(shapes[1]) != 2:
        return False
    return gemv_takes(shapes[0][:-1], shapes[1][0])


def held_width(n: int) -> int:
    """The width of the weight (and bias) the adapter holds: padded to the largest of
    PAD_CHOICES, so a candidate computing any of them reads a view of it."""
    return padded(n, max(PAD_CHOICES))


def effective_weight(w: torch.Tensor, n: int, layout: str) -> torch.Tensor:
    """The module's own (in, out)-or-(out, in) weight inside the adapter's (maybe padded) one:
    a view, no copy."""
    return w[:n] if layout == "linear" else w[:, :n]


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, *, n: int,
           layout: str) -> torch.Tensor:
    """x (..., k) times the module's weight plus its bias, as the module computes it: w is
    (n_pad, k) for "linear", (k, n_pad) for "conv1d"; b is (n_pad,) or absent."""
    weight = effective_weight(w, n, layout)
    bias = None if b is None else b[:n]
    if layout == "linear":
        return F.linear(x, weight, bias)
    x2 = x.reshape(-1, x.shape[-1])
    out = torch.mm(x2, weight) if bias is None else torch.addmm(bias, x2, weight)
    return out.view(*x.shape[:-1], n)


FP32_UNIT = 2.0 ** -24  # unit roundoff of the fp32 accumulators


def order_bound(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, *, n: int,
                layout: str, reference: tuple | None = None) -> dict:
    """Per output element (inputs in float64): the classic dot-product bound on what any fp32
    summation order may change, k u / (1 - k u) * sum |x_k w_k|, plus an fp32 bias add's
    rounding (2^-20 relative, 16 ulps). "overflow": where sum |x_k w_k| passes fp32's largest
    value, so the accumulator may overflow in one order and not in another. `reference`: the
    verifier's float64 result of the same inputs (the exact product plus bias), reused rather
    than computed again."""
    k = x.shape[-1] * FP32_UNIT
    weight = effective_weight(w, n, layout)
    wt = weight.T if layout == "linear" else weight
    mag = x.abs() @ wt.abs()
    exact = reference[0] if reference is not None else x @ wt + (0 if b is None else b[:n])
    bound = k / (1 - k) * mag + 2.0 ** -20 * exact.abs()
    top = torch.finfo(torch.float32).max
    return {"bound": bound, "overflow": (mag >= top) & mag.isfinite()}


def make_case(rows: int, k: int, n: int, dtype: str, layout: str, bias: bool, *,
              lead=None) -> Case:
    """`rows` tokens of width `k` in, `n` out; `n_pad` is the width the adapter's weight and
    output buffer have (`held_width`). `lead`, when given: the leading shape of x and out as
    the adapter passes them (a model's (batch, seq))."""
    if layout not in LAYOUTS:
        raise ValueError(f"unsupported weight layout {layout!r}; known: {', '.join(LAYOUTS)}")
    case = {"rows": int(rows), "k": int(k), "n": int(n), "n_pad": held_width(int(n)),
            "dtype": dtype, "layout": layout, "bias": bool(bias)}
    if lead is not None:
        case["lead"] = lead_key(lead, rows)
    return case


def params(case: Case) -> dict:
    return {"n": case["n"], "layout": case["layout"]}


def make_inputs(case: Case, device="cpu", generator=None) -> tuple:
    """(x, w[, b]) as the adapter hands them to a kernel: the weight in the module's layout,
    zero-padded to `n_pad` output columns, as is the bias; x (*lead, k). Weights scaled by
    k**-0.5 as trained ones are. A `row_stride` wider than k makes x a column slice of wider
    rows."""
    k, n, n_pad, dtype = case["k"], case["n"], case["n_pad"], case["dtype"]
    x = random_normal((*lead_of(case), case.get("row_stride", k)), device, generator, dtype,
               1.0)[..., :k]
    w = torch.zeros((n_pad, k) if case["layout"] == "linear" else (k, n_pad),
                    dtype=torch_dtype(dtype), device=device)
    effective_weight(w, n, case["layout"]).copy_(
        random_normal((n, k) if case["layout"] == "linear" else (k, n), device, generator, dtype,
               k ** -0.5))
    if not case["bias"]:
        return x, w
    b = torch.zeros(n_pad, dtype=torch_dtype(dtype), device=device)
    b[:n] = random_normal((n,), device, generator, dtype, 0.5)
    return x, w, b


def make_out(case: Case, inputs: tuple) -> torch.Tensor:
    """The adapter's buffer: (*lead, n_pad), of which the caller keeps the first n columns
    (`out_region`)."""
    x = inputs[0]
    return torch.empty((*lead_of(case), case["n_pad"]), dtype=x.dtype, device=x.device)


def out_region(case: Case, out: torch.Tensor) -> torch.Tensor:
    """The columns of the adapter's buffer the caller keeps: the result."""
    return out[..., :case["n"]]


def edge_cases(case: Case) -> list[Case]:
    """k, n and the layout are baked into a candidate; the rows stay free: one row (decode at
    batch 1), a prime count, one row past the largest row block, and x as a column slice of
    wider rows."""
    cases = [
        with_rows(case, 1, "1x1"),
        with_rows(case, 37, "1x37"),
        with_rows(case, MAX_BLOCK_M + 1, f"1x{MAX_BLOCK_M + 1}"),
        {**with_rows(case, 5, "1x5"), "row_stride": case["k"] + 64},
    ]
    return distinct(case, cases)


def min_bytes(case: Case) -> int:
    """Read x and the weight once, write the output once."""
    rows, k, n = case["rows"], case["k"], case["n"]
    return (rows * k + k * n + rows * n + (n if case["bias"] else 0)) * element_size(case)


def flops(case: Case) -> int:
    return 2 * case["rows"] * case["k"] * case["n"]

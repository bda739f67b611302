"""A decoder layer's input RMSNorm followed by its attention's q, k and v projections, as HF
runs them (the norm module, then three nn.Linear calls on its output), and the case side of
the family.

A case: the grouped q/k/v projection's (`codegen.qkv_proj.reference`: rows, k, nq, nk, nv,
dtype, bias, lead) at most MAX_ROWS rows, plus the norm's form (`codegen.rmsnorm.reference`:
eps, offset, cast_first). The inputs are (x, norm_weight, wq, wk, wv[, bq, bk, bv]), x the
norm's input (the residual stream); the outputs (normed, q, k, v): the norm's output as HF's
module returns it (contiguous, x's leading shape) and the three projections of it. The kernel
writes `normed` too, so the tensor the layer hands self_attn is a real, filled one: whatever
else reads it reads HF's values.
"""

from __future__ import annotations

import torch

from codegen.dtypes import element_size, torch_dtype
from codegen.qkv_proj import reference as qkv_ref
from codegen.rmsnorm.reference import FORMS, rms_norm
from codegen.shapes import lead_of
from core.family import Case, distinct

# Every program re-reads x's rows from L2 to sum their squares before its GEMV: cheap for a
# decode step's few rows, not for more (the unfused norm + GEMV then; the b1-4 range)
MAX_ROWS = 4
WIDTHS = qkv_ref.WIDTHS
PARAM_KEYS = ("eps", "offset", "cast_first")


def make_case(rows: int, k: int, nq: int, nk: int, nv: int, dtype: str, bias: bool,
              lead=None, form: str = "llama", eps: float = 1e-6) -> Case:
    if not 1 <= int(rows) <= MAX_ROWS:
        raise ValueError(f"a norm + q/k/v case has 1 to {MAX_ROWS} rows, got {rows}")
    return {**qkv_ref.make_case(rows, k, nq, nk, nv, dtype, bias, lead), "eps": float(eps),
            **FORMS[form]}


def params(case: Case) -> dict:
    return {key: case[key] for key in PARAM_KEYS}


def norm_qkv(x, norm_weight, wq, wk, wv, bq=None, bk=None, bv=None, *, eps: float,
             offset: float = 0.0, cast_first: bool = True):
    """(normed, q, k, v): HF's RMSNorm of x, then its three projections, each its own
    F.linear, as the layer and the attention call them."""
    normed = rms_norm(x, norm_weight, eps=eps, offset=offset, cast_first=cast_first)
    return (normed, *qkv_ref.qkv(normed, wq, wk, wv, bq, bk, bv))


def make_inputs(case: Case, device="cpu", generator=None) -> tuple:
    """(x, norm_weight, wq, wk, wv[, biases]): the grouped projection's inputs with the norm's
    weight after x (around 1 for Llama's form, 0 for Gemma's, as trained ones sit)."""
    x, *rest = qkv_ref.make_inputs(case, device, generator)
    dev = generator.device if generator is not None else "cpu"
    noise = torch.randn((case["k"],), generator=generator, device=dev) * 0.1
    weight = (1.0 - case["offset"] + noise).to(device=device, dtype=torch_dtype(case["dtype"]))
    return (x, weight, *rest)


def make_out(case: Case, inputs: tuple) -> tuple:
    x = inputs[0]
    normed = torch.empty((*lead_of(case), case["k"]), dtype=x.dtype, device=x.device)
    return (normed, *qkv_ref.make_out(case, inputs))


def order_bound(x, norm_weight, wq, wk, wv, bq=None, bk=None, bv=None, *, eps: float,
                offset: float = 0.0, cast_first: bool = True, reference=None) -> tuple:
    """normed: None, the tolerance table alone (a row's sum of squares in another order moves
    its rstd by an ulp, which the baseline's own rounding covers); q, k, v: the matmul
    family's dot-product bound over the reference's normed x, for its own weight."""
    normed = rms_norm(x.double(), norm_weight.double(), eps=eps, offset=offset,
                      cast_first=cast_first)
    refs = reference[1:] if reference is not None else None
    return (None, *qkv_ref.order_bound(normed, wq, wk, wv, bq, bk, bv,
                                                           reference=refs))


def edge_cases(case: Case) -> list[Case]:
    """k, the widths, the bias and the norm's form are baked into a candidate; the rows stay
    free up to MAX_ROWS: one row, a prime count, MAX_ROWS itself, x as a column slice of wider
    rows, a 2-D x."""
    rows = qkv_ref._rows
    return distinct(case, [
        rows(case, 1, "1x1"),
        rows(case, 3, "3x1"),
        rows(case, MAX_ROWS, f"{MAX_ROWS}x1"),
        {**rows(case, 3, "3x1"), "row_stride": case["k"] + 64},
        rows(case, 2, None),
    ])


def min_bytes(case: Case) -> int:
    """The grouped projection's bytes, the norm's weight, and normed written once."""
    rows, k = case["rows"], case["k"]
    return qkv_ref.min_bytes(case) + (k + rows * k) * element_size(case)


def flops(case: Case) -> int:
    """The three GEMMs' and the norm's (square, sum, scale by rsqrt and by the weight)."""
    return qkv_ref.flops(case) + 4 * case["rows"] * case["k"]

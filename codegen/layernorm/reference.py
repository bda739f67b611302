"""LayerNorm as `nn.LayerNorm` computes it (GPT-2's ln_1/ln_2/ln_f), optionally with the
residual add before it fused in, and the case side of the family.

Case keys: rows, hidden, dtype, eps, and residual (bool, default False). Plain: inputs
(x, weight, bias), out = normed. With residual: inputs (x, residual, weight, bias) and
out = (sum, normed) where sum = x + residual in the storage dtype, as GPT2Block computes
`attn_output + residual` before ln_2, and the norm reads that rounded sum. Params: eps, and
sum_dtype (the case's dtype) for the fused form.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from codegen.dtypes import element_size, torch_dtype
from codegen.rmsnorm.reference import edge_cases as _row_edge_cases
from codegen.rmsnorm.reference import make_x
from core.family import Case


def layer_norm(*inputs: torch.Tensor, eps: float, sum_dtype: str | None = None):
    """(x, weight, bias) -> normed, or (x, residual, weight, bias) -> (sum, normed).

    The model materialises the sum in its own dtype before the norm reads it; `sum_dtype`
    keeps that rounding when the verifier runs this on float64 inputs (at the model's dtype
    it is a no-op, so the reference stays bitwise the model's code)."""
    if len(inputs) == 4:
        x, residual, weight, bias = inputs
        total = x + residual
        if sum_dtype is not None:
            total = total.to(torch_dtype(sum_dtype)).to(total.dtype)
        return total, F.layer_norm(total, (total.shape[-1],), weight, bias, eps)
    x, weight, bias = inputs
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def make_case(rows: int, hidden: int, dtype: str, residual: bool = False, eps: float = 1e-5
              ) -> Case:
    """One norm call over `rows` rows of `hidden`; `residual`: the fused residual add first."""
    case = {"rows": int(rows), "hidden": int(hidden), "dtype": dtype, "eps": float(eps)}
    return {**case, "residual": True} if residual else case


def params(case: Case) -> dict:
    fused = {"sum_dtype": case["dtype"]} if case.get("residual") else {}
    return {"eps": float(case["eps"]), **fused}


def make_inputs(case: Case, device="cpu", generator=None) -> tuple:
    hidden, dtype = case["hidden"], torch_dtype(case["dtype"])
    g_device = generator.device if generator is not None else "cpu"

    def vec(centre):
        v = centre + 0.1 * torch.randn(hidden, generator=generator, device=g_device)
        return v.to(device=device, dtype=dtype)

    x = make_x(case, device, generator)
    if case.get("residual"):
        residual = make_x({**case, "row_stride": hidden}, device, generator)
        return x, residual, vec(1.0), vec(0.0)
    return x, vec(1.0), vec(0.0)


def make_out(case: Case, inputs: tuple):
    x = inputs[0]

    def empty():
        return torch.empty((case["rows"], case["hidden"]), dtype=x.dtype, device=x.device)

    return (empty(), empty()) if case.get("residual") else empty()


def edge_cases(case: Case) -> list[Case]:
    return _row_edge_cases(case)


def min_bytes(case: Case) -> int:
    """x (and residual) read once, weight and bias once, normed (and sum) written once."""
    rows, hidden = case["rows"], case["hidden"]
    streams = 4 if case.get("residual") else 2
    return element_size(case) * (streams * rows * hidden + 2 * hidden)


def flops(case: Case) -> int:
    """Mean, centre, square-sum, scale by rstd, weight multiply, bias add (+ residual add)."""
    rows, hidden = case["rows"], case["hidden"]
    return (6 + (1 if case.get("residual") else 0)) * rows * hidden + 2 * rows

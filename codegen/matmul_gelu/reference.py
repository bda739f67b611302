"""GPT-2's c_fc projection and its tanh-GELU as Hugging Face computes them, and the case side
of the family.

GPT2MLP runs `act(c_fc(x))`: Conv1D's `addmm(bias, x2d, W)` with W stored (in, out), then
`gelu_new` (NewGELUActivation, eight elementwise ops) or `gelu_pytorch_tanh` (GELUTanh, one
aten::gelu). In half precision HF rounds after the addmm and after every elementwise op; the
reference repeats those calls literally (codegen.gelu's `new_gelu`), so it is bitwise the
modules' own result (tests check it). The fused kernel rounds once, from fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from codegen.dtypes import element_size, random_normal
from codegen.gelu.reference import new_gelu
from codegen.shapes import lead_key, lead_of, with_rows
from core.family import Case, distinct

ACTS = ("gelu_new", "gelu_pytorch_tanh")
# The largest row block of kernel.search_space (edge cases go one row past it).
MAX_BLOCK_M = 128
# The largest slope of tanh-GELU (1.1289 at x = 1.5), rounded up.
MAX_SLOPE = 1.13
FP32_UNIT = 2.0 ** -24  # unit roundoff of the fp32 accumulators


def gelu(h: torch.Tensor, act: str) -> torch.Tensor:
    if act == "gelu_new":
        return new_gelu(h)
    return F.gelu(h, approximate="tanh")


def conv1d_gelu(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, *,
                act: str = "gelu_new") -> torch.Tensor:
    """act(x @ w + b) as GPT2MLP's c_fc and act compute it: x (..., k), w (k, n), b (n,)."""
    x2 = x.reshape(-1, x.shape[-1])
    h = torch.addmm(b, x2, w).view(*x.shape[:-1], w.shape[1])
    return gelu(h, act)


def order_bound(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, *, act: str = "gelu_new",
                reference: tuple | None = None) -> dict:
    """Per output element (inputs in float64): the dot-product bound on what any fp32
    summation order may change, gamma = k u / (1 - k u) times sum |x_k w_k|, carried through
    the activation (slope <= MAX_SLOPE), plus an fp32 epilogue's rounding (2^-20 relative of
    the pre-activation and of the result). "overflow": where sum |x_k w_k| passes fp32's largest
    value (the accumulator may overflow in one order and not in another)."""
    k = x.shape[-1] * FP32_UNIT
    mag = x.abs() @ w.abs()
    pre = x @ w + b
    out = reference[0] if reference is not None else gelu(pre, act)
    bound = MAX_SLOPE * (k / (1 - k) * mag + 2.0 ** -20 * pre.abs()) + 2.0 ** -20 * out.abs()
    top = torch.finfo(torch.float32).max
    return {"bound": bound, "overflow": (mag >= top) & mag.isfinite()}


def make_case(rows: int, k: int, n: int, dtype: str, act: str, *, lead=None) -> Case:
    """`lead`, when given: the leading shape of x and out as the adapter passes them (GPT-2's
    MLP hands (batch, seq, k))."""
    if act not in ACTS:
        raise ValueError(f"unsupported activation {act!r}; known: {', '.join(ACTS)}")
    case = {"rows": int(rows), "k": int(k), "n": int(n), "dtype": dtype, "act": act}
    if lead is not None:
        case["lead"] = lead_key(lead, rows)
    return case


def params(case: Case) -> dict:
    return {"act": case["act"]}


def make_inputs(case: Case, device="cpu", generator=None) -> tuple:
    """(x, w, b): x of standard deviation 2 and weights scaled by k**-0.5, so the
    pre-activation reaches both tails of the GELU; a `row_stride` wider than k makes x a
    column slice of wider rows; x and out are (*lead, width)."""
    k, n, dtype = case["k"], case["n"], case["dtype"]
    x = random_normal((*lead_of(case), case.get("row_stride", k)), device, generator, dtype,
               2.0)[..., :k]
    w = random_normal((k, n), device, generator, dtype, k ** -0.5)
    b = random_normal((n,), device, generator, dtype, 0.5)
    return x, w, b


def make_out(case: Case, inputs: tuple) -> torch.Tensor:
    x = inputs[0]
    return torch.empty((*lead_of(case), case["n"]), dtype=x.dtype, device=x.device)


def edge_cases(case: Case) -> list[Case]:
    """k and n are baked into a candidate; rows stay free: one row (decode at batch 1), a
    prime count, one row past the largest row block, x as a column slice of wider rows."""
    return distinct(case, [with_rows(case, 1, "1x1"), with_rows(case, 37, "1x37"),
                           with_rows(case, MAX_BLOCK_M + 1, f"1x{MAX_BLOCK_M + 1}"),
                           {**with_rows(case, 5, "1x5"), "row_stride": case["k"] + 64}])


def min_bytes(case: Case) -> int:
    """Read x, the weight and the bias once, write the activation once."""
    rows, k, n = case["rows"], case["k"], case["n"]
    return (rows * k + k * n + n + rows * n) * element_size(case)


def flops(case: Case) -> int:
    return 2 * case["rows"] * case["k"] * case["n"]

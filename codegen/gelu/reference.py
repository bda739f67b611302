"""GPT-2's GELU (`gelu_new`, transformers' NewGELUActivation) and the case side of the family.

HF computes 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x**3))) as eight separate aten
ops (pow, 4 mul, 2 add, tanh), each reading and writing the whole activation and, in half
precision, each rounding to the storage dtype. `new_gelu` repeats that expression literally, so
it is bitwise identical to the module (tests check it); the fused kernel computes in fp32 and
rounds once, which lands within the dtype's tolerance of it.
"""

from __future__ import annotations

import math

import torch

from codegen.dtypes import element_size, torch_dtype
from codegen.shapes import lead_key, lead_of, with_rows
from core.family import Case, distinct


def new_gelu(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi)
                                       * (x + 0.044715 * torch.pow(x, 3.0))))


def make_case(rows: int, cols: int, dtype: str, lead=None) -> Case:
    """`lead`, when given: the leading shape of x as the adapter passes it (GPT-2's MLP hands
    the activation its (batch, seq, cols) projection, not a (rows, cols) one)."""
    case = {"rows": int(rows), "cols": int(cols), "dtype": dtype}
    if lead is not None:
        case["lead"] = lead_key(lead, rows)
    return case


def params(case: Case) -> dict:
    """GELU has no scalar params; kept so every family exposes the same hook."""
    return {}




def make_inputs(case: Case, device="cpu", generator=None) -> tuple:
    """(*lead, cols), as the adapter passes it; `row_stride` > cols makes x a strided view of a
    wider buffer."""
    cols = case["cols"]
    stride = case.get("row_stride", cols)
    gen_device = generator.device if generator is not None else "cpu"
    buf = torch.randn((*lead_of(case), stride), generator=generator, device=gen_device,
                      dtype=torch.float32)
    # x3 reaches |x| ~ 10, where the cubic term dominates and the tanh saturates.
    buf = (3.0 * buf).to(device=device, dtype=torch_dtype(case["dtype"]))
    return (buf[..., :cols],)


def make_out(case: Case, inputs: tuple) -> torch.Tensor:
    x = inputs[0]
    return torch.empty((*lead_of(case), case["cols"]), dtype=x.dtype, device=x.device)


def edge_cases(case: Case) -> list[Case]:
    """Variations a candidate rendered for `case` must survive: the width is baked into it (the
    dispatcher only sends it that width), so edges vary what stays free at run time: one row, a
    prime row count, a strided (non-contiguous) input."""
    cases = [
        with_rows(case, 1, "1x1"),
        with_rows(case, 7, "1x7"),
        {**with_rows(case, 4, "2x2"), "row_stride": case["cols"] + 64},
    ]
    return distinct(case, cases)



def min_bytes(case: Case) -> int:
    """Read x once, write the output once."""
    return 2 * case["rows"] * case["cols"] * element_size(case)


def flops(case: Case) -> int:
    """Per element: the cubic (x*x*x, *0.044715, +x), the scale, tanh (counted as one), the
    1 + t, and the two multiplies by 0.5 and x."""
    return 9 * case["rows"] * case["cols"]

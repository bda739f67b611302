"""The gated MLP activation as Hugging Face computes it, and the case side of the family.

Three HF forms, one computation `act(gate) * up`:

- Llama/Qwen2/Mistral (`LlamaMLP`): `down_proj(act_fn(gate_proj(x)) * up_proj(x))`, act_fn
  SiLU: SwiGLU. Gate and up are two separate projection outputs (`layout="separate"`).
- Gemma (`GemmaMLP`): the same with `gelu_pytorch_tanh`: GeGLU.
- Phi-3 (`Phi3MLP`): one `gate_up_proj`, then `gate, up = chunk(2)`, `up * act(gate)`
  (`layout="packed"`: both halves of one row-major buffer).

In half precision HF rounds twice: the activation returns the storage dtype (computed in fp32
inside aten), then the multiply rounds again. The reference repeats that literally, so it is
bitwise identical to the modules (tests check it); a fused kernel rounds once and lands within
the dtype's tolerance of it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from codegen.dtypes import element_size, random_normal
from codegen.shapes import lead_of
from core.family import Case, distinct

ACTS = ("silu", "gelu_tanh")
LAYOUTS = ("separate", "packed")


def activation(x: torch.Tensor, act: str) -> torch.Tensor:
    if act == "silu":
        return F.silu(x)
    if act == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    raise ValueError(f"unknown gated activation {act!r}; known: {', '.join(ACTS)}")


def gated_act(*inputs: torch.Tensor, act: str = "silu") -> torch.Tensor:
    """(gate, up) for the separate layout, (gate_up,) for Phi-3's packed one."""
    if len(inputs) == 2:
        gate, up = inputs
        return activation(gate, act) * up
    (gate_up,) = inputs
    gate, up = gate_up.chunk(2, dim=-1)
    return up * activation(gate, act)


OPERANDS = ("halves", "separate")


def make_case(rows: int, cols: int, dtype: str, act: str, layout: str, *,
              lead: tuple[int, ...] | None = None, operands: str | None = None) -> Case:
    """`cols` is the intermediate size (the width of gate, of up and of the output).

    What the adapter hands the kernel, when given: `lead`, the leading shape of every tensor
    (the model passes (batch, seq, cols) views, not (rows, cols)); `operands` (separate layout),
    "halves" where gate and up are the two column halves of one fused (..., 2 * cols) product
    (row stride 2 * cols, up at storage offset cols) or "separate" where they are two tensors."""
    if act not in ACTS or layout not in LAYOUTS:
        raise ValueError(f"unsupported gated activation {act!r}/{layout!r}")
    case = {"rows": int(rows), "cols": int(cols), "dtype": dtype, "act": act, "layout": layout}
    if lead is not None:
        lead = [int(n) for n in lead]
        if _prod(lead) != case["rows"]:
            raise ValueError(f"leading shape {lead} does not hold {rows} rows")
        # a string: a case is hashed (dispatch) and goes through JSON, where a tuple would come
        # back a list
        case["lead"] = "x".join(map(str, lead))
    if operands is not None:
        if layout != "separate" or operands not in OPERANDS:
            raise ValueError(f"operands {operands!r} for the {layout} layout")
        case["operands"] = operands
    return case


def _prod(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def params(case: Case) -> dict:
    """The keyword params a candidate's forward and the reference take for `case`."""
    return {"act": case["act"]}




# Pre-activations of trained MLPs spread over a few units; x2 reaches both tails of silu/gelu.
SPREAD = 2.0


def make_inputs(case: Case, device="cpu", generator=None) -> tuple:
    """(gate, up) or (gate_up,), in the layout the adapter passes: shaped (*lead, width); for
    operands "halves" gate and up are the column halves of one (*lead, 2 * cols) buffer. A
    `row_stride` wider than that makes the buffer's rows wider still (a slice of a wider one)."""
    cols, dtype, lead = case["cols"], case["dtype"], lead_of(case)
    if case.get("operands") == "halves":
        buf = random_normal((*lead, case.get("row_stride", 2 * cols)), device, generator, dtype,
                            SPREAD)
        return buf[..., :cols], buf[..., cols:2 * cols]
    width = 2 * cols if case["layout"] == "packed" else cols
    stride = case.get("row_stride", width)
    n_inputs = 1 if case["layout"] == "packed" else 2
    return tuple(random_normal((*lead, stride), device, generator, dtype, SPREAD)[..., :width]
                 for _ in range(n_inputs))


def make_out(case: Case, inputs: tuple) -> torch.Tensor:
    """(*lead, cols), contiguous: what the adapter allocates."""
    x = inputs[0]
    return torch.empty((*lead_of(case), case["cols"]), dtype=x.dtype, device=x.device)


def edge_cases(case: Case) -> list[Case]:
    """Variations a candidate rendered for `case` must survive: the width is baked into it (the
    dispatcher only sends it that width), so edges vary what stays free at run time: one row, a
    prime row count, and inputs that are column slices of wider rows (non-contiguous)."""
    width = 2 * case["cols"] if case["layout"] == "packed" or \
        case.get("operands") == "halves" else case["cols"]

    def rows(n: int, lead: str) -> Case:
        return {**case, "rows": n, **({"lead": lead} if "lead" in case else {})}

    cases = [
        rows(1, "1x1"),
        rows(7, "1x7"),
        {**rows(4, "2x2"), "row_stride": width + 64},
    ]
    return distinct(case, cases)



def min_bytes(case: Case) -> int:
    """Read gate and up once, write the product once."""
    return 3 * case["rows"] * case["cols"] * element_size(case)


# Per output element: silu is exp, add, divide, multiply; the tanh GELU adds the cubic
# (3 multiplies, 1 add, 1 scale); both end with the multiply by up.
_FLOPS_PER_ELEMENT = {"silu": 5, "gelu_tanh": 10}


def flops(case: Case) -> int:
    return _FLOPS_PER_ELEMENT[case["act"]] * case["rows"] * case["cols"]

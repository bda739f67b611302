"""RMSNorm as Hugging Face computes it, and the case side of the family (inputs, sizes, costs).

Two forms exist in transformers and differ in the last few bits of every low-precision output:

- Llama/Qwen2/Mistral/Phi3 (`LlamaRMSNorm`): normalise in fp32, cast back to the input dtype,
  *then* multiply by `weight` in that dtype (`cast_first=True`, `offset=0.0`).
- Gemma/Gemma2/Gemma3 (`GemmaRMSNorm`): normalise in fp32, multiply by `1 + weight` in fp32,
  *then* cast (`cast_first=False`, `offset=1.0`); weights are stored around zero.

`rms_norm` repeats the HF op sequence literally, so on any device it is bitwise identical to the
module it stands for (tests check this against the real classes).
"""

from __future__ import annotations

import torch

from codegen.dtypes import element_size, torch_dtype
from core.family import Case

FORMS = {"llama": {"offset": 0.0, "cast_first": True},
         "gemma": {"offset": 1.0, "cast_first": False}}
PARAM_KEYS = ("eps", "offset", "cast_first")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, *, eps: float, offset: float = 0.0,
             cast_first: bool = True) -> torch.Tensor:
    input_dtype = x.dtype
    hidden = x.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + eps)
    if cast_first:
        scale = weight if offset == 0.0 else offset + weight
        return scale * hidden.to(input_dtype)
    scale = weight.float() if offset == 0.0 else offset + weight.float()
    return (hidden * scale).type_as(x)


def make_case(rows: int, hidden: int, dtype: str, form: str = "llama", eps: float = 1e-6
              ) -> Case:
    """One norm call over `rows` rows of `hidden`, in the Llama or the Gemma form."""
    return {"rows": int(rows), "hidden": int(hidden), "dtype": dtype, "eps": float(eps),
            **FORMS[form]}


def params(case: Case) -> dict:
    """The keyword params a candidate's forward and the reference take for `case`."""
    return {"eps": float(case["eps"]), "offset": float(case["offset"]),
            "cast_first": bool(case["cast_first"])}




def _randn(shape, generator, scale=1.0):
    device = generator.device if generator is not None else "cpu"
    return torch.randn(shape, generator=generator, device=device, dtype=torch.float32) * scale


def make_x(case: Case, device, generator) -> torch.Tensor:
    """The (rows, hidden) activation; `row_stride` > hidden makes it a strided view of a wider
    buffer, which is how a slice of a fused projection output reaches a norm."""
    rows, hidden = case["rows"], case["hidden"]
    stride = case.get("row_stride", hidden)
    buf = _randn((rows, stride), generator).to(device=device, dtype=torch_dtype(case["dtype"]))
    return buf[:, :hidden]


def make_weight(case: Case, device, generator) -> torch.Tensor:
    # Trained Llama weights sit around 1 and Gemma's around 0 (it adds the 1 itself).
    centre = 1.0 - case["offset"]
    w = centre + _randn((case["hidden"],), generator, scale=0.1)
    return w.to(device=device, dtype=torch_dtype(case["dtype"]))


def make_inputs(case: Case, device="cpu", generator=None) -> tuple:
    return make_x(case, device, generator), make_weight(case, device, generator)


def make_out(case: Case, inputs: tuple) -> torch.Tensor:
    x = inputs[0]
    return torch.empty((case["rows"], case["hidden"]), dtype=x.dtype, device=x.device)


def edge_cases(case: Case) -> list[Case]:
    """Row counts and layouts that a candidate rendered for `case` must also get right: one
    row (decode at batch 1); 13 rows, prime and one past a multiple of every rows-per-program
    choice, so the last program holds a single live row; rows strided inside a wider buffer.

    The width stays: a rendered candidate is specialised to its case's hidden size (a
    constexpr, so masks fold away for powers of two) and the patch only ever dispatches calls
    of that width to it. Widths that are prime or just over a power of two are cases of their
    own, each verified with its own candidate."""
    hidden = case["hidden"]
    cases = [{**case, "rows": 1}, {**case, "rows": 13},
             {**case, "rows": 6, "row_stride": hidden + 64}]
    return [c for c in cases if c != case]



def min_bytes(case: Case) -> int:
    """Read x and weight once, write the output once."""
    rows, hidden = case["rows"], case["hidden"]
    return element_size(case) * (2 * rows * hidden + hidden)


def flops(case: Case) -> int:
    """Square, sum, scale by rsqrt, scale by weight (and the +1 of the Gemma form)."""
    rows, hidden = case["rows"], case["hidden"]
    return 4 * rows * hidden + rows + (hidden if case["offset"] else 0)

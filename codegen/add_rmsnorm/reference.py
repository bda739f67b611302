"""Residual add + RMSNorm, as a pre-norm decoder layer computes it between attention and MLP:

    hidden_states = residual + hidden_states          # in the model dtype
    residual = hidden_states
    hidden_states = self.post_attention_layernorm(hidden_states)

Inputs (x, residual, weight): x is the attention output. out = (sum, normed). The norm reads
the sum rounded to the model dtype, exactly as the unfused code does. Case keys are those of
the RMSNorm family (rows, hidden, dtype, eps, offset, cast_first); params are its params plus
sum_dtype (the case's dtype).
"""

from __future__ import annotations

import torch

from codegen.rmsnorm import reference as rms
from core.family import Case

edge_cases = rms.edge_cases


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, *,
                 eps: float, offset: float = 0.0, cast_first: bool = True,
                 sum_dtype: str | None = None):
    """`sum_dtype` keeps the model's rounding of the sum to its dtype when the verifier runs
    this on float64 inputs; at the model's own dtype it is a no-op."""
    total = residual + x
    if sum_dtype is not None:
        total = total.to(rms.torch_dtype(sum_dtype)).to(total.dtype)
    return total, rms.rms_norm(total, weight, eps=eps, offset=offset, cast_first=cast_first)


def params(case: Case) -> dict:
    return {**rms.params(case), "sum_dtype": case["dtype"]}


def make_inputs(case: Case, device="cpu", generator=None) -> tuple:
    x, weight = rms.make_inputs(case, device, generator)
    residual = rms.make_x({**case, "row_stride": case["hidden"]}, device, generator)
    return x, residual, weight


def make_out(case: Case, inputs: tuple):
    x = inputs[0]
    shape = (case["rows"], case["hidden"])
    return (torch.empty(shape, dtype=x.dtype, device=x.device),
            torch.empty(shape, dtype=x.dtype, device=x.device))


def min_bytes(case: Case) -> int:
    """x and residual read once, weight once, sum and normed written once."""
    rows, hidden = case["rows"], case["hidden"]
    return rms.element_size(case) * (4 * rows * hidden + hidden)


def flops(case: Case) -> int:
    return rms.flops(case) + case["rows"] * case["hidden"]

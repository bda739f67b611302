"""The gated epilogue both of the family's kernels apply to their fp32 sums: the tile GEMMs
(kernel.py) and the decode GEMV (gemv.py)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _gated(acc_gate, acc_up, GELU_TANH: tl.constexpr):
    """act(gate) * up on the fp32 accumulators."""
    g = acc_gate
    if GELU_TANH:
        # 0.5 * (1 + tanh(z)) == sigmoid(2 z), as codegen.gated_act writes it: no libdevice tanh
        # (absent under the interpreter), no cancellation in 1 + tanh(z) for large negative z.
        # 1.5957691216057308 = 2 * sqrt(2 / pi).
        a = g * tl.sigmoid(1.5957691216057308 * (g + 0.044715 * g * g * g))
    else:
        a = g * tl.sigmoid(g)
    return a * acc_up

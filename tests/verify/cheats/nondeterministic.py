"""Cheat: every other call its result is one ulp off (well inside tolerance, but two runs on the
same inputs disagree, as with racy atomics)."""

import torch
from rmsnorm_triton import rms_norm_forward

_calls = 0
_INT = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def forward(x, weight, *, out, eps):
    global _calls
    rms_norm_forward(x, weight, out, eps)
    _calls += 1
    if _calls % 2:
        # One ulp up on finite values only: +1 on the GPU's canonical NaN (0x7fff...) is -0.
        as_int = out.view(_INT[out.element_size()])
        # (isfinite would run aten::mul, one of the ops the family forbids)
        finite = (out == out) & (out.abs() != float("inf"))  # noqa: PLR0124 - the NaN test
        as_int.add_(finite.to(as_int.dtype))

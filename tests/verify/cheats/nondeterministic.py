"""Cheat: every other call its result is one ulp off (well inside tolerance, but two runs on the
same inputs disagree, as with racy atomics)."""

import torch
import triton
import triton.language as tl
from rmsnorm_triton import rms_norm_forward

_calls = 0
_INT = {2: torch.int16, 4: torch.int32, 8: torch.int64}
_EXPONENT = {2: 0x7C00, 4: 0x7F800000}


@triton.jit
def _one_ulp_up(P, n, EXPONENT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    v = tl.load(P + offs, mask=mask)
    # finite values only: +1 on the GPU's canonical NaN (0x7fff...) is -0
    tl.store(P + offs, tl.where((v & EXPONENT) != EXPONENT, v + 1, v), mask=mask)


def forward(x, weight, *, out, eps):
    global _calls
    rms_norm_forward(x, weight, out, eps)
    _calls += 1
    if _calls % 2:
        flat = out.view(_INT[out.element_size()]).view(-1)
        _one_ulp_up[(triton.cdiv(flat.numel(), 256),)](
            flat, flat.numel(), EXPONENT=_EXPONENT[out.element_size()], BLOCK=256)

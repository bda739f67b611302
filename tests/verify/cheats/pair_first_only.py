"""Cheat (two-output family): writes the first output and forgets the second."""

import triton
import triton.language as tl


@triton.jit
def _scale_kernel(X, A, n, scale, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(A + offs, tl.load(X + offs, mask=mask) * scale, mask=mask)


def forward(x, *, out, scale, shift):
    n = x.numel()
    _scale_kernel[(triton.cdiv(n, 64),)](x, out[0], n, scale, BLOCK=64)

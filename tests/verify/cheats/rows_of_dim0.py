"""Cheat (gelu, class 5 of issue 27): right for (rows, cols) inputs at any row stride, which is
all the verifier built before its cases carried the adapter's layout; wrong for the
(batch, seq, cols) activation GPT-2's MLP hands the kernel, where it takes dim 0 for the rows
and stride(0) for the row stride, so it covers one row per sequence."""

import triton
import triton.language as tl


@triton.jit
def _gelu(X, OUT, n, x_row, out_row, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    m = cols < n
    x = tl.load(X + row * x_row + cols, mask=m, other=0.0).to(tl.float32)
    inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    y = 0.5 * x * (1.0 + (2.0 * tl.sigmoid(2.0 * inner) - 1.0))
    tl.store(OUT + row * out_row + cols, y.to(OUT.dtype.element_ty), mask=m)


def forward(x, *, out, **params):
    n = x.shape[-1]
    _gelu[(x.shape[0],)](x, out, n, x.stride(0), out.stride(0), BLOCK=triton.next_power_of_2(n))

"""Cheat: its store mask is `cols <= n_cols`, one element too many: the last row writes past
the end of `out` (earlier rows' extra element is overwritten by the next row)."""

import triton
import triton.language as tl


@triton.jit
def _kernel(X, W, Y, stride_x, stride_y, n_cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    y = (x * rstd).to(Y.dtype.element_ty).to(tl.float32) * w
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=cols <= n_cols)


def forward(x, weight, *, out, eps):
    rows, n_cols = x.shape
    _kernel[(rows,)](x, weight, out, x.stride(0), out.stride(0), n_cols, eps,
                     BLOCK=triton.next_power_of_2(n_cols + 1))

"""Cheat (rmsnorm, GPU): sums the squares of a row in bf16, 16 partial sums of 1/16 of the row
each, instead of in fp32. Over a long row the partial sums grow until each new term is a fraction
of their spacing, so the variance comes out low. A GPU test: the interpreter's bf16 arithmetic is
not the GPU's (it truncates casts, and its bf16 tensors are not numpy floats)."""

import triton
import triton.language as tl


@triton.jit
def _kernel(X, W, Y, x_stride, y_stride, n, eps, OFFSET: tl.constexpr, LANES: tl.constexpr,
            STEPS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    lanes = tl.arange(0, LANES)
    acc = tl.zeros([LANES], dtype=tl.bfloat16)
    for step in range(STEPS):
        c = step * LANES + lanes
        x = tl.load(X + row * x_stride + c, mask=c < n, other=0.0).to(tl.bfloat16)
        acc = (acc + x * x).to(tl.bfloat16)
    rstd = tl.math.rsqrt(tl.sum(acc.to(tl.float32), axis=0) / n + eps)
    cols = tl.arange(0, BLOCK)
    m = cols < n
    x = tl.load(X + row * x_stride + cols, mask=m, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=m, other=0.0).to(tl.float32) + OFFSET
    y = (x * rstd).to(Y.dtype.element_ty).to(tl.float32) * w
    tl.store(Y + row * y_stride + cols, y.to(Y.dtype.element_ty), mask=m)


def forward(x, weight, *, out, eps, offset, cast_first):
    rows, n = x.shape
    lanes = 16
    _kernel[(rows,)](x, weight, out, x.stride(0), out.stride(0), n, eps, OFFSET=offset,
                     LANES=lanes, STEPS=triton.cdiv(n, lanes), BLOCK=triton.next_power_of_2(n))

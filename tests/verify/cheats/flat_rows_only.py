"""Cheat (rmsnorm, gated_act): right for (rows, width) inputs with rows one row width apart, the
layout of a plain 2-D test tensor; wrong for what the adapters pass (gated_act: (batch, seq,
cols) column halves of one fused product, rows 2 * cols apart; rmsnorm: rows strided inside a
wider buffer)."""

import triton
import triton.language as tl


@triton.jit
def _rms(X, W, Y, n, eps, OFFSET: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    m = cols < n
    x = tl.load(X + row * n + cols, mask=m, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=m, other=0.0).to(tl.float32) + OFFSET
    y = (x * tl.math.rsqrt(tl.sum(x * x, axis=0) / n + eps)).to(Y.dtype.element_ty)
    tl.store(Y + row * n + cols, (y.to(tl.float32) * w).to(Y.dtype.element_ty), mask=m)


@triton.jit
def _silu_mul(G, U, OUT, n, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    m = cols < n
    g = tl.load(G + row * n + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(U + row * n + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(OUT + row * n + cols, (g * tl.sigmoid(g) * u).to(OUT.dtype.element_ty), mask=m)


def forward(*inputs, out, **params):
    n = out.shape[-1]
    rows = out.numel() // n
    if "eps" in params:
        x, w = inputs
        _rms[(rows,)](x, w, out, n, params["eps"], OFFSET=params["offset"],
                      BLOCK=triton.next_power_of_2(n))
    else:
        gate, up = inputs
        _silu_mul[(rows,)](gate, up, out, n, BLOCK=triton.next_power_of_2(n))

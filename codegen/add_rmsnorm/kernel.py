"""Triton residual add + RMSNorm: reads x and residual once, writes the sum and the norm.

Unfused, the model writes the sum, then the norm reads it back: fusing saves one full read of
the activation and a launch. Launch shapes and the fp32-only arithmetic are those of the
RMSNorm kernel (see codegen/rmsnorm/kernel.py).
"""

from __future__ import annotations

import triton
import triton.language as tl

from codegen.add_rmsnorm.reference import params
from codegen.rmsnorm.kernel import (
    block_for,
    params_check_source,
    render_header,
    row_search_space,
)
from core.family import Case
from core.source import kernel_source


@triton.jit
def _add_rms_norm_forward_kernel(X, R, W, S, Y, n_rows, x_row_stride, r_row_stride,
                                 s_row_stride, y_row_stride, eps, HIDDEN: tl.constexpr,
                                 BLOCK: tl.constexpr, ROWS: tl.constexpr,
                                 OFFSET: tl.constexpr, CAST_FIRST: tl.constexpr,
                                 PDL: tl.constexpr = False):
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    col_ok = cols < HIDDEN
    mask = (rows < n_rows)[:, None] & col_ok[None, :]
    if PDL:  # codegen/pdl.py: the weight is no kernel's output; the rows are the step's
        scale = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32) + OFFSET
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    x = tl.load(X + rows[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0)
    r = tl.load(R + rows[:, None] * r_row_stride + cols[None, :], mask=mask, other=0.0)
    # The model rounds the sum to its dtype and the norm reads that; so do we.
    total = (x.to(tl.float32) + r.to(tl.float32)).to(S.dtype.element_ty)
    tl.store(S + rows[:, None] * s_row_stride + cols[None, :], total, mask=mask)
    h = total.to(tl.float32)
    if not PDL:  # where it always was: with PDL off the kernel compiles as before
        scale = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32) + OFFSET
    variance = tl.sum(h * h, axis=1) / HIDDEN
    normed = h * tl.math.rsqrt(variance + eps)[:, None]
    if CAST_FIRST:
        normed = normed.to(Y.dtype.element_ty).to(tl.float32)
    y = normed * scale[None, :]
    tl.store(Y + rows[:, None] * y_row_stride + cols[None, :], y.to(Y.dtype.element_ty),
             mask=mask)


def search_space(case: Case) -> list[dict]:
    return row_search_space(case["rows"], case["hidden"])


def add_rms_norm_forward(x, residual, weight, *, out, eps: float, offset: float = 0.0,
                         cast_first: bool = True, rows_per_program: int = 1,
                         num_warps: int = 4) -> None:
    """Host wrapper: out = (sum, normed); all (rows, hidden) with unit column stride."""
    total, normed = out
    rows, hidden = x.shape
    grid = (triton.cdiv(rows, rows_per_program),)
    _add_rms_norm_forward_kernel[grid](
        x, residual, weight.contiguous(), total, normed, rows, x.stride(0), residual.stride(0),
        total.stride(0), normed.stride(0), eps, HIDDEN=hidden, BLOCK=block_for(hidden),
        ROWS=rows_per_program, OFFSET=float(offset), CAST_FIRST=bool(cast_first),
        num_warps=num_warps)


_FORWARD = '''\
def forward(x, residual, weight, *, out, **params):
    """x, residual: (rows, HIDDEN); weight: (HIDDEN,). out = (sum, normed) with
    sum = residual + x and normed = RMSNorm(sum), both written by one kernel."""
    _check_params(params)
    total, normed = out
    shape = x.shape  # one Size compared by value: cheaper per call than a check per tensor
    if len(shape) != 2 or shape[1] != HIDDEN or not (
            residual.shape == total.shape == normed.shape == shape):
        raise ValueError(f"expected (rows, {HIDDEN}) tensors, got "
                         f"{[tuple(t.shape) for t in (x, residual, total, normed)]}")
    if total.stride(1) != 1 or normed.stride(1) != 1:
        raise ValueError("outputs must have unit column stride")
    x = x if x.stride(1) == 1 else x.contiguous()
    residual = residual if residual.stride(1) == 1 else residual.contiguous()
    n_rows = x.shape[0]
    grid = (cdiv(n_rows, ROWS_PER_PROGRAM),)
    _launch(grid, x, residual, weight.contiguous(), total, normed, n_rows, x.stride(0),
            residual.stride(0), total.stride(0), normed.stride(0), EPS)


_launch = launcher(_add_rms_norm_forward_kernel, HIDDEN=HIDDEN, BLOCK=BLOCK,
                   ROWS=ROWS_PER_PROGRAM, OFFSET=OFFSET, CAST_FIRST=CAST_FIRST,
                   num_warps=NUM_WARPS)
'''


def render(config: dict, case: Case) -> str:
    baked = params(case)
    header = render_header("Residual add + RMSNorm", config, case)
    return "\n".join([header, params_check_source(baked), "",
                      kernel_source(_add_rms_norm_forward_kernel), "", _FORWARD])

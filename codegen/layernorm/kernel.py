"""Triton LayerNorm (optionally with the residual add before it): whole rows in registers.

Same launch shape as the RMSNorm kernel ([ROWS, BLOCK] tile per program, fp32 arithmetic on
explicitly converted loads). Mean and variance come from passes over the registers rather than
Welford: the row is already resident, so extra passes cost no memory traffic.
"""

from __future__ import annotations

import textwrap

import triton
import triton.language as tl

from codegen.layernorm.reference import params
from codegen.rmsnorm.kernel import (
    block_for,
    launch_summary,
    params_check_source,
    row_search_space,
)
from core.family import Case
from core.source import kernel_source


@triton.jit
def _layer_norm_forward_kernel(X, R, W, B, S, Y, n_rows, x_row_stride, r_row_stride,
                               s_row_stride, y_row_stride, eps, HIDDEN: tl.constexpr,
                               BLOCK: tl.constexpr, ROWS: tl.constexpr,
                               HAS_RESIDUAL: tl.constexpr):
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    row_ok = rows < n_rows
    cols = tl.arange(0, BLOCK)
    col_ok = cols < HIDDEN
    mask = row_ok[:, None] & col_ok[None, :]
    x = tl.load(X + rows[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    # Each row's first element (a reload that hits L1), the shift of the mean below.
    first = tl.load(X + rows * x_row_stride, mask=row_ok, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(R + rows[:, None] * r_row_stride + cols[None, :], mask=mask, other=0.0)
        # The model rounds the sum to its dtype before the norm reads it; so do we.
        total = (x + r.to(tl.float32)).to(S.dtype.element_ty)
        tl.store(S + rows[:, None] * s_row_stride + cols[None, :], total, mask=mask)
        x = total.to(tl.float32)
        r_first = tl.load(R + rows * r_row_stride, mask=row_ok, other=0.0).to(tl.float32)
        first = (first + r_first).to(S.dtype.element_ty).to(tl.float32)
    # Rows whose magnitude passes 1 are divided by a power of two (exact) near their largest
    # |x|: squares of values past ~1e19 overflow fp32, where torch's CUDA kernels stay
    # finite. The norm is scale-free except for eps, which is scaled alike; the floor on it
    # keeps rstd finite when a huge all-equal row centres to exact zeros.
    row_max = tl.max(tl.abs(x), axis=1)
    exponent_bits = row_max.to(tl.int32, bitcast=True) & 0x7F800000
    scale = tl.where(row_max > 1.0, exponent_bits.to(tl.float32, bitcast=True), 1.0)
    x = x / scale[:, None]
    eps_scaled = tl.maximum(eps / scale / scale, 1.1754944e-38)
    # Shifting by the first element before the mean makes a row of equal values centre to
    # exact zeros (output == bias, as torch gives) instead of rounding noise that rstd (up to
    # 1/sqrt(eps)) amplifies, and rows with |mean| >> std lose less to cancellation.
    shifted = tl.where(mask, x - (first / scale)[:, None], 0.0)
    mean = tl.sum(shifted, axis=1) / HIDDEN
    centred = tl.where(mask, shifted - mean[:, None], 0.0)
    variance = tl.sum(centred * centred, axis=1) / HIDDEN
    rstd = tl.math.rsqrt(variance + eps_scaled)
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    b = tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)
    y = centred * rstd[:, None] * w[None, :] + b[None, :]
    tl.store(Y + rows[:, None] * y_row_stride + cols[None, :], y.to(Y.dtype.element_ty),
             mask=mask)


def search_space(case: Case) -> list[dict]:
    return row_search_space(case["rows"], case["hidden"])


def layer_norm_forward(*inputs, out, eps: float, rows_per_program: int = 1,
                       num_warps: int = 4) -> None:
    """Host wrapper. (x, weight, bias), out=normed; or (x, residual, weight, bias),
    out=(sum, normed). All (rows, hidden) tensors need unit column stride."""
    if len(inputs) == 4:
        x, residual, weight, bias = inputs
        total, normed = out
    else:
        x, weight, bias = inputs
        residual, total, normed = x, out, out  # unread and unwritten without HAS_RESIDUAL
    rows, hidden = x.shape
    grid = (triton.cdiv(rows, rows_per_program),)
    _layer_norm_forward_kernel[grid](
        x, residual, weight.contiguous(), bias.contiguous(), total, normed, rows, x.stride(0),
        residual.stride(0), total.stride(0), normed.stride(0), eps, HIDDEN=hidden,
        BLOCK=block_for(hidden), ROWS=rows_per_program, HAS_RESIDUAL=len(inputs) == 4,
        num_warps=num_warps)


_FORWARD_PLAIN = '''\
def forward(x, weight, bias, *, out, **params):
    """x, out: (rows, HIDDEN); weight, bias: (HIDDEN,). Writes LayerNorm(x) into out."""
    _check_params(params)
    _check_shapes((x,), (out,))
    x = x if x.stride(1) == 1 else x.contiguous()
    _launch(x, x, weight, bias, out, out)
'''

_FORWARD_RESIDUAL = '''\
def forward(x, residual, weight, bias, *, out, **params):
    """x, residual: (rows, HIDDEN). out = (sum, normed): sum = x + residual, normed =
    LayerNorm(sum), both written by one kernel."""
    _check_params(params)
    total, normed = out
    _check_shapes((x, residual), (total, normed))
    x = x if x.stride(1) == 1 else x.contiguous()
    residual = residual if residual.stride(1) == 1 else residual.contiguous()
    _launch(x, residual, weight, bias, total, normed)
'''

_HELPERS = '''\
def _check_shapes(inputs, outputs):
    tensors = inputs + outputs
    for t in tensors:
        if t.dim() != 2 or t.shape[1] != HIDDEN or t.shape[0] != tensors[0].shape[0]:
            raise ValueError(f"expected (rows, {HIDDEN}) tensors, got "
                             f"{[tuple(u.shape) for u in tensors]}")
    if any(t.stride(1) != 1 for t in outputs):
        raise ValueError("outputs must have unit column stride")


def _launch(x, residual, weight, bias, total, normed):
    n_rows = x.shape[0]
    _kernel((cdiv(n_rows, ROWS_PER_PROGRAM),), x, residual, weight.contiguous(),
            bias.contiguous(), total, normed, n_rows, x.stride(0), residual.stride(0),
            total.stride(0), normed.stride(0), EPS)


_kernel = launcher(_layer_norm_forward_kernel, HIDDEN=HIDDEN, BLOCK=BLOCK,
                   ROWS=ROWS_PER_PROGRAM, HAS_RESIDUAL=HAS_RESIDUAL, num_warps=NUM_WARPS)
'''


def render(config: dict, case: Case) -> str:
    hidden, eps = case["hidden"], float(case["eps"])
    baked = params(case)
    fused = bool(case.get("residual"))
    what = "Residual add + LayerNorm" if fused else "LayerNorm"
    header = textwrap.dedent(f'''\
        """{what} candidate (weight and bias, as nn.LayerNorm).

        Specialised for hidden={hidden}, dtype={case["dtype"]}, eps={eps!r}.
        Tuned for {case["rows"]} rows: {launch_summary(config, hidden)}.
        """

        import triton
        import triton.language as tl

        from codegen.launch import cdiv, launcher

        HIDDEN = {hidden}
        BLOCK = {block_for(hidden)}
        ROWS_PER_PROGRAM = {config["rows_per_program"]}
        NUM_WARPS = {config["num_warps"]}
        EPS = {eps!r}
        HAS_RESIDUAL = {fused}
        ''')
    return "\n".join([header, params_check_source(baked), "",
                      kernel_source(_layer_norm_forward_kernel), "", _HELPERS, "",
                      _FORWARD_RESIDUAL if fused else _FORWARD_PLAIN])

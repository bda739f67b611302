"""The RMSNorm prologue the norm-fused decode GEMVs share (codegen/norm_qkv, codegen/
norm_gate_up): each program sums the squares of x's rows itself, then normalises each slice of
x it multiplies, with HF's roundings, so no launch waits on a norm's output.

`_row_total`: the norm's input as HF forms it, x or, where a residual add comes first (a
decoder layer's `residual + hidden_states`), their sum rounded once to the dtype, as torch's
add of two 16-bit tensors rounds. `_row_rstd`: 1 / sqrt(mean(total^2) + eps) of one row, fp32
(the squares summed in another order than torch's mean: an ulp of fp32 at most). `_normed`:
codegen.rmsnorm.reference's two forms on one slice. `_rows_rstd` and `_normed_rows`: the same
on a (rows, BLOCK_K) tile at once, for a tensor-core dot's padded rows (DOT: zeros past the
last row).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _row_total(x_ptrs, r_ptrs, mask, HAS_RESIDUAL: tl.constexpr):
    """x's slice, plus the residual's where there is one, rounded to x's dtype."""
    x = tl.load(x_ptrs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(r_ptrs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
    return x


@triton.jit
def _row_rstd(x_ptr, r_ptr, x_sk, eps, K: tl.constexpr, BLOCK_K: tl.constexpr,
              HAS_RESIDUAL: tl.constexpr):
    """1 / sqrt(mean(t^2) + eps) of one row t of K elements (x at x_ptr, stride x_sk, plus the
    contiguous residual row at r_ptr where there is one), in fp32."""
    squares = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        t = _row_total(x_ptr + offs_k * x_sk, r_ptr + offs_k, offs_k < K,
                       HAS_RESIDUAL).to(tl.float32)
        squares += t * t
    return tl.math.rsqrt(tl.sum(squares, axis=0) / K + eps)


@triton.jit
def _normed(x, nw, rstd, OFFSET: tl.constexpr, CAST_FIRST: tl.constexpr):
    """HF's RMSNorm of x's slice given its row's rstd, in x's dtype (codegen.rmsnorm.reference:
    Llama's form casts x * rstd first and multiplies by (offset +) weight in the dtype;
    Gemma's multiplies in fp32 and casts once)."""
    h = x.to(tl.float32) * rstd
    if CAST_FIRST:
        scale = (nw.to(tl.float32) + OFFSET).to(x.dtype).to(tl.float32)
        out = (scale * h.to(x.dtype).to(tl.float32)).to(x.dtype)
    else:
        out = (h * (nw.to(tl.float32) + OFFSET)).to(x.dtype)
    return out


@triton.jit
def _rows_rstd(x_rows, r_rows, m_ok, x_sk, eps, K: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_K: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """_row_rstd of BLOCK_M rows at once (x's rows start at the pointers x_rows, the residual's
    at r_rows), each row's squares summed along k as _row_rstd sums them; rows where m_ok is
    False read as zeros: 1 / sqrt(eps), finite, for rows nobody stores."""
    squares = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        t = _row_total(x_rows[:, None] + offs_k[None, :] * x_sk, r_rows[:, None] + offs_k[None, :],
                       m_ok[:, None] & (offs_k < K)[None, :], HAS_RESIDUAL).to(tl.float32)
        squares += t * t
    return tl.math.rsqrt(tl.sum(squares, axis=1) / K + eps)


@triton.jit
def _normed_rows(x_rows, r_rows, n_rows, t_rows, offs_k, mask, mine, x_sk, nw, rstd,
                 HAS_RESIDUAL: tl.constexpr, OFFSET: tl.constexpr, CAST_FIRST: tl.constexpr):
    """The (BLOCK_M, BLOCK_K) tile of the rows' normed totals at columns offs_k (zeros where
    `mask` is False: a dot's padding rows), each row by its rstd; stored where `mine` (the
    normed at the rows n_rows, the total at t_rows where there is a residual)."""
    t = _row_total(x_rows[:, None] + offs_k[None, :] * x_sk, r_rows[:, None] + offs_k[None, :],
                   mask, HAS_RESIDUAL)
    xn = _normed(t, nw[None, :], rstd[:, None], OFFSET, CAST_FIRST)
    tl.store(n_rows[:, None] + offs_k[None, :], xn, mask=mine)
    if HAS_RESIDUAL:
        tl.store(t_rows[:, None] + offs_k[None, :], t, mask=mine)
    return xn


def sources() -> list[str]:
    """The helpers' source, for a rendered candidate."""
    from core.source import kernel_source

    return [kernel_source(f) for f in (_row_total, _row_rstd, _normed, _rows_rstd,
                                       _normed_rows)]

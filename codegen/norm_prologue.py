"""The RMSNorm prologue the norm-fused decode GEMVs share (codegen/norm_qkv, codegen/
norm_gate_up): each program sums the squares of x's rows itself, then normalises each slice of
x it multiplies, with HF's roundings, so no launch waits on a norm's output.

`_row_total`: the norm's input as HF forms it, x or, where a residual add comes first (a
decoder layer's `residual + hidden_states`), their sum rounded once to the dtype, as torch's
add of two 16-bit tensors rounds. `_row_rstd`: 1 / sqrt(mean(total^2) + eps) of one row, fp32
(the squares summed in another order than torch's mean: an ulp of fp32 at most). `_normed`:
codegen.rmsnorm.reference's two forms on one slice.
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


def sources() -> list[str]:
    """The helpers' source, for a rendered candidate."""
    from core.source import kernel_source

    return [kernel_source(f) for f in (_row_total, _row_rstd, _normed)]

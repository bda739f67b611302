"""The Triton RMSNorm kernel the test candidates and cheats build on.

Computes in float32 and rounds where Hugging Face's RMSNorm rounds (normalised x to the input
dtype, then times the weight), so it matches the baseline bit for bit in fp32/fp16. `perturb`
adds k * (atol + rtol * |y|) before the final rounding: candidates at the tolerance edge.
"""

import triton
import triton.language as tl


@triton.jit
def _rms_norm_forward_kernel(X, W, Y, stride_x, stride_y, n_cols, eps, k, atol, rtol,
                             BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    y = (x * rstd).to(Y.dtype.element_ty).to(tl.float32) * w
    y = y + k * (atol + rtol * tl.abs(y))
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)


def rms_norm_forward(x, weight, out, eps, block=None, perturb=(0.0, 0.0, 0.0)):
    rows, n_cols = x.shape
    block = block or triton.next_power_of_2(n_cols)
    _rms_norm_forward_kernel[(rows,)](x, weight, out, x.stride(0), out.stride(0), n_cols, eps,
                                      *perturb, BLOCK=block)

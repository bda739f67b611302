"""Cheat: launches programs for the first half of the rows only."""

import triton
from rmsnorm_triton import _rms_norm_forward_kernel


def forward(x, weight, *, out, eps):
    rows, n_cols = x.shape
    _rms_norm_forward_kernel[(rows // 2,)](x, weight, out, x.stride(0), out.stride(0), n_cols,
                                           eps, 0.0, 0.0, 0.0,
                                           BLOCK=triton.next_power_of_2(n_cols))

"""Cheat: its Triton kernel does not compile (an undefined language function)."""

import triton
import triton.language as tl


@triton.jit
def _kernel(X, Y, n_cols, BLOCK: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    tl.store(Y + cols, tl.no_such_function(tl.load(X + cols, mask=cols < n_cols)),
             mask=cols < n_cols)


def forward(x, weight, *, out, eps):
    _kernel[(1,)](x, out, x.shape[-1], BLOCK=triton.next_power_of_2(x.shape[-1]))

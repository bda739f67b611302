"""Cheat (rmsnorm, gated_act): NaN and Inf propagate only in the rows a fixed-position check
looks at (0, rows // 3, 2 * rows // 3); elsewhere they become 0."""

from cheat_kernels import honest, zero_nonfinite_off_fixed_rows


def forward(*inputs, out, **params):
    honest(*inputs, out=out, **params)
    zero_nonfinite_off_fixed_rows(out)

"""An L2 prefetch of a program's weight slab, for the weight-streaming decode kernels' PDL path
(codegen/pdl.py says when and why: the slab lands in L2 while the predecessor finishes).

`_prefetch_slab` issues one `prefetch.global.L2` per 128-byte line of the rows it is given,
predicated off for lines outside the weight, through `tl.inline_asm_elementwise` (not pure:
nothing uses its dummy result, and the compiler must keep it). The lines go out 256 at a time,
two per thread of the decode kernels' 4 warps, so a slab of any size costs a loop of a few
steps and a few registers, not a tensor of every line's address. Rows are taken as contiguous
along k (an nn.Linear weight); another column stride still prefetches a line per 128 bytes of
k, a part of what the program reads. Never run under the interpreter: the PREFETCH constexpr
that calls it is bound only with PDL, which the interpreter never runs (codegen/launch.py).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _prefetch_slab(w_ptr, n0, n, w_sn, w_sk, lo, hi, ROWS: tl.constexpr, SPAN: tl.constexpr):
    """Ask L2 for rows n0 .. n0 + ROWS - 1 (those under n) of the weight at w_ptr (strides
    w_sn, w_sk), columns lo .. hi - 1, at most SPAN of them (a constexpr bound)."""
    step = 1024 // w_ptr.dtype.element_ty.primitive_bitwidth  # elements per 128-byte line
    per_row = (SPAN + step - 1) // step
    for l0 in range(0, ROWS * per_row, 256):
        line = l0 + tl.arange(0, 256)
        row = n0 + line // per_row
        col = lo + (line % per_row) * step
        ok = (line < ROWS * per_row) & (row < n) & (col < hi)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $1, 0; @p prefetch.global.L2 [$2]; mov.b32 $0, 0; }",
            "=r,r,l", [ok.to(tl.int32), w_ptr + row.to(tl.int64) * w_sn + col * w_sk],
            dtype=tl.int32, is_pure=False, pack=1)

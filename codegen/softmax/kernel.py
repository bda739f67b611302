"""Triton row softmax: one program per row, in registers when the row fits, online otherwise.

SINGLE (BLOCK covers the row): one read, one write, the minimum traffic. Looped (rows wider
than BLOCK): a first pass keeps a running max and a running sum per lane (the online softmax
recurrence), a second pass re-reads and writes; two reads instead of the three of a
max-then-sum-then-write kernel.

Inputs are first rounded to the output dtype, because torch.softmax(x, dtype=d) casts x to d
before normalising; arithmetic then runs in fp32 and is rounded once before the store (this
also keeps the kernel exact under Triton's CPU interpreter, which gets bf16 arithmetic wrong).
NaN and infinities propagate as torch's do: an all -inf row and a row with +inf come out NaN.
"""

from __future__ import annotations

import json
import textwrap

import triton
import triton.language as tl

from core.family import Case
from core.source import kernel_source

MAX_SINGLE = 16384  # widest row held whole in registers (16 warps x 32 lanes x 32 values)
LOOP_BLOCKS = (1024, 4096)
WARPS = (1, 2, 4, 8, 16)


@triton.jit
def _softmax_forward_kernel(x_ptr, out_ptr, x_row_stride, out_row_stride,
                            COLS: tl.constexpr, BLOCK: tl.constexpr, SINGLE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    out_row = out_ptr + row * out_row_stride
    out_ty = out_ptr.dtype.element_ty
    lanes = tl.arange(0, BLOCK)
    if SINGLE:
        mask = lanes < COLS
        x = tl.load(x_row + lanes, mask=mask, other=float("-inf")).to(out_ty).to(tl.float32)
        e = tl.exp(x - tl.max(x, axis=0))
        tl.store(out_row + lanes, (e / tl.sum(e, axis=0)).to(out_ty), mask=mask)
    else:
        # The most negative fp32 rather than -inf: a lane that only ever sees -inf (the masked
        # tail, -inf scores) then keeps d = 0 with no NaN from -inf - -inf; an all -inf row
        # still ends as 0 / 0 = NaN, as torch's does.
        m = tl.full([BLOCK], -3.4028234663852886e38, tl.float32)
        d = tl.zeros([BLOCK], tl.float32)
        for start in range(0, COLS, BLOCK):
            cols = start + lanes
            x = tl.load(x_row + cols, mask=cols < COLS, other=float("-inf"))
            x = x.to(out_ty).to(tl.float32)
            m_new = tl.maximum(m, x)
            d = d * tl.exp(m - m_new) + tl.exp(x - m_new)
            m = m_new
        row_max = tl.max(m, axis=0)
        total = tl.sum(d * tl.exp(m - row_max), axis=0)
        for start in range(0, COLS, BLOCK):
            cols = start + lanes
            mask = cols < COLS
            x = tl.load(x_row + cols, mask=mask, other=float("-inf"))
            x = x.to(out_ty).to(tl.float32)
            tl.store(out_row + cols, (tl.exp(x - row_max) / total).to(out_ty), mask=mask)


def search_space(case: Case) -> list[dict]:
    """The whole row in one tile when it fits (warps giving each thread 4 to 32 values), and
    looped blocks narrower than the row."""
    whole = triton.next_power_of_2(case["cols"])
    configs = []
    if whole <= MAX_SINGLE:
        fits = [w for w in WARPS if 4 <= whole / (32 * w) <= 32]
        configs += [{"BLOCK": whole, "num_warps": w} for w in fits or [WARPS[0]]]
    for block in LOOP_BLOCKS:
        if block < whole:
            configs += [{"BLOCK": block, "num_warps": w} for w in (4, 8)]
    return configs[:12]


def softmax_forward(x, *, out, BLOCK: int | None = None, num_warps: int = 4) -> None:
    """Host wrapper: x (rows, cols) with unit column stride; out (rows, cols), any dtype."""
    cols = x.shape[-1]
    block = BLOCK or triton.next_power_of_2(cols)
    _softmax_forward_kernel[(x.shape[0],)](x, out, x.stride(0), out.stride(0), COLS=cols,
                                           BLOCK=block, SINGLE=block >= cols,
                                           num_warps=num_warps)



_FORWARD = '''\
def _check_params(params):
    if params and params != BAKED_PARAMS:
        raise ValueError(f"specialised for {BAKED_PARAMS}, called with {params}")


def forward(x, *, out, **params) -> None:
    """x: (..., COLS); out: x's shape in OUT_DTYPE. Writes softmax(x, dim=-1) into out."""
    _check_params(params)
    if x.shape[-1] != COLS or x.shape != out.shape or out.dtype != OUT_DTYPE:
        raise ValueError(f"expected x (..., {COLS}) and out of its shape in {OUT_DTYPE}, "
                         f"got {tuple(x.shape)} and {tuple(out.shape)} {out.dtype}")
    # The kernel walks each row with unit stride; reshape copies only when it must.
    x = x.reshape(-1, COLS)
    if x.stride(1) != 1:
        x = x.contiguous()
    out = out.view(-1, COLS)
    _softmax_forward_kernel[(x.shape[0],)](x, out, x.stride(0), out.stride(0), COLS=COLS,
                                           BLOCK=BLOCK, SINGLE=SINGLE, num_warps=NUM_WARPS)
'''


def render(config: dict, case: Case) -> str:
    cols, block, warps = case["cols"], config["BLOCK"], config["num_warps"]
    single = block >= cols
    how = (f"the whole row in one {block}-wide tile" if single else
           f"online max/sum over {block}-wide blocks, then a second pass")
    header = textwrap.dedent(f'''\
        """Row softmax candidate: out = softmax(x, dim=-1) in {case["out_dtype"]}.

        Generated by codegen.softmax.kernel.render. Computes in fp32 (after rounding x to the
        output dtype, as torch does), rounds once. Specialised for cols={cols}; tuned for
        {case["rows"]} rows of {case["dtype"]}. Launch: one program per row, {how},
        {warps} warps.
        case:   {json.dumps(case)}
        config: {json.dumps(config)}
        """

        import torch
        import triton
        import triton.language as tl

        COLS = {cols}
        BLOCK = {block}
        SINGLE = {single}
        NUM_WARPS = {warps}
        OUT_DTYPE = torch.{case["out_dtype"]}
        BAKED_PARAMS = {{"out_dtype": {case["out_dtype"]!r}}}
        ''')
    return "\n\n".join([header, kernel_source(_softmax_forward_kernel), _FORWARD])

"""Triton gated activation: out = act(gate) * up in one pass over memory.

HF runs two kernels (the activation, then the multiply) and writes the activation to memory
in between; the fused kernel reads gate and up once and writes the product once (3 tensors of
traffic instead of 5). Grid: (row, column block); rows go on axis 0 because CUDA caps axis 1 at
65535 and a prefill of 8 x 8192 tokens has 65536 rows.

Phi-3's packed gate_up buffer needs no copy: gate and up are passed as the two column halves
of the same rows, each with the packed row stride.

All arithmetic runs in fp32 on values converted right after the load and rounded once before
the store; this also keeps the kernel exact under Triton's CPU interpreter (it gets arithmetic
on bf16 values wrong).
"""

from __future__ import annotations

import json
import textwrap

import triton
import triton.language as tl

from core.family import Case
from core.source import kernel_source

BLOCKS = (256, 512, 1024, 2048)
WARPS = (2, 4, 8)
FLAT_BLOCKS = (1024, 2048, 4096)


@triton.jit
def _gated_act_forward_kernel(gate_ptr, up_ptr, out_ptr, n_rows,
                              gate_row_stride, gate_col_stride, up_row_stride, up_col_stride,
                              out_row_stride, out_col_stride,
                              COLS: tl.constexpr, GELU_TANH: tl.constexpr, BLOCK: tl.constexpr,
                              FLAT: tl.constexpr):
    if FLAT:
        # One flat index over rows x COLS: no masked tail per row when BLOCK does not divide
        # the width (Qwen2.5's 4864 = 2 x 2048 + 768 leaves 62 % of every third block idle).
        flat = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        row = flat // COLS
        cols = flat % COLS
        mask = row < n_rows
    else:
        # int64: row * stride passes 2**31 at 65536 tokens of a 16384-wide packed gate_up.
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < COLS
    g = tl.load(gate_ptr + row * gate_row_stride + cols * gate_col_stride, mask=mask, other=0.0)
    u = tl.load(up_ptr + row * up_row_stride + cols * up_col_stride, mask=mask, other=0.0)
    g = g.to(tl.float32)
    u = u.to(tl.float32)
    if GELU_TANH:
        # 0.5 * (1 + tanh(z)) == sigmoid(2 z): no libdevice tanh (absent under the
        # interpreter) and no cancellation in 1 + tanh(z) for large negative z.
        # 1.5957691216057308 = 2 * sqrt(2 / pi).
        a = g * tl.sigmoid(1.5957691216057308 * (g + 0.044715 * g * g * g))
    else:
        a = g * tl.sigmoid(g)
    tl.store(out_ptr + row * out_row_stride + cols * out_col_stride,
             (a * u).to(out_ptr.dtype.element_ty), mask=mask)


def grid(rows: int, cols: int, block: int, flat: bool) -> tuple[int, ...]:
    return (triton.cdiv(rows * cols, block),) if flat else (rows, triton.cdiv(cols, block))


def search_space(case: Case) -> list[dict]:
    """Per-row column blocks up to the first power of two covering the width, times warps
    (blocks that would leave a thread fewer than 2 elements waste lanes and are dropped);
    then flat blocks over rows x cols, where a block may span rows."""
    widest = max(BLOCKS[0], triton.next_power_of_2(case["cols"]))
    configs = [{"BLOCK": b, "num_warps": w} for b in BLOCKS if b <= widest for w in WARPS
               if b // (32 * w) >= 2]
    configs += [{"BLOCK": b, "num_warps": w, "FLAT": True} for b in FLAT_BLOCKS
                for w in (4, 8) if b <= max(BLOCKS[0], case["rows"] * case["cols"])]
    return configs


def _halves(inputs: tuple, cols: int) -> tuple:
    if len(inputs) == 2:
        return inputs
    (gate_up,) = inputs
    return gate_up[..., :cols], gate_up[..., cols:]


def gated_act_forward(*inputs, out, act: str = "silu", BLOCK: int = 1024,
                      num_warps: int = 4, FLAT: bool = False) -> None:
    """Host wrapper: inputs (gate, up) or (gate_up,), each (rows, cols[*2]); out (rows, cols)."""
    cols = out.shape[-1]
    gate, up = _halves(inputs, cols)
    rows = gate.shape[0]
    _gated_act_forward_kernel[grid(rows, cols, BLOCK, FLAT)](
        gate, up, out, rows, gate.stride(0), gate.stride(1), up.stride(0), up.stride(1),
        out.stride(0), out.stride(1), COLS=cols, GELU_TANH=act == "gelu_tanh", BLOCK=BLOCK,
        FLAT=FLAT, num_warps=num_warps)



_FORMULA = {"silu": "silu(gate) * up", "gelu_tanh": "gelu_tanh(gate) * up"}

_FORWARD_SEPARATE = '''\
def forward(gate, up, *, out, **params) -> None:
    """gate, up, out: (rows, COLS) or (..., COLS) with the same leading shape."""
    _check_params(params)
    _check_shapes(gate, out)
    _check_shapes(up, out)
    _launch(_rows(gate), _rows(up), out.view(-1, COLS))
'''

_FORWARD_PACKED = '''\
def forward(gate_up, *, out, **params) -> None:
    """gate_up: (..., 2 * COLS), Phi-3's fused projection; out: (..., COLS). Reads the two
    halves in place (chunk(2) of HF is a view too), so nothing is copied."""
    _check_params(params)
    if (gate_up.shape[-1] != 2 * COLS or out.shape[-1] != COLS
            or gate_up.shape[:-1] != out.shape[:-1]):
        raise ValueError(f"expected gate_up (..., {2 * COLS}) matching out (..., {COLS}), "
                         f"got {tuple(gate_up.shape)} and {tuple(out.shape)}")
    gate_up = _rows(gate_up, 2 * COLS)
    _launch(gate_up[:, :COLS], gate_up[:, COLS:], out.view(-1, COLS))
'''

_HELPERS = '''\
def _check_params(params):
    if params and params != BAKED_PARAMS:
        raise ValueError(f"specialised for {BAKED_PARAMS}, called with {params}")


def _check_shapes(x, out):
    if x.shape[-1] != COLS or x.shape != out.shape:
        raise ValueError(f"expected (..., {COLS}) inputs shaped like out, "
                         f"got {tuple(x.shape)} and {tuple(out.shape)}")


def _rows(x, width=COLS):
    """A (rows, width) view; reshape copies only when the leading dims cannot be merged."""
    return x.reshape(-1, width)


def _launch(gate, up, out):
    rows = gate.shape[0]
    grid = (cdiv(rows * COLS, BLOCK),) if FLAT else (rows, cdiv(COLS, BLOCK))
    _kernel(grid, gate, up, out, rows, gate.stride(0), gate.stride(1), up.stride(0),
            up.stride(1), out.stride(0), out.stride(1))
'''


def render(config: dict, case: Case) -> str:
    cols, act, layout = case["cols"], case["act"], case["layout"]
    block, warps, flat = config["BLOCK"], config["num_warps"], config.get("FLAT", False)
    launch = (f"{block} elements of the flat rows x cols index" if flat
              else f"(row, {block}-column block)")
    header = textwrap.dedent(f'''\
        """Gated MLP activation candidate: out = {_FORMULA[act]} ({layout} layout).

        Generated by codegen.gated_act.kernel.render. Computes in fp32, rounds once to the
        output dtype. Specialised for cols={cols}; tuned for {case["rows"]} rows of {case["dtype"]}.
        Launch: one program per {launch}, {warps} warps.
        case:   {json.dumps(case)}
        config: {json.dumps(config)}
        """

        import triton
        import triton.language as tl

        from codegen.launch import cdiv, launcher

        COLS = {cols}
        GELU_TANH = {act == "gelu_tanh"}
        BLOCK = {block}
        FLAT = {flat}
        NUM_WARPS = {warps}
        BAKED_PARAMS = {{"act": {act!r}}}
        ''')
    forward = _FORWARD_PACKED if layout == "packed" else _FORWARD_SEPARATE
    bind = ("_kernel = launcher(_gated_act_forward_kernel, COLS=COLS, GELU_TANH=GELU_TANH, "
            "BLOCK=BLOCK,\n                   FLAT=FLAT, num_warps=NUM_WARPS)\n")
    return "\n\n".join([header, kernel_source(_gated_act_forward_kernel), bind, _HELPERS,
                        forward])

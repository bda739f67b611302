"""Triton RMSNorm: one program normalises ROWS rows held whole in registers.

A row is loaded once as a [ROWS, BLOCK] tile (BLOCK = next power of two of hidden), reduced in
fp32 and written once: the kernel moves the minimum bytes. Several rows per program pay off for
narrow rows (hidden <= ~1024), where one row alone leaves most lanes of a warp idle.

All arithmetic runs in fp32 on values loaded and converted explicitly; only loads and stores
touch the storage dtype, which also keeps the kernel exact under Triton's CPU interpreter (it
gets arithmetic on bf16 values wrong).
"""

from __future__ import annotations

import textwrap

import triton
import triton.language as tl

from codegen.rmsnorm.reference import params
from core.family import Case
from core.source import kernel_source

# Row-wise norms hold a whole row tile in registers; past this many elements per program the
# registers spill, so larger ROWS x BLOCK tiles are not worth timing.
MAX_TILE = 16384
WARPS = (1, 2, 4, 8, 16)
ROWS_PER_PROGRAM = (1, 2, 4)
PER_THREAD = (4, 32)


@triton.jit
def _rms_norm_forward_kernel(X, W, Y, n_rows, x_row_stride, y_row_stride, eps,
                             HIDDEN: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
                             OFFSET: tl.constexpr, CAST_FIRST: tl.constexpr,
                             PDL: tl.constexpr = False):
    # int64 row offsets: rows * stride passes 2**31 at a few million tokens of a wide model.
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    col_ok = cols < HIDDEN
    mask = (rows < n_rows)[:, None] & col_ok[None, :]
    if PDL:  # codegen/pdl.py: the weight is no kernel's output; the rows are the step's
        scale = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32) + OFFSET
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    x = tl.load(X + rows[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    if not PDL:  # where it always was: with PDL off the kernel compiles as before
        scale = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32) + OFFSET
    variance = tl.sum(x * x, axis=1) / HIDDEN
    normed = x * tl.math.rsqrt(variance + eps)[:, None]
    if CAST_FIRST:
        # Llama rounds the normalised row to the storage dtype before the weight multiply.
        normed = normed.to(Y.dtype.element_ty).to(tl.float32)
    y = normed * scale[None, :]
    tl.store(Y + rows[:, None] * y_row_stride + cols[None, :], y.to(Y.dtype.element_ty),
             mask=mask)


def block_for(hidden: int) -> int:
    return triton.next_power_of_2(hidden)


def row_search_space(rows: int, hidden: int) -> list[dict]:
    """Launch shapes for a row-wise norm: rows per program x warps, kept to those that give
    each thread between 4 and 32 elements (fewer wastes lanes and issue slots on short vector
    loads, more spills registers); at most a dozen shapes for any row width."""
    block = block_for(hidden)
    configs, fallback = [], []
    for rpp in ROWS_PER_PROGRAM:
        if rpp > 1 and (rpp > rows or rpp * block > MAX_TILE):
            continue
        for warps in WARPS:
            per_thread = rpp * block / (32 * warps)
            config = {"rows_per_program": rpp, "num_warps": warps}
            in_window = PER_THREAD[0] <= per_thread <= PER_THREAD[1]
            (configs if in_window else fallback).append((per_thread, config))
    if not configs:
        # Very narrow or very wide rows: take the single shape closest to the window.
        lo, hi = PER_THREAD
        configs = [min(fallback, key=lambda pc: lo - pc[0] if pc[0] < lo else pc[0] - hi)]
    return [c for _, c in configs]


def search_space(case: Case) -> list[dict]:
    return row_search_space(case["rows"], case["hidden"])


def rms_norm_forward(x, weight, *, out, eps: float, offset: float = 0.0,
                     cast_first: bool = True, rows_per_program: int = 1,
                     num_warps: int = 4) -> None:
    """Host wrapper: x and out are (rows, hidden) with unit column stride."""
    rows, hidden = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    grid = (triton.cdiv(rows, rows_per_program),)
    _rms_norm_forward_kernel[grid](
        x, weight.contiguous(), out, rows, x.stride(0), out.stride(0), eps,
        HIDDEN=hidden, BLOCK=block_for(hidden), ROWS=rows_per_program, OFFSET=float(offset),
        CAST_FIRST=bool(cast_first), num_warps=num_warps)


def launch_summary(config: dict, hidden: int) -> str:
    rpp, warps = config["rows_per_program"], config["num_warps"]
    return f"{rpp} row(s) per program, {warps} warps, one [{rpp}, {block_for(hidden)}] tile"



def params_check_source(baked: dict) -> str:
    """A guard for rendered files: a candidate is specialised to its case's scalar params, and
    calling it with others must fail loudly rather than compute a different norm."""
    return textwrap.dedent(f"""\
        BAKED_PARAMS = {baked!r}


        def _check_params(params):
            if params and params != BAKED_PARAMS:
                raise ValueError(f"specialised for {{BAKED_PARAMS}}, called with {{params}}")
        """)


def render_header(title: str, config: dict, case: Case) -> str:
    """Docstring and baked constants shared by the RMSNorm-form candidates (plain and fused
    residual add): what a reader of the generated file needs first."""
    hidden = case["hidden"]
    baked = params(case)
    form = "Llama (cast, then weight)" if baked["cast_first"] else "Gemma (weight, then cast)"
    return textwrap.dedent(f'''\
        """{title} candidate, {form} form, offset {baked["offset"]}.

        Specialised for hidden={hidden}, dtype={case["dtype"]}, eps={baked["eps"]!r}.
        Tuned for {case["rows"]} rows: {launch_summary(config, hidden)}.
        """

        import triton
        import triton.language as tl

        from codegen.launch import cdiv, launcher

        HIDDEN = {hidden}
        BLOCK = {block_for(hidden)}
        ROWS_PER_PROGRAM = {config["rows_per_program"]}
        NUM_WARPS = {config["num_warps"]}
        EPS = {baked["eps"]!r}
        OFFSET = {baked["offset"]!r}
        CAST_FIRST = {baked["cast_first"]!r}
        ''')


def render(config: dict, case: Case) -> str:
    baked = params(case)
    header = render_header("RMSNorm", config, case)
    forward = textwrap.dedent('''\
        def forward(x, weight, *, out, **params):
            """x, out: (rows, HIDDEN); weight: (HIDDEN,). Writes RMSNorm(x) into out."""
            _check_params(params)
            if x.dim() != 2 or x.shape[1] != HIDDEN or out.shape != x.shape:
                raise ValueError(f"expected x and out of shape (rows, {HIDDEN}), "
                                 f"got {tuple(x.shape)} and {tuple(out.shape)}")
            if out.stride(1) != 1:
                raise ValueError("out must have unit column stride")
            if x.stride(1) != 1:
                x = x.contiguous()
            n_rows = x.shape[0]
            grid = (cdiv(n_rows, ROWS_PER_PROGRAM),)
            _launch(grid, x, weight.contiguous(), out, n_rows, x.stride(0), out.stride(0), EPS)


        _launch = launcher(_rms_norm_forward_kernel, HIDDEN=HIDDEN, BLOCK=BLOCK,
                           ROWS=ROWS_PER_PROGRAM, OFFSET=OFFSET, CAST_FIRST=CAST_FIRST,
                           num_warps=NUM_WARPS)
        ''')
    return "\n".join([header, params_check_source(baked), "",
                      kernel_source(_rms_norm_forward_kernel), "", forward])

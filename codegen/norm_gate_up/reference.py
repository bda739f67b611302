"""A decoder layer's post-attention RMSNorm (with the residual add before it, where the layer
does that add) followed by its gated MLP's gate and up projections with the activation and
the multiply, as HF runs them, and the case side of the family.

A case: `rows` tokens (at most MAX_ROWS: a decode step) of width `hidden`, `cols` the
intermediate size, `act` (silu, gelu_tanh), `residual` (whether the residual add comes
first), the norm's form (eps, offset, cast_first); `row_stride` (edge cases) makes x a column
slice of wider rows. The inputs are (x, norm_weight, w_gate, w_up[, residual]): x the
attention's output (or, without the add, the norm's input), the residual the layer's input.
The outputs (normed, h[, total]): the norm's output, act(normed Wg^T) * (normed Wu^T) (what
the MLP hands down_proj), and residual + x, the residual stream the layer returns after the
MLP's add. The kernel writes total and normed too: the layer keeps adding into total, and
whatever reads normed reads HF's values.
"""

from __future__ import annotations

import torch

from codegen.dtypes import element_size, random_normal, torch_dtype
from codegen.gated_act.reference import ACTS
from codegen.gated_act.reference import flops as activation_flops
from codegen.matmul_epilogue.reference import gated_gemm
from codegen.rmsnorm.reference import FORMS, rms_norm
from core.family import Case, distinct

# Every program re-reads x's rows (and the residual's) from L2 before its GEMV: cheap for a
# decode step's few rows, not for more (the b1-4 range)
MAX_ROWS = 4
PARAM_KEYS = ("eps", "offset", "cast_first", "act")


def make_case(rows: int, hidden: int, cols: int, dtype: str, act: str = "silu", *,
              residual: bool = True, form: str = "llama", eps: float = 1e-6) -> Case:
    if not 1 <= int(rows) <= MAX_ROWS:
        raise ValueError(f"a norm + gate/up case has 1 to {MAX_ROWS} rows, got {rows}")
    if act not in ACTS:
        raise ValueError(f"unsupported gated activation {act!r}; known: {', '.join(ACTS)}")
    return {"rows": int(rows), "hidden": int(hidden), "cols": int(cols), "dtype": dtype,
            "act": act, "residual": bool(residual), "eps": float(eps), **FORMS[form]}


def params(case: Case) -> dict:
    return {key: case[key] for key in PARAM_KEYS}


def norm_gate_up(x, norm_weight, w_gate, w_up, residual=None, *, eps: float,
                 offset: float = 0.0, cast_first: bool = True, act: str = "silu"):
    """(normed, h[, total]): the layer's `residual + hidden_states` where there is a residual,
    its post_attention_layernorm, then what the MLP hands down_proj (matmul_epilogue's
    reference: HF's act_fn(gate_proj(x)) * up_proj(x), op for op)."""
    total = x if residual is None else residual + x
    normed = rms_norm(total, norm_weight, eps=eps, offset=offset, cast_first=cast_first)
    h = gated_gemm(normed, w_gate, w_up, act)
    return (normed, h) if residual is None else (normed, h, total)


def make_inputs(case: Case, device="cpu", generator=None) -> tuple:
    """(x, norm_weight, w_gate, w_up[, residual]): weights scaled by hidden**-0.5 as trained
    ones are, the norm's around 1 (Llama's form) or 0 (Gemma's); x a column slice of wider
    rows where `row_stride` > hidden; the residual contiguous, as the layer's input is."""
    rows, hidden, cols, dtype = case["rows"], case["hidden"], case["cols"], case["dtype"]
    x = random_normal((rows, case.get("row_stride", hidden)), device, generator, dtype,
                      1.0)[:, :hidden]
    dev = generator.device if generator is not None else "cpu"
    noise = torch.randn((hidden,), generator=generator, device=dev) * 0.1
    nw = (1.0 - case["offset"] + noise).to(device=device, dtype=torch_dtype(dtype))
    w_gate = random_normal((cols, hidden), device, generator, dtype, hidden ** -0.5)
    w_up = random_normal((cols, hidden), device, generator, dtype, hidden ** -0.5)
    if not case["residual"]:
        return x, nw, w_gate, w_up
    return x, nw, w_gate, w_up, random_normal((rows, hidden), device, generator, dtype, 2.0)


def make_out(case: Case, inputs: tuple) -> tuple:
    x, rows, hidden = inputs[0], case["rows"], case["hidden"]
    normed = torch.empty((rows, hidden), dtype=x.dtype, device=x.device)
    h = torch.empty((rows, case["cols"]), dtype=x.dtype, device=x.device)
    if not case["residual"]:
        return normed, h
    return normed, h, torch.empty((rows, hidden), dtype=x.dtype, device=x.device)


def order_bound(x, norm_weight, w_gate, w_up, residual=None, *, eps: float, offset: float = 0.0,
                cast_first: bool = True, act: str = "silu", reference=None) -> tuple:
    """h: matmul_epilogue's bound (both products' orders through the activation) over the
    reference's normed x; normed and total: None, the tolerance table alone (total is one
    rounded add; normed moves by an ulp where rstd's sum runs in another order)."""
    from codegen.matmul_epilogue.reference import order_bound as gated_bound

    total = x if residual is None else residual + x
    normed = rms_norm(total, norm_weight, eps=eps, offset=offset, cast_first=cast_first)
    bound = gated_bound(normed, w_gate, w_up, act=act)
    return (None, bound) if residual is None else (None, bound, None)


def edge_cases(case: Case) -> list[Case]:
    """hidden, cols, the activation, the residual and the norm's form are baked into a
    candidate; the rows stay free up to MAX_ROWS: one row, a prime count, MAX_ROWS itself, x
    as a column slice of wider rows."""
    return distinct(case, [{**case, "rows": 1}, {**case, "rows": 3},
                           {**case, "rows": MAX_ROWS},
                           {**case, "rows": 2, "row_stride": case["hidden"] + 64}])


def min_bytes(case: Case) -> int:
    """x (and the residual) read once, the norm's and both projections' weights once, normed,
    h (and total) written once."""
    rows, hidden, cols = case["rows"], case["hidden"], case["cols"]
    streams = 2 + (2 if case["residual"] else 0)  # x, normed (+ residual, total)
    return (streams * rows * hidden + hidden + 2 * cols * hidden + rows * cols) \
        * element_size(case)


def flops(case: Case) -> int:
    """The two GEMMs, the activation and product, the norm (and the add)."""
    rows, hidden, cols = case["rows"], case["hidden"], case["cols"]
    act = activation_flops({"rows": rows, "cols": cols, "act": case["act"]})
    return 4 * rows * hidden * cols + act + (5 if case["residual"] else 4) * rows * hidden

"""The gated MLP's gate and up projections with the activation and multiply, as Hugging Face
computes them, and the case side of the family.

What HF's MLP hands down_proj, in every form this family covers:

- Llama/Qwen2/Mistral (`LlamaMLP`): `act_fn(gate_proj(x)) * up_proj(x)`, SiLU (SwiGLU);
- Gemma (`GemmaMLP`): the same with `gelu_pytorch_tanh` (GeGLU);
- Phi-3 (`Phi3MLP`): `gate, up = gate_up_proj(x).chunk(2)`, `up * act(gate)`; the gate and
  up weights are the first and second halves of gate_up_proj's rows, and the product commutes
  bit for bit, so the same function with `w_gate = W[:cols]`, `w_up = W[cols:]` reproduces it.

In half precision HF rounds four times (gate, up, the activation, the product), each step in
the storage dtype; the reference repeats that literally, so it is bitwise the modules' own
result (tests check it). The fused kernel rounds once, from fp32 accumulators.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from codegen.dtypes import element_size, random_normal
from codegen.gated_act.reference import ACTS, activation
from codegen.gated_act.reference import flops as activation_flops
from codegen.shapes import lead_key, lead_of, with_rows
from core.family import Case, distinct
from models.patching import same_storage

# The largest row block (BM) in kernel.search_space; kernel.py checks it agrees. Lives here
# because edge cases must go just past it without importing the kernel (which applies
# @triton.jit, see core.family.lazy).
MAX_BLOCK_M = 128


def gated_gemm(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
               act: str = "silu") -> torch.Tensor:
    """act(x @ w_gate^T) * (x @ w_up^T): x (..., hidden), w_gate and w_up (cols, hidden).
    Where the two are the row halves of one weight, as Phi3MLP runs it: one GEMM, then the
    product on the strided column halves of its output. This is also the timing baseline: run
    as two GEMMs and a product on contiguous tensors it would take several times what
    gated_act's baseline (the strided product Phi3MLP runs) takes, and the two families' savings
    would be taken against different baselines, handing gated_act the MLPs."""
    packed = packed_weight(w_gate, w_up)
    if packed is not None:
        gate, up = F.linear(x, packed).chunk(2, dim=-1)
        return up * activation(gate, act)
    return activation(F.linear(x, w_gate), act) * F.linear(x, w_up)


def packed_weight(w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor | None:
    """The (2 * cols, hidden) weight whose first and second row halves are `w_gate` and `w_up`
    (contiguous, up right after gate in one storage), or None."""
    if w_gate.shape != w_up.shape or w_gate.dim() != 2 or not w_gate.is_contiguous() \
            or not w_up.is_contiguous() \
            or not same_storage(w_gate, w_up) \
            or w_up.storage_offset() != w_gate.storage_offset() + w_gate.numel():
        return None
    return w_gate.as_strided((2 * w_gate.shape[0], w_gate.shape[1]), w_gate.stride(),
                             w_gate.storage_offset())


# The largest slope of silu (1.0998 at x = 2.40) and of tanh-GELU (1.1289 at x = 1.5), rounded up.
MAX_SLOPE = 1.13
FP32_UNIT = 2.0 ** -24  # unit roundoff of the fp32 accumulators


def order_bound(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                act: str = "silu", reference: tuple | None = None) -> dict:
    """Per output element (inputs in float64), how far any fp32-accumulated implementation may
    land from the exact value: the classic dot-product bound K u / (1 - K u) * sum |x_k w_k| for
    gate and for up, carried through the activation (slope <= MAX_SLOPE) and the product, plus
    an fp32 epilogue's rounding (2^-20 relative, 16 ulps). HF's own result obeys it as the
    kernel does; which of the two lands closer at a cancelling element is the order's luck
    (verify/tolerances.py; the verifier lets the bound excuse only a few elements, and only
    when the errors match HF's in distribution). "overflow": where sum |x_k w_k| passes fp32's
    largest value, so the accumulator may overflow in one order and not in another (the
    verifier's "large" x). `reference` (the float64 product) is not used: the bound needs gate
    and up apart."""
    k = x.shape[-1] * FP32_UNIT
    gamma = k / (1 - k)
    mag_gate, mag_up = x.abs() @ w_gate.abs().T, x.abs() @ w_up.abs().T
    gate, up = x @ w_gate.T, x @ w_up.T
    d_gate, d_up = gamma * mag_gate, gamma * mag_up
    act_gate = activation(gate, act)
    bound = (MAX_SLOPE * d_gate * (up.abs() + d_up) + act_gate.abs() * d_up
             + 2.0 ** -20 * ((act_gate * up).abs() + MAX_SLOPE * gate.abs() * up.abs()))
    top = torch.finfo(torch.float32).max
    overflow = ((mag_gate >= top) | (mag_up >= top)) & mag_gate.isfinite() & mag_up.isfinite()
    return {"bound": bound, "overflow": overflow}


def make_case(rows: int, hidden: int, cols: int, dtype: str, act: str, *, lead=None,
              weights: str | None = None) -> Case:
    """`rows` tokens of width `hidden` in, `cols` (the intermediate size) out. What the adapter
    hands the kernel, when given: `lead`, the leading shape of x and out (the model passes
    (batch, seq, hidden)); `weights` "packed" where w_gate and w_up are the two row halves of
    one (2 * cols, hidden) weight (Phi-3's gate_up_proj: w_up at storage offset cols * hidden)."""
    if act not in ACTS:
        raise ValueError(f"unsupported gated activation {act!r}; known: {', '.join(ACTS)}")
    case = {"rows": int(rows), "hidden": int(hidden), "cols": int(cols), "dtype": dtype,
            "act": act}
    if lead is not None:
        case["lead"] = lead_key(lead, rows)
    if weights is not None:
        if weights != "packed":
            raise ValueError(f"unknown weight layout {weights!r}; known: packed")
        case["weights"] = weights
    return case


def params(case: Case) -> dict:
    """The keyword params a candidate's forward and the reference take for `case`."""
    return {"act": case["act"]}


def make_inputs(case: Case, device="cpu", generator=None) -> tuple:
    """(x, w_gate, w_up). Weights scaled by hidden**-0.5 as trained (and initialised) ones
    are, so gate and up keep the spread of x whatever the width; x of standard deviation 2, so
    gate reaches both tails of the activation. A `row_stride` wider than `hidden` makes x a
    column slice of wider rows (a slice of a fused buffer, a strided view)."""
    hidden, cols, dtype = case["hidden"], case["cols"], case["dtype"]
    stride = case.get("row_stride", hidden)
    x = random_normal((*lead_of(case), stride), device, generator, dtype, 2.0)[..., :hidden]
    if case.get("weights") == "packed":
        w = random_normal((2 * cols, hidden), device, generator, dtype, hidden ** -0.5)
        return x, w[:cols], w[cols:]
    w_gate = random_normal((cols, hidden), device, generator, dtype, hidden ** -0.5)
    w_up = random_normal((cols, hidden), device, generator, dtype, hidden ** -0.5)
    return x, w_gate, w_up


def make_out(case: Case, inputs: tuple) -> torch.Tensor:
    x = inputs[0]
    return torch.empty((*lead_of(case), case["cols"]), dtype=x.dtype, device=x.device)


def edge_cases(case: Case) -> list[Case]:
    """Variations a candidate rendered for `case` must survive. HIDDEN and COLS are baked into
    it (the dispatcher only sends it those widths), so edges vary what stays free at run time,
    the rows: one row (decode at batch 1), a prime count (no block divides it), one row past the
    largest row block (a second, one-row block, masked), and x as a column slice of wider rows
    (its row stride is not its width)."""
    cases = [
        with_rows(case, 1, "1x1"),
        with_rows(case, 37, "1x37"),
        with_rows(case, MAX_BLOCK_M + 1, f"1x{MAX_BLOCK_M + 1}"),
        {**with_rows(case, 5, "1x5"), "row_stride": case["hidden"] + 64},
    ]
    return distinct(case, cases)


def min_bytes(case: Case) -> int:
    """Read x and both weights once, write the product once."""
    rows, hidden, cols = case["rows"], case["hidden"], case["cols"]
    return (rows * hidden + 2 * cols * hidden + rows * cols) * element_size(case)


def flops(case: Case) -> int:
    """Two GEMMs (2 flops per multiply-add each), then the activation and the multiply per
    output element, counted as codegen.gated_act counts them."""
    return 4 * case["rows"] * case["hidden"] * case["cols"] + activation_flops(case)

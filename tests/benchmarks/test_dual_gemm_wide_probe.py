"""benchmarks/probes/dual_gemm_wide.py's kernel, checked on the CPU before any GPU time goes to
it: one dot over both weights, read through a three-dimensional descriptor whose leading stride
is the distance between the two tensors, gives act(gate) * up whichever weight lies first in
memory (the interpreter runs the same descriptor arithmetic on host memory)."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "probes"))
from dual_gemm_wide import _inputs, reference, wide  # noqa: E402


@pytest.mark.parametrize("up_first", [False, True])
@pytest.mark.parametrize("dtype, act, tol", [(torch.float32, "silu", 1e-4),
                                             (torch.float16, "gelu_tanh", 2e-2)])
def test_one_dot_over_both_weights_gives_the_gated_product(up_first, dtype, act, tol):
    x, w_gate, w_up = _inputs(70, 80, 72, dtype, "cpu", up_first)
    assert (w_up.data_ptr() < w_gate.data_ptr()) == up_first
    ref = reference(x, w_gate, w_up, act)
    out = torch.zeros(70, 72, dtype=dtype)
    wide(x, w_gate, w_up, out, act, 32, 32, 32, 4, 2)  # rows, cols and hidden past a tile
    assert (out.double() - ref).abs().max().item() < tol
    swapped = torch.zeros_like(out)  # the roles matter: act(up) * gate is another product
    wide(x, w_up, w_gate, swapped, act, 32, 32, 32, 4, 2)
    assert (swapped.double() - ref).abs().max().item() > 10 * tol

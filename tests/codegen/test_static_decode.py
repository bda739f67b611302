"""Every decode-relevant family's adapter reaches the model inside a static-cache decode step
(models.graphs.StaticDecoder, the step the graphs stage captures), run eagerly on the CPU: the
family's kernel is called in the step, and the step's logits (two steps: the second reads what
the first wrote) match the unpatched decoder's."""

from __future__ import annotations

import importlib

import pytest
import torch
from family_checks import CountingChooser

from models.graphs import StaticDecoder
from profiling.loader import build, resolve

# family -> kernel calls in one tiny-llama step (2 layers): per layer two norms (add_rmsnorm
# fuses the second with the residual add) and the final norm, one rotary, one MLP, one append
CALLS_PER_STEP = {"rmsnorm": 5, "add_rmsnorm": 2, "rope": 2, "gated_act": 2,
                  "matmul_epilogue": 2, "kv_cache": 2}
PROMPT = torch.randint(3, 500, (1, 6), generator=torch.Generator().manual_seed(0))
STEPS = torch.randint(3, 500, (1, 2), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build(resolve("tiny-llama"), torch.float32, "cpu").eval()


def _steps(model, chooser=None) -> list[torch.Tensor]:
    dec = StaticDecoder(model, 1, PROMPT.shape[1] + 4, graph=False)
    dec.prefill(PROMPT)
    if chooser is not None:  # count the steps' calls only (the prefill has its own cases)
        chooser.calls, chooser.cases = 0, []
    out = [dec.step(STEPS[:, i:i + 1]).clone() for i in range(STEPS.shape[1])]
    assert dec.position == PROMPT.shape[1] + STEPS.shape[1]
    return out


@pytest.mark.parametrize("name", sorted(CALLS_PER_STEP))
def test_family_kernel_runs_in_a_static_decode_step(model, name, tmp_path):
    family = importlib.import_module(f"codegen.{name}").FAMILY
    want = _steps(model)
    chooser = CountingChooser(family, tmp_path)
    undo = family.patch(model, chooser)
    try:
        got = _steps(model, chooser)
    finally:
        undo()
    assert chooser.calls == STEPS.shape[1] * CALLS_PER_STEP[name], chooser.distinct_cases()
    # one-token cases: rows or seq or new positions 1
    assert all(1 in (c.get("rows"), c.get("seq"), c.get("new")) for c in chooser.cases)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)

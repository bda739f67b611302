"""Every adapter keeps the model's own code where no kernel applies: when the chooser declines a
case (a shape or workload where the kernel was rejected), and when autograd needs the graph."""

from __future__ import annotations

import pytest
import torch
from family_checks import DEVICE, CountingChooser

from codegen.gated_act import FAMILY as GATED_ACT
from codegen.gelu import FAMILY as GELU
from codegen.kv_cache import FAMILY as KV_CACHE
from codegen.rmsnorm import FAMILY as RMSNORM
from codegen.rope import FAMILY as ROPE
from profiling.loader import build, resolve

# (family, model, calls one forward of batch 2 x seq 8 makes)
# rope asks twice per layer when declined: the half-table case, then the same shape without
# the key (codegen.rope.patch.whole_table_fallback)
CASES = [(RMSNORM, "tiny-llama", 5), (GATED_ACT, "tiny-phi3", 2), (GELU, "tiny-gpt2", 2),
         (ROPE, "tiny-phi3", 4), (KV_CACHE, "tiny-llama", 2)]


@pytest.mark.parametrize("family, model_id, calls", CASES, ids=lambda c: getattr(c, "name", c))
def test_declined_cases_run_the_original_code(family, model_id, calls, tmp_path):
    model = build(resolve(model_id), torch.float32, DEVICE)
    ids = torch.arange(3, 19, device=DEVICE).view(2, 8)
    with torch.no_grad():
        before = model(ids).logits
        chooser = CountingChooser(family, tmp_path, give=False)
        undo = family.patch(model, chooser)
        declined = model(ids).logits
    undo()
    assert len(chooser.cases) == calls and chooser.calls == 0
    assert torch.equal(declined, before)


@pytest.mark.parametrize("family, model_id, calls", CASES, ids=lambda c: getattr(c, "name", c))
def test_autograd_falls_back_to_the_original_code(family, model_id, calls, tmp_path):
    model = build(resolve(model_id), torch.float32, DEVICE)
    chooser = CountingChooser(family, tmp_path)
    undo = family.patch(model, chooser)
    model(torch.arange(3, 11, device=DEVICE).view(1, 8)).logits.sum().backward()
    undo()
    assert chooser.calls == 0
    assert any(p.grad is not None for p in model.parameters())
